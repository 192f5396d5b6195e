#include "server/auto_planner.h"

#include <algorithm>

#include "common/log.h"
#include "server/protocol.h"

namespace bytecomp::server {

BC_LOG_CATEGORY(LogAuto, "coordinator.auto");

using Clock = std::chrono::steady_clock;
using planner::online::Decision;
using planner::online::NodeProfile;

AutoPlanner::AutoPlanner(SendFn send, PlanFn plan) : send_(std::move(send)), plan_(std::move(plan)) {
  if (!plan_) plan_ = [](const NodeProfile& p, const planner::online::AutoConfig& c) {
    return planner::online::decide(p, c);
  };
  worker_ = std::thread([this] { worker(); });
  watchdog_ = std::thread([this] { watchdog(); });
}

AutoPlanner::~AutoPlanner() { stop(); }

void AutoPlanner::stop() {
  {
    std::lock_guard lk(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  if (watchdog_.joinable()) watchdog_.join();
}

Status AutoPlanner::on_profile(const JobView& job, transport::NodeId from, uint64_t epoch,
                               std::string_view profile_yaml, std::string_view spec_yaml) {
  const std::string who = "node " + std::to_string(from);
  if (std::find(job.nodes.begin(), job.nodes.end(), from) == job.nodes.end())
    return Status(ErrorCode::kInvalidArgument,
                  "auto profile refused: " + who + " is not part of job '" + job.name + "'");
  NodeProfile profile;
  std::optional<strategy::AutoSpec> spec;
  try {
    profile = NodeProfile::parse(profile_yaml, who + "'s profile of job '" + job.name + "'");
    spec = strategy::AutoSpec::parse_job_text(spec_yaml, who + "'s auto spec");
  } catch (const Error& e) {
    return Status(ErrorCode::kInvalidArgument, std::string("auto profile refused: ") + e.what());
  }
  if (!spec)
    return Status(ErrorCode::kInvalidArgument,
                  "auto profile refused: " + who + "'s auto spec has no 'mode: auto'");
  std::unique_lock lk(mu_);
  if (stopping_) return Status(ErrorCode::kUnavailable, "coordinator shutting down");
  JobState& st = jobs_.try_emplace(job.uid).first->second;
  if (epoch != st.epoch || !st.collecting)
    return Status(ErrorCode::kInvalidArgument,
                  "auto profile of " + who + " for epoch " + std::to_string(epoch) +
                      " refused: job '" + job.name + "' is at epoch " + std::to_string(st.epoch) +
                      (st.collecting ? " (collecting)" : st.planning ? " (planning)" : " (decided)"));
  if (!st.profiles.emplace(from, std::move(profile)).second)
    return Status(ErrorCode::kInvalidArgument, "auto profile of " + who + " for epoch " +
                                                   std::to_string(epoch) + " sent twice");
  st.specs[from] = spec->to_yaml();
  if (st.profiles.size() < job.nodes.size()) return Status::Ok();

  // Every node reported: queue the plan.
  st.collecting = false;
  st.planning = true;
  Task t;
  t.uid = job.uid;
  t.epoch = epoch;
  t.nodes = job.nodes;
  t.job = job.name;
  t.timeout_ms = spec->plan_timeout_ms;
  t.deadline = Clock::now() + std::chrono::milliseconds(spec->plan_timeout_ms);
  std::string problem;
  const std::string& ref = st.specs.begin()->second;
  for (const auto& [node, text] : st.specs)
    if (text != ref)
      problem = "nodes " + std::to_string(st.specs.begin()->first) + " and " +
                std::to_string(node) + " run different auto settings (compare their " +
                "strategy sections)";
  for (transport::NodeId n : job.nodes) t.parts.push_back(st.profiles.at(n));
  st.profiles.clear();
  st.specs.clear();
  t.cfg.compressors = spec->compressors;
  t.cfg.exclude = spec->exclude;
  t.cfg.min_compress_bytes = spec->min_compress_bytes;
  t.cfg.min_gain = spec->min_gain;
  t.cfg.guards = spec->guards;
  t.cfg.nodes = static_cast<uint32_t>(job.nodes.size());
  t.cfg.servers = job.servers;
  t.cfg.colocated_servers = spec->colocated_servers;
  t.cfg.partition_bytes = job.partition_bytes;
  t.cfg.placement = job.ring && job.nodes.size() > 1 ? planner::online::AutoConfig::Placement::kMove
                                                     : planner::online::AutoConfig::Placement::kFixed;
  open_[{t.uid, t.epoch}] = t;
  if (!problem.empty()) {
    lk.unlock();
    finish(t.uid, t.epoch, t.nodes, t.job, nullptr, problem);
    return Status::Ok();
  }
  tasks_.push_back(std::move(t));
  lk.unlock();
  cv_.notify_all();
  return Status::Ok();
}

Status AutoPlanner::on_replan(const JobView& job, transport::NodeId from, uint64_t from_iteration,
                              const std::string& reason) {
  if (std::find(job.nodes.begin(), job.nodes.end(), from) == job.nodes.end())
    return Status(ErrorCode::kInvalidArgument, "re-plan refused: node " + std::to_string(from) +
                                                   " is not part of job '" + job.name + "'");
  uint64_t epoch = 0;
  {
    std::lock_guard lk(mu_);
    JobState& st = jobs_.try_emplace(job.uid).first->second;
    if (st.collecting || st.planning)
      return Status(ErrorCode::kInvalidArgument,
                    "re-plan refused: job '" + job.name + "' epoch " + std::to_string(st.epoch) +
                        " is still " + (st.planning ? "planning" : "collecting profiles"));
    epoch = ++st.epoch;
    st.collecting = true;
  }
  BC_LOG(LogAuto(), kInfo) << "job '" << job.name << "': re-plan (epoch " << epoch << ") asked by node "
                           << from << ": " << reason << "; every node profiles from iteration "
                           << from_iteration;
  const transport::Message m =
      proto::to_message(proto::AutoProfileRequest{job.uid, epoch, from_iteration, reason});
  for (transport::NodeId n : job.nodes) send_(n, m);
  return Status::Ok();
}

void AutoPlanner::forget(uint32_t uid) {
  std::lock_guard lk(mu_);
  jobs_.erase(uid);
  for (auto it = open_.begin(); it != open_.end();)
    it = it->first.first == uid ? open_.erase(it) : std::next(it);
  std::erase_if(tasks_, [uid](const Task& t) { return t.uid == uid; });
}

std::optional<AutoPlanner::Snapshot> AutoPlanner::snapshot(uint32_t uid) const {
  std::lock_guard lk(mu_);
  auto it = jobs_.find(uid);
  if (it == jobs_.end()) return std::nullopt;
  return Snapshot{it->second.epoch, it->second.collecting, it->second.planning,
                  it->second.decisions, it->second.failures};
}

bool AutoPlanner::finish(uint32_t uid, uint64_t epoch, const std::vector<transport::NodeId>& nodes,
                         const std::string& job, const Decision* d, const std::string& why) {
  {
    std::lock_guard lk(mu_);
    if (!open_.erase({uid, epoch})) return false;
    auto it = jobs_.find(uid);
    if (it != jobs_.end() && it->second.epoch == epoch) {
      it->second.planning = false;
      ++(d ? it->second.decisions : it->second.failures);
    }
  }
  proto::AutoDecision msg;
  msg.uid = uid;
  msg.epoch = epoch;
  if (d) {
    msg.predicted_us = std::max(0.0, d->predicted_us);
    msg.strategy_yaml = d->strategy.to_yaml();
    msg.decision_yaml = d->to_yaml();
    msg.text = d->explain();
    msg.timeline_json = d->timeline_json;
    BC_LOG(LogAuto(), kInfo) << "job '" << job << "' epoch " << epoch << ": decided in "
                             << d->decision_ms << " ms, predicted " << d->predicted_us / 1000.0
                             << " ms per iteration (measured " << d->measured_us / 1000.0
                             << " ms)";
  } else {
    msg.failed = true;
    msg.text = why;
    BC_LOG(LogAuto(), kWarn) << "job '" << job << "' epoch " << epoch
                             << ": no plan, every node keeps its strategy: " << why;
  }
  const transport::Message m = proto::to_message(msg);
  for (transport::NodeId n : nodes) send_(n, m);
  return true;
}

void AutoPlanner::worker() {
  std::unique_lock lk(mu_);
  for (;;) {
    cv_.wait(lk, [this] { return stopping_ || !tasks_.empty(); });
    if (stopping_) return;
    Task t = std::move(tasks_.front());
    tasks_.pop_front();
    if (!open_.count({t.uid, t.epoch})) continue;  // timed out while queued
    lk.unlock();
    std::optional<Decision> d;
    std::string why;
    const auto t0 = Clock::now();
    try {
      NodeProfile merged = planner::online::merge(t.parts);
      d = plan_(merged, t.cfg);
      d->decision_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    } catch (const std::exception& e) {
      why = std::string("planning failed: ") + e.what();
    }
    if (!finish(t.uid, t.epoch, t.nodes, t.job, d ? &*d : nullptr, why))
      BC_LOG(LogAuto(), kWarn) << "job '" << t.job << "' epoch " << t.epoch
                               << ": a plan finished after its deadline and is discarded";
    lk.lock();
  }
}

void AutoPlanner::watchdog() {
  std::unique_lock lk(mu_);
  while (!stopping_) {
    auto next = Clock::time_point::max();
    std::vector<Task> late;
    const auto now = Clock::now();
    for (const auto& [key, t] : open_) {
      if (t.deadline <= now) late.push_back(t);
      else next = std::min(next, t.deadline);
    }
    if (!late.empty()) {
      lk.unlock();
      for (const Task& t : late)
        finish(t.uid, t.epoch, t.nodes, t.job, nullptr,
               "planning took longer than plan_timeout_ms " + std::to_string(t.timeout_ms) + " ms");
      lk.lock();
      continue;
    }
    if (next == Clock::time_point::max()) cv_.wait(lk);
    else cv_.wait_until(lk, next);
  }
}

}  // namespace bytecomp::server
