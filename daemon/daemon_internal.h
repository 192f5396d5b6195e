// Internal to bytecompd's Daemon class, whose members are defined in three
// files by job: daemon.cc (the control socket and the client protocol),
// job_setup.cc (assembling, starting, ending and reloading jobs) and
// operator.cc (bytecompctl requests and metrics). Not installed.
//
// Thread-safety: like Daemon, everything here belongs to the control thread,
// except what Job says the engine thread sets.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "client/ipc/protocol.h"
#include "client/ipc/shm_layout.h"
#include "common/log.h"
#include "daemon/auto_tuner.h"
#include "daemon/counting_compressor.h"
#include "daemon/daemon.h"
#include "daemon/engine.h"
#include "daemon/shm_segment.h"
#include "planner/strategy/timeline.h"

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
  std::shared_ptr<const strategy::Strategy> own_strategy;
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
  // Multi-node: the job's handle with the servers once it joined (set on
  // the engine thread); reload() reads the strategy the job runs from it.
  std::mutex ps_mu;
  std::weak_ptr<server::PsJob> ps;
  // Set by the engine thread; read by run().
  std::mutex fail_mu;
  bool failed = false;
  ErrorCode fail_code = ErrorCode::kOk;
  std::string fail_reason;
  // What bytecompctl and the metrics show (daemon/ctl.h).
  Clock::time_point created = Clock::now();
  ipc::Layout layout;
  std::shared_ptr<JobByteCounters> bytes = std::make_shared<JobByteCounters>();
  std::shared_ptr<const strategy::Strategy> active_strategy;  // null: uncompressed
  std::string strategy_mode = "none";
  std::string strategy_source;
  uint64_t pushpulls = 0;
  int64_t last_iteration = -1;
  bool aborted = false;
};

// The whole file (a strategy file's text, for the coordinator).
std::string read_text(const std::string& path);
// One datagram to a client, never blocking the control thread.
void send_msg(int fd, const std::vector<uint8_t>& m);
// Operator replies may span several datagrams; waits at most `budget` for a
// slow reader rather than dropping parts of the answer.
bool send_all(int fd, const std::vector<std::vector<uint8_t>>& msgs,
              std::chrono::milliseconds budget);
// <run_dir>/<job>: the job id made safe as one path component.
std::string run_dir_for(const DaemonConfig& c, const std::string& job);

}  // namespace bytecomp::daemon
