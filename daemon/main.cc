// bytecompd: the ByteComp node daemon. See daemon/daemon.h and docs/daemon.md.
#include <signal.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <optional>
#include <string>

#include "bytecomp_build_config.h"
#include "common/error.h"
#include "common/log.h"
#include "daemon/config.h"
#include "daemon/daemon.h"
#include "common/malloc_policy.h"

namespace {
constexpr const char* kUsage =
    "usage: bytecompd [--config PATH]\n"
    "  --config PATH  daemon configuration (default: /etc/bytecomp/daemon.yaml,\n"
    "                 or $BYTECOMP_SYSCONFDIR/daemon.yaml, else built-in defaults)\n"
    "Signals: SIGTERM/SIGINT abort running jobs and exit; SIGHUP reloads the\n"
    "configuration and its drop-ins (scheduler sizes, setup timeout, strategy,\n"
    "metrics, log levels). bytecompctl queries and steers a running daemon.\n";
}  // namespace

int main(int argc, char** argv) {
  bytecomp::keep_freed_memory_for_reuse();  // large pushes and answers
  std::optional<std::string> config_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--config" && i + 1 < argc) {
      config_path = argv[++i];
    } else if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    } else if (a == "--version") {
      std::printf("bytecompd %s\n", BYTECOMP_VERSION);
      return 0;
    } else {
      std::fprintf(stderr, "bytecompd: unknown argument '%s'\n%s", a.c_str(), kUsage);
      return 2;
    }
  }
  // Signals go to the control loop through a signalfd; block them before any
  // thread starts so every thread inherits the mask.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGPIPE, SIG_IGN);
  const int sfd = signalfd(-1, &set, SFD_CLOEXEC);
  try {
    auto cfg = bytecomp::daemon::DaemonConfig::parse(
        bytecomp::config::Document::locate(config_path, "daemon.yaml"));
    // Daemon::run() tells systemd READY=1 and pings its watchdog.
    bytecomp::daemon::Daemon daemon(std::move(cfg), config_path);
    const int rc = daemon.run(sfd);
    close(sfd);
    return rc;
  } catch (const bytecomp::Error& e) {
    std::fprintf(stderr, "bytecompd: %s\n", e.what());
    return e.code() == bytecomp::ErrorCode::kConfig ? 2 : 1;
  }
}
