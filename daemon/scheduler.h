// Priority scheduling of tensor partitions (DESIGN.md §4 "runtime's real
// scheduling"): a tensor whose push_pull is complete on every local rank is
// cut into partitions of at most partition_bytes (so large tensors pipeline
// and share the cores with small ones), and partitions are handed out by
// priority: the tensor declared first (needed first by the next forward pass)
// goes first, ties in arrival order. A batch never exceeds the bytes-in-
// flight bound, except that one partition always fits.
//
// Thread-safety: neither thread-safe nor thread-bound; its engine owns it.
#pragma once

#include <cstdint>
#include <cstddef>
#include <map>
#include <utility>
#include <vector>

namespace bytecomp::daemon {

struct Task {
  uint32_t tensor = 0;
  uint64_t iteration = 0;
  uint64_t begin = 0;  // byte range of the tensor
  uint64_t end = 0;
};

class Scheduler {
 public:
  // Queues every partition of the tensor. Partitions are multiples of 64
  // bytes and of elem_size (64 is a multiple of every element size we have).
  // Returns the number of partitions.
  size_t add(uint32_t tensor, uint64_t iteration, uint64_t bytes, uint64_t partition_bytes);

  // Up to max_tasks highest-priority partitions whose bytes sum to at most
  // max_bytes (the first always fits).
  std::vector<Task> next_batch(size_t max_tasks, uint64_t max_bytes);

  bool empty() const { return queue_.empty(); }
  size_t size() const { return queue_.size(); }

 private:
  // Key: (priority = tensor id, arrival sequence).
  std::map<std::pair<uint32_t, uint64_t>, Task> queue_;
  uint64_t seq_ = 0;
};

}  // namespace bytecomp::daemon
