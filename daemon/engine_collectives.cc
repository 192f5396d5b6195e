#include "daemon/engine_collectives.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "common/log.h"
#include "planner/strategy/partition.h"

namespace bytecomp::daemon {

BC_LOG_CATEGORY(LogCollectives, "daemon.engine");

namespace {

// An arrival of the engine's own collectives names its tensor, iteration and
// byte range like a path's partition.
Task collective_task(uint32_t tensor, uint64_t iteration, uint64_t begin, uint64_t end) {
  Task t;
  t.tensor = tensor;
  t.iteration = iteration;
  t.begin = begin;
  t.end = end;
  return t;
}

std::string describe(const ipc::Collective& c) {
  char tag[24];
  std::snprintf(tag, sizeof tag, "0x%llx", static_cast<unsigned long long>(c.tag));
  return "root rank " + std::to_string(c.root) + ", " + std::to_string(c.nbytes) + " bytes, tag " +
         tag + ", iteration " + std::to_string(c.iteration);
}

}  // namespace

Collectives::Collectives(CollectiveContext ctx) : ctx_(std::move(ctx)) {
  bcasts_.resize(ctx_.tensors->size());
  for (CollRound& c : bcasts_) c.from.assign(ctx_.local_size, false);
  barrier_.from.assign(ctx_.local_size, false);
}

Collectives::~Collectives() { close(); }

void Collectives::joined(std::shared_ptr<server::PsJob> ps, std::vector<uint64_t> partition_bytes,
                         const PeerOptions& peers) {
  ps_ = std::move(ps);
  partition_bytes_ = std::move(partition_bytes);
  peers_ = peers;
  const server::JobInfo& info = ps_->info();
  chain_ = peers.hub != nullptr && info.nodes.size() > 1 &&
           info.peer_addresses.size() == info.nodes.size();
  for (size_t r = 0; chain_ && r < info.peer_addresses.size(); ++r)
    chain_ = r == info.rank || !info.peer_addresses[r].empty();
}

Status Collectives::check(std::chrono::steady_clock::time_point now) {
  return bcast_ ? bcast_->check_deadlines(now) : Status::Ok();
}

void Collectives::close() {
  if (bcast_) bcast_->close();
}

void Collectives::submit(uint32_t rank, const ipc::Collective& c) {
  std::lock_guard lock(mu_);
  pending_.emplace_back(rank, c);
}

bool Collectives::check_left(uint32_t r) {
  for (size_t t = 0; t <= bcasts_.size(); ++t) {
    const CollRound& c = t < bcasts_.size() ? bcasts_[t] : barrier_;
    const std::string what = t < bcasts_.size()
                                 ? "the broadcast of tensor '" + (*ctx_.tensors)[t].name + "'"
                                 : "the barrier";
    if (c.from[r] || (c.arrived > 0 && !c.running)) {
      ctx_.fail(ErrorCode::kAborted,
                "local rank " + std::to_string(r) + " closed the job while " + what +
                    " (iteration " + std::to_string(c.first.iteration) + ") " +
                    (c.from[r] ? "it had entered was still in flight" : "still waited for it"));
      return false;
    }
  }
  return true;
}

bool Collectives::drain() {
  std::vector<std::pair<uint32_t, ipc::Collective>> got;
  {
    std::lock_guard lock(mu_);
    got.swap(pending_);
  }
  const uint64_t size = uint64_t{ctx_.local_size} * (ps_ ? ps_->info().nodes.size() : 1);
  for (auto& [r, op] : got) {
    const std::string who = "local rank " + std::to_string(r);
    const bool barrier = op.op == ipc::CollectiveOp::kBarrier;
    std::string what = "the barrier";
    if (!barrier) {
      if (op.tensor >= (*ctx_.tensors).size()) {
        ctx_.fail(ErrorCode::kInvalidArgument, who + " broadcast tensor id " + std::to_string(op.tensor) +
                                              " but only " + std::to_string((*ctx_.tensors).size()) +
                                              " were declared");
        return false;
      }
      what = "the broadcast of tensor '" + (*ctx_.tensors)[op.tensor].name + "'";
      if (op.nbytes > (*ctx_.tensors)[op.tensor].bytes()) {
        ctx_.fail(ErrorCode::kInvalidArgument,
             who + ": " + what + " of " + std::to_string(op.nbytes) +
                 " bytes exceeds the tensor's " + std::to_string((*ctx_.tensors)[op.tensor].bytes()));
        return false;
      }
      if (op.root >= size) {
        ctx_.fail(ErrorCode::kInvalidArgument, who + ": " + what + " names root rank " +
                                              std::to_string(op.root) + ", the job has ranks 0.." +
                                              std::to_string(size - 1));
        return false;
      }
      if (ctx_.busy(op.tensor)) {
        ctx_.fail(ErrorCode::kInvalidArgument,
             who + ": " + what + " while a push_pull of it is in flight");
        return false;
      }
    }
    CollRound& c = coll_of(op.tensor);
    if (c.running || c.from[r]) {
      ctx_.fail(ErrorCode::kInvalidArgument, who + " entered " + what + " (iteration " +
                                            std::to_string(op.iteration) +
                                            ") again before its previous one finished");
      return false;
    }
    if (static_cast<int64_t>(op.iteration) <= c.last_done) {
      ctx_.fail(ErrorCode::kInvalidArgument, who + ": " + what + " of iteration " +
                                            std::to_string(op.iteration) +
                                            ", not after the last finished one (" +
                                            std::to_string(c.last_done) + ")");
      return false;
    }
    if (c.arrived == 0) {
      c.first = op;
      c.first_rank = r;
    } else if (op.iteration != c.first.iteration || op.root != c.first.root ||
               op.nbytes != c.first.nbytes || op.tag != c.first.tag) {
      ctx_.fail(ErrorCode::kInvalidArgument,
           "the ranks disagree on " + what + ": " + who + " passed " + describe(op) +
               ", local rank " + std::to_string(c.first_rank) + " passed " + describe(c.first) +
               " (every rank must make the same call)");
      return false;
    }
    c.from[r] = true;
    if (++c.arrived == ctx_.local_size) {
      c.running = true;
      if (!begin(c)) return false;
    }
  }
  return true;
}

bool Collectives::begin(CollRound& c) {
  const ipc::Collective& op = c.first;
  std::weak_ptr<Inbox> inbox = ctx_.inbox;
  if (op.op == ipc::CollectiveOp::kBarrier) {
    if (!ps_) {
      complete(c);
      return true;
    }
    c.parts_left = 1;
    const uint64_t it = op.iteration;
    ps_->barrier(
        [inbox, it](const Status& s) {
          if (auto i = inbox.lock())
            i->deliver({collective_task(ipc::kBarrierTensor, it, 0, 0), s, {}, 0,
                        Inbox::Arrival::Kind::kBarrier});
        },
        server::Millis{0});
    return true;
  }
  const uint32_t t = op.tensor;
  std::vector<char*> bufs;
  ctx_.buffers_of(t, bufs);
  const uint32_t root_node = op.root / ctx_.local_size;
  const uint32_t root_local = op.root % ctx_.local_size;
  const bool here = root_node == ctx_.node_rank;
  if (!ps_) {
    for (uint32_t r = 0; r < ctx_.local_size; ++r)
      if (r != root_local && op.nbytes > 0) std::memcpy(bufs[r], bufs[root_local], op.nbytes);
    complete(c);
    return true;
  }
  if (chain_) return begin_chain(c, bufs);
  // Cut at the tensor's partitions, each to the server that owns it, so the
  // bytes fan out through every server at once; partition 0 always goes
  // (also for 0 bytes): every node's agreement is checked there.
  const uint64_t pb = partition_bytes_.at(t);
  const uint64_t parts = std::max<uint64_t>(1, (op.nbytes + pb - 1) / pb);
  c.parts_left = parts;
  for (uint64_t p = 0; p < parts; ++p) {
    const uint64_t key = strategy::partition_key(t, static_cast<uint32_t>(p));
    if (ps_->info().assignment.find(key) == nullptr) {
      ctx_.fail(ErrorCode::kInvalidArgument,
           "the broadcast of tensor '" + (*ctx_.tensors)[t].name + "' needs its partitions on the "
           "parameter servers, but its strategy places it elsewhere (give it placement ps)");
      return false;
    }
    const uint64_t begin = p * pb;
    const uint64_t end = std::min(op.nbytes, begin + pb);
    transport::Buffer data;
    if (here && end > begin) {
      const char* src = bufs[root_local] + begin;
      // Zero-copy as PsPath's pushes: the root's buffer is next written by
      // its client after this broadcast completed, which waits for the
      // server's answer, i.e. for every byte to have left.
      data = ctx_.keep_mapped ? transport::Buffer::wrap(src, end - begin, [keep = ctx_.keep_mapped] {})
                          : transport::Buffer::copy_of(src, end - begin);
    }
    const uint64_t it = op.iteration;
    ps_->broadcast(key, it, op.root, op.nbytes, op.tag, here, std::move(data),
                   [inbox, t, it, begin, end](const Status& s, transport::Buffer result) {
                     if (auto i = inbox.lock())
                       i->deliver({collective_task(t, it, begin, end), s, std::move(result), 0,
                                   Inbox::Arrival::Kind::kBroadcast});
                   });
  }
  return true;
}

bool Collectives::begin_chain(CollRound& c, std::vector<char*>& bufs) {
  const ipc::Collective& op = c.first;
  const uint32_t t = op.tensor;
  const uint32_t root_local = op.root % ctx_.local_size;
  const bool here = op.root / ctx_.local_size == ctx_.node_rank;
  try {
    if (!bcast_) {
      const server::JobInfo& info = ps_->info();
      BcastJobSpec spec;
      spec.name = info.name;
      spec.uid = info.uid;
      spec.rank = info.rank;
      spec.local_size = ctx_.local_size;
      spec.nodes = info.nodes;
      spec.addresses = info.peer_addresses;
      for (const TensorSpec& ts : *ctx_.tensors) {
        spec.tensor_names.push_back(ts.name);
        spec.tensor_bytes.push_back(ts.bytes());
      }
      spec.chunk_bytes = std::min<uint64_t>(peers_.ring_chunk_bytes, kBcastMaxChunkBytes);
      spec.window = std::max<uint32_t>(2, peers_.ring_window);
      spec.timeout = peers_.timeout;
      std::weak_ptr<Inbox> inbox = ctx_.inbox;
      bcast_ = peers_.hub->open_bcast(
          std::move(spec),
          [inbox](uint32_t tensor, uint64_t iteration) {
            // The bytes are in every local rank's buffer already: no range.
            if (auto i = inbox.lock())
              i->deliver({collective_task(tensor, iteration, 0, 0), Status::Ok(), {}, 0,
                          Inbox::Arrival::Kind::kBroadcast});
          },
          [inbox](const Status& s) {
            if (auto i = inbox.lock()) i->fail(s);
          });
      BC_LOG(LogCollectives(), kInfo) << "job " << info.name << ": broadcasts down a chain of "
                                      << info.nodes.size() << " daemons (rank " << info.rank
                                      << ")";
    }
    std::vector<char*> dsts;
    if (here) {
      // The root's node: its other local ranks copy here, the chain sends
      // from the root's buffer.
      for (uint32_t r = 0; r < ctx_.local_size; ++r)
        if (r != root_local && op.nbytes > 0) std::memcpy(bufs[r], bufs[root_local], op.nbytes);
    } else {
      dsts = bufs;
    }
    c.parts_left = 1;
    bcast_->start(t, op.iteration, BcastCall{op.root, op.nbytes, op.tag},
                  here ? bufs[root_local] : nullptr, std::move(dsts), ctx_.keep_mapped);
  } catch (const Error& e) {
    ctx_.fail(e.code(), "the broadcast of tensor '" + (*ctx_.tensors)[t].name + "' (iteration " +
                            std::to_string(op.iteration) + "): " + e.what());
    return false;
  }
  return true;
}

bool Collectives::finish(const Inbox::Arrival& a) {
  const bool barrier = a.kind == Inbox::Arrival::Kind::kBarrier;
  if (!barrier && a.task.tensor >= bcasts_.size()) {
    ctx_.fail(ErrorCode::kInternal, "broadcast answer for unknown tensor " + std::to_string(a.task.tensor));
    return false;
  }
  CollRound& c = coll_of(barrier ? ipc::kBarrierTensor : a.task.tensor);
  const std::string what =
      barrier ? "the barrier" : "the broadcast of tensor '" + (*ctx_.tensors)[a.task.tensor].name + "'";
  if (!c.running || c.first.iteration != a.task.iteration || c.parts_left == 0) {
    ctx_.fail(ErrorCode::kInternal, "an answer for " + what + " (iteration " +
                                   std::to_string(a.task.iteration) + ") that is not running");
    return false;
  }
  if (!a.status.ok()) {
    ctx_.fail(a.status.code() == ErrorCode::kOk ? ErrorCode::kAborted : a.status.code(),
         what + " (iteration " + std::to_string(a.task.iteration) + ") failed: " + a.status.message());
    return false;
  }
  if (!barrier && a.task.end > a.task.begin) {
    std::vector<char*> bufs;
    ctx_.buffers_of(a.task.tensor, bufs);
    const uint32_t root_node = c.first.root / ctx_.local_size;
    const uint32_t root_local = c.first.root % ctx_.local_size;
    const uint64_t n = a.task.end - a.task.begin;
    const char* src = nullptr;
    if (root_node == ctx_.node_rank) {
      src = bufs[root_local] + a.task.begin;
    } else if (a.result.size() != n) {
      ctx_.fail(ErrorCode::kMalformed, what + ": a server answered " + std::to_string(a.result.size()) +
                                      " bytes for a partition of " + std::to_string(n));
      return false;
    } else {
      src = reinterpret_cast<const char*>(a.result.data());
    }
    for (uint32_t r = 0; r < ctx_.local_size; ++r)
      if (bufs[r] + a.task.begin != src) std::memcpy(bufs[r] + a.task.begin, src, n);
  }
  if (--c.parts_left == 0) complete(c);
  return true;
}

void Collectives::complete(CollRound& c) {
  if (!ctx_.notify_ranks(c.first.tensor, c.first.iteration)) return;
  c.last_done = static_cast<int64_t>(c.first.iteration);
  c.arrived = 0;
  c.running = false;
  c.parts_left = 0;
  std::fill(c.from.begin(), c.from.end(), false);
}

}  // namespace bytecomp::daemon
