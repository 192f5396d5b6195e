#include "planner/strategy/answer.h"
#include "planner/strategy/partition.h"
#include "daemon/engine_ps.h"

#include <algorithm>
#include <cstring>

#include "compress/reduce.h"
#include "daemon/client_payload.h"
#include "daemon/counting_compressor.h"

namespace bytecomp::daemon {

PsPath::PsPath(const PathContext& ctx, std::shared_ptr<server::PsJob> ps,
               std::shared_ptr<const void> keep_mapped)
    : ctx_(ctx), ps_(std::move(ps)), keep_mapped_(std::move(keep_mapped)) {
  ps_parts_.resize(ctx_.tensors->size());
  for (size_t t = 0; t < ps_parts_.size(); ++t) {
    // Per unit (server::unit_partition_bytes: a fused bucket's equal shards,
    // else its pieces), as assign_partitions cut it.
    const uint64_t pb = ctx_.partition_bytes.at(t);
    ps_parts_[t].resize(static_cast<size_t>(((*ctx_.tensors)[t].bytes() + pb - 1) / pb));
  }
}

PsPath::PsPart& PsPath::ps_part(const Task& t) {
  PsPart& part = ps_parts_.at(t.tensor).at(t.index);
  // The round's plan, the same on every node and server (strategy changes
  // are announced by the coordinator ahead of time).
  const strategy::TensorPlan& plan = *t.plan;
  if (!(plan == part.plan) || (plan.compressed_push() && !part.compressor) ||
      (plan.pull == strategy::PullFormat::kCompressed && !part.compressor)) {
    part.plan = plan;
    part.compressor.reset();
    part.state.reset();
    if (plan.compressed_push()) {
      part.compressor = compress::make_compressor(plan.spec());
    }
  }
  return part;
}

std::optional<ExecutionPath::LinkCharge> PsPath::link_charge(const Task& t) {
  const server::Partition* p = ps_->info().assignment.find(t.key);
  if (p == nullptr) return std::nullopt;  // start() fails the job, naming it
  PsPart& part = ps_part(t);
  const uint64_t bytes = part.compressor
                             ? part.compressor->max_compressed_bytes(static_cast<size_t>(t.count))
                             : t.bytes();
  return LinkCharge{p->server, bytes};
}

void PsPath::start(const Task& t, std::span<char* const> bufs) {
  const TensorSpec& spec = (*ctx_.tensors)[t.tensor];
  const uint32_t index = t.index;
  const uint64_t key = t.key;
  const server::Partition* p = ps_->info().assignment.find(key);
  const auto n = static_cast<size_t>(t.count);
  if (p == nullptr || p->offset * 4 != t.begin || p->count != n) {
    throw Error(ErrorCode::kInternal, "partition " + std::to_string(index) + " of tensor '" +
                                          spec.name + "' does not match the servers' assignment");
  }
  PsPart& part = ps_part(t);
  PhaseLog& phases = *ctx_.phases;
  transport::Buffer payload;
  if (t.compressed) {
    // Pushed as the client compressed it (its own error feedback): with one
    // local rank its payload is the node's.
    check_forwardable(t, spec.name, part.plan.compressed_push() && part.compressor != nullptr,
                      bufs.size());
    const std::span<const std::byte> p = client_payload(t, spec.name, 0, bufs[0], *part.compressor);
    if (ctx_.bytes) ctx_.bytes->add(n * 4, p.size());
    payload = transport::Buffer::copy_of(p.data(), p.size());
    phases.stamp(t.tensor, index, t.iteration, Phase::kReduced);
  } else {
    ctx_.reducer->sum_to_first(spec.dtype, bufs, t.begin, t.end);
    phases.stamp(t.tensor, index, t.iteration, Phase::kReduced);
  }
  const float* sum = reinterpret_cast<const float*>(bufs[0] + t.begin);
  if (t.compressed) {
    // payload set above
  } else if (part.plan.compressed_push()) {
    if (!part.state) part.state = part.compressor->make_state(n);
    std::vector<std::byte> out(part.compressor->max_compressed_bytes(n));
    compress::CompressContext cctx;
    cctx.iteration = t.iteration;
    cctx.shared_seed = strategy::partition_seed(ps_->info().name, key);
    cctx.private_seed = strategy::node_private_seed(cctx.shared_seed, ps_->info().rank);
    const size_t len =
        part.compressor->compress(compress::ConstTensorView::cpu(sum, n), out, *part.state, cctx);
    if (ctx_.bytes) ctx_.bytes->add(n * 4, len);
    out.resize(len);
    payload = transport::Buffer::take(std::move(out));
  } else if (keep_mapped_) {
    // Zero-copy from rank 0's buffer; the release keeps the segment mapped
    // while the transport holds the bytes (a job may end meanwhile). The
    // range is next written when this partition's pull answers, which the
    // server does only after it received every byte of this push.
    payload = transport::Buffer::wrap(sum, n * 4, [keep = keep_mapped_] {});
  } else {
    // No keep-alive given (the segment's owner cannot share it): copy.
    payload = transport::Buffer::copy_of(sum, n * 4);
  }
  phases.stamp(t.tensor, index, t.iteration, Phase::kCompressed);
  // Before the push: once the pull is issued its answer may be delivered
  // (the Inbox's time is kArrived) before this thread stamps anything.
  phases.stamp(t.tensor, index, t.iteration, Phase::kSent);
  std::weak_ptr<Inbox> inbox = ctx_.inbox;
  ps_->push(key, t.iteration, std::move(payload),
            [inbox, name = spec.name, bytes = t.bytes(), link = t.link,
             link_bytes = t.link_bytes](const Status& s) {
              auto i = inbox.lock();
              if (!i) return;
              if (s.ok()) {
                i->acked(bytes, link, link_bytes);
              } else {
                i->fail(Status(s.code(), "push of tensor '" + name + "' failed: " + s.message()));
              }
            });
  ps_->pull(key, t.iteration, [inbox, t](const Status& s, transport::Buffer result) {
    if (auto i = inbox.lock()) {
      i->deliver({t, s, std::move(result)});
    }
  });
}

std::string PsPath::finish(const Inbox::Arrival& a, std::span<char* const> bufs) {
  const Task& t = a.task;
  const auto n = static_cast<size_t>(t.count);
  float* out = reinterpret_cast<float*>(bufs[0] + t.begin);
  PsPart& part = ps_parts_[t.tensor][t.index];
  PhaseLog& phases = *ctx_.phases;
  try {
    compress::CompressContext cctx;
    cctx.iteration = t.iteration;
    strategy::decode_answer(part.plan.pull, a.result.span(), out, n, part.compressor.get(), cctx);
    phases.stamp(t.tensor, t.index, t.iteration, Phase::kDecompressed);
    ctx_.reducer->copy_from_first(bufs, t.begin, t.end);
    phases.stamp(t.tensor, t.index, t.iteration, Phase::kCopiedOut);
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

}  // namespace bytecomp::daemon
