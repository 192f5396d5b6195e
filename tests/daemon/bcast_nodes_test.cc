// bytecomp_broadcast down the chain of daemons (daemon/peer_broadcast.h):
// 2-4 real bytecompd processes on loopback, each with a peer endpoint and
// two local ranks (bc_bcast_worker), one bytecomp-server coordinating.
// Every byte is checked by the workers (below the size the root's, above it
// each rank's own), from roots on several nodes; a node whose ranks come
// late gets the first chunks parked until it opens the job; a daemon killed
// mid-broadcast aborts every rank naming it.
#include <bytecomp/bytecomp.h>
#include <gtest/gtest.h>

#include <csignal>

#include "tests/daemon/harness.h"
#include "tests/daemon/peer_nodes.h"
#include "transport/transport.h"

using namespace bctest;

namespace {

// internode.ring_chunk_bytes, which the chain's chunks follow too.
constexpr uint64_t kChunkBytes = 16384;
// None, one byte, odd, one chunk less one / exactly / plus one, many chunks
// (more than the window of 4 in flight) and odd.
constexpr const char* kSizes = "0,1,3,16383,16384,16385,1000003";

class BcastNodes : public PeerNodes {
 protected:
  // One server, `n` daemons with a peer endpoint.
  void start(uint32_t n) { start_nodes("bcast", n, kChunkBytes); }
  // Two bc_bcast_workers per node.
  std::vector<std::unique_ptr<Process>> workers(const std::string& job, const std::string& mode,
                                                uint32_t root, const std::string& sizes,
                                                const std::string& dtypes) {
    std::vector<std::unique_ptr<Process>> w;
    for (uint32_t n = 0; n < n_; ++n) {
      for (uint32_t r = 0; r < 2; ++r) {
        w.push_back(std::make_unique<Process>(
            std::vector<std::string>{build_root() + "/tests/daemon/bc_bcast_worker",
                                     nodes_[n]->socket(), job, std::to_string(r), "2",
                                     std::to_string(n), std::to_string(n_), mode,
                                     std::to_string(root), sizes, dtypes},
            dir_ / (job + "-n" + std::to_string(n) + "-r" + std::to_string(r) + ".log")));
      }
    }
    return w;
  }

};

void expect_exit(Process& p, int code, std::chrono::seconds within = std::chrono::seconds(90)) {
  auto st = p.wait(within);
  ASSERT_TRUE(st.has_value()) << "still running: " << p.output();
  EXPECT_EQ(*st, code) << p.output();
}

}  // namespace

// 2, 3 and 4 daemons; per size a broadcast from the last node's second rank
// and from the first rank of a middle node (the chain starts at the root's
// node and wraps round; multi-node jobs declare float32 tensors, whose
// bytes the worker fills with any pattern, NaNs included): every byte exact
// on every rank, the bytes above the size untouched, and the chain carried it.
TEST_P(BcastNodes, BytesExactOnTwoThreeAndFourNodesFromRootsOnAnyNode) {
  for (uint32_t m : {2u, 3u, 4u}) {
    SCOPED_TRACE("nodes " + std::to_string(m));
    start(m);
    if (HasFatalFailure()) return;
    for (uint32_t root : {2 * m - 1, 2 * (m / 2)}) {
      SCOPED_TRACE("root rank " + std::to_string(root));
      auto w = workers("bn" + std::to_string(m) + "-" + std::to_string(root), "ok", root, kSizes,
                       "f32");
      for (auto& p : w) expect_exit(*p, 0);
      for (auto& p : w) EXPECT_NE(p->output().find("OK"), std::string::npos) << p->output();
    }
    for (auto& n : nodes_) {
      EXPECT_NE(n->daemon().output().find("broadcasts down a chain of " + std::to_string(m) +
                                          " daemons"),
                std::string::npos)
          << n->daemon().output();
      EXPECT_EQ(n->daemon().output().find("aborted"), std::string::npos) << n->daemon().output();
      EXPECT_TRUE(no_shm_left(n->shm_prefix()));
    }
    TearDown();
    nodes_.clear();
  }
}

// The last node's ranks start 1.5 s late: the chunks its upstream forwards
// wait (unanswered) in its daemon's peer hub until it opens the job, then
// every byte arrives as usual.
TEST_P(BcastNodes, ChunksForANodeThatHasNotOpenedTheJobWaitForIt) {
  start(3);
  auto w = workers("blate", "late", 0, "1,100003", "f32");
  for (auto& p : w) expect_exit(*p, 0);
  for (auto& p : w) EXPECT_NE(p->output().find("OK"), std::string::npos) << p->output();
  EXPECT_NE(nodes_[2]->daemon().output().find("waits until that job's broadcasts open here"),
            std::string::npos)
      << nodes_[2]->daemon().output();
}

// Consecutive broadcasts of a tensor from different roots, each from the
// node before the last one's (3 nodes: roots on nodes 1, 0, 2, 1, ...): the
// last node of each chain finishes first and its ranks start the next
// round as its root at once, so its chunks can reach the nodes still in
// the round before (waiting for the report from downstream). They keep
// them (daemon/peer_broadcast.h); before, they refused them and the job
// failed with "the ranks disagree ... sent iteration".
TEST_P(BcastNodes, ConsecutiveBroadcastsFromTheLastNodeOfTheChainBefore) {
  start(3);
  std::string sizes;
  for (int k = 0; k < 8; ++k) sizes += std::string(k ? "," : "") + "1,16385,100003";
  auto w = workers("brot", "rotate", 2, sizes, "f32");
  for (auto& p : w) expect_exit(*p, 0);
  for (auto& p : w) EXPECT_NE(p->output().find("OK"), std::string::npos) << p->output();
  for (auto& n : nodes_) {
    EXPECT_EQ(n->daemon().output().find("aborted"), std::string::npos) << n->daemon().output();
  }
}

// The ranks of the last node pass 4 bytes more: a node of the chain finds
// the disagreement, and every rank fails naming both calls.
TEST_P(BcastNodes, DisagreeingNodesFailEveryRankNamingBothCalls) {
  start(3);
  auto w = workers("bmis", "mismatch", 0, "100", "f32");
  for (auto& p : w) {
    expect_exit(*p, 10 + BYTECOMP_ERR_ABORTED, 30s);
    const std::string out = p->output();
    EXPECT_NE(out.find("the ranks disagree on the broadcast of tensor 'b.f32'"), std::string::npos)
        << out;
    EXPECT_NE(out.find("root rank 0, 100 bytes"), std::string::npos) << out;
    EXPECT_NE(out.find("root rank 0, 104 bytes"), std::string::npos) << out;
  }
}

// A daemon killed while every rank broadcasts 1 MB again and again from
// rank 0 (the middle of the chain dies): every rank of the other nodes
// fails naming it within the heartbeat bound, the killed node's ranks see
// their daemon gone, nothing is left in /dev/shm and the others keep serving.
TEST_P(BcastNodes, KilledDaemonMidBroadcastAbortsEveryRankNamingIt) {
  peer_timeout_ms_ = 1000;
  start(3);
  auto w = workers("bkill", "loop", 0, "1000003", "f32");
  for (auto& p : w) ASSERT_TRUE(p->wait_output("running", 30s)) << p->output();
  const auto t0 = std::chrono::steady_clock::now();
  nodes_[1]->daemon().signal(SIGKILL);
  for (size_t i : {0u, 1u, 4u, 5u}) {
    auto st = w[i]->wait(10s);
    ASSERT_TRUE(st.has_value()) << w[i]->output();
    EXPECT_EQ(*st, 10 + BYTECOMP_ERR_ABORTED) << w[i]->output();
    EXPECT_NE(w[i]->output().find("node 101"), std::string::npos) << w[i]->output();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s) << "the others learnt of the death late";
  for (size_t i : {2u, 3u}) {
    auto st = w[i]->wait(10s);
    ASSERT_TRUE(st.has_value()) << w[i]->output();
    EXPECT_EQ(*st, 10 + BYTECOMP_ERR_UNAVAILABLE) << w[i]->output();
  }
  for (uint32_t n : {0u, 2u}) {
    EXPECT_TRUE(no_shm_left(nodes_[n]->shm_prefix())) << n;
    EXPECT_FALSE(nodes_[n]->daemon().wait(0ms).has_value()) << "the daemon keeps serving";
  }
  nodes_[1]->drop_daemon();
}

INSTANTIATE_TEST_SUITE_P(Backends, BcastNodes,
                         ::testing::ValuesIn(bytecomp::transport::available_backends()),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });
