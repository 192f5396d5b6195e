// bytecomp_broadcast and bytecomp_barrier with real processes
// (bc_bcast_worker): one daemon with three local ranks, and two daemons with
// two ranks each plus two parameter servers on loopback (with peer
// endpoints: the chain of daemons carries the broadcasts; without: the
// servers; tests/daemon/bcast_nodes_test.cc has 2-4 nodes). Every byte is
// checked by the workers; disagreeing ranks and a dying rank must fail every
// other rank, naming the problem, well within the waits' bound.
#include <bytecomp/bytecomp.h>
#include <gtest/gtest.h>

#include "tests/daemon/harness.h"
#include "tests/daemon/two_nodes.h"

using namespace bctest;

namespace {

std::unique_ptr<Process> bcast_worker(const std::string& socket, const fs::path& dir,
                                      const std::string& job, uint32_t local_rank,
                                      uint32_t local_size, uint32_t node, uint32_t nodes,
                                      const std::string& mode, uint32_t root,
                                      const std::string& sizes, const std::string& dtypes) {
  std::vector<std::string> argv{build_root() + "/tests/daemon/bc_bcast_worker", socket, job,
                                std::to_string(local_rank), std::to_string(local_size),
                                std::to_string(node), std::to_string(nodes), mode,
                                std::to_string(root), sizes, dtypes};
  return std::make_unique<Process>(
      argv, dir / (job + "-n" + std::to_string(node) + "-r" + std::to_string(local_rank) + ".log"));
}

void expect_exit(Process& p, int code, std::chrono::seconds within = std::chrono::seconds(90)) {
  auto st = p.wait(within);
  ASSERT_TRUE(st.has_value()) << "still running: " << p.output();
  EXPECT_EQ(*st, code) << p.output();
}

// Sizes: none, one byte, not a multiple of an element, of the 256 KiB
// partition of the two-node cluster (exactly one, one and a bit) and of the
// 4 MiB chunk a Python process uses, several partitions over both servers.
constexpr const char* kSizes = "0,1,3,262144,262147,1000003";

}  // namespace

class Broadcast : public ::testing::Test {
 protected:
  void SetUp() override { env_.start(); }
  std::vector<std::unique_ptr<Process>> run(const std::string& job, const std::string& mode,
                                            uint32_t root, const std::string& sizes,
                                            const std::string& dtypes) {
    std::vector<std::unique_ptr<Process>> w;
    for (uint32_t r = 0; r < 3; ++r)
      w.push_back(bcast_worker(env_.socket(), env_.dir(), job, r, 3, 0, 1, mode, root, sizes, dtypes));
    return w;
  }
  DaemonEnv env_{"bcast"};
};

TEST_F(Broadcast, OneNodeBytesExactForEveryDtypeAndSizeFromRootTwo) {
  auto w = run("b1", "ok", 2, kSizes, "f32,f64,i32,i64");
  for (auto& p : w) expect_exit(*p, 0);
  for (auto& p : w) EXPECT_NE(p->output().find("OK"), std::string::npos) << p->output();
  EXPECT_TRUE(no_shm_left(env_.shm_prefix()));
}

TEST_F(Broadcast, OneNodeDisagreeingSizesFailEveryRankNamingThem) {
  auto w = run("b1m", "mismatch", 0, "100", "f32");
  for (auto& p : w) {
    expect_exit(*p, 10 + BYTECOMP_ERR_ABORTED);
    EXPECT_NE(p->output().find("the ranks disagree on the broadcast of tensor 'b.f32'"),
              std::string::npos)
        << p->output();
    EXPECT_NE(p->output().find("104 bytes"), std::string::npos) << p->output();
  }
}

TEST_F(Broadcast, OneNodeDyingRankFailsTheOthersAtOnce) {
  const auto t0 = std::chrono::steady_clock::now();
  auto w = run("b1d", "die", 1, "4096", "f32");
  expect_exit(*w[1], 0);
  for (size_t i : {0u, 2u}) {
    expect_exit(*w[i], 10 + BYTECOMP_ERR_ABORTED);
    EXPECT_NE(w[i]->output().find("local rank 1"), std::string::npos) << w[i]->output();
  }
  // The workers wait up to 20 s; the death must be reported long before.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
}

namespace {

std::vector<std::unique_ptr<Process>> run_two(const std::unique_ptr<DaemonEnv> (&nodes)[2],
                                              const fs::path& dir, const std::string& job,
                                              const std::string& mode, uint32_t root,
                                              const std::string& sizes) {
  std::vector<std::unique_ptr<Process>> w;
  for (uint32_t n = 0; n < 2; ++n)
    for (uint32_t r = 0; r < 2; ++r)
      w.push_back(bcast_worker(nodes[n]->socket(), dir, job, r, 2, n, 2, mode, root, sizes, "f32"));
  return w;
}

}  // namespace

TEST_P(TwoNodes, BroadcastBytesExactDownTheChainFromEveryNode) {
  start(2);
  // Root on node 1 (its second rank), then on node 0.
  for (uint32_t root : {3u, 0u}) {
    auto w = run_two(nodes_, dir_, "b2-" + std::to_string(root), "ok", root, kSizes);
    for (auto& p : w) expect_exit(*p, 0);
    for (auto& p : w) EXPECT_NE(p->output().find("OK"), std::string::npos) << p->output();
  }
  for (auto& s : servers_) EXPECT_EQ(s->output().find("refused"), std::string::npos) << s->output();
  for (auto& n : nodes_) EXPECT_TRUE(no_shm_left(n->shm_prefix()));
}

TEST_P(TwoNodes, BroadcastDisagreeingSizesFailOnBothNodesNamingThem) {
  start(1);
  // Node 1's ranks (the root's) pass 4 bytes more: node 0 finds the nodes
  // disagree at the first chunk down the chain; the abort reaches the rest.
  auto w = run_two(nodes_, dir_, "b2m", "mismatch", 2, "100");
  for (auto& p : w) {
    expect_exit(*p, 10 + BYTECOMP_ERR_ABORTED, 30s);
    const std::string out = p->output();
    EXPECT_NE(out.find("the ranks disagree on the broadcast of tensor 'b.f32' (iteration 0): the "
                       "ranks of node 100 (rank 0) passed root rank 2, 100 bytes"),
              std::string::npos)
        << out;
    EXPECT_NE(out.find("node 101 (rank 1) sent the broadcast of root rank 2, 104 bytes"),
              std::string::npos)
        << out;
  }
}

// Without peer endpoints the servers carry the broadcast (docs/daemon.md):
// the same bytes, and the server's finding when the nodes disagree.
TEST_P(TwoNodes, BroadcastThroughTheServersWithoutPeerEndpoints) {
  peer_listen_ = false;
  start(2);
  auto w = run_two(nodes_, dir_, "b2s", "ok", 3, kSizes);
  for (auto& p : w) expect_exit(*p, 0);
  for (auto& p : w) EXPECT_NE(p->output().find("OK"), std::string::npos) << p->output();
  auto m = run_two(nodes_, dir_, "b2sm", "mismatch", 2, "100");
  for (auto& p : m) {
    expect_exit(*p, 10 + BYTECOMP_ERR_ABORTED, 30s);
    const std::string out = p->output();
    EXPECT_NE(out.find("partition 0 (key 0x0): broadcast of iteration 0: the ranks disagree: "
                       "node 10"),
              std::string::npos)
        << out;
    EXPECT_NE(out.find("passed root rank 2, 100 bytes"), std::string::npos) << out;
    EXPECT_NE(out.find("passed root rank 2, 104 bytes"), std::string::npos) << out;
  }
}

TEST_P(TwoNodes, BroadcastDyingRankFailsTheOtherNodeWithinTheTimeout) {
  start(1);
  const auto t0 = std::chrono::steady_clock::now();
  auto w = run_two(nodes_, dir_, "b2d", "die", 3, "300000");
  expect_exit(*w[3], 0);
  for (size_t i = 0; i < 3; ++i) expect_exit(*w[i], 10 + BYTECOMP_ERR_ABORTED, 30s);
  // The cluster's request bound is 10 s and the workers' waits 20 s: the
  // death travels through the coordinator well before either.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  EXPECT_NE(w[0]->output().find("aborted"), std::string::npos) << w[0]->output();
}
