// The online planner: from what the nodes measured during a window of
// iterations to one per-tensor strategy for the whole job (issue 13; the
// coordinator links this library, docs/planner.md "Online planning").
// online.cc: merge, calibration, decide(); online_record.cc: the decision
// record; its search is refine_groups() (search.h, refine.cc); the
// profile's YAML is planner/strategy/profile.cc.
//
// The model is the planner's timeline simulator (planner/evaluator.h) on
// CPU-only nodes (Cluster::cpu_nodes): no GPU, no intra-node link; the
// backward pass is the measured ready times, the intra-node step the
// measured reduce fit, (de)compression the measured fits divided over the
// daemon's pool threads, the push/pull to the sharded servers the measured
// link per node. It is calibrated so that its prediction for the strategy
// that ran during the window equals the measured iteration time
// (Decision::strategy.meta says what was derived and how).
//
// Options are only those the CPU runtime executes: per tensor none, fp16
// or one of the accepted compressors on the CPU over the PS sharded scheme,
// or none / fp16 on the daemons' ring (inter: allreduce, Placement::kRing).
// A running job may move a tensor between the servers and the ring at one
// iteration (docs/daemon.md "Ring allreduce"); AutoConfig::placement says
// whether the decision may: kFixed (the default) keeps every tensor where
// the window ran it, kMove (the coordinator's where the job's ring is
// open, docs/auto.md "Placement") moves tensors only when that is
// predicted faster than the best plan that keeps every placement by the
// min_gain bar, kFree (a plan before the job's first round, `bytecomp-plan
// decide --placement free`) lets each tensor take either.
//
// Units: microseconds (_us), milliseconds (_ms), elements are fp32
// elements, bytes are bytes, link rates gigabits per second.
//
// Thread-safety: plain values and pure functions; decide() builds its own
// Problem, so calls may run concurrently on different (or the same const)
// inputs.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "planner/strategy/auto_spec.h"
#include "planner/strategy/profile.h"
#include "planner/strategy/strategy.h"

namespace bytecomp::planner::online {

// The nodes' measurements are the profile contract of the strategy
// library (planner/strategy/profile.h: the daemon links it without the
// planner); the planner names them as its inputs.
using strategy::CompressorMeasure;
using strategy::fit_linear;
using strategy::LinearFit;
using strategy::NodeProfile;
using strategy::TensorMeasure;

// The job's view of several nodes' profiles: per tensor the latest ready
// time of any node, the longest iteration, the narrowest link (smallest
// known rate, largest latency), the slowest cost coefficients (largest a and
// b of every fit, largest wire size), the fewest pool threads and cores, the
// most local ranks, the shortest window. Throws Error(kInvalidArgument)
// naming the difference when the nodes' tensor lists (names, sizes, order),
// compressor lists or current strategies differ, or when `nodes` is empty.
NodeProfile merge(const std::vector<NodeProfile>& nodes);

// How a (merged) profile's nodes share their host's cores with training
// and with other work (docs/planner.md, "CPU training on a shared host").
//   other work: the host's CPU time in the window (host_cpu_us) less the
//     job's own processes on it (nodes on the host x (local ranks x
//     train_cpu_us + daemon_cpu_us), and daemon_cpu_us again per colocated
//     server), in cores (other_cores; 0 where host_cpu_us or train_cpu_us
//     is unknown). It counts as that many more runnable processes: the
//     job's keep procs / (procs + other_cores) of the cores (job cores)
//     when they and the other work do not all fit.
//   compute: a window's ready times carry the contention of the strategy
//     that ran: uncompressed on a slow link the nodes' iterations drift
//     apart and each computes nearly alone; compressed, every training
//     process of the host computes at once. Where the host's training
//     processes are at least its cores, the backward pass of a
//     compute-bound iteration takes their CPU time (train_cpu_us x
//     processes on the host / job cores): the ready times are stretched
//     (or shrunk: the window's comm stack also took cores) to that bound.
//     With other work on the host they shrink only by the comm stack's
//     part of the contention (compute_floor = other / (other + the comm
//     stack's cores)): what the job leaves, the other work takes.
//   pool: (local ranks + pool threads) x nodes on the host + other_cores >
//     cores puts the daemon's and colocated server's CPU work on the
//     compute resource, at nodes on the host / job cores per microsecond.
struct HostShare {
  bool pool_shares_compute = false;
  double pool_cost_scale = 1.0;
  double compute_stretch = 1.0;
  double compute_bound_us = 0;  // 0: not applied (CPU time unknown, or spare cores)
  double other_cores = 0;       // other work on the host, in cores (0: none or unknown)
  double compute_floor = 0;     // the least compute_stretch (0: no other work)
};
HostShare host_share(const NodeProfile& prof, bool colocated_servers);

struct AutoConfig {
  std::vector<std::string> compressors;  // accepted by the user; empty = fp16 only
  std::vector<std::string> exclude;      // fnmatch globs of tensors never compressed
  uint64_t min_compress_bytes = 1 << 20; // the BytePS size-threshold alternative
  uint32_t nodes = 1, servers = 1;
  bool colocated_servers = true;
  uint64_t partition_bytes = 4 << 20;    // the daemon's partitioning
  // Compress only when the plan is predicted faster than leaving every
  // tensor uncompressed by at least this fraction of the measured iteration,
  // or by the calibration's own misfit (|residual| / measured) when that is
  // larger: a gain the model cannot resolve is not worth the accuracy.
  double min_gain = 0.1;
  // Tensors kept uncompressed for accuracy (strategy::AccuracyGuards). Off
  // in this library struct, so that a caller plans every tensor unless it
  // says otherwise; a user's auto spec (AutoSpec::guards) has them on, and
  // the coordinator and `bytecomp-plan online` pass those.
  strategy::AccuracyGuards guards = strategy::AccuracyGuards::off();
  // Where each tensor may run (servers or ring), against the window's
  // strategy (the placement each tensor ran with):
  //   kFixed: every tensor keeps it (a job without a ring; the library's
  //     default, so that a caller moves nothing unless it says so);
  //   kMove: a running job whose daemons all have a peer endpoint (the
  //     coordinator): a plan that moves a tensor must be predicted faster
  //     than the best plan that moves none by the min_gain bar (the window
  //     measured each tensor only on the path it ran; the other path is the
  //     model's estimate, and a move on a near-tie would flap back at the
  //     next re-plan). A tensor the window ran neither sharded nor on the
  //     ring (ps_single, allgather: the runtime cannot move it mid-job) is
  //     refused: decide() throws naming it;
  //   kFree: each tensor may take either with no bar (a job's first plan,
  //     before any placement ran).
  enum class Placement { kFixed, kMove, kFree };
  Placement placement = Placement::kFixed;
  // The ring and push/pull link model (Cluster in planner/model.h), fitted
  // to scripts/bench-ring on the emulated cluster (docs/planner.md "Ring
  // allreduce against push/pull"): the daemons' ring_chunk_bytes, the
  // per-hop latency as a multiple of the probe's small-message round trip,
  // the link shares.
  static constexpr double kRingHopRtts = 1.0;
  static constexpr double kRingLinkShare = 0.91;
  static constexpr double kPsOverhead = 0.16;
  static constexpr double kPsFaninOverhead = 0.26;
  uint64_t ring_chunk_bytes = 1 << 20;
  double ring_hop_rtts = kRingHopRtts;
  double ring_link_share = kRingLinkShare;
  double ps_overhead = kPsOverhead;
  double ps_fanin_overhead = kPsFaninOverhead;
};

// Why tensor `index` of `tensors` (declaration order) is kept uncompressed
// by `guards`: "" when no guard holds it, else the reason (the explain
// table prints it), e.g. "guard: 40 B < min_bytes 262144 B".
std::string guard_reason(const strategy::AccuracyGuards& guards,
                         const std::vector<TensorMeasure>& tensors, size_t index);

// A hand strategy the decision compares against.
struct Alternative {
  std::string name;          // "fp32", "fp16", "all:<spec>", "threshold:<spec>"
  double predicted_us = 0;   // calibrated prediction of its iteration time
  std::string strategy_yaml; // its strategy file
};

struct TensorChoice {
  std::string name;
  uint64_t bytes = 0;
  std::string option;  // Option::describe() of the chosen option
  bool excluded = false;  // matched AutoConfig::exclude (kept uncompressed)
  std::string guard;      // guard_reason(): why an accuracy guard kept it uncompressed
};

struct Decision {
  // One exact entry per tensor; meta: predicted_us, measured_us and the
  // calibration (calibration.link_gbps, .link_source, .residual_us, ...).
  Strategy strategy;
  double predicted_us = 0;  // calibrated prediction of `strategy`
  double measured_us = 0;   // the profile's iteration_us (its own strategy)
  double decision_ms = 0;   // wall time of decide()
  // "fp32", "fp16", one "all:<spec>" per accepted compressor and one
  // "threshold:<spec>" (min_compress_bytes) per accepted compressor; the
  // exclusions and the accuracy guards hold in all of them.
  std::vector<Alternative> alternatives;
  std::vector<TensorChoice> tensors;  // declaration order
  std::string timeline_json;  // predicted timeline of `strategy`, Chrome trace format
  // Hysteresis: the strategy that ran during the window is kept when the
  // search's plan is not predicted faster than it by the min_gain bar
  // (returning to uncompressed needs only to be no slower); this says why
  // ("" when the search's plan was taken).
  std::string kept_current;
  // The decision record (the daemon's RUN_DIR/plan.yaml), version: 1.
  std::string to_yaml() const;
  // Throws config::ConfigError located in `name` (the strategy inside is
  // located as "<name>: strategy").
  static Decision parse(std::string_view text, std::string name);
  // The human table: per tensor its size and option, predicted vs measured
  // iteration time, the alternatives' predictions.
  std::string explain() const;
};

// Throws Error(kInvalidArgument) naming what is wrong: an empty profile, a
// tensor of 0 elements, no iteration time, an unknown or unmeasured
// compressor spec, a compressor the CPU runtime cannot run sharded, a
// current strategy that does not parse or that names an unmeasured
// compressor, and with Placement::kMove one that runs a tensor neither
// sharded nor on the ring.
Decision decide(const NodeProfile& merged, const AutoConfig& cfg);

namespace detail {
// decide() with the simulator's shortcuts off (Evaluator::set_shortcuts):
// the same search, but every candidate it tries is simulated to its end and
// nothing is remembered, as the search ran before the shortcuts. The
// shortcuts only drop candidates that cannot beat the cutoff, so both give
// the same decision; several times slower. The tests' reference.
Decision decide_reference(const NodeProfile& merged, const AutoConfig& cfg);
// What the search leaves on the table: the largest fraction of the
// predicted iteration (before the min_gain bar) that changing one tensor's
// option would still save. The search moves runs of equal-sized tensors,
// not each of them; the tests hold this small.
double best_single_move_gain(const NodeProfile& merged, const AutoConfig& cfg);
}  // namespace detail

// The option decide() emits for a spec ("none", "fp16", "efsignsgd",
// "topk:0.01"): hierarchical, intra reduce_broadcast, on the CPU; additive
// compressors under reduce_scatter_allgather (compressed-domain sum), the
// others under alltoall_allgather (the servers recompress the sum, error
// feedback on where the compressor has it). Every one maps to
// strategy::Placement::kSharded. Throws Error(kInvalidArgument) for an
// unknown compressor or bad parameters.
Option sharded_option(std::string_view spec);
// The option decide() emits for a tensor on the daemons' ring: "none",
// "fp16" or "bf16" under inter: allreduce (Placement::kRing). Throws
// Error(kInvalidArgument) for any other spec.
Option ring_option(std::string_view spec);

}  // namespace bytecomp::planner::online
