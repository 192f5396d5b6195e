// Prometheus text exposition (format 0.0.4) and the atomic textfile write
// node_exporter's textfile collector needs, shared by bytecompd
// (daemon/ctl.cc) and bytecomp-server (server/metrics.cc) so both render
// and publish metrics the same way (docs/operations.md lists them).
//
// Thread-safety: PromText is thread-compatible; the functions are
// thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>

namespace bytecomp::prom {

// A label value with backslash, double quote and newline escaped.
std::string label_value(std::string_view s);

class PromText {
 public:
  // One metric family: HELP and TYPE once, then its samples.
  PromText& family(const char* name, const char* type, const char* help);
  // A sample of the current family ("" labels: none).
  PromText& sample(const std::string& labels, double v);
  // A sample of the current family under a suffixed name (a histogram's
  // _bucket, _sum and _count).
  PromText& sample_of(const std::string& name, const std::string& labels, double v);
  // The _bucket (cumulative, le="+Inf" last), _sum and _count samples of
  // one histogram series: `counts[i]` durations fell at or below
  // `bounds_ns[i]` and above the bound before (the last count: above every
  // bound), their total `sum_ns`.
  template <size_t N>
  PromText& histogram(const std::string& labels, const std::array<uint64_t, N>& bounds_ns,
                      const std::array<uint64_t, N + 1>& counts, uint64_t sum_ns) {
    return histogram_ns(labels, bounds_ns.data(), counts.data(), N, sum_ns);
  }
  std::string text() const { return s_.str(); }

 private:
  PromText& histogram_ns(const std::string& labels, const uint64_t* bounds_ns,
                         const uint64_t* counts, size_t n, uint64_t sum_ns);
  std::ostringstream s_;
  std::string name_;
};

// Writes `text` to `path` atomically (temporary file in the same directory,
// then rename), so a reader never sees half a file. Throws Error(kUnavailable)
// naming the path and errno.
void write_atomically(const std::string& path, const std::string& text);

}  // namespace bytecomp::prom
