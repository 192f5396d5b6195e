// The partition round state machine of the parameter server: a partition
// collects iteration c (one push from every rank of the job), sums it, keeps
// the answer of c for the pulls and starts collecting c+1. docs/server.md
// ("Rounds") describes the rules and the refusals.
//
// No transport here: a round takes pushes and pulls as values (the sender's
// node id and rank, the payload buffers, the pull's Incoming kept while it
// waits) and hands back what to answer (RoundAnswer). The caller (ps_server.cc)
// sends the answers, counts refusals and aborts the job when a round fails.
//
// Threading: a PartitionRound is thread-bound (its partition's engine thread),
// except frozen(), which any thread may read. The job's Timeline is
// thread-safe (its mutex is the job's plan lock: taken after
// ServerState::jobs_mu, never together with another job's).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/error.h"
#include "compress/compressor.h"
#include "server/job.h"
#include "planner/strategy/timeline.h"
#include "server/protocol.h"
#include "transport/transport.h"

namespace bytecomp::server {

// A job's plans by first iteration: the strategy library's one type.
using strategy::Timeline;

// Refuses a change from `iteration` on when one of `rounds` already fixed its
// plan for an iteration >= `iteration` (kInvalidArgument, "<who>: <label>
// already started iteration f (...)"). Run as Timeline::add's admission
// check, under the timeline's lock.
class PartitionRound;
Status rounds_admit_change(uint64_t iteration, const std::vector<const PartitionRound*>& rounds,
                           const std::string& who);

// Whether a server sums this plan's pushes with one fused
// decompress-sum-recompress at the round's end (Compressor::sum_compress:
// the sign family under a gathering collective), keeping the compressed
// pushes until then instead of an fp32 sum.
bool fuses_sum(const TensorPlan& plan);

// Bytes a partition of `count` elements may hold under `plan` (sum, answer in
// flight, spare block, held push, stored pushes, encoded answers, EF state):
// what a server reserves for it.

uint64_t round_reservation(const TensorPlan& plan, uint64_t count, size_t nodes,
                           bool deterministic);

// What the caller sends: `status` ok -> an ok reply carrying `payload`
// (empty for a push acknowledgement); else an error reply with its code and
// message.
struct RoundAnswer {
  transport::Incoming to;
  Status status;
  transport::Buffer payload;
};

struct PushOutcome {
  // !ok: the push was refused (nothing changed); code and message for the
  // sender. ok: accepted; acknowledge it before sending `answers`.
  Status status;
  bool completed = false;  // the push finished its round
  uint64_t started_ns = 0;  // completed: steady-clock time of the round's first push
  // Set when the finished round could not be summed: the job must abort
  // (the round is not repeated; `answers` carry kAborted).
  std::string failure;
  std::vector<RoundAnswer> answers;  // the pulls that waited for the round
};

// Fixed at setup.
struct RoundSetup {
  Partition part;
  std::string label;  // "job 'j' tensor 'x' partition 3 (key 0x...)": named in every refusal
  uint64_t start_iteration = 0;
  uint32_t nodes = 1;  // ranks of the job
  bool deterministic = false;
  uint64_t shared_seed = 0;   // strategy::partition_seed(job, key)
  uint64_t private_seed = 0;  // strategy::server_private_seed(server, key)
};

class BlockPool;

class PartitionRound {
 public:
  // `plans` must outlive the round (both belong to the job).
  PartitionRound(RoundSetup setup, const Timeline& plans);
  ~PartitionRound();
  PartitionRound(const PartitionRound&) = delete;
  PartitionRound& operator=(const PartitionRound&) = delete;

  // A push of `iteration` from rank `rank` (node `from`, named in refusals).
  // An idle round whose tensor was on the daemons' ring for every iteration
  // from the collecting one up to `iteration` (Timeline::off_servers) first
  // moves to `iteration` (a pull does the same); its sum block is allocated
  // with its first push.
  // Refused: not the collecting iteration, a second push of the rank, not
  // exactly one payload, a wrong length or (compressed) a buffer of another
  // algorithm / element count / malformed (kMalformed). The first push of a
  // round fixes the round's plan (Timeline::plan with the round's frozen marker).
  // `shared`: the payload lies in memory the sender can still write (a
  // node's shared-memory segment); a compressed one is then copied before it
  // is checked, so the bytes checked are the bytes decoded, now or at the
  // round's end.
  PushOutcome push(transport::NodeId from, uint32_t rank, uint64_t iteration,
                   const std::vector<transport::Buffer>& payloads, bool shared = false);

  // A pull of `in.message.header.arg`: answered at once when it is the kept
  // iteration (ok) or refused (stale, future, a second waiting pull of the
  // node); nullopt when it is the collecting iteration: it waits, and the
  // push that finishes the round answers it.
  std::optional<RoundAnswer> pull(transport::Incoming in);

  // The job ended: frees the round's memory and answers every waiting pull
  // with `why`. Later pushes and pulls are the caller's to refuse
  // (released()). Idempotent (a second call answers nothing).
  std::vector<RoundAnswer> release(const Status& why);

  bool released() const { return released_; }
  uint64_t collecting() const { return collecting_; }
  // Last iteration whose plan is fixed (-1: none yet). Any thread.
  int64_t frozen() const { return frozen_.load(); }
  const Partition& part() const { return setup_.part; }
  const std::string& label() const { return setup_.label; }

 private:
  void fix_plan();
  // Moves an idle round forward to `iteration` when Timeline::off_servers
  // says every iteration from collecting_ up to it went round the daemons'
  // ring (a ring -> ps switch joins at the switch iteration).
  void skip_to(uint64_t iteration);
  void accumulate(const transport::Buffer& b);
  PushOutcome complete();
  compress::CompressContext ctx() const;

  RoundSetup setup_;
  const Timeline& plans_;
  uint64_t collecting_ = 0;
  TensorPlan plan_;
  bool plan_ready_ = false;
  // compress::make_sum_recompressor of the plan: decodes pushes, recompresses
  // the sum; state_ holds its residual (server error feedback) if any.
  std::unique_ptr<compress::Compressor> comp_;
  std::unique_ptr<compress::TensorState> state_;
  // fuses_sum(plan_): pushes are kept (pending_) and summed by
  // comp_->sum_compress() when the round completes.
  bool fused_ = false;
  std::shared_ptr<BlockPool> pool_;
  std::unique_ptr<float[]> sum_;
  bool sum_started_ = false;
  transport::Buffer held_;                  // first raw push, summed with the second
  std::vector<transport::Buffer> pending_;  // per rank (deterministic / compressed sum)
  std::vector<uint8_t> pushed_;             // per rank
  uint32_t n_pushed_ = 0;
  uint64_t started_ns_ = 0;  // first push of collecting_ (steady clock, ns)
  uint32_t next_rank_ = 0;                  // deterministic: ranks below are summed
  transport::Buffer result_;
  bool has_result_ = false;
  uint64_t result_iteration_ = 0;
  std::vector<transport::Incoming> waiting_;  // pulls of `collecting_`
  std::atomic<int64_t> frozen_{-1};
  bool released_ = false;
  bool poisoned_ = false;
  std::string poison_;
};

// The broadcast state of one partition (docs/server.md "Broadcast"): every
// rank (node) of the job sends one kBroadcast per iteration, the root's
// carrying the bytes; once all arrived they are all answered (the root with
// an empty ok, the others with the bytes), after checking that they agree.
// No sum and no plan: the bytes travel raw. Thread-bound like
// PartitionRound (the partition's engine thread).
struct BroadcastOutcome {
  std::vector<RoundAnswer> answers;
  // Set when the nodes disagree (every sender so far is answered with it):
  // the job must abort, so that the nodes not arrived yet learn it too.
  std::string failure;
};

class BroadcastRound {
 public:
  // `part`: the partition (its bytes are [offset*4, (offset+count)*4) of the
  // tensor); `label` as RoundSetup's.
  BroadcastRound(Partition part, std::string label, uint32_t nodes);

  // The part of rank `rank` (node `in.from`); `payloads` as received
  // (meta, then the bytes when `is_root`).
  BroadcastOutcome add(transport::Incoming in, uint32_t rank, bool is_root);
  // The job ended: answers whatever waits with `why`. Idempotent.
  std::vector<RoundAnswer> release(const Status& why);
  bool released() const { return released_; }

 private:
  BroadcastOutcome fail_all(transport::Incoming in, const std::string& why);
  // The iteration is over (answered or failed): ready for the next.
  void finish();

  Partition part_;
  std::string label_;
  uint32_t nodes_;
  uint64_t collecting_ = 0;
  int64_t last_done_ = -1;
  std::vector<transport::Incoming> waiting_;
  std::vector<uint8_t> from_;  // per rank
  std::vector<uint32_t> ranks_;  // arrival order
  proto::BroadcastMeta meta_;
  uint32_t first_rank_ = 0;
  int64_t root_rank_ = -1;  // the rank (node) that sent the bytes
  transport::Buffer data_;
  bool released_ = false;
};

}  // namespace bytecomp::server
