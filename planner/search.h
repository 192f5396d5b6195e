// Decision algorithms (paper section 4.4), baselines, exact solver and the
// Upper Bound.
//
// Thread-safety: functions take the Problem by reference and must not run
// concurrently on the same Problem (its chain cache).
#pragma once

#include <algorithm>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "planner/simulator.h"

namespace bytecomp::planner {

struct PlanStats {
  // Wall-clock times; the *_cpu_ms twins count this thread's CPU time only,
  // which is what to compare on a loaded machine.
  double decision_ms = 0;       // Algorithm 1 + 2 (the paper's Table 5 figure)
  double decision_cpu_ms = 0;
  double total_ms = 0;          // + refinement and baseline restarts
  double total_cpu_ms = 0;
  double algorithm1_ms = 0;
  double algorithm2_ms = 0;
  uint64_t simulations = 0;
  int tensors_examined = 0;     // by Algorithm 1 before the bubbles were gone
  int offload_groups = 0;       // Algorithm 2 groups
  int split_tensors = 0;        // tensors of the plan split between CPU and GPU
  int pieced_tensors = 0;       // tensors of the plan with Option::pieces > 1
};

struct PlanOptions {
  // After Algorithms 1 and 2, sweep every tensor over the whole option set
  // (GPU and CPU) until nothing improves (at most this many rounds).
  int refine_rounds = 2;
  // Algorithm 1 examines at most this many non-dominated GPU options per
  // tensor (those loading links and GPU least); 0 = all of them.
  int max_gpu_candidates = 0;
  // Start from the best baseline as well and keep the better plan.
  bool consider_baselines = true;
  // Each refinement round tries splitting this many of the tensors with the
  // most GPU compression time between CPU and GPU (Option::cpu_share,
  // partial offloading: our extension of Algorithm 2, run after it and not
  // counted in the decision time); 0 = never split. A handful carries nearly
  // all the GPU compression time of the paper's models.
  size_t split_tensors = 4;
  // Last step of the planner: the tensors with the longest chains (this
  // many) try being cut into 2, 4 or 8 pipelined slices (Option::pieces)
  // and keep the count that shortens the iteration most; 0 = never. It runs
  // after everything else and only commits improvements, so a plan with
  // pieces is never longer than the same plan without them.
  size_t pieces_tensors = 4;
};

// The planner: Algorithm 1 (GPU options, bubble elimination, size groups
// descending, closest to output first), Algorithm 2 (CPU offloading by
// groups of equal size and option), then refinement.
Assignment plan(Problem& p, const PlanOptions& opts = {}, PlanStats* stats = nullptr);

enum class Baseline { kFp32, kBytePSCompress, kHiPress, kHiTopKComm };
const char* to_string(Baseline b);
constexpr Baseline kBaselines[] = {Baseline::kFp32, Baseline::kBytePSCompress,
                                   Baseline::kHiPress, Baseline::kHiTopKComm};
// A fixed strategy; tensors below `min_compress_bytes` stay uncompressed
// (BytePS-Compress and HiPress only; HiTopKComm compresses every tensor).
// Returns an empty assignment when the problem's option set lacks the
// baseline's options (e.g. GPU compression forbidden).
Assignment baseline(Problem& p, Baseline b, uint64_t min_compress_bytes = 1 << 20);

// Exhaustive depth-first search with branch and bound over the decision
// tree; gives up (returns empty) after `max_leaves` complete assignments.
// Its incumbent is the planner's plan without pipelining (pieces_tensors 0;
// cpu_share splits included), so the result is the better of the tree's
// optimum and that plan: the search space of the planner before its
// pipelining step.
Assignment exact(Problem& p, double* best_value, uint64_t max_leaves = 50'000'000);

// The paper's Upper Bound: the planner on a copy where compression is free
// and causes no contention. Returns the iteration time.
double upper_bound_us(const Problem& p);

// A random small instance for quality studies: `tensors` tensors of 10^2 to
// 10^7 elements with random gaps, 2 machines x 2 GPUs with random link
// speeds and cores, one of randomk/dgc/efsignsgd (fp16 excluded so that the
// exact solver stays fast).
Problem random_small_problem(std::mt19937& rng, const CostTable& costs, int tensors = 3);

// Strategy file for a plan: one exact entry per tensor.
Strategy to_strategy(const Problem& p, const Assignment& a);

// ---- the online planner's search (planner/online.h decide(); refine.cc)

// A change of strategy is kept only when it shortens the predicted
// iteration by more than the model's resolution: the fits and the
// calibration are not better than this, and a "gain" below it (a
// 64-element vector compressed on a saturated link) is noise that costs
// accuracy and server work for nothing.
constexpr double kMinGainFraction = 1e-3;
constexpr double kMinGainUs = 5.0;
// The resolution at a predicted iteration of `us` microseconds.
constexpr double resolution_us(double us) { return std::max(kMinGainUs, kMinGainFraction * us); }

// Coordinate descent over the candidate options from `start`: first whole
// groups of equal-sized tensors (what Algorithm 2 moves together; a tensor
// of a size of its own is a group of one), largest first, then runs of a
// group's members from either end in ready order and single tensors of a
// size of their own, keeping only changes that beat the resolution. From a
// hand strategy (`cleanup`: uniform, so what it can improve on is whole
// groups) the group moves only, then tensors whose compression gains less
// than the resolution go back to none (option 0).
// `cands[i]`: tensor i's candidate option indices (problem order);
// `by_size`: the tensors by element count, largest first; `shortcuts`:
// Evaluator::set_shortcuts. Returns the assignment and its value.
// Groups are tensors of equal element count AND equal candidate sets (a
// running job's ring tensors and sharded ones choose among different
// options). `plain[o]`: the uncompressed option of option o's placement,
// what the cleanup reverts to (empty: option 0 for every option).
std::pair<Assignment, double> refine_groups(Problem& p, const std::vector<std::vector<int>>& cands,
                                            const std::vector<int>& by_size, Assignment start,
                                            bool cleanup, bool shortcuts,
                                            const std::vector<int>& plain = {});

}  // namespace bytecomp::planner
