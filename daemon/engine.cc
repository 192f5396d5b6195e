#include "daemon/engine.h"

#include <cstring>

#include "common/log.h"
#include "compress/reduce.h"
#include "daemon/local_reduce.h"
#include "planner/strategy/answer.h"
#include "planner/strategy/partition.h"

namespace bytecomp::daemon {

BC_LOG_CATEGORY(LogEngine, "daemon.engine");

namespace {
// Bound on one idle sleep; stop() also posts the doorbell, so this only
// limits how stale a missed wake-up can get.
constexpr auto kIdleWait = std::chrono::milliseconds(200);
}  // namespace

void Inbox::ring() {
  if (doorbell_ == nullptr) return;
  try {
    doorbell_->post();
  } catch (...) {
  }
}

void Inbox::deliver(Arrival a) {
  std::lock_guard lock(mu_);
  if (doorbell_ == nullptr) return;
  arrivals_.push_back(std::move(a));
  ring();
}

void Inbox::acked(uint64_t bytes) {
  std::lock_guard lock(mu_);
  if (doorbell_ == nullptr) return;
  acked_ += bytes;
  ring();
}

uint64_t Inbox::take_acked() {
  std::lock_guard lock(mu_);
  return std::exchange(acked_, 0);
}

void Inbox::fail(const Status& s) {
  std::lock_guard lock(mu_);
  if (doorbell_ == nullptr) return;
  if (failure_.ok()) failure_ = s;
  ring();
}

void Inbox::close() {
  std::lock_guard lock(mu_);
  doorbell_ = nullptr;
  arrivals_.clear();
}

std::vector<Inbox::Arrival> Inbox::take() {
  std::lock_guard lock(mu_);
  return std::exchange(arrivals_, {});
}

Status Inbox::failure() {
  std::lock_guard lock(mu_);
  return failure_;
}

Engine::Engine(std::string job_name, void* segment, const ipc::Layout& layout,
               std::vector<TensorSpec> tensors, std::vector<TensorPlan> plans,
               uint32_t node_rank, ThreadPool& pool, const Tunables& tunables,
               FailureFn on_failure, JoinFn join, PeerOptions peers,
               std::shared_ptr<const void> keep_mapped)
    : job_(std::move(job_name)),
      base_(static_cast<char*>(segment)),
      layout_(layout),
      tensors_(std::move(tensors)),
      pool_(pool),
      tunables_(tunables),
      on_failure_(std::move(on_failure)),
      header_(ipc::init_segment(segment, layout)),
      clients_(reinterpret_cast<ipc::ClientArea*>(base_ + layout.clients_offset)),
      rounds_(tensors_.size()),
      left_(new std::atomic<bool>[layout.local_size]),
      runs_(tensors_.size()),
      node_rank_(node_rank),
      partition_bytes_(std::max<uint64_t>(64, tunables.partition_bytes.load() / 64 * 64)) {
  for (uint32_t t = 0; t < tensors_.size(); ++t) install(t, std::move(plans.at(t)));
  for (uint32_t r = 0; r < layout.local_size; ++r) {
    left_[r] = false;
    submit_.emplace_back(clients_[r].submit,
                         reinterpret_cast<ipc::RingEntry*>(base_ + layout.submit_ring_offset(r)),
                         layout.ring_capacity);
    complete_.emplace_back(
        clients_[r].complete,
        reinterpret_cast<ipc::RingEntry*>(base_ + layout.complete_ring_offset(r)),
        layout.ring_capacity);
  }
  for (Round& r : rounds_) r.from.assign(layout.local_size, false);
  join_ = std::move(join);
  keep_mapped_ = std::move(keep_mapped);
  peer_opts_ = peers;
  inbox_ = std::make_shared<Inbox>(&header_->doorbell);
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() { stop(); }

void Engine::stop() {
  stop_.store(true);
  try {
    header_->doorbell.post();
  } catch (...) {
    // Scribbled over by a client; the idle timeout ends the loop.
  }
  if (thread_.joinable()) thread_.join();
  // Late PS callbacks must not touch the segment once it is unmapped.
  inbox_->close();
  if (peer_) peer_->close();
  if (ps_) {
    // Tells the coordinator and fails what is still pending. An aborted job
    // is aborted for every node at once (a job the coordinator already
    // aborted is unknown to it by now: that refusal is harmless). Without
    // waiting for the answer: stop() runs on the daemon's control thread,
    // which serves every other job meanwhile (the PsClient's close waits for
    // outstanding answers when the daemon exits).
    std::string reason;
    {
      std::lock_guard lock(abort_mu_);
      reason = abort_reason_;
    }
    auto log = [job = job_, aborting = !reason.empty()](const Status& s) {
      if (!s.ok())
        BC_LOG(LogEngine(), kDebug) << "job " << job << (aborting ? ": abort: " : ": leave: ")
                                    << s.to_string();
    };
    if (reason.empty()) {
      ps_->leave_async(log, std::chrono::milliseconds(2000));
    } else {
      ps_->abort_async(reason, log, std::chrono::milliseconds(2000));
    }
    ps_.reset();
  }
}

void Engine::install(uint32_t t, TensorPlan plan) {
  Run& run = runs_[t];
  run.states.clear();
  run.scratch.clear();
  if (plan.compressor) {
    const uint64_t bytes = tensors_[t].bytes;
    for (uint64_t b = 0; b < bytes; b += partition_bytes_) {
      const size_t n = static_cast<size_t>((std::min(bytes, b + partition_bytes_) - b) / 4);
      run.states.push_back(plan.compressor->make_state(n));
      run.scratch.emplace_back(plan.compressor->max_compressed_bytes(n));
    }
  }
  BC_LOG(LogEngine(), kDebug) << "job " << job_ << " tensor '" << tensors_[t].name
                              << "': " << plan.describe();
  run.plan = std::move(plan);
}

void Engine::set_plans(std::vector<TensorPlan> plans) {
  {
    std::lock_guard lock(pending_mu_);
    pending_ = std::move(plans);
  }
  try {
    header_->doorbell.post();
  } catch (...) {
  }
}

void Engine::request_strategy(std::string strategy_yaml) {
  {
    std::lock_guard lock(pending_mu_);
    pending_yaml_ = std::move(strategy_yaml);
  }
  try {
    header_->doorbell.post();
  } catch (...) {
  }
}

void Engine::adopt_pending() {
  std::optional<std::vector<TensorPlan>> p;
  std::optional<std::string> yaml;
  {
    std::lock_guard lock(pending_mu_);
    p.swap(pending_);
    if (ps_) yaml.swap(pending_yaml_);
  }
  if (yaml) {
    int64_t latest = -1;
    for (const Round& r : rounds_) {
      latest = std::max(latest, r.last_done);
      if (r.arrived > 0) latest = std::max(latest, static_cast<int64_t>(r.iteration));
    }
    // Two ahead: the servers may already collect latest + 1 for some tensor.
    const auto at = static_cast<uint64_t>(latest + 2);
    const std::string job = job_;
    ps_->set_strategy(std::move(*yaml), at, [job, at](const Status& s) {
      if (s.ok()) {
        BC_LOG(LogEngine(), kInfo) << "job " << job << ": strategy change applies on every node "
                                   << "from iteration " << at;
      } else {
        BC_LOG(LogEngine(), kError) << "job " << job << ": strategy change refused: "
                                    << s.to_string();
      }
    });
  }
  if (!p) return;
  // The switch iteration is after every round already begun, so no tensor
  // changes plan in the middle of an iteration some other tensor finished.
  int64_t latest = -1;
  for (const Round& r : rounds_) {
    latest = std::max(latest, r.last_done);
    if (r.arrived > 0) latest = std::max(latest, static_cast<int64_t>(r.iteration));
  }
  switch_iteration_ = latest + 1;
  for (size_t t = 0; t < runs_.size(); ++t) runs_[t].next = std::move((*p)[t]);
  switch_published_.store(switch_iteration_);
  BC_LOG(LogEngine(), kInfo) << "job " << job_ << ": new strategy applies from iteration "
                             << switch_iteration_;
}

void Engine::rank_left(uint32_t rank) {
  if (rank < layout_.local_size) left_[rank] = true;
  try {
    header_->doorbell.post();
  } catch (...) {
  }
}

std::pair<ErrorCode, std::string> Engine::publish_abort(ErrorCode code, const std::string& reason) {
  std::lock_guard lock(abort_mu_);
  if (abort_reason_.empty()) {
    abort_reason_ = reason.empty() ? "aborted" : reason;
    abort_code_ = code;
  }
  ipc::publish_abort(header_, code, reason, clients_, layout_.local_size);
  return {abort_code_, abort_reason_};
}

void Engine::fail(ErrorCode code, const std::string& reason) {
  if (failed_.exchange(true)) return;
  BC_LOG(LogEngine(), kWarn) << "job " << job_ << " aborted: " << reason;
  publish_abort(code, reason);
  stop_.store(true);
  on_failure_(code, reason);
}

void Engine::loop() {
  try {
    if (join_) {
      // Blocks until every node registered (bounded by the cluster's
      // admission timeout); submissions wait in the rings meanwhile.
      try {
        ps_ = join_();
      } catch (const Error& e) {
        fail(e.code() == ErrorCode::kOk ? ErrorCode::kUnavailable : e.code(),
             std::string("joining the parameter servers failed: ") + e.what());
        return;
      }
      const uint64_t pb = ps_->info().partition_bytes;
      if (pb % 64 != 0) {
        fail(ErrorCode::kConfig, "cluster partition_bytes " + std::to_string(pb) +
                                     " is not a multiple of 64");
        return;
      }
      partition_bytes_ = pb;
      ps_parts_.resize(tensors_.size());
      for (size_t t = 0; t < tensors_.size(); ++t) {
        ps_parts_[t].resize(static_cast<size_t>((tensors_[t].bytes + pb - 1) / pb));
      }
      std::weak_ptr<Inbox> inbox = inbox_;
      ps_->on_failure([inbox](const Status& s) {
        if (auto i = inbox.lock()) i->fail(s);
      });
      BC_LOG(LogEngine(), kInfo) << "job " << job_ << ": joined the parameter servers as rank "
                                 << ps_->info().rank << " of " << ps_->info().nodes.size();
      if (!open_peers()) return;
    }
    while (!stop_.load()) {
      ipc::timed_wait(header_->doorbell, kIdleWait);
      if (stop_.load()) break;
      if (const Status f = inbox_->failure(); !f.ok()) {
        fail(f.code() == ErrorCode::kOk ? ErrorCode::kAborted : f.code(),
             "inter-node: " + f.message());
        break;
      }
      if (peer_) {
        if (const Status late = peer_->check_deadlines(std::chrono::steady_clock::now());
            !late.ok()) {
          fail(late.code(), "inter-node: " + late.message());
          break;
        }
      }
      adopt_pending();
      if (!drain() || !check_left()) break;
      while (!stop_.load()) {
        if (ps_ && !process_arrivals()) return;
        if (sched_.empty()) break;
        const uint64_t bound = tunables_.max_inflight_bytes.load();
        // With that many bytes pushed (or sent to the peers) and
        // unacknowledged, wait (the doorbell rings) before pushing more, so
        // that a high-priority tensor arriving meanwhile does not queue
        // behind them. Only pushes count: a pull (or an allgather round) is
        // answered when every node pushed, and the nodes may start their
        // partitions in different orders (each by its local priority and
        // readiness), so a bound held until the answers would deadlock them.
        if (inflight_bytes_ >= bound) break;
        run_batch(sched_.next_batch(pool_.concurrency(), bound - inflight_bytes_));
        // New arrivals between batches, so a high-priority tensor overtakes
        // the rest of a large one.
        if (!drain()) break;
      }
    }
  } catch (const std::exception& e) {
    fail(ErrorCode::kInternal, std::string("engine error: ") + e.what());
  }
}

bool Engine::drain() {
  ipc::RingEntry e;
  for (uint32_t r = 0; r < layout_.local_size; ++r) {
    for (;;) {
      try {
        if (!submit_[r].pop(e)) break;
      } catch (const Error& err) {
        fail(ErrorCode::kMalformed, "local rank " + std::to_string(r) + ": " + err.what());
        return false;
      }
      if (e.tensor >= tensors_.size()) {
        fail(ErrorCode::kMalformed, "local rank " + std::to_string(r) + " pushed tensor id " +
                                        std::to_string(e.tensor) + " but only " +
                                        std::to_string(tensors_.size()) + " were declared");
        return false;
      }
      Round& round = rounds_[e.tensor];
      const std::string& name = tensors_[e.tensor].name;
      if (round.running || round.from[r]) {
        fail(ErrorCode::kInvalidArgument, "local rank " + std::to_string(r) + " pushed tensor '" +
                                              name + "' (iteration " +
                                              std::to_string(e.iteration) +
                                              ") again before its previous push_pull finished");
        return false;
      }
      if (static_cast<int64_t>(e.iteration) <= round.last_done) {
        fail(ErrorCode::kInvalidArgument,
             "local rank " + std::to_string(r) + " pushed tensor '" + name + "' for iteration " +
                 std::to_string(e.iteration) + ", not after the last finished one (" +
                 std::to_string(round.last_done) + ")");
        return false;
      }
      if (round.arrived == 0) {
        round.iteration = e.iteration;
      } else if (round.iteration != e.iteration) {
        fail(ErrorCode::kInvalidArgument,
             "local ranks disagree on the iteration of tensor '" + name + "': rank " +
                 std::to_string(r) + " pushed iteration " + std::to_string(e.iteration) +
                 ", another rank " + std::to_string(round.iteration));
        return false;
      }
      round.from[r] = true;
      if (++round.arrived == layout_.local_size) {
        round.running = true;
        Run& run = runs_[e.tensor];
        if (run.next && static_cast<int64_t>(round.iteration) >= switch_iteration_) {
          install(e.tensor, std::move(*run.next));
          run.next.reset();
        }
        round.partitions_left = sched_.add(e.tensor, round.iteration, tensors_[e.tensor].bytes,
                                           partition_bytes_);
      }
    }
  }
  return true;
}

bool Engine::check_left() {
  for (uint32_t r = 0; r < layout_.local_size; ++r) {
    if (!left_[r].load()) continue;
    for (size_t t = 0; t < rounds_.size(); ++t) {
      // Closing with its own push_pull unfinished: the caller abandoned work
      // the others share (its buffer would be summed after it let go of it).
      if (rounds_[t].from[r]) {
        fail(ErrorCode::kAborted, "local rank " + std::to_string(r) +
                                      " closed the job with its push_pull of tensor '" +
                                      tensors_[t].name + "' (iteration " +
                                      std::to_string(rounds_[t].iteration) + ") still in flight");
        return false;
      }
      // A rank that finished everything it pushed leaves quietly: the others
      // keep reading their results, and only a round still waiting for it
      // can never finish.
      if (rounds_[t].arrived > 0 && !rounds_[t].running && !rounds_[t].from[r]) {
        fail(ErrorCode::kAborted, "local rank " + std::to_string(r) +
                                      " closed the job while tensor '" + tensors_[t].name +
                                      "' (iteration " + std::to_string(rounds_[t].iteration) +
                                      ") still waited for it");
        return false;
      }
    }
  }
  return true;
}

void Engine::run_batch(const std::vector<Task>& batch) {
  std::vector<std::vector<char*>> bufs(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    const ipc::TensorSlot& s = layout_.tensors[batch[i].tensor];
    for (uint32_t r = 0; r < layout_.local_size; ++r) bufs[i].push_back(base_ + s.offset + s.stride * r);
  }
  if (ps_) {
    for (const Task& t : batch) inflight_bytes_ += t.end - t.begin;
    pool_.parallel_for(
        batch.size(), 1,
        [&](size_t b, size_t e) {
          for (size_t i = b; i < e; ++i) {
            if (is_peer(batch[i].tensor)) {
              start_peer_task(batch[i], bufs[i]);
            } else {
              start_ps_task(batch[i], bufs[i]);
            }
          }
        },
        batch.size());
    return;  // completed by process_arrivals()
  }
  pool_.parallel_for(
      batch.size(), 1,
      [&](size_t b, size_t e) {
        for (size_t i = b; i < e; ++i) run_task(batch[i], bufs[i]);
      },
      batch.size());
  for (const Task& t : batch) {
    if (--rounds_[t.tensor].partitions_left == 0) complete(t.tensor);
  }
}

void Engine::run_task(const Task& t, std::span<char* const> bufs) {
  Run& run = runs_[t.tensor];
  const TensorSpec& spec = tensors_[t.tensor];
  if (!run.plan.compressor) {
    reduce_range(spec.dtype, bufs, t.begin, t.end);
    return;
  }
  // Distinct partitions own distinct states and scratch buffers, so tasks of
  // one tensor run in parallel safely.
  const size_t part = static_cast<size_t>(t.begin / partition_bytes_);
  sum_to_first(spec.dtype, bufs, t.begin, t.end);
  float* sum = reinterpret_cast<float*>(bufs[0] + t.begin);
  const size_t n = static_cast<size_t>((t.end - t.begin) / 4);
  compress::CompressContext ctx;
  ctx.iteration = t.iteration;
  // Same on every node for this tensor partition (randomk's indices), and
  // private per node for stochastic rounding.
  ctx.shared_seed =
      strategy::partition_seed(job_, strategy::partition_key(t.tensor, static_cast<uint32_t>(part)));
  ctx.private_seed = strategy::node_private_seed(ctx.shared_seed, node_rank_);
  std::vector<std::byte>& wire = run.scratch[part];
  const size_t len = run.plan.compressor->compress(compress::ConstTensorView::cpu(sum, n), wire,
                                                   *run.states[part], ctx);
  // Inter-node phase: with one node the aggregate of the compressed
  // partitions is this node's own.
  run.plan.compressor->decompress(std::span<const std::byte>(wire.data(), len),
                                  compress::TensorView::cpu(sum, n), false, ctx);
  copy_from_first(bufs, t.begin, t.end);
}

Engine::PsPart& Engine::ps_part(uint32_t tensor, uint64_t begin, uint64_t iteration) {
  PsPart& part = ps_parts_.at(tensor).at(static_cast<size_t>(begin / partition_bytes_));
  // The plan in force at this iteration, the same on every node and server
  // (strategy changes are announced by the coordinator ahead of time).
  strategy::TensorPlan plan = ps_->plan_at(tensor, iteration);
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

void Engine::start_ps_task(const Task& t, std::span<char* const> bufs) {
  const TensorSpec& spec = tensors_[t.tensor];
  const auto index = static_cast<uint32_t>(t.begin / partition_bytes_);
  const uint64_t key = strategy::partition_key(t.tensor, index);
  const server::Partition* p = ps_->info().assignment.find(key);
  const size_t n = static_cast<size_t>((t.end - t.begin) / 4);
  if (p == nullptr || p->offset * 4 != t.begin || p->count != n) {
    throw Error(ErrorCode::kInternal, "partition " + std::to_string(index) + " of tensor '" +
                                          spec.name + "' does not match the servers' assignment");
  }
  sum_to_first(spec.dtype, bufs, t.begin, t.end);
  const float* sum = reinterpret_cast<const float*>(bufs[0] + t.begin);
  PsPart& part = ps_part(t.tensor, t.begin, t.iteration);
  transport::Buffer payload;
  if (part.plan.compressed_push()) {
    if (!part.state) part.state = part.compressor->make_state(n);
    std::vector<std::byte> out(part.compressor->max_compressed_bytes(n));
    compress::CompressContext ctx;
    ctx.iteration = t.iteration;
    ctx.shared_seed = strategy::partition_seed(ps_->info().name, key);
    ctx.private_seed = strategy::node_private_seed(ctx.shared_seed, ps_->info().rank);
    const size_t len =
        part.compressor->compress(compress::ConstTensorView::cpu(sum, n), out, *part.state, ctx);
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
  std::weak_ptr<Inbox> inbox = inbox_;
  ps_->push(key, t.iteration, std::move(payload),
            [inbox, name = spec.name, bytes = t.end - t.begin](const Status& s) {
              auto i = inbox.lock();
              if (!i) return;
              if (s.ok()) {
                i->acked(bytes);
              } else {
                i->fail(Status(s.code(), "push of tensor '" + name + "' failed: " + s.message()));
              }
            });
  ps_->pull(key, t.iteration, [inbox, t](const Status& s, transport::Buffer result) {
    if (auto i = inbox.lock()) {
      i->deliver({t.tensor, t.iteration, t.begin, t.end, s, std::move(result)});
    }
  });
}

bool Engine::process_arrivals() {
  inflight_bytes_ -= std::min(inflight_bytes_, inbox_->take_acked());
  std::vector<Inbox::Arrival> arrived = inbox_->take();
  if (arrived.empty()) return true;
  for (const auto& a : arrived) {
    if (!a.status.ok()) {
      fail(a.status.code(), "pull of tensor '" + tensors_[a.tensor].name + "' (iteration " +
                                std::to_string(a.iteration) + ") failed: " + a.status.message());
      return false;
    }
  }
  std::vector<std::string> errors(arrived.size());
  pool_.parallel_for(
      arrived.size(), 1,
      [&](size_t b, size_t e) {
        for (size_t i = b; i < e; ++i) {
          const auto& a = arrived[i];
          if (a.peer) {
            errors[i] = finish_peer(a);
            continue;
          }
          const ipc::TensorSlot& slot = layout_.tensors[a.tensor];
          std::vector<char*> bufs;
          for (uint32_t r = 0; r < layout_.local_size; ++r) {
            bufs.push_back(base_ + slot.offset + slot.stride * r);
          }
          const size_t n = static_cast<size_t>((a.end - a.begin) / 4);
          float* out = reinterpret_cast<float*>(bufs[0] + a.begin);
          PsPart& part = ps_parts_[a.tensor][static_cast<size_t>(a.begin / partition_bytes_)];
          try {
            compress::CompressContext ctx;
            ctx.iteration = a.iteration;
            strategy::decode_answer(part.plan.pull, a.result.span(), out, n, part.compressor.get(),
                                    ctx);
            copy_from_first(bufs, a.begin, a.end);
          } catch (const std::exception& e) {
            errors[i] = e.what();
          }
        }
      },
      arrived.size());
  for (size_t i = 0; i < arrived.size(); ++i) {
    if (!errors[i].empty()) {
      fail(ErrorCode::kMalformed, "answer for tensor '" + tensors_[arrived[i].tensor].name +
                                      "' unusable: " + errors[i]);
      return false;
    }
  }
  // Bytes in flight were released by the acknowledgements (servers' for
  // pushes, peers' for allgather payloads), not here.
  for (const auto& a : arrived) {
    if (--rounds_[a.tensor].partitions_left == 0) complete(a.tensor);
  }
  return true;
}

void Engine::complete(uint32_t tensor) {
  Round& round = rounds_[tensor];
  for (uint32_t r = 0; r < layout_.local_size; ++r) {
    if (!complete_[r].push({tensor, 0, round.iteration})) {
      fail(ErrorCode::kMalformed, "completion ring of local rank " + std::to_string(r) +
                                      " is full (client does not drain it)");
      return;
    }
    try {
      clients_[r].wake.post();
    } catch (const std::exception& e) {
      fail(ErrorCode::kMalformed, "wake semaphore of local rank " + std::to_string(r) +
                                      " unusable: " + e.what());
      return;
    }
  }
  round.last_done = static_cast<int64_t>(round.iteration);
  round.arrived = 0;
  round.running = false;
  std::fill(round.from.begin(), round.from.end(), false);
}

}  // namespace bytecomp::daemon
