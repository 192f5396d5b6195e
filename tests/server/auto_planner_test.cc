// The coordinator's auto-planning state machine without a transport: a fake
// SendFn records what would reach the nodes, a fake PlanFn stands for the
// planner (it may throw or overrun its deadline).
#include "server/auto_planner.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "server/protocol.h"

namespace bytecomp::server {
namespace {

using namespace std::chrono_literals;
using planner::online::Decision;
using planner::online::NodeProfile;

struct Sent {
  transport::NodeId to;
  transport::Message m;
};

class AutoPlannerTest : public ::testing::Test {
 protected:
  AutoPlanner::SendFn sender() {
    return [this](transport::NodeId n, transport::Message m) {
      std::lock_guard lk(mu_);
      sent_.push_back({n, std::move(m)});
    };
  }
  std::vector<Sent> wait_sent(size_t n, std::chrono::milliseconds t = 5000ms) {
    const auto deadline = std::chrono::steady_clock::now() + t;
    for (;;) {
      {
        std::lock_guard lk(mu_);
        if (sent_.size() >= n || std::chrono::steady_clock::now() > deadline) return sent_;
      }
      std::this_thread::sleep_for(2ms);
    }
  }
  static std::string profile(uint32_t rank, double ready_big, double iteration_us) {
    NodeProfile p;
    p.node_rank = rank;
    p.iterations = 3;
    p.iteration_us = iteration_us;
    p.tensors = {{"small", 64, 100.0}, {"big", 1 << 20, ready_big}};
    p.link_gbps = 1;
    p.link_latency_us = 50;
    return p.to_yaml();
  }
  static std::string spec(uint32_t timeout_ms = 2000, const char* comp = "efsignsgd") {
    strategy::AutoSpec s;
    s.compressors = {comp};
    s.plan_timeout_ms = timeout_ms;
    return s.to_yaml();
  }
  AutoPlanner::JobView job() const {
    AutoPlanner::JobView v;
    v.uid = 7;
    v.name = "j";
    v.nodes = {100, 101};
    v.servers = 2;
    v.partition_bytes = 1 << 20;
    return v;
  }
  static Decision fixed_decision(double predicted) {
    Decision d;
    d.predicted_us = predicted;
    d.measured_us = 1000;
    return d;
  }
  std::mutex mu_;
  std::vector<Sent> sent_;
};

TEST_F(AutoPlannerTest, PlansOnceEveryNodeReportedWithTheSlowestNodesProfile) {
  std::atomic<int> calls{0};
  NodeProfile seen;
  AutoPlanner ap(sender(), [&](const NodeProfile& merged, const planner::online::AutoConfig& c) {
    ++calls;
    seen = merged;
    EXPECT_EQ(c.nodes, 2u);
    EXPECT_EQ(c.servers, 2u);
    EXPECT_EQ(c.compressors, std::vector<std::string>{"efsignsgd"});
    return fixed_decision(1234);
  });
  ASSERT_TRUE(ap.on_profile(job(), 100, 0, profile(0, 500, 900), spec()).ok());
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(calls.load(), 0) << "planned before node 101 reported";
  ASSERT_TRUE(ap.on_profile(job(), 101, 0, profile(1, 800, 1100), spec()).ok());
  auto sent = wait_sent(2);
  ASSERT_EQ(sent.size(), 2u);
  EXPECT_EQ(calls.load(), 1);
  for (const Sent& s : sent) {
    EXPECT_EQ(s.m.header.type, proto::kAutoDecision);
    const auto d = proto::from_message<proto::AutoDecision>(s.m);
    EXPECT_FALSE(d.failed);
    EXPECT_EQ(d.epoch, 0u);
    EXPECT_EQ(d.uid, 7u);
    EXPECT_EQ(d.predicted_us, 1234.0);
    EXPECT_FALSE(d.strategy_yaml.empty());
    EXPECT_FALSE(d.text.empty());
  }
  EXPECT_EQ(sent[0].to + sent[1].to, 201u);
  // merge: the latest ready time and the longest iteration of any node.
  ASSERT_EQ(seen.tensors.size(), 2u);
  EXPECT_DOUBLE_EQ(seen.tensors[1].ready_us, 800);
  EXPECT_DOUBLE_EQ(seen.iteration_us, 1100);
  auto snap = ap.snapshot(7);
  ASSERT_TRUE(snap.has_value());
  EXPECT_EQ(snap->decisions, 1u);
  EXPECT_FALSE(snap->planning);
}

// Issue 25 item 2: the plan may move tensors between the servers and the
// ring only where the job's ring is open (every daemon has a peer endpoint);
// otherwise every tensor keeps its placement, so no plan puts a tensor on a
// ring the nodes never opened.
TEST_F(AutoPlannerTest, PlacementMayMoveOnlyWhereTheJobHasARing) {
  using P = planner::online::AutoConfig::Placement;
  std::mutex mu;
  std::vector<P> seen;
  AutoPlanner ap(sender(), [&](const NodeProfile&, const planner::online::AutoConfig& c) {
    std::lock_guard lk(mu);
    seen.push_back(c.placement);
    return fixed_decision(1000);
  });
  AutoPlanner::JobView ringed = job();
  ringed.ring = true;
  ASSERT_TRUE(ap.on_profile(ringed, 100, 0, profile(0, 500, 900), spec()).ok());
  ASSERT_TRUE(ap.on_profile(ringed, 101, 0, profile(1, 800, 1100), spec()).ok());
  ASSERT_EQ(wait_sent(2).size(), 2u);
  AutoPlanner::JobView plain = job();
  plain.uid = 8;
  ASSERT_TRUE(ap.on_profile(plain, 100, 0, profile(0, 500, 900), spec()).ok());
  ASSERT_TRUE(ap.on_profile(plain, 101, 0, profile(1, 800, 1100), spec()).ok());
  ASSERT_EQ(wait_sent(4).size(), 4u);
  std::lock_guard lk(mu);
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0], P::kMove);
  EXPECT_EQ(seen[1], P::kFixed);
}

TEST_F(AutoPlannerTest, RefusesStrangersDuplicatesStaleEpochsAndBadProfiles) {
  AutoPlanner ap(sender(), [](const NodeProfile&, const planner::online::AutoConfig&) {
    return fixed_decision(1);
  });
  Status s = ap.on_profile(job(), 555, 0, profile(0, 1, 1), spec());
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("not part of job 'j'"), std::string::npos) << s.message();
  s = ap.on_profile(job(), 100, 3, profile(0, 1, 1), spec());
  EXPECT_NE(s.message().find("epoch 3 refused"), std::string::npos) << s.message();
  s = ap.on_profile(job(), 100, 0, "version: 1\nnot a profile: [", spec());
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  s = ap.on_profile(job(), 100, 0, profile(0, 1, 1), "version: 1\ncompressors: []\n");
  EXPECT_NE(s.message().find("mode: auto"), std::string::npos) << s.message();
  ASSERT_TRUE(ap.on_profile(job(), 100, 0, profile(0, 1, 1), spec()).ok());
  s = ap.on_profile(job(), 100, 0, profile(0, 1, 1), spec());
  EXPECT_NE(s.message().find("sent twice"), std::string::npos) << s.message();
  EXPECT_TRUE(wait_sent(1, 100ms).empty());
}

TEST_F(AutoPlannerTest, AFailingPlanTellsEveryNodeWhy) {
  AutoPlanner ap(sender(), [](const NodeProfile&, const planner::online::AutoConfig&) -> Decision {
    throw Error(ErrorCode::kInvalidArgument, "no option fits tensor 'big'");
  });
  ASSERT_TRUE(ap.on_profile(job(), 100, 0, profile(0, 1, 1), spec()).ok());
  ASSERT_TRUE(ap.on_profile(job(), 101, 0, profile(1, 1, 1), spec()).ok());
  auto sent = wait_sent(2);
  ASSERT_EQ(sent.size(), 2u);
  for (const Sent& s : sent) {
    const auto d = proto::from_message<proto::AutoDecision>(s.m);
    EXPECT_TRUE(d.failed);
    EXPECT_NE(d.text.find("no option fits tensor 'big'"), std::string::npos);
  }
  EXPECT_EQ(ap.snapshot(7)->failures, 1u);
}

TEST_F(AutoPlannerTest, APlanPastItsDeadlineFailsOnceAndItsLateResultIsDropped) {
  std::atomic<bool> release{false};
  AutoPlanner ap(sender(), [&](const NodeProfile&, const planner::online::AutoConfig&) {
    while (!release) std::this_thread::sleep_for(1ms);
    return fixed_decision(5);
  });
  ASSERT_TRUE(ap.on_profile(job(), 100, 0, profile(0, 1, 1), spec(50)).ok());
  ASSERT_TRUE(ap.on_profile(job(), 101, 0, profile(1, 1, 1), spec(50)).ok());
  auto sent = wait_sent(2);
  ASSERT_EQ(sent.size(), 2u);
  const auto late = proto::from_message<proto::AutoDecision>(sent[0].m);
  EXPECT_TRUE(late.failed);
  EXPECT_NE(late.text.find("plan_timeout_ms 50"), std::string::npos) << late.text;
  release = true;
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(wait_sent(3, 50ms).size(), 2u) << "the late plan reached the nodes";
}

TEST_F(AutoPlannerTest, NodesWithDifferentSettingsAreRefusedAPlan) {
  AutoPlanner ap(sender(), [](const NodeProfile&, const planner::online::AutoConfig&) {
    return fixed_decision(1);
  });
  ASSERT_TRUE(ap.on_profile(job(), 100, 0, profile(0, 1, 1), spec(2000, "efsignsgd")).ok());
  ASSERT_TRUE(ap.on_profile(job(), 101, 0, profile(1, 1, 1), spec(2000, "topk:0.01")).ok());
  auto sent = wait_sent(2);
  ASSERT_EQ(sent.size(), 2u);
  const auto refused = proto::from_message<proto::AutoDecision>(sent[0].m);
  EXPECT_TRUE(refused.failed);
  EXPECT_NE(refused.text.find("different auto settings"), std::string::npos);
}

TEST_F(AutoPlannerTest, ReplanOpensTheNextEpochOnEveryNodeOneAtATime) {
  AutoPlanner ap(sender(), [](const NodeProfile&, const planner::online::AutoConfig&) {
    return fixed_decision(1);
  });
  // Epoch 0 still collecting: no re-plan yet.
  EXPECT_NE(ap.on_replan(job(), 100, 10, "drift").message().find("still collecting"),
            std::string::npos);
  ASSERT_TRUE(ap.on_profile(job(), 100, 0, profile(0, 1, 1), spec()).ok());
  ASSERT_TRUE(ap.on_profile(job(), 101, 0, profile(1, 1, 1), spec()).ok());
  ASSERT_EQ(wait_sent(2).size(), 2u);
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (ap.snapshot(7)->planning && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(ap.on_replan(job(), 100, 40, "link slower").ok());
  auto sent = wait_sent(4);
  ASSERT_EQ(sent.size(), 4u);
  for (size_t i = 2; i < 4; ++i) {
    EXPECT_EQ(sent[i].m.header.type, proto::kAutoProfileRequest);
    const auto r = proto::from_message<proto::AutoProfileRequest>(sent[i].m);
    EXPECT_EQ(r.epoch, 1u);
    EXPECT_EQ(r.from_iteration, 40u);
    EXPECT_EQ(r.reason, "link slower");
  }
  EXPECT_NE(ap.on_replan(job(), 101, 41, "again").message().find("epoch 1"), std::string::npos);
  EXPECT_NE(ap.on_profile(job(), 100, 0, profile(0, 1, 1), spec()).message().find("epoch 0 refused"),
            std::string::npos);
  ASSERT_TRUE(ap.on_profile(job(), 100, 1, profile(0, 1, 1), spec()).ok());
  ap.forget(7);
  EXPECT_FALSE(ap.snapshot(7).has_value());
}

}  // namespace
}  // namespace bytecomp::server
