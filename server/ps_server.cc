// The parameter server's wiring: transport handlers, engine threads,
// registration with the coordinator, job setup and end, strategy prepare and
// the data path's routing to the partition rounds. Configuration is in
// config.cc, the coordinator in coordinator.cc, the round state machine in
// rounds.cc.
#include "server/ps_server.h"

#include <cstdio>
#include <cstring>
#include <optional>

#include "server/server_impl.h"

namespace bytecomp::server {

using transport::Buffer;
using transport::Incoming;
using transport::Message;

namespace {

std::string hex(uint64_t v) {
  char b[24];
  std::snprintf(b, sizeof b, "0x%llx", static_cast<unsigned long long>(v));
  return b;
}

}  // namespace

ParameterServer::Impl::Impl(ServerConfig c) : cfg(std::move(c)) {
  tp = transport::make_transport(cfg.transport);
  for (uint32_t i = 0; i < cfg.engine_threads; ++i)
    engines.push_back(std::make_unique<EngineThread>());
  is_coordinator = cfg.node_id == cfg.cluster.coordinator;
  if (is_coordinator) coord = std::make_unique<Coordinator>(*this);
}

void ParameterServer::Impl::start() {
  // The data path runs on the transport's I/O loop: on_data checks the
  // message and hands it to its partition's engine thread (or refuses it),
  // never blocking, so the handler-thread hop would only add a wake-up
  // per message.
  tp->set_inline_handler(proto::kPush, [this](Incoming in) { on_data(std::move(in)); });
  tp->set_inline_handler(proto::kPull, [this](Incoming in) { on_data(std::move(in)); });
  tp->set_inline_handler(proto::kBroadcast, [this](Incoming in) { on_data(std::move(in)); });
  tp->set_inline_handler(proto::kShmPush, [this](Incoming in) { on_data(std::move(in)); });
  tp->set_inline_handler(proto::kShmPull, [this](Incoming in) { on_data(std::move(in)); });
  // Opens and maps a segment: not for the I/O loop.
  tp->set_handler(proto::kShmAttach, [this](Incoming in) { on_shm_attach(in); });
  tp->set_handler(proto::kStats, [this](Incoming in) { on_stats(in); });
  tp->set_handler(proto::kProbe, [this](Incoming in) {
    if (in.expects_reply) reply(in, proto::probe_answer(in.message));
  });
  tp->set_handler(proto::kMetrics, [this](Incoming in) {
    if (in.expects_reply) reply(in, proto::ok_reply(transport::Buffer::take(metrics_text())));
  });
  for (uint16_t t : {proto::kJobSetup, proto::kJobEnd, proto::kStrategyPrepare})
    tp->set_handler(t, [this](Incoming in) { on_control(std::move(in)); });
  if (is_coordinator) {
    for (uint16_t t : {proto::kRegister, proto::kServerHello, proto::kBarrier,
                       proto::kSetStrategy, proto::kLeave, proto::kAbortRequest,
                       proto::kAutoProfile, proto::kAutoReplan})
      tp->set_handler(t, [this](Incoming in) { coord->on_message(std::move(in)); });
  }
  tp->set_default_handler([this](Incoming in) {
    frames_refused.fetch_add(1, std::memory_order_relaxed);
    char b[8];
    std::snprintf(b, sizeof b, "%04x", in.message.header.type);
    BC_LOG(LogServer(), kWarn) << "node " << in.from << " sent message type 0x" << b
                               << " this server does not serve; dropped";
    if (in.expects_reply)
      reply(in, proto::error_reply(ErrorCode::kInvalidArgument,
                                   std::string("unknown message type 0x") + b +
                                       (is_coordinator ? "" : " (this server is not the coordinator)")));
  });
  tp->on_peer_failure([this](NodeId id, const Status& s) {
    if (coord) coord->on_peer_lost(id, s);
    if (!is_coordinator && id == cfg.cluster.coordinator) {
      BC_LOG(LogServer(), kWarn) << "coordinator lost: " << s.message();
      end_all_jobs(ErrorCode::kAborted, "coordinator " + std::to_string(id) + " lost");
      {
        std::lock_guard lk(hello_mu);
        hello_needed = true;
      }
      hello_cv.notify_all();
    }
  });
  tp->start();
  if (!is_coordinator) {
    tp->add_peer(cfg.cluster.coordinator, cfg.cluster.coordinator_info().address);
    hello_thread = std::thread([this] { hello_loop(); });
  }
}

void ParameterServer::Impl::hello_loop() {
  // Registered, the server says hello again every second: a coordinator
  // that systemd restarted faster than peer_timeout was never seen lost, yet
  // it knows neither this server nor the jobs this server still holds for
  // its previous run. Its answer's incarnation tells (coordinator.cc).
  constexpr auto kAgain = std::chrono::milliseconds(1000);
  uint64_t incarnation = 0;  // the coordinator's, 0 = not known yet
  std::unique_lock lk(hello_mu);
  while (!stopping) {
    if (!hello_needed) {
      hello_cv.wait_for(lk, kAgain);
      if (stopping) break;
    }
    lk.unlock();
    // The jobs set up before asking: those of the run that answers with a
    // new incarnation may only be newer than this.
    std::vector<uint32_t> before;
    {
      std::shared_lock jl(jobs_mu);
      for (auto& [uid, j] : jobs) before.push_back(uid);
    }
    const proto::ServerHello hello{
        ServerInfo{cfg.node_id, tp->local_addresses().at(0), cfg.engine_threads}};
    transport::Response r =
        tp->call(cfg.cluster.coordinator, proto::to_message(hello), transport::Millis{2000});
    Status st = r.status.ok() ? proto::reply_status(r.response) : r.status;
    uint64_t now = 0;
    if (st.ok()) {
      const std::string payload = proto::joined(r.response);
      if (payload.size() == sizeof now) std::memcpy(&now, payload.data(), sizeof now);
    }
    if (st.ok() && now != 0 && incarnation != 0 && now != incarnation && !before.empty()) {
      const std::string why = "coordinator " + std::to_string(cfg.cluster.coordinator) +
                              " restarted (its jobs ended with it)";
      BC_LOG(LogServer(), kWarn) << why << ": ending " << before.size() << " job(s) of its "
                                 << "previous run";
      for (uint32_t uid : before) end_job(uid, ErrorCode::kAborted, why);
    } else if (st.ok() && now != 0 && incarnation != 0 && now != incarnation) {
      BC_LOG(LogServer(), kWarn) << "coordinator " << cfg.cluster.coordinator << " restarted";
    }
    lk.lock();
    if (st.ok()) {
      if (now != 0) incarnation = now;
      if (hello_needed)
        BC_LOG(LogServer(), kInfo) << "registered with coordinator " << cfg.cluster.coordinator;
      hello_needed = false;
    } else {
      if (!hello_needed)
        BC_LOG(LogServer(), kDebug) << "hello to coordinator " << cfg.cluster.coordinator
                                    << " failed: " << st.to_string();
      else
        BC_LOG(LogServer(), kDebug) << "coordinator not reached yet: " << st.to_string();
      hello_cv.wait_for(lk, std::chrono::milliseconds(300));
    }
  }
}

void ParameterServer::Impl::shutdown() {
  std::call_once(shutdown_once, [this] {
    BC_LOG(LogServer(), kInfo) << "server " << cfg.node_id << " stopping";
    {
      std::lock_guard lk(hello_mu);
      stopping = true;
    }
    hello_cv.notify_all();
    if (hello_thread.joinable()) hello_thread.join();
    if (coord) coord->stop();
    end_all_jobs(ErrorCode::kUnavailable, "server " + std::to_string(cfg.node_id) + " shut down");
    for (auto& e : engines) e->stop();  // runs the release tasks
    tp->shutdown();
    BC_LOG(LogServer(), kInfo) << "server " << cfg.node_id << " stopped";
  });
}

void ParameterServer::Impl::end_all_jobs(ErrorCode code, const std::string& reason) {
  std::vector<uint32_t> uids;
  {
    std::shared_lock lk(jobs_mu);
    for (auto& [uid, j] : jobs) uids.push_back(uid);
  }
  for (uint32_t uid : uids) end_job(uid, code, reason);
}

Status ParameterServer::Impl::setup_job(const proto::Admission& a) {
  auto job = std::make_shared<ServerJob>();
  job->uid = a.uid;
  job->name = a.name;
  job->nodes = a.nodes;
  for (uint32_t r = 0; r < a.nodes.size(); ++r) job->rank[a.nodes[r]] = r;
  job->deterministic = a.deterministic;
  job->start_iteration = a.start_iteration;
  job->units = fuse_job(a.tensors, plan_job(a.tensors, a.strategy_yaml), a.fusion);
  job->tensors = job->units.tensors;
  std::vector<TensorPlan> plans = job->units.plans;
  job->assignment = assign_partitions(job->tensors, plans, a.servers, a.partition_bytes,
                                      shard_elements(job->units, a.servers.size(), a.partition_bytes));
  if (job->assignment.digest != a.digest)
    return Status(ErrorCode::kInternal, "assignment digest differs from the coordinator's");
  for (const Partition& p : job->assignment.partitions) {
    if (p.server != cfg.node_id) continue;
    // A fused tensor's own partitions serve broadcasts only (its gradient
    // travels in its bucket): no sum to reserve.
    if (job->units.fused(p.tensor)) continue;
    job->reserved += round_reservation(plans[p.tensor], p.count, a.nodes.size(), a.deterministic);
  }
  {
    std::unique_lock lk(jobs_mu);
    if (jobs.count(a.uid))
      return Status(ErrorCode::kInvalidArgument, "job uid " + std::to_string(a.uid) + " exists");
    if (jobs.size() >= cfg.max_jobs)
      return Status(ErrorCode::kResourceExhausted,
                    "server " + std::to_string(cfg.node_id) + " already serves " +
                        std::to_string(jobs.size()) + " jobs (max_jobs)");
    if (job->reserved > cfg.max_job_bytes || reserved_total + job->reserved > cfg.max_total_bytes)
      return Status(ErrorCode::kResourceExhausted,
                    "job needs " + std::to_string(job->reserved) + " bytes on server " +
                        std::to_string(cfg.node_id) + " (max_job_bytes " +
                        std::to_string(cfg.max_job_bytes) + ", " +
                        std::to_string(cfg.max_total_bytes - reserved_total) +
                        " left of max_total_bytes)");
    reserved_total += job->reserved;
  }
  job->plans = std::make_unique<Timeline>(a.start_iteration, std::move(plans), a.strategy_yaml);
  for (const Partition& p : job->assignment.partitions) {
    if (p.server != cfg.node_id) continue;
    RoundSetup rs;
    rs.part = p;
    rs.label = "job '" + a.name + "' tensor '" + job->tensors[p.tensor].name + "' partition " +
               std::to_string(p.index) + " (key " + hex(p.key) + ")";
    rs.start_iteration = a.start_iteration;
    rs.nodes = static_cast<uint32_t>(a.nodes.size());
    rs.deterministic = a.deterministic;
    rs.shared_seed = strategy::partition_seed(a.name, p.key);
    rs.private_seed = strategy::server_private_seed(cfg.node_id, p.key);
    job->bcasts.emplace(p.key, std::make_unique<BroadcastRound>(p, rs.label, rs.nodes));
    if (job->units.fused(p.tensor)) continue;
    auto round = std::make_unique<PartitionRound>(std::move(rs), *job->plans);
    job->round_list.push_back(round.get());
    job->parts.emplace(p.key, std::move(round));
  }
  const uint64_t reserved = job->reserved;
  {
    std::unique_lock lk(jobs_mu);
    jobs[a.uid] = job;
  }
  BC_LOG(LogServer(), kInfo) << "job '" << a.name << "' (uid " << a.uid << ") set up: "
                             << job->parts.size() << " partitions here, " << reserved
                             << " bytes reserved";
  return Status::Ok();
}

void ParameterServer::Impl::end_job(uint32_t uid, ErrorCode code, const std::string& reason) {
  std::shared_ptr<ServerJob> job;
  {
    std::unique_lock lk(jobs_mu);
    auto it = jobs.find(uid);
    if (it == jobs.end()) return;
    job = it->second;
    jobs.erase(it);
    reserved_total -= job->reserved;
  }
  Status why;
  {
    std::lock_guard lk(job->mu);
    job->end_code = code;
    job->end_reason = reason.empty() ? "job '" + job->name + "' ended"
                                     : "job '" + job->name + "' aborted: " + reason;
    why = Status(code, job->end_reason);
  }
  job->ended.store(true);
  {
    std::unique_lock lk(jobs_mu);
    ended.push_back({uid, why.code(), why.message()});
    if (ended.size() > kEndedKept) ended.pop_front();
  }
  {
    // The rounds' held pushes keep their segment mapped until released.
    std::lock_guard lk(job->shm_mu);
    job->shm.clear();
  }
  BC_LOG(LogServer(), kInfo) << (reason.empty() ? "job ended: " : "job aborted: ")
                             << job->name << " (uid " << uid << ")"
                             << (reason.empty() ? "" : ": " + reason);
  // Each partition is released by its own engine, after what is queued.
  for (auto& [key, ps] : job->parts) {
    PartitionRound* r = ps.get();
    BroadcastRound* b = job->bcasts.at(key).get();
    engines[r->part().engine % engines.size()]->post([this, job, r, b, why] {
      std::vector<RoundAnswer> answers = r->release(why);
      answer(answers);
      answers = b->release(why);
      answer(answers);
    });
  }
}

Status ParameterServer::Impl::prepare_strategy(uint32_t uid, uint64_t iteration,
                                               const std::string& yaml, bool cancel) {
  std::shared_ptr<ServerJob> job;
  {
    std::shared_lock lk(jobs_mu);
    auto it = jobs.find(uid);
    if (it != jobs.end()) job = it->second;
  }
  if (!job) return Status(ErrorCode::kInvalidArgument, "unknown job uid " + std::to_string(uid));
  if (cancel) {
    job->plans->cancel(iteration);
    return Status::Ok();
  }
  std::vector<TensorPlan> plans;
  try {
    plans = unit_plans(
        job->units, plan_job({job->tensors.begin(),
                              job->tensors.begin() + static_cast<ptrdiff_t>(job->units.declared)},
                             yaml));
  } catch (const Error& e) {
    return Status(ErrorCode::kInvalidArgument, e.what());
  }
  uint64_t need = 0;
  for (auto& [key, ps] : job->parts)
    need += round_reservation(plans[ps->part().tensor], ps->part().count, job->nodes.size(),
                              job->deterministic);
  {
    // The reservation only grows (the old plan's rounds may still run).
    std::unique_lock lk(jobs_mu);
    if (need > job->reserved) {
      uint64_t more = need - job->reserved;
      if (need > cfg.max_job_bytes || reserved_total + more > cfg.max_total_bytes)
        return Status(ErrorCode::kResourceExhausted,
                      "server " + std::to_string(cfg.node_id) + ": the new strategy needs " +
                          std::to_string(need) + " bytes for the job (max_job_bytes " +
                          std::to_string(cfg.max_job_bytes) + ", " +
                          std::to_string(cfg.max_total_bytes - reserved_total) +
                          " left of max_total_bytes)");
      reserved_total += more;
      job->reserved = need;
    }
  }
  const std::string who = "server " + std::to_string(cfg.node_id);
  Status st = job->plans->add(iteration, std::move(plans), yaml, [&] {
    return rounds_admit_change(iteration, job->round_list, who);
  });
  if (!st.ok()) return st;
  BC_LOG(LogServer(), kInfo) << "job '" << job->name << "': strategy change prepared for iteration "
                             << iteration;
  return Status::Ok();
}

void ParameterServer::Impl::on_control(Incoming in) {
  const auto& h = in.message.header;
  if (in.from != cfg.cluster.coordinator) {
    frames_refused.fetch_add(1);
    if (in.expects_reply)
      reply(in, proto::error_reply(ErrorCode::kInvalidArgument,
                                   "node " + std::to_string(in.from) +
                                       " is not the coordinator; control message refused"));
    return;
  }
  Status st;
  try {
    switch (h.type) {
      case proto::kJobSetup: st = setup_job(proto::from_message<proto::JobSetup>(in.message).admission); break;
      case proto::kJobEnd: {
        const proto::JobEnd e = proto::from_message<proto::JobEnd>(in.message);
        end_job(e.uid, e.reason.empty() ? ErrorCode::kUnavailable : ErrorCode::kAborted, e.reason);
        break;
      }
      case proto::kStrategyPrepare: {
        const auto p = proto::from_message<proto::StrategyPrepare>(in.message);
        st = prepare_strategy(p.uid, p.iteration, p.yaml, p.cancel);
        break;
      }
      default: break;
    }
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kMalformed) frames_refused.fetch_add(1);
    st = Status::FromError(e);
  }
  if (in.expects_reply) reply(in, st.ok() ? proto::ok_reply() : proto::error_reply(st.code(), st.message()));
}

void ParameterServer::Impl::on_stats(const Incoming& in) {
  proto::Stats st;
  {
    std::shared_lock lk(jobs_mu);
    st.jobs = static_cast<uint32_t>(jobs.size());
    st.job_bytes = reserved_total;
  }
  st.rounds = rounds.load();
  st.pushes_refused = pushes_refused.load();
  st.frames_refused = frames_refused.load();
  if (in.expects_reply) reply(in, proto::ok_reply(proto::encode(st)));
}

void ParameterServer::Impl::on_data(Incoming in) {
  const auto& h = in.message.header;
  const char* what = h.type == proto::kPush      ? "push"
                     : h.type == proto::kPull    ? "pull"
                     : h.type == proto::kShmPush ? "shm push"
                     : h.type == proto::kShmPull ? "shm pull"
                                                 : "broadcast";
  // The message's shape (payloads, header fields) before anything reads it;
  // the rounds read its fields from the header, which data messages define.
  uint64_t shm_offset = 0, shm_length = 0;
  bool shared = false;  // a kShmPush: its bytes stay writable by the node
  try {
    if (h.type == proto::kPush) (void)proto::from_message<proto::Push>(in.message);
    else if (h.type == proto::kPull) (void)proto::from_message<proto::Pull>(in.message);
    else if (h.type == proto::kShmPush) {
      const auto m = proto::from_message<proto::ShmPush>(in.message);
      shm_offset = m.offset;
      shm_length = m.length;
    } else if (h.type == proto::kShmPull) {
      const auto m = proto::from_message<proto::ShmPull>(in.message);
      shm_offset = m.offset;
      shm_length = m.capacity;
    } else (void)proto::from_message<proto::Broadcast>(in.message);
  } catch (const Error& e) {
    frames_refused.fetch_add(1);
    return refuse(in, e.code(), e.what());
  }
  std::shared_ptr<ServerJob> job;
  std::optional<Ended> gone;
  {
    std::shared_lock lk(jobs_mu);
    auto it = jobs.find(h.aux);
    if (it != jobs.end()) job = it->second;
    else
      for (const Ended& e : ended)
        if (e.uid == h.aux) gone = e;
  }
  if (!job && gone)
    return refuse(in, gone->code,
                  std::string(what) + " refused by server " + std::to_string(cfg.node_id) +
                      ": " + gone->reason);
  if (!job)
    return refuse(in, ErrorCode::kInvalidArgument,
                  std::string(what) + " refused: unknown job uid " + std::to_string(h.aux) +
                      " on server " + std::to_string(cfg.node_id) + " (not admitted)");
  if (!job->rank.count(in.from))
    return refuse(in, ErrorCode::kInvalidArgument,
                  std::string(what) + " refused: node " + std::to_string(in.from) +
                      " is not part of job '" + job->name + "'");
  if (h.type == proto::kShmPush || h.type == proto::kShmPull) {
    std::shared_ptr<LocalShm> seg = job->shm_of(in.from);
    if (!seg)
      return refuse(in, ErrorCode::kInvalidArgument,
                    std::string(what) + " refused: node " + std::to_string(in.from) +
                        " attached no shared memory to server " + std::to_string(cfg.node_id) +
                        " for job '" + job->name + "'");
    if (shm_offset > seg->size() || shm_length > seg->size() - shm_offset)
      return refuse(in, ErrorCode::kInvalidArgument,
                    std::string(what) + " refused: bytes [" + std::to_string(shm_offset) + ", " +
                        std::to_string(shm_offset) + "+" + std::to_string(shm_length) +
                        ") lie outside node " + std::to_string(in.from) + "'s segment of " +
                        std::to_string(seg->size()) + " bytes (job '" + job->name + "', key " +
                        hex(h.key) + ")");
    if (h.type == proto::kShmPush) {
      // From here on an ordinary push whose bytes are the node's: the
      // rounds hold them (the Buffer keeps the segment mapped) and the node
      // does not rewrite them before the round's pull is answered; a
      // compressed one the round copies first (shared), as a buggy or
      // hostile node could.
      shared = true;
      metrics.shm(shm_length);
      in.message.header.type = proto::kPush;
      in.message.payloads = {Buffer::wrap(seg->data() + shm_offset, shm_length, [seg] {})};
    }
  }
  if (h.type == proto::kBroadcast) {
    // Every partition has a broadcast round, also a fused tensor's own
    // (which has no sum round: its gradient travels in its bucket).
    auto bit = job->bcasts.find(h.key);
    const Partition* part = job->assignment.find(h.key);
    if (bit != job->bcasts.end() && part != nullptr) {
      EngineThread& e = *engines[part->engine % engines.size()];
      BroadcastRound* b = bit->second.get();
      e.post([this, job, b, in = std::move(in)]() mutable { on_broadcast(job, *b, std::move(in)); });
      return;
    }
  }
  auto pit = job->parts.find(h.key);
  if (pit == job->parts.end()) {
    const uint64_t t = strategy::partition_tensor(h.key);
    const uint32_t i = strategy::partition_index(h.key);
    std::string detail;
    if (t >= job->tensors.size())
      detail = "tensor index " + std::to_string(t) + " does not exist (job has " +
               std::to_string(job->tensors.size()) + " tensors)";
    else if (const Partition* p = job->assignment.find(h.key))
      detail = "tensor '" + job->tensors[t].name + "' partition " + std::to_string(i) +
               " belongs to server " + std::to_string(p->server);
    else
      detail = "tensor '" + job->tensors[t].name + "' has no partition " + std::to_string(i);
    return refuse(in, ErrorCode::kInvalidArgument,
                  std::string(what) + " refused: unknown key " + hex(h.key) + " in job '" +
                      job->name + "': " + detail);
  }
  PartitionRound* round = pit->second.get();
  EngineThread& e = *engines[round->part().engine % engines.size()];
  if (h.type == proto::kBroadcast) {
    BroadcastRound* b = job->bcasts.at(h.key).get();
    e.post([this, job, b, in = std::move(in)]() mutable { on_broadcast(job, *b, std::move(in)); });
  } else if (h.type == proto::kPush)
    e.post([this, job, round, shared, in = std::move(in)] { on_push(job, *round, in, shared); });
  else
    e.post([this, job, round, in = std::move(in)]() mutable { on_pull(job, *round, std::move(in)); });
}

void ParameterServer::Impl::on_push(const std::shared_ptr<ServerJob>& job, PartitionRound& round,
                                    const Incoming& in, bool shared) {
  if (job->ended.load() || round.released()) {
    Status s = job->end_status();
    return refuse(in, s.code(), "push refused: " + s.message());
  }
  PushOutcome out =
      round.push(in.from, job->rank.at(in.from), in.message.header.arg, in.message.payloads, shared);
  if (!out.status.ok()) return refuse(in, out.status.code(), out.status.message());
  reply(in, proto::ok_reply());
  metrics.pushed(in.message.payloads[0].size());
  if (!out.failure.empty()) {
    BC_LOG(LogServer(), kError) << out.failure;
    request_abort(job->uid, out.failure);
  } else if (out.completed) {
    rounds.fetch_add(1, std::memory_order_relaxed);
    metrics.round_done(out.started_ns);
  }
  answer(out.answers, job.get());
}

void ParameterServer::Impl::on_pull(const std::shared_ptr<ServerJob>& job, PartitionRound& round,
                                    Incoming in) {
  if (job->ended.load() || round.released()) {
    Status s = job->end_status();
    return refuse(in, s.code(), "pull refused: " + s.message());
  }
  std::optional<RoundAnswer> a = round.pull(std::move(in));
  if (!a) return;  // waits for the round
  if (!a->status.ok()) return refuse(a->to, a->status.code(), a->status.message());
  answer(*a, job.get());
}

void ParameterServer::Impl::on_broadcast(const std::shared_ptr<ServerJob>& job,
                                         BroadcastRound& round, Incoming in) {
  if (job->ended.load() || round.released()) {
    Status s = job->end_status();
    return refuse(in, s.code(), "broadcast refused: " + s.message());
  }
  const uint32_t rank = job->rank.at(in.from);
  const bool is_root = (in.message.header.flags & proto::kBroadcastRoot) != 0;
  if (is_root && in.message.payloads.size() > 1) metrics.pushed(in.message.payloads[1].size());
  BroadcastOutcome out = round.add(std::move(in), rank, is_root);
  if (!out.failure.empty()) {
    BC_LOG(LogServer(), kWarn) << out.failure;
    request_abort(job->uid, out.failure);
  }
  answer(out.answers);
}

void ParameterServer::Impl::answer(RoundAnswer& a, ServerJob* job) {
  if (a.status.ok()) metrics.answered(a.payload.size());
  if (a.status.ok() && a.to.message.header.type == proto::kShmPull)
    return reply(a.to, shm_answer(a, job));
  reply(a.to, a.status.ok() ? proto::ok_reply(std::move(a.payload))
                            : proto::error_reply(a.status.code(), a.status.message()));
}

void ParameterServer::Impl::answer(std::vector<RoundAnswer>& answers, ServerJob* job) {
  for (RoundAnswer& a : answers) answer(a, job);
  answers.clear();
}

transport::Message ParameterServer::Impl::shm_answer(RoundAnswer& a, ServerJob* job) {
  // Checked against the segment when it arrived (on_data).
  const proto::ShmPull p = proto::from_message<proto::ShmPull>(a.to.message);
  std::shared_ptr<LocalShm> seg = job ? job->shm_of(a.to.from) : nullptr;
  if (!seg)
    return proto::error_reply(ErrorCode::kUnavailable,
                              "shm pull of node " + std::to_string(a.to.from) + ": its segment on " +
                                  "server " + std::to_string(cfg.node_id) + " is gone (job ended)");
  const uint64_t n = a.payload.size();
  if (n > p.capacity || p.offset > seg->size() || n > seg->size() - p.offset) {
    // A strategy whose answer outgrew the node's slot: carried in the reply.
    transport::Message m = proto::ok_reply(proto::encode(proto::ShmAnswer{n, false}));
    m.payloads.push_back(std::move(a.payload));
    return m;
  }
  if (n > 0) std::memcpy(seg->data() + p.offset, a.payload.data(), n);
  metrics.shm(n);
  return proto::ok_reply(proto::encode(proto::ShmAnswer{n, true}));
}

void ParameterServer::Impl::on_shm_attach(const Incoming& in) {
  auto answer_with = [&](const Status& st) {
    if (!st.ok())
      BC_LOG(LogServer(), kDebug) << "shm attach of node " << in.from << ": " << st.message();
    if (in.expects_reply)
      reply(in, st.ok() ? proto::ok_reply() : proto::error_reply(st.code(), st.message()));
  };
  proto::ShmAttach m;
  try {
    m = proto::from_message<proto::ShmAttach>(in.message);
  } catch (const Error& e) {
    frames_refused.fetch_add(1);
    return answer_with(Status::FromError(e));
  }
  const std::string me = "server " + std::to_string(cfg.node_id);
  if (!cfg.local_shm)
    return answer_with(Status(ErrorCode::kUnavailable, me + " has server.local_shm off"));
  if (m.host != host_identity())
    return answer_with(Status(ErrorCode::kUnavailable,
                              me + " runs on another host or network namespace (" +
                                  host_identity() + ", node " + std::to_string(in.from) +
                                  ": " + m.host.substr(0, 200) + ")"));
  std::shared_ptr<ServerJob> job;
  {
    std::shared_lock lk(jobs_mu);
    auto it = jobs.find(m.uid);
    if (it != jobs.end()) job = it->second;
  }
  if (!job)
    return answer_with(Status(ErrorCode::kInvalidArgument,
                              "shm attach: unknown job uid " + std::to_string(m.uid) + " on " + me));
  if (!job->rank.count(in.from))
    return answer_with(Status(ErrorCode::kInvalidArgument,
                              "shm attach: node " + std::to_string(in.from) +
                                  " is not part of job '" + job->name + "'"));
  if (!shm_name_matches(m.segment, m.uid, in.from))
    return answer_with(Status(ErrorCode::kInvalidArgument,
                              "shm attach: segment name '" + m.segment.substr(0, 200) +
                                  "' is not " + kShmPrefix + std::to_string(m.uid) + "." +
                                  std::to_string(in.from) + ".<server>.<pid>"));
  if (m.bytes == 0 || m.bytes > (uint64_t{1} << 44))
    return answer_with(Status(ErrorCode::kInvalidArgument,
                              "shm attach: segment size " + std::to_string(m.bytes) +
                                  " (accepted: 1 B .. 16 TiB)"));
  const std::string again = "shm attach: node " + std::to_string(in.from) +
                            " already attached a segment for job '" + job->name + "'";
  if (job->shm_of(in.from)) return answer_with(Status(ErrorCode::kInvalidArgument, again));
  std::shared_ptr<LocalShm> seg;
  try {
    seg = LocalShm::open(m.segment, m.bytes);
  } catch (const Error& e) {
    return answer_with(Status(e.code(), me + ": " + e.what()));
  }
  {
    std::lock_guard lk(job->shm_mu);
    if (job->ended.load()) return answer_with(job->end_status());
    if (!job->shm.emplace(in.from, seg).second)
      return answer_with(Status(ErrorCode::kInvalidArgument, again));
  }
  BC_LOG(LogServer(), kInfo) << "job '" << job->name << "': node " << in.from << " attached "
                             << m.segment << " (" << m.bytes << " bytes)";
  answer_with(Status::Ok());
}


// ---------------------------------------------------------------------------

void ParameterServer::Impl::request_abort(uint32_t uid, const std::string& reason) {
  if (coord) {
    coord->abort_running(uid, reason);
    return;
  }
  end_job(uid, ErrorCode::kAborted, reason);
  Message m = proto::to_message(proto::AbortRequest{uid, reason});
  tp->send(cfg.cluster.coordinator, std::move(m), nullptr);
}

ParameterServer::ParameterServer(ServerConfig config)
    : impl_(std::make_unique<Impl>(std::move(config))) {
  impl_->start();
  BC_LOG(LogServer(), kInfo) << "server " << impl_->cfg.node_id << " serving on "
                             << impl_->tp->local_addresses().at(0) << " with "
                             << impl_->cfg.engine_threads << " engine threads"
                             << (impl_->is_coordinator ? " (coordinator)" : "");
}

ParameterServer::~ParameterServer() { shutdown(); }

std::vector<std::string> ParameterServer::addresses() const { return impl_->tp->local_addresses(); }

std::string ParameterServer::metrics_text() const { return impl_->metrics_text(); }

std::string ParameterServer::Impl::metrics_text() {
  ServerView v{cfg.node_id, is_coordinator, 0, 0, pushes_refused.load(), frames_refused.load()};
  {
    std::shared_lock lk(jobs_mu);
    v.jobs = static_cast<uint32_t>(jobs.size());
    v.reserved_bytes = reserved_total;
  }
  return server::metrics_text(v, metrics);
}

void ParameterServer::shutdown() {
  if (impl_) impl_->shutdown();
}

}  // namespace bytecomp::server
