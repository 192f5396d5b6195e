#include "common/prometheus.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "common/error.h"

namespace bytecomp::prom {

namespace {

std::string num_text(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 9e15) return std::to_string(static_cast<int64_t>(v));
  char b[32];
  std::snprintf(b, sizeof b, "%.9g", v);
  return b;
}

}  // namespace

std::string label_value(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

PromText& PromText::family(const char* name, const char* type, const char* help) {
  s_ << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n";
  name_ = name;
  return *this;
}

PromText& PromText::sample(const std::string& labels, double v) {
  s_ << name_;
  if (!labels.empty()) s_ << "{" << labels << "}";
  s_ << " " << num_text(v) << "\n";
  return *this;
}

PromText& PromText::sample_of(const std::string& name, const std::string& labels, double v) {
  s_ << name;
  if (!labels.empty()) s_ << "{" << labels << "}";
  s_ << " " << num_text(v) << "\n";
  return *this;
}

PromText& PromText::histogram_ns(const std::string& labels, const uint64_t* bounds_ns,
                                 const uint64_t* counts, size_t n, uint64_t sum_ns) {
  const std::string sep = labels.empty() ? "" : ",";
  uint64_t cumulative = 0;
  for (size_t b = 0; b <= n; ++b) {
    cumulative += counts[b];
    char le[32];
    if (b < n) {
      std::snprintf(le, sizeof le, "%g", static_cast<double>(bounds_ns[b]) / 1e9);
    } else {
      std::snprintf(le, sizeof le, "+Inf");
    }
    sample_of(name_ + "_bucket", labels + sep + "le=\"" + le + "\"",
              static_cast<double>(cumulative));
  }
  sample_of(name_ + "_sum", labels, static_cast<double>(sum_ns) / 1e9);
  sample_of(name_ + "_count", labels, static_cast<double>(cumulative));
  return *this;
}

void write_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw Error(ErrorCode::kUnavailable, "cannot write " + tmp + ": " + std::strerror(errno));
  }
  size_t at = 0;
  while (at < text.size()) {
    const ssize_t n = ::write(fd, text.data() + at, text.size() - at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      throw Error(ErrorCode::kUnavailable, "cannot write " + tmp + ": " + std::strerror(err));
    }
    at += static_cast<size_t>(n);
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw Error(ErrorCode::kUnavailable,
                "cannot rename " + tmp + " to " + path + ": " + std::strerror(err));
  }
}

}  // namespace bytecomp::prom
