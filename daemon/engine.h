// The data path of one job: takes push_pull submissions from the clients'
// rings, reduces each tensor over the local ranks (partitioned, by priority,
// over the shared ThreadPool), runs the tensor's plan and posts completions.
//
// Per partition of a compressed tensor: sum into local rank 0's buffer,
// compress (error-feedback state per tensor partition lives here), the
// inter-node phase, decompress, copy to every local rank. A job on one node
// has no inter-node phase to run: the compressed partition is decompressed as
// is, which is exactly what this node's share of a multi-node round does.
// Partition boundaries are fixed for the life of the job (the partition size
// is read once, at start), so per-partition state stays meaningful.
//
// Strategy changes (set_plans) take effect at one iteration for every tensor
// of the job: the first iteration after every round already begun.
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
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "client/ipc/protocol.h"
#include "client/ipc/shm_layout.h"
#include "common/error.h"
#include "common/thread_pool.h"
#include "daemon/config.h"
#include "daemon/engine_types.h"
#include "daemon/peer_allgather.h"
#include "daemon/plan.h"
#include "daemon/scheduler.h"
#include "server/ps_client.h"

namespace bytecomp::daemon {

// Results of asynchronous PS operations, handed from the transport's
// completion thread to the engine. Shared with the callbacks, which may run
// after the engine is gone: close() makes them no-ops.
// Thread-safety: thread-safe.
class Inbox {
 public:
  struct Arrival {
    uint32_t tensor;
    uint64_t iteration;
    uint64_t begin, end;
    Status status;
    transport::Buffer result;
    bool peer = false;  // a complete allgather round: PeerJob::take() has it
  };
  explicit Inbox(boost::interprocess::interprocess_semaphore* doorbell) : doorbell_(doorbell) {}
  void deliver(Arrival a);
  // A push of `bytes` (tensor bytes) was acknowledged by its server.
  void acked(uint64_t bytes);
  void fail(const Status& s);
  void close();
  std::vector<Arrival> take();
  uint64_t take_acked();
  Status failure();

 private:
  void ring();  // mu_ held
  std::mutex mu_;
  boost::interprocess::interprocess_semaphore* doorbell_;  // null once closed
  std::vector<Arrival> arrivals_;
  uint64_t acked_ = 0;
  Status failure_;
};

// Multi-node jobs with allgather tensors: the daemon's peer endpoint (null:
// none configured; such jobs fail at join) and the bound on a peer's answer
// and on waiting for the other nodes' payloads of a round.
struct PeerOptions {
  PeerHub* hub = nullptr;
  std::chrono::milliseconds timeout{30000};
};

class Engine {
 public:
  using FailureFn = std::function<void(ErrorCode, const std::string&)>;
  // Multi-node jobs: joins the PS job (blocking; called on the engine thread).
  using JoinFn = std::function<std::shared_ptr<server::PsJob>()>;

  // `segment` must stay mapped until the engine is destroyed. `keep_mapped`,
  // when given, owns that mapping: multi-node pushes then send straight from
  // shared memory, holding it past the engine's end until the bytes left.
  Engine(std::string job_name, void* segment, const ipc::Layout& layout,
         std::vector<TensorSpec> tensors, std::vector<TensorPlan> plans, uint32_t node_rank,
         ThreadPool& pool, const Tunables& tunables, FailureFn on_failure,
         JoinFn join = nullptr, PeerOptions peers = {},
         std::shared_ptr<const void> keep_mapped = nullptr);
  ~Engine();  // stops and joins
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // A rank left gracefully (BYE): rounds waiting for it can never finish.
  void rank_left(uint32_t rank);
  // Publishes an abort in shared memory (wakes every client) and returns the
  // abort that stands: the first one published (clients may already have
  // read its reason from shared memory and exited). Thread-safe.
  std::pair<ErrorCode, std::string> publish_abort(ErrorCode code, const std::string& reason);
  void stop();
  // Installs new plans (one per tensor, already checked) at the next
  // iteration boundary. Thread-safe.
  void set_plans(std::vector<TensorPlan> plans);
  // Multi-node jobs: asks the coordinator to switch every node and server to
  // `strategy_yaml` at one iteration (a little after the latest begun here).
  // Thread-safe; the outcome is logged.
  void request_strategy(std::string strategy_yaml);
  // Iteration from which the last set_plans() applies, -1 before the engine
  // adopted it. Thread-safe.
  int64_t plans_switch_iteration() const { return switch_published_.load(); }

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

  struct Run {  // a tensor's current plan and its per-partition state
    TensorPlan plan;
    std::vector<std::unique_ptr<compress::TensorState>> states;
    std::vector<std::vector<std::byte>> scratch;
    std::optional<TensorPlan> next;
  };

  void loop();
  void install(uint32_t tensor, TensorPlan plan);
  void adopt_pending();
  void run_task(const Task& t, std::span<char* const> bufs);
  // Multi-node: local sum, compress, push + pull (completes asynchronously).
  void start_ps_task(const Task& t, std::span<char* const> bufs);
  // Multi-node: writes arrived pull results to every local rank.
  bool process_arrivals();
  struct PsPart {  // per tensor partition: the plan in force and its state
    strategy::TensorPlan plan;
    std::unique_ptr<compress::Compressor> compressor;
    std::unique_ptr<compress::TensorState> state;
  };
  PsPart& ps_part(uint32_t tensor, uint64_t begin, uint64_t iteration);
  // Peer allgather (daemon/engine_peer.cc). open_peers() runs after the
  // join; false after failing the job.
  bool open_peers();
  bool is_peer(uint32_t tensor) const { return peer_ && peer_tensor_[tensor]; }
  void start_peer_task(const Task& t, std::span<char* const> bufs);
  // Sums a complete round into every local rank's buffer; the problem, or "".
  std::string finish_peer(const Inbox::Arrival& a);
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
  std::vector<Run> runs_;
  uint32_t node_rank_;
  uint64_t partition_bytes_;
  std::mutex pending_mu_;
  std::optional<std::vector<TensorPlan>> pending_;  // guarded by pending_mu_
  std::optional<std::string> pending_yaml_;          // guarded by pending_mu_
  int64_t switch_iteration_ = -1;
  std::atomic<int64_t> switch_published_{-1};
  Scheduler sched_;
  JoinFn join_;
  // Keeps the segment mapped while the transport sends from it (zero-copy
  // pushes hold a copy until sent).
  std::shared_ptr<const void> keep_mapped_;
  std::shared_ptr<server::PsJob> ps_;
  std::shared_ptr<Inbox> inbox_;
  std::vector<std::vector<PsPart>> ps_parts_;
  // Multi-node: tensor bytes pushed and not yet acknowledged by the servers
  // (a server acknowledges a push once it summed it, whatever the other
  // nodes do), plus peer-allgather partitions until every peer acknowledged
  // receipt (whether or not their round is complete). Single node: bytes of
  // the batch being reduced.
  uint64_t inflight_bytes_ = 0;
  // Allgather tensors: their plans by first iteration (strategy changes
  // arrive on the transport's thread), per-partition error-feedback state.
  struct PeerPlans {
    std::mutex mu;
    std::vector<std::pair<uint64_t, std::vector<TensorPlan>>> by_iteration;
    TensorPlan at(uint32_t tensor, uint64_t iteration);
  };
  struct PeerPart {
    uint64_t digest = 0;
    std::unique_ptr<compress::TensorState> state;
  };
  PeerOptions peer_opts_;
  std::shared_ptr<PeerJob> peer_;
  std::shared_ptr<PeerPlans> peer_plans_;
  std::vector<bool> peer_tensor_;
  std::vector<std::vector<PeerPart>> peer_parts_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> failed_{false};
  std::mutex abort_mu_;  // serialises publish_abort between the two threads
  std::string abort_reason_;  // first published abort (guarded by abort_mu_)
  ErrorCode abort_code_ = ErrorCode::kAborted;  // its code (guarded by abort_mu_)
  std::thread thread_;
};

}  // namespace bytecomp::daemon
