// libbytecomp: the operations of a started job (client_internal.h).
#include "client/src/client_internal.h"

namespace {
bytecomp_status push_pull(bytecomp_client* c, uint32_t id, uint64_t iteration,
                          bytecomp_handle* out, uint32_t flags, const char* fn) {
  return guarded([&] {
    require_client(c);
    if (out == nullptr) fail(BYTECOMP_ERR_INVALID_ARGUMENT, "out_handle is NULL");
    *out = 0;
    std::lock_guard lock(c->mu);
    require_started(c, fn);
    if ((flags & ipc::kSubmitCompressed) != 0 &&
        c->header->partition_bytes.load(std::memory_order_acquire) == 0) {
      fail(BYTECOMP_ERR_STATE, std::string(fn) + ": the daemon has not published the job's "
                               "partition size yet (bytecomp_partition_bytes is 0): push dense");
    }
    c->check_health();
    require_healthy(c);
    require_tensor(c, id);
    const TensorInfo& t = c->tensors[id];
    if (const uint32_t dense = ipc::submit_dense_partitions(flags); dense != 0) {
      // The tensor's own partitions (its strategy's pieces).
      const auto [pb, parts] = c->tensor_partitions(id);
      if (dense >= parts) {
        fail(BYTECOMP_ERR_INVALID_ARGUMENT,
             std::string(fn) + ": tensor '" + t.name + "' has " + std::to_string(parts) +
                 " partitions of " + std::to_string(pb) + " bytes; dense_partitions " +
                 std::to_string(dense) + " leaves none compressed (push it dense instead)");
      }
    }
    if (c->pending[id] != 0) {
      fail(BYTECOMP_ERR_STATE, "tensor '" + t.name + "' already has a push_pull in flight (iteration " +
                                   std::to_string(c->ops.at(c->pending[id]).iteration) +
                                   "): wait for that handle before pushing it again");
    }
    if (iteration > static_cast<uint64_t>(INT64_MAX) ||
        static_cast<int64_t>(iteration) <= c->last_iteration[id]) {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT,
           "tensor '" + t.name + "': iteration " + std::to_string(iteration) +
               " is not after the last one pushed (" + std::to_string(c->last_iteration[id]) +
               "); iterations of a tensor must increase");
    }
    if (!c->submit->push({id, {flags}, iteration})) {
      fail(BYTECOMP_ERR_INTERNAL, "submit ring full although every tensor has at most one "
                                  "push in flight");
    }
    try {
      c->header->doorbell.post();
    } catch (const std::exception& e) {
      c->break_job(BYTECOMP_ERR_PROTOCOL, std::string("job doorbell unusable: ") + e.what());
      require_healthy(c);
    }
    const bytecomp_handle h = c->next_handle++;
    c->ops.emplace(h, Op{id, iteration});
    c->pending[id] = h;
    c->last_iteration[id] = static_cast<int64_t>(iteration);
    *out = h;
  });
}

}  // namespace

extern "C" {

bytecomp_status bytecomp_push_pull(bytecomp_client* c, uint32_t id, uint64_t iteration,
                                   bytecomp_handle* out) {
  return push_pull(c, id, iteration, out, 0, "bytecomp_push_pull");
}

bytecomp_status bytecomp_push_pull_compressed(bytecomp_client* c, uint32_t id, uint64_t iteration,
                                              bytecomp_handle* out) {
  return push_pull(c, id, iteration, out, ipc::kSubmitCompressed, "bytecomp_push_pull_compressed");
}

bytecomp_status bytecomp_push_pull_split(bytecomp_client* c, uint32_t id, uint64_t iteration,
                                         uint32_t dense_partitions, bytecomp_handle* out) {
  if (dense_partitions > ipc::kSubmitMaxDense) {
    return guarded([&] {
      if (out != nullptr) *out = 0;
      fail(BYTECOMP_ERR_INVALID_ARGUMENT,
           "bytecomp_push_pull_split: dense_partitions " + std::to_string(dense_partitions) +
               " above the protocol's " + std::to_string(ipc::kSubmitMaxDense));
    });
  }
  return push_pull(c, id, iteration, out,
                   ipc::kSubmitCompressed | (dense_partitions << ipc::kSubmitDenseShift),
                   "bytecomp_push_pull_split");
}

bytecomp_status bytecomp_partition_bytes(bytecomp_client* c, uint64_t* out) {
  return guarded([&] {
    require_client(c);
    if (out == nullptr) fail(BYTECOMP_ERR_INVALID_ARGUMENT, "out_bytes is NULL");
    *out = 0;
    std::lock_guard lock(c->mu);
    require_started(c, "bytecomp_partition_bytes");
    *out = c->header->partition_bytes.load(std::memory_order_acquire);
  });
}

bytecomp_status bytecomp_tensor_partitions(bytecomp_client* c, uint32_t id,
                                          uint64_t* out_partition_bytes,
                                          uint32_t* out_partitions) {
  return guarded([&] {
    require_client(c);
    if (out_partition_bytes == nullptr)
      fail(BYTECOMP_ERR_INVALID_ARGUMENT, "out_partition_bytes is NULL");
    *out_partition_bytes = 0;
    if (out_partitions != nullptr) *out_partitions = 0;
    std::lock_guard lock(c->mu);
    require_started(c, "bytecomp_tensor_partitions");
    require_tensor(c, id);
    const auto [pb, parts] = c->tensor_partitions(id);
    *out_partition_bytes = pb;
    if (out_partitions != nullptr) *out_partitions = parts;
  });
}

bytecomp_status bytecomp_broadcast(bytecomp_client* c, uint32_t id, uint64_t iteration,
                                   uint32_t root_rank, uint64_t nbytes, uint64_t tag,
                                   bytecomp_handle* out) {
  return guarded([&] {
    require_client(c);
    if (out == nullptr) fail(BYTECOMP_ERR_INVALID_ARGUMENT, "out_handle is NULL");
    *out = 0;
    std::lock_guard lock(c->mu);
    require_started(c, "bytecomp_broadcast");
    c->check_health();
    require_healthy(c);
    require_tensor(c, id);
    const TensorInfo& t = c->tensors[id];
    if (c->pending[id] != 0) {
      fail(BYTECOMP_ERR_STATE, "tensor '" + t.name + "' already has an operation in flight (" +
                                   c->describe(c->ops.at(c->pending[id])) +
                                   "): wait for that handle first");
    }
    if (iteration > static_cast<uint64_t>(INT64_MAX) ||
        static_cast<int64_t>(iteration) <= c->last_iteration[id]) {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT,
           "tensor '" + t.name + "': iteration " + std::to_string(iteration) +
               " is not after the last one (" + std::to_string(c->last_iteration[id]) +
               "); iterations of a tensor must increase");
    }
    if (nbytes > t.bytes) {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT, "broadcast of " + std::to_string(nbytes) +
                                              " bytes exceeds tensor '" + t.name + "''s " +
                                              std::to_string(t.bytes) + " bytes");
    }
    ipc::Collective m;
    m.op = ipc::CollectiveOp::kBroadcast;
    m.tensor = id;
    m.iteration = iteration;
    m.root = root_rank;
    m.nbytes = nbytes;
    m.tag = tag;
    c->send_started(ipc::encode(m));
    const bytecomp_handle h = c->next_handle++;
    Op op{id, iteration};
    op.kind = "broadcast";
    c->ops.emplace(h, std::move(op));
    c->pending[id] = h;
    c->last_iteration[id] = static_cast<int64_t>(iteration);
    *out = h;
  });
}

bytecomp_status bytecomp_barrier(bytecomp_client* c, bytecomp_handle* out) {
  return guarded([&] {
    require_client(c);
    if (out == nullptr) fail(BYTECOMP_ERR_INVALID_ARGUMENT, "out_handle is NULL");
    *out = 0;
    std::lock_guard lock(c->mu);
    require_started(c, "bytecomp_barrier");
    c->check_health();
    require_healthy(c);
    if (c->pending_barrier != 0) {
      fail(BYTECOMP_ERR_STATE, c->describe(c->ops.at(c->pending_barrier)) +
                                   " is still in flight: wait for that handle first");
    }
    ipc::Collective m;
    m.op = ipc::CollectiveOp::kBarrier;
    m.tensor = ipc::kBarrierTensor;
    m.iteration = c->barrier_seq;
    c->send_started(ipc::encode(m));
    const bytecomp_handle h = c->next_handle++;
    Op op{ipc::kBarrierTensor, c->barrier_seq++};
    op.kind = "barrier";
    c->ops.emplace(h, std::move(op));
    c->pending_barrier = h;
    *out = h;
  });
}

bytecomp_status bytecomp_wait(bytecomp_client* c, bytecomp_handle h, uint32_t timeout_ms) {
  return guarded([&] {
    require_client(c);
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    std::unique_lock lock(c->mu);
    require_started(c, "bytecomp_wait");
    bool reaped_once = false;
    for (;;) {
      auto it = c->ops.find(h);
      if (it == c->ops.end()) {
        fail(BYTECOMP_ERR_INVALID_ARGUMENT,
             "unknown handle " + std::to_string(h) +
                 " (never returned by bytecomp_push_pull, or already waited for)");
      }
      if (it->second.done) {
        Op op = std::move(it->second);
        c->ops.erase(it);
        if (c->pending.size() > op.tensor && c->pending[op.tensor] == h) c->pending[op.tensor] = 0;
        if (c->pending_barrier == h) c->pending_barrier = 0;
        if (op.status != BYTECOMP_OK) fail(op.status, op.message);
        return;
      }
      const auto now = Clock::now();
      if (now >= deadline && !reaped_once && !c->reaper_active) {
        // Even a zero timeout looks at the completions once.
        reaped_once = true;
        c->reap(lock, std::chrono::microseconds(0));
        continue;
      }
      if (now >= deadline) {
        fail(BYTECOMP_ERR_TIMEOUT,
             c->describe(it->second) + " not finished within " +
                 std::to_string(timeout_ms) + " ms; the handle stays valid");
      }
      const auto slice = std::min<Clock::duration>(deadline - now, kSlice);
      if (!c->reaper_active) {
        reaped_once = true;
        c->reap(lock, std::chrono::duration_cast<std::chrono::microseconds>(slice));
      } else {
        c->cv.wait_for(lock, slice);
      }
    }
  });
}

bytecomp_status bytecomp_poll(bytecomp_client* c, bytecomp_handle h, int* done) {
  return guarded([&] {
    require_client(c);
    if (done == nullptr) fail(BYTECOMP_ERR_INVALID_ARGUMENT, "out_done is NULL");
    std::unique_lock lock(c->mu);
    require_started(c, "bytecomp_poll");
    auto it = c->ops.find(h);
    if (it == c->ops.end()) {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT,
           "unknown handle " + std::to_string(h) +
               " (never returned by bytecomp_push_pull, or already waited for)");
    }
    if (!it->second.done && !c->reaper_active && c->phase == bytecomp_client::Phase::kStarted) {
      c->reap(lock, std::chrono::microseconds(0));
      it = c->ops.find(h);
    }
    *done = it->second.done ? 1 : 0;
  });
}

}  // extern "C"
