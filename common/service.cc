#include "common/service.h"

#include <algorithm>
#include <string>

#include "bytecomp_build_config.h"
#include "common/log.h"
#if BYTECOMP_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

namespace bytecomp {

BC_LOG_CATEGORY(LogService, "service");

ServiceNotifier::ServiceNotifier() {
#if BYTECOMP_HAVE_SYSTEMD
  uint64_t usec = 0;
  // 0: keep WATCHDOG_USEC/WATCHDOG_PID in the environment; the daemon
  // starts no child that could mistake them for its own.
  if (sd_watchdog_enabled(0, &usec) > 0 && usec > 0) {
    interval_ = std::chrono::microseconds(usec / 2);
    BC_LOG(LogService(), kInfo) << "watchdog: pinging every " << usec / 2000 << " ms";
  }
#endif
}

void ServiceNotifier::send(const char* text) {
#if BYTECOMP_HAVE_SYSTEMD
  const int r = sd_notify(0, text);
  if (r < 0) BC_LOG(LogService(), kWarn) << "sd_notify(" << text << "): error " << -r;
#else
  (void)text;
#endif
}

void ServiceNotifier::ready() {
  send("READY=1");
  last_ping_ = std::chrono::steady_clock::now();
}

void ServiceNotifier::reloading() { send("RELOADING=1"); }

void ServiceNotifier::stopping() { send("STOPPING=1"); }

void ServiceNotifier::status(std::string_view text) {
  send(("STATUS=" + std::string(text)).c_str());
}

void ServiceNotifier::tick() {
  if (!watchdog_enabled()) return;
  const auto now = std::chrono::steady_clock::now();
  if (now - last_ping_ < interval_) return;
  send("WATCHDOG=1");
  last_ping_ = now;
}

std::chrono::milliseconds ServiceNotifier::poll_timeout(std::chrono::milliseconds wanted) const {
  if (!watchdog_enabled()) return wanted;
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      interval_ - (std::chrono::steady_clock::now() - last_ping_));
  return std::clamp(left, std::chrono::milliseconds(1), wanted);
}

}  // namespace bytecomp
