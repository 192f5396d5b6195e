// bytecomp-server --config server.yaml [--ready-file PATH]
// Runs until SIGTERM or SIGINT, then shuts down cleanly (jobs aborted with a
// reason, threads joined). --ready-file receives the bound address once the
// server serves (scripts and tests use it with ephemeral ports).
#include <signal.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>

#include "common/error.h"
#include "common/log.h"
#include "common/malloc_policy.h"
#include "server/ps_server.h"

BC_LOG_CATEGORY(LogMain, "server");

int main(int argc, char** argv) {
  bytecomp::keep_freed_memory_for_reuse();
  std::optional<std::string> config_path;
  std::string ready_file;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if ((a == "--config" || a == "--ready-file") && i + 1 < argc) {
      (a == "--config" ? *(config_path = std::string()) : ready_file) = argv[++i];
    } else if (a == "--help" || a == "-h") {
      std::printf("usage: %s --config server.yaml [--ready-file PATH]\n", argv[0]);
      return 0;
    } else {
      std::fprintf(stderr, "bytecomp-server: unknown argument '%s' (see --help)\n", a.c_str());
      return 2;
    }
  }
  // Block the signals before any thread starts so only sigwait() sees them.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  try {
    bytecomp::server::ParameterServer server(bytecomp::server::ServerConfig::load(config_path));
    if (!ready_file.empty()) {
      std::string tmp = ready_file + ".tmp";
      std::ofstream(tmp) << server.addresses().at(0) << "\n";
      if (std::rename(tmp.c_str(), ready_file.c_str()) != 0)
        throw bytecomp::Error(bytecomp::ErrorCode::kUnavailable,
                              "cannot write --ready-file " + ready_file + ": " + std::strerror(errno));
    }
    int sig = 0;
    sigwait(&sigs, &sig);
    BC_LOG(LogMain(), kInfo) << "received " << (sig == SIGTERM ? "SIGTERM" : "SIGINT")
                             << ", shutting down";
    server.shutdown();
  } catch (const bytecomp::Error& e) {
    std::fprintf(stderr, "bytecomp-server: %s\n", e.what());
    return 1;
  }
  return 0;
}
