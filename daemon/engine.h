// The data path of one job: takes push_pull submissions from the clients'
// rings, waits until every local rank submitted a tensor (a round), cuts it
// into partitions, hands them out by priority within the bytes-in-flight
// bound, runs each on the tensor's execution path (daemon/engine_path.h:
// local, ps, peer or ring) and posts completions.
//
// Parts and what each owns:
//   Engine (core)    the rings, the rounds (one per tensor), the Scheduler,
//                    the bytes-in-flight count, pending strategy changes,
//                    the abort, the PS job membership (join, leave/abort),
//                    the Inbox and the engine thread. It chooses a path per
//                    round of a tensor from the plan in force at the round's
//                    iteration (path_for: a ring <-> ps switch applies at
//                    the coordinator's iteration).
//   ExecutionPath    per-partition state of its tensors (error feedback,
//                    scratch, plans in force) and what running a partition
//                    means. Owned by the core (unique_ptr), destroyed with it.
//   IntraNodeReducer the sum over the local ranks (ShmSimdReducer unless the
//                    options give another). Owned by the core, lent to paths.
//   Inbox            shared (shared_ptr) with the transport's callbacks,
//                    which may outlive the engine; closed in stop().
//
// Partition boundaries are fixed for the life of the job (the partition size
// is read once, at start, or taken from the cluster at the join), so
// per-partition state stays meaningful.
//
// Strategy changes (set_plans) take effect at one iteration for every tensor
// of the job: the first iteration after every round already begun. They
// concern single-node jobs (the local path); multi-node jobs follow the
// coordinator (request_strategy).
//
// Threading model:
//   control thread   (the daemon's) constructs, calls rank_left(), stop(),
//                    set_plans(), request_strategy(), publish_abort(),
//                    plans_switch_iteration() and destroys the engine.
//   engine thread    runs loop(): the join, opening the paths, draining the
//                    rings, rounds, scheduling, completions, and
//                    adopt_pending(). Owns every Round and the Scheduler
//                    without locks.
//   pool workers     (the daemon's shared ThreadPool) run path start() and
//                    finish() for a batch while the engine thread waits in
//                    parallel_for(); distinct partitions only.
//   transport threads run the PS and peer callbacks, which touch only the
//                    Inbox.
// Phase timestamps (daemon/engine_phases.h): the core stamps kFirstRank and
// kAllRanks (drain), kStart (before a path's start()) and kArrived (the
// Inbox's delivery time) and publishes a record after a path finished it;
// the paths stamp what happens inside start() and finish().
// Locks: pending_mu_ (pending plans/strategy), abort_mu_ (the first abort),
// the Inbox's mutex; each is held only to move a value and none is taken
// while another is held, so there is no lock order to keep. The engine
// thread and the workers meet only through parallel_for()'s barrier.
// `on_failure` is called from the engine thread at most once, after the
// abort is published in shared memory.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "client/ipc/protocol.h"
#include "client/ipc/shm_layout.h"
#include "common/error.h"
#include "common/thread_pool.h"
#include "daemon/config.h"
#include "daemon/engine_collectives.h"
#include "daemon/engine_path.h"
#include "daemon/engine_peer.h"
#include "daemon/engine_phases.h"
#include "daemon/engine_ring.h"
#include "daemon/engine_types.h"
#include "daemon/local_reduce.h"
#include "daemon/plan.h"
#include "daemon/submit_check.h"
#include "daemon/scheduler.h"
#include "planner/strategy/timeline.h"
#include "server/ps_client.h"

namespace bytecomp::daemon {

class LocalPath;
class PsPath;

class Engine {
 public:
  using FailureFn = std::function<void(ErrorCode, const std::string&)>;
  // Multi-node jobs: joins the PS job (blocking; called on the engine thread).
  using JoinFn = std::function<std::shared_ptr<server::PsJob>()>;

  struct Options {
    std::string job;
    // Must stay mapped until the engine is destroyed.
    void* segment = nullptr;
    ipc::Layout layout;
    std::vector<TensorSpec> tensors;
    // One per tensor (single-node jobs; multi-node jobs follow the
    // coordinator's plans).
    std::vector<TensorPlan> plans;
    uint32_t node_rank = 0;
    FailureFn on_failure;
    JoinFn join;  // null: a single-node job
    PeerOptions peers;
    // When given, owns the segment's mapping: multi-node pushes then send
    // straight from shared memory, holding it past the engine's end until
    // the bytes left.
    std::shared_ptr<const void> keep_mapped;
    // Null: ShmSimdReducer.
    std::unique_ptr<IntraNodeReducer> reducer;
    // Multi-node: called on the engine thread once the job joined the
    // servers, before the first round (the auto tuner's attach).
    std::function<void(Engine&, const std::shared_ptr<server::PsJob>&, uint64_t partition_bytes)>
        on_joined;
    // Multi-node: counts the paths' compression (null: not counted).
    std::shared_ptr<JobByteCounters> bytes;
  };

  // `pool` and `tunables` are borrowed for the engine's life. Starts the
  // engine thread.
  Engine(Options options, ThreadPool& pool, const Tunables& tunables);
  ~Engine();  // stops and joins
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Local rank `rank`'s collective operation (a COLLECTIVE message, decoded
  // by the control thread): the engine thread runs it once every local rank
  // sent the same one (docs/daemon.md "Broadcast and barrier"). Thread-safe.
  void submit_collective(uint32_t rank, const ipc::Collective& c);
  // A rank left gracefully (BYE): rounds waiting for it can never finish.
  void rank_left(uint32_t rank);
  // Publishes an abort in shared memory (wakes every client) and returns the
  // abort that stands: the first one published (clients may already have
  // read its reason from shared memory and exited). Thread-safe.
  std::pair<ErrorCode, std::string> publish_abort(ErrorCode code, const std::string& reason);
  void stop();
  // Installs new plans (one per tensor, already checked) at the next
  // iteration boundary. Thread-safe. Single-node jobs only. Throws
  // Error(kInvalidArgument) naming the tensor when a plan changes its
  // tensor's pieces (strategy::layout_change: the layout is fixed for the
  // job); nothing changes then.
  void set_plans(std::vector<TensorPlan> plans);
  // Multi-node jobs: asks the coordinator to switch every node and server to
  // `strategy_yaml` at one iteration (a little after the latest begun here).
  // Thread-safe; the outcome is logged.
  void request_strategy(std::string strategy_yaml);
  // Iteration from which the last set_plans() applies, -1 before the engine
  // adopted it. Thread-safe.
  int64_t plans_switch_iteration() const { return switch_published_.load(); }

  ipc::SegmentHeader* header() const { return header_; }

  // A copy of the phase timestamps of the last PhaseLog::kIterations
  // iterations (daemon/engine_phases.h), by tensor, partition, iteration;
  // empty with engine.phase_timestamps off or before a multi-node job
  // joined. Thread-safe; allocates (not for the hot path).
  std::vector<PhaseRecord> phase_records() const;
  // Histograms of the spans of every partition round published so far
  // (daemon/engine_phases.h). Thread-safe.
  PhaseStats phase_stats() const { return phases_.stats(); }
  // Partitions of each tensor as the phase records count them (empty while
  // phase_records() is). Thread-safe.
  std::vector<uint32_t> phase_partitions() const { return phases_.partitions(); }

  // What the data path holds, as the engine thread last published it (at
  // each turn of its loop and after each batch). Thread-safe.
  struct Gauges {
    uint64_t queued_partitions = 0;  // in the scheduler, waiting for a worker
    uint64_t inflight_bytes = 0;     // multi-node pushes not yet acknowledged
    uint32_t waiting_tensors = 0;    // submitted by some local ranks, not all
  };
  Gauges gauges() const {
    return {queued_pub_.load(std::memory_order_relaxed),
            inflight_pub_.load(std::memory_order_relaxed),
            waiting_pub_.load(std::memory_order_relaxed)};
  }

 private:
  // iteration, arrived, running (all arrived, partitions queued or
  // executing), last_done, from: what the submission checks read.
  struct Round : SubmitRound {
    uint64_t first_ns = 0;  // first local rank's submission seen
    size_t partitions_left = 0;
  };

  void loop();
  // Multi-node: the join and the ps/peer paths; false after failing the job.
  bool open_paths();
  // Multi-node: the path a round of `unit` under `plan` runs on; null after
  // failing the job (a ring round without a ring).
  ExecutionPath* path_for(uint32_t unit, const TensorPlan& plan, uint64_t iteration);
  void adopt_pending();
  // Returns false (after failing the job) on a protocol violation.
  bool drain();
  bool check_left();
  void run_batch(const std::vector<Task>& batch);
  // Writes arrived results to every local rank; false after failing the job.
  bool process_arrivals();
  void buffers_of(uint32_t tensor, std::vector<char*>& out) const;
  void complete(uint32_t tensor);
  // Posts (tensor, iteration) to every local rank's completion ring and
  // wakes it; false after failing the job.
  bool notify_ranks(uint32_t tensor, uint64_t iteration);
  void fail(ErrorCode code, const std::string& reason);
  int64_t latest_begun() const;
  // All local ranks of the tensor's round arrived: queue its partitions (a
  // fused tensor's: its bucket's, once every member arrived).
  void begin_round(uint32_t tensor);
  // Tensor fusion (server/fusion.h): a bucket's members all arrived; packs
  // them into the bucket's staging buffers and queues its partitions.
  void begin_bucket(uint32_t unit, uint64_t iteration);
  // Tensor fusion: local rank `rank` pushes `e` (checked by check_round).
  // Fails the job (false) when the rank left a bucket of an earlier iteration
  // without one of its members (it moved on: the member will never come), or
  // pushes a member for another iteration than its collecting bucket's;
  // otherwise counts a member's push.
  bool track_buckets(uint32_t rank, const ipc::RingEntry& e);
  // Tensor fusion: fails the job (false) when a collecting bucket still
  // misses a member after fusion.member_timeout_ms.
  bool check_buckets(std::chrono::steady_clock::time_point now);
  // "tensor 'w2' (bucket 'fused[0]:w4..w0', iteration 7) was not pushed by
  // local rank(s) ..." for the members of bucket `b` that `ranks` (or, empty,
  // any rank) did not push in its iteration.
  std::string missing_members(uint32_t b, const std::vector<uint32_t>& ranks) const;
  // A partition of `unit` finished; completes the round after its last.
  void partition_done(uint32_t unit);
  // Unpacks a finished bucket into its members' buffers and completes them.
  void complete_bucket(uint32_t unit);
  // Bytes per scheduler partition of a unit (tensor_pb_: a sharded bucket's
  // equal shards, else its option's pieces).
  uint64_t unit_partition_bytes(uint32_t unit) const;
  const std::string& unit_name(uint32_t unit) const;
  // Begins the held rounds once no strategy change of ours is unconfirmed.
  void release_held();
  // Once partition_bytes_ (and shard_elems_) are final: every unit's
  // partition size from the job's first plans (server::unit_partition_bytes),
  // the declared tensors' published in shared memory.
  void setup_phases(const std::vector<TensorPlan>& plans);
  void log_phases() const;
  void publish_gauges();

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
  uint32_t node_rank_;
  uint64_t partition_bytes_;
  // Per unit (units_): server::unit_partition_bytes of the job's first plans;
  // written by setup_phases() (the constructor for a single-node job, the
  // engine thread after the join otherwise), fixed after.
  std::vector<uint64_t> tensor_pb_;
  // The plans the layout was cut by (a single-node job's, for set_plans).
  std::vector<TensorPlan> layout_plans_;
  std::mutex pending_mu_;
  std::optional<std::vector<TensorPlan>> pending_;  // guarded by pending_mu_
  std::optional<std::string> pending_yaml_;          // guarded by pending_mu_
  std::atomic<int64_t> switch_published_{-1};
  // The job's plans by first iteration: the engine's own for a single-node
  // job (set_plans() adds to it), the PS client's (every node's and
  // server's announced changes) for a multi-node one. Engine thread reads.
  std::unique_ptr<strategy::Timeline> own_timeline_;
  const strategy::Timeline* timeline_ = nullptr;
  // A strategy change this node asked the coordinator for, at iteration E:
  // until the coordinator confirms that every node applied it, rounds of
  // E - 1 and later wait here (held_), so that no other node can finish
  // E - 1 and start E before it knows. Engine thread, except the count.
  int64_t hold_from_ = -1;
  // The iteration of the last strategy change this node asked for (-1:
  // none); engine thread.
  int64_t last_requested_at_ = -1;
  std::vector<uint32_t> held_;  // tensors whose complete round waits
  std::shared_ptr<std::atomic<int>> changes_unconfirmed_ = std::make_shared<std::atomic<int>>(0);
  Scheduler sched_;
  JoinFn join_;
  std::function<void(Engine&, const std::shared_ptr<server::PsJob>&, uint64_t)> on_joined_;
  PeerOptions peer_opts_;
  std::shared_ptr<const void> keep_mapped_;
  std::shared_ptr<JobByteCounters> bytes_;
  std::unique_ptr<IntraNodeReducer> reducer_;
  std::shared_ptr<server::PsJob> ps_;
  std::shared_ptr<Inbox> inbox_;
  // Multi-node: tensor bytes pushed and not yet acknowledged by the servers
  // (a server acknowledges a push once it summed it, whatever the other
  // nodes do), plus peer-allgather partitions until every peer acknowledged
  // receipt (whether or not their round is complete). Single node: unused
  // (a batch is bounded by the bound itself and finishes in run_batch()).
  uint64_t inflight_bytes_ = 0;
  // Multi-node: per link (ExecutionPath::link_charge: a server), the bytes
  // charged to its credit window and not yet acknowledged.
  std::unordered_map<uint32_t, uint64_t> link_inflight_;
  bool phase_timestamps_ = true;
  // Written by the engine thread and the workers, read by phase_records().
  PhaseLog phases_;
  // The paths (declared after what they borrow, so destroyed first) and
  // each tensor's; the plans of set_plans() go to local_.
  std::unique_ptr<LocalPath> local_;
  std::unique_ptr<PsPath> ps_path_;
  std::unique_ptr<PeerPath> peer_path_;
  std::unique_ptr<RingPath> ring_path_;
  // Broadcast and barrier, beside the paths.
  std::unique_ptr<Collectives> collectives_;
  // Per unit: the path of its current round (set when the round begins;
  // one round of a unit runs at a time, so its tasks and arrivals all use
  // the one it began with).
  std::vector<ExecutionPath*> path_of_;
  // Multi-node: the job's units (declared tensors, then fused buckets) as
  // the servers and paths see them; single-node: the declared tensors.
  std::vector<TensorSpec> units_;
  const server::JobUnits* fusion_ = nullptr;  // ps_->info().units, when any bucket
  std::vector<uint64_t> shard_elems_;         // per unit (server/fusion.h)
  // Per bucket: one contiguous fp32 copy per local rank (the path runs on
  // these like on a tensor's buffers), and the round.
  struct BucketRound {
    std::vector<char*> bufs;  // per local rank, 64-byte aligned, in staging_
    uint32_t ready = 0;                            // members all ranks submitted
    uint64_t iteration = 0;
    uint64_t first_ns = 0;
    size_t partitions_left = 0;
    // Collecting: some local rank pushed a member for `iteration` and the
    // bucket has not begun. pushed[r]: members local rank r pushed for it;
    // since: the first of those pushes (fusion.member_timeout_ms counts
    // from it).
    bool collecting = false;
    std::vector<uint32_t> pushed;
    std::chrono::steady_clock::time_point since;
  };
  std::vector<BucketRound> buckets_;
  // Per local rank: the latest iteration it pushed anything of, and when
  // that began. A rank that has not begun a bucket's iteration is late, not
  // missing a member (fusion.member_timeout_ms counts only from its start).
  std::vector<int64_t> rank_iteration_;
  std::vector<std::chrono::steady_clock::time_point> rank_since_;
  // The staging memory, shared with the PS path's zero-copy pushes (the
  // transport may still send from it after the job ended).
  std::shared_ptr<std::vector<std::unique_ptr<char[]>>> staging_;
  // gauges(): written by the engine thread.
  std::atomic<uint64_t> queued_pub_{0};
  std::atomic<uint64_t> inflight_pub_{0};
  std::atomic<uint32_t> waiting_pub_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> failed_{false};
  std::mutex abort_mu_;  // serialises publish_abort between the two threads
  std::string abort_reason_;  // first published abort (guarded by abort_mu_)
  ErrorCode abort_code_ = ErrorCode::kAborted;  // its code (guarded by abort_mu_)
  std::thread thread_;
};

}  // namespace bytecomp::daemon
