#include "common/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <memory>

#include <pthread.h>

namespace bytecomp {

ThreadPool::ThreadPool(size_t threads) {
  workers_.reserve(threads);
  for (size_t i = 0; i < threads; ++i)
    workers_.emplace_back([this] {
      pthread_setname_np(pthread_self(), "bc-pool");
      worker_loop();
    });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::submit(std::function<void()> fn) {
  if (workers_.empty()) {
    fn();
    return;
  }
  {
    std::lock_guard lock(mu_);
    queue_.push_back(std::move(fn));
  }
  cv_.notify_one();
}

void ThreadPool::worker_loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

void ThreadPool::parallel_for(size_t n, size_t min_chunk,
                              const std::function<void(size_t, size_t)>& fn,
                              size_t max_chunks) {
  if (n == 0) return;
  if (max_chunks == 0) max_chunks = concurrency();
  min_chunk = std::max<size_t>(min_chunk, 1);
  size_t chunks = std::min(max_chunks, (n + min_chunk - 1) / min_chunk);
  if (chunks <= 1) {
    fn(0, n);
    return;
  }
  // Helpers that start late (or never, while every worker is busy) must not
  // touch this stack frame, so the shared state is reference-counted; `fn` is
  // only called for a claimed chunk, and we return only when every claimed
  // chunk is done, so the reference to it stays valid.
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::atomic<size_t> next{0};
    size_t remaining = 0;
    std::exception_ptr error;
  };
  auto st = std::make_shared<State>();
  st->remaining = chunks;
  const auto* fnp = &fn;
  auto run_chunks = [st, fnp, n, chunks] {
    for (;;) {
      size_t c = st->next.fetch_add(1, std::memory_order_relaxed);
      if (c >= chunks) return;
      size_t begin = n * c / chunks, end = n * (c + 1) / chunks;
      std::exception_ptr err;
      try {
        (*fnp)(begin, end);
      } catch (...) {
        err = std::current_exception();
      }
      std::lock_guard lock(st->mu);
      if (err && !st->error) st->error = err;
      if (--st->remaining == 0) st->cv.notify_all();
    }
  };
  size_t helpers = std::min(chunks - 1, workers_.size());
  for (size_t i = 0; i < helpers; ++i) submit(run_chunks);
  run_chunks();
  std::unique_lock lock(st->mu);
  st->cv.wait(lock, [&] { return st->remaining == 0; });
  if (st->error) std::rethrow_exception(st->error);
}

}  // namespace bytecomp
