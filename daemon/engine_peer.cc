#include "planner/strategy/partition.h"
#include "daemon/engine_peer.h"

#include <algorithm>
#include <cstring>

#include "common/log.h"
#include "compress/reduce.h"
#include "daemon/client_payload.h"
#include "daemon/counting_compressor.h"

namespace bytecomp::daemon {

BC_LOG_CATEGORY(LogEnginePeer, "daemon.engine");

uint64_t plan_digest_of(const TensorPlan& plan) {
  return plan_digest(plan.compressor ? compress::to_string(plan.compressor->spec()) : "");
}

std::vector<bool> tensors_placed(const server::PsJob& ps, size_t tensors,
                                 strategy::Placement where) {
  const uint64_t first = ps.info().start_iteration;
  std::vector<bool> placed(tensors, false);
  bool any = false;
  for (uint32_t t = 0; t < tensors; ++t) {
    placed[t] = ps.timeline().plan(t, first).placement == where;
    any = any || placed[t];
  }
  if (!any) placed.clear();
  return placed;
}

PeerPath::PeerPath(const PathContext& ctx, std::shared_ptr<server::PsJob> ps,
                   std::vector<bool> peer_tensor)
    : ctx_(ctx), ps_(std::move(ps)), peer_tensor_(std::move(peer_tensor)) {}

PeerPath::~PeerPath() { close(); }

std::unique_ptr<PeerPath> PeerPath::open(const PathContext& ctx,
                                         std::shared_ptr<server::PsJob> ps,
                                         const PeerOptions& opts) {
  const server::JobInfo& info = ps->info();
  const std::vector<TensorSpec>& tensors = *ctx.tensors;
  std::vector<bool> peer_tensor = tensors_placed(*ps, tensors.size(), strategy::Placement::kPeer);
  if (peer_tensor.empty()) return nullptr;
  if (opts.hub == nullptr) {
    throw Error(ErrorCode::kUnavailable,
                "the job uses inter: allgather between daemons, but this bytecompd has no peer "
                "endpoint (set internode.peer_listen in its configuration)");
  }
  std::unique_ptr<PeerPath> path(new PeerPath(ctx, ps, std::move(peer_tensor)));
  // The plans (peer tensors' with their compressor) come with each task from
  // the job's timeline, which the PS client keeps and every announced change
  // extends: nothing to parse here.
  std::weak_ptr<Inbox> inbox = ctx.inbox;
  // Per tensor (its pieces), as the scheduler cuts it.
  const std::vector<uint64_t> pbs = ctx.partition_bytes;
  PeerJobSpec spec;
  spec.name = info.name;
  spec.uid = info.uid;
  spec.rank = info.rank;
  spec.nodes = info.nodes;
  spec.addresses = info.peer_addresses;
  spec.timeout = opts.timeout;
  std::vector<uint64_t> bytes;
  path->peer_parts_.resize(tensors.size());
  for (uint32_t t = 0; t < tensors.size(); ++t) {
    spec.tensor_names.push_back(tensors[t].name);
    bytes.push_back(tensors[t].bytes());
    const auto parts = path->peer_tensor_[t]
                           ? static_cast<uint32_t>((tensors[t].bytes() + pbs.at(t) - 1) / pbs.at(t))
                           : 0u;
    spec.partitions.push_back(parts);
    path->peer_parts_[t].resize(parts);
  }
  spec.partition_count = [bytes, pbs](uint32_t tensor, uint32_t index) -> uint64_t {
    const uint64_t pb = pbs.at(tensor);
    const uint64_t begin = uint64_t{index} * pb;
    return (std::min(bytes.at(tensor), begin + pb) - begin) / 4;
  };
  auto ready = [inbox, bytes, pbs](uint32_t tensor, uint32_t index, uint64_t iteration) {
    if (auto i = inbox.lock()) {
      const uint64_t pb = pbs[tensor];
      const uint64_t begin = uint64_t{index} * pb;
      // Only the partition's identity: finish() takes the round's plan
      // from the contributing task's record.
      Task t;
      t.tensor = tensor;
      t.index = index;
      t.key = strategy::partition_key(tensor, index);
      t.iteration = iteration;
      t.begin = begin;
      t.end = std::min(bytes[tensor], begin + pb);
      t.count = (t.end - t.begin) / 4;
      i->deliver({std::move(t), Status::Ok(), {}});
    }
  };
  auto failed = [inbox](const Status& s) {
    if (auto i = inbox.lock()) i->fail(s);
  };
  path->peer_ = opts.hub->open(std::move(spec), ready, failed);
  // Every node registered its job with its hub before any payload is sent,
  // so none is refused as belonging to an unknown job.
  if (const Status s = ps->barrier(opts.timeout); !s.ok()) {
    throw Error(s.code() == ErrorCode::kOk ? ErrorCode::kUnavailable : s.code(),
                "peer allgather: waiting for every node to open the job failed: " + s.message());
  }
  BC_LOG(LogEnginePeer(), kInfo) << "job " << ctx.job << ": allgather with "
                                 << info.nodes.size() - 1 << " peer daemon(s)";
  return path;
}

Status PeerPath::check(std::chrono::steady_clock::time_point now) {
  return peer_->check_deadlines(now);
}

void PeerPath::close() {
  if (peer_) peer_->close();
}

void PeerPath::start(const Task& t, std::span<char* const> bufs) {
  const TensorSpec& spec = (*ctx_.tensors)[t.tensor];
  const uint32_t index = t.index;
  const auto n = static_cast<size_t>(t.count);
  if (t.compressed) {
    check_forwardable(t, spec.name, t.plan->compressor != nullptr, bufs.size());
  } else {
    ctx_.reducer->sum_to_first(spec.dtype, bufs, t.begin, t.end);
  }
  PhaseLog& phases = *ctx_.phases;
  phases.stamp(t.tensor, index, t.iteration, Phase::kReduced);
  const float* sum = reinterpret_cast<const float*>(bufs[0] + t.begin);
  const TensorPlan& plan = *t.plan;
  // finish() decodes under the same plan (a round's start happens before
  // its finish, and the next round starts after both).
  peer_parts_[t.tensor][index].plan = t.plan;
  PeerHeader h;
  h.count = n;
  h.plan_digest = plan_digest_of(plan);
  transport::Buffer data;
  if (t.compressed) {
    // As the client compressed it (its own error feedback).
    const std::span<const std::byte> p =
        client_payload(t, spec.name, 0, bufs[0], *plan.compressor);
    if (ctx_.bytes) ctx_.bytes->add(n * 4, p.size());
    h.format = PeerFormat::kCompressed;
    data = transport::Buffer::copy_of(p.data(), p.size());
  } else if (plan.compressor) {
    PeerPart& part = peer_parts_[t.tensor][index];
    // A new plan starts with fresh error feedback, on every node alike.
    if (!part.state || part.digest != h.plan_digest) {
      part.state = plan.compressor->make_state(n);
      part.digest = h.plan_digest;
    }
    compress::CompressContext ctx;
    ctx.iteration = t.iteration;
    ctx.shared_seed = strategy::partition_seed(ps_->info().name, t.key);
    ctx.private_seed = strategy::node_private_seed(ctx.shared_seed, ps_->info().rank);
    std::vector<std::byte> out(plan.compressor->max_compressed_bytes(n));
    out.resize(plan.compressor->compress(compress::ConstTensorView::cpu(sum, n), out, *part.state,
                                         ctx));
    if (ctx_.bytes) ctx_.bytes->add(n * 4, out.size());
    h.format = PeerFormat::kCompressed;
    data = transport::Buffer::take(std::move(out));
  } else {
    h.format = PeerFormat::kRawFp32;
    data = transport::Buffer::copy_of(sum, n * 4);  // the segment may go away first
  }
  phases.stamp(t.tensor, index, t.iteration, Phase::kCompressed);
  // The bytes-in-flight bound is released when every peer has acknowledged
  // receipt, not when the round completes: a round completes only once
  // every node contributed, and the nodes may start partitions in different
  // orders, so a bound held until then deadlocks them (each node's bound
  // full of partitions that wait for the other's).
  // Before contributing: the round may complete (and be delivered) inside.
  phases.stamp(t.tensor, index, t.iteration, Phase::kSent);
  std::weak_ptr<Inbox> inbox = ctx_.inbox;
  peer_->contribute(t.tensor, index, t.iteration, h, std::move(data),
                    [inbox, bytes = t.bytes()] {
                      if (auto i = inbox.lock()) i->acked(bytes);
                    });
}

std::string PeerPath::finish(const Inbox::Arrival& a, std::span<char* const> bufs) {
  const Task& t = a.task;
  const uint32_t index = t.index;
  const auto n = static_cast<size_t>(t.count);
  float* out = reinterpret_cast<float*>(bufs[0] + t.begin);
  const uint32_t self = ps_->info().rank;
  const auto& nodes = ps_->info().nodes;
  auto who = [&](uint32_t r) {
    return "node " + std::to_string(nodes.at(r)) + " (rank " + std::to_string(r) + ")";
  };
  try {
    std::vector<PeerPayload> payloads = peer_->take(t.tensor, index, t.iteration);
    const PeerHeader& own = payloads.at(self).header;
    for (uint32_t r = 0; r < payloads.size(); ++r) {
      const PeerHeader& h = payloads[r].header;
      if (h.format != own.format || h.plan_digest != own.plan_digest) {
        return who(r) + " sent partition " + std::to_string(index) + " (iteration " +
               std::to_string(t.iteration) + ") " +
               (h.format == PeerFormat::kRawFp32 ? "uncompressed" : "compressed") +
               " under plan digest " + std::to_string(h.plan_digest) + ", this node ran " +
               (own.format == PeerFormat::kRawFp32 ? "uncompressed" : "compressed") +
               " under " + std::to_string(own.plan_digest) +
               " (the nodes disagree on the tensor's strategy at this iteration)";
      }
    }
    if (own.format == PeerFormat::kRawFp32) {
      // Summed exactly as received, in rank order, so every node computes
      // the same bits.
      std::vector<float> aligned;
      for (uint32_t r = 0; r < payloads.size(); ++r) {
        const transport::Buffer& d = payloads[r].data;
        const float* src = reinterpret_cast<const float*>(d.data());
        if (reinterpret_cast<uintptr_t>(d.data()) % alignof(float) != 0) {
          aligned.resize(n);
          std::memcpy(aligned.data(), d.data(), n * 4);
          src = aligned.data();
        }
        if (r == 0) {
          std::memcpy(out, src, n * 4);
        } else {
          compress::sum_into(out, src, n);
        }
      }
    } else {
      // The plan this node's start() ran the round under.
      const TensorPlan& plan = *peer_parts_[t.tensor][index].plan;
      if (!plan.compressor || plan_digest_of(plan) != own.plan_digest) {
        return "the plan of partition " + std::to_string(index) + " changed under it";
      }
      compress::CompressContext ctx;
      ctx.iteration = t.iteration;
      ctx.shared_seed = strategy::partition_seed(ps_->info().name, t.key);
      for (uint32_t r = 0; r < payloads.size(); ++r) {
        try {
          plan.compressor->decompress(payloads[r].data.span(), compress::TensorView::cpu(out, n),
                                      r > 0, ctx);
        } catch (const std::exception& e) {
          return "the payload of " + who(r) + " for partition " + std::to_string(index) +
                 " (iteration " + std::to_string(t.iteration) + ") does not decode: " + e.what();
        }
      }
    }
    ctx_.phases->stamp(t.tensor, index, t.iteration, Phase::kDecompressed);
    ctx_.reducer->copy_from_first(bufs, t.begin, t.end);
    ctx_.phases->stamp(t.tensor, index, t.iteration, Phase::kCopiedOut);
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

}  // namespace bytecomp::daemon
