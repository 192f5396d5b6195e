// Loads a strategy file with the planner's own loader (planner/strategy.h),
// checks it against a tensor list as the CPU runtime will, and prints how
// each tensor resolves, so the Python tests can hold shipped strategies to
// the daemon's rules.
//
//   strategy_check FILE NAME:BYTES...
//   -> one line per tensor: "NAME compressed|uncompressed MODE DESCRIPTION"
//   exit 0, or 1 with the loader's message on stderr.
//   strategy_check --compressors
//   -> every compressor a strategy may name, one a line ("none" first).
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "planner/strategy/strategy.h"

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--compressors") {
    for (const auto& name : bytecomp::planner::compressor_names()) std::printf("%s\n", name.c_str());
    return 0;
  }
  if (argc < 3) {
    std::fprintf(stderr, "usage: strategy_check FILE NAME:BYTES...\n");
    return 2;
  }
  try {
    const auto s = bytecomp::planner::Strategy::load_file(argv[1]);
    std::vector<bytecomp::planner::TensorDecl> decls;
    for (int i = 2; i < argc; ++i) {
      const std::string a = argv[i];
      const auto colon = a.rfind(':');
      if (colon == std::string::npos) {
        std::fprintf(stderr, "strategy_check: '%s' is not NAME:BYTES\n", a.c_str());
        return 2;
      }
      decls.push_back({a.substr(0, colon), std::stoull(a.substr(colon + 1))});
    }
    s.check_cpu_runtime(decls);
    for (const auto& d : decls) {
      const auto& o = s.resolve(d.name, d.bytes);
      std::printf("%s %s %s %s\n", d.name.c_str(), o.compressed() ? "compressed" : "uncompressed",
                  bytecomp::planner::runtime_inter_mode(o).c_str(), o.describe().c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
