// One engine thread of the parameter server: a FIFO of tasks (a partition's
// tasks always run on its engine, in arrival order, so its round state needs
// no lock). Thread-safe: post() and stop() from any thread but its own.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <pthread.h>
#include <thread>

#include "server/server_log.h"

namespace bytecomp::server {

class EngineThread {
 public:
  EngineThread()
      : thread_([this] {
          pthread_setname_np(pthread_self(), "bc-srv-engine");
          run();
        }) {}
  ~EngineThread() { stop(); }
  void post(std::function<void()> fn) {
    {
      std::lock_guard lk(mu_);
      if (stopping_) return;
      queue_.push_back(std::move(fn));
    }
    cv_.notify_one();
  }
  // Runs what is queued, then joins.
  void stop() {
    {
      std::lock_guard lk(mu_);
      stopping_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run() {
    std::unique_lock lk(mu_);
    for (;;) {
      cv_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      auto fn = std::move(queue_.front());
      queue_.pop_front();
      lk.unlock();
      try {
        fn();
      } catch (const std::exception& e) {
        BC_LOG(LogServer(), kError) << "engine task failed: " << e.what();
      }
      lk.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace bytecomp::server
