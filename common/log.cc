#include "common/log.h"

#include <sys/time.h>
#include <unistd.h>

#include <cstdlib>
#include <ctime>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "common/error.h"

namespace bytecomp::log {
namespace {

struct Spec {
  Level default_level = Level::kInfo;
  std::map<std::string, Level, std::less<>> per_category;

  Level level_for(std::string_view name) const {
    auto it = per_category.find(name);
    return it == per_category.end() ? default_level : it->second;
  }
};

struct Registry {
  std::mutex mu;
  Spec spec;
  std::map<std::string, std::unique_ptr<Category>, std::less<>> categories;
};

Registry& registry() {
  // Intentionally leaked: see log.h.
  static Registry* r = new Registry;
  return *r;
}

Spec parse_spec(std::string_view text, Spec base) {
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t end = text.find(',', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view item = text.substr(pos, end - pos);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    if (!item.empty()) {
      size_t eq = item.find('=');
      if (eq == std::string_view::npos) {
        base.default_level = parse_level(item);
      } else {
        std::string_view name = item.substr(0, eq);
        if (name.empty())
          throw Error(ErrorCode::kConfig,
                      "log spec entry '" + std::string(item) +
                          "' has no category name before '='");
        base.per_category[std::string(name)] = parse_level(item.substr(eq + 1));
      }
    }
    pos = end + 1;
  }
  return base;
}

}  // namespace

Level parse_level(std::string_view t) {
  if (t == "trace") return Level::kTrace;
  if (t == "debug") return Level::kDebug;
  if (t == "info") return Level::kInfo;
  if (t == "warn" || t == "warning") return Level::kWarn;
  if (t == "error") return Level::kError;
  if (t == "off") return Level::kOff;
  throw Error(ErrorCode::kConfig,
              "unknown log level '" + std::string(t) +
                  "' (accepted: trace, debug, info, warn, error, off)");
}

std::string_view level_name(Level level) noexcept {
  switch (level) {
    case Level::kTrace: return "TRACE";
    case Level::kDebug: return "DEBUG";
    case Level::kInfo: return "INFO";
    case Level::kWarn: return "WARN";
    case Level::kError: return "ERROR";
    case Level::kOff: return "OFF";
  }
  return "?";
}

Category& category(std::string_view name) {
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  auto it = r.categories.find(name);
  if (it != r.categories.end()) return *it->second;
  auto c = std::make_unique<Category>(std::string(name), r.spec.level_for(name));
  Category& ref = *c;
  r.categories.emplace(std::string(name), std::move(c));
  return ref;
}

void configure(std::string_view text) {
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  Spec spec = parse_spec(text, r.spec);  // throws before anything changes
  r.spec = std::move(spec);
  for (auto& [name, cat] : r.categories) cat->set_level(r.spec.level_for(name));
}

void configure_from_env() {
  const char* env = std::getenv("BYTECOMP_LOG");
  if (env == nullptr || *env == '\0') return;
  try {
    configure(env);
  } catch (const Error& e) {
    throw Error(ErrorCode::kConfig,
                std::string("environment variable BYTECOMP_LOG: ") + e.what());
  }
}

Line::Line(const Category& category, Level level) {
  timeval tv{};
  gettimeofday(&tv, nullptr);
  tm utc{};
  gmtime_r(&tv.tv_sec, &utc);
  char stamp[40];
  size_t n = strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%S", &utc);
  snprintf(stamp + n, sizeof stamp - n, ".%06ldZ", static_cast<long>(tv.tv_usec));
  out_ << stamp << " [" << getpid() << "] " << level_name(level) << ' '
       << category.name() << ": ";
}

Line::~Line() {
  try {
    out_ << '\n';
    const std::string s = out_.str();
    size_t off = 0;
    while (off < s.size()) {
      ssize_t w = ::write(STDERR_FILENO, s.data() + off, s.size() - off);
      if (w <= 0) break;  // nowhere to report a failing stderr
      off += static_cast<size_t>(w);
    }
  } catch (...) {
    // Never throw from a destructor; a lost log line is the lesser harm.
  }
}

}  // namespace bytecomp::log
