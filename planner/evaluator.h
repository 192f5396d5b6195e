// The timeline simulator F(S) (paper section 4.3) over a Problem's chains.
//
// Scheduling (what the runtime does): gradients become ready in backward
// order; each operation starts at the earliest time its input is ready and
// its resource has room for it (first come, first served, a later operation
// may use an idle gap that fits). Backward computation runs on the GPU except
// while GPU compression kernels run. The iteration ends when the forward pass
// (a constant) plus the later of the backward end and the last tensor's
// decompression has passed.
//
// Thread-safety: Evaluator is thread-bound (and mutates its Problem's chain
// cache).
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "planner/chains.h"
#include "planner/trace.h"

namespace bytecomp::planner {

// An assignment: option index per tensor.
using Assignment = std::vector<int>;

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
  // soon as the value is known to be >= cutoff. Answers are remembered until
  // the base changes: a sweep that re-tries a tensor against the base it
  // was last tried on (the last round of a coordinate descent, which finds
  // nothing) simulates nothing.
  double try_option(int i, int opt, double cutoff = std::numeric_limits<double>::infinity());
  // F of the base with several tensors changed (sorted by tensor index).
  double try_changes(const std::vector<std::pair<int, int>>& changes,
                     double cutoff = std::numeric_limits<double>::infinity());
  // The shortcuts of try_option() and try_changes() that cannot change an
  // answer below the cutoff: ending a run once a lower bound of F (the
  // prefix's latest completion, the work left on a resource) reaches the
  // cutoff, ending it where what is pending is the base's shifted in time
  // (shifted_base()), and remembering try_option()'s answers until the base
  // changes.
  // Off, every run goes to its end (or to a drained timeline, whose rest is
  // the base's shifted: that is how F is computed) and nothing is
  // remembered: the reference the tests hold the shortcuts to. On by
  // default.
  void set_shortcuts(bool on) { shortcuts_ = on; }
  // Accept a change into the base.
  void commit(int i, int opt);
  // Lower bound of F for any assignment: forward + backward without
  // contention + the fastest possible tail of the last tensor.
  // (Computed on first use: it builds every option's chain of the last
  // tensor.)
  double lower_bound();
  uint64_t simulations() const { return simulations_; }
  // try_option() calls answered from memory.
  uint64_t remembered() const { return remembered_; }
  // Runs ended because the rest of the timeline is the base's shifted
  // (shifted_base(), a shortcut).
  uint64_t shifted() const { return shifted_; }

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
  // True when, with tensors < j simulated, what is still pending once
  // tensor j - 1's gradient is ready (each resource's idle gaps and last end
  // from then on) is the base's at boundary j shifted by the difference of
  // the two backward passes' progress: the simulation is invariant under a
  // shift of time, so the rest of the timeline is the base's shifted.
  // (drained() is the case of nothing pending, checked without the record.)
  bool shifted_base(int j) const;
  // Records the base's pending state at boundary j (the state holds exactly
  // the base's tensors < j).
  void record_pending(int j);
  // True when, with tensors < j simulated and the base's options for the
  // rest, F is certainly >= cutoff: a lower bound from the work left on
  // each resource (the base's operations of tensors >= j, and on the GPU
  // the backward pass left), which can only run after tensor j - 1's
  // gradient is ready, in that resource's idle time.
  bool cannot_beat(int j, double cutoff) const;
  // Records drained(), compute ends and suffix ends of the base from tensor
  // `from` on (state must hold exactly the base's tensors < from).
  void refresh_base_info(int from);

  Problem& p_;
  Assignment base_;
  std::vector<double> base_compute_end_;  // per tensor
  std::vector<char> base_drained_;        // per boundary 0..n
  std::vector<double> base_suffix_end_;   // per boundary: max(done of >= j, backward end)
  using Work = std::array<double, kResources>;
  std::vector<Work> base_work_;           // per boundary: time on each resource of tensors >= j
  std::vector<double> base_done_;         // per tensor
  std::vector<Work> base_tensor_work_;    // per tensor: time on each resource
  std::vector<double> rest_backward_;     // per boundary: backward time of tensors >= j
  // The base's pending state per boundary j (shifted_base()), times relative
  // to tensor j - 1's gradient: resource r's gaps are
  // pending_gaps_[pending_off_[j * kResources + r] ..
  // pending_off_[j * kResources + r + 1]), its last end pending_last_[j][r].
  std::vector<Gap> pending_gaps_;
  std::vector<uint32_t> pending_off_;
  std::vector<Work> pending_last_;
  std::vector<char> pending_kept_;  // per boundary: recorded (not too much pending)
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
  // try_option()'s answers for the base of `base_version_`, per tensor and
  // option. A finite value is F itself (a run that is not cut off gives the
  // same value whatever the cutoff); +inf only says F >= cutoff.
  struct Tried {
    uint64_t version = 0;  // 0: never (versions start at 1)
    double cutoff = 0, value = 0;
  };
  std::vector<std::vector<Tried>> tried_;
  uint64_t base_version_ = 1;
  uint64_t remembered_ = 0;
  uint64_t shifted_ = 0;
  bool shortcuts_ = true;
};

}  // namespace bytecomp::planner
