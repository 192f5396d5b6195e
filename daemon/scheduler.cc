#include "daemon/scheduler.h"

#include <algorithm>

#include "planner/strategy/partition.h"

namespace bytecomp::daemon {

size_t Scheduler::add(uint32_t tensor, uint64_t iteration, uint64_t bytes,
                      uint64_t partition_bytes, uint32_t elem_size,
                      std::shared_ptr<const strategy::TensorPlan> plan, bool compressed,
                      uint32_t dense_partitions, std::optional<uint32_t> priority,
                      uint32_t first) {
  const uint64_t part = std::max<uint64_t>(64, partition_bytes / 64 * 64);
  size_t n = 0;
  uint64_t begin = 0;
  std::vector<Task> tasks;
  do {
    Task t;
    t.tensor = tensor;
    t.index = static_cast<uint32_t>(n);
    t.key = strategy::partition_key(tensor, t.index);
    t.iteration = iteration;
    t.begin = begin;
    t.end = std::min(bytes, begin + part);
    t.count = t.bytes() / std::max<uint32_t>(elem_size, 1);
    t.plan = plan;
    t.compressed = compressed && n >= dense_partitions;
    begin = t.end;
    tasks.push_back(std::move(t));
    ++n;
  } while (begin < bytes);
  for (size_t i = 0; i < n; ++i) {
    queue_.emplace(std::make_pair(priority.value_or(tensor), seq_++),
                   std::move(tasks[(i + first) % n]));
  }
  return n;
}

std::vector<Task> Scheduler::next_batch(size_t max_tasks, uint64_t max_bytes,
                                        const AdmitFn& admit) {
  std::vector<Task> batch;
  uint64_t total = 0;
  auto it = queue_.begin();
  while (it != queue_.end() && batch.size() < std::max<size_t>(max_tasks, 1)) {
    const uint64_t b = it->second.bytes();
    if (!batch.empty() && total + b > max_bytes) break;
    if (admit && !admit(it->second)) {
      ++it;
      continue;
    }
    total += b;
    batch.push_back(std::move(it->second));
    it = queue_.erase(it);
  }
  return batch;
}

}  // namespace bytecomp::daemon
