// A job's strategy over time: the one type every holder of "the plans in
// force at iteration i" keeps (the servers' rounds, each node's PS client,
// the peer path, the local engine, the coordinator), and the one function
// that turns a strategy's YAML into the plans of a job's tensors.
//
// A change is parsed and mapped once, where it enters a process (admission,
// kStrategyPrepare, kStrategyUpdate, a local set_plans); every reader then
// shares the same immutable plan vector.
//
// Thread-safety: Timeline is thread-safe (one mutex, held for a lookup or an
// insertion; never calls out while holding it except the admission check of
// add(), which must not call back into the timeline). plans_for() is pure.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "planner/strategy/plan.h"

namespace bytecomp::strategy {

// Every tensor's plan under one strategy; shared by every reader.
using Plans = std::shared_ptr<const std::vector<TensorPlan>>;

// `yaml` (empty: the default strategy, every tensor uncompressed over the
// servers) parsed once and mapped for every tensor.
//   Scope::kCluster (servers, coordinator, a node's PS client): every tensor
//     must be float32 (the servers sum fp32; half precision is an fp16/bf16
//     compressor). A peer (allgather) tensor's plan carries the compressor
//     the daemons run themselves, with the option's error feedback.
//   Scope::kNode (a one-node job): make_plans()'s rules.
// Throws Error(kInvalidArgument) / config::ConfigError naming `source`, the
// tensor or the YAML location.
std::vector<TensorPlan> plans_for(Scope scope, std::span<const PlanTensor> tensors,
                                  std::string_view yaml, const std::string& source);

class Timeline {
 public:
  struct Entry {
    uint64_t first = 0;  // first iteration the plans apply to
    Plans plans;
    // The strategy they were made from ("" = default). Shared, so that a
    // reader on the data path (the engine, once per round) copies no text.
    std::shared_ptr<const std::string> yaml;
  };

  Timeline(uint64_t start_iteration, std::vector<TensorPlan> plans, std::string yaml = {});

  // The entry in force at `iteration`: the last one starting at or before
  // it (the first entry for earlier iterations). When `frozen` is given it is
  // set to `iteration` under the lock, so an add() for a later change sees
  // that this reader already fixed its plan.
  Entry at(uint64_t iteration, std::atomic<int64_t>* frozen = nullptr) const;
  // One tensor's plan from at(). Throws Error(kInvalidArgument) for a bad index.
  TensorPlan plan(uint32_t tensor, uint64_t iteration,
                  std::atomic<int64_t>* frozen = nullptr) const;
  // The newest entry (the strategy last announced).
  Entry latest() const;
  // True when no parameter server handles `tensor` at any iteration in
  // [from, to) (its plan is between_daemons there; true for an empty range):
  // a server's round of it may then skip those iterations, which went round
  // the daemons' ring. False for a bad index.
  bool off_servers(uint32_t tensor, uint64_t from, uint64_t to) const;

  // Records `plans` from `iteration` on. `admissible` (may be empty) runs
  // under the lock, atomically with the insertion, and may refuse (its
  // Status is returned, nothing recorded). A change already recorded for
  // `iteration` is kept (duplicate announcements are harmless): Ok, with
  // `*added` false.
  Status add(uint64_t iteration, std::vector<TensorPlan> plans, std::string yaml,
             const std::function<Status()>& admissible = {}, bool* added = nullptr);
  // Drops the change recorded for `iteration` (a cancelled prepare); never
  // the first entry.
  void cancel(uint64_t iteration);

  size_t tensors() const { return tensors_; }

 private:
  mutable std::mutex mu_;
  size_t tensors_ = 0;
  std::map<uint64_t, Entry> by_first_;
};

}  // namespace bytecomp::strategy
