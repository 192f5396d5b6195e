#include "daemon/daemon.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "bytecomp_build_config.h"
#include "common/prometheus.h"
#include "daemon/daemon_internal.h"

namespace bytecomp::daemon {

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}


void send_msg(int fd, const std::vector<uint8_t>& m) {
  // Never block the control thread on a slow client.
  (void)::send(fd, m.data(), m.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

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

namespace {

// Bound on what one connection's declarations may cost the daemon.
constexpr uint64_t kMaxDeclaredBytes = 64ull << 20;

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
    server::PsClientOptions po;
    po.local_shm = config_.local_shm;
    ps_client_ = server::PsClient::create(cluster, tc, po);
    if (!config_.peer_listen.empty()) {
      transport::TransportConfig pc = cluster.transport;
      pc.node_id = config_.node_id;
      pc.listen = {config_.peer_listen};
      try {
        peer_hub_ = std::make_unique<PeerHub>(pc, cluster.request_timeout);
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
    beat();
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
    // Parked broadcast data of jobs that never open here is refused in time.
    if (peer_hub_) peer_hub_->tick(std::chrono::steady_clock::now());
    sweep_closed();
  }
}

void Daemon::beat() {
  // Every job's clients watch this counter (client/ipc/shm_layout.h): it
  // moves as long as this loop runs, which the 250 ms poll bound keeps at
  // least 4 times a second (the same promise as the systemd watchdog's).
  for (auto& [key, job] : jobs_) {
    if (!job->segment || job->segment->size() < sizeof(ipc::SegmentHeader)) continue;
    static_cast<ipc::SegmentHeader*>(job->segment->data())
        ->heartbeat.fetch_add(1, std::memory_order_relaxed);
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

}  // namespace bytecomp::daemon
