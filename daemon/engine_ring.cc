#include "daemon/engine_ring.h"

#include <algorithm>
#include <cstring>

#include "common/log.h"
#include "daemon/client_payload.h"
#include "daemon/counting_compressor.h"
#include "planner/strategy/partition.h"

namespace bytecomp::daemon {

BC_LOG_CATEGORY(LogEngineRing, "daemon.engine");

RingFormat ring_format(const TensorPlan& plan, const std::string& tensor) {
  if (!plan.compressor) return RingFormat::kFp32;
  const std::string& name = plan.compressor->name();
  if (name == "fp16") return RingFormat::kFp16;
  if (name == "bf16") return RingFormat::kBf16;
  throw Error(ErrorCode::kInvalidArgument,
              "tensor '" + tensor + "': the ring allreduce carries fp32, fp16 or bf16, not " +
                  name + " (use compressor none, fp16 or bf16 with inter: allreduce)");
}

RingPath::RingPath(const PathContext& ctx, std::shared_ptr<server::PsJob> ps,
                   std::vector<bool> ring_tensor)
    : ctx_(ctx), ps_(std::move(ps)), ring_tensor_(std::move(ring_tensor)) {}

RingPath::~RingPath() { close(); }

std::unique_ptr<RingPath> RingPath::open(const PathContext& ctx,
                                         std::shared_ptr<server::PsJob> ps,
                                         const PeerOptions& opts) {
  const server::JobInfo& info = ps->info();
  const std::vector<TensorSpec>& tensors = *ctx.tensors;
  std::vector<bool> ring_tensor = tensors_placed(*ps, tensors.size(), strategy::Placement::kRing);
  // A strategy change may move a tensor onto the ring at one iteration
  // (strategy::placement_switchable): where every node has a peer endpoint
  // the ring is opened at the join, with a place for every tensor that may
  // go round it, so no node has to stop at the switch to open it. The
  // coordinator refuses a move onto the ring where one has none. The
  // decision uses the admission only, so every node takes the same one
  // (and the same barriers).
  const bool switchable =
      info.peer_addresses.size() == info.nodes.size() &&
      std::none_of(info.peer_addresses.begin(), info.peer_addresses.end(),
                   [](const std::string& a) { return a.empty(); });
  if (ring_tensor.empty() && !switchable) return nullptr;
  const auto starts_on_ring =
      static_cast<size_t>(std::count(ring_tensor.begin(), ring_tensor.end(), true));
  if (switchable) {
    const uint64_t first = info.start_iteration;
    ring_tensor.assign(tensors.size(), false);
    for (uint32_t t = 0; t < tensors.size(); ++t)
      ring_tensor[t] = strategy::placement_switchable(ps->timeline().plan(t, first).placement,
                                                      strategy::Placement::kRing);
  }
  if (opts.hub == nullptr) {
    throw Error(ErrorCode::kUnavailable,
                "the job uses inter: allreduce (a ring between daemons), but this bytecompd has "
                "no peer endpoint (set internode.peer_listen in its configuration)");
  }
  std::unique_ptr<RingPath> path(new RingPath(ctx, ps, std::move(ring_tensor)));
  std::weak_ptr<Inbox> inbox = ctx.inbox;
  // Per tensor (its pieces), as the scheduler cuts it.
  const std::vector<uint64_t> pbs = ctx.partition_bytes;
  RingJobSpec spec;
  spec.name = info.name;
  spec.uid = info.uid;
  spec.rank = info.rank;
  spec.nodes = info.nodes;
  spec.addresses = info.peer_addresses;
  spec.timeout = opts.timeout;
  spec.chunk_bytes = opts.ring_chunk_bytes;
  spec.window = opts.ring_window;
  std::vector<uint64_t> bytes;
  for (uint32_t t = 0; t < tensors.size(); ++t) {
    spec.tensor_names.push_back(tensors[t].name);
    bytes.push_back(tensors[t].bytes());
    spec.partitions.push_back(path->ring_tensor_[t]
                                  ? static_cast<uint32_t>((tensors[t].bytes() + pbs.at(t) - 1) / pbs.at(t))
                                  : 0u);
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
  path->ring_ = opts.hub->open_ring(std::move(spec), ready, failed);
  // Every node registered its ring before any chunk is sent, so none is
  // refused as belonging to an unknown job.
  if (const Status s = ps->barrier(opts.timeout); !s.ok()) {
    throw Error(s.code() == ErrorCode::kOk ? ErrorCode::kUnavailable : s.code(),
                "ring allreduce: waiting for every node to open the job failed: " + s.message());
  }
  BC_LOG(LogEngineRing(), kInfo) << "job " << ctx.job << ": ring allreduce over "
                                 << info.nodes.size() << " daemons (rank " << info.rank << ", "
                                 << starts_on_ring << " tensor(s) start on it)";
  return path;
}

Status RingPath::check(std::chrono::steady_clock::time_point now) {
  return ring_->check_deadlines(now);
}

void RingPath::close() {
  if (ring_) ring_->close();
}

void RingPath::start(const Task& t, std::span<char* const> bufs) {
  const TensorSpec& spec = (*ctx_.tensors)[t.tensor];
  const TensorPlan& plan = *t.plan;
  if (plan.placement != strategy::Placement::kRing) {
    throw Error(ErrorCode::kInternal, "tensor '" + spec.name + "' runs on the ring under a " +
                                          std::string(strategy::to_string(plan.placement)) +
                                          " plan");
  }
  const RingFormat format = ring_format(plan, spec.name);
  if (t.compressed) {
    // The local ranks compressed it (fp16 / bf16 words): the node's sum of
    // their decoded values enters the ring like a dense one.
    if (!plan.compressor) {
      throw Error(ErrorCode::kInvalidArgument,
                  compressed_refusal(t, spec.name, "the plan in force does not compress it"));
    }
    compress::CompressContext cctx;
    cctx.iteration = t.iteration;
    cctx.shared_seed = strategy::partition_seed(ps_->info().name, t.key);
    decode_sum_to_first(t, spec.name, bufs, *plan.compressor, cctx);
  } else {
    ctx_.reducer->sum_to_first(spec.dtype, bufs, t.begin, t.end);
  }
  PhaseLog& phases = *ctx_.phases;
  phases.stamp(t.tensor, t.index, t.iteration, Phase::kReduced);
  if (ctx_.bytes && plan.compressor) ctx_.bytes->add(t.count * 4, t.count * 2);
  phases.stamp(t.tensor, t.index, t.iteration, Phase::kCompressed);
  phases.stamp(t.tensor, t.index, t.iteration, Phase::kSent);
  std::weak_ptr<Inbox> inbox = ctx_.inbox;
  // The bytes-in-flight bound is released once the right neighbour answered
  // this node's own first-step chunks, not when the round completes (that
  // needs every node, which may start partitions in other orders).
  // Reduced in place in rank 0's partition: the segment stays mapped while
  // the engine exists, and close() (Engine::stop) ends every write into it.
  ring_->start(t.tensor, t.index, t.iteration, format, plan_digest_of(plan),
               reinterpret_cast<float*>(bufs[0] + t.begin), t.count,
               [inbox, bytes = t.bytes()] {
                 if (auto i = inbox.lock()) i->acked(bytes);
               });
}

std::string RingPath::finish(const Inbox::Arrival& a, std::span<char* const> bufs) {
  const Task& t = a.task;
  try {
    ring_->take(t.tensor, t.index, t.iteration);  // the result is in rank 0's partition
    ctx_.phases->stamp(t.tensor, t.index, t.iteration, Phase::kDecompressed);
    ctx_.reducer->copy_from_first(bufs, t.begin, t.end);
    ctx_.phases->stamp(t.tensor, t.index, t.iteration, Phase::kCopiedOut);
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

}  // namespace bytecomp::daemon
