// libFuzzer target for the configuration files (common/config.h Document
// and Reader, and what each program reads with them): input byte 0 picks
// the file, the rest is its YAML text.
//   0 daemon.yaml   daemon::DaemonConfig::parse
//   1 cluster.yaml  server::read_cluster_config (cluster: and transport:)
//   2 server.yaml   server::ServerConfig::load (written to a temporary
//                   directory beside a valid cluster.yaml)
// Any bytecomp::Error is a correct rejection; a crash, a sanitizer report or
// another exception (e.g. one of yaml-cpp's) is a bug.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

#include "common/config.h"
#include "daemon/config.h"
#include "common/error.h"
#include "fuzz_common.h"
#include "server/cluster_config.h"
#include "server/ps_server.h"

namespace config = bytecomp::config;

namespace {

// A directory with a valid cluster.yaml, for server.yaml's cluster_file;
// removed when the process exits.
struct Scratch {
  std::string dir;
  Scratch() {
    const char* base = std::getenv("TMPDIR");
    dir = std::string(base && *base ? base : "/tmp") + "/bc-config-fuzz-" +
          std::to_string(::getpid());
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/cluster.yaml") << "version: 1\n"
                                            "cluster:\n"
                                            "  coordinator: 100\n"
                                            "  servers:\n"
                                            "    - {id: 100, address: 'tcp://127.0.0.1:9100'}\n";
  }
  ~Scratch() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
};

const std::string& scratch() {
  static const Scratch s;
  return s.dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    switch (data[0] % 3) {
      case 0:
        bytecomp::daemon::DaemonConfig::parse(config::Document::parse(text, "daemon.yaml"));
        break;
      case 1: {
        config::Document doc = config::Document::parse(text, "cluster.yaml");
        config::Reader root = doc.root("");
        bytecomp::server::read_cluster_config(root);
        root.finish();
        break;
      }
      case 2: {
        const std::string path = scratch() + "/server.yaml";
        std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
        bytecomp::server::ServerConfig::load(path);
        break;
      }
    }
  } catch (const bytecomp::Error&) {
  }
  return 0;
}
