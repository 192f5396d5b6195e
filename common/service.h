// The service manager's notification protocol (sd_notify): readiness,
// reloads, shutdown and watchdog pings, for bytecompd and bytecomp-server
// under systemd's Type=notify (configs/*.service.in).
//
// Without NOTIFY_SOCKET in the environment (not started by systemd) or in a
// build without libsystemd (-Dsystemd=disabled) every call is a no-op.
// With WatchdogSec= the manager passes WATCHDOG_USEC; tick() then sends
// WATCHDOG=1 once half of that interval passed since the last ping, so a
// caller's loop that runs at least every poll_timeout() keeps the service
// alive, and a loop that hangs gets it restarted.
//
// Thread-safety: thread-bound (one loop owns it).
#pragma once

#include <chrono>
#include <string_view>

namespace bytecomp {

class ServiceNotifier {
 public:
  ServiceNotifier();

  void ready();
  void reloading();
  void stopping();
  void status(std::string_view text);
  // Pings the watchdog when due; cheap otherwise.
  void tick();

  bool watchdog_enabled() const { return interval_.count() > 0; }
  // The ping period (half of WatchdogSec); zero without a watchdog.
  std::chrono::microseconds interval() const { return interval_; }
  // How long the caller's loop may sleep before the next tick(): `wanted`,
  // or less when a ping falls due earlier.
  std::chrono::milliseconds poll_timeout(std::chrono::milliseconds wanted) const;

 private:
  void send(const char* text);
  std::chrono::microseconds interval_{0};
  std::chrono::steady_clock::time_point last_ping_{};
};

}  // namespace bytecomp
