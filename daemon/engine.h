// The data path of one job: takes push_pull submissions from the clients'
// rings, reduces each tensor over the local ranks (partitioned, by priority,
// over the shared ThreadPool) and posts completions.
//
// Thread-safety: the engine runs its own thread. rank_left(), stop() and
// the constructor/destructor are called from the daemon's control thread;
// they are thread-safe with respect to the engine thread. `on_failure` is
// called from the engine thread at most once, after the abort is published
// in shared memory.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "client/ipc/protocol.h"
#include "client/ipc/shm_layout.h"
#include "common/error.h"
#include "common/thread_pool.h"
#include "daemon/config.h"
#include "daemon/scheduler.h"

namespace bytecomp::daemon {

struct TensorSpec {
  std::string name;
  uint64_t count = 0;
  ipc::DType dtype = ipc::DType::kFloat32;
  uint64_t bytes = 0;
};

class Engine {
 public:
  using FailureFn = std::function<void(ErrorCode, const std::string&)>;

  // `segment` must stay mapped until the engine is destroyed.
  Engine(std::string job_name, void* segment, const ipc::Layout& layout,
         std::vector<TensorSpec> tensors, ThreadPool& pool, const Tunables& tunables,
         FailureFn on_failure);
  ~Engine();  // stops and joins
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // A rank left gracefully (BYE): rounds waiting for it can never finish.
  void rank_left(uint32_t rank);
  // Publishes an abort in shared memory (wakes every client). Thread-safe.
  void publish_abort(ErrorCode code, const std::string& reason);
  void stop();

  ipc::SegmentHeader* header() const { return header_; }

 private:
  struct Round {
    uint64_t iteration = 0;
    uint32_t arrived = 0;
    bool running = false;  // all arrived, partitions queued or executing
    size_t partitions_left = 0;
    int64_t last_done = -1;
    std::vector<bool> from;
  };

  void loop();
  // Returns false (after failing the job) on a protocol violation.
  bool drain();
  bool check_left();
  void run_batch(const std::vector<Task>& batch);
  void complete(uint32_t tensor);
  void fail(ErrorCode code, const std::string& reason);

  std::string job_;
  char* base_;
  ipc::Layout layout_;
  std::vector<TensorSpec> tensors_;
  ThreadPool& pool_;
  const Tunables& tunables_;
  FailureFn on_failure_;
  ipc::SegmentHeader* header_;
  ipc::ClientArea* clients_;
  std::vector<ipc::Ring> submit_;
  std::vector<ipc::Ring> complete_;
  std::vector<Round> rounds_;
  std::unique_ptr<std::atomic<bool>[]> left_;
  Scheduler sched_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> failed_{false};
  std::mutex abort_mu_;  // serialises publish_abort between the two threads
  std::thread thread_;
};

}  // namespace bytecomp::daemon
