#include "planner/strategy/partition.h"
#include "daemon/engine_local.h"

#include <functional>

#include "common/log.h"
#include "daemon/client_payload.h"

namespace bytecomp::daemon {

BC_LOG_CATEGORY(LogEngineLocal, "daemon.engine");

LocalPath::LocalPath(const PathContext& ctx, uint32_t node_rank,
                     const strategy::Timeline::Entry& start)
    : ctx_(ctx), node_rank_(node_rank), runs_(ctx.tensors->size()) {
  for (uint32_t t = 0; t < runs_.size(); ++t) follow(t, start);
}

void LocalPath::follow(uint32_t t, const strategy::Timeline::Entry& in_force) {
  Run& run = runs_[t];
  if (run.from && *run.from == in_force.first) return;
  run.from = in_force.first;
  const TensorPlan& plan = (*in_force.plans).at(t);
  run.states.clear();
  run.scratch.clear();
  if (plan.compressor) {
    const uint64_t bytes = (*ctx_.tensors)[t].bytes();
    const uint64_t pb = ctx_.partition_bytes.at(t);
    for (uint64_t b = 0; b < bytes; b += pb) {
      const size_t n = static_cast<size_t>((std::min(bytes, b + pb) - b) / 4);
      run.states.push_back(plan.compressor->make_state(n));
      run.scratch.emplace_back(plan.compressor->max_compressed_bytes(n));
    }
  }
  BC_LOG(LogEngineLocal(), kDebug) << "job " << ctx_.job << " tensor '" << (*ctx_.tensors)[t].name
                                   << "': " << plan.describe();
  run.plan = plan;
}

void LocalPath::start(const Task& t, std::span<char* const> bufs) {
  Run& run = runs_[t.tensor];
  const TensorSpec& spec = (*ctx_.tensors)[t.tensor];
  IntraNodeReducer& reducer = *ctx_.reducer;
  PhaseLog& phases = *ctx_.phases;
  // Distinct partitions own distinct states and scratch buffers, so tasks of
  // one tensor run in parallel safely.
  const size_t part = t.index;
  const uint32_t index = t.index;
  if (t.compressed) {
    // The ranks compressed (and kept their error feedback) themselves: the
    // node's aggregate is the sum of their decoded payloads.
    if (!run.plan.compressor) {
      throw Error(ErrorCode::kInvalidArgument,
                  compressed_refusal(t, spec.name, "the plan in force does not compress it"));
    }
    compress::CompressContext cctx;
    cctx.iteration = t.iteration;
    cctx.shared_seed = strategy::partition_seed(ctx_.job, t.key);
    cctx.private_seed = strategy::node_private_seed(cctx.shared_seed, node_rank_);
    decode_sum_to_first(t, spec.name, bufs, *run.plan.compressor, cctx);
    if (phases.enabled()) {
      const uint64_t now = monotonic_ns();
      for (Phase p : {Phase::kReduced, Phase::kCompressed, Phase::kSent, Phase::kArrived,
                      Phase::kDecompressed})
        phases.stamp(t.tensor, index, t.iteration, p, now);
    }
    reducer.copy_from_first(bufs, t.begin, t.end);
    phases.stamp(t.tensor, index, t.iteration, Phase::kCopiedOut);
    return;
  }
  if (!run.plan.compressor) {
    reducer.reduce(spec.dtype, bufs, t.begin, t.end);
    if (phases.enabled()) phases.stamp_through(t.tensor, index, t.iteration, Phase::kReduced, monotonic_ns());
    return;
  }
  reducer.sum_to_first(spec.dtype, bufs, t.begin, t.end);
  phases.stamp(t.tensor, index, t.iteration, Phase::kReduced);
  float* sum = reinterpret_cast<float*>(bufs[0] + t.begin);
  const auto n = static_cast<size_t>(t.count);
  compress::CompressContext cctx;
  cctx.iteration = t.iteration;
  // Same on every node for this tensor partition (randomk's indices), and
  // private per node for stochastic rounding.
  cctx.shared_seed = strategy::partition_seed(ctx_.job, t.key);
  cctx.private_seed = strategy::node_private_seed(cctx.shared_seed, node_rank_);
  std::vector<std::byte>& wire = run.scratch[part];
  const size_t len = run.plan.compressor->compress(compress::ConstTensorView::cpu(sum, n), wire,
                                                   *run.states[part], cctx);
  if (phases.enabled()) {
    // No inter-node phase: sent and arrived when compressed.
    const uint64_t now = monotonic_ns();
    phases.stamp(t.tensor, index, t.iteration, Phase::kCompressed, now);
    phases.stamp(t.tensor, index, t.iteration, Phase::kSent, now);
    phases.stamp(t.tensor, index, t.iteration, Phase::kArrived, now);
  }
  // Inter-node phase: with one node the aggregate of the compressed
  // partitions is this node's own.
  run.plan.compressor->decompress(std::span<const std::byte>(wire.data(), len),
                                  compress::TensorView::cpu(sum, n), false, cctx);
  phases.stamp(t.tensor, index, t.iteration, Phase::kDecompressed);
  reducer.copy_from_first(bufs, t.begin, t.end);
  phases.stamp(t.tensor, index, t.iteration, Phase::kCopiedOut);
}

std::string LocalPath::finish(const Inbox::Arrival& a, std::span<char* const>) {
  return "the local path got an arrival for tensor " + std::to_string(a.task.tensor) +
         " (it finishes its tasks in start())";
}

}  // namespace bytecomp::daemon
