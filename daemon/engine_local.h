// The local execution path: single-node jobs. Per partition of a compressed
// tensor: sum into local rank 0's buffer, compress (error-feedback state per
// tensor partition lives here), decompress, copy to every local rank. A job
// on one node has no inter-node phase to run: the compressed partition is
// decompressed as is, which is exactly what this node's share of a
// multi-node round does. Uncompressed tensors are summed and copied out in
// one blocked pass.
//
// Thread-safety: see ExecutionPath. follow() runs on the engine thread
// while no task of that tensor runs (between its rounds).
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "compress/compressor.h"
#include "daemon/engine_path.h"
#include "daemon/plan.h"
#include "planner/strategy/timeline.h"

namespace bytecomp::daemon {

class LocalPath final : public ExecutionPath {
 public:
  // `start`: the job's first timeline entry.
  LocalPath(const PathContext& ctx, uint32_t node_rank, const strategy::Timeline::Entry& start);

  // Before each round of `tensor`: takes its plan from `in_force` (the
  // timeline's entry for the round) when that entry is not the one it runs,
  // with fresh per-partition state.
  void follow(uint32_t tensor, const strategy::Timeline::Entry& in_force);

  const char* name() const override { return "local"; }
  bool synchronous() const override { return true; }
  void start(const Task& t, std::span<char* const> bufs) override;
  std::string finish(const Inbox::Arrival& a, std::span<char* const> bufs) override;

 private:
  struct Run {  // a tensor's current plan and its per-partition state
    TensorPlan plan;
    std::optional<uint64_t> from;  // first iteration of the timeline entry `plan` came from
    std::vector<std::unique_ptr<compress::TensorState>> states;
    std::vector<std::vector<std::byte>> scratch;
  };

  PathContext ctx_;
  uint32_t node_rank_;
  std::vector<Run> runs_;
};

}  // namespace bytecomp::daemon
