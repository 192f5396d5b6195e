#include "server/metrics.h"

#include <time.h>

#include <algorithm>
#include <chrono>

#include "bytecomp_build_config.h"
#include "common/error.h"
#include "common/log.h"
#include "common/prometheus.h"

namespace bytecomp::server {

BC_LOG_CATEGORY(LogMetrics, "server.metrics");

MetricsConfig MetricsConfig::read(config::Reader& root) {
  MetricsConfig c;
  config::Reader m = root.section("metrics");
  m.get("textfile_dir", c.textfile_dir)
      .get("interval_ms", c.interval_ms, config::Range<uint32_t>{500, 3600000});
  m.finish();
  return c;
}

ServerMetrics::ServerMetrics()
    : start_time_(std::chrono::duration<double>(
                      std::chrono::system_clock::now().time_since_epoch())
                      .count()) {}

uint64_t ServerMetrics::now_ns() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

void ServerMetrics::round_done(uint64_t started_ns) {
  const uint64_t now = now_ns();
  const uint64_t d = started_ns != 0 && now > started_ns ? now - started_ns : 0;
  const auto b = static_cast<size_t>(
      std::lower_bound(kRoundBoundsNs.begin(), kRoundBoundsNs.end(), d) - kRoundBoundsNs.begin());
  buckets_[b].fetch_add(1, std::memory_order_relaxed);
  round_ns_.fetch_add(d, std::memory_order_relaxed);
  rounds_.fetch_add(1, std::memory_order_relaxed);
}

ServerMetricsSnapshot ServerMetrics::snapshot() const {
  ServerMetricsSnapshot s;
  s.rounds = rounds_.load(std::memory_order_relaxed);
  for (size_t i = 0; i < buckets_.size(); ++i) {
    s.round_buckets[i] = buckets_[i].load(std::memory_order_relaxed);
  }
  s.round_ns_sum = round_ns_.load(std::memory_order_relaxed);
  s.pushes = pushes_.load(std::memory_order_relaxed);
  s.push_bytes = push_bytes_.load(std::memory_order_relaxed);
  s.answers = answers_.load(std::memory_order_relaxed);
  s.answer_bytes = answer_bytes_.load(std::memory_order_relaxed);
  s.shm_bytes = shm_bytes_.load(std::memory_order_relaxed);
  return s;
}

std::string metrics_text(const ServerView& v, const ServerMetrics& metrics) {
  using prom::label_value;
  const ServerMetricsSnapshot m = metrics.snapshot();
  auto d = [](uint64_t x) { return static_cast<double>(x); };
  prom::PromText p;
  p.family("bytecomp_server_info", "gauge",
           "Constant 1, labelled with the server's version, id and role.")
      .sample("version=\"" + label_value(BYTECOMP_VERSION) + "\",server=\"" +
                  std::to_string(v.node_id) + "\",coordinator=\"" +
                  (v.coordinator ? "true" : "false") + "\"",
              1);
  p.family("bytecomp_server_start_time_seconds", "gauge",
           "When bytecomp-server started, in seconds since the epoch.")
      .sample("", metrics.start_time());
  p.family("bytecomp_server_jobs", "gauge", "Jobs with partitions on this server.")
      .sample("", v.jobs);
  p.family("bytecomp_server_reserved_bytes", "gauge",
           "Memory reserved for the jobs' partitions (server.max_total_bytes bounds it).")
      .sample("", d(v.reserved_bytes));
  p.family("bytecomp_server_rounds_total", "counter",
           "Partition rounds summed (one per partition and iteration).")
      .sample("", d(m.rounds));
  p.family("bytecomp_server_round_seconds", "histogram",
           "Time of each round from its first push to its sum ready for the pulls.");
  std::array<uint64_t, kRoundBoundsNs.size() + 1> counts = m.round_buckets;
  p.histogram("", kRoundBoundsNs, counts, m.round_ns_sum);
  p.family("bytecomp_server_pushes_total", "counter", "Pushes accepted.").sample("", d(m.pushes));
  p.family("bytecomp_server_push_bytes_total", "counter",
           "Bytes of the pushes accepted (as sent: compressed where the plan compresses).")
      .sample("", d(m.push_bytes));
  p.family("bytecomp_server_answers_total", "counter",
           "Pulls answered with a round's result.")
      .sample("", d(m.answers));
  p.family("bytecomp_server_answer_bytes_total", "counter",
           "Bytes of those answers (as sent).")
      .sample("", d(m.answer_bytes));
  p.family("bytecomp_server_shm_bytes_total", "counter",
           "Bytes of pushes read from and answers written to the shared memory of nodes on "
           "this host (server.local_shm), instead of travelling over a socket.")
      .sample("", d(m.shm_bytes));
  p.family("bytecomp_server_refused_total", "counter",
           "Requests refused, by kind: pushes and pulls (wrong job, length, plan, ...) and "
           "malformed transport frames.")
      .sample("kind=\"request\"", d(v.pushes_refused))
      .sample("kind=\"frame\"", d(v.frames_refused));
  return p.text();
}

std::string metrics_file(const std::string& dir, uint32_t node_id) {
  return dir + "/bytecomp-server-" + std::to_string(node_id) + ".prom";
}

MetricsTextfile::MetricsTextfile(MetricsConfig config, uint32_t node_id,
                                 std::function<std::string()> render)
    : config_(std::move(config)),
      path_(config_.textfile_dir.empty() ? "" : metrics_file(config_.textfile_dir, node_id)),
      render_(std::move(render)) {}

std::chrono::milliseconds MetricsTextfile::tick() {
  using namespace std::chrono;
  if (path_.empty()) return hours(1);
  const auto now = steady_clock::now();
  if (now >= next_) write_now();
  return duration_cast<milliseconds>(next_ - now) + milliseconds(1);
}

void MetricsTextfile::write_now() {
  if (path_.empty()) return;
  next_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(config_.interval_ms);
  try {
    prom::write_atomically(path_, render_());
  } catch (const Error& e) {
    BC_LOG(LogMetrics(), kWarn) << "metrics: " << e.what();
  }
}

}  // namespace bytecomp::server
