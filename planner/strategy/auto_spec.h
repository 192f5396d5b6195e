// What a user accepts when they let the runtime choose the strategy
// (`strategy: {mode: auto, ...}` in bytecompd's configuration, or a job's own
// strategy text with `mode: auto` through bytecomp_set_strategy /
// bc.DistributedOptimizer(strategy="auto")). The daemons send it to the
// coordinator with their profiles; docs/auto.md describes every key.
//
//   version: 1
//   mode: auto
//   compressors: [efsignsgd, "topk:0.01"]   # empty: fp16 only
//   exclude: ["conv1.*", "fc.*"]            # fnmatch globs, never compressed
//   min_compress_bytes: 1MiB                # the size-threshold alternative
//   min_gain: 0.1                           # compress (or move ring <-> servers) only for a larger gain
//   warmup_iterations: 5                    # profiled iterations
//   skip_iterations: 2                      # first iterations not profiled
//   plan_timeout_ms: 5000                   # coordinator's planning bound
//   colocated_servers: true                 # one server per node (BytePS)
//   replan: {drift: 0.25, iterations: 5, min_interval: 20, max: 1, per: 1000}
//   guard: {min_bytes: 256KiB, names: ["*bias", ...], output_layer: true}
//   loss_guard: {enabled: true, window: 20, tolerance: 0.25}
//
// Thread-safety: a plain value.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/config.h"

namespace bytecomp::strategy {

// The accuracy guards (issue 29, docs/auto.md "Accuracy guards"): tensors
// the planner never compresses whatever the predicted gain, because
// compressing them costs accuracy out of proportion to the bytes they save
// (biases, normalisation parameters, the output layer, small tensors: on
// digits efsignsgd on every tensor trained to 41-76 %, on tensors of at
// least 256 KiB to 97 %).
struct AccuracyGuards {
  // Tensors smaller than this many bytes stay uncompressed (0: off).
  uint64_t min_bytes = 256 << 10;
  // fnmatch globs of tensor names that stay uncompressed.
  std::vector<std::string> names = default_names();
  // The output layer (every tensor of the last-declared tensor's module,
  // the name up to its last '.') stays uncompressed.
  bool output_layer = true;

  static std::vector<std::string> default_names() {
    return {"*bias", "*.b", "*norm*", "*bn*", "*.ln*", "ln*", "*ln_*", "*embed*"};
  }
  // Every guard off: the planner decides every tensor on time alone.
  static AccuracyGuards off() { return {0, {}, false}; }
  bool operator==(const AccuracyGuards&) const = default;
};

struct AutoSpec {
  std::vector<std::string> compressors;  // as written; validated by the factory
  std::vector<std::string> exclude;
  uint64_t min_compress_bytes = 1ull << 20;
  // A compressed plan must be predicted this fraction faster than none, and
  // a plan that moves tensors between the ring and the servers this fraction
  // faster than the best one that moves none (planner/online.h).
  double min_gain = 0.1;
  uint32_t warmup_iterations = 5;
  uint32_t skip_iterations = 2;
  uint32_t plan_timeout_ms = 5000;
  bool colocated_servers = true;
  // Re-plan when |measured - predicted| / predicted > drift for
  // `iterations` iterations in a row, at least min_interval iterations after
  // the last change.
  double replan_drift = 0.25;
  uint32_t replan_iterations = 5;
  uint32_t replan_min_interval = 20;
  // At most replan_max re-plans in any replan_per iterations (hysteresis:
  // a job whose link does not change settles; one re-plan corrects a first
  // prediction the model got wrong. Issue 29's digits job re-planned 6
  // times in its 280 steps).
  uint32_t replan_max = 1;
  uint32_t replan_per = 1000;
  AccuracyGuards guards;
  // The loss guard (daemon/auto_tuner.h LossGuard): after a switch to a
  // compressed strategy, the median of `loss_window` reported losses above
  // the median of the last `loss_window` uncompressed ones by more than
  // `loss_tolerance` (a fraction) rolls the job back to uncompressed.
  bool loss_guard = true;
  uint32_t loss_window = 20;
  double loss_tolerance = 0.25;

  // Reads the keys above (not `version` or `mode`) from a section; throws
  // config::ConfigError naming the key (unknown compressors included). Does
  // not call finish(): the caller's section may hold keys of its own.
  static AutoSpec read(config::Reader& section);
  // A job's strategy text: nullopt when it is not an auto document (no `mode`
  // key: a strategy file); the AutoSpec when `mode: auto`; ConfigError
  // otherwise (bad YAML, other mode, unknown key).
  static std::optional<AutoSpec> parse_job_text(std::string_view text, std::string name);
  // A complete document (`version: 1`, `mode: auto`, every key) that
  // parse_job_text() reads back equal.
  std::string to_yaml() const;
  bool operator==(const AutoSpec&) const = default;
};

// Why tensor `index` (of `names`/`elements` in declaration order, fp32
// elements) is kept uncompressed by `guards`: "" when no guard holds it,
// else the reason, e.g. "guard: 40 B < min_bytes 262144 B" (the online
// planner's explain table prints it).
std::string guard_reason(const AccuracyGuards& guards, const std::vector<std::string>& names,
                         const std::vector<uint64_t>& elements, size_t index);

// The strategy an auto job starts with: its join strategy, each tensor's
// placement before anything is measured (a later plan may move a tensor
// between the servers and the daemons' ring where every node has a peer
// endpoint, docs/auto.md "Placement"). Every tensor uncompressed; on the ring
// (inter: allreduce) the tensors auto can never compress beyond fp16 (the
// ring carries fp16: every tensor when `spec.compressors` is empty, else
// those an accuracy guard or `exclude` keeps uncompressed) where the
// planner's model (planner/model.h Cluster::ring_us) has the ring no slower
// than push/pull whatever the link: on 2 nodes every such tensor (both pay
// two latencies per partition, and the ring reaches more of the link), on
// more nodes those whose partitions (of `partition_bytes`) are at least
// kRingStartMinBytes (smaller ones pay the ring's 2(N-1) hops: 64 KiB on 4
// nodes measured 0.43x push/pull's speed, 1 MiB 2.06x; docs/planner.md).
// The rest stay sharded over the servers, where any accepted compressor can
// take them later. "" when no tensor goes on the ring (the job starts
// uncompressed on the servers, as before).
constexpr uint64_t kRingStartMinBytes = 1 << 20;
std::string start_strategy_yaml(const AutoSpec& spec, const std::vector<std::string>& names,
                                const std::vector<uint64_t>& elements, uint32_t nodes,
                                uint64_t partition_bytes);

}  // namespace bytecomp::strategy
