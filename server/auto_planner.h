// The coordinator's half of automatic strategies (issue 13, docs/auto.md):
// it collects every node's profile of a job for one epoch, merges them (the
// slowest node's ready times, the narrowest link), runs the online planner
// (planner/online.h) off the request thread within the job's
// plan_timeout_ms, and tells every node the decision (kAutoDecision). Node
// rank 0 then applies it through the ordinary strategy change, so every node
// and server switches at one iteration. A failed or timed-out plan is sent as
// kAutoFailed with the reason: the nodes keep their current strategy.
//
// Epochs: 0 is the warm-up profile every node sends by itself; a node that
// sees the measured iteration drift from the prediction asks for a re-plan
// (on_replan), which opens the next epoch and asks every node to profile
// again (kAutoProfileRequest). One epoch at a time per job.
//
// Transport-free: messages leave through the SendFn, so the state machine is
// tested without sockets (tests/server/auto_planner_test.cc).
//
// Threading: on_profile/on_replan/forget from the coordinator's handler
// threads (internally locked); the plan runs on this object's worker thread;
// a watchdog thread fails plans past their deadline. SendFn is called from
// any of them, never with the lock held. stop() (or the destructor) joins
// both threads; a plan still running is abandoned (its thread is joined, so
// stop waits for it, bounded by the planner's own run time).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "planner/online.h"
#include "planner/strategy/auto_spec.h"
#include "transport/transport.h"

namespace bytecomp::server {

class AutoPlanner {
 public:
  using PlanFn = std::function<planner::online::Decision(const planner::online::NodeProfile&,
                                                         const planner::online::AutoConfig&)>;
  using SendFn = std::function<void(transport::NodeId node, transport::Message m)>;

  // What the coordinator knows of a running job.
  struct JobView {
    uint32_t uid = 0;
    std::string name;
    std::vector<transport::NodeId> nodes;  // rank order
    uint32_t servers = 1;
    uint64_t partition_bytes = 0;
    // Every node's daemon has a peer endpoint (the admission's
    // peer_addresses), so the nodes opened the ring at the join: the plan
    // may move tensors between the servers and the ring
    // (AutoConfig::Placement::kMove); without it every tensor keeps its
    // placement (kFixed), and none can go on a ring that is not there.
    bool ring = false;
  };

  // `plan` null: planner::online::merge + decide.
  explicit AutoPlanner(SendFn send, PlanFn plan = nullptr);
  ~AutoPlanner();
  AutoPlanner(const AutoPlanner&) = delete;
  AutoPlanner& operator=(const AutoPlanner&) = delete;

  // A node's profile (YAML of planner::online::NodeProfile) and auto spec
  // for `epoch`. Returns what to answer the node: an error naming the problem
  // (stale epoch, not part of the job, undecodable profile, duplicate). When
  // the last node's profile arrives the plan is queued.
  Status on_profile(const JobView& job, transport::NodeId from, uint64_t epoch,
                    std::string_view profile_yaml, std::string_view spec_yaml);
  // A node asks for a re-plan from `from_iteration` on. Refused while an
  // epoch is collecting or planning (the message says which).
  Status on_replan(const JobView& job, transport::NodeId from, uint64_t from_iteration,
                   const std::string& reason);
  // The job ended: its state goes; a plan in flight is discarded.
  void forget(uint32_t uid);
  void stop();

  // For tests and logs: the epoch a job is at and whether it is planning.
  struct Snapshot {
    uint64_t epoch = 0;
    bool collecting = false, planning = false;
    uint64_t decisions = 0, failures = 0;
  };
  std::optional<Snapshot> snapshot(uint32_t uid) const;

 private:
  struct JobState {
    uint64_t epoch = 0;
    bool collecting = true;  // epoch 0 collects from the start
    bool planning = false;
    std::map<transport::NodeId, planner::online::NodeProfile> profiles;
    std::map<transport::NodeId, std::string> specs;
    uint64_t decisions = 0, failures = 0;
  };
  struct Task {
    uint32_t uid = 0;
    uint64_t epoch = 0;
    std::vector<transport::NodeId> nodes;
    std::string job;
    planner::online::AutoConfig cfg;
    std::chrono::steady_clock::time_point deadline;
    uint32_t timeout_ms = 0;
    std::vector<planner::online::NodeProfile> parts;  // rank order, merged by the worker
  };

  void worker();
  void watchdog();
  // Ends (uid, epoch) once: sends the decision or the failure to `nodes`.
  // False when it had already ended (timed out, or forgotten).
  bool finish(uint32_t uid, uint64_t epoch, const std::vector<transport::NodeId>& nodes,
              const std::string& job, const planner::online::Decision* d, const std::string& why);

  SendFn send_;
  PlanFn plan_;
  mutable std::mutex mu_;
  std::condition_variable cv_;       // worker: tasks_; watchdog: deadlines
  std::map<uint32_t, JobState> jobs_;
  std::deque<Task> tasks_;
  // Deadlines of (uid, epoch) queued or planning.
  std::map<std::pair<uint32_t, uint64_t>, Task> open_;
  bool stopping_ = false;
  std::thread worker_, watchdog_;
};

}  // namespace bytecomp::server
