// Priority scheduling of tensor partitions (DESIGN.md §4 "runtime's real
// scheduling"): a tensor whose push_pull is complete on every local rank is
// cut into partitions of at most partition_bytes (so large tensors pipeline
// and share the cores with small ones), and partitions are handed out by
// priority: the tensor declared first (needed first by the next forward pass)
// goes first, ties in arrival order. A batch never exceeds the bytes-in-
// flight bound, except that one partition always fits, and takes only the
// partitions its caller admits (the engine's per-link credit windows): a
// partition whose link is full stays queued in its place while lower-
// priority ones for other links go.
//
// Thread-safety: neither thread-safe nor thread-bound; its engine owns it.
#pragma once

#include <cstdint>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "planner/strategy/plan.h"

namespace bytecomp::daemon {

// One partition of one tensor's round: its identity is computed here once
// and carried to the path that runs it and back with its arrival (BytePS's
// task lesson), so no path re-derives index, key or count.
struct Task {
  uint32_t tensor = 0;
  uint32_t index = 0;      // partition within the tensor
  uint64_t key = 0;        // strategy::partition_key(tensor, index): the wire key
  uint64_t iteration = 0;
  uint64_t begin = 0;      // byte range of the tensor
  uint64_t end = 0;
  uint64_t count = 0;      // elements in [begin, end)
  // The plan the round runs under (fixed once per round from the job's
  // timeline); null where the path keeps its own (the local path).
  std::shared_ptr<const strategy::TensorPlan> plan;
  // The local ranks wrote this partition already compressed under `plan`'s
  // compressor (ipc::kSubmitCompressed): the path decodes or forwards their
  // payloads instead of summing and compressing (daemon/client_payload.h).
  // (A compressed round's first dense_partitions partitions stay dense:
  // the daemon compresses them, the strategy's cpu_share.)
  bool compressed = false;
  // Set by the engine when the partition is admitted under a link's credit
  // window (scheduler.link_window): the link (the server it pushes to) and
  // the bytes charged to it, returned when the push is acknowledged.
  // link < 0: not charged to any link.
  int64_t link = -1;
  uint64_t link_bytes = 0;

  uint64_t bytes() const { return end - begin; }
};

class Scheduler {
 public:
  // Queues every partition of the tensor. Partitions are multiples of 64
  // bytes and of elem_size (64 is a multiple of every element size we have).
  // `priority` (default: the tensor id; lower first): a fused bucket
  // (server/fusion.h) takes its earliest-declared member's. Returns the
  // number of partitions. `first`: the partition queued first, the others
  // following it cyclically (a bucket's equal shards: each node starts at
  // another server's, so the nodes do not all push to one server at once).
  size_t add(uint32_t tensor, uint64_t iteration, uint64_t bytes, uint64_t partition_bytes,
             uint32_t elem_size, std::shared_ptr<const strategy::TensorPlan> plan = {},
             bool compressed = false, uint32_t dense_partitions = 0,
             std::optional<uint32_t> priority = std::nullopt, uint32_t first = 0);

  // Up to max_tasks highest-priority partitions whose bytes sum to at most
  // max_bytes (the first always fits) and that `admit` accepts (it may
  // record what it charged in the task; a refused one stays queued and
  // keeps its place). Empty when nothing is admitted.
  using AdmitFn = std::function<bool(Task&)>;
  std::vector<Task> next_batch(size_t max_tasks, uint64_t max_bytes,
                               const AdmitFn& admit = {});

  bool empty() const { return queue_.empty(); }
  size_t size() const { return queue_.size(); }

 private:
  // Key: (priority = tensor id, arrival sequence).
  std::map<std::pair<uint32_t, uint64_t>, Task> queue_;
  uint64_t seq_ = 0;
};

}  // namespace bytecomp::daemon
