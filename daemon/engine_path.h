// The seam between the engine's core (daemon/engine.h) and its execution
// paths. The core decides when a partition runs (rounds, priorities, the
// bytes-in-flight bound); a path decides what running it means:
//
//   local (daemon/engine_local.h)  single-node jobs: reduce, compress and
//                                  decompress in place, finished in start();
//   ps    (daemon/engine_ps.h)     push the node's sum to its parameter
//                                  server, pull the aggregate;
//   peer  (daemon/engine_peer.h)   allgather the node's (compressed) sum
//                                  between the daemons, sum all of them.
//
// A new path implements ExecutionPath and is chosen per tensor where the
// core builds its paths (Engine::open_paths()).
//
// Asynchronous paths hand their results to the core through the Inbox: the
// transport's threads deliver() arrivals and acked() bytes, the engine thread
// take()s them.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <boost/interprocess/sync/interprocess_semaphore.hpp>

#include "common/error.h"
#include "daemon/engine_phases.h"
#include "daemon/engine_types.h"
#include "daemon/local_reduce.h"
#include "daemon/scheduler.h"
#include "transport/transport.h"

namespace bytecomp::daemon {

struct JobByteCounters;  // daemon/counting_compressor.h

// Results of asynchronous operations, handed from the transport's threads to
// the engine thread. Shared with the callbacks, which may run after the
// engine is gone: close() makes them no-ops.
// Thread-safety: thread-safe (one mutex, held only to move values in or
// out; the doorbell is posted with it held, so close() cannot race a post).
class Inbox {
 public:
  struct Arrival {
    Task task;  // the partition it answers (the engine's collectives fill tensor, iteration, range)
    Status status;
    transport::Buffer result;  // ps: the pull's answer; peer: empty (PeerJob::take() has it)
    uint64_t at_ns = 0;        // monotonic_ns() when delivered (0: not stamped)
    // What answered: a path's partition, or one of the engine's own
    // collective operations (not a path's: Engine handles them).
    enum class Kind : uint8_t { kPath, kBroadcast, kBarrier } kind = Kind::kPath;
  };
  // `stamp`: deliver() records each arrival's time (phase timestamps on).
  Inbox(boost::interprocess::interprocess_semaphore* doorbell, bool stamp)
      : doorbell_(doorbell), stamp_(stamp) {}
  void deliver(Arrival a);
  // A push of `bytes` (tensor bytes) was acknowledged by its server (or a
  // peer payload by every peer); `link` >= 0: the task's link charge
  // (Task::link, Task::link_bytes) comes back with it.
  void acked(uint64_t bytes, int64_t link = -1, uint64_t link_bytes = 0);
  void fail(const Status& s);
  // Rings the engine's doorbell (until closed): something outside the
  // arrivals changed.
  void wake();
  void close();
  std::vector<Arrival> take();
  struct Acked {
    uint64_t bytes = 0;                                // tensor bytes
    std::vector<std::pair<uint32_t, uint64_t>> links;  // (link, bytes) credits returned
  };
  Acked take_acked();
  Status failure();

 private:
  void ring();  // mu_ held
  std::mutex mu_;
  boost::interprocess::interprocess_semaphore* doorbell_;  // null once closed
  const bool stamp_;
  std::vector<Arrival> arrivals_;
  Acked acked_;
  Status failure_;
};

// What the core lends every path. The pointees belong to the engine and
// outlive its paths.
struct PathContext {
  std::string job;
  const std::vector<TensorSpec>* tensors = nullptr;
  // Per tensor: its partition size (strategy::tensor_partition_bytes: the
  // job's cut into the option's pieces), fixed for the life of the job.
  std::vector<uint64_t> partition_bytes;
  IntraNodeReducer* reducer = nullptr;
  std::shared_ptr<Inbox> inbox;
  // Paths stamp kReduced..kSent in start() and kDecompressed, kCopiedOut in
  // finish(); the core stamps the rest (see Engine).
  PhaseLog* phases = nullptr;
  // Multi-node paths add what they compress here (the plans come from the
  // coordinator, not from the daemon's counting wrappers); null: not counted.
  JobByteCounters* bytes = nullptr;
};

// One way of running a tensor partition. Threading: start() and finish()
// run on the engine's pool workers (or the engine thread), concurrently for
// distinct partitions and never concurrently for the same one; a partition's
// start() happens before its finish(). Everything else runs on the engine
// thread. A path keeps per-partition state (error feedback, scratch) indexed
// by partition, so concurrent calls touch disjoint state without locks.
class ExecutionPath {
 public:
  virtual ~ExecutionPath() = default;
  virtual const char* name() const = 0;
  // True: start() finishes the task (nothing goes off the node). False: the
  // task finishes with an Inbox arrival, and its bytes count against the
  // bytes-in-flight bound until the Inbox reports them acknowledged.
  virtual bool synchronous() const = 0;
  // Starts task `t` over the local ranks' buffers (bufs[r] is rank r's copy
  // of the tensor). Throws Error on a broken invariant (fails the job).
  virtual void start(const Task& t, std::span<char* const> bufs) = 0;
  // Writes an arrived result into every local rank's buffer. Returns the
  // problem ("" when fine): the answer was unusable (fails the job).
  virtual std::string finish(const Inbox::Arrival& a, std::span<char* const> bufs) = 0;
  // The link whose credit window (scheduler.link_window) bounds task `t`'s
  // push, and the most bytes that push puts on it; none where the path
  // bounds its own flows (the ring's chunk credit) or sends nothing. Engine
  // thread, before `t`'s start().
  struct LinkCharge {
    uint32_t link = 0;
    uint64_t bytes = 0;
  };
  virtual std::optional<LinkCharge> link_charge(const Task&) { return std::nullopt; }
  // Engine thread, each loop turn: a failure the path detected on its own
  // (e.g. a deadline passed).
  virtual Status check(std::chrono::steady_clock::time_point) { return Status::Ok(); }
  // From Engine::stop() once the engine thread has ended: late callbacks
  // become no-ops. Idempotent.
  virtual void close() {}
};

}  // namespace bytecomp::daemon
