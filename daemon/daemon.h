// bytecompd's control plane: the Unix control socket, jobs and their
// lifecycle, signals. One thread (run()) owns every connection and job; each
// running job has an Engine thread for its data path, and all engines share
// one ThreadPool for reductions.
//
// Job lifecycle: the first HELLO of (user, job id) creates the job; each
// local rank declares its tensors and sends START; when all local_size ranks
// started with identical declarations, the daemon creates the shared-memory
// segment and the engine and answers READY to all. A client that disconnects
// without BYE (it died), a protocol violation, a setup timeout or daemon
// shutdown aborts the job: the abort is published in shared memory (waking
// every client at once), ABORT is sent on each socket, and the segment is
// removed. When every rank has left with BYE the job ends quietly.
//
// Operators (bytecompctl) talk to the same socket with CTL_REQUEST messages
// on a connection that never says HELLO: one request per connection, answered
// from run()'s thread (daemon/ctl.h renders the answers and the metrics).
// `servers` asks every parameter server for its metrics through the PS
// client: that runs on a task of its own (bounded by a timeout per server)
// whose end wakes run(), which then answers; the connection waits meanwhile.
// While draining, a HELLO for a new job is refused; running and forming jobs
// go on.
//
// Thread-safety: construct, run() and destroy from one thread. Engines call
// back (on_failure) from their threads: that only sets a flag and writes the
// eventfd that run() polls.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "client/ipc/protocol.h"
#include "common/error.h"
#include "common/service.h"
#include "common/thread_pool.h"
#include "daemon/config.h"
#include "daemon/ctl.h"
#include "daemon/peer_allgather.h"
#include "planner/strategy/strategy.h"
#include "server/ps_client.h"

namespace bytecomp::daemon {

class Daemon {
 public:
  // `config_path` is remembered for SIGHUP reloads (nullopt: lookup order).
  // Binds the control socket and removes stale segments; throws Error.
  Daemon(DaemonConfig config, std::optional<std::string> config_path);
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // Serves until SIGTERM/SIGINT arrives on `signal_fd` (a signalfd for
  // SIGTERM, SIGINT and SIGHUP). Returns the exit status.
  int run(int signal_fd);

  const std::string& instance() const { return instance_; }

 private:
  struct Conn;
  struct Job;

  void accept_one();
  // Moves every job's heartbeat in its shared memory (run() thread).
  void beat();
  void on_readable(Conn& c);
  void on_message(Conn& c, std::span<const uint8_t> bytes);
  void disconnect(Conn& c, const std::string& why);
  void reject(Conn& c, ErrorCode code, const std::string& message);
  void maybe_start(Job& j);
  void abort_job(Job& j, ErrorCode code, std::string reason);
  void finish_job(Job& j);
  void reap_failed_jobs();
  void check_setup_deadlines();
  // Re-reads the configuration; (applied, what happened). Logs either way.
  std::pair<bool, std::string> reload();
  void sweep_closed();
  // bytecompctl (daemon/ctl.h).
  void on_ctl(Conn& c, const ipc::CtlRequest& req);
  void reply_ctl(Conn& c, ErrorCode code, const std::string& text);
  void ask_servers(Conn& c);
  void answer_pending_ctl();
  DaemonView view(bool all_users, uid_t uid);
  JobView job_view(Job& j, bool with_tensors);
  void sample(Job& j);
  void write_metrics();
  // Loads config_.strategy_file (nullptr when none); throws Error.
  std::shared_ptr<const strategy::Strategy> load_strategy() const;

  DaemonConfig config_;
  std::optional<std::string> config_path_;
  std::string instance_;
  Tunables tunables_;
  std::shared_ptr<const strategy::Strategy> strategy_;
  std::string strategy_text_;  // the file's text, sent to the coordinator
  std::unique_ptr<server::PsClient> ps_client_;  // null: single-node only
  std::unique_ptr<PeerHub> peer_hub_;  // null: no internode.peer_listen
  std::vector<server::ServerInfo> servers_;  // the cluster's (multi-node)
  server::NodeId coordinator_ = 0;
  std::chrono::milliseconds admission_timeout_{30000};
  std::chrono::milliseconds request_timeout_{30000};
  ThreadPool pool_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;
  uint64_t next_job_seq_ = 0;
  std::map<int, std::unique_ptr<Conn>> conns_;           // by fd
  std::map<std::string, std::unique_ptr<Job>> jobs_;     // by "uid/job id"
  ServiceNotifier notifier_;
  DaemonCounters counters_;
  bool draining_ = false;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  std::chrono::system_clock::time_point started_wall_ = std::chrono::system_clock::now();
  std::chrono::steady_clock::time_point next_metrics_{};
  uint64_t next_conn_id_ = 0;
  // Operator requests answered by a task (ask_servers), by connection id;
  // declared after ps_client_ so they end (each bounded) before it does.
  struct PendingCtl {
    uint64_t conn_id;
    std::future<std::string> answer;
  };
  std::vector<PendingCtl> pending_ctl_;
};

}  // namespace bytecomp::daemon
