// The client side of the parameter server: what bytecompd (and the test tool
// bytecomp-ps-worker) link to take part in a job.
//
//   auto cluster = server::load_cluster_config("cluster.yaml");
//   transport::TransportConfig tc = ...;        // this node's transport section
//   tc.node_id = my_node_id;                    // must be in JobSpec::nodes
//   auto client = server::PsClient::create(cluster, tc);
//   std::shared_ptr<server::PsJob> job = client->join(spec);  // blocks until admitted
//   for (it = spec.start_iteration; ...; ++it)
//     // every node pushes every partition (of kSharded/kSingle tensors)
//     for (const Partition& p : job->info().assignment.partitions) {
//       job->push(p.key, it, buffer_of(p), [](const Status& s) {...});
//       job->pull(p.key, it, [](const Status& s, transport::Buffer sum) {...});
//     }
//   job->barrier(std::chrono::seconds(30)).throw_if_error();
//   job->leave();
//
// Round semantics (enforced by the server, see docs/server.md):
//   * For each partition and iteration every node of the job pushes exactly
//     once; when all pushes arrived the engine sums them and answers that
//     iteration's pulls. A pull sent before the round completed waits on the
//     server (bounded by the request timeout on our side).
//   * A partition collects iteration i+1 once iteration i is complete; the
//     result of i stays pullable until i+1 completes. So pull i before
//     pushing i+1 (sending the pull request first is enough: messages from
//     one node are handled in order).
//   * Refusals come back as a failed Status (code kInvalidArgument; kMalformed
//     for a compressed buffer that does not decode) whose message names what
//     was wrong: stale or future iteration, duplicate push from this node,
//     duplicate waiting pull, wrong length or compressor, unknown key,
//     unknown job.
//
// Push payload formats (per the tensor's TensorPlan):
//   raw fp32: exactly Partition::count * 4 bytes (little-endian floats);
//   compressed: one buffer produced by plan.compressor (make_compressor(
//     plan.spec)) for the partition's elements (count = Partition::count).
//     For randomk the CompressContext::shared_seed must be
//     strategy::partition_seed(job, key) and iteration the iteration, so all
//     nodes pick the same indices (planner/strategy/partition.h).
// Pull answer formats (PullFormat; strategy::decode_answer() reads them,
//   planner/strategy/answer.h): kFp32 -> count*4 bytes of fp32; kFp16 ->
//   count*2 bytes of fp16 words; kCompressed -> one compressed buffer.
//
// Error model (common/error.h): setup errors throw bytecomp::Error
// (create(): bad config or cannot bind; join(): admission failed — the
// message names missing nodes, the differing tensor, or the bad strategy —
// with codes kTimeout, kInvalidArgument, kPeerLost, kUnavailable).
// Everything asynchronous completes with a Status:
//   kOk; kInvalidArgument (refused by the server, message says why);
//   kTimeout (no answer within the timeout); kPeerLost (a server or the
//   coordinator stopped answering heartbeats); kAborted (the job was aborted:
//   a node died, a node left early, or the job failed; message names it);
//   kUnavailable (client or job closed).
// Once a job failed (kAborted from the coordinator or a server, kPeerLost
// when this node lost a server or the coordinator), every pending and later
// operation of it fails with that first status, and on_failure callbacks run
// once. Operations refused at once (job already failed or closed) complete
// inline, on the calling thread.
//
// Threading:
//   * PsClient and PsJob are thread-safe: any method from any thread.
//   * Completion callbacks (push/pull/barrier/set_strategy done, strategy
//     changes, failures) run on the transport's completion thread. Do not
//     block in them (they delay every other completion) and do not call the
//     blocking helpers (join, barrier(timeout), leave) from them; issuing
//     new async operations from a callback is fine.
//   * Each callback runs exactly once, also when the job/client is closed
//     (with kUnavailable) — no lost completions.
//
// Ownership:
//   * PsClient is owned by the caller (unique_ptr); it owns its transport
//     (one connection to each server). Destroying it closes every job
//     (pending operations fail with kUnavailable) and joins its threads.
//     Do not destroy it from one of its callbacks.
//   * PsJob is shared (the client keeps a reference while the job is open so
//     callbacks can hold one). leave() or the client's destruction closes it.
//   * push() shares the Buffer with the transport until the bytes are sent
//     (see transport::Buffer); do not modify the memory before its release
//     function ran (a push to a server on this host is copied into shared
//     memory at once: docs/server.md "Local shared memory"). A pulled Buffer
//     owns its bytes, or refers to this node's shared memory, which stays
//     reserved for it (later operations on its partition use the socket)
//     until the Buffer goes. A pull through shared memory that got no reply
//     (timeout) keeps its slot the same way until an answered pull of that
//     partition, of the same or a later iteration, shows the server past it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "server/cluster_config.h"
#include "planner/strategy/timeline.h"
#include "server/job.h"
#include "transport/transport.h"

namespace bytecomp::server {

using Millis = std::chrono::milliseconds;

// A strategy change, effective from `iteration` on (for every node and
// server alike). (*plans)[i] is tensor i's plan from that iteration: the
// entry the job's timeline recorded, shared.
struct StrategyChange {
  uint64_t iteration = 0;
  std::string strategy_yaml;
  strategy::Plans plans;
};

// What admission tells every party.
struct JobInfo {
  std::string name;
  uint32_t uid = 0;                  // cluster-unique job number (wire id)
  uint32_t rank = 0;                 // this node's rank
  std::vector<NodeId> nodes;         // rank order
  // The job's units (server/fusion.h): the declared tensors, then one per
  // fused bucket; plans, the timeline and the assignment are per unit.
  std::vector<TensorSpec> tensors;
  bool deterministic = false;
  uint64_t start_iteration = 0;
  uint64_t partition_bytes = 0;
  std::vector<ServerInfo> servers;
  std::string strategy_yaml;         // in force from start_iteration
  std::vector<TensorPlan> plans;     // per unit, from strategy_yaml
  FusionConfig fusion;
  JobUnits units;                    // the layout (units.tensors == tensors)
  Assignment assignment;
  // Every node's JobSpec::peer_address, by rank ("" where a node has none).
  std::vector<std::string> peer_addresses;
};

struct ServerStats {
  uint32_t jobs = 0;              // jobs currently set up on the server
  uint64_t job_bytes = 0;         // memory reserved for them
  uint64_t rounds_completed = 0;  // since start
  uint64_t pushes_refused = 0;
  uint64_t frames_refused = 0;    // malformed / unknown messages
};

// What the coordinator tells a node about automatic strategies
// (server/auto_planner.h).
struct AutoEvent {
  enum class Kind {
    kProfileRequest,  // profile again from from_iteration (a re-plan)
    kDecision,        // a plan for `epoch`: strategy_yaml, decision_yaml, text, timeline
    kFailed,          // no plan for `epoch`; text says why
  };
  Kind kind = Kind::kFailed;
  uint64_t epoch = 0;
  uint64_t from_iteration = 0;
  double predicted_us = 0;
  std::string strategy_yaml, decision_yaml, text, timeline_json;
};

using DoneCallback = std::function<void(const Status&)>;
using PullCallback = std::function<void(const Status&, transport::Buffer result)>;
using StrategyCallback = std::function<void(const StrategyChange&)>;
using FailureCallback = std::function<void(const Status&)>;
using AutoCallback = std::function<void(const AutoEvent&)>;

class PsJob {
 public:
  virtual ~PsJob() = default;

  virtual const JobInfo& info() const = 0;
  // The job's plans by first iteration: the start plans and every announced
  // strategy change (Scope::kCluster; a peer tensor's plan carries the
  // compressor the daemons run). Lives as long as the job handle.
  virtual const strategy::Timeline& timeline() const = 0;

  // Asynchronous data path. `timeout` Millis{0} = cluster request_timeout.
  // Unknown keys are sent anyway (the server refuses them: that is tested).
  virtual void push(uint64_t key, uint64_t iteration, transport::Buffer data,
                    DoneCallback done, Millis timeout = Millis{0}) = 0;
  virtual void pull(uint64_t key, uint64_t iteration, PullCallback done,
                    Millis timeout = Millis{0}) = 0;

  // This node's part of partition `key` (a partition key of the broadcast
  // tensor, routed like its push) of a broadcast at `iteration` (one per
  // partition and iteration; iterations of a key increase): `root` (global
  // rank), `nbytes` (of the whole broadcast) and `tag` must be every node's;
  // `is_root`: this node holds the root rank and `data` is the partition's
  // bytes (else empty). `done` runs once every node sent its part: the bytes
  // (empty for the root), or the refusal (kInvalidArgument naming what the
  // nodes disagree on), kTimeout, or the job's failure.
  virtual void broadcast(uint64_t key, uint64_t iteration, uint32_t root, uint64_t nbytes,
                         uint64_t tag, bool is_root, transport::Buffer data, PullCallback done,
                         Millis timeout = Millis{0}) = 0;

  // Every node of the job calls barrier with the same sequence of calls;
  // done runs when all arrived (kOk) or the job failed / timeout passed.
  virtual void barrier(DoneCallback done, Millis timeout) = 0;
  Status barrier(Millis timeout);  // blocking form

  // Asks the coordinator to switch to `strategy_yaml` from `iteration` on.
  // Refused (kInvalidArgument) when some server already collects pushes at
  // or past `iteration` (request it at least one iteration ahead), when the
  // YAML is invalid, or when it would move a tensor to or from ps_single or
  // allgather (a new job's; ring <-> ps moves apply at `iteration`,
  // strategy::placement_change). On success every party,
  // this one included, gets on_strategy_change before done runs.
  virtual void set_strategy(std::string strategy_yaml, uint64_t iteration,
                            DoneCallback done) = 0;
  Status set_strategy(std::string strategy_yaml, uint64_t iteration, Millis timeout);

  // Automatic strategies: this node's profile of `epoch` (YAML of
  // planner::online::NodeProfile, and the strategy::AutoSpec it runs under)
  // to the coordinator; a re-plan request naming the first iteration every
  // node should profile. `done` gets the coordinator's answer (refusals name
  // why). Events come to on_auto() callbacks, in arrival order.
  virtual void auto_profile(uint64_t epoch, std::string profile_yaml, std::string spec_yaml,
                            DoneCallback done) = 0;
  virtual void auto_replan(uint64_t from_iteration, std::string reason, DoneCallback done) = 0;
  virtual void on_auto(AutoCallback callback) = 0;
  // Link probe (blocking): sends `up_bytes` to `server` (one of the job's
  // servers or the coordinator) and receives `down_bytes` back; the caller
  // times it. Both at most 16 MiB.
  virtual Status probe(NodeId server, uint64_t up_bytes, uint64_t down_bytes, Millis timeout) = 0;

  // Register before pushing (callbacks added later miss earlier events,
  // except on_failure, which runs at once if the job already failed).
  // Strategy callbacks of one job run one at a time; a job's callbacks may
  // start new async operations but must not wait for their completion.
  virtual void on_strategy_change(StrategyCallback callback) = 0;
  virtual void on_failure(FailureCallback callback) = 0;
  // kOk while the job runs; the abort reason afterwards.
  virtual Status status() const = 0;

  // The job is done on this node: tells the coordinator (which releases the
  // job on every server once all nodes left) and closes the handle.
  // Pending operations fail with kUnavailable. Idempotent; blocks at most
  // `timeout`.
  virtual Status leave(Millis timeout = Millis{5000}) = 0;

  // This node's part of the job failed (e.g. one of its training processes
  // died): the coordinator aborts the job at once for every node and server,
  // so the others get kAborted carrying `reason` instead of waiting for a
  // timeout. Closes the handle like leave(). Blocks at most `timeout`.
  virtual Status abort(const std::string& reason, Millis timeout = Millis{2000}) = 0;

  // Non-blocking leave() / abort(): the handle closes at once (pending
  // operations fail as with the blocking forms) and the coordinator is told
  // in the background; `done` (may be empty) runs once with its answer, on
  // the completion thread (inline when the handle was already closed: kOk,
  // or the client was closed: kUnavailable). The client's close() waits for
  // these answers (each bounded by its `timeout`) before it shuts the
  // transport down, so a client destroyed right after still tells the
  // coordinator.
  virtual void leave_async(DoneCallback done, Millis timeout = Millis{5000}) = 0;
  virtual void abort_async(const std::string& reason, DoneCallback done,
                           Millis timeout = Millis{2000}) = 0;

 protected:
  PsJob() = default;
};

struct PsClientOptions {
  // At join(), offer each of the job's servers a shared-memory segment for
  // its partitions (server/local_shm.h); a server on this host that accepts
  // gets this node's pushes and pulls of them through it, every other one
  // over the transport (the refusal's reason is logged once per server).
  bool local_shm = true;
};

class PsClient {
 public:
  // Makes the client's transport from `transport_config` (its node_id is
  // this node's id; listen may be empty) and connects to every server of the
  // cluster. Throws Error (kConfig / kInvalidArgument / kUnavailable).
  static std::unique_ptr<PsClient> create(const ClusterConfig& cluster,
                                          const transport::TransportConfig& transport_config,
                                          const PsClientOptions& options = {});
  virtual ~PsClient() = default;
  PsClient(const PsClient&) = delete;
  PsClient& operator=(const PsClient&) = delete;

  virtual NodeId self() const = 0;

  // Registers this node for `spec` and blocks until the coordinator admitted
  // the job (all nodes registered, declarations equal, servers set up) or
  // refused it. `timeout` Millis{0} = cluster admission_timeout (plus a
  // margin: the coordinator's own timeout answers first). Throws
  // Error(kTimeout) naming the missing nodes, Error(kInvalidArgument) naming
  // the tensor that differs and on which node, Error(kPeerLost/kUnavailable)
  // when the coordinator cannot be reached.
  virtual std::shared_ptr<PsJob> join(const JobSpec& spec, Millis timeout = Millis{0}) = 0;

  // Asks one server for its counters (tests, monitoring). Reaches the
  // coordinator, servers with a fixed (non-0) port in the cluster config, and
  // servers learnt at a join(). Throws Error on failure.
  virtual ServerStats stats(NodeId server, Millis timeout = Millis{5000}) = 0;
  // The server's Prometheus text (server/metrics.h). Throws Error naming
  // the server when it does not answer within `timeout`.
  virtual std::string metrics(NodeId server, Millis timeout = Millis{5000}) = 0;

  // Waits for the answers to leave_async()/abort_async() still in flight
  // (each bounded by its timeout), then closes every job (kUnavailable) and
  // the transport; idempotent.
  virtual void close() = 0;

 protected:
  PsClient() = default;
};

}  // namespace bytecomp::server
