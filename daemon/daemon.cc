#include "daemon/daemon.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include "bytecomp_build_config.h"
#include "client/ipc/protocol.h"
#include "client/ipc/shm_layout.h"
#include "common/log.h"
#include "daemon/auto_tuner.h"
#include "common/prometheus.h"
#include "daemon/counting_compressor.h"
#include "daemon/engine.h"
#include "daemon/shm_segment.h"

namespace bytecomp::daemon {

BC_LOG_CATEGORY(LogDaemon, "daemon");

using Clock = std::chrono::steady_clock;

struct Daemon::Conn {
  uint64_t id = 0;  // unique for the daemon's life (fds are reused)
  int fd = -1;
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  enum class State { kNew, kJoined, kStarted, kRunning } state = State::kNew;
  Job* job = nullptr;
  uint32_t rank = 0;
  bool bye = false;
  bool closed = false;  // to be swept
  Clock::time_point accepted_at = Clock::now();
  std::vector<ipc::Declare> decls;
  uint64_t declared_bytes = 0;
  std::optional<ipc::StrategyMsg> strategy;  // bytecomp_set_strategy
  bool ctl = false;  // an operator's connection (CTL_REQUEST)
  std::string who() const {
    return "local rank " + std::to_string(rank) + " (pid " + std::to_string(pid) + ")";
  }
};

struct Daemon::Job {
  std::string key;
  std::string id;
  uid_t uid = 0;
  gid_t gid = 0;
  uint32_t local_size = 0;
  uint32_t node_rank = 0;
  uint32_t num_nodes = 0;
  std::vector<Conn*> members;  // by local rank
  std::vector<ipc::Declare> reference;
  // The job's own strategy (every local rank passed the same text), null:
  // the daemon's default; reference_rank is the rank that started first.
  std::optional<ipc::StrategyMsg> strategy;
  std::shared_ptr<const planner::Strategy> own_strategy;
  uint32_t reference_rank = 0;
  uint32_t started = 0;
  Clock::time_point setup_deadline;
  // Shared with the transport's zero-copy pushes, which keep it mapped
  // (not named) until they are sent.
  std::shared_ptr<Segment> segment;
  std::vector<TensorSpec> specs;
  std::unique_ptr<Engine> engine;
  // mode: auto multi-node jobs (after engine: destroyed first).
  std::shared_ptr<AutoTuner> tuner;
  // Set by the engine thread; read by run().
  std::mutex fail_mu;
  bool failed = false;
  ErrorCode fail_code = ErrorCode::kOk;
  std::string fail_reason;
  // What bytecompctl and the metrics show (daemon/ctl.h).
  Clock::time_point created = Clock::now();
  ipc::Layout layout;
  std::shared_ptr<JobByteCounters> bytes = std::make_shared<JobByteCounters>();
  std::shared_ptr<const planner::Strategy> active_strategy;  // null: uncompressed
  std::string strategy_mode = "none";
  std::string strategy_source;
  uint64_t pushpulls = 0;
  int64_t last_iteration = -1;
  bool aborted = false;
};

namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Bound on what one connection's declarations may cost the daemon.
constexpr uint64_t kMaxDeclaredBytes = 64ull << 20;

void send_msg(int fd, const std::vector<uint8_t>& m) {
  // Never block the control thread on a slow client.
  (void)::send(fd, m.data(), m.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

// Operator replies may span several datagrams; the control thread waits a
// bounded time for a slow reader rather than dropping parts of the answer.
bool send_all(int fd, const std::vector<std::vector<uint8_t>>& msgs,
              std::chrono::milliseconds budget) {
  const auto deadline = Clock::now() + budget;
  for (const auto& m : msgs) {
    for (;;) {
      if (::send(fd, m.data(), m.size(), MSG_NOSIGNAL | MSG_DONTWAIT) >= 0) break;
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return false;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) return false;
      pollfd p{fd, POLLOUT, 0};
      (void)::poll(&p, 1, static_cast<int>(left.count()));
    }
  }
  return true;
}

// <run_dir>/<job>: the job id made safe as one path component.
std::string run_dir_for(const DaemonConfig& c, const std::string& job) {
  std::string base = c.run_dir;
  if (base.empty()) base = std::filesystem::path(c.socket_path).parent_path().string() + "/runs";
  std::string name;
  for (char ch : job)
    name += (std::isalnum(static_cast<unsigned char>(ch)) || ch == '-' || ch == '_' || ch == '.')
                ? ch : '_';
  if (name.empty() || name == "." || name == "..") name = "job";
  return base + "/" + name;
}

std::string describe(const ipc::Declare& d) {
  return "'" + d.name + "' " + ipc::dtype_name(d.dtype) + "[" + std::to_string(d.count) + "]";
}

}  // namespace

Daemon::Daemon(DaemonConfig config, std::optional<std::string> config_path)
    : config_(std::move(config)),
      config_path_(std::move(config_path)),
      instance_(config_.instance.empty() ? instance_from_socket(config_.socket_path)
                                         : config_.instance),
      pool_(static_cast<size_t>(config_.threads)) {
  tunables_.apply(config_);
  strategy_ = load_strategy();
  if (strategy_) strategy_text_ = read_text(config_.strategy_file);
  if (!config_.cluster_file.empty()) {
    server::ClusterConfig cluster = server::load_cluster_config(config_.cluster_file);
    transport::TransportConfig tc = cluster.transport;
    tc.node_id = config_.node_id;
    tc.listen = {};
    admission_timeout_ = cluster.admission_timeout;
    servers_ = cluster.servers;
    coordinator_ = cluster.coordinator;
    request_timeout_ = cluster.request_timeout;
    ps_client_ = server::PsClient::create(cluster, tc);
    if (!config_.peer_listen.empty()) {
      transport::TransportConfig pc = cluster.transport;
      pc.node_id = config_.node_id;
      pc.listen = {config_.peer_listen};
      try {
        peer_hub_ = std::make_unique<PeerHub>(pc);
      } catch (const Error& e) {
        throw Error(ErrorCode::kConfig,
                    "internode.peer_listen '" + config_.peer_listen + "': " + e.what());
      }
    }
    BC_LOG(LogDaemon(), kInfo) << "inter-node: node " << config_.node_id << " of cluster "
                               << config_.cluster_file;
  }
  const int stale = remove_stale(instance_);
  if (stale > 0) {
    BC_LOG(LogDaemon(), kInfo) << "removed " << stale << " stale shared-memory segment(s)";
  }

  std::error_code ec;
  const std::filesystem::path dir = std::filesystem::path(config_.socket_path).parent_path();
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    throw Error(ErrorCode::kUnavailable,
                "cannot create socket directory " + dir.string() + ": " + ec.message());
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, config_.socket_path.data(), config_.socket_path.size());
  listen_fd_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listen_fd_ < 0) throw Error(ErrorCode::kUnavailable, std::string("socket: ") + strerror(errno));
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    if (errno != EADDRINUSE) {
      const int err = errno;
      ::close(listen_fd_);
      throw Error(ErrorCode::kUnavailable,
                  "cannot bind " + config_.socket_path + ": " + std::strerror(err));
    }
    // A live daemon answers a connect; a stale socket file does not.
    const int probe = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    const bool live =
        probe >= 0 && ::connect(probe, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    if (probe >= 0) ::close(probe);
    if (live) {
      ::close(listen_fd_);
      throw Error(ErrorCode::kUnavailable, "another bytecompd is serving " + config_.socket_path +
                                               " (stop it, or configure control.socket)");
    }
    ::unlink(config_.socket_path.c_str());
    if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      const int err = errno;
      ::close(listen_fd_);
      throw Error(ErrorCode::kUnavailable,
                  "cannot bind " + config_.socket_path + ": " + std::strerror(err));
    }
  }
  ::chmod(config_.socket_path.c_str(), config_.socket_mode);
  if (::listen(listen_fd_, 128) != 0) {
    const int err = errno;
    ::close(listen_fd_);
    throw Error(ErrorCode::kUnavailable, std::string("listen: ") + std::strerror(err));
  }
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  BC_LOG(LogDaemon(), kInfo) << "bytecompd " << BYTECOMP_VERSION << " serving "
                             << config_.socket_path << " (instance " << instance_ << ", "
                             << pool_.concurrency() << " reduce threads)";
}

Daemon::~Daemon() {
  for (auto& p : pending_ctl_) p.answer.wait();  // each bounded by its timeouts
  for (auto& [key, job] : jobs_) {
    if (job->tuner) job->tuner->stop();
    if (job->engine) job->engine->stop();
  }
  jobs_.clear();
  for (auto& [fd, c] : conns_) ::close(fd);
  conns_.clear();
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    ::unlink(config_.socket_path.c_str());
  }
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

int Daemon::run(int signal_fd) {
  notifier_.ready();
  for (;;) {
    notifier_.tick();
    if (!config_.metrics_textfile_dir.empty() && Clock::now() >= next_metrics_) write_metrics();
    std::vector<pollfd> fds;
    fds.push_back({signal_fd, POLLIN, 0});
    fds.push_back({wake_fd_, POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    for (auto& [fd, c] : conns_) fds.push_back({fd, POLLIN, 0});
    // The timeout serves the setup deadlines, the watchdog and the metrics.
    const int r = ::poll(fds.data(), fds.size(),
                         static_cast<int>(notifier_.poll_timeout(std::chrono::milliseconds(250)).count()));
    if (r < 0 && errno != EINTR) {
      BC_LOG(LogDaemon(), kError) << "poll: " << std::strerror(errno);
      return 1;
    }
    if (r > 0 && (fds[0].revents & POLLIN)) {
      signalfd_siginfo si{};
      if (::read(signal_fd, &si, sizeof si) == sizeof si) {
        if (si.ssi_signo == SIGHUP) {
          (void)reload();
        } else {
          notifier_.stopping();
          BC_LOG(LogDaemon(), kInfo) << "signal " << si.ssi_signo << ": shutting down, aborting "
                                     << jobs_.size() << " job(s)";
          while (!jobs_.empty()) {
            abort_job(*jobs_.begin()->second, ErrorCode::kAborted,
                      "bytecompd is shutting down (signal " + std::to_string(si.ssi_signo) + ")");
          }
          return 0;
        }
      }
    }
    if (r > 0 && (fds[1].revents & POLLIN)) {
      uint64_t v;
      (void)::read(wake_fd_, &v, sizeof v);
    }
    reap_failed_jobs();
    answer_pending_ctl();
    if (r > 0 && (fds[2].revents & POLLIN)) accept_one();
    for (size_t i = 3; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      auto it = conns_.find(fds[i].fd);
      if (it != conns_.end() && !it->second->closed) on_readable(*it->second);
    }
    check_setup_deadlines();
    sweep_closed();
  }
}

void Daemon::accept_one() {
  for (;;) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;
    auto c = std::make_unique<Conn>();
    c->id = ++next_conn_id_;
    c->fd = fd;
    ucred cred{};
    socklen_t len = sizeof cred;
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      ::close(fd);
      continue;
    }
    c->pid = cred.pid;
    c->uid = cred.uid;
    c->gid = cred.gid;
    Conn& ref = *c;
    conns_.emplace(fd, std::move(c));
    const uid_t me = ::geteuid();
    if (!config_.allow_other_users && me != 0 && cred.uid != me && cred.uid != 0) {
      reject(ref, ErrorCode::kInvalidArgument,
             "user " + std::to_string(cred.uid) + " may not use this bytecompd (it runs as user " +
                 std::to_string(me) + "; set control.allow_other_users or run it as root)");
    }
  }
}

void Daemon::reject(Conn& c, ErrorCode code, const std::string& message) {
  BC_LOG(LogDaemon(), kWarn) << "pid " << c.pid << ": " << message;
  ++counters_.rejects[std::string(to_string(code))];
  send_msg(c.fd, ipc::encode(ipc::ErrorMsg{static_cast<uint32_t>(code), message}));
  disconnect(c, message);
}

void Daemon::on_readable(Conn& c) {
  std::vector<uint8_t> buf(ipc::kMaxMessageBytes + 1);
  // A bounded number per turn, so one chatty client cannot starve the rest.
  for (int turn = 0; turn < 256; ++turn) {
    const ssize_t n = ::recv(c.fd, buf.data(), buf.size(), MSG_DONTWAIT | MSG_TRUNC);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      disconnect(c, n == 0 ? "connection closed" : std::string("recv: ") + std::strerror(errno));
      return;
    }
    if (static_cast<size_t>(n) > ipc::kMaxMessageBytes) {
      reject(c, ErrorCode::kMalformed,
             "malformed control message: datagram of " + std::to_string(n) +
                 " bytes exceeds the limit of " + std::to_string(ipc::kMaxMessageBytes));
      return;
    }
    on_message(c, std::span<const uint8_t>(buf.data(), static_cast<size_t>(n)));
    if (c.closed) return;
  }
}

void Daemon::on_message(Conn& c, std::span<const uint8_t> bytes) {
  ipc::Decoded d;
  try {
    d = ipc::decode(bytes);
  } catch (const ipc::VersionMismatch& e) {
    reject(c, ErrorCode::kMalformed,
           std::string("client speaks ") + e.what() +
               ": install a libbytecomp and bytecompd of the same release");
    return;
  } catch (const Error& e) {
    reject(c, ErrorCode::kMalformed, e.what());
    return;
  }
  using S = Conn::State;
  switch (d.type) {
    case ipc::MsgType::kHello: {
      if (c.state != S::kNew) return reject(c, ErrorCode::kMalformed, "HELLO sent twice");
      const auto& h = std::get<ipc::Hello>(d.msg);
      const std::string key = std::to_string(c.uid) + "/" + h.job_id;
      auto it = jobs_.find(key);
      if (it == jobs_.end() && draining_) {
        return reject(c, ErrorCode::kUnavailable,
                      "bytecompd is draining (bytecompctl drain): it accepts no new jobs, job '" +
                          h.job_id + "' was refused; " + std::to_string(jobs_.size()) +
                          " job(s) already admitted go on");
      }
      if (it == jobs_.end()) {
        auto j = std::make_unique<Job>();
        j->key = key;
        j->id = h.job_id;
        j->uid = c.uid;
        j->gid = c.gid;
        j->local_size = h.local_size;
        j->node_rank = h.node_rank;
        j->num_nodes = h.num_nodes;
        j->members.assign(h.local_size, nullptr);
        j->setup_deadline =
            Clock::now() + std::chrono::milliseconds(tunables_.setup_timeout_ms.load());
        it = jobs_.emplace(key, std::move(j)).first;
        BC_LOG(LogDaemon(), kInfo) << "job " << h.job_id << " (uid " << c.uid << ") forming: "
                                   << h.local_size << " local rank(s)";
      }
      Job& j = *it->second;
      if (j.engine) {
        return reject(c, ErrorCode::kInvalidArgument,
                      "job '" + h.job_id + "' is already running; use a new job id or wait "
                      "until it ends");
      }
      if (j.local_size != h.local_size || j.num_nodes != h.num_nodes ||
          j.node_rank != h.node_rank) {
        return reject(c, ErrorCode::kInvalidArgument,
                      "job '" + h.job_id + "' was created with local_size " +
                          std::to_string(j.local_size) + ", node " + std::to_string(j.node_rank) +
                          " of " + std::to_string(j.num_nodes) + "; this client says local_size " +
                          std::to_string(h.local_size) + ", node " + std::to_string(h.node_rank) +
                          " of " + std::to_string(h.num_nodes) + " (all local ranks must agree)");
      }
      if (j.members[h.local_rank] != nullptr) {
        return reject(c, ErrorCode::kInvalidArgument,
                      "local rank " + std::to_string(h.local_rank) + " of job '" + h.job_id +
                          "' is already connected (pid " +
                          std::to_string(j.members[h.local_rank]->pid) +
                          "); every process needs its own local_rank");
      }
      j.members[h.local_rank] = &c;
      c.job = &j;
      c.rank = h.local_rank;
      c.state = S::kJoined;
      send_msg(c.fd, ipc::encode(ipc::Welcome{BYTECOMP_VERSION, instance_}));
      return;
    }
    case ipc::MsgType::kDeclare: {
      if (c.state != S::kJoined) {
        return reject(c, ErrorCode::kMalformed, "DECLARE outside the declaration phase");
      }
      auto& m = std::get<ipc::Declare>(d.msg);
      if (m.index != c.decls.size()) {
        return reject(c, ErrorCode::kMalformed,
                      "DECLARE index " + std::to_string(m.index) + ", expected " +
                          std::to_string(c.decls.size()));
      }
      if (m.device != ipc::Device::kCpu) {
        return reject(c, ErrorCode::kInvalidArgument,
                      "tensor '" + m.name + "': GPU tensors are not supported by this bytecompd");
      }
      c.declared_bytes += m.name.size() + sizeof(ipc::Declare);
      if (c.declared_bytes > kMaxDeclaredBytes) {
        return reject(c, ErrorCode::kResourceExhausted,
                      "declarations exceed " + std::to_string(kMaxDeclaredBytes >> 20) +
                          " MiB of names and metadata");
      }
      c.decls.push_back(std::move(m));
      return;
    }
    case ipc::MsgType::kStrategy: {
      if (c.state != S::kJoined) {
        return reject(c, ErrorCode::kMalformed, "STRATEGY outside the declaration phase");
      }
      if (c.strategy) return reject(c, ErrorCode::kMalformed, "STRATEGY sent twice");
      c.strategy = std::move(std::get<ipc::StrategyMsg>(d.msg));
      return;
    }
    case ipc::MsgType::kStart: {
      if (c.state != S::kJoined) return reject(c, ErrorCode::kMalformed, "START sent twice or before HELLO");
      const auto& m = std::get<ipc::Start>(d.msg);
      Job& j = *c.job;
      if (m.num_tensors != c.decls.size()) {
        return reject(c, ErrorCode::kMalformed,
                      "START says " + std::to_string(m.num_tensors) + " tensors, " +
                          std::to_string(c.decls.size()) + " were declared");
      }
      if (j.reference.empty()) {
        j.reference = c.decls;
        j.strategy = c.strategy;
        j.reference_rank = c.rank;
      } else {
        auto describe_strategy = [](const std::optional<ipc::StrategyMsg>& s) {
          return s ? "the strategy '" + s->source + "' (" + std::to_string(s->text.size()) +
                         " bytes)"
                   : std::string("no strategy (the daemon's default)");
        };
        if (j.strategy.has_value() != c.strategy.has_value() ||
            (j.strategy && j.strategy->text != c.strategy->text)) {
          abort_job(j, ErrorCode::kInvalidArgument,
                    "local ranks disagree on the job's strategy: local rank " +
                        std::to_string(c.rank) + " set " + describe_strategy(c.strategy) +
                        ", local rank " + std::to_string(j.reference_rank) + " set " +
                        describe_strategy(j.strategy) +
                        " (every local rank must pass the same text to bytecomp_set_strategy)");
          return;
        }
        std::string diff;
        if (j.reference.size() != c.decls.size()) {
          diff = std::to_string(c.decls.size()) + " tensors declared, another rank declared " +
                 std::to_string(j.reference.size());
        } else {
          for (size_t i = 0; i < c.decls.size() && diff.empty(); ++i) {
            const auto& a = c.decls[i];
            const auto& b = j.reference[i];
            if (a.name != b.name || a.count != b.count || a.dtype != b.dtype) {
              diff = "tensor " + std::to_string(i) + " declared as " + describe(a) +
                     ", another rank declared " + describe(b);
            }
          }
        }
        if (!diff.empty()) {
          abort_job(j, ErrorCode::kInvalidArgument,
                    c.who() + " declared different tensors: " + diff +
                        " (every local rank must declare the same tensors in the same order)");
          return;
        }
      }
      c.state = S::kStarted;
      ++j.started;
      maybe_start(j);
      return;
    }
    case ipc::MsgType::kCollective: {
      if (c.state != S::kRunning || c.job == nullptr || !c.job->engine) {
        return reject(c, ErrorCode::kMalformed, "COLLECTIVE before the job started");
      }
      c.job->engine->submit_collective(c.rank, std::get<ipc::Collective>(d.msg));
      return;
    }
    case ipc::MsgType::kCtlRequest:
      return on_ctl(c, std::get<ipc::CtlRequest>(d.msg));
    case ipc::MsgType::kBye:
      if (c.state == S::kNew) return disconnect(c, "BYE before HELLO");
      c.bye = true;
      if (c.job != nullptr && c.job->engine) c.job->engine->rank_left(c.rank);
      return;
    default:
      return reject(c, ErrorCode::kMalformed, "clients may not send this message type");
  }
}

std::shared_ptr<const planner::Strategy> Daemon::load_strategy() const {
  if (config_.strategy_file.empty()) return nullptr;
  return std::make_shared<const planner::Strategy>(
      planner::Strategy::load_file(config_.strategy_file));
}


void Daemon::maybe_start(Job& j) {
  if (j.started != j.local_size) return;
  // mode: auto, from the job's own text or the daemon's configuration.
  std::optional<strategy::AutoSpec> auto_spec;
  if (j.strategy) {
    try {
      auto_spec = strategy::AutoSpec::parse_job_text(j.strategy->text, j.strategy->source);
      if (!auto_spec)
        j.own_strategy = std::make_shared<const planner::Strategy>(
            planner::Strategy::parse(j.strategy->text, j.strategy->source));
    } catch (const Error& e) {
      abort_job(j, ErrorCode::kInvalidArgument,
                "cannot start the job: the job's strategy '" + j.strategy->source +
                    "' is invalid: " + e.what());
      return;
    }
  }
  if (!j.strategy && config_.strategy_mode == "auto") auto_spec = config_.auto_spec;
  if (auto_spec && j.num_nodes <= 1) {
    BC_LOG(LogDaemon(), kInfo) << "job " << j.id << ": strategy auto on one node: every tensor "
                               << "stays uncompressed (nothing crosses a network)";
  }
  const bool auto_job = auto_spec && j.num_nodes > 1;
  // The job's own strategy overrides the daemon's default for this job only;
  // an auto job starts uncompressed (its warm-up is the profile).
  const std::shared_ptr<const planner::Strategy> strategy =
      auto_spec ? nullptr : j.own_strategy ? j.own_strategy : strategy_;
  const std::string strategy_source =
      j.own_strategy ? j.strategy->source : config_.strategy_file;
  const std::string strategy_text = j.own_strategy ? j.strategy->text : strategy_text_;
  Engine::JoinFn join;
  if (j.num_nodes > 1) {
    std::string problem;
    if (!ps_client_) {
      problem = "this bytecompd has no inter-node path configured (set internode.cluster_file, "
                "node_id and nodes in its configuration)";
    } else if (config_.nodes.size() < j.num_nodes) {
      problem = "internode.nodes lists " + std::to_string(config_.nodes.size()) + " daemons";
    } else if (config_.nodes[j.node_rank] != config_.node_id) {
      problem = "node rank " + std::to_string(j.node_rank) + " is daemon " +
                std::to_string(config_.nodes[j.node_rank]) + " in internode.nodes, but this is " +
                std::to_string(config_.node_id) + " (connect to the right node's daemon)";
    }
    server::JobSpec spec;
    spec.name = j.id;
    spec.nodes.assign(config_.nodes.begin(), config_.nodes.begin() + std::min<size_t>(
                                                                      config_.nodes.size(), j.num_nodes));
    for (const auto& d : j.reference) {
      if (d.dtype != ipc::DType::kFloat32 && problem.empty()) {
        problem = "tensor '" + d.name + "' is " + ipc::dtype_name(d.dtype) +
                  ": the parameter servers sum float32 only";
      }
      spec.tensors.push_back({d.name, d.count, compress::DType::kFloat32});
    }
    if (strategy) spec.strategy_yaml = strategy_text;
    if (problem.empty()) {
      try {
        for (const auto& plan : server::plan_job(spec.tensors, spec.strategy_yaml)) {
          if (plan.placement == strategy::Placement::kPeer && !peer_hub_) {
            problem = "a tensor's strategy uses inter: allgather between daemons, but this "
                      "bytecompd has no peer endpoint (set internode.peer_listen)";
            break;
          }
        }
      } catch (const Error& e) {
        problem = e.what();
      }
    }
    if (peer_hub_) spec.peer_address = peer_hub_->address();
    if (!problem.empty()) {
      abort_job(j, ErrorCode::kUnavailable,
                "job '" + j.id + "' spans " + std::to_string(j.num_nodes) + " nodes: " + problem);
      return;
    }
    server::PsClient* client = ps_client_.get();
    const auto timeout = admission_timeout_;
    join = [client, spec, timeout] { return client->join(spec, timeout); };
  }
  std::vector<uint64_t> sizes;
  std::vector<TensorSpec> specs;
  uint64_t total = 0;
  for (const auto& d : j.reference) {
    const uint64_t b = d.count * ipc::dtype_size(d.dtype);
    sizes.push_back(b);
    specs.push_back({d.name, d.count, d.dtype, b});
    j.specs.push_back(specs.back());
    total += b;
  }
  try {
    const ipc::Layout layout = ipc::Layout::compute(j.local_size, sizes);
    if (layout.total_bytes > config_.max_job_bytes) {
      throw Error(ErrorCode::kResourceExhausted,
                  "job needs " + std::to_string(layout.total_bytes) +
                      " bytes of shared memory (tensors of " + std::to_string(total) +
                      " bytes x " + std::to_string(j.local_size) +
                      " local ranks), more than shm.max_job_bytes " +
                      std::to_string(config_.max_job_bytes));
    }
    const std::string name = segment_prefix(instance_) + std::to_string(::getpid()) + "." +
                             std::to_string(next_job_seq_++);
    Job* jp = &j;
    const int wake = wake_fd_;
    // Multi-node jobs follow the coordinator's plans (ps_->timeline()).
    std::vector<TensorPlan> plans = counting_plans(
        strategy && !join ? make_plans(*strategy, strategy_source, specs)
                          : uncompressed_plans(specs.size()),
        j.bytes);
    j.layout = layout;
    j.active_strategy = strategy;
    j.strategy_mode = auto_spec ? (j.strategy ? "job-auto" : "auto")
                      : j.own_strategy ? "job" : strategy ? "daemon" : "none";
    j.strategy_source = strategy ? strategy_source : std::string();
    if (strategy && join) (void)make_plans(*strategy, strategy_source, specs);
    if (auto_job) {
      AutoTuner::Options to;
      to.job = j.id;
      to.spec = *auto_spec;
      for (const auto& d : j.reference) {
        to.names.push_back(d.name);
        to.elements.push_back(d.count);
      }
      to.local_ranks = j.local_size;
      to.pool_threads = static_cast<uint32_t>(pool_.concurrency());
      for (const Conn* m : j.members)
        if (m) to.pids.push_back(m->pid);
      to.run_dir = run_dir_for(config_, j.id);
      j.tuner = std::make_shared<AutoTuner>(std::move(to));
    }
    j.segment = std::make_shared<Segment>(name, layout.total_bytes, j.uid, j.gid);
    Engine::Options eo;
    eo.job = j.id;
    eo.segment = j.segment->data();
    eo.layout = layout;
    eo.tensors = std::move(specs);
    eo.plans = std::move(plans);
    eo.node_rank = j.node_rank;
    eo.on_failure = [jp, wake](ErrorCode code, const std::string& reason) {
      {
        std::lock_guard lock(jp->fail_mu);
        jp->failed = true;
        jp->fail_code = code;
        jp->fail_reason = reason;
      }
      const uint64_t one = 1;
      (void)::write(wake, &one, sizeof one);
    };
    eo.join = std::move(join);
    if (j.tuner) {
      std::weak_ptr<AutoTuner> weak = j.tuner;
      eo.on_joined = [weak](Engine& e, const std::shared_ptr<server::PsJob>& ps, uint64_t pb) {
        if (auto t = weak.lock()) t->attach(e, ps, pb);
      };
    }
    eo.peers = PeerOptions{peer_hub_.get(), request_timeout_};
    eo.keep_mapped = j.segment;
    // Multi-node paths compress with the coordinator's plans: counted inside.
    if (eo.join) eo.bytes = j.bytes;
    j.engine = std::make_unique<Engine>(std::move(eo), pool_, tunables_);
    for (Conn* m : j.members) {
      m->state = Conn::State::kRunning;
      send_msg(m->fd, ipc::encode(ipc::Ready{name, layout.total_bytes}));
    }
    ++counters_.jobs_started;
    BC_LOG(LogDaemon(), kInfo) << "job " << j.id << " running: " << j.reference.size()
                               << " tensors, segment " << name << " (" << layout.total_bytes
                               << " bytes)";
  } catch (const Error& e) {
    abort_job(j, e.code(), std::string("cannot start the job: ") + e.what());
  }
}

void Daemon::abort_job(Job& j, ErrorCode code, std::string reason) {
  if (j.engine) {
    // The first abort stands, on the socket as in shared memory: a client
    // that read an engine failure from shared memory and exited must not
    // make the others see "local rank 1 ... disconnected" instead of the
    // cause (the control thread may see that socket close before it reaps
    // the engine's failure).
    auto [first_code, first] = j.engine->publish_abort(code, reason);
    if (first != reason) {
      BC_LOG(LogDaemon(), kInfo) << "job " << j.id << ": " << reason << " (after the abort)";
      code = first_code;
      reason = std::move(first);
    }
    if (j.tuner) j.tuner->stop();
    j.engine->stop();
  }
  BC_LOG(LogDaemon(), kWarn) << "job " << j.id << " aborted: " << reason;
  j.aborted = true;
  ++counters_.aborts[std::string(to_string(code))];
  const auto msg = ipc::encode(ipc::ErrorMsg{static_cast<uint32_t>(code), reason},
                               j.engine ? ipc::MsgType::kAbort : ipc::MsgType::kError);
  for (Conn* m : j.members) {
    if (m == nullptr || m->closed) continue;
    send_msg(m->fd, msg);
    m->job = nullptr;
    disconnect(*m, "job aborted");
  }
  finish_job(j);
}

void Daemon::finish_job(Job& j) {
  for (Conn* m : j.members) {
    if (m != nullptr) m->job = nullptr;
  }
  // Every rank that left with BYE has its results: the counts are final.
  if (j.engine && j.segment) sample(j);
  counters_.pushpulls += j.pushpulls;
  counters_.compress_input_bytes += j.bytes->input_bytes.load();
  counters_.compress_output_bytes += j.bytes->output_bytes.load();
  if (j.engine && !j.aborted) ++counters_.jobs_finished;
  if (j.tuner) j.tuner->stop();
  j.tuner.reset();
  j.engine.reset();
  if (j.segment) j.segment->unlink();
  j.segment.reset();
  BC_LOG(LogDaemon(), kInfo) << "job " << j.id << " ended";
  jobs_.erase(j.key);
}

void Daemon::disconnect(Conn& c, const std::string& why) {
  if (c.closed) return;
  c.closed = true;
  ::shutdown(c.fd, SHUT_RDWR);
  // Input left unread at close resets the connection, and the client's
  // recv then reports ECONNRESET before our last message (a refusal's
  // reason, e.g. to a client that sent HELLO before we accepted it): read
  // it away. After the shutdown nothing more can arrive.
  char sink[512];
  while (::recv(c.fd, sink, sizeof sink, MSG_DONTWAIT) > 0) {
  }
  Job* j = c.job;
  c.job = nullptr;
  if (j == nullptr) return;
  j->members[c.rank] = nullptr;
  if (!c.bye) {
    abort_job(*j, c.state == Conn::State::kRunning ? ErrorCode::kPeerLost : ErrorCode::kAborted,
              c.who() + " of job '" + j->id + "' disconnected without closing (" + why +
                  "; did the process die?)" +
                  (j->engine ? "" : " before the job started"));
    return;
  }
  for (Conn* m : j->members) {
    if (m != nullptr) return;
  }
  finish_job(*j);
}

void Daemon::reap_failed_jobs() {
  std::vector<Job*> failed;
  for (auto& [k, j] : jobs_) {
    std::lock_guard lock(j->fail_mu);
    if (j->failed) failed.push_back(j.get());
  }
  for (Job* j : failed) {
    ErrorCode code;
    std::string reason;
    {
      std::lock_guard lock(j->fail_mu);
      code = j->fail_code;
      reason = j->fail_reason;
    }
    abort_job(*j, code, reason);
  }
}

void Daemon::check_setup_deadlines() {
  const auto now = Clock::now();
  // A connection that never says HELLO must not hold a descriptor forever.
  const auto hello_bound = std::chrono::milliseconds(tunables_.setup_timeout_ms.load());
  for (auto& [fd, c] : conns_) {
    // An operator's connection waits for its answer (ask_servers), not HELLO.
    if (!c->closed && c->state == Conn::State::kNew && !c->ctl &&
        now - c->accepted_at > hello_bound) {
      reject(*c, ErrorCode::kTimeout, "no HELLO within control.setup_timeout_ms");
    }
  }
  std::vector<Job*> late;
  for (auto& [k, j] : jobs_) {
    if (!j->engine && now > j->setup_deadline) late.push_back(j.get());
  }
  for (Job* j : late) {
    uint32_t joined = 0;
    for (Conn* m : j->members) joined += m != nullptr;
    abort_job(*j, ErrorCode::kTimeout,
              "job '" + j->id + "' did not start within control.setup_timeout_ms (" +
                  std::to_string(tunables_.setup_timeout_ms.load()) + " ms): " +
                  std::to_string(joined) + " of " + std::to_string(j->local_size) +
                  " local ranks connected, " + std::to_string(j->started) + " started");
  }
}

void Daemon::sweep_closed() {
  for (auto it = conns_.begin(); it != conns_.end();) {
    if (it->second->closed) {
      ::close(it->first);
      it = conns_.erase(it);
    } else {
      ++it;
    }
  }
}

std::pair<bool, std::string> Daemon::reload() {
  notifier_.reloading();
  // READY=1 again however the reload ends (systemd waits for it).
  struct ReadyAgain {
    ServiceNotifier& n;
    ~ReadyAgain() { n.ready(); }
  } ready_again{notifier_};
  try {
    // Everything is read and checked before anything is applied, so a bad
    // file leaves the daemon exactly as it was.
    DaemonConfig next = DaemonConfig::parse(config::Document::locate(config_path_, "daemon.yaml"));
    std::shared_ptr<const planner::Strategy> strategy;
    if (!next.strategy_file.empty()) {
      strategy = std::make_shared<const planner::Strategy>(
          planner::Strategy::load_file(next.strategy_file));
    }
    std::string kept;
    for (auto [changed, key] : {std::pair{next.socket_path != config_.socket_path, "control.socket"},
                                {next.instance != config_.instance, "shm.instance"},
                                {next.threads != config_.threads, "scheduler.threads"},
                                {next.socket_mode != config_.socket_mode, "control.socket_mode"},
                                {next.cluster_file != config_.cluster_file, "internode.cluster_file"},
                                {next.node_id != config_.node_id, "internode.node_id"},
                                {next.nodes != config_.nodes, "internode.nodes"},
                                {next.peer_listen != config_.peer_listen, "internode.peer_listen"}}) {
      if (changed) {
        BC_LOG(LogDaemon(), kWarn) << "SIGHUP: " << key
                                   << " changed, which needs a restart: keeping the running value";
        kept += std::string(kept.empty() ? "" : ", ") + key;
      }
    }
    config_.setup_timeout_ms = next.setup_timeout_ms;
    config_.partition_bytes = next.partition_bytes;
    config_.max_inflight_bytes = next.max_inflight_bytes;
    config_.phase_timestamps = next.phase_timestamps;
    config_.allow_other_users = next.allow_other_users;
    config_.max_job_bytes = next.max_job_bytes;
    config_.strategy_file = next.strategy_file;
    config_.strategy_mode = next.strategy_mode;
    config_.auto_spec = next.auto_spec;
    config_.run_dir = next.run_dir;
    config_.metrics_textfile_dir = next.metrics_textfile_dir;
    config_.metrics_interval_ms = next.metrics_interval_ms;
    config_.sources = next.sources;
    next_metrics_ = {};
    tunables_.apply(config_);
    strategy_ = strategy;
    strategy_text_ = strategy_ ? read_text(config_.strategy_file) : std::string();
    for (auto& [key, j] : jobs_) {
      // A job that brought its own strategy keeps it; an auto job keeps
      // choosing its own (the new mode applies to new jobs).
      if (!j->engine || j->own_strategy || j->tuner || j->strategy) continue;
      if (config_.strategy_mode == "auto") continue;
      if (j->num_nodes > 1) {
        // One node asks the coordinator, which announces the change to
        // every node and server for the same iteration.
        if (j->node_rank == 0) {
          try {
            if (strategy_) (void)make_plans(*strategy_, config_.strategy_file, j->specs);
            j->engine->request_strategy(strategy_text_);
            j->active_strategy = strategy_;
            j->strategy_mode = strategy_ ? "daemon" : "none";
            j->strategy_source = config_.strategy_file;
          } catch (const Error& e) {
            BC_LOG(LogDaemon(), kError) << "SIGHUP: job " << j->id << " keeps its strategy: "
                                        << e.what();
          }
        }
        continue;
      }
      try {
        j->engine->set_plans(counting_plans(
            strategy_ ? make_plans(*strategy_, config_.strategy_file, j->specs)
                      : uncompressed_plans(j->specs.size()),
            j->bytes));
        j->active_strategy = strategy_;
        j->strategy_mode = strategy_ ? "daemon" : "none";
        j->strategy_source = config_.strategy_file;
      } catch (const Error& e) {
        BC_LOG(LogDaemon(), kError) << "SIGHUP: job " << j->id << " keeps its strategy: "
                                    << e.what();
      }
    }
    std::ostringstream done;
    done << "reloaded (partition_bytes " << config_.partition_bytes
         << " for new jobs, max_inflight_bytes " << config_.max_inflight_bytes
         << ", setup_timeout_ms " << config_.setup_timeout_ms << ", strategy '"
         << config_.strategy_file << "', metrics '" << config_.metrics_textfile_dir
         << "', log levels)";
    if (!kept.empty()) done << "; needs a restart, not applied: " << kept;
    BC_LOG(LogDaemon(), kInfo) << "SIGHUP: " << done.str();
    ++counters_.reloads;
    return {true, done.str()};
  } catch (const Error& e) {
    BC_LOG(LogDaemon(), kError) << "SIGHUP: configuration not reloaded, keeping the old one: "
                                << e.what();
    ++counters_.reload_failures;
    return {false, std::string("configuration not reloaded, keeping the old one: ") + e.what()};
  }
}

// ------------------------------------------------------- operator requests

void Daemon::reply_ctl(Conn& c, ErrorCode code, const std::string& text) {
  if (text.size() > ipc::kMaxCtlReplyBytes) {
    return reply_ctl(c, ErrorCode::kResourceExhausted,
                     "the answer of " + std::to_string(text.size()) +
                         " bytes exceeds the limit of " + std::to_string(ipc::kMaxCtlReplyBytes));
  }
  if (!send_all(c.fd, ipc::encode_ctl_reply(static_cast<uint32_t>(code), text),
                std::chrono::milliseconds(2000))) {
    BC_LOG(LogDaemon(), kWarn) << "pid " << c.pid << ": bytecompctl did not read its answer";
  }
  disconnect(c, "control request answered");
}

void Daemon::on_ctl(Conn& c, const ipc::CtlRequest& req) {
  ++counters_.ctl_requests;
  if (c.state != Conn::State::kNew || c.ctl) {
    return reject(c, ErrorCode::kMalformed,
                  "CTL_REQUEST on a connection that already sent a request or joined a job");
  }
  c.ctl = true;
  if (req.ctl_version != ipc::kCtlVersion) {
    return reply_ctl(c, ErrorCode::kInvalidArgument,
                     "bytecompctl speaks operator protocol version " +
                         std::to_string(req.ctl_version) + ", this bytecompd " +
                         BYTECOMP_VERSION + " speaks " + std::to_string(ipc::kCtlVersion) +
                         ": use the bytecompctl of the daemon's release");
  }
  // Root and the daemon's own user see every job and may change the daemon;
  // other users see their own jobs.
  const bool privileged = c.uid == 0 || c.uid == ::geteuid();
  const std::string& cmd = req.command;
  auto deny = [&] {
    reply_ctl(c, ErrorCode::kInvalidArgument,
              "permission denied: '" + cmd + "' needs root or bytecompd's user (uid " +
                  std::to_string(::geteuid()) + "); you are uid " + std::to_string(c.uid));
  };
  if (cmd == "status") return reply_ctl(c, ErrorCode::kOk, status_json(view(privileged, c.uid)));
  if (cmd == "jobs") return reply_ctl(c, ErrorCode::kOk, jobs_json(view(privileged, c.uid)));
  if (cmd == "strategy") {
    for (auto& [key, j] : jobs_) {
      if (j->id == req.arg && (privileged || j->uid == c.uid)) {
        return reply_ctl(c, ErrorCode::kOk, strategy_json(job_view(*j, true)));
      }
    }
    return reply_ctl(c, ErrorCode::kInvalidArgument,
                     req.arg.empty() ? "strategy needs a job id (bytecompctl jobs lists them)"
                                     : "no job '" + req.arg +
                                           "' on this bytecompd (bytecompctl jobs lists them)");
  }
  if (cmd == "trace") {
    for (auto& [key, j] : jobs_) {
      if (j->id != req.arg || !(privileged || j->uid == c.uid)) continue;
      if (!j->engine) {
        return reply_ctl(c, ErrorCode::kUnavailable,
                         "job '" + req.arg + "' is still forming: no iteration to trace yet");
      }
      const std::vector<uint32_t> parts = j->engine->phase_partitions();
      if (parts.empty()) {
        return reply_ctl(c, ErrorCode::kUnavailable,
                         "job '" + req.arg + "' has no phase records: engine.phase_timestamps "
                         "was off when it started" +
                             std::string(j->num_nodes > 1
                                             ? ", or it has not joined its servers yet"
                                             : ""));
      }
      std::vector<std::string> names;
      for (const TensorSpec& t : j->specs) names.push_back(t.name);
      return reply_ctl(c, ErrorCode::kOk,
                       trace_json(j->id, names, parts, j->engine->phase_records(),
                                  monotonic_ns()));
    }
    return reply_ctl(c, ErrorCode::kInvalidArgument,
                     req.arg.empty() ? "trace needs a job id (bytecompctl jobs lists them)"
                                     : "no job '" + req.arg +
                                           "' on this bytecompd (bytecompctl jobs lists them)");
  }
  if (cmd == "servers") return ask_servers(c);
  if (cmd == "metrics") {
    if (!config_.metrics_textfile_dir.empty()) write_metrics();
    return reply_ctl(c, ErrorCode::kOk, metrics_text(view(privileged, c.uid)));
  }
  if (cmd == "reload") {
    if (!privileged) return deny();
    auto [ok, what] = reload();
    return reply_ctl(c, ok ? ErrorCode::kOk : ErrorCode::kConfig, what + "\n");
  }
  if (cmd == "drain") {
    if (!privileged) return deny();
    if (req.arg != "on" && req.arg != "off") {
      return reply_ctl(c, ErrorCode::kInvalidArgument,
                       "drain takes 'on' or 'off', got '" + req.arg + "'");
    }
    draining_ = req.arg == "on";
    BC_LOG(LogDaemon(), kInfo) << (draining_ ? "draining: no new jobs accepted, "
                                             : "drain ended: accepting new jobs, ")
                               << jobs_.size() << " job(s) admitted";
    notifier_.status(draining_ ? "draining" : "serving");
    return reply_ctl(c, ErrorCode::kOk, status_json(view(true, c.uid)));
  }
  reply_ctl(c, ErrorCode::kInvalidArgument,
            "unknown command '" + cmd +
                "' (accepted: status, jobs, strategy, trace, servers, metrics, reload, drain)");
}

void Daemon::ask_servers(Conn& c) {
  if (!ps_client_) {
    return reply_ctl(c, ErrorCode::kUnavailable,
                     "this bytecompd has no inter-node configuration (internode.cluster_file): "
                     "it knows no parameter servers");
  }
  // Short per server: the operator waits, and a dead server must not hold
  // the answer about the others for long.
  constexpr std::chrono::milliseconds kPerServer{2000};
  server::PsClient* client = ps_client_.get();
  const int wake = wake_fd_;
  pending_ctl_.push_back(
      {c.id, std::async(std::launch::async, [client, wake, servers = servers_,
                                             coordinator = coordinator_, kPerServer] {
         std::string out = "{\"servers\":[";
         for (size_t i = 0; i < servers.size(); ++i) {
           const server::ServerInfo& s = servers[i];
           std::string entry = "{\"id\":" + std::to_string(s.id) + ",\"address\":" +
                               json_string(s.address) + ",\"coordinator\":" +
                               (s.id == coordinator ? "true" : "false");
           try {
             entry += ",\"metrics\":" + json_string(client->metrics(s.id, kPerServer)) +
                      ",\"error\":null}";
           } catch (const std::exception& e) {
             entry += ",\"metrics\":null,\"error\":" + json_string(e.what()) + "}";
           }
           out += (i ? "," : "") + entry;
         }
         out += "]}\n";
         const uint64_t one = 1;
         (void)::write(wake, &one, sizeof one);
         return out;
       })});
}

void Daemon::answer_pending_ctl() {
  for (auto it = pending_ctl_.begin(); it != pending_ctl_.end();) {
    if (it->answer.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
      ++it;
      continue;
    }
    const std::string text = it->answer.get();
    const uint64_t id = it->conn_id;
    it = pending_ctl_.erase(it);
    // The operator may have gone meanwhile (then the answer is dropped).
    for (auto& [fd, conn] : conns_) {
      if (conn->id == id && !conn->closed) {
        reply_ctl(*conn, ErrorCode::kOk, text);
        break;
      }
    }
  }
}

void Daemon::sample(Job& j) {
  // Local rank 0's completion ring: its head counts every push_pull the
  // engine completed; the entry before it is the latest. The engine may be
  // overwriting that slot meanwhile (with one tensor the ring has one slot),
  // and then it writes a completion that is being published right now: the
  // iteration read is never older than the latest at the time of the head's
  // load, which is what the gauge claims. One aligned 8-byte load.
  auto* base = static_cast<char*>(j.segment->data());
  auto* clients = reinterpret_cast<ipc::ClientArea*>(base + j.layout.clients_offset);
  const auto& head = clients[0].complete.head.value;
  const uint64_t h = head.load(std::memory_order_acquire);
  j.pushpulls = h;
  const uint32_t cap = j.layout.ring_capacity;
  if (h == 0 || cap == 0) return;
  const auto* ring = reinterpret_cast<const ipc::RingEntry*>(base + j.layout.complete_ring_offset(0));
  auto& slot = const_cast<uint64_t&>(ring[(h - 1) & (cap - 1)].iteration);
  j.last_iteration = static_cast<int64_t>(std::atomic_ref<uint64_t>(slot).load(std::memory_order_relaxed));
}

JobView Daemon::job_view(Job& j, bool with_tensors) {
  JobView v;
  v.id = j.id;
  v.uid = j.uid;
  v.state = j.engine ? "running" : "forming";
  v.local_size = j.local_size;
  for (Conn* m : j.members) v.connected += m != nullptr;
  v.started = j.started;
  v.node_rank = j.node_rank;
  v.num_nodes = j.num_nodes;
  if (j.num_nodes > 1) {
    v.nodes.assign(config_.nodes.begin(),
                   config_.nodes.begin() + std::min<size_t>(config_.nodes.size(), j.num_nodes));
  }
  v.tensors = static_cast<uint32_t>(j.reference.size());
  for (const auto& d : j.reference) v.tensor_bytes += d.count * ipc::dtype_size(d.dtype);
  v.age_seconds = std::chrono::duration<double>(Clock::now() - j.created).count();
  v.strategy_mode = j.strategy_mode;
  v.strategy_source = j.strategy_source;
  if (j.engine) {
    v.strategy_switch_iteration = j.engine->plans_switch_iteration();
    if (j.segment) sample(j);
  }
  v.pushpulls = j.pushpulls;
  v.last_iteration = j.last_iteration;
  if (j.engine) {
    const Engine::Gauges g = j.engine->gauges();
    v.engine_gauges = true;
    v.queued_partitions = g.queued_partitions;
    v.inflight_bytes = g.inflight_bytes;
    v.waiting_tensors = g.waiting_tensors;
    // Empty with engine.phase_timestamps off, or before a multi-node job
    // joined its servers.
    if (!j.engine->phase_partitions().empty()) {
      v.phase_stats = j.engine->phase_stats();
      for (size_t i = 0; i < kSpanCount; ++i) {
        v.phase_seconds[std::string(span_name(i))] =
            static_cast<double>(v.phase_stats->sum_ns[i]) / 1e9;
      }
      v.last_iteration_seconds = last_iteration_seconds(j.engine->phase_records());
    }
  }
  // Single-node plans count through their wrappers, multi-node paths
  // through the engine (PathContext::bytes).
  v.compress_counted = j.engine != nullptr;
  v.compress_input_bytes = j.bytes->input_bytes.load();
  v.compress_output_bytes = j.bytes->output_bytes.load();
  std::shared_ptr<const planner::Strategy> in_force = j.active_strategy;
  if (j.tuner) {
    const AutoTuner::View t = j.tuner->view();
    v.auto_view = AutoView{t.state, t.epoch, t.predicted_us / 1e6, t.link_gbps,
                           t.link_latency_us, t.decisions, t.replans, t.last_message, t.run_dir};
    if (!t.strategy_yaml.empty()) {
      try {
        in_force = std::make_shared<const planner::Strategy>(
            planner::Strategy::parse(t.strategy_yaml, "auto decision"));
      } catch (const Error&) {
        // The coordinator checked it; a strategy that does not parse here
        // shows as uncompressed rather than failing the operator's request.
      }
    }
  }
  if (with_tensors) {
    const planner::Option none;
    for (const auto& d : j.reference) {
      const uint64_t bytes = d.count * ipc::dtype_size(d.dtype);
      const planner::Option& o = in_force ? in_force->resolve(d.name, bytes) : none;
      v.tensor_list.push_back({d.name, ipc::dtype_name(d.dtype), d.count, bytes, o.describe(),
                               o.compressor});
    }
  }
  return v;
}

DaemonView Daemon::view(bool all_users, uid_t uid) {
  DaemonView v;
  v.version = BYTECOMP_VERSION;
  v.pid = ::getpid();
  v.start_time = std::chrono::duration<double>(started_wall_.time_since_epoch()).count();
  v.uptime_seconds = std::chrono::duration<double>(Clock::now() - started_).count();
  v.config_sources = config_.sources;
  v.socket = config_.socket_path;
  v.instance = instance_;
  v.node_id = config_.node_id;
  v.multi_node = ps_client_ != nullptr;
  v.draining = draining_;
  v.watchdog_seconds = std::chrono::duration<double>(notifier_.interval()).count();
  if (!config_.metrics_textfile_dir.empty()) {
    v.metrics_file = config_.metrics_textfile_dir + "/bytecompd.prom";
  }
  v.metrics_interval_ms = config_.metrics_interval_ms;
  for (auto& [key, j] : jobs_) {
    if (all_users || j->uid == uid) v.jobs.push_back(job_view(*j, false));
  }
  v.counters = counters_;
  return v;
}

void Daemon::write_metrics() {
  next_metrics_ = Clock::now() + std::chrono::milliseconds(config_.metrics_interval_ms);
  const std::string path = config_.metrics_textfile_dir + "/bytecompd.prom";
  try {
    prom::write_atomically(path, metrics_text(view(true, 0)));
    ++counters_.metrics_writes;
  } catch (const Error& e) {
    // Once per interval at most: the next attempt is next_metrics_ away.
    BC_LOG(LogDaemon(), kWarn) << "metrics: " << e.what();
    ++counters_.metrics_write_failures;
  }
}

}  // namespace bytecomp::daemon
