// What bytecomp-server exports as Prometheus text (docs/operations.md): the
// partition rounds it summed and how long each took, pushes and their bytes,
// refusals, jobs and reservations. ParameterServer counts into a
// ServerMetrics (a few hook lines in its data path) and renders it with
// ParameterServer::metrics_text(); main() writes the text atomically to
// `metrics.textfile_dir`/bytecomp-server-<node id>.prom every
// `metrics.interval_ms` for node_exporter's textfile collector, and answers
// kMetrics requests with it (PsClient::metrics(): `bytecompctl servers`
// asks through the daemon, over the cluster transport and its CURVE keys).
//
// A round's time runs from its first push to the moment its sum (or
// aggregate) is ready to answer pulls: the wait for the other nodes' pushes
// plus the summing.
//
// Thread-safety: ServerMetrics is thread-safe (relaxed atomics: every
// counter is exact, a snapshot taken while rounds finish may hold one round
// in the counter and not yet in the histogram); the rest is plain values.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "common/config.h"

namespace bytecomp::server {

struct MetricsConfig {
  std::string textfile_dir;  // "" : no textfile
  uint32_t interval_ms = 5000;
  // The `metrics` section of server.yaml: textfile_dir, interval_ms.
  static MetricsConfig read(config::Reader& root);
};

// Upper bounds (ns) of the round-time histogram's buckets, 10 us .. 10 s,
// then +Inf (the daemon's span histograms use the same).
inline constexpr std::array<uint64_t, 19> kRoundBoundsNs{
    10'000,      25'000,      50'000,      100'000,       250'000,
    500'000,     1'000'000,   2'500'000,   5'000'000,     10'000'000,
    25'000'000,  50'000'000,  100'000'000, 250'000'000,   500'000'000,
    1'000'000'000, 2'500'000'000, 5'000'000'000, 10'000'000'000};

struct ServerMetricsSnapshot {
  uint64_t rounds = 0;
  std::array<uint64_t, kRoundBoundsNs.size() + 1> round_buckets{};
  uint64_t round_ns_sum = 0;
  uint64_t pushes = 0;
  uint64_t push_bytes = 0;
  uint64_t answers = 0;  // pulls answered with a result
  uint64_t answer_bytes = 0;
  uint64_t shm_bytes = 0;  // pushes read from / answers written to nodes' segments
};

class ServerMetrics {
 public:
  ServerMetrics();
  double start_time() const { return start_time_; }  // seconds since the epoch
  // Monotonic clock (CLOCK_MONOTONIC, ns) for round start and end.
  static uint64_t now_ns();
  void pushed(uint64_t bytes) {
    pushes_.fetch_add(1, std::memory_order_relaxed);
    push_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  }
  void answered(uint64_t bytes) {
    answers_.fetch_add(1, std::memory_order_relaxed);
    answer_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  }
  // `bytes` of a push or an answer went through a node's shared memory.
  void shm(uint64_t bytes) { shm_bytes_.fetch_add(bytes, std::memory_order_relaxed); }
  // A round's sum is ready; it began (first push) at `started_ns`.
  void round_done(uint64_t started_ns);
  ServerMetricsSnapshot snapshot() const;

 private:
  double start_time_ = 0;
  std::atomic<uint64_t> rounds_{0};
  std::array<std::atomic<uint64_t>, kRoundBoundsNs.size() + 1> buckets_{};
  std::atomic<uint64_t> round_ns_{0};
  std::atomic<uint64_t> pushes_{0}, push_bytes_{0}, answers_{0}, answer_bytes_{0},
      shm_bytes_{0};
};

// The values metrics_text() renders besides the counters.
struct ServerView {
  uint32_t node_id = 0;
  bool coordinator = false;
  uint32_t jobs = 0;
  uint64_t reserved_bytes = 0;
  uint64_t pushes_refused = 0;  // pushes and pulls refused (refuse())
  uint64_t frames_refused = 0;
};

// Prometheus text exposition format 0.0.4 (with this build's version and
// the start time `metrics` recorded).
std::string metrics_text(const ServerView& v, const ServerMetrics& metrics);

// The textfile's path for server `node_id` in `dir`.
std::string metrics_file(const std::string& dir, uint32_t node_id);

// Writes `render()` to metrics_file(dir, node_id) every interval_ms (a
// failed write is logged, at most once per interval, and retried at the
// next). Inert without textfile_dir. Thread-bound: main()'s loop.
class MetricsTextfile {
 public:
  MetricsTextfile(MetricsConfig config, uint32_t node_id, std::function<std::string()> render);
  // Writes when due; returns how long the caller may sleep until the next.
  std::chrono::milliseconds tick();
  void write_now();
  const std::string& path() const { return path_; }

 private:
  MetricsConfig config_;
  std::string path_;
  std::function<std::string()> render_;
  std::chrono::steady_clock::time_point next_{};
};

}  // namespace bytecomp::server
