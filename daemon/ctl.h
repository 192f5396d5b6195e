// What bytecompctl and the metrics file show of a running bytecompd: plain
// value snapshots the control thread fills (daemon.cc), rendered here as the
// JSON answers of the operator requests (client/ipc/protocol.h CTL_REQUEST)
// and as Prometheus text (docs/operations.md lists every metric).
//
// The engine's part of a JobView (span histograms, the last iteration's
// time, queue depths, bytes in flight) comes from Engine::phase_stats(),
// phase_records() and gauges(); `trace JOB` answers with the raw phase
// records (trace_json), which bytecompctl turns into a Chrome trace.
//
// Thread-safety: pure functions over values; thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "daemon/engine_phases.h"

namespace bytecomp::daemon {

struct TensorView {
  std::string name;
  std::string dtype;
  uint64_t count = 0;
  uint64_t bytes = 0;
  std::string option;      // strategy::Option::describe() of the strategy in force
  std::string compressor;  // "none" when uncompressed
};

// An auto job's tuner (daemon/auto_tuner.h), as the operator sees it.
struct AutoView {
  std::string state;  // probing, profiling, planning, applied, failed, stopped
  uint64_t epoch = 0;
  double predicted_seconds = 0;  // of the decision in force (0: none yet)
  double link_gbps = 0, link_latency_us = 0;
  uint64_t decisions = 0, replans = 0;
  std::string message;  // why the last plan failed
  std::string run_dir;
};

struct JobView {
  std::string id;
  uint32_t uid = 0;
  std::string state;  // "forming" or "running"
  uint32_t local_size = 0;
  uint32_t connected = 0;
  uint32_t started = 0;
  uint32_t node_rank = 0;
  uint32_t num_nodes = 1;
  std::vector<uint32_t> nodes;  // daemon node ids by node rank (multi-node)
  uint32_t tensors = 0;
  uint64_t tensor_bytes = 0;  // one iteration of every tensor, per rank
  double age_seconds = 0;
  // "job" (bytecomp_set_strategy), "daemon" (strategy.file) or "none".
  std::string strategy_mode;
  std::string strategy_source;
  int64_t strategy_switch_iteration = -1;
  std::optional<AutoView> auto_view;  // strategy mode auto, multi-node
  // Observed in the job's shared memory: completed push_pulls of local rank
  // 0 (one per tensor and iteration) and the iteration of the latest one.
  uint64_t pushpulls = 0;
  int64_t last_iteration = -1;
  // Compression by the plans the daemon built (counting_compressor.h).
  bool compress_counted = false;
  uint64_t compress_input_bytes = 0;
  uint64_t compress_output_bytes = 0;
  // From the engine (running jobs with engine.phase_timestamps on):
  // span histograms, their sums by span name, and the time of the latest
  // iteration the records hold whole (last_iteration_seconds()).
  std::optional<PhaseStats> phase_stats;
  std::optional<double> last_iteration_seconds;
  std::map<std::string, double> phase_seconds;
  // Engine::gauges() of a running job.
  bool engine_gauges = false;
  uint64_t queued_partitions = 0;
  uint64_t inflight_bytes = 0;
  uint32_t waiting_tensors = 0;
  std::vector<TensorView> tensor_list;  // filled for `strategy JOB` only
};

struct DaemonCounters {
  uint64_t jobs_started = 0;
  uint64_t jobs_finished = 0;
  std::map<std::string, uint64_t> aborts;   // by reason (ErrorCode name)
  std::map<std::string, uint64_t> rejects;  // connections refused, by reason
  // Of jobs that ended; the live jobs' share is added when rendering.
  uint64_t pushpulls = 0;
  uint64_t compress_input_bytes = 0;
  uint64_t compress_output_bytes = 0;
  uint64_t ctl_requests = 0;
  uint64_t reloads = 0;
  uint64_t reload_failures = 0;
  uint64_t metrics_writes = 0;
  uint64_t metrics_write_failures = 0;
};

struct DaemonView {
  std::string version;
  int64_t pid = 0;
  double start_time = 0;  // seconds since the epoch
  double uptime_seconds = 0;
  std::vector<std::string> config_sources;  // empty: built-in defaults
  std::string socket;
  std::string instance;
  uint32_t node_id = 0;
  bool multi_node = false;
  bool draining = false;
  double watchdog_seconds = 0;  // ping period; 0 without a watchdog
  std::string metrics_file;     // "" without metrics.textfile_dir
  uint32_t metrics_interval_ms = 0;
  std::vector<JobView> jobs;
  DaemonCounters counters;
};

std::string status_json(const DaemonView& v);
std::string jobs_json(const DaemonView& v);
std::string strategy_json(const JobView& j);
// The answer to `trace JOB`: the job's phase records as the engine holds
// them (the last PhaseLog::kIterations iterations), with tensor names and
// partition counts and the daemon's monotonic clock now, so a client that
// polls can merge answers and see how old they are:
//   {"job":..,"clock":"monotonic","now_ns":..,"phases":[9 names],
//    "spans":[8 names],"tensors":[{"name":..,"partitions":..},..],
//    "records":[[tensor,partition,iteration,[9 ns]],..]}
std::string trace_json(const std::string& job, const std::vector<std::string>& tensor_names,
                       const std::vector<uint32_t>& partitions,
                       const std::vector<PhaseRecord>& records, uint64_t now_ns);
// Wall time of the latest iteration whose records are all there (every
// partition of every tensor that has a record): from its first local
// submission to its last copy-out. nullopt without such an iteration.
std::optional<double> last_iteration_seconds(const std::vector<PhaseRecord>& records);
// Prometheus text exposition format 0.0.4.
std::string metrics_text(const DaemonView& v);

std::string json_string(std::string_view s);

}  // namespace bytecomp::daemon
