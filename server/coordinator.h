// The job coordinator (on the server named `coordinator` in the cluster
// config): server registration, job admission (every node's declaration
// compared, the assignment checked on every server), barriers, leave, strategy
// changes (prepared on every server, then announced to every node) and aborts
// on peer loss. docs/server.md ("A job's life") describes the protocol.
//
// Threading: thread-safe. Its state sits behind mu_ and one timer thread
// (admission deadlines); it is on the control path only. Lock order:
// Coordinator::mu_ before the server's jobs lock (docs in ps_server.h); mu_ is
// never held while calling into the transport or the local server.
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "server/auto_planner.h"
#include "planner/strategy/timeline.h"
#include "server/job.h"
#include "server/protocol.h"
#include "server/ps_server.h"
#include "transport/transport.h"

namespace bytecomp::server {

class Coordinator {
 public:
  // Registers this server itself and starts the admission timer.
  explicit Coordinator(ParameterServer::Impl& srv);
  ~Coordinator() { stop(); }
  // Answers every waiting registration and aborts every running job (so
  // nodes hear about it at once, not after their heartbeat timeout).
  // Idempotent.
  void stop();

  void on_message(transport::Incoming in);
  void on_peer_lost(NodeId id, const Status& s);
  void abort_running(uint32_t uid, const std::string& reason);
  void reply_all_unavailable(std::vector<transport::Incoming>& ins, const std::string& why);

 private:
  struct Reg {
    transport::Incoming in;
    JobSpec spec;
  };
  struct Pending {
    std::string name;
    uint32_t uid = 0;
    JobSpec ref;
    NodeId ref_node = 0;
    std::map<uint32_t, Reg> regs;  // by rank
    transport::Clock::time_point deadline;
    bool setting_up = false;
    std::string failed;  // set while setting up: fail when setup returns
  };
  struct Running {
    proto::Admission adm;
    std::set<NodeId> left;
    std::map<uint64_t, std::vector<transport::Incoming>> barriers;
    // The job's strategy over time (its latest entry: the last change).
    std::unique_ptr<strategy::Timeline> timeline;
    bool changing = false;
  };

  // Each handler gets its message decoded (on_message refused a malformed one).
  void on_register(transport::Incoming in, proto::Register m);
  void on_hello(transport::Incoming in, proto::ServerHello m);
  void on_barrier(transport::Incoming in, const proto::Barrier& m);
  void on_set_strategy(transport::Incoming in, proto::SetStrategy m);
  void on_auto(transport::Incoming in, uint32_t uid,
               const std::function<Status(const AutoPlanner::JobView&)>& deliver);
  void on_leave(transport::Incoming in, const proto::Leave& m);
  void timer_loop();
  // Both called with mu_ held; they take what they must answer out of the
  // tables, and the caller answers after unlocking.
  std::vector<transport::Incoming> take_pending(const std::string& name);
  void try_admit_locked(Pending& p, std::vector<std::function<void()>>& after);
  void admit(proto::Admission adm, std::string name);
  void barrier_check_locked(Running& r, std::vector<transport::Incoming>& done);
  std::string missing_locked(const Pending& p) const;
  std::string node_name(NodeId id) const;

  ParameterServer::Impl& srv_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::thread timer_;
  std::map<NodeId, ServerInfo> servers_;  // registered
  const uint64_t incarnation_;  // this run's, told to servers in every hello's answer
  uint32_t next_uid_;
  std::map<std::string, Pending> pending_;
  std::map<uint32_t, Running> running_;
  AutoPlanner auto_;  // after srv_: its SendFn uses the transport
};

}  // namespace bytecomp::server
