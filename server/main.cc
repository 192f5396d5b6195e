// bytecomp-server --config server.yaml [--ready-file PATH]
// Runs until SIGTERM or SIGINT, then shuts down cleanly (jobs aborted with a
// reason, threads joined). SIGHUP re-reads the log levels (everything else
// needs a restart). Under systemd (Type=notify) it reports READY=1 once it
// serves and pings the watchdog from this main thread (common/service.h),
// which also writes the metrics textfile (server/metrics.h). --ready-file
// receives the bound address once the server serves (scripts and tests use
// it with ephemeral ports).
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>

#include "common/error.h"
#include "common/log.h"
#include "common/malloc_policy.h"
#include "common/service.h"
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
  sigaddset(&sigs, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  try {
    const bytecomp::server::ServerConfig server_config =
        bytecomp::server::ServerConfig::load(config_path);
    bytecomp::server::ParameterServer server(server_config);
    if (!ready_file.empty()) {
      std::string tmp = ready_file + ".tmp";
      std::ofstream(tmp) << server.addresses().at(0) << "\n";
      if (std::rename(tmp.c_str(), ready_file.c_str()) != 0)
        throw bytecomp::Error(bytecomp::ErrorCode::kUnavailable,
                              "cannot write --ready-file " + ready_file + ": " + std::strerror(errno));
    }
    bytecomp::server::MetricsTextfile metrics(server_config.metrics, server_config.node_id,
                                              [&server] { return server.metrics_text(); });
    bytecomp::ServiceNotifier notifier;
    notifier.ready();
    int sig = 0;
    for (;;) {
      notifier.tick();
      const auto wait = notifier.poll_timeout(
          std::min(std::chrono::milliseconds(1000), metrics.tick()));
      const timespec ts{static_cast<time_t>(wait.count() / 1000),
                        static_cast<long>(wait.count() % 1000) * 1000000L};
      sig = sigtimedwait(&sigs, nullptr, &ts);
      if (sig == SIGHUP) {
        notifier.reloading();
        try {
          // Parsing applies the logging section; the rest is not re-applied.
          (void)bytecomp::server::ServerConfig::load(config_path);
          BC_LOG(LogMain(), kInfo) << "SIGHUP: log levels reloaded; other changes to the "
                                      "configuration need a restart";
        } catch (const bytecomp::Error& e) {
          BC_LOG(LogMain(), kError) << "SIGHUP: configuration not reloaded: " << e.what();
        }
        notifier.ready();
      } else if (sig == SIGTERM || sig == SIGINT) {
        break;
      }
    }
    notifier.stopping();
    BC_LOG(LogMain(), kInfo) << "received " << (sig == SIGTERM ? "SIGTERM" : "SIGINT")
                             << ", shutting down";
    server.shutdown();
    // The final counts, for whoever reads the file after the server stopped.
    metrics.write_now();
  } catch (const bytecomp::Error& e) {
    std::fprintf(stderr, "bytecomp-server: %s\n", e.what());
    return 1;
  }
  return 0;
}
