#include "daemon/ctl.h"

#include <cmath>
#include <cstdio>
#include <set>
#include <sstream>
#include <utility>

#include "common/error.h"
#include "common/prometheus.h"

namespace bytecomp::daemon {

std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20) {
          char b[8];
          std::snprintf(b, sizeof b, "\\u%04x", c);
          out += b;
        } else {
          out += ch;
        }
    }
  }
  return out + "\"";
}

namespace {

std::string num(double v) {
  if (!std::isfinite(v)) return "null";
  char b[32];
  std::snprintf(b, sizeof b, "%.6g", v);
  return b;
}

// Comma-separated "key": value members of one JSON object.
class Obj {
 public:
  Obj& raw(std::string_view k, const std::string& v) {
    if (!s_.empty()) s_ += ",";
    s_ += json_string(k) + ":" + v;
    return *this;
  }
  Obj& str(std::string_view k, std::string_view v) { return raw(k, json_string(v)); }
  Obj& u(std::string_view k, uint64_t v) { return raw(k, std::to_string(v)); }
  Obj& i(std::string_view k, int64_t v) { return raw(k, std::to_string(v)); }
  Obj& d(std::string_view k, double v) { return raw(k, num(v)); }
  Obj& b(std::string_view k, bool v) { return raw(k, v ? "true" : "false"); }
  std::string done() const { return "{" + s_ + "}"; }

 private:
  std::string s_;
};

template <class T, class F>
std::string array(const std::vector<T>& items, F each) {
  std::string s = "[";
  for (size_t i = 0; i < items.size(); ++i) s += (i ? "," : "") + each(items[i]);
  return s + "]";
}

std::string auto_obj(const JobView& j) {
  if (!j.auto_view) return "null";
  const AutoView& a = *j.auto_view;
  Obj o;
  o.str("state", a.state).u("epoch", a.epoch)
      .raw("predicted_seconds", a.predicted_seconds > 0 ? num(a.predicted_seconds) : "null")
      .raw("measured_seconds",
           j.last_iteration_seconds ? num(*j.last_iteration_seconds) : "null")
      .d("link_gbps", a.link_gbps).d("link_latency_us", a.link_latency_us)
      .u("decisions", a.decisions).u("replans", a.replans).str("message", a.message)
      .str("run_dir", a.run_dir);
  return o.done();
}

std::string job_obj(const JobView& j) {
  Obj o;
  o.str("id", j.id).u("uid", j.uid).str("state", j.state).u("local_size", j.local_size)
      .u("connected", j.connected).u("started", j.started).u("node_rank", j.node_rank)
      .u("num_nodes", j.num_nodes)
      .raw("nodes", array(j.nodes, [](uint32_t n) { return std::to_string(n); }))
      .u("tensors", j.tensors).u("tensor_bytes", j.tensor_bytes).d("age_seconds", j.age_seconds)
      .raw("strategy", Obj().str("mode", j.strategy_mode).str("source", j.strategy_source)
                            .i("switch_iteration", j.strategy_switch_iteration)
                            .raw("auto", auto_obj(j)).done())
      .u("pushpulls", j.pushpulls).i("iteration", j.last_iteration);
  if (j.compress_counted) {
    o.raw("compress", Obj().u("input_bytes", j.compress_input_bytes)
                          .u("output_bytes", j.compress_output_bytes).done());
  } else {
    o.raw("compress", "null");
  }
  o.raw("last_iteration_seconds",
        j.last_iteration_seconds ? num(*j.last_iteration_seconds) : "null");
  Obj phases;
  for (const auto& [k, v] : j.phase_seconds) phases.d(k, v);
  o.raw("phase_seconds", j.phase_seconds.empty() ? "null" : phases.done());
  o.raw("rounds", j.phase_stats ? std::to_string(j.phase_stats->records) : "null");
  if (j.engine_gauges) {
    o.raw("engine", Obj().u("queued_partitions", j.queued_partitions)
                        .u("waiting_tensors", j.waiting_tensors)
                        .u("inflight_bytes", j.inflight_bytes).done());
  } else {
    o.raw("engine", "null");
  }
  return o.done();
}

}  // namespace

std::string status_json(const DaemonView& v) {
  uint32_t forming = 0, running = 0;
  for (const auto& j : v.jobs) (j.state == "running" ? running : forming)++;
  Obj o;
  o.str("version", v.version).i("pid", v.pid).d("start_time", v.start_time)
      .d("uptime_seconds", v.uptime_seconds)
      .raw("config_sources", array(v.config_sources, [](const std::string& s) {
             return json_string(s);
           }))
      .str("socket", v.socket).str("instance", v.instance).u("node_id", v.node_id)
      .b("multi_node", v.multi_node).b("draining", v.draining)
      .d("watchdog_seconds", v.watchdog_seconds).str("metrics_file", v.metrics_file)
      .raw("jobs", Obj().u("forming", forming).u("running", running).done())
      .raw("job_ids", array(v.jobs, [](const JobView& j) { return json_string(j.id); }));
  return o.done() + "\n";
}

std::string jobs_json(const DaemonView& v) {
  return Obj().raw("jobs", array(v.jobs, job_obj)).done() + "\n";
}

std::string trace_json(const std::string& job, const std::vector<std::string>& tensor_names,
                       const std::vector<uint32_t>& partitions,
                       const std::vector<PhaseRecord>& records, uint64_t now_ns) {
  std::vector<std::string> phases, spans;
  for (size_t p = 0; p < kPhaseCount; ++p) {
    phases.push_back(json_string(phase_name(static_cast<Phase>(p))));
  }
  for (size_t i = 0; i < kSpanCount; ++i) spans.push_back(json_string(span_name(i)));
  auto plain = [](const std::string& x) { return x; };
  std::string tensors = "[";
  for (size_t t = 0; t < tensor_names.size(); ++t) {
    tensors += (t ? "," : "") + Obj().str("name", tensor_names[t])
                                     .u("partitions", t < partitions.size() ? partitions[t] : 0)
                                     .done();
  }
  tensors += "]";
  std::string recs = "[";
  for (size_t i = 0; i < records.size(); ++i) {
    const PhaseRecord& r = records[i];
    recs += (i ? ",[" : "[") + std::to_string(r.tensor) + "," + std::to_string(r.partition) + "," +
            std::to_string(r.iteration) + ",[";
    for (size_t p = 0; p < kPhaseCount; ++p) recs += (p ? "," : "") + std::to_string(r.ns[p]);
    recs += "]]";
  }
  recs += "]";
  return Obj().str("job", job).str("clock", "monotonic").u("now_ns", now_ns)
             .raw("phases", array(phases, plain)).raw("spans", array(spans, plain))
             .raw("tensors", tensors).raw("records", recs).done() +
         "\n";
}

std::optional<double> last_iteration_seconds(const std::vector<PhaseRecord>& records) {
  std::set<std::pair<uint32_t, uint32_t>> slots;
  std::map<uint64_t, std::set<std::pair<uint32_t, uint32_t>>> by_iteration;
  for (const PhaseRecord& r : records) {
    slots.insert({r.tensor, r.partition});
    by_iteration[r.iteration].insert({r.tensor, r.partition});
  }
  for (auto it = by_iteration.rbegin(); it != by_iteration.rend(); ++it) {
    if (it->second != slots) continue;
    uint64_t first = UINT64_MAX, last = 0;
    for (const PhaseRecord& r : records) {
      if (r.iteration != it->first) continue;
      first = std::min(first, r.at(Phase::kFirstRank));
      last = std::max(last, r.at(Phase::kCopiedOut));
    }
    if (first == 0 || last < first) return std::nullopt;
    return static_cast<double>(last - first) / 1e9;
  }
  return std::nullopt;
}

std::string strategy_json(const JobView& j) {
  Obj o;
  o.str("job", j.id).str("mode", j.strategy_mode).str("source", j.strategy_source)
      .i("switch_iteration", j.strategy_switch_iteration).raw("auto", auto_obj(j))
      .raw("tensors", array(j.tensor_list, [](const TensorView& t) {
             return Obj().str("name", t.name).str("dtype", t.dtype).u("count", t.count)
                 .u("bytes", t.bytes).str("compressor", t.compressor).str("option", t.option)
                 .done();
           }));
  return o.done() + "\n";
}

namespace {

using prom::label_value;

std::string job_labels(const JobView& j) {
  return "bytecomp_job=\"" + label_value(j.id) + "\",uid=\"" + std::to_string(j.uid) + "\"";
}

}  // namespace

std::string metrics_text(const DaemonView& v) {
  const DaemonCounters& c = v.counters;
  uint64_t pushpulls = c.pushpulls, cin = c.compress_input_bytes, cout = c.compress_output_bytes;
  uint32_t forming = 0, running = 0;
  for (const auto& j : v.jobs) {
    pushpulls += j.pushpulls;
    cin += j.compress_input_bytes;
    cout += j.compress_output_bytes;
    (j.state == "running" ? running : forming)++;
  }
  prom::PromText p;
  p.family("bytecomp_daemon_info", "gauge", "Constant 1, labelled with the daemon's version.")
      .sample("version=\"" + label_value(v.version) + "\",instance=\"" + label_value(v.instance) +
                  "\"",
              1);
  p.family("bytecomp_daemon_start_time_seconds", "gauge",
           "When bytecompd started, in seconds since the epoch.")
      .sample("", v.start_time);
  p.family("bytecomp_daemon_draining", "gauge",
           "1 while the daemon refuses new jobs (bytecompctl drain).")
      .sample("", v.draining ? 1 : 0);
  p.family("bytecomp_jobs", "gauge", "Jobs by state: forming (ranks joining) or running.")
      .sample("state=\"forming\"", forming)
      .sample("state=\"running\"", running);
  p.family("bytecomp_jobs_started_total", "counter", "Jobs that started running.")
      .sample("", static_cast<double>(c.jobs_started));
  p.family("bytecomp_jobs_finished_total", "counter",
           "Jobs that ended with every rank leaving normally.")
      .sample("", static_cast<double>(c.jobs_finished));
  p.family("bytecomp_job_aborts_total", "counter", "Jobs aborted, by reason.");
  for (const auto& [reason, n] : c.aborts) {
    p.sample("reason=\"" + label_value(reason) + "\"", static_cast<double>(n));
  }
  p.family("bytecomp_client_rejects_total", "counter",
           "Client connections refused, by reason.");
  for (const auto& [reason, n] : c.rejects) {
    p.sample("reason=\"" + label_value(reason) + "\"", static_cast<double>(n));
  }
  p.family("bytecomp_pushpulls_total", "counter",
           "Completed push_pulls (one per tensor and iteration) over all jobs.")
      .sample("", static_cast<double>(pushpulls));
  p.family("bytecomp_compress_input_bytes_total", "counter",
           "Bytes handed to compressors (before compression) over all jobs.")
      .sample("", static_cast<double>(cin));
  p.family("bytecomp_compress_output_bytes_total", "counter",
           "Bytes compressors produced (after compression) over all jobs.")
      .sample("", static_cast<double>(cout));
  p.family("bytecomp_control_requests_total", "counter", "bytecompctl requests served.")
      .sample("", static_cast<double>(c.ctl_requests));
  p.family("bytecomp_reloads_total", "counter", "Configuration reloads, by result.")
      .sample("result=\"ok\"", static_cast<double>(c.reloads))
      .sample("result=\"failed\"", static_cast<double>(c.reload_failures));
  p.family("bytecomp_metrics_writes_total", "counter", "Metrics textfile writes, by result.")
      .sample("result=\"ok\"", static_cast<double>(c.metrics_writes))
      .sample("result=\"failed\"", static_cast<double>(c.metrics_write_failures));

  p.family("bytecomp_job_local_ranks", "gauge", "Local ranks of each job on this node.");
  for (const auto& j : v.jobs) p.sample(job_labels(j), j.local_size);
  p.family("bytecomp_job_tensors", "gauge", "Tensors each job declared.");
  for (const auto& j : v.jobs) p.sample(job_labels(j), j.tensors);
  p.family("bytecomp_job_pushpulls_total", "counter",
           "Completed push_pulls of each running job (local rank 0).");
  for (const auto& j : v.jobs) p.sample(job_labels(j), static_cast<double>(j.pushpulls));
  p.family("bytecomp_job_iteration", "gauge",
           "Iteration of each job's latest completed push_pull (-1: none yet).");
  for (const auto& j : v.jobs) p.sample(job_labels(j), static_cast<double>(j.last_iteration));
  p.family("bytecomp_job_compress_input_bytes_total", "counter",
           "Bytes each job handed to compressors on this node.");
  for (const auto& j : v.jobs) {
    if (j.compress_counted) p.sample(job_labels(j), static_cast<double>(j.compress_input_bytes));
  }
  p.family("bytecomp_job_compress_output_bytes_total", "counter",
           "Bytes each job's compressors produced on this node.");
  for (const auto& j : v.jobs) {
    if (j.compress_counted) p.sample(job_labels(j), static_cast<double>(j.compress_output_bytes));
  }
  p.family("bytecomp_job_compression_ratio", "gauge",
           "Bytes before over bytes after compression, per job (absent before any).");
  for (const auto& j : v.jobs) {
    if (j.compress_counted && j.compress_output_bytes > 0) {
      p.sample(job_labels(j), static_cast<double>(j.compress_input_bytes) /
                                  static_cast<double>(j.compress_output_bytes));
    }
  }
  p.family("bytecomp_job_rounds_total", "counter",
           "Partition rounds each job's engine finished (one per partition and iteration).");
  for (const auto& j : v.jobs) {
    if (j.phase_stats) p.sample(job_labels(j), static_cast<double>(j.phase_stats->records));
  }
  p.family("bytecomp_job_phase_seconds", "histogram",
           "Time of each partition round in each phase of the data path, per job.");
  for (const auto& j : v.jobs) {
    if (!j.phase_stats) continue;
    const PhaseStats& st = *j.phase_stats;
    for (size_t i = 0; i < kSpanCount; ++i) {
      p.histogram(job_labels(j) + ",phase=\"" + std::string(span_name(i)) + "\"",
                  kBucketBoundsNs, st.buckets[i], st.sum_ns[i]);
    }
  }
  p.family("bytecomp_job_last_iteration_seconds", "gauge",
           "Wall time of each job's latest whole iteration: first local submission to last "
           "copy-out.");
  for (const auto& j : v.jobs) {
    if (j.last_iteration_seconds) p.sample(job_labels(j), *j.last_iteration_seconds);
  }
  p.family("bytecomp_job_queued_partitions", "gauge",
           "Partitions each job's scheduler holds, waiting for a worker.");
  for (const auto& j : v.jobs) {
    if (j.engine_gauges) p.sample(job_labels(j), static_cast<double>(j.queued_partitions));
  }
  p.family("bytecomp_job_waiting_tensors", "gauge",
           "Tensors of each job submitted by some local ranks and waiting for the others.");
  for (const auto& j : v.jobs) {
    if (j.engine_gauges) p.sample(job_labels(j), j.waiting_tensors);
  }
  p.family("bytecomp_job_inflight_bytes", "gauge",
           "Bytes each multi-node job pushed and the servers or peers have not acknowledged.");
  for (const auto& j : v.jobs) {
    if (j.engine_gauges) p.sample(job_labels(j), static_cast<double>(j.inflight_bytes));
  }
  return p.text();
}

}  // namespace bytecomp::daemon
