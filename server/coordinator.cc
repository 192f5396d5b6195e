#include "server/coordinator.h"

#include <algorithm>
#include <optional>
#include <random>
#include <type_traits>

#include "planner/strategy/auto_spec.h"
#include "planner/strategy/strategy.h"
#include "server/server_impl.h"
#include "server/server_log.h"

namespace bytecomp::server {

using transport::Buffer;
using transport::Clock;
using transport::Incoming;
using transport::Message;

namespace {

// Nonzero, different in every run of a coordinator (systemd restarts one in
// 100 ms, faster than any peer_timeout: nobody saw it lost).
uint64_t new_incarnation() {
  std::random_device rd;
  uint64_t v = 0;
  while (v == 0) v = (uint64_t{rd()} << 32) ^ rd();
  return v;
}

}  // namespace

Coordinator::Coordinator(ParameterServer::Impl& srv)
    : srv_(srv),
      incarnation_(new_incarnation()),
      // Job uids start at a random point of [1, 2^31): a restarted
      // coordinator reuses none of the uids that nodes and servers may
      // still hold (or hear late aborts of) from its previous run.
      next_uid_(1 + static_cast<uint32_t>(incarnation_ % 0x7fffffffu)),
      auto_([&srv](NodeId n, Message m) { srv.tp->send(n, std::move(m), nullptr); }) {
  ServerInfo self{srv.cfg.node_id, srv.tp->local_addresses().at(0), srv.cfg.engine_threads};
  servers_[self.id] = self;
  timer_ = std::thread([this] { timer_loop(); });
}

std::string Coordinator::node_name(NodeId id) const {
  return srv_.cfg.cluster.describe_node(id);
}

void Coordinator::stop() {
  std::vector<Incoming> waiting;
  std::vector<uint32_t> running;
  {
    std::lock_guard lk(mu_);
    if (stopping_) return;
    stopping_ = true;
    std::vector<std::string> names;
    for (auto& [name, p] : pending_) names.push_back(name);
    for (const std::string& n : names)
      for (Incoming& in : take_pending(n)) waiting.push_back(std::move(in));
    for (auto& [uid, r] : running_) running.push_back(uid);
  }
  cv_.notify_all();
  if (timer_.joinable()) timer_.join();
  auto_.stop();
  const std::string why = "coordinator " + std::to_string(srv_.cfg.node_id) + " shut down";
  reply_all_unavailable(waiting, why);
  for (uint32_t uid : running) abort_running(uid, why);
}

namespace {

void reply_all(ParameterServer::Impl& srv, std::vector<Incoming>& ins, ErrorCode code,
               const std::string& why) {
  for (Incoming& in : ins) srv.reply(in, proto::error_reply(code, why));
  ins.clear();
}

// Runs `n` asynchronous steps and calls `done(first_error)` once all finished.
struct Gather {
  std::mutex mu;
  size_t left = 0;
  Status first;
  std::vector<NodeId> ok;
  std::function<void(const Status&, const std::vector<NodeId>&)> done;
  void finish(NodeId who, const Status& s) {
    bool last = false;
    {
      std::lock_guard lk(mu);
      if (s.ok()) ok.push_back(who);
      else if (first.ok()) first = s;
      last = --left == 0;
    }
    if (last) done(first, ok);
  }
};

// Sends `m` as a request to every server (itself handled by `local`), or to
// every node (`who` "node ": none is this server).
void to_servers(ParameterServer::Impl& srv, const std::vector<NodeId>& servers, const Message& m,
                std::function<Status()> local,
                std::function<void(const Status&, const std::vector<NodeId>&)> done,
                const char* who = "server ") {
  auto g = std::make_shared<Gather>();
  g->left = servers.size();
  g->done = std::move(done);
  if (servers.empty()) {
    g->done(Status::Ok(), {});
    return;
  }
  for (NodeId s : servers) {
    if (s == srv.cfg.node_id) {
      Status st;
      try {
        st = local();
      } catch (const Error& e) {
        st = Status::FromError(e);
      }
      g->finish(s, st);
      continue;
    }
    srv.tp->request(s, m, srv.cfg.cluster.setup_timeout, [g, s, who](transport::Response r) {
      Status st = r.status.ok() ? proto::reply_status(r.response) : r.status;
      if (!st.ok()) st = Status(st.code(), who + std::to_string(s) + ": " + st.message());
      g->finish(s, st);
    });
  }
}

std::string describe_tensor(const TensorSpec& t) {
  return "'" + t.name + "' " + std::to_string(t.count) + " x " +
         std::string(compress::to_string(t.dtype));
}

// The start placement of an auto job (strategy::start_strategy_yaml),
// decided here once for every node: its inputs (every node's peer endpoint,
// the cluster's partition_bytes, which cuts the job) are the same for all,
// whereas each daemon's own scheduler.partition_bytes and peer_listen are
// not. "" (every tensor on the servers) unless every node runs strategy auto
// with the same settings and has a peer endpoint; `why` then says why not
// when some node asked for auto.
std::string auto_start_yaml(const std::vector<TensorSpec>& tensors, uint32_t nodes,
                            const std::vector<std::string>& auto_specs,
                            const std::vector<std::string>& peer_addresses,
                            uint64_t partition_bytes, std::string& why) {
  bool any = false, all = true;
  for (const std::string& a : auto_specs) {
    any = any || !a.empty();
    all = all && !a.empty();
  }
  if (!any || nodes < 2) return "";
  if (!all) {
    why = "not every node runs strategy auto";
    return "";
  }
  for (size_t r = 1; r < auto_specs.size(); ++r)
    if (auto_specs[r] != auto_specs[0]) {
      why = "ranks 0 and " + std::to_string(r) + " run different auto settings";
      return "";
    }
  for (size_t r = 0; r < peer_addresses.size(); ++r)
    if (peer_addresses[r].empty()) {
      why = "rank " + std::to_string(r) +
            "'s daemon has no peer endpoint (internode.peer_listen), so there is no ring";
      return "";
    }
  try {
    const auto spec = strategy::AutoSpec::parse_job_text(auto_specs[0], "the job's auto settings");
    if (!spec) {
      why = "the nodes' auto settings are not mode: auto";
      return "";
    }
    std::vector<std::string> names;
    std::vector<uint64_t> elements;
    for (const TensorSpec& t : tensors) {
      names.push_back(t.name);
      elements.push_back(t.count);
    }
    return strategy::start_strategy_yaml(*spec, names, elements, nodes, partition_bytes);
  } catch (const Error& e) {
    why = e.what();
    return "";
  }
}

// Empty when `b` (node `bn`) declares the same job as `a` (node `an`).
std::string spec_difference(const std::string& job, const JobSpec& a, const std::string& an,
                            const JobSpec& b, const std::string& bn) {
  std::string head = "job '" + job + "': ";
  if (a.nodes != b.nodes) return head + "the node list differs on " + bn + " from " + an;
  if (a.deterministic != b.deterministic)
    return head + "'deterministic' differs on " + bn + " from " + an;
  // One strategy for the whole job: a node with another text would run
  // other plans than the coordinator distributes.
  if (a.strategy_yaml != b.strategy_yaml)
    return head + "the strategy differs on " + bn + " from " + an +
           " (every node must run the job with the same strategy text)";
  if (!(a.fusion == b.fusion))
    return head + "tensor fusion differs on " + bn + " (" + b.fusion.describe() + ") from " + an +
           " (" + a.fusion.describe() +
           "): every node's bytecompd must have the same fusion section";
  if (a.start_iteration != b.start_iteration)
    return head + "start_iteration " + std::to_string(b.start_iteration) + " on " + bn +
           " differs from " + std::to_string(a.start_iteration) + " on " + an;
  size_t n = std::min(a.tensors.size(), b.tensors.size());
  for (size_t i = 0; i < n; ++i)
    if (!(a.tensors[i] == b.tensors[i]))
      return head + "tensor #" + std::to_string(i) + " differs on " + bn + ": declared " +
             describe_tensor(b.tensors[i]) + ", but " + an + " declared " +
             describe_tensor(a.tensors[i]);
  if (a.tensors.size() != b.tensors.size()) {
    const JobSpec& longer = a.tensors.size() > b.tensors.size() ? a : b;
    const std::string& who = a.tensors.size() > b.tensors.size() ? an : bn;
    const std::string& other = a.tensors.size() > b.tensors.size() ? bn : an;
    return head + "tensor #" + std::to_string(n) + " " + describe_tensor(longer.tensors[n]) +
           " is declared on " + who + " but not on " + other + " (" +
           std::to_string(a.tensors.size()) + " vs " + std::to_string(b.tensors.size()) +
           " tensors)";
  }
  return {};
}

}  // namespace

void Coordinator::reply_all_unavailable(std::vector<Incoming>& ins, const std::string& why) {
  reply_all(srv_, ins, ErrorCode::kUnavailable, why);
}

std::string Coordinator::missing_locked(const Pending& p) const {
  std::string m;
  for (uint32_t r = 0; r < p.ref.nodes.size(); ++r)
    if (!p.regs.count(r)) m += (m.empty() ? "" : ", ") + node_name(p.ref.nodes[r]) + " (rank " +
                               std::to_string(r) + ")";
  std::string servers;
  for (const ServerInfo& s : srv_.cfg.cluster.servers)
    if (!servers_.count(s.id)) servers += (servers.empty() ? "" : ", ") + std::to_string(s.id);
  if (!servers.empty()) m += (m.empty() ? "" : "; ") + std::string("servers not registered: ") + servers;
  return m;
}

void Coordinator::on_message(Incoming in) {
  // Decoded here, once; a malformed message is counted and refused naming
  // what was wrong, and no handler sees it.
  auto decode = [&]<class M>(std::type_identity<M>) -> std::optional<M> {
    try {
      return proto::from_message<M>(in.message);
    } catch (const Error& e) {
      srv_.frames_refused.fetch_add(1);
      BC_LOG(LogCoord(), kWarn) << node_name(in.from) << ": " << e.what();
      if (in.expects_reply) srv_.reply(in, proto::error_reply(e.code(), e.what()));
      return std::nullopt;
    }
  };
  switch (in.message.header.type) {
    case proto::kRegister:
      if (auto m = decode(std::type_identity<proto::Register>{})) on_register(std::move(in), std::move(*m));
      return;
    case proto::kServerHello:
      if (auto m = decode(std::type_identity<proto::ServerHello>{})) on_hello(std::move(in), std::move(*m));
      return;
    case proto::kBarrier:
      if (auto m = decode(std::type_identity<proto::Barrier>{})) on_barrier(std::move(in), *m);
      return;
    case proto::kSetStrategy:
      if (auto m = decode(std::type_identity<proto::SetStrategy>{}))
        on_set_strategy(std::move(in), std::move(*m));
      return;
    case proto::kLeave:
      if (auto m = decode(std::type_identity<proto::Leave>{})) on_leave(std::move(in), *m);
      return;
    case proto::kAutoProfile:
      if (auto m = decode(std::type_identity<proto::AutoProfile>{})) {
        const uint32_t uid = m->uid;
        const NodeId from = in.from;
        on_auto(std::move(in), uid, [this, from, p = std::move(*m)](const AutoPlanner::JobView& v) {
          return auto_.on_profile(v, from, p.epoch, p.profile_yaml, p.spec_yaml);
        });
      }
      return;
    case proto::kAutoReplan:
      if (auto m = decode(std::type_identity<proto::AutoReplan>{})) {
        const uint32_t uid = m->uid;
        const NodeId from = in.from;
        on_auto(std::move(in), uid, [this, from, r = std::move(*m)](const AutoPlanner::JobView& v) {
          return auto_.on_replan(v, from, r.from_iteration, r.reason);
        });
      }
      return;
    case proto::kAbortRequest:
      if (auto m = decode(std::type_identity<proto::AbortRequest>{}))
        if (srv_.cfg.cluster.server(in.from)) abort_running(m->uid, m->reason);
      return;
    default: break;
  }
}

void Coordinator::on_hello(Incoming in, proto::ServerHello m) {
  const ServerInfo info = std::move(m.info);
  if (info.id != in.from || !srv_.cfg.cluster.server(info.id))
    return srv_.reply(in, proto::error_reply(ErrorCode::kInvalidArgument,
                                             "node " + std::to_string(in.from) +
                                                 " is not a server of the cluster config"));
  std::vector<std::function<void()>> after;
  bool known = false;
  {
    std::lock_guard lk(mu_);
    auto it = servers_.find(info.id);
    known = it != servers_.end() && it->second.address == info.address &&
            it->second.engine_threads == info.engine_threads;
    servers_[info.id] = info;
    for (auto& [name, p] : pending_) try_admit_locked(p, after);
  }
  // Servers say hello again every second (a restarted coordinator learns of
  // them so); only news is worth a line.
  if (known)
    BC_LOG(LogCoord(), kDebug) << "server " << info.id << " said hello again";
  else
    BC_LOG(LogCoord(), kInfo) << "server " << info.id << " registered (" << info.address << ", "
                              << info.engine_threads << " engine threads)";
  // The answer carries this run's incarnation: a server that sees it change
  // drops the jobs of the previous run (ParameterServer::Impl::hello_loop).
  srv_.reply(in, proto::ok_reply(Buffer::copy_of(&incarnation_, sizeof incarnation_)));
  for (auto& f : after) f();
}

void Coordinator::on_register(Incoming in, proto::Register m) {
  JobSpec spec = std::move(m.spec);
  auto refuse = [&](const std::string& why) {
    BC_LOG(LogCoord(), kWarn) << "registration of " << node_name(in.from) << " refused: " << why;
    srv_.reply(in, proto::error_reply(ErrorCode::kInvalidArgument, why));
  };
  if (spec.name.empty()) return refuse("job name is empty");
  auto self_it = std::find(spec.nodes.begin(), spec.nodes.end(), in.from);
  if (self_it == spec.nodes.end())
    return refuse("job '" + spec.name + "': " + node_name(in.from) +
                  " registered but is not in the job's node list");
  std::set<NodeId> uniq(spec.nodes.begin(), spec.nodes.end());
  if (uniq.size() != spec.nodes.size())
    return refuse("job '" + spec.name + "': a node appears twice in the node list");
  for (NodeId n : spec.nodes)
    if (srv_.cfg.cluster.server(n))
      return refuse("job '" + spec.name + "': node " + std::to_string(n) +
                    " of the node list is a server id");
  uint32_t rank = static_cast<uint32_t>(self_it - spec.nodes.begin());

  // A node registers a job's name again while it is a member of the running
  // job of that name that has not left it: its daemon no longer runs that
  // job (a daemon refuses a job id it runs, and a leave or abort it sent
  // came first: one sender's messages are handled in order). Restarted by
  // systemd faster than peer_timeout, it was never seen lost, and the other
  // nodes may have left already: the job would stay forever. It is over.
  uint32_t stale = 0;
  {
    std::lock_guard lk(mu_);
    for (auto& [uid, r] : running_)
      if (r.adm.name == spec.name && !r.left.count(in.from) &&
          std::find(r.adm.nodes.begin(), r.adm.nodes.end(), in.from) != r.adm.nodes.end())
        stale = uid;
  }
  if (stale != 0)
    abort_running(stale, node_name(in.from) + " registered job '" + spec.name +
                              "' again while a member of its running job (uid " +
                              std::to_string(stale) +
                              "): its daemon no longer runs that job (restarted?)");

  std::vector<Incoming> fail;
  std::string fail_why;
  std::vector<std::function<void()>> after;
  {
    std::lock_guard lk(mu_);
    for (auto& [uid, r] : running_)
      if (r.adm.name == spec.name)
        return refuse("job '" + spec.name + "' is already running (uid " + std::to_string(uid) +
                      ")");
    auto it = pending_.find(spec.name);
    if (it == pending_.end()) {
      Pending p;
      p.name = spec.name;
      p.uid = next_uid_++;
      p.ref = spec;
      p.ref_node = in.from;
      p.deadline = Clock::now() + srv_.cfg.cluster.admission_timeout;
      it = pending_.emplace(spec.name, std::move(p)).first;
      BC_LOG(LogCoord(), kInfo) << "job '" << spec.name << "': first registration (" 
                                << node_name(in.from) << "), waiting for "
                                << spec.nodes.size() << " nodes";
      cv_.notify_all();
    }
    Pending& p = it->second;
    if (p.regs.count(rank))
      return refuse("job '" + spec.name + "': " + node_name(in.from) + " registered twice");
    std::string diff = spec_difference(
        spec.name, p.ref, node_name(p.ref_node) + " (rank " +
                              std::to_string(std::find(p.ref.nodes.begin(), p.ref.nodes.end(),
                                                       p.ref_node) -
                                             p.ref.nodes.begin()) +
                              ")",
        spec, node_name(in.from) + " (rank " + std::to_string(rank) + ")");
    if (!diff.empty()) {
      fail = take_pending(spec.name);
      fail.push_back(std::move(in));
      fail_why = diff;
    } else {
      BC_LOG(LogCoord(), kInfo) << "job '" << spec.name << "': " << node_name(in.from)
                                << " registered as rank " << rank;
      p.regs[rank] = Reg{std::move(in), std::move(spec)};
      try_admit_locked(p, after);
    }
  }
  if (!fail.empty()) {
    BC_LOG(LogCoord(), kWarn) << fail_why << "; job refused";
    reply_all(srv_, fail, ErrorCode::kInvalidArgument, fail_why);
  }
  for (auto& f : after) f();
}

std::vector<Incoming> Coordinator::take_pending(const std::string& name) {
  std::vector<Incoming> out;
  auto it = pending_.find(name);
  if (it == pending_.end()) return out;
  for (auto& [r, reg] : it->second.regs) out.push_back(std::move(reg.in));
  pending_.erase(it);
  return out;
}

void Coordinator::try_admit_locked(Pending& p, std::vector<std::function<void()>>& after) {
  if (p.setting_up || p.regs.size() != p.ref.nodes.size()) return;
  for (const ServerInfo& s : srv_.cfg.cluster.servers)
    if (!servers_.count(s.id)) return;  // admitted when the last server says hello
  proto::Admission adm;
  adm.name = p.name;
  adm.uid = p.uid;
  adm.nodes = p.ref.nodes;
  adm.tensors = p.ref.tensors;
  adm.deterministic = p.ref.deterministic;
  adm.start_iteration = p.ref.start_iteration;
  adm.partition_bytes = srv_.cfg.cluster.partition_bytes;
  for (const ServerInfo& s : srv_.cfg.cluster.servers) adm.servers.push_back(servers_.at(s.id));
  adm.strategy_yaml = p.regs.at(0).spec.strategy_yaml;
  adm.fusion = p.regs.at(0).spec.fusion;
  std::vector<std::string> auto_specs;
  for (const auto& [rank, reg] : p.regs) {
    adm.peer_addresses.push_back(reg.spec.peer_address);
    auto_specs.push_back(reg.spec.auto_spec_yaml);
  }
  // An auto job registers no strategy; its start placement travels to every
  // party in the admission, which all plans come from.
  if (adm.strategy_yaml.empty()) {
    std::string why;
    adm.strategy_yaml =
        auto_start_yaml(adm.tensors, static_cast<uint32_t>(adm.nodes.size()), auto_specs,
                        adm.peer_addresses, adm.partition_bytes, why);
    if (!adm.strategy_yaml.empty())
      BC_LOG(LogCoord(), kInfo) << "job '" << p.name << "': strategy auto starts with "
                                << strategy::Strategy::parse(adm.strategy_yaml, "start")
                                       .meta.at("ring_tensors")
                                << " tensor(s) on the daemons' ring";
    else if (!why.empty())  // a warning: the job runs without the ring its nodes could use
      BC_LOG(LogCoord(), kWarn) << "job '" << p.name << "': strategy auto starts with every "
                                << "tensor on the servers: " << why;
  }
  p.setting_up = true;
  std::string name = p.name;
  after.push_back([this, adm = std::move(adm), name]() mutable { admit(std::move(adm), name); });
}

void Coordinator::admit(proto::Admission adm, std::string name) {
  // The coordinator computes the assignment like everybody else.
  std::string problem;
  auto plans = std::make_shared<std::vector<TensorPlan>>();
  try {
    *plans = plan_job(adm.tensors, adm.strategy_yaml);
    // The servers run the job's units (declared tensors, then fused buckets).
    const JobUnits units = fuse_job(adm.tensors, *plans, adm.fusion);
    adm.digest = assign_partitions(units.tensors, units.plans, adm.servers, adm.partition_bytes,
                                   shard_elements(units, adm.servers.size(), adm.partition_bytes))
                     .digest;
    if (!units.buckets.empty())
      BC_LOG(LogCoord(), kInfo) << "job '" << name << "': " << units.buckets.size()
                                << " fused buckets (" << adm.fusion.describe() << ")";
  } catch (const Error& e) {
    problem = "job '" + name + "': " + e.what();
  }
  auto fail = [this, name](const std::string& why, const std::vector<NodeId>& undo, uint32_t uid) {
    std::vector<Incoming> ins;
    {
      std::lock_guard lk(mu_);
      ins = take_pending(name);
    }
    BC_LOG(LogCoord(), kWarn) << why << "; job refused";
    reply_all(srv_, ins, ErrorCode::kInvalidArgument, why);
    const Message end = proto::to_message(proto::JobEnd{uid, why});
    for (NodeId s : undo) {
      if (s == srv_.cfg.node_id) srv_.end_job(uid, ErrorCode::kAborted, why);
      else srv_.tp->request(s, end, srv_.cfg.cluster.setup_timeout, [](transport::Response) {});
    }
  };
  if (!problem.empty()) return fail(problem, {}, adm.uid);

  std::vector<NodeId> servers;
  for (const ServerInfo& s : adm.servers) servers.push_back(s.id);
  const Message setup = proto::to_message(proto::JobSetup{adm});
  to_servers(
      srv_, servers, setup, [this, adm] { return srv_.setup_job(adm); },
      [this, adm, name, fail, plans](const Status& st, const std::vector<NodeId>& ok) {
        if (!st.ok()) return fail("job '" + name + "': setup failed on " + st.message(), ok, adm.uid);
        std::vector<std::pair<Incoming, uint32_t>> answer;
        std::string failed;
        {
          std::lock_guard lk(mu_);
          auto it = pending_.find(name);
          if (it == pending_.end()) {
            failed = "job '" + name + "' vanished during setup";
          } else if (!it->second.failed.empty()) {
            failed = it->second.failed;
          } else {
            Running r;
            r.adm = adm;
            r.timeline = std::make_unique<strategy::Timeline>(adm.start_iteration,
                                                              std::move(*plans), adm.strategy_yaml);
            for (auto& [rank, reg] : it->second.regs) answer.emplace_back(std::move(reg.in), rank);
            pending_.erase(it);
            running_.emplace(adm.uid, std::move(r));
          }
        }
        if (!failed.empty()) return fail(failed, ok, adm.uid);
        BC_LOG(LogCoord(), kInfo) << "job '" << name << "' (uid " << adm.uid << ") admitted: "
                                  << adm.nodes.size() << " nodes, " << adm.tensors.size()
                                  << " tensors, " << adm.servers.size() << " servers";
        for (auto& [in, rank] : answer) {
          proto::Admission mine = adm;
          mine.rank = rank;
          srv_.reply(in, proto::ok_reply(proto::encode(mine)));
        }
      });
}

void Coordinator::timer_loop() {
  std::unique_lock lk(mu_);
  while (!stopping_) {
    auto now = Clock::now();
    auto next = now + std::chrono::seconds(1);
    std::vector<std::pair<std::vector<Incoming>, std::string>> expired;
    for (auto it = pending_.begin(); it != pending_.end();) {
      Pending& p = it->second;
      if (!p.setting_up && p.deadline <= now) {
        std::string why = "job '" + p.name + "': admission timed out after " +
                          std::to_string(srv_.cfg.cluster.admission_timeout.count()) +
                          " ms; missing: " + missing_locked(p);
        std::string name = p.name;
        ++it;
        expired.emplace_back(take_pending(name), why);
        continue;
      }
      if (!p.setting_up) next = std::min(next, p.deadline);
      ++it;
    }
    if (!expired.empty()) {
      lk.unlock();
      for (auto& [ins, why] : expired) {
        BC_LOG(LogCoord(), kWarn) << why;
        reply_all(srv_, ins, ErrorCode::kTimeout, why);
      }
      lk.lock();
      continue;
    }
    cv_.wait_until(lk, next);
  }
}

void Coordinator::barrier_check_locked(Running& r, std::vector<Incoming>& done) {
  size_t need = r.adm.nodes.size() - r.left.size();
  for (auto it = r.barriers.begin(); it != r.barriers.end();) {
    if (it->second.size() >= need) {
      for (Incoming& in : it->second) done.push_back(std::move(in));
      it = r.barriers.erase(it);
    } else {
      ++it;
    }
  }
}

void Coordinator::on_barrier(Incoming in, const proto::Barrier& m) {
  std::vector<Incoming> done;
  {
    std::lock_guard lk(mu_);
    auto it = running_.find(m.uid);
    if (it == running_.end() ||
        std::find(it->second.adm.nodes.begin(), it->second.adm.nodes.end(), in.from) ==
            it->second.adm.nodes.end())
      return srv_.reply(in, proto::error_reply(ErrorCode::kInvalidArgument,
                                               "barrier: unknown job uid " +
                                                   std::to_string(m.uid) + " for " +
                                                   node_name(in.from)));
    it->second.barriers[m.seq].push_back(std::move(in));
    barrier_check_locked(it->second, done);
  }
  for (Incoming& d : done) srv_.reply(d, proto::ok_reply());
}

void Coordinator::on_leave(Incoming in, const proto::Leave& m) {
  const uint32_t uid = m.uid;
  if (m.abort) {
    std::string reason = node_name(in.from) + " aborted the job: " + m.reason;
    bool known;
    {
      std::lock_guard lk(mu_);
      known = running_.count(uid) != 0;
    }
    srv_.reply(in, known ? proto::ok_reply()
                         : proto::error_reply(ErrorCode::kInvalidArgument,
                                              "abort: unknown job uid " + std::to_string(uid)));
    if (known) abort_running(uid, reason);
    return;
  }
  std::vector<Incoming> done;
  bool all_left = false;
  std::string name;
  {
    std::lock_guard lk(mu_);
    auto it = running_.find(uid);
    if (it == running_.end())
      return srv_.reply(in, proto::error_reply(ErrorCode::kInvalidArgument,
                                               "leave: unknown job uid " + std::to_string(uid)));
    Running& r = it->second;
    name = r.adm.name;
    r.left.insert(in.from);
    barrier_check_locked(r, done);
    if (r.left.size() == r.adm.nodes.size()) {
      all_left = true;
      running_.erase(it);
      auto_.forget(uid);
    }
  }
  BC_LOG(LogCoord(), kInfo) << "job '" << name << "': " << node_name(in.from) << " left";
  srv_.reply(in, proto::ok_reply());
  for (Incoming& d : done) srv_.reply(d, proto::ok_reply());
  if (all_left) {
    BC_LOG(LogCoord(), kInfo) << "job '" << name << "' (uid " << uid << ") ended: all nodes left";
    const Message end = proto::to_message(proto::JobEnd{uid, ""});
    std::vector<NodeId> servers;
    for (const ServerInfo& s : srv_.cfg.cluster.servers) servers.push_back(s.id);
    to_servers(
        srv_, servers, end,
        [this, uid] {
          srv_.end_job(uid, ErrorCode::kUnavailable, "");
          return Status::Ok();
        },
        [](const Status&, const std::vector<NodeId>&) {});
  }
}

void Coordinator::on_set_strategy(Incoming in, proto::SetStrategy m) {
  const uint32_t uid = m.uid;
  const uint64_t iteration = m.iteration;
  const std::string yaml = std::move(m.yaml);
  auto refuse = [&](const std::string& why) {
    BC_LOG(LogCoord(), kWarn) << "strategy change refused: " << why;
    srv_.reply(in, proto::error_reply(ErrorCode::kInvalidArgument, why));
  };
  proto::Admission adm;
  std::vector<TensorPlan> current;
  {
    std::lock_guard lk(mu_);
    auto it = running_.find(uid);
    if (it == running_.end()) return refuse("unknown job uid " + std::to_string(uid));
    Running& r = it->second;
    if (std::find(r.adm.nodes.begin(), r.adm.nodes.end(), in.from) == r.adm.nodes.end())
      return refuse(node_name(in.from) + " is not part of job '" + r.adm.name + "'");
    if (r.changing) return refuse("job '" + r.adm.name + "': another strategy change is in progress");
    const strategy::Timeline::Entry last = r.timeline->latest();
    if (iteration <= last.first)
      return refuse("job '" + r.adm.name + "': iteration " + std::to_string(iteration) +
                    " is not after the last change (iteration " + std::to_string(last.first) +
                    ")");
    r.changing = true;
    adm = r.adm;
    current = *last.plans;
  }
  auto unmark = [this, uid] {
    std::lock_guard lk(mu_);
    auto it = running_.find(uid);
    if (it != running_.end()) it->second.changing = false;
  };
  std::vector<TensorPlan> plans;
  try {
    plans = plan_job(adm.tensors, yaml);
    // Ring <-> ps moves apply at the iteration like any change: every server
    // holds the ring tensors' partitions (assign_partitions) and the nodes
    // pick the path per round.
    if (std::string why = strategy::placement_change(adm.tensors, current, plans); !why.empty())
      throw Error(ErrorCode::kInvalidArgument, why);
    for (size_t t = 0; t < plans.size(); ++t) {
      if (plans[t].placement != Placement::kRing || current[t].placement == Placement::kRing)
        continue;
      // The nodes opened their ring at the join only when every one of
      // them has a peer endpoint.
      for (size_t r = 0; r < adm.peer_addresses.size(); ++r)
        if (adm.peer_addresses[r].empty())
          throw Error(ErrorCode::kInvalidArgument,
                      "tensor '" + adm.tensors[t].name + "' would move from " +
                          std::string(to_string(current[t].placement)) +
                          " to the daemons' ring, but " + node_name(adm.nodes.at(r)) +
                          " has no peer endpoint (internode.peer_listen)");
    }
    // Every party cut the tensors at admission by their pieces
    // (assign_partitions, the nodes' paths, the clients' shared memory).
    if (std::string why = strategy::layout_change(adm.tensors, current, plans); !why.empty())
      throw Error(ErrorCode::kInvalidArgument, why);
    // Fused buckets are fixed for the job: their members must keep one plan.
    if (adm.fusion.enabled)
      unit_plans(fuse_job(adm.tensors, plan_job(adm.tensors, adm.strategy_yaml), adm.fusion),
                 plans);
  } catch (const Error& e) {
    unmark();
    return refuse("job '" + adm.name + "': " + e.what());
  }
  std::vector<NodeId> servers;
  for (const ServerInfo& s : adm.servers) servers.push_back(s.id);
  const Message prep = proto::to_message(proto::StrategyPrepare{uid, iteration, false, yaml});
  to_servers(
      srv_, servers, prep,
      [this, uid, iteration, yaml] { return srv_.prepare_strategy(uid, iteration, yaml, false); },
      [this, in, uid, iteration, yaml, plans, adm, servers](const Status& st,
                                                            const std::vector<NodeId>& ok) {
        if (!st.ok()) {
          const Message cancel =
              proto::to_message(proto::StrategyPrepare{uid, iteration, true, ""});
          for (NodeId s : ok) {
            if (s == srv_.cfg.node_id) srv_.prepare_strategy(uid, iteration, yaml, true);
            else srv_.tp->request(s, cancel, srv_.cfg.cluster.setup_timeout, [](transport::Response) {});
          }
          {
            std::lock_guard lk(mu_);
            auto it = running_.find(uid);
            if (it != running_.end()) it->second.changing = false;
          }
          BC_LOG(LogCoord(), kWarn) << "job '" << adm.name << "': strategy change refused: "
                                    << st.message();
          srv_.reply(in, proto::error_reply(st.code(), "job '" + adm.name + "': " + st.message()));
          return;
        }
        std::set<NodeId> left;
        {
          std::lock_guard lk(mu_);
          auto it = running_.find(uid);
          if (it != running_.end()) {
            it->second.changing = false;
            (void)it->second.timeline->add(iteration, plans, yaml);
            left = it->second.left;
          }
        }
        BC_LOG(LogCoord(), kInfo) << "job '" << adm.name << "': strategy changes at iteration "
                                  << iteration;
        const Message upd = proto::to_message(proto::StrategyUpdate{uid, iteration, yaml});
        std::vector<NodeId> nodes;
        for (NodeId n : adm.nodes)
          if (!left.count(n)) nodes.push_back(n);
        // The requester hears "done" once every node applied the change (and
        // holds its rounds from the iteration before the switch until then),
        // so no node can reach the switch iteration under the old plan. The
        // servers have it already: a node that does not confirm fails at the
        // switch with the servers' refusal, so the change stands either way.
        to_servers(
            srv_, nodes, upd, [] { return Status::Ok(); },
            [this, in, name = adm.name, iteration](const Status& st, const std::vector<NodeId>&) {
              if (!st.ok())
                BC_LOG(LogCoord(), kWarn) << "job '" << name << "': strategy change at iteration "
                                          << iteration << " not confirmed by every node: "
                                          << st.message();
              srv_.reply(in, proto::ok_reply());
            },
            "node ");
      });
}

void Coordinator::on_auto(Incoming in, uint32_t uid,
                          const std::function<Status(const AutoPlanner::JobView&)>& deliver) {
  AutoPlanner::JobView view;
  {
    std::lock_guard lk(mu_);
    auto it = running_.find(uid);
    if (it == running_.end())
      return srv_.reply(in, proto::error_reply(ErrorCode::kInvalidArgument,
                                               "auto planning: unknown job uid " +
                                                   std::to_string(uid)));
    const proto::Admission& a = it->second.adm;
    view.uid = a.uid;
    view.name = a.name;
    view.nodes = a.nodes;
    view.servers = static_cast<uint32_t>(a.servers.size());
    view.partition_bytes = a.partition_bytes;
    // The same test as the ring <-> ps check of on_set_strategy: a plan
    // that moves a tensor onto the ring is never one the coordinator refuses.
    view.ring = !a.peer_addresses.empty() &&
                std::none_of(a.peer_addresses.begin(), a.peer_addresses.end(),
                             [](const std::string& p) { return p.empty(); });
  }
  const Status st = deliver(view);
  if (!st.ok()) BC_LOG(LogCoord(), kWarn) << "job '" << view.name << "': " << st.message();
  srv_.reply(in, st.ok() ? proto::ok_reply() : proto::error_reply(st.code(), st.message()));
}

void Coordinator::abort_running(uint32_t uid, const std::string& reason) {
  std::vector<Incoming> waiting;
  proto::Admission adm;
  std::set<NodeId> left;
  {
    std::lock_guard lk(mu_);
    auto it = running_.find(uid);
    if (it == running_.end()) return;
    for (auto& [seq, ins] : it->second.barriers)
      for (Incoming& in : ins) waiting.push_back(std::move(in));
    adm = it->second.adm;
    left = it->second.left;
    running_.erase(it);
    auto_.forget(uid);
  }
  BC_LOG(LogCoord(), kWarn) << "job '" << adm.name << "' (uid " << uid << ") aborted: " << reason;
  reply_all(srv_, waiting, ErrorCode::kAborted, reason);
  const Message ab = proto::to_message(proto::JobAborted{uid, reason});
  for (NodeId n : adm.nodes)
    if (!left.count(n) && srv_.tp->peer_state(n) != transport::PeerState::kLost)
      srv_.tp->send(n, ab, nullptr);
  const Message end = proto::to_message(proto::JobEnd{uid, reason});
  std::vector<NodeId> servers;
  for (const ServerInfo& s : adm.servers)
    if (s.id == srv_.cfg.node_id || srv_.tp->peer_state(s.id) != transport::PeerState::kLost)
      servers.push_back(s.id);
  to_servers(
      srv_, servers, end,
      [this, uid, reason] {
        srv_.end_job(uid, ErrorCode::kAborted, reason);
        return Status::Ok();
      },
      [](const Status&, const std::vector<NodeId>&) {});
}

void Coordinator::on_peer_lost(NodeId id, const Status& s) {
  std::vector<uint32_t> abort;
  std::vector<std::pair<std::vector<Incoming>, std::string>> fail;
  std::string reason;
  bool is_server = srv_.cfg.cluster.server(id) != nullptr;
  {
    std::lock_guard lk(mu_);
    if (is_server) {
      servers_.erase(id);
      reason = "server " + std::to_string(id) + " lost: " + s.message();
      for (auto& [uid, r] : running_) abort.push_back(uid);
    } else {
      reason = node_name(id) + " lost: " + s.message();
      for (auto& [uid, r] : running_)
        if (std::find(r.adm.nodes.begin(), r.adm.nodes.end(), id) != r.adm.nodes.end() &&
            !r.left.count(id))
          abort.push_back(uid);
      std::vector<std::string> names;
      for (auto& [name, p] : pending_) {
        bool member = false;
        for (auto& [rank, reg] : p.regs) member |= reg.in.from == id;
        if (!member) continue;
        if (p.setting_up) p.failed = "job '" + name + "': " + reason + " before admission";
        else names.push_back(name);
      }
      for (const std::string& n : names)
        fail.emplace_back(take_pending(n), "job '" + n + "': " + reason + " before admission");
    }
  }
  if (is_server) BC_LOG(LogCoord(), kWarn) << reason;
  for (auto& [ins, why] : fail) {
    BC_LOG(LogCoord(), kWarn) << why;
    reply_all(srv_, ins, ErrorCode::kAborted, why);
  }
  for (uint32_t uid : abort) abort_running(uid, reason);
}

}  // namespace bytecomp::server
