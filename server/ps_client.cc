#include "server/ps_client.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>

#include <unistd.h>

#include "common/log.h"
#include "server/local_shm.h"
#include "server/protocol.h"

namespace bytecomp::server {

BC_LOG_CATEGORY(LogPsClient, "ps_client");

using transport::Buffer;
using transport::Incoming;
using transport::Message;
using transport::Response;

namespace {

class JobImpl;

// Shared by the client and its jobs, so a job handle outliving the client
// fails cleanly instead of touching a dead transport.
struct Core {
  ClusterConfig cluster;
  std::unique_ptr<transport::Transport> tp;
  std::mutex mu;
  bool closed = false;
  std::map<uint32_t, std::shared_ptr<JobImpl>> jobs;
  // Aborts of jobs not in `jobs`, kept only while a join() is in flight (an
  // abort may overtake its admission) and dropped when the last join
  // returns. An abort of a job this node already left lands here too; kept
  // for good, those piled up, and after a coordinator restart (uids count
  // from 1 again) one failed a later job of the reused uid at its join with
  // the old job's reason (found by scripts/chaos: kill-rank, then
  // kill-coordinator, then a new job).
  std::map<uint32_t, Status> early_aborts;
  uint32_t joins_in_flight = 0;
  // leave_async()/abort_async() requests not answered yet (guarded by mu).
  uint32_t leaves_in_flight = 0;
  std::chrono::steady_clock::time_point leaves_deadline{};  // latest answer due
  std::condition_variable leaves_done;
  bool local_shm = true;  // PsClientOptions
  std::set<NodeId> shm_told;  // servers whose shm refusal was logged (guarded by mu)

  Millis or_default(Millis t) const { return t.count() > 0 ? t : cluster.request_timeout; }
};

// A one-way message from the coordinator; a malformed one is logged and
// ignored as if it had not arrived (the job's own timeouts still hold).
template <class M>
std::optional<M> decoded(const Incoming& in) {
  try {
    return proto::from_message<M>(in.message);
  } catch (const Error& e) {
    BC_LOG(LogPsClient(), kWarn) << "from node " << in.from << ": " << e.what();
    return std::nullopt;
  }
}

Status to_status(const Response& r) {
  if (!r.status.ok()) return r.status;
  return proto::reply_status(r.response);
}

// "server 1 lost: node 1 sent nothing for 1500 ms (peer_timeout)": the one
// wording of a job's end by a lost server, whichever path saw it first.
std::string lost_reason(const Core& c, NodeId id, const Status& s) {
  const std::string who =
      (id == c.cluster.coordinator ? "coordinator " : "server ") + std::to_string(id) + " lost";
  if (s.message().rfind(who, 0) == 0) return s.message();
  return who + ": " + s.message();
}

class JobImpl final : public PsJob, public std::enable_shared_from_this<JobImpl> {
 public:
  JobImpl(std::shared_ptr<Core> core, JobInfo info)
      : core_(std::move(core)),
        info_(std::move(info)),
        timeline_(info_.start_iteration, info_.plans, info_.strategy_yaml) {}

  const JobInfo& info() const override { return info_; }
  const strategy::Timeline& timeline() const override { return timeline_; }

  void push(uint64_t key, uint64_t iteration, Buffer data, DoneCallback done,
            Millis timeout) override {
    if (ShmSlot* slot = shm_slot(key)) {
      bool use = false;
      {
        std::lock_guard lk(shm_mu_);
        if (!slot->push_pending && !slot->pull_pending && !slot->answer_held->load() &&
            data.size() <= slot->capacity) {
          slot->push_pending = true;
          slot->push_iteration = iteration;
          use = true;
        }
      }
      if (use) {
        if (!data.empty()) std::memcpy(slot->seg->data() + slot->offset, data.data(), data.size());
        proto::ShmPush m{info_.uid, key, iteration, slot->offset, data.size()};
        start(server_of(key), proto::to_message(m), timeout,
              [this, slot, done = std::move(done)](const Status& s, Buffer) {
                // A refused push left nothing with the server; anything else
                // (ok, timeout) may still hold the slot until the round ends.
                if (s.code() == ErrorCode::kInvalidArgument || s.code() == ErrorCode::kMalformed) {
                  std::lock_guard lk(shm_mu_);
                  slot->push_pending = false;
                }
                if (done) done(s);
              });
        return;
      }
    }
    start(server_of(key), proto::to_message(proto::Push{info_.uid, key, iteration, std::move(data)}),
          timeout,
          [done = std::move(done)](const Status& s, Buffer) {
            if (done) done(s);
          });
  }

  void pull(uint64_t key, uint64_t iteration, PullCallback done, Millis timeout) override {
    ShmSlot* slot = shm_slot(key);
    bool use = false;
    if (slot) {
      std::lock_guard lk(shm_mu_);
      // The server writes the answer over the slot: only when nothing else
      // lives there (an answer still held, a push of another round).
      if (!slot->pull_pending && !slot->answer_held->load() &&
          (!slot->push_pending || slot->push_iteration == iteration)) {
        slot->pull_pending = true;
        use = true;
      }
    }
    if (!use) {
      if (slot) {
        done = [this, slot, iteration, done = std::move(done)](const Status& s, Buffer b) {
          round_over(*slot, s, iteration);
          if (done) done(s, std::move(b));
        };
      }
      start(server_of(key), proto::to_message(proto::Pull{info_.uid, key, iteration}), timeout,
            std::move(done));
      return;
    }
    proto::ShmPull m{info_.uid, key, iteration, slot->offset, slot->capacity};
    start(server_of(key), proto::to_message(m), timeout, nullptr,
          [this, slot, key, iteration, done = std::move(done)](const Status& s, Message reply) {
            Status st = s;
            Buffer result;
            if (st.ok()) {
              try {
                result = shm_result(*slot, reply);
              } catch (const Error& e) {
                st = Status(ErrorCode::kMalformed, "job '" + info_.name + "': " + e.what());
              }
            }
            // The server replied (answer or refusal): it is done with the
            // slot. No reply (timeout, lost server, closed job): the request
            // may still wait on the server, which would write the round's
            // answer into the slot whenever it comes, so the slot stays
            // reserved until a later answer proves the server is past it
            // (round_over), or for good.
            const bool answered = reply.header.type == proto::kOkReply ||
                                  reply.header.type == proto::kErrorReply;
            {
              std::lock_guard lk(shm_mu_);
              if (answered) slot->pull_pending = false;
              else {
                slot->pull_orphaned = true;
                slot->orphan_iteration = iteration;
              }
            }
            if (!answered)
              BC_LOG(LogPsClient(), kDebug)
                  << "job '" << info_.name << "': shm pull of key " << key << " iteration "
                  << iteration << " got no reply (" << st.message()
                  << "): its slot stays reserved until the server is past that round";
            round_over(*slot, st, iteration);
            if (done) done(st, std::move(result));
          });
  }

  void broadcast(uint64_t key, uint64_t iteration, uint32_t root, uint64_t nbytes, uint64_t tag,
                 bool is_root, Buffer data, PullCallback done, Millis timeout) override {
    proto::Broadcast b{info_.uid, key, iteration, {root, nbytes, tag}, is_root, std::move(data)};
    start(server_of(key), proto::to_message(b), timeout, std::move(done));
  }

  void barrier(DoneCallback done, Millis timeout) override {
    proto::Barrier b{info_.uid, 0};
    {
      std::lock_guard lk(mu_);
      b.seq = barrier_seq_++;
    }
    start(core_->cluster.coordinator, proto::to_message(b), timeout,
          [done = std::move(done)](const Status& s, Buffer) {
            if (done) done(s);
          });
  }

  void set_strategy(std::string yaml, uint64_t iteration, DoneCallback done) override {
    Message m = proto::to_message(proto::SetStrategy{info_.uid, iteration, yaml});
    // The coordinator's update message and its reply travel separately; the
    // requester applies the change itself first so its on_strategy_change
    // always runs before done (the later update is then a duplicate).
    std::weak_ptr<JobImpl> weak = weak_from_this();
    start(core_->cluster.coordinator, std::move(m), Millis{0},
          [weak, yaml, iteration, done = std::move(done)](const Status& s, Buffer) {
            if (s.ok())
              if (auto self = weak.lock()) self->apply_change(iteration, yaml);
            if (done) done(s);
          });
  }

  void auto_profile(uint64_t epoch, std::string profile_yaml, std::string spec_yaml,
                    DoneCallback done) override {
    proto::AutoProfile p{info_.uid, epoch, std::move(profile_yaml), std::move(spec_yaml)};
    start(core_->cluster.coordinator, proto::to_message(p), Millis{0},
          [done = std::move(done)](const Status& s, Buffer) {
            if (done) done(s);
          });
  }

  void auto_replan(uint64_t from_iteration, std::string reason, DoneCallback done) override {
    proto::AutoReplan r{info_.uid, from_iteration, std::move(reason)};
    start(core_->cluster.coordinator, proto::to_message(r), Millis{0},
          [done = std::move(done)](const Status& s, Buffer) {
            if (done) done(s);
          });
  }

  void on_auto(AutoCallback cb) override {
    std::lock_guard lk(mu_);
    auto_cbs_.push_back(std::move(cb));
  }

  void deliver_auto(const AutoEvent& e) {
    std::vector<AutoCallback> cbs;
    {
      std::lock_guard lk(mu_);
      if (closed_) return;
      cbs = auto_cbs_;
    }
    for (auto& cb : cbs) cb(e);
  }

  Status probe(NodeId server, uint64_t up_bytes, uint64_t down_bytes, Millis timeout) override {
    if (up_bytes > proto::kMaxProbeBytes || down_bytes > proto::kMaxProbeBytes)
      return Status(ErrorCode::kInvalidArgument, "probe: at most 16 MiB each way");
    if (!uses(server))
      return Status(ErrorCode::kInvalidArgument,
                    "probe: node " + std::to_string(server) + " is not a server of job '" +
                        info_.name + "'");
    Response r = core_->tp->call(server, proto::to_message(proto::Probe{down_bytes, up_bytes}),
                                 timeout);
    Status st = to_status(r);
    if (!st.ok()) return st;
    uint64_t got = 0;
    for (const Buffer& b : r.response.payloads) got += b.size();
    if (got != down_bytes)
      return Status(ErrorCode::kMalformed, "probe: server " + std::to_string(server) + " sent " +
                                               std::to_string(got) + " bytes, asked " +
                                               std::to_string(down_bytes));
    return Status::Ok();
  }

  void on_strategy_change(StrategyCallback cb) override {
    std::lock_guard lk(mu_);
    strategy_cbs_.push_back(std::move(cb));
  }

  void on_failure(FailureCallback cb) override {
    Status now;
    {
      std::lock_guard lk(mu_);
      if (failed_.ok()) {
        failure_cbs_.push_back(std::move(cb));
        return;
      }
      now = failed_;
    }
    cb(now);
  }

  Status status() const override {
    std::lock_guard lk(mu_);
    return failed_;
  }

  Status leave(Millis timeout) override { return leave_or_abort(nullptr, timeout); }
  Status abort(const std::string& reason, Millis timeout) override {
    return leave_or_abort(&reason, timeout);
  }
  void leave_async(DoneCallback done, Millis timeout) override {
    start_leave(nullptr, std::move(done), timeout);
  }
  void abort_async(const std::string& reason, DoneCallback done, Millis timeout) override {
    start_leave(&reason, std::move(done), timeout);
  }

  Status leave_or_abort(const std::string* abort_reason, Millis timeout) {
    auto p = std::make_shared<std::promise<Status>>();
    auto f = p->get_future();
    start_leave(abort_reason, [p](const Status& s) { p->set_value(s); }, timeout);
    // The transport answers within `timeout`; the margin covers scheduling.
    if (f.wait_for(timeout + Millis{2000}) != std::future_status::ready)
      return Status(ErrorCode::kTimeout, "job '" + info_.name + "': no answer to " +
                                             (abort_reason ? "abort" : "leave") + " within " +
                                             std::to_string(timeout.count()) + " ms");
    return f.get();
  }

  // Closes the handle now, then tells the coordinator; `done` gets its answer.
  void start_leave(const std::string* abort_reason, DoneCallback done, Millis timeout) {
    timeout = core_->or_default(timeout);
    {
      std::lock_guard lk(mu_);
      if (closed_) {
        if (done) done(Status::Ok());
        return;
      }
    }
    if (abort_reason) {
      // status() tells the reason; no failure callbacks: this node asked for it.
      std::lock_guard lk(mu_);
      if (failed_.ok())
        failed_ = Status(ErrorCode::kAborted, "job '" + info_.name + "' aborted here: " + *abort_reason);
    }
    close(abort_reason ? Status(ErrorCode::kAborted, "job '" + info_.name + "' aborted here: " + *abort_reason)
                       : Status(ErrorCode::kUnavailable, "job '" + info_.name + "' left"),
          false);
    const std::shared_ptr<Core> core = core_;
    const uint32_t uid = info_.uid;
    {
      std::lock_guard lk(core->mu);
      if (core->closed) {
        core->jobs.erase(uid);
        if (done) done(Status(ErrorCode::kUnavailable, "client closed"));
        return;
      }
      ++core->leaves_in_flight;
      // The transport answers by the request's deadline; a second covers
      // the completion thread's scheduling.
      core->leaves_deadline = std::max(core->leaves_deadline,
                                       std::chrono::steady_clock::now() + timeout + Millis{1000});
    }
    Message m = proto::to_message(
        proto::Leave{uid, abort_reason != nullptr, abort_reason ? *abort_reason : std::string()});
    // The job stays in the client's table until the answer, so a kJobAborted
    // crossing the leave finds it (and finds it closed).
    auto finish = [core, uid, done = std::move(done)](const Status& st) {
      {
        std::lock_guard lk(core->mu);
        core->jobs.erase(uid);
      }
      if (done) done(st);
      {
        std::lock_guard lk(core->mu);
        --core->leaves_in_flight;
      }
      core->leaves_done.notify_all();
    };
    try {
      core->tp->request(core->cluster.coordinator, std::move(m), timeout,
                        [finish](Response r) { finish(to_status(r)); });
    } catch (const Error& e) {
      finish(Status::FromError(e));
    }
  }

  // Fails the job (first reason wins) and every pending operation.
  void fail(const Status& why) { close(why, true); }

  void apply_change(uint64_t iteration, const std::string& yaml) {
    // Held through the callbacks: whichever of the update message and the
    // requester's reply comes second returns only once they ran.
    std::lock_guard apply(apply_mu_);
    // The requester sees its change twice (reply and update): parse once.
    if (timeline_.at(iteration).first == iteration) return;
    std::vector<TensorPlan> plans;
    try {
      plans = unit_plans(
          info_.units,
          plan_job({info_.tensors.begin(),
                    info_.tensors.begin() + static_cast<ptrdiff_t>(info_.units.declared)},
                   yaml));
    } catch (const Error& e) {
      fail(Status(ErrorCode::kAborted, "job '" + info_.name +
                                           "': announced strategy cannot be used: " + e.what()));
      return;
    }
    if (Status s = timeline_.add(iteration, std::move(plans), yaml); !s.ok()) {
      fail(Status(ErrorCode::kAborted, "job '" + info_.name + "': " + s.message()));
      return;
    }
    const StrategyChange c{iteration, yaml, timeline_.at(iteration).plans};
    std::vector<StrategyCallback> cbs;
    {
      std::lock_guard lk(mu_);
      cbs = strategy_cbs_;
    }
    BC_LOG(LogPsClient(), kInfo) << "job '" << info_.name << "': strategy changes at iteration "
                                 << iteration;
    for (auto& cb : cbs) cb(c);
  }

  // Offers each server of the job a segment for the partitions it owns
  // (server/local_shm.h); those on this host that accept get this node's
  // pushes and pulls of them through it. Runs once, in join(), before the
  // job is handed out.
  void attach_local() {
    const NodeId self = core_->tp->self();
    for (const ServerInfo& srv : info_.servers) {
      std::vector<const Partition*> mine;
      uint64_t total = 0;
      std::vector<uint64_t> caps;
      for (const Partition& p : info_.assignment.partitions) {
        // A fused tensor's own partitions carry broadcasts only.
        if (p.server != srv.id || info_.units.fused(p.tensor)) continue;
        const TensorPlan& plan = info_.plans.at(p.tensor);
        uint64_t cap = std::max({p.count * 4, push_bytes_bound(plan, p.count),
                                 pull_bytes_bound(plan, p.count)});
        cap = (cap + 63) / 64 * 64;  // each slot cache-line aligned
        mine.push_back(&p);
        caps.push_back(cap);
        total += cap;
      }
      if (mine.empty()) continue;
      const std::string name = shm_segment_name(info_.uid, self, srv.id, static_cast<long>(::getpid()));
      Status st;
      std::shared_ptr<LocalShm> seg;
      try {
        seg = LocalShm::create(name, total);
        proto::ShmAttach m{info_.uid, host_identity(), name, total};
        Response r = core_->tp->call(srv.id, proto::to_message(m), core_->or_default(Millis{0}));
        st = to_status(r);
        // Only now (a remote server refused): nothing was written yet, and
        // the server writes only answers this node asks for, so a failed
        // reservation just leaves the attached segment unused.
        if (st.ok()) seg->reserve();
      } catch (const Error& e) {
        st = Status::FromError(e);
      }
      // Attached or not, the name goes: the mappings hold the memory.
      if (seg) seg->unlink();
      if (!st.ok()) {
        bool tell = false;
        {
          std::lock_guard lk(core_->mu);
          tell = core_->shm_told.insert(srv.id).second;
        }
        if (tell)
          BC_LOG(LogPsClient(), kInfo) << "node " << self << ": server " << srv.id
                                       << " is reached over the network, not shared memory: "
                                       << st.message();
        continue;
      }
      uint64_t offset = 0;
      for (size_t i = 0; i < mine.size(); ++i) {
        ShmSlot& slot = slots_[mine[i]->key];
        slot.seg = seg;
        slot.offset = offset;
        slot.capacity = caps[i];
        offset += caps[i];
      }
      BC_LOG(LogPsClient(), kInfo) << "node " << self << ": job '" << info_.name << "': "
                                   << mine.size() << " partitions of server " << srv.id
                                   << " go through shared memory (" << total << " bytes)";
    }
  }

  // Whether any of this job's servers (or the coordinator) is `id`.
  bool uses(NodeId id) const {
    if (id == core_->cluster.coordinator) return true;
    for (const ServerInfo& s : info_.servers)
      if (s.id == id) return true;
    return false;
  }

 private:
  using OpCallback = std::function<void(const Status&, Buffer)>;
  // Gets the whole reply (kShmPull: its ShmAnswer and maybe the bytes).
  using RawCallback = std::function<void(const Status&, Message)>;
  struct Op {
    OpCallback cb;
    RawCallback raw;
  };

  // A partition's part of a segment shared with its server. The slot holds
  // one thing at a time: this node's push until its round is over (the
  // server sums from it), or the round's answer while a pulled Buffer
  // refers to it; whatever would overlap goes over the network instead.
  struct ShmSlot {
    std::shared_ptr<LocalShm> seg;
    uint64_t offset = 0;
    uint64_t capacity = 0;
    // Guarded by shm_mu_.
    bool push_pending = false;
    uint64_t push_iteration = 0;
    bool pull_pending = false;
    // A kShmPull of orphan_iteration got no reply (pull_pending stays set):
    // the server may still write that round's answer here.
    bool pull_orphaned = false;
    uint64_t orphan_iteration = 0;
    // Cleared by the answer Buffer's release (any thread).
    std::shared_ptr<std::atomic<bool>> answer_held = std::make_shared<std::atomic<bool>>(false);
  };
  // slots_ is filled before the job is handed out and never changes.
  ShmSlot* shm_slot(uint64_t key) {
    if (slots_.empty()) return nullptr;
    auto it = slots_.find(key);
    return it == slots_.end() ? nullptr : &it->second;
  }
  // A pull of `iteration` answered: its round is over, so a push of this
  // node up to that round no longer lives in the slot. Nor does an orphaned
  // pull up to that round: the server handles one node's messages to a
  // partition in order and answers a round's waiting pulls when the round
  // completes, so by the time it answered this pull it had answered (or
  // refused) the orphan, whose answer was then written.
  void round_over(ShmSlot& slot, const Status& s, uint64_t iteration) {
    if (!s.ok()) return;
    std::lock_guard lk(shm_mu_);
    if (slot.push_pending && slot.push_iteration <= iteration) slot.push_pending = false;
    if (slot.pull_orphaned && slot.orphan_iteration <= iteration) {
      slot.pull_orphaned = false;
      slot.pull_pending = false;
    }
  }
  // The answer of a kShmPull reply: in the slot, or carried in payload 1.
  Buffer shm_result(ShmSlot& slot, const Message& reply) {
    if (reply.payloads.empty() || reply.payloads.size() > 2)
      throw Error(ErrorCode::kMalformed, "shm pull reply with " +
                                             std::to_string(reply.payloads.size()) +
                                             " payloads (expected 1..2)");
    const proto::ShmAnswer a = proto::decode_shm_answer(reply.payloads[0].view());
    if (!a.in_segment) {
      if (reply.payloads.size() != 2 || reply.payloads[1].size() != a.length)
        throw Error(ErrorCode::kMalformed, "shm pull reply: answer of " +
                                               std::to_string(a.length) +
                                               " bytes not carried in payload 1");
      return reply.payloads[1];
    }
    if (reply.payloads.size() != 1 || a.length > slot.capacity)
      throw Error(ErrorCode::kMalformed, "shm pull reply: answer of " + std::to_string(a.length) +
                                             " bytes in a slot of " +
                                             std::to_string(slot.capacity));
    {
      std::lock_guard lk(shm_mu_);
      slot.answer_held->store(true);
    }
    return Buffer::wrap(slot.seg->data() + slot.offset, a.length,
                        [held = slot.answer_held, seg = slot.seg] { held->store(false); });
  }

  NodeId server_of(uint64_t key) const {
    const Partition* p = info_.assignment.find(key);
    return p ? p->server : core_->cluster.coordinator;
  }

  void start(NodeId to, Message m, Millis timeout, OpCallback cb, RawCallback raw = nullptr) {
    uint64_t op = 0;
    Status refused;
    {
      std::lock_guard lk(mu_);
      if (!failed_.ok()) refused = failed_;
      else if (closed_) refused = Status(ErrorCode::kUnavailable, "job '" + info_.name + "' is closed");
      else {
        op = next_op_++;
        ops_.emplace(op, Op{std::move(cb), std::move(raw)});
      }
    }
    if (!refused.ok()) {
      if (cb) cb(refused, {});
      if (raw) raw(refused, {});
      return;
    }
    std::weak_ptr<JobImpl> weak = weak_from_this();
    try {
      core_->tp->request(to, std::move(m), core_->or_default(timeout), [weak, op, to](Response r) {
        if (auto self = weak.lock()) self->complete(op, to, std::move(r));
      });
    } catch (const Error& e) {
      complete(op, to, Response{Status::FromError(e), transport::kNoNode, {}});
    }
  }

  // `to`: the server the request went to.
  void complete(uint64_t op, NodeId to, Response r) {
    Op o;
    {
      std::lock_guard lk(mu_);
      auto it = ops_.find(op);
      if (it == ops_.end()) return;  // already failed by an abort
      o = std::move(it->second);
      ops_.erase(it);
    }
    OpCallback& cb = o.cb;
    Status st = to_status(r);
    Buffer result;
    if (st.ok() && !o.raw && !r.response.payloads.empty()) {
      if (r.response.payloads.size() == 1) result = r.response.payloads[0];
      else result = Buffer::take(proto::joined(r.response));
    }
    // The request's server was declared lost: the job is over, with the
    // reason on_lost() gives it. The transport fails the requests to a lost
    // peer before the peer-failure callback runs, so without this the
    // operation's bare transport wording ("node 1 sent nothing for ...")
    // raced on_lost's "server 1 lost: ..." (issue 28: seen under load).
    if (st.code() == ErrorCode::kPeerLost) st = Status(ErrorCode::kPeerLost, lost_reason(*core_, to, st));
    if (st.code() == ErrorCode::kAborted || st.code() == ErrorCode::kPeerLost) fail(st);
    if (o.raw) o.raw(st, std::move(r.response));
    if (cb) cb(st, std::move(result));
  }

  void close(const Status& why, bool is_failure) {
    std::unordered_map<uint64_t, Op> ops;
    std::vector<FailureCallback> cbs;
    {
      std::lock_guard lk(mu_);
      if (is_failure) {
        if (!failed_.ok() || closed_) return;
        failed_ = why;
        cbs = std::move(failure_cbs_);
      }
      closed_ = true;
      ops.swap(ops_);
    }
    if (is_failure)
      BC_LOG(LogPsClient(), kWarn) << "job '" << info_.name << "' failed: " << why.message();
    for (auto& [op, o] : ops) {
      if (o.cb) o.cb(why, {});
      if (o.raw) o.raw(why, {});
    }
    for (auto& cb : cbs) cb(why);
  }

  std::shared_ptr<Core> core_;
  const JobInfo info_;
  std::mutex apply_mu_;  // serialises apply_change (taken before mu_)
  mutable std::mutex mu_;
  Status failed_;
  bool closed_ = false;
  uint64_t next_op_ = 1;
  uint64_t barrier_seq_ = 0;
  std::unordered_map<uint64_t, Op> ops_;
  std::mutex shm_mu_;  // the slots' state; taken alone
  std::unordered_map<uint64_t, ShmSlot> slots_;
  strategy::Timeline timeline_;
  std::vector<StrategyCallback> strategy_cbs_;
  std::vector<FailureCallback> failure_cbs_;
  std::vector<AutoCallback> auto_cbs_;
};

class ClientImpl final : public PsClient {
 public:
  ClientImpl(const ClusterConfig& cluster, const transport::TransportConfig& tc,
             const PsClientOptions& options)
      : core_(std::make_shared<Core>()) {
    core_->cluster = cluster;
    core_->local_shm = options.local_shm;
    core_->tp = transport::make_transport(tc);
    std::weak_ptr<Core> weak = core_;
    core_->tp->set_handler(proto::kJobAborted, [weak](Incoming in) {
      if (auto c = weak.lock()) on_aborted(*c, in);
    });
    core_->tp->set_handler(proto::kStrategyUpdate, [weak](Incoming in) {
      if (auto c = weak.lock()) on_update(*c, in);
    });
    for (uint16_t t : {proto::kAutoProfileRequest, proto::kAutoDecision})
      core_->tp->set_handler(t, [weak](Incoming in) {
        if (auto c = weak.lock()) on_auto_message(*c, in);
      });
    core_->tp->on_peer_failure([weak](NodeId id, const Status& s) {
      if (auto c = weak.lock()) on_lost(*c, id, s);
    });
    core_->tp->start();
    core_->tp->add_peer(cluster.coordinator, cluster.coordinator_info().address);
    // Servers with a fixed address are reachable before any admission (for
    // stats()); the others are learnt from the coordinator at join().
    for (const ServerInfo& s : cluster.servers)
      if (s.id != cluster.coordinator && !s.address.ends_with(":0"))
        core_->tp->add_peer(s.id, s.address);
  }
  ~ClientImpl() override { close(); }

  NodeId self() const override { return core_->tp->self(); }

  std::shared_ptr<PsJob> join(const JobSpec& spec, Millis timeout) override {
    {
      std::lock_guard lk(core_->mu);
      if (core_->closed) throw Error(ErrorCode::kUnavailable, "join: client closed");
    }
    if (timeout.count() <= 0) timeout = core_->cluster.admission_timeout + Millis{5000};
    struct InFlight {
      Core& c;
      explicit InFlight(Core& core) : c(core) {
        std::lock_guard lk(c.mu);
        ++c.joins_in_flight;
      }
      ~InFlight() {
        std::lock_guard lk(c.mu);
        if (--c.joins_in_flight == 0) c.early_aborts.clear();
      }
    } in_flight(*core_);
    // A coordinator this node holds as lost may be on its way back (a healed
    // partition: its heartbeats have not arrived yet). Failing at once would
    // leave the other nodes, which did register, waiting for this one until
    // admission_ms (issue 28): wait for it instead, bounded by the
    // admission timeout (by then the other nodes' admission has failed too).
    const auto start = std::chrono::steady_clock::now();
    const NodeId coord = core_->cluster.coordinator;
    if (core_->tp->peer_state(coord) == transport::PeerState::kLost) {
      const Millis bound = std::min(timeout, core_->cluster.admission_timeout);
      BC_LOG(LogPsClient(), kInfo) << "node " << self() << ": coordinator " << coord
                                   << " is lost; job '" << spec.name << "' waits up to "
                                   << bound.count() << " ms for it to come back";
      while (core_->tp->peer_state(coord) == transport::PeerState::kLost &&
             std::chrono::steady_clock::now() - start < bound) {
        {
          std::lock_guard lk(core_->mu);
          if (core_->closed) throw Error(ErrorCode::kUnavailable, "join: client closed");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      if (core_->tp->peer_state(coord) == transport::PeerState::kLost)
        throw Error(ErrorCode::kPeerLost,
                    "join job '" + spec.name + "': coordinator " + std::to_string(coord) +
                        " is lost and did not come back within " + std::to_string(bound.count()) +
                        " ms");
      timeout -= std::chrono::duration_cast<Millis>(std::chrono::steady_clock::now() - start);
      if (timeout.count() <= 0) timeout = Millis{1};
    }
    Message m = proto::to_message(proto::Register{spec});
    BC_LOG(LogPsClient(), kInfo) << "node " << self() << ": registering for job '" << spec.name
                                 << "'";
    Response r = core_->tp->call(coord, std::move(m), timeout);
    Status st = to_status(r);
    if (!st.ok()) throw Error(st.code(), "join job '" + spec.name + "': " + st.message());
    proto::Admission a = proto::decode_admission(proto::joined(r.response));
    JobInfo info;
    info.name = a.name;
    info.uid = a.uid;
    info.rank = a.rank;
    info.nodes = a.nodes;
    info.tensors = a.tensors;
    info.deterministic = a.deterministic;
    info.start_iteration = a.start_iteration;
    info.partition_bytes = a.partition_bytes;
    info.servers = a.servers;
    info.strategy_yaml = a.strategy_yaml;
    info.peer_addresses = a.peer_addresses;
    info.fusion = a.fusion;
    info.units = fuse_job(info.tensors, plan_job(info.tensors, info.strategy_yaml), info.fusion);
    info.tensors = info.units.tensors;
    info.plans = info.units.plans;
    info.assignment =
        assign_partitions(info.tensors, info.plans, info.servers, info.partition_bytes,
                          shard_elements(info.units, info.servers.size(), info.partition_bytes));
    if (info.assignment.digest != a.digest)
      throw Error(ErrorCode::kInternal, "join job '" + spec.name +
                                            "': partition assignment differs from the "
                                            "coordinator's (different library versions?)");
    for (const ServerInfo& s : info.servers)
      if (s.id != core_->cluster.coordinator) core_->tp->add_peer(s.id, s.address);
    auto job = std::make_shared<JobImpl>(core_, std::move(info));
    if (core_->local_shm) job->attach_local();
    Status early;
    {
      std::lock_guard lk(core_->mu);
      auto it = core_->early_aborts.find(a.uid);
      if (it != core_->early_aborts.end()) {
        early = it->second;
        core_->early_aborts.erase(it);
      } else {
        core_->jobs[a.uid] = job;
      }
    }
    if (!early.ok()) job->fail(early);
    BC_LOG(LogPsClient(), kInfo) << "node " << self() << ": job '" << a.name << "' admitted (uid "
                                 << a.uid << ", rank " << a.rank << ")";
    return job;
  }

  ServerStats stats(NodeId server, Millis timeout) override {
    Response r = core_->tp->call(server, proto::to_message(proto::StatsRequest{}), timeout);
    Status st = to_status(r);
    if (!st.ok()) throw Error(st.code(), "stats of server " + std::to_string(server) + ": " + st.message());
    const proto::Stats d = proto::decode_stats(proto::joined(r.response));
    ServerStats s;
    s.jobs = d.jobs;
    s.job_bytes = d.job_bytes;
    s.rounds_completed = d.rounds;
    s.pushes_refused = d.pushes_refused;
    s.frames_refused = d.frames_refused;
    return s;
  }

  std::string metrics(NodeId server, Millis timeout) override {
    Response r = core_->tp->call(server, proto::to_message(proto::MetricsRequest{}), timeout);
    Status st = to_status(r);
    if (!st.ok()) {
      throw Error(st.code(), "metrics of server " + std::to_string(server) + ": " + st.message());
    }
    return proto::joined(r.response);
  }

  void close() override {
    std::map<uint32_t, std::shared_ptr<JobImpl>> jobs;
    {
      std::unique_lock lk(core_->mu);
      if (core_->closed) return;
      core_->leaves_done.wait_until(lk, core_->leaves_deadline,
                                    [&] { return core_->leaves_in_flight == 0; });
      core_->closed = true;
      jobs.swap(core_->jobs);
    }
    for (auto& [uid, j] : jobs) j->fail(Status(ErrorCode::kUnavailable, "client closed"));
    core_->tp->shutdown();
  }

 private:
  static std::shared_ptr<JobImpl> find(Core& c, uint32_t uid) {
    std::lock_guard lk(c.mu);
    auto it = c.jobs.find(uid);
    return it == c.jobs.end() ? nullptr : it->second;
  }

  static void on_aborted(Core& c, const Incoming& in) {
    if (in.from != c.cluster.coordinator) return;
    const std::optional<proto::JobAborted> msg = decoded<proto::JobAborted>(in);
    if (!msg) return;
    const proto::JobAborted& a = *msg;
    Status why(ErrorCode::kAborted, a.reason);
    std::shared_ptr<JobImpl> job;
    {
      std::lock_guard lk(c.mu);
      auto it = c.jobs.find(a.uid);
      if (it == c.jobs.end()) {
        if (c.joins_in_flight > 0) c.early_aborts[a.uid] = why;
        return;
      }
      job = it->second;
      c.jobs.erase(it);
    }
    job->fail(why);
  }

  // The coordinator asks (a request) and hears back only once the change is
  // applied here: it answers the node that asked for the change after every
  // node confirmed, so no node can start the switch iteration under the old
  // plan (this handler runs on a handler thread, pull answers on the
  // completion thread; without the answer nothing orders the two).
  static void on_update(Core& c, const Incoming& in) {
    if (in.from != c.cluster.coordinator) return;
    Message r;
    try {
      const proto::StrategyUpdate u = proto::from_message<proto::StrategyUpdate>(in.message);
      std::shared_ptr<JobImpl> job = find(c, u.uid);
      if (job) job->apply_change(u.iteration, u.yaml);
      r = job ? proto::ok_reply()
              : proto::error_reply(ErrorCode::kInvalidArgument,
                                   "strategy update: node " + std::to_string(c.tp->self()) +
                                       " has no job uid " + std::to_string(u.uid));
    } catch (const Error& e) {
      BC_LOG(LogPsClient(), kWarn) << "from the coordinator: " << e.what();
      r = proto::error_reply(e.code(), e.what());
    }
    if (!in.expects_reply) return;
    try {
      c.tp->reply(in, std::move(r), nullptr);
    } catch (const Error& e) {
      BC_LOG(LogPsClient(), kWarn) << "strategy update: reply to the coordinator failed: "
                                   << e.what();
    }
  }

  static void on_auto_message(Core& c, const Incoming& in) {
    if (in.from != c.cluster.coordinator) return;
    auto job = find(c, in.message.header.aux);
    if (!job) return;
    AutoEvent e;
    try {
      if (in.message.header.type == proto::kAutoProfileRequest) {
        const auto r = proto::from_message<proto::AutoProfileRequest>(in.message);
        e.kind = AutoEvent::Kind::kProfileRequest;
        e.epoch = r.epoch;
        e.from_iteration = r.from_iteration;
        e.text = r.reason;
      } else {
        auto d = proto::from_message<proto::AutoDecision>(in.message);
        e.kind = d.failed ? AutoEvent::Kind::kFailed : AutoEvent::Kind::kDecision;
        e.epoch = d.epoch;
        e.predicted_us = d.predicted_us;
        e.strategy_yaml = std::move(d.strategy_yaml);
        e.decision_yaml = std::move(d.decision_yaml);
        e.text = std::move(d.text);
        e.timeline_json = std::move(d.timeline_json);
      }
    } catch (const Error& err) {
      e = AutoEvent{};
      e.kind = AutoEvent::Kind::kFailed;
      e.text = std::string("malformed message from the coordinator: ") + err.what();
    }
    job->deliver_auto(e);
  }

  static void on_lost(Core& c, NodeId id, const Status& s) {
    const Status why(ErrorCode::kPeerLost, lost_reason(c, id, s));
    std::vector<std::shared_ptr<JobImpl>> hit;
    {
      std::lock_guard lk(c.mu);
      for (auto it = c.jobs.begin(); it != c.jobs.end();) {
        if (it->second->uses(id)) {
          hit.push_back(it->second);
          it = c.jobs.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& j : hit) j->fail(why);
  }

  std::shared_ptr<Core> core_;
};

}  // namespace

Status PsJob::barrier(Millis timeout) {
  auto p = std::make_shared<std::promise<Status>>();
  auto f = p->get_future();
  barrier([p](const Status& s) { p->set_value(s); }, timeout);
  if (f.wait_for(timeout + Millis{2000}) != std::future_status::ready)
    return Status(ErrorCode::kTimeout, "barrier: no answer within " + std::to_string(timeout.count()) + " ms");
  return f.get();
}

Status PsJob::set_strategy(std::string yaml, uint64_t iteration, Millis timeout) {
  auto p = std::make_shared<std::promise<Status>>();
  auto f = p->get_future();
  set_strategy(std::move(yaml), iteration, [p](const Status& s) { p->set_value(s); });
  if (f.wait_for(timeout) != std::future_status::ready)
    return Status(ErrorCode::kTimeout,
                  "set_strategy: no answer within " + std::to_string(timeout.count()) + " ms");
  return f.get();
}

std::unique_ptr<PsClient> PsClient::create(const ClusterConfig& cluster,
                                           const transport::TransportConfig& transport_config,
                                           const PsClientOptions& options) {
  return std::make_unique<ClientImpl>(cluster, transport_config, options);
}

}  // namespace bytecomp::server
