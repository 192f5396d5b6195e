#include "server/ps_server.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "common/config.h"
#include "common/log.h"
#include "common/logging_config.h"
#include "compress/compressor.h"
#include "compress/reduce.h"
#include "planner/strategy/answer.h"
#include "server/auto_planner.h"
#include "server/metrics.h"
#include "server/protocol.h"
#include "server/ps_client.h"

namespace bytecomp::server {

BC_LOG_CATEGORY(LogServer, "server");
BC_LOG_CATEGORY(LogCoord, "coordinator");

using transport::Buffer;
using transport::Clock;
using transport::Incoming;
using transport::Message;

// ---------------------------------------------------------------------------
// Configuration

ServerConfig ServerConfig::load(const std::optional<std::string>& path) {
  using config::Range;
  config::Document doc = config::Document::locate(path, "server.yaml");
  config::Reader root = doc.root("BYTECOMP_SERVER");
  ServerConfig c;
  config::Reader s = root.section("server");
  std::string cluster_file = "cluster.yaml";
  s.require("node_id");
  s.get("node_id", c.node_id, Range<uint32_t>{0, 0xFFFFFFFEu})
      .get("cluster_file", cluster_file)
      .get("engine_threads", c.engine_threads, Range<uint32_t>{1, 256})
      .get_bytes("max_job_bytes", c.max_job_bytes, Range<uint64_t>{1ull << 20, 1ull << 42})
      .get_bytes("max_total_bytes", c.max_total_bytes, Range<uint64_t>{1ull << 20, 1ull << 44})
      .get("max_jobs", c.max_jobs, Range<uint32_t>{1, 100000});
  if (c.max_total_bytes < c.max_job_bytes)
    s.fail("max_total_bytes",
           std::to_string(c.max_total_bytes) + " is below max_job_bytes " +
               std::to_string(c.max_job_bytes),
           ">= server.max_job_bytes");
  std::filesystem::path cf(cluster_file);
  if (cf.is_relative() && !doc.is_defaults())
    cf = std::filesystem::path(doc.name()).parent_path() / cf;
  try {
    c.cluster = load_cluster_config(cf.string());
  } catch (const Error& e) {
    s.fail("cluster_file", e.what(), "a valid cluster config (configs/cluster.yaml)");
  }
  if (!c.cluster.server(c.node_id))
    s.fail("node_id",
           "server " + std::to_string(c.node_id) + " is not listed in " + cf.string(),
           "the id of one of cluster.servers");
  s.finish();
  config::Reader t = root.section("transport");
  bool listen_given = t.has("listen");
  c.transport = transport::read_transport_config(t);
  c.transport.node_id = c.node_id;
  if (!listen_given) c.transport.listen = {c.cluster.server(c.node_id)->address};
  c.metrics = MetricsConfig::read(root);
  config::apply_logging_section(root);
  root.finish();
  return c;
}

namespace {

// ---------------------------------------------------------------------------
// Engine threads: one FIFO of tasks each (a partition's tasks always run on
// its engine, in arrival order).

class EngineThread {
 public:
  explicit EngineThread(int index) : thread_([this] { run(); }) { (void)index; }
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

// Recycles a partition's fp32 blocks: the sum of round i becomes the pull
// answer (shared with the transport while being sent) and a spare block
// becomes the sum of round i+1, without a copy or a fresh allocation.
// Thread-safe (the transport releases blocks on its threads).
class BlockPool {
 public:
  explicit BlockPool(size_t floats) : floats_(floats) {}
  std::unique_ptr<float[]> get() {
    {
      std::lock_guard lk(mu_);
      if (!free_.empty()) {
        auto p = std::move(free_.back());
        free_.pop_back();
        return p;
      }
    }
    return std::unique_ptr<float[]>(new float[std::max<size_t>(floats_, 1)]);
  }
  void put(std::unique_ptr<float[]> p) {
    std::lock_guard lk(mu_);
    if (free_.size() < 2) free_.push_back(std::move(p));
  }
  size_t floats() const { return floats_; }

 private:
  size_t floats_;
  std::mutex mu_;
  std::vector<std::unique_ptr<float[]>> free_;
};

constexpr int64_t kNotFrozen = -1;

// A partition's round state. Touched only by its engine thread, except
// `frozen` (read by strategy prepare under Job::mu).
struct PartState {
  Partition part;
  std::string label;  // "tensor 'x' partition 3 (key 0x...)"
  uint64_t collecting = 0;
  uint64_t round_started_ns = 0;  // first push of `collecting` (server/metrics.h)
  TensorPlan plan;
  bool plan_ready = false;
  std::unique_ptr<compress::Compressor> comp;
  std::unique_ptr<compress::TensorState> state;
  std::shared_ptr<BlockPool> pool;
  std::unique_ptr<float[]> sum;
  bool sum_started = false;
  Buffer held;                   // first raw push, summed with the second
  std::vector<Buffer> pending;   // per rank (deterministic / compressed sum)
  std::vector<uint8_t> pushed;   // per rank
  uint32_t n_pushed = 0;
  uint32_t next_rank = 0;        // deterministic: ranks below are summed
  Buffer result;
  bool has_result = false;
  uint64_t result_iteration = 0;
  std::vector<Incoming> waiting;  // pulls of `collecting`
  std::atomic<int64_t> frozen{kNotFrozen};  // last iteration whose plan is fixed
  bool released = false;
  bool poisoned = false;
  std::string poison;
};

struct ServerJob {
  uint32_t uid = 0;
  std::string name;
  std::vector<NodeId> nodes;
  std::unordered_map<NodeId, uint32_t> rank;
  bool deterministic = false;
  uint64_t start_iteration = 0;
  std::vector<TensorSpec> tensors;
  Assignment assignment;
  std::unordered_map<uint64_t, std::unique_ptr<PartState>> parts;  // fixed after setup
  uint64_t reserved = 0;

  std::mutex mu;  // guards plans and end_*
  std::map<uint64_t, std::vector<TensorPlan>> plans;  // from iteration on
  std::atomic<bool> ended{false};
  ErrorCode end_code = ErrorCode::kOk;
  std::string end_reason;

  Status end_status() {
    std::lock_guard lk(mu);
    return Status(end_code, end_reason);
  }
};

std::string hex(uint64_t v) {
  char b[24];
  std::snprintf(b, sizeof b, "0x%llx", static_cast<unsigned long long>(v));
  return b;
}

uint64_t reservation(const TensorPlan& plan, uint64_t count, size_t nodes, bool deterministic) {
  uint64_t r = 4 * count * 4;  // sum + answer in flight + spare block + held first push
  if (plan.sum == SumMode::kCompressed || deterministic)
    r += nodes * push_bytes_bound(plan, count);
  if (plan.pull != PullFormat::kFp32) r += 2 * pull_bytes_bound(plan, count);
  if (plan.compressed_push() && plan.sum == SumMode::kDense) r += count * 4;  // EF state
  return r;
}

}  // namespace

// ---------------------------------------------------------------------------

class Coordinator;

struct ParameterServer::Impl {
  ServerConfig cfg;
  std::unique_ptr<transport::Transport> tp;
  std::vector<std::unique_ptr<EngineThread>> engines;
  std::unique_ptr<Coordinator> coord;
  bool is_coordinator = false;

  std::shared_mutex jobs_mu;
  std::unordered_map<uint32_t, std::shared_ptr<ServerJob>> jobs;
  // Why the last jobs ended (uid, code, reason; bounded): a node's push or
  // pull that arrives just after the end learns the cause, not only that
  // the job is unknown.
  struct Ended {
    uint32_t uid;
    ErrorCode code;
    std::string reason;
  };
  std::deque<Ended> ended;
  static constexpr size_t kEndedKept = 64;
  uint64_t reserved_total = 0;  // under jobs_mu

  std::atomic<uint64_t> rounds{0}, pushes_refused{0}, frames_refused{0};
  ServerMetrics metrics;
  std::string metrics_text();  // server/metrics.h

  // Registration with the coordinator (non-coordinator servers).
  std::mutex hello_mu;
  std::condition_variable hello_cv;
  bool hello_needed = true;
  bool stopping = false;
  std::thread hello_thread;
  std::once_flag shutdown_once;

  explicit Impl(ServerConfig c);
  void start();
  void shutdown();
  void hello_loop();

  void reply(const Incoming& in, Message m) {
    try {
      tp->reply(in, std::move(m), nullptr);
    } catch (const Error& e) {
      BC_LOG(LogServer(), kWarn) << "reply to node " << in.from << " failed: " << e.what();
    }
  }
  void refuse(const Incoming& in, ErrorCode code, const std::string& why) {
    pushes_refused.fetch_add(1, std::memory_order_relaxed);
    BC_LOG(LogServer(), kDebug) << "refused from node " << in.from << ": " << why;
    if (in.expects_reply) reply(in, proto::error_reply(code, why));
  }

  // Job lifecycle (also called by the coordinator for itself).
  Status setup_job(const proto::Admission& a);
  void end_job(uint32_t uid, ErrorCode code, const std::string& reason);
  Status prepare_strategy(uint32_t uid, uint64_t iteration, const std::string& yaml, bool cancel);
  void end_all_jobs(ErrorCode code, const std::string& reason);

  // Data path.
  void on_data(Incoming in);
  void on_push(const std::shared_ptr<ServerJob>& job, PartState& ps, const Incoming& in);
  void on_pull(const std::shared_ptr<ServerJob>& job, PartState& ps, Incoming in);
  void fix_plan(ServerJob& job, PartState& ps);
  void accumulate(ServerJob& job, PartState& ps, const Buffer& b);
  void complete_round(ServerJob& job, PartState& ps);
  void release_part(PartState& ps, const Status& why);
  compress::CompressContext ctx(const ServerJob& job, const PartState& ps) const {
    compress::CompressContext c;
    c.iteration = ps.collecting;
    c.shared_seed = strategy::partition_seed(job.name, ps.part.key);
    c.private_seed = strategy::server_private_seed(cfg.node_id, ps.part.key);
    return c;
  }

  void on_control(Incoming in);
  void on_stats(const Incoming& in);
  // Aborts a job cluster-wide (through the coordinator).
  void request_abort(uint32_t uid, const std::string& reason);
};

// ---------------------------------------------------------------------------
// Coordinator

class Coordinator {
 public:
  explicit Coordinator(ParameterServer::Impl& srv)
      : srv_(srv), auto_([&srv](NodeId n, Message m) { srv.tp->send(n, std::move(m), nullptr); }) {
    ServerInfo self{srv.cfg.node_id, srv.tp->local_addresses().at(0), srv.cfg.engine_threads};
    servers_[self.id] = self;
    timer_ = std::thread([this] { timer_loop(); });
  }
  ~Coordinator() { stop(); }
  // Answers every waiting registration and aborts every running job (so
  // nodes hear about it at once, not after their heartbeat timeout).
  void stop() {
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

  void on_message(Incoming in);
  void on_peer_lost(NodeId id, const Status& s);
  void abort_running(uint32_t uid, const std::string& reason);
  void reply_all_unavailable(std::vector<Incoming>& ins, const std::string& why);

 private:
  struct Reg {
    Incoming in;
    JobSpec spec;
  };
  struct Pending {
    std::string name;
    uint32_t uid = 0;
    JobSpec ref;
    NodeId ref_node = 0;
    std::map<uint32_t, Reg> regs;  // by rank
    Clock::time_point deadline;
    bool setting_up = false;
    std::string failed;  // set while setting up: fail when setup returns
  };
  struct Running {
    proto::Admission adm;
    std::set<NodeId> left;
    std::map<uint64_t, std::vector<Incoming>> barriers;
    std::vector<TensorPlan> plans;
    std::string yaml;
    uint64_t last_change = 0;
    bool changing = false;
  };

  void on_register(Incoming in);
  void on_hello(Incoming in);
  void on_barrier(Incoming in);
  void on_set_strategy(Incoming in);
  void on_auto(Incoming in);
  void on_leave(Incoming in);
  void timer_loop();
  // Both called with mu_ held; they take what they must answer out of the
  // tables, and the caller answers after unlocking.
  std::vector<Incoming> take_pending(const std::string& name);
  void try_admit_locked(Pending& p, std::vector<std::function<void()>>& after);
  void admit(proto::Admission adm, std::string name);
  void barrier_check_locked(Running& r, std::vector<Incoming>& done);
  std::string missing_locked(const Pending& p) const;
  std::string node_name(NodeId id) const { return srv_.cfg.cluster.describe_node(id); }

  ParameterServer::Impl& srv_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::thread timer_;
  std::map<NodeId, ServerInfo> servers_;  // registered
  uint32_t next_uid_ = 1;
  std::map<std::string, Pending> pending_;
  std::map<uint32_t, Running> running_;
  AutoPlanner auto_;  // after srv_: its SendFn uses the transport
};

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

// Sends `m` as a request to every server (itself handled by `local`).
void to_servers(ParameterServer::Impl& srv, const std::vector<NodeId>& servers, const Message& m,
                std::function<Status()> local,
                std::function<void(const Status&, const std::vector<NodeId>&)> done) {
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
    srv.tp->request(s, m, srv.cfg.cluster.setup_timeout, [g, s](transport::Response r) {
      Status st = r.status.ok() ? proto::reply_status(r.response) : r.status;
      if (!st.ok()) st = Status(st.code(), "server " + std::to_string(s) + ": " + st.message());
      g->finish(s, st);
    });
  }
}

std::string describe_tensor(const TensorSpec& t) {
  return "'" + t.name + "' " + std::to_string(t.count) + " x " +
         std::string(compress::to_string(t.dtype));
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
  switch (in.message.header.type) {
    case proto::kRegister: return on_register(std::move(in));
    case proto::kServerHello: return on_hello(std::move(in));
    case proto::kBarrier: return on_barrier(std::move(in));
    case proto::kSetStrategy: return on_set_strategy(std::move(in));
    case proto::kLeave: return on_leave(std::move(in));
    case proto::kAutoProfile:
    case proto::kAutoReplan: return on_auto(std::move(in));
    case proto::kAbortRequest:
      if (srv_.cfg.cluster.server(in.from))
        abort_running(in.message.header.aux, proto::joined(in.message));
      return;
    default: break;
  }
}

void Coordinator::on_hello(Incoming in) {
  ServerInfo info;
  try {
    info = proto::decode_server_info(proto::joined(in.message));
  } catch (const Error& e) {
    srv_.frames_refused.fetch_add(1);
    return srv_.reply(in, proto::error_reply(e.code(), e.what()));
  }
  if (info.id != in.from || !srv_.cfg.cluster.server(info.id))
    return srv_.reply(in, proto::error_reply(ErrorCode::kInvalidArgument,
                                             "node " + std::to_string(in.from) +
                                                 " is not a server of the cluster config"));
  std::vector<std::function<void()>> after;
  {
    std::lock_guard lk(mu_);
    servers_[info.id] = info;
    for (auto& [name, p] : pending_) try_admit_locked(p, after);
  }
  BC_LOG(LogCoord(), kInfo) << "server " << info.id << " registered (" << info.address << ", "
                            << info.engine_threads << " engine threads)";
  srv_.reply(in, proto::ok_reply());
  for (auto& f : after) f();
}

void Coordinator::on_register(Incoming in) {
  JobSpec spec;
  try {
    const std::string bytes = proto::joined(in.message);
    proto::Reader r(bytes, "register");
    spec = proto::read_spec(r);
    r.end();
  } catch (const Error& e) {
    srv_.frames_refused.fetch_add(1);
    return srv_.reply(in, proto::error_reply(e.code(), e.what()));
  }
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
  for (const auto& [rank, reg] : p.regs) adm.peer_addresses.push_back(reg.spec.peer_address);
  p.setting_up = true;
  std::string name = p.name;
  after.push_back([this, adm = std::move(adm), name]() mutable { admit(std::move(adm), name); });
}

void Coordinator::admit(proto::Admission adm, std::string name) {
  // The coordinator computes the assignment like everybody else.
  std::string problem;
  try {
    std::vector<TensorPlan> plans = plan_job(adm.tensors, adm.strategy_yaml);
    adm.digest = assign_partitions(adm.tensors, plans, adm.servers, adm.partition_bytes).digest;
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
    Message end;
    end.header.type = proto::kJobEnd;
    end.header.aux = uid;
    end.payloads.push_back(Buffer::copy_of(why));
    for (NodeId s : undo) {
      if (s == srv_.cfg.node_id) srv_.end_job(uid, ErrorCode::kAborted, why);
      else srv_.tp->request(s, end, srv_.cfg.cluster.setup_timeout, [](transport::Response) {});
    }
  };
  if (!problem.empty()) return fail(problem, {}, adm.uid);

  std::vector<NodeId> servers;
  for (const ServerInfo& s : adm.servers) servers.push_back(s.id);
  Message setup;
  setup.header.type = proto::kJobSetup;
  setup.header.aux = adm.uid;
  setup.payloads.push_back(proto::encode(adm));
  to_servers(
      srv_, servers, setup, [this, adm] { return srv_.setup_job(adm); },
      [this, adm, name, fail](const Status& st, const std::vector<NodeId>& ok) {
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
            r.yaml = adm.strategy_yaml;
            r.plans = plan_job(adm.tensors, adm.strategy_yaml);
            r.last_change = adm.start_iteration;
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

void Coordinator::on_barrier(Incoming in) {
  std::vector<Incoming> done;
  {
    std::lock_guard lk(mu_);
    auto it = running_.find(in.message.header.aux);
    if (it == running_.end() ||
        std::find(it->second.adm.nodes.begin(), it->second.adm.nodes.end(), in.from) ==
            it->second.adm.nodes.end())
      return srv_.reply(in, proto::error_reply(ErrorCode::kInvalidArgument,
                                               "barrier: unknown job uid " +
                                                   std::to_string(in.message.header.aux) +
                                                   " for " + node_name(in.from)));
    it->second.barriers[in.message.header.arg].push_back(std::move(in));
    barrier_check_locked(it->second, done);
  }
  for (Incoming& d : done) srv_.reply(d, proto::ok_reply());
}

void Coordinator::on_leave(Incoming in) {
  uint32_t uid = in.message.header.aux;
  if (in.message.header.flags & proto::kLeaveAbort) {
    std::string reason = node_name(in.from) + " aborted the job: " + proto::joined(in.message);
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
    Message end;
    end.header.type = proto::kJobEnd;
    end.header.aux = uid;
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

void Coordinator::on_set_strategy(Incoming in) {
  uint32_t uid = in.message.header.aux;
  uint64_t iteration = in.message.header.arg;
  std::string yaml = proto::joined(in.message);
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
    if (iteration <= r.last_change)
      return refuse("job '" + r.adm.name + "': iteration " + std::to_string(iteration) +
                    " is not after the last change (iteration " + std::to_string(r.last_change) +
                    ")");
    r.changing = true;
    adm = r.adm;
    current = r.plans;
  }
  auto unmark = [this, uid] {
    std::lock_guard lk(mu_);
    auto it = running_.find(uid);
    if (it != running_.end()) it->second.changing = false;
  };
  std::vector<TensorPlan> plans;
  try {
    plans = plan_job(adm.tensors, yaml);
    for (size_t t = 0; t < plans.size(); ++t)
      if (plans[t].placement != current[t].placement)
        throw Error(ErrorCode::kInvalidArgument,
                    "tensor '" + adm.tensors[t].name + "' would move from " +
                        std::string(to_string(current[t].placement)) + " to " +
                        std::string(to_string(plans[t].placement)) +
                        " (a placement change needs a new job)");
  } catch (const Error& e) {
    unmark();
    return refuse("job '" + adm.name + "': " + e.what());
  }
  std::vector<NodeId> servers;
  for (const ServerInfo& s : adm.servers) servers.push_back(s.id);
  Message prep;
  prep.header.type = proto::kStrategyPrepare;
  prep.header.aux = uid;
  prep.header.arg = iteration;
  prep.payloads.push_back(Buffer::copy_of(yaml));
  to_servers(
      srv_, servers, prep,
      [this, uid, iteration, yaml] { return srv_.prepare_strategy(uid, iteration, yaml, false); },
      [this, in, uid, iteration, yaml, plans, adm, servers](const Status& st,
                                                            const std::vector<NodeId>& ok) {
        if (!st.ok()) {
          Message cancel;
          cancel.header.type = proto::kStrategyPrepare;
          cancel.header.flags = 1;
          cancel.header.aux = uid;
          cancel.header.arg = iteration;
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
            it->second.last_change = iteration;
            it->second.plans = plans;
            it->second.yaml = yaml;
            left = it->second.left;
          }
        }
        BC_LOG(LogCoord(), kInfo) << "job '" << adm.name << "': strategy changes at iteration "
                                  << iteration;
        Message upd;
        upd.header.type = proto::kStrategyUpdate;
        upd.header.aux = uid;
        upd.header.arg = iteration;
        upd.payloads.push_back(Buffer::copy_of(yaml));
        for (NodeId n : adm.nodes)
          if (!left.count(n)) srv_.tp->send(n, upd, nullptr);
        srv_.reply(in, proto::ok_reply());
      });
}

void Coordinator::on_auto(Incoming in) {
  const auto& h = in.message.header;
  AutoPlanner::JobView view;
  {
    std::lock_guard lk(mu_);
    auto it = running_.find(h.aux);
    if (it == running_.end())
      return srv_.reply(in, proto::error_reply(ErrorCode::kInvalidArgument,
                                               "auto planning: unknown job uid " +
                                                   std::to_string(h.aux)));
    const proto::Admission& a = it->second.adm;
    view.uid = a.uid;
    view.name = a.name;
    view.nodes = a.nodes;
    view.servers = static_cast<uint32_t>(a.servers.size());
    view.partition_bytes = a.partition_bytes;
  }
  Status st;
  if (h.type == proto::kAutoProfile) {
    if (in.message.payloads.size() != 2)
      st = Status(ErrorCode::kMalformed, "auto profile: expected 2 payloads (profile, auto spec), got " +
                                             std::to_string(in.message.payloads.size()));
    else
      st = auto_.on_profile(view, in.from, h.arg, in.message.payloads[0].view(),
                            in.message.payloads[1].view());
  } else {
    st = auto_.on_replan(view, in.from, h.arg, proto::joined(in.message));
  }
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
  Message ab;
  ab.header.type = proto::kJobAborted;
  ab.header.aux = uid;
  ab.payloads.push_back(Buffer::copy_of(reason));
  for (NodeId n : adm.nodes)
    if (!left.count(n) && srv_.tp->peer_state(n) != transport::PeerState::kLost)
      srv_.tp->send(n, ab, nullptr);
  Message end;
  end.header.type = proto::kJobEnd;
  end.header.aux = uid;
  end.payloads.push_back(Buffer::copy_of(reason));
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

// ---------------------------------------------------------------------------
// ParameterServer::Impl

ParameterServer::Impl::Impl(ServerConfig c) : cfg(std::move(c)) {
  tp = transport::make_transport(cfg.transport);
  for (uint32_t i = 0; i < cfg.engine_threads; ++i)
    engines.push_back(std::make_unique<EngineThread>(static_cast<int>(i)));
  is_coordinator = cfg.node_id == cfg.cluster.coordinator;
  if (is_coordinator) coord = std::make_unique<Coordinator>(*this);
}

void ParameterServer::Impl::start() {
  tp->set_handler(proto::kPush, [this](Incoming in) { on_data(std::move(in)); });
  tp->set_handler(proto::kPull, [this](Incoming in) { on_data(std::move(in)); });
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
  std::unique_lock lk(hello_mu);
  while (!stopping) {
    if (!hello_needed) {
      hello_cv.wait(lk);
      continue;
    }
    lk.unlock();
    Message m;
    m.header.type = proto::kServerHello;
    m.payloads.push_back(
        proto::encode(ServerInfo{cfg.node_id, tp->local_addresses().at(0), cfg.engine_threads}));
    transport::Response r = tp->call(cfg.cluster.coordinator, std::move(m), Millis{2000});
    Status st = r.status.ok() ? proto::reply_status(r.response) : r.status;
    lk.lock();
    if (st.ok()) {
      hello_needed = false;
      BC_LOG(LogServer(), kInfo) << "registered with coordinator " << cfg.cluster.coordinator;
    } else {
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
  job->tensors = a.tensors;
  std::vector<TensorPlan> plans = plan_job(a.tensors, a.strategy_yaml);
  job->assignment = assign_partitions(a.tensors, plans, a.servers, a.partition_bytes);
  if (job->assignment.digest != a.digest)
    return Status(ErrorCode::kInternal, "assignment digest differs from the coordinator's");
  job->plans[a.start_iteration] = plans;
  for (const Partition& p : job->assignment.partitions) {
    if (p.server != cfg.node_id) continue;
    job->reserved += reservation(plans[p.tensor], p.count, a.nodes.size(), a.deterministic);
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
  size_t n = a.nodes.size();
  for (const Partition& p : job->assignment.partitions) {
    if (p.server != cfg.node_id) continue;
    auto ps = std::make_unique<PartState>();
    ps->part = p;
    ps->label = "job '" + a.name + "' tensor '" + a.tensors[p.tensor].name + "' partition " +
                std::to_string(p.index) + " (key " + hex(p.key) + ")";
    ps->collecting = a.start_iteration;
    ps->pool = std::make_shared<BlockPool>(p.count);
    ps->sum = ps->pool->get();
    ps->pending.resize(n);
    ps->pushed.assign(n, 0);
    job->parts.emplace(p.key, std::move(ps));
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
  BC_LOG(LogServer(), kInfo) << (reason.empty() ? "job ended: " : "job aborted: ")
                             << job->name << " (uid " << uid << ")"
                             << (reason.empty() ? "" : ": " + reason);
  // Each partition is released by its own engine, after what is queued.
  for (auto& [key, ps] : job->parts) {
    PartState* p = ps.get();
    engines[p->part.engine % engines.size()]->post([this, job, p, why] { release_part(*p, why); });
  }
}

void ParameterServer::Impl::release_part(PartState& ps, const Status& why) {
  if (ps.released) return;
  ps.released = true;
  if (why.code() != ErrorCode::kOk && (ps.n_pushed > 0 || !ps.waiting.empty())) {
    std::string ranks, pulls;
    for (size_t r = 0; r < ps.pushed.size(); ++r)
      if (ps.pushed[r]) ranks += (ranks.empty() ? "" : ",") + std::to_string(r);
    for (const Incoming& in : ps.waiting)
      pulls += (pulls.empty() ? "" : ",") + std::to_string(in.from);
    BC_LOG(LogServer(), kDebug) << ps.label << " released unfinished: collecting iteration "
                                << ps.collecting << ", pushes from ranks {" << ranks
                                << "}, pulls waiting from nodes {" << pulls << "}";
  }
  for (Incoming& in : ps.waiting) reply(in, proto::error_reply(why.code(), why.message()));
  ps.waiting.clear();
  ps.waiting.shrink_to_fit();
  ps.pending.clear();
  ps.held = Buffer();
  ps.result = Buffer();
  ps.sum.reset();
  ps.state.reset();
  ps.comp.reset();
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
    std::lock_guard lk(job->mu);
    job->plans.erase(iteration);
    return Status::Ok();
  }
  std::vector<TensorPlan> plans = plan_job(job->tensors, yaml);
  uint64_t need = 0;
  for (auto& [key, ps] : job->parts)
    need += reservation(plans[ps->part.tensor], ps->part.count, job->nodes.size(), job->deterministic);
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
  std::lock_guard lk(job->mu);
  for (auto& [key, ps] : job->parts) {
    int64_t f = ps->frozen.load();
    if (f != kNotFrozen && static_cast<uint64_t>(f) >= iteration)
      return Status(ErrorCode::kInvalidArgument,
                    "server " + std::to_string(cfg.node_id) + ": " + ps->label +
                        " already started iteration " + std::to_string(f) +
                        " (request changes at least one iteration ahead)");
  }
  job->plans[iteration] = std::move(plans);
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
      case proto::kJobSetup: st = setup_job(proto::decode_admission(proto::joined(in.message))); break;
      case proto::kJobEnd: {
        std::string reason = proto::joined(in.message);
        end_job(h.aux, reason.empty() ? ErrorCode::kUnavailable : ErrorCode::kAborted, reason);
        break;
      }
      case proto::kStrategyPrepare:
        st = prepare_strategy(h.aux, h.arg, proto::joined(in.message), h.flags == 1);
        break;
      default: break;
    }
  } catch (const Error& e) {
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
  const char* what = h.type == proto::kPush ? "push" : "pull";
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
  auto pit = job->parts.find(h.key);
  if (pit == job->parts.end()) {
    uint64_t t = h.key >> 32, i = h.key & 0xFFFFFFFFu;
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
  PartState* ps = pit->second.get();
  EngineThread& e = *engines[ps->part.engine % engines.size()];
  if (h.type == proto::kPush)
    e.post([this, job, ps, in = std::move(in)] { on_push(job, *ps, in); });
  else
    e.post([this, job, ps, in = std::move(in)]() mutable { on_pull(job, *ps, std::move(in)); });
}

void ParameterServer::Impl::fix_plan(ServerJob& job, PartState& ps) {
  TensorPlan plan;
  {
    std::lock_guard lk(job.mu);
    auto it = job.plans.upper_bound(ps.collecting);
    --it;  // plans always holds start_iteration <= collecting
    plan = it->second[ps.part.tensor];
    ps.frozen.store(static_cast<int64_t>(ps.collecting));
  }
  if (ps.plan_ready && plan == ps.plan) return;
  ps.plan = std::move(plan);
  ps.plan_ready = true;
  if (ps.plan.compressed_push()) {
    ps.comp = compress::make_compressor(ps.plan.spec());
    ps.state = ps.comp->make_state(ps.part.count);
  } else {
    ps.comp.reset();
    ps.state.reset();
  }
}

void ParameterServer::Impl::on_push(const std::shared_ptr<ServerJob>& job, PartState& ps,
                                    const Incoming& in) {
  if (job->ended.load() || ps.released) {
    Status s = job->end_status();
    return refuse(in, s.code(), "push refused: " + s.message());
  }
  const uint64_t it = in.message.header.arg;
  const uint32_t rank = job->rank.at(in.from);
  const std::string who = "node " + std::to_string(in.from) + " (rank " + std::to_string(rank) + ")";
  if (it < ps.collecting)
    return refuse(in, ErrorCode::kInvalidArgument,
                  "push refused: stale iteration " + std::to_string(it) + " from " + who + ": " +
                      ps.label + " is collecting iteration " + std::to_string(ps.collecting));
  if (it > ps.collecting)
    return refuse(in, ErrorCode::kInvalidArgument,
                  "push refused: future iteration " + std::to_string(it) + " from " + who + ": " +
                      ps.label + " is collecting iteration " + std::to_string(ps.collecting));
  if (ps.pushed[rank])
    return refuse(in, ErrorCode::kInvalidArgument,
                  "push refused: duplicate push from " + who + " for iteration " +
                      std::to_string(it) + " of " + ps.label);
  if (in.message.payloads.size() != 1)
    return refuse(in, ErrorCode::kInvalidArgument,
                  "push refused: " + std::to_string(in.message.payloads.size()) +
                      " payload buffers for " + ps.label + " (accepted: exactly 1)");
  if (ps.n_pushed == 0) {
    fix_plan(*job, ps);
    ps.round_started_ns = ServerMetrics::now_ns();
  }
  const Buffer& b = in.message.payloads[0];
  if (!ps.plan.compressed_push()) {
    if (b.size() != ps.part.count * 4)
      return refuse(in, ErrorCode::kInvalidArgument,
                    "push refused: wrong length " + std::to_string(b.size()) + " bytes from " +
                        who + " for " + ps.label + " (expected " +
                        std::to_string(ps.part.count * 4) + " = " +
                        std::to_string(ps.part.count) + " fp32)");
  } else {
    compress::WireInfo info;
    try {
      info = compress::inspect(b.span());
    } catch (const Error& e) {
      return refuse(in, ErrorCode::kMalformed,
                    "push refused: malformed compressed buffer from " + who + " for " + ps.label +
                        ": " + e.what());
    }
    if (info.algorithm != ps.plan.spec().name)
      return refuse(in, ErrorCode::kInvalidArgument,
                    "push refused: buffer from " + who + " is compressed with '" + info.algorithm +
                        "' but " + ps.label + " expects '" + ps.plan.spec().name + "'");
    if (info.count != ps.part.count || info.total_bytes != b.size())
      return refuse(in, ErrorCode::kInvalidArgument,
                    "push refused: wrong length from " + who + " for " + ps.label + ": buffer of " +
                        std::to_string(b.size()) + " bytes holds " + std::to_string(info.count) +
                        " elements (expected " + std::to_string(ps.part.count) + ")");
  }
  const bool store = ps.plan.sum == SumMode::kCompressed || job->deterministic;
  if (!store) {
    try {
      accumulate(*job, ps, b);
    } catch (const Error& e) {
      return refuse(in, ErrorCode::kMalformed,
                    "push refused: cannot decode buffer from " + who + " for " + ps.label + ": " +
                        e.what());
    }
  }
  ps.pushed[rank] = 1;
  ++ps.n_pushed;
  metrics.pushed(b.size());
  if (store) {
    ps.pending[rank] = b;
    if (ps.plan.sum == SumMode::kDense) {
      while (ps.next_rank < ps.pending.size() && !ps.pending[ps.next_rank].empty()) {
        if (!ps.poisoned) {
          try {
            accumulate(*job, ps, ps.pending[ps.next_rank]);
          } catch (const Error& e) {
            ps.poisoned = true;
            ps.poison = "cannot decode the push of rank " + std::to_string(ps.next_rank) + ": " +
                        e.what();
          }
        }
        ps.pending[ps.next_rank] = Buffer();
        ++ps.next_rank;
      }
    }
  }
  reply(in, proto::ok_reply());
  if (ps.n_pushed == ps.pushed.size()) complete_round(*job, ps);
}

void ParameterServer::Impl::accumulate(ServerJob& job, PartState& ps, const Buffer& b) {
  const size_t n = ps.part.count;
  if (ps.comp) {
    ps.comp->decompress(b.span(), compress::TensorView::cpu(ps.sum.get(), n), ps.sum_started,
                        ctx(job, ps));
  } else {
    const float* src = reinterpret_cast<const float*>(b.data());
    std::vector<float> aligned;
    if (reinterpret_cast<uintptr_t>(src) % alignof(float) != 0) {
      aligned.resize(n);
      std::memcpy(aligned.data(), b.data(), n * 4);
      src = aligned.data();
    }
    if (!ps.sum_started) {
      if (aligned.empty()) {
        // Keep the first push as it arrived and sum it with the second in
        // one pass (compress::sum writes dst without reading it): one fewer
        // pass over the partition than copy-then-add, same additions in the
        // same order.
        ps.held = b;
        ps.sum_started = true;
        return;
      }
      std::memcpy(ps.sum.get(), src, n * 4);
    } else if (!ps.held.empty()) {
      const float* srcs[2] = {reinterpret_cast<const float*>(ps.held.data()), src};
      compress::sum(ps.sum.get(), srcs, n);
      ps.held = Buffer();
    } else {
      compress::sum_into(ps.sum.get(), src, n);
    }
  }
  ps.sum_started = true;
}

void ParameterServer::Impl::complete_round(ServerJob& job, PartState& ps) {
  const size_t n = ps.part.count;
  Buffer result;
  std::string failure;
  try {
    if (ps.poisoned) throw Error(ErrorCode::kMalformed, ps.poison);
    if (!ps.held.empty()) {  // a one-node job: the push is the sum
      std::memcpy(ps.sum.get(), ps.held.data(), n * 4);
      ps.held = Buffer();
    }
    if (ps.plan.sum == SumMode::kCompressed) {
      std::vector<std::span<const std::byte>> inputs;
      for (const Buffer& b : ps.pending) inputs.push_back(b.span());
      Buffer out = Buffer::allocate(ps.comp->max_compressed_bytes(n));
      size_t len = ps.comp->aggregate(inputs, {out.mutable_data(), out.size()}, ctx(job, ps));
      result = out.slice(0, len);
    } else {
      if (strategy::answer_is_raw_sum(ps.plan.pull)) {
        // The block's owner rides in the release function's capture, so
        // it returns to the pool when the last copy of that function goes
        // (however many copies Buffer::wrap makes of it).
        std::shared_ptr<BlockPool> pool = ps.pool;
        std::shared_ptr<float[]> block(ps.sum.release(), [pool](float* p) {
          pool->put(std::unique_ptr<float[]>(p));
        });
        const float* raw = block.get();
        result = Buffer::wrap(raw, n * 4, [block] {});
        ps.sum = ps.pool->get();
      } else {
        Buffer out = Buffer::allocate(pull_bytes_bound(ps.plan, n));
        size_t len = strategy::encode_answer(ps.plan.pull, ps.sum.get(), n,
                                             {out.mutable_data(), out.size()}, ps.comp.get(),
                                             ps.state.get(), ctx(job, ps));
        result = out.slice(0, len);
      }
    }
  } catch (const Error& e) {
    failure = ps.label + ", iteration " + std::to_string(ps.collecting) + ": " + e.what();
  }
  for (Buffer& b : ps.pending) b = Buffer();
  ps.held = Buffer();
  std::fill(ps.pushed.begin(), ps.pushed.end(), 0);
  ps.n_pushed = 0;
  ps.next_rank = 0;
  ps.sum_started = false;
  ps.poisoned = false;
  if (!failure.empty()) {
    // A round that cannot be summed cannot be repeated: the job fails.
    BC_LOG(LogServer(), kError) << failure;
    request_abort(job.uid, failure);
    for (Incoming& in : ps.waiting) reply(in, proto::error_reply(ErrorCode::kAborted, failure));
    ps.waiting.clear();
    ++ps.collecting;
    return;
  }
  ps.result = std::move(result);
  ps.has_result = true;
  ps.result_iteration = ps.collecting;
  ++ps.collecting;
  rounds.fetch_add(1, std::memory_order_relaxed);
  metrics.round_done(ps.round_started_ns);
  for (Incoming& in : ps.waiting) {
    metrics.answered(ps.result.size());
    reply(in, proto::ok_reply(ps.result));
  }
  ps.waiting.clear();
}

void ParameterServer::Impl::on_pull(const std::shared_ptr<ServerJob>& job, PartState& ps,
                                    Incoming in) {
  if (job->ended.load() || ps.released) {
    Status s = job->end_status();
    return refuse(in, s.code(), "pull refused: " + s.message());
  }
  const uint64_t it = in.message.header.arg;
  if (ps.has_result && it == ps.result_iteration) {
    metrics.answered(ps.result.size());
    return reply(in, proto::ok_reply(ps.result));
  }
  if (it == ps.collecting) {
    for (const Incoming& w : ps.waiting)
      if (w.from == in.from)
        return refuse(in, ErrorCode::kInvalidArgument,
                      "pull refused: duplicate pull from node " + std::to_string(in.from) +
                          " for iteration " + std::to_string(it) + " of " + ps.label +
                          " (one is already waiting)");
    ps.waiting.push_back(std::move(in));
    return;
  }
  if (it < ps.collecting)
    return refuse(in, ErrorCode::kInvalidArgument,
                  "pull refused: stale iteration " + std::to_string(it) + " of " + ps.label +
                      ": its result is gone (" +
                      (ps.has_result ? "holding iteration " + std::to_string(ps.result_iteration)
                                     : std::string("no result yet")) +
                      ", collecting " + std::to_string(ps.collecting) + ")");
  return refuse(in, ErrorCode::kInvalidArgument,
                "pull refused: future iteration " + std::to_string(it) + " of " + ps.label +
                    ": collecting iteration " + std::to_string(ps.collecting));
}

// ---------------------------------------------------------------------------

void ParameterServer::Impl::request_abort(uint32_t uid, const std::string& reason) {
  if (coord) {
    coord->abort_running(uid, reason);
    return;
  }
  end_job(uid, ErrorCode::kAborted, reason);
  Message m;
  m.header.type = proto::kAbortRequest;
  m.header.aux = uid;
  m.payloads.push_back(Buffer::copy_of(reason));
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
