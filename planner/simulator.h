// Cost models and the timeline simulator F(S) (paper section 4.3).
//
// Each option of a tensor becomes a chain of operations, each on one
// resource of a (representative) machine: the GPU (compression kernels, which
// delay the backward computation), the CPU pool (compression on the spare
// cores, work divided over them), the intra-node link and the inter-node link.
// Communication costs follow the ring/tree analysis of Thakur et al. and
// NCCL's notes: latency per step plus bytes over bandwidth, PS traffic divided
// over servers. See docs/planner.md.
//
// Scheduling (what the runtime does): gradients become ready in backward
// order; each operation starts at the earliest time its input is ready and
// its resource has room for it (first come, first served, a later operation
// may use an idle gap that fits). Backward computation runs on the GPU except
// while GPU compression kernels run. The iteration ends when the forward pass
// (a constant) plus the later of the backward end and the last tensor's
// decompression has passed.
//
// Thread-safety: Problem is immutable after construction except for its
// chain cache and the split and pipelined options it adds on demand
// (split_option, pieces_option); not thread-safe: one Problem per thread.
// Evaluator is thread-bound.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "planner/model.h"
#include "planner/options.h"
#include "planner/strategy/strategy.h"

namespace bytecomp::planner {

enum class Resource : uint8_t { kGpu = 0, kCpu = 1, kIntra = 2, kInter = 3 };
constexpr int kResources = 4;
const char* to_string(Resource r);

// A chain is a sequence of operations, each starting when the previous one
// ends. A fork (duration < 0) ends one sequence and starts another from the
// chunk's ready time: an option with Option::cpu_share runs its CPU part and
// its GPU part as two such sequences (groups), placed one after the other.
// A slice marker (duration kSliceMark) starts another sequence of the same
// group: the slices of Option::pieces. The simulator interleaves the
// sequences of a group, always placing next the operation whose input is
// ready first (what a runtime's FIFO queue per resource does), so slice 1
// is compressed while slice 0 is on the wire.
constexpr double kForkMark = -1.0;
constexpr double kSliceMark = -2.0;
struct Op {
  Resource resource;
  double duration_us;
  const char* what;  // static string: "compress", "reduce_scatter", ...
  bool fork() const { return duration_us < 0; }
  bool slice() const { return duration_us < -1.5; }
};
// Time from the chain's start to its last operation's end on idle resources
// (the longest of its forked groups; a group of slices scheduled as the
// simulator does).
double chain_latency(const std::vector<Op>& ops);

// One tensor partition (or the whole tensor) of the simulation.
struct Chunk {
  int tensor;            // index into the profile
  uint64_t elements;
};

class Problem {
 public:
  Problem(Profile profile, Cluster cluster, CostTable costs, CompressorSpec compressor,
          Constraints constraints = {});

  const Profile& profile() const { return profile_; }
  const Cluster& cluster() const { return cluster_; }
  const CostTable& costs() const { return costs_; }
  const CompressorSpec& compressor() const { return spec_; }
  const Constraints& constraints() const { return constraints_; }
  const std::vector<Option>& options() const { return options_; }
  const std::vector<Chunk>& chunks() const { return chunks_; }
  // chunk indices of tensor i: [first_chunk(i), first_chunk(i+1))
  int first_chunk(int tensor) const { return chunk_begin_[tensor]; }
  int tensors() const { return static_cast<int>(profile_.tensors.size()); }

  // The operation chain of option `opt` on `elements` elements (cached).
  const std::vector<Op>& chain(uint64_t elements, int opt);
  // The same for chunk `c` (no lookup by size: the hot path of F).
  const std::vector<Op>& chunk_chain(int c, int opt) {
    auto& v = by_size_[chunk_size_id_[c]][opt];
    if (v.empty()) v = chain(chunks_[c].elements, opt);
    return v;
  }
  // Builds the chain into `out` without caching it (cheap summaries).
  void chain_into(uint64_t elements, int opt, std::vector<Op>& out) const;
  // Option index of an option equal to `o`, or -1.
  int find_option(const Option& o) const;
  // The decision tree's options are indices [0, tree_options()); options
  // added later (split variants) follow them.
  int tree_options() const { return tree_options_; }
  // Index of option `base` with cpu_share = share (0 < share < 1), added to
  // the option set on first use; -1 when the split is not a valid option
  // (uncompressed, no GPU device, CPU forbidden or no CPU cost figures).
  int split_option(int base, double share);
  // Index of option `base` cut into `pieces` pipelined slices
  // (Option::pieces; 1 gives the unpipelined variant), added on first use;
  // -1 when `pieces` is not allowed or the search is restricted to the CPU
  // runtime (which pipelines by its own partitions).
  int pieces_option(int base, int pieces);
  // Whether option `opt` has pieces > 1 (a compact copy for the
  // simulator's hot path).
  bool pieced(int opt) const { return pieced_[opt] != 0; }
  // A copy where compression costs nothing and causes no contention (the
  // paper's Upper Bound setting).
  Problem zero_cost_copy() const;
  double forward_us() const { return profile_.forward_or_default_us(); }

 private:
  std::vector<Op> build_chain(uint64_t elements, const Option& o) const;
  void build_chain_into(uint64_t elements, const Option& o, std::vector<Op>& ops) const;
  // Split (cpu_share) and pipelined (pieces) options: several sequences
  // (kept out of build_chain_into, the hot path of the search).
  [[gnu::noinline]] void build_composite(uint64_t elements, const Option& o,
                                         std::vector<Op>& ops) const;
  Profile profile_;
  Cluster cluster_;
  CostTable costs_;
  CompressorSpec spec_;
  Constraints constraints_;
  std::vector<Option> options_;
  int tree_options_ = 0;
  std::vector<uint8_t> pieced_;  // per option: pieces > 1
  std::vector<Chunk> chunks_;
  std::vector<int> chunk_begin_;
  std::map<uint64_t, std::vector<std::vector<Op>>> cache_;
  std::vector<int> chunk_size_id_;
  std::vector<std::vector<std::vector<Op>>> by_size_;
};

// An assignment: option index per tensor.
using Assignment = std::vector<int>;

struct TraceEvent {
  std::string name;
  std::string what;
  Resource resource;
  bool compute = false;
  double start_us = 0, end_us = 0;
};

struct Timeline {
  double iteration_us = 0;
  double backward_end_us = 0;   // relative to backward start
  double comm_end_us = 0;       // last decompression / collective
  std::vector<TraceEvent> events;
  // Chrome trace JSON (Perfetto / chrome://tracing).
  std::string chrome_trace_json() const;
};

// Incremental evaluator of F(S). Holds the simulated state of a base
// assignment so that changing one tensor re-simulates only the tensors from
// it onward (tensors before it are unaffected: operations never move
// earlier ones).
class Evaluator {
 public:
  explicit Evaluator(Problem& p);

  // Full simulation; optionally records the timeline.
  double evaluate(const Assignment& a, Timeline* timeline = nullptr);

  // Sets the base assignment (simulated lazily).
  void set_base(const Assignment& a);
  const Assignment& base() const { return base_; }
  double base_value();
  // F of the base with tensor i's option replaced by `opt`; returns +inf as
  // soon as the value is known to be >= cutoff.
  double try_option(int i, int opt, double cutoff = std::numeric_limits<double>::infinity());
  // F of the base with several tensors changed (sorted by tensor index).
  double try_changes(const std::vector<std::pair<int, int>>& changes,
                     double cutoff = std::numeric_limits<double>::infinity());
  // Accept a change into the base.
  void commit(int i, int opt);
  // Lower bound of F for any assignment: forward + backward without
  // contention + the fastest possible tail of the last tensor.
  // (Computed on first use: it builds every option's chain of the last
  // tensor.)
  double lower_bound();
  uint64_t simulations() const { return simulations_; }

  // Low-level stepping for depth-first searches (the exact solver): the
  // state holds tensors [0, depth()); push() simulates the next tensor and
  // returns the latest completion so far; pop_to() drops tensors >= i.
  void reset() { rollback(0); base_value_ = -1; }
  int depth() const { return prefix_; }
  double push(int opt) { simulate_tensor(prefix_, opt, nullptr); return prefix_done_[prefix_]; }
  void pop_to(int i) { rollback(i); }
  double compute_end(int i) const { return compute_end_[i]; }

 private:
  // Each resource is its idle gaps before `last_end` (sorted, disjoint)
  // plus the free tail after it. Changes are logged per tensor so that the
  // state of tensors >= i can be undone in O(changes) (tensors are simulated
  // in order, so the log is a stack).
  struct Gap {
    double start, end;
  };
  struct ResourceState {
    std::vector<Gap> gaps;
    double last_end = 0;
  };
  // Only backfills are logged; tail placements (the common case) are undone
  // from a per-tensor snapshot of each resource's gap count and last end.
  enum class UndoKind : uint8_t { kSet, kInserted, kErased };
  struct Snapshot {
    double last_end[kResources];
    uint32_t gaps[kResources];
  };
  struct Undo {
    int tensor;
    uint8_t resource;
    UndoKind kind;
    int index;
    Gap old;
  };
  void rollback(int tensor);           // drop state of tensors >= tensor
  // Simulates tensor i with option opt from the current prefix; returns its
  // done time and updates compute end.
  double simulate_tensor(int i, int opt, Timeline* tl);
  // The chains of a pipelined option (Option::pieces), slices interleaved;
  // returns the done time (kept out of simulate_tensor's hot loop).
  [[gnu::noinline]] double simulate_slices(int i, int opt, double ready, Timeline* tl);
  double place(Resource r, double ready, double dur, int tensor);
  double run_compute(double start, double gap) const;
  double run_suffix(int from, const std::pair<int, int>* changes, size_t nchanges,
                    double cutoff);

  // True when, with tensors < j simulated, every resource is idle once
  // tensor j's gradient is ready: the rest of the timeline is then a pure
  // time shift of what follows in any assignment that agrees from j on.
  bool drained(int j) const;
  // Records drained(), compute ends and suffix ends of the base from tensor
  // `from` on (state must hold exactly the base's tensors < from).
  void refresh_base_info(int from);

  Problem& p_;
  Assignment base_;
  std::vector<double> base_compute_end_;  // per tensor
  std::vector<char> base_drained_;        // per boundary 0..n
  std::vector<double> base_suffix_end_;   // per boundary: max(done of >= j, backward end)
  std::vector<double> base_inter_work_;   // per boundary: inter-link time of tensors >= j
  std::vector<double> base_done_;         // per tensor
  std::vector<double> base_inter_;        // per tensor: inter-link time
  int base_info_from_ = 0;                // info valid for boundaries <= this... see .cc
  ResourceState res_[kResources];
  std::vector<Undo> log_;
  std::vector<Snapshot> snap_;  // per tensor, taken before simulating it
  std::vector<double> compute_end_;   // per tensor
  std::vector<double> prefix_done_;   // max done of tensors < i (size n+1)
  int prefix_ = 0;                    // state holds tensors [0, prefix_)
  double base_value_ = -1;
  double lower_bound_ = -1;
  uint64_t simulations_ = 0;
};

}  // namespace bytecomp::planner
