#include "daemon/engine.h"

#include "common/log.h"
#include "daemon/local_reduce.h"

namespace bytecomp::daemon {

BC_LOG_CATEGORY(LogEngine, "daemon.engine");

namespace {
// Bound on one idle sleep; stop() also posts the doorbell, so this only
// limits how stale a missed wake-up can get.
constexpr auto kIdleWait = std::chrono::milliseconds(200);
}  // namespace

Engine::Engine(std::string job_name, void* segment, const ipc::Layout& layout,
               std::vector<TensorSpec> tensors, std::vector<TensorPlan> plans,
               uint32_t node_rank, ThreadPool& pool, const Tunables& tunables,
               FailureFn on_failure)
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

void Engine::adopt_pending() {
  std::optional<std::vector<TensorPlan>> p;
  {
    std::lock_guard lock(pending_mu_);
    p.swap(pending_);
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

void Engine::publish_abort(ErrorCode code, const std::string& reason) {
  std::lock_guard lock(abort_mu_);
  ipc::publish_abort(header_, code, reason, clients_, layout_.local_size);
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
    while (!stop_.load()) {
      ipc::timed_wait(header_->doorbell, kIdleWait);
      if (stop_.load()) break;
      adopt_pending();
      if (!drain() || !check_left()) break;
      while (!sched_.empty() && !stop_.load()) {
        run_batch(sched_.next_batch(pool_.concurrency(), tunables_.max_inflight_bytes.load()));
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
  ctx.shared_seed = std::hash<std::string>{}(spec.name) * 1000003u + part;
  ctx.private_seed = ctx.shared_seed ^ (0x9e3779b97f4a7c15ull * (node_rank_ + 1));
  std::vector<std::byte>& wire = run.scratch[part];
  const size_t len = run.plan.compressor->compress(compress::ConstTensorView::cpu(sum, n), wire,
                                                   *run.states[part], ctx);
  // Inter-node phase: with one node the aggregate of the compressed
  // partitions is this node's own.
  run.plan.compressor->decompress(std::span<const std::byte>(wire.data(), len),
                                  compress::TensorView::cpu(sum, n), false, ctx);
  copy_from_first(bufs, t.begin, t.end);
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
