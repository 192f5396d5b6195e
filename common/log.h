// Categorised logging to stderr (journald picks it up under systemd).
//
//   BC_LOG_CATEGORY(LogTransport, "transport");
//   BC_LOG(LogTransport(), kInfo) << "listening on " << endpoint;
//
// Each category has its own level. Levels come from a spec string such as
// "info,transport=debug,server=warn" (first bare level = default for every
// category), applied from the config file's `logging:` section and then from
// the BYTECOMP_LOG environment variable, which wins. A disabled statement costs
// one relaxed atomic load: the stream expression is not evaluated.
//
// Thread-safety: everything here is thread-safe. Each line is written with a
// single write(2), so lines from threads and processes do not interleave.
// The category registry is the one process-wide object of the project: it is
// created on first use and never destroyed, so logging from static
// destructors and detached threads stays valid.
#pragma once

#include <atomic>
#include <sstream>
#include <string>
#include <string_view>

namespace bytecomp::log {

enum class Level : int { kTrace = 0, kDebug, kInfo, kWarn, kError, kOff };

// Accepts trace|debug|info|warn|warning|error|off; throws Error(kConfig) otherwise.
Level parse_level(std::string_view text);
std::string_view level_name(Level level) noexcept;

class Category {
 public:
  explicit Category(std::string name, Level level)
      : name_(std::move(name)), level_(static_cast<int>(level)) {}
  Category(const Category&) = delete;
  Category& operator=(const Category&) = delete;

  const std::string& name() const noexcept { return name_; }
  bool enabled(Level level) const noexcept {
    return static_cast<int>(level) >= level_.load(std::memory_order_relaxed);
  }
  Level level() const noexcept {
    return static_cast<Level>(level_.load(std::memory_order_relaxed));
  }
  void set_level(Level level) noexcept {
    level_.store(static_cast<int>(level), std::memory_order_relaxed);
  }

 private:
  std::string name_;
  std::atomic<int> level_;
};

// The category of that name, created on first use with the level the current
// spec gives it. References stay valid for the life of the process.
Category& category(std::string_view name);

// Applies a level spec ("info,transport=debug"). Throws Error(kConfig) naming
// the bad entry; on error no level is changed.
void configure(std::string_view spec);
// Applies BYTECOMP_LOG if set. Call after applying the config file's levels.
void configure_from_env();

// One log line; written out when destroyed.
class Line {
 public:
  Line(const Category& category, Level level);
  ~Line();
  Line(const Line&) = delete;
  Line& operator=(const Line&) = delete;
  std::ostream& stream() { return out_; }

 private:
  std::ostringstream out_;
};

}  // namespace bytecomp::log

#define BC_LOG_CATEGORY(fn, name)                                     \
  inline ::bytecomp::log::Category& fn() {                            \
    static ::bytecomp::log::Category& c = ::bytecomp::log::category(name); \
    return c;                                                         \
  }

// The for-form keeps `if (x) BC_LOG(...) << y; else ...` unambiguous.
#define BC_LOG(cat, lvl)                                                    \
  for (bool bc_log_on_ = (cat).enabled(::bytecomp::log::Level::lvl); bc_log_on_; \
       bc_log_on_ = false)                                                  \
  ::bytecomp::log::Line((cat), ::bytecomp::log::Level::lvl).stream()
