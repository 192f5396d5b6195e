// A fixed-size pool of worker threads for CPU work (compression, reduction):
// the "spare CPU cores" of a GPU node. Callers pass it by reference; nothing
// owns a hidden global pool.
//
// Thread-safety: thread-safe. parallel_for() may be called from several
// threads at once; the calling thread takes part in the work, so a pool of
// size 0 runs everything inline and a parallel_for() issued from inside a
// worker cannot deadlock. Idle workers block on a condition variable.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace bytecomp {

class ThreadPool {
 public:
  // `threads` workers besides the caller; 0 is valid (inline execution).
  explicit ThreadPool(size_t threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Workers + the calling thread.
  size_t concurrency() const { return workers_.size() + 1; }

  // Runs fn on a worker; fire-and-forget. fn must not throw.
  void submit(std::function<void()> fn);

  // Splits [0, n) into at most `max_chunks` contiguous ranges of at least
  // `min_chunk` elements and runs fn(begin, end) on each, blocking until all
  // are done. max_chunks == 0 means concurrency(). If fn throws, the first
  // exception is rethrown here after every chunk finished.
  void parallel_for(size_t n, size_t min_chunk,
                    const std::function<void(size_t, size_t)>& fn,
                    size_t max_chunks = 0);

 private:
  void worker_loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace bytecomp
