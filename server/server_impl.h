// ParameterServer's inside, shared by ps_server.cc (the wiring: transport
// handlers, engine threads, job setup and end, the data path's routing) and
// coordinator.cc (which runs inside the coordinator server and calls the
// job lifecycle for itself). Not installed; nothing outside server/ includes
// it. The threading and lock order are in ps_server.h.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "server/coordinator.h"
#include "server/engine_thread.h"
#include "server/job.h"
#include "server/local_shm.h"
#include "server/metrics.h"
#include "server/protocol.h"
#include "server/ps_server.h"
#include "server/rounds.h"
#include "server/server_log.h"
#include "transport/transport.h"

namespace bytecomp::server {

// A job as one server holds it: its declaration, assignment, plans and the
// rounds of the partitions this server owns.
struct ServerJob {
  uint32_t uid = 0;
  std::string name;
  std::vector<NodeId> nodes;
  std::unordered_map<NodeId, uint32_t> rank;
  bool deterministic = false;
  uint64_t start_iteration = 0;
  std::vector<TensorSpec> tensors;  // the job's units: declared, then fused buckets
  JobUnits units;                   // its layout (server/fusion.h)
  Assignment assignment;
  std::unique_ptr<Timeline> plans;  // from iteration on; its own lock
  std::unordered_map<uint64_t, std::unique_ptr<PartitionRound>> parts;  // fixed after setup
  std::vector<const PartitionRound*> round_list;                      // the same, for rounds_admit_change
  // Broadcast state of the same partitions (same engine), fixed after setup.
  std::unordered_map<uint64_t, std::unique_ptr<BroadcastRound>> bcasts;
  uint64_t reserved = 0;

  std::mutex mu;  // guards end_*
  std::atomic<bool> ended{false};
  ErrorCode end_code = ErrorCode::kOk;
  std::string end_reason;

  // The segments of the job's nodes on this host (kShmAttach), by node.
  // Unmapped when the job goes; rounds still holding a push from one keep
  // its mapping through the push's Buffer.
  std::mutex shm_mu;
  std::unordered_map<NodeId, std::shared_ptr<LocalShm>> shm;
  std::shared_ptr<LocalShm> shm_of(NodeId node) {
    std::lock_guard lk(shm_mu);
    auto it = shm.find(node);
    return it == shm.end() ? nullptr : it->second;
  }

  Status end_status() {
    std::lock_guard lk(mu);
    return Status(end_code, end_reason);
  }
};

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

  void reply(const transport::Incoming& in, transport::Message m) {
    try {
      tp->reply(in, std::move(m), nullptr);
    } catch (const Error& e) {
      BC_LOG(LogServer(), kWarn) << "reply to node " << in.from << " failed: " << e.what();
    }
  }
  void refuse(const transport::Incoming& in, ErrorCode code, const std::string& why) {
    pushes_refused.fetch_add(1, std::memory_order_relaxed);
    BC_LOG(LogServer(), kDebug) << "refused from node " << in.from << ": " << why;
    if (in.expects_reply) reply(in, proto::error_reply(code, why));
  }
  // Sends what a round hands back.
  // `job`: the pulls' job, for answers to kShmPull (written to its segment).
  void answer(std::vector<RoundAnswer>& answers, ServerJob* job = nullptr);
  void answer(RoundAnswer& a, ServerJob* job = nullptr);
  // A kShmPull's ok answer: into the node's segment when it fits.
  transport::Message shm_answer(RoundAnswer& a, ServerJob* job);
  void on_shm_attach(const transport::Incoming& in);

  // Job lifecycle (also called by the coordinator for itself).
  Status setup_job(const proto::Admission& a);
  void end_job(uint32_t uid, ErrorCode code, const std::string& reason);
  Status prepare_strategy(uint32_t uid, uint64_t iteration, const std::string& yaml, bool cancel);
  void end_all_jobs(ErrorCode code, const std::string& reason);

  // Data path: routes a push or pull to its partition's engine, which runs
  // the partition's round (server/rounds.h).
  void on_data(transport::Incoming in);
  // `shared`: the push's bytes lie in the node's shared memory (kShmPush).
  void on_push(const std::shared_ptr<ServerJob>& job, PartitionRound& round,
               const transport::Incoming& in, bool shared);
  void on_pull(const std::shared_ptr<ServerJob>& job, PartitionRound& round,
               transport::Incoming in);
  void on_broadcast(const std::shared_ptr<ServerJob>& job, BroadcastRound& round,
                    transport::Incoming in);

  void on_control(transport::Incoming in);
  void on_stats(const transport::Incoming& in);
  // Aborts a job cluster-wide (through the coordinator).
  void request_abort(uint32_t uid, const std::string& reason);
};

}  // namespace bytecomp::server
