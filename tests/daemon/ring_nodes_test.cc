// Ring allreduce between real bytecompd processes (inter: allreduce): 2-4
// daemons on loopback, each with its own socket, shm instance and peer
// endpoint, one bytecomp-server coordinating (and serving the push/pull
// tensors of mixed jobs). Results are checked bit for bit against the ring's
// documented reduction order (daemon/ring_allreduce.h).
#include <bytecomp/bytecomp.h>
#include <gtest/gtest.h>

#include <barrier>
#include <cmath>
#include <csignal>
#include <cstring>
#include <future>

#include "compress/reduce.h"
#include "daemon/ring_allreduce.h"
#include "server/cluster_config.h"
#include "server/ps_client.h"
#include "tests/daemon/harness.h"
#include "tests/daemon/peer_nodes.h"
#include "transport/transport.h"

using namespace bctest;
namespace bd = bytecomp::daemon;
namespace cz = bytecomp::compress;

namespace {

constexpr uint64_t kPartitionElements = 65536;  // the fixture's 256 KiB partitions
constexpr uint64_t kChunkBytes = 16384;         // internode.ring_chunk_bytes: 4096 elements

class RingNodes : public PeerNodes {
 protected:
  // One server, `n` daemons with a peer endpoint and the strategy file.
  void start(uint32_t n, const std::string& strategy_yaml) {
    strategy_yaml_ = strategy_yaml;
    start_nodes("ring", n, kChunkBytes);
  }
  std::string daemon_extra() override {
    write("strategy.yaml", strategy_yaml_);
    return "strategy:\n  file: " + (dir_ / "strategy.yaml").string() + "\n";
  }
  bytecomp_client* connect_client(uint32_t node, uint32_t rank, const char* job) {
    bytecomp_connect_options o;
    bytecomp_connect_options_init(&o);
    o.socket_path = nodes_[node]->socket().c_str();
    o.job_id = job;
    o.local_rank = rank;
    o.local_size = 2;
    o.node_rank = node;
    o.num_nodes = n_;
    bytecomp_client* c = nullptr;
    if (bytecomp_connect(&o, &c) != BYTECOMP_OK) {
      ADD_FAILURE() << "connect to node " << node << ": " << bytecomp_last_error();
      return nullptr;
    }
    return c;
  }
  // fn(node, local_rank) for every client at once (2 per node).
  template <class Fn>
  void on_every_rank(const Fn& fn) {
    std::vector<std::future<void>> others;
    for (uint32_t g = 1; g < 2 * n_; ++g)
      others.push_back(std::async(std::launch::async, [&fn, g] { fn(g / 2, g % 2); }));
    fn(0u, 0u);
    for (auto& f : others) f.get();
  }
  uint64_t rounds_completed() {
    namespace sv = bytecomp::server;
    sv::ClusterConfig c = sv::load_cluster_config((dir_ / "cluster.yaml").string());
    bytecomp::transport::TransportConfig tc = c.transport;
    tc.node_id = 150;
    tc.listen = {};
    return sv::PsClient::create(c, tc)->stats(0).rounds_completed;
  }

  // Writes `yaml` as the strategy file, SIGHUPs node 0 and waits for its
  // `nth` announced change ("applies on every node from iteration N"):
  // returns N, or -1 (a failure is added) when it did not come.
  int64_t switch_strategy(const std::string& yaml, size_t nth) {
    write("strategy.yaml", yaml);
    nodes_[0]->daemon().signal(SIGHUP);
    return announced_change(nodes_[0]->daemon(), nth);
  }

  std::string strategy_yaml_;
};

float grad(uint32_t grank, uint64_t it, uint64_t i) {
  return static_cast<float>(std::sin(0.11 * static_cast<double>(i) + 0.7 * static_cast<double>(it) +
                                     1.9 * grank)) *
         static_cast<float>(1 + i % 9);
}

// Push/pull values: small integers, so the server's fp32 sum of them is
// exact whatever the order the nodes' pushes arrive in.
float ints(uint32_t grank, uint64_t it, uint64_t i) {
  return static_cast<float>(static_cast<int>((i * 7 + it * 5 + grank * 13) % 61) - 30);
}
float ints_sum(uint32_t nodes, uint64_t it, uint64_t i) {
  float s = 0;
  for (uint32_t g = 0; g < 2 * nodes; ++g) s += ints(g, it, i);
  return s;
}

float wire(bd::RingFormat f, float v) {
  if (f == bd::RingFormat::kFp16) return cz::fp16_to_fp32(cz::fp32_to_fp16(v));
  if (f == bd::RingFormat::kBf16) return cz::bf16_to_fp32(cz::fp32_to_bf16(v));
  return v;
}

// The ring's result for element i of a tensor: node r's sum is its two
// ranks' values; the element's segment k (of its 256 KiB partition) is
// summed from node k round to node k - 1, rounded to the wire format at
// each send and at the owner.
float ring_expect(uint32_t m, uint64_t count, uint64_t it, uint64_t i, bd::RingFormat f) {
  const uint64_t p = i / kPartitionElements;
  const uint64_t n = std::min(kPartitionElements, count - p * kPartitionElements);
  const uint64_t j = i - p * kPartitionElements;
  bd::RingGeometry g{m, kChunkBytes / 4};
  uint32_t k = 0;
  while (g.segment_end(n, k) <= j) ++k;
  auto x = [&](uint32_t r) { return grad(2 * r, it, i) + grad(2 * r + 1, it, i); };
  float acc = wire(f, x(k));
  for (uint32_t s = 1; s < m; ++s) acc = wire(f, acc + x((k + s) % m));
  return acc;
}

struct Tensor {
  const char* name;
  uint64_t count;
  bd::RingFormat format;
  bool ring;
};

}  // namespace

// 2, 3 and 4 daemons, one job mixing ring tensors (fp32, fp16, bf16; one
// element, odd sizes, below and above one chunk, several partitions) with a
// push/pull tensor: every node's ring results are bit-identical to the
// reference, the push/pull tensor's sums are exact, and the server ran only
// the push/pull tensor's partitions.
TEST_P(RingNodes, MixedRingAndPushPullJobOnTwoThreeAndFourNodes) {
  const Tensor tensors[] = {
      {"r_one", 1, bd::RingFormat::kFp32, true},
      {"r_odd", 4097 * 3 + 1, bd::RingFormat::kFp32, true},
      {"r_big", 2 * kPartitionElements + 12345, bd::RingFormat::kFp32, true},
      {"h_small", 1001, bd::RingFormat::kFp16, true},
      {"h_big", kPartitionElements + 7, bd::RingFormat::kFp16, true},
      {"b_mid", 30001, bd::RingFormat::kBf16, true},
      {"p_ps", 70000, bd::RingFormat::kFp32, false},
  };
  constexpr size_t kT = std::size(tensors);
  for (uint32_t m : {2u, 3u, 4u}) {
    SCOPED_TRACE("nodes " + std::to_string(m));
    start(m,
          "version: 1\ndefault: {compressor: none}\nrules:\n"
          "  - match: 'r_*'\n    option: {compressor: none, inter: allreduce}\n"
          "  - match: 'h_*'\n    option: {compressor: fp16, inter: allreduce}\n"
          "  - match: 'b_*'\n    option: {compressor: bf16, inter: allreduce}\n");
    if (HasFatalFailure()) return;
    constexpr int kIters = 3;
    std::vector<std::vector<float>> got[4][kT];  // [node][tensor][iteration]
    auto run = [&](uint32_t node, uint32_t rank) {
      bytecomp_client* c = connect_client(node, rank, "mixed");
      ASSERT_NE(c, nullptr);
      uint32_t ids[kT];
      for (size_t k = 0; k < kT; ++k) {
        ASSERT_EQ(bytecomp_declare_tensor(c, tensors[k].name, tensors[k].count, BYTECOMP_FLOAT32,
                                          BYTECOMP_DEVICE_CPU, 0, &ids[k]),
                  BYTECOMP_OK);
      }
      ASSERT_EQ(bytecomp_start(c, 30000), BYTECOMP_OK) << bytecomp_last_error();
      const uint32_t grank = node * 2 + rank;
      for (uint64_t it = 0; it < kIters; ++it) {
        bytecomp_handle hs[kT];
        float* p[kT];
        // Each node submits in another order.
        for (size_t j = 0; j < kT; ++j) {
          const size_t k = (j + node * 2) % kT;
          uint64_t bytes = 0;
          ASSERT_EQ(bytecomp_tensor_buffer(c, ids[k], reinterpret_cast<void**>(&p[k]), &bytes),
                    BYTECOMP_OK);
          for (uint64_t i = 0; i < tensors[k].count; ++i) {
            // The push/pull tensor: small integers, so its sum is exact in any order.
            p[k][i] = tensors[k].ring ? grad(grank, it, i)
                                      : static_cast<float>((i + it + grank) % 100);
          }
          ASSERT_EQ(bytecomp_push_pull(c, ids[k], it, &hs[k]), BYTECOMP_OK);
        }
        for (size_t k = 0; k < kT; ++k) {
          ASSERT_EQ(bytecomp_wait(c, hs[k], 30000), BYTECOMP_OK) << bytecomp_last_error();
          if (rank == 0) got[node][k].emplace_back(p[k], p[k] + tensors[k].count);
        }
      }
      bytecomp_close(c);
    };
    on_every_rank(run);
    ASSERT_FALSE(HasFailure());
    for (size_t k = 0; k < kT; ++k) {
      const Tensor& t = tensors[k];
      for (uint64_t it = 0; it < kIters; ++it) {
        size_t mismatches = 0, differ = 0;
        for (uint64_t i = 0; i < t.count; ++i) {
          float expect = 0;
          if (t.ring) {
            expect = ring_expect(m, t.count, it, i, t.format);
          } else {
            for (uint32_t g = 0; g < 2 * m; ++g) expect += static_cast<float>((i + it + g) % 100);
          }
          mismatches += std::memcmp(&got[0][k][it][i], &expect, 4) != 0;
          for (uint32_t r = 1; r < m; ++r)
            differ += std::memcmp(&got[0][k][it][i], &got[r][k][it][i], 4) != 0;
        }
        EXPECT_EQ(mismatches, 0u) << t.name << " iteration " << it;
        EXPECT_EQ(differ, 0u) << t.name << " iteration " << it << ": nodes differ";
      }
    }
    // p_ps: two partitions a round; no ring tensor reached the server.
    EXPECT_EQ(rounds_completed(), 2u * kIters);
    for (auto& n : nodes_) {
      EXPECT_NE(n->daemon().output().find("ring allreduce over " + std::to_string(m) + " daemons"),
                std::string::npos)
          << n->daemon().output();
      EXPECT_EQ(n->daemon().output().find("aborted"), std::string::npos) << n->daemon().output();
    }
    TearDown();
    nodes_.clear();
  }
}

// SIGHUP on node 0 switches the one tensor of a 3-node job from the ring
// (fp32) to push/pull through the server, then back onto the ring (fp16):
// each switch applies at the coordinator's iteration on every node, like
// any strategy change. Every iteration is exact: the ring's against its
// reference order, the server's (small integers, exact in any order)
// against the plain sum, and the server ran exactly the push/pull
// iterations' rounds.
TEST_P(RingNodes, StrategySwitchOnTheRingAppliesAtOneIteration) {
  start(3, "version: 1\ndefault: {compressor: none, inter: allreduce}\n");
  constexpr uint64_t kN = 70001;  // two partitions
  constexpr int kIters = 12;
  std::vector<std::vector<float>> got[3];
  std::barrier sync(6);
  int64_t to_ps = -1, to_ring = -1;
  auto run = [&](uint32_t node, uint32_t rank) {
    bytecomp_client* c = connect_client(node, rank, "switch");
    ASSERT_NE(c, nullptr);
    uint32_t id = 0;
    ASSERT_EQ(bytecomp_declare_tensor(c, "w", kN, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, &id),
              BYTECOMP_OK);
    ASSERT_EQ(bytecomp_start(c, 30000), BYTECOMP_OK) << bytecomp_last_error();
    const uint32_t grank = node * 2 + rank;
    for (uint64_t it = 0; it < kIters; ++it) {
      if (it == 3 || it == 7) {
        sync.arrive_and_wait();
        if (grank == 0 && it == 3) to_ps = switch_strategy("version: 1\ndefault: {compressor: none}\n", 1);
        if (grank == 0 && it == 7)
          to_ring = switch_strategy("version: 1\ndefault: {compressor: fp16, inter: allreduce}\n", 2);
        sync.arrive_and_wait();
      }
      const bool ps = to_ps >= 0 && static_cast<int64_t>(it) >= to_ps &&
                      (to_ring < 0 || static_cast<int64_t>(it) < to_ring);
      float* p = nullptr;
      uint64_t bytes = 0;
      ASSERT_EQ(bytecomp_tensor_buffer(c, id, reinterpret_cast<void**>(&p), &bytes), BYTECOMP_OK);
      for (uint64_t i = 0; i < kN; ++i) p[i] = ps ? ints(grank, it, i) : grad(grank, it, i);
      bytecomp_handle hd = 0;
      ASSERT_EQ(bytecomp_push_pull(c, id, it, &hd), BYTECOMP_OK);
      ASSERT_EQ(bytecomp_wait(c, hd, 30000), BYTECOMP_OK) << bytecomp_last_error();
      if (rank == 0) got[node].emplace_back(p, p + kN);
    }
    bytecomp_close(c);
  };
  on_every_rank(run);
  ASSERT_FALSE(HasFailure());
  ASSERT_GE(to_ps, 3) << nodes_[0]->daemon().output();
  ASSERT_GE(to_ring, 7) << nodes_[0]->daemon().output();
  ASSERT_LT(to_ring, kIters);
  for (uint32_t node = 0; node < 3; ++node) {
    ASSERT_EQ(got[node].size(), static_cast<size_t>(kIters));
    for (uint64_t it = 0; it < kIters; ++it) {
      const auto i64 = static_cast<int64_t>(it);
      const bool ps = i64 >= to_ps && i64 < to_ring;
      const auto f = i64 >= to_ring ? bd::RingFormat::kFp16 : bd::RingFormat::kFp32;
      size_t mismatches = 0;
      for (uint64_t i = 0; i < kN; ++i) {
        const float expect = ps ? ints_sum(3, it, i) : ring_expect(3, kN, it, i, f);
        mismatches += std::memcmp(&got[node][it][i], &expect, 4) != 0;
      }
      EXPECT_EQ(mismatches, 0u) << "node " << node << " iteration " << it << " ("
                                << (ps ? "ps" : "ring") << "; ps from " << to_ps
                                << ", ring again from " << to_ring << ")";
    }
  }
  EXPECT_EQ(rounds_completed(), 2u * static_cast<uint64_t>(to_ring - to_ps))
      << "the server ran other rounds than the push/pull iterations'";
  for (auto& n : nodes_)
    EXPECT_EQ(n->daemon().output().find("aborted"), std::string::npos) << n->daemon().output();
}

// One 2-node job with a ring tensor and a push/pull tensor, switched both
// ways at one iteration (they swap places, then swap back), then a move to
// ps_single refused naming the tensor (that placement change needs a new
// job) while the job carries on. Every iteration of both tensors is exact
// on every node, and the server's round counter holds exactly the rounds of
// the iterations each tensor spent on push/pull.
TEST_P(RingNodes, MixedJobSwitchesTensorsBetweenRingAndServers) {
  const std::string a_ring_b_ps =
      "version: 1\ndefault: {compressor: none}\nentries:\n"
      "  - {tensor: a, option: {compressor: none, inter: allreduce}}\n";
  const std::string a_ps_b_ring =
      "version: 1\ndefault: {compressor: none}\nentries:\n"
      "  - {tensor: b, option: {compressor: bf16, inter: allreduce}}\n";
  start(2, a_ring_b_ps);
  struct T {
    const char* name;
    uint64_t count;
  };
  const T tensors[] = {{"a", 2 * kPartitionElements + 99}, {"b", 1001}};  // 3 and 1 partitions
  constexpr int kIters = 13;
  std::vector<std::vector<float>> got[2][2];  // [node][tensor][iteration]
  std::barrier sync(4);
  int64_t swap = -1, back = -1;
  bool single_refused = false;
  auto run = [&](uint32_t node, uint32_t rank) {
    bytecomp_client* c = connect_client(node, rank, "mixedswitch");
    ASSERT_NE(c, nullptr);
    uint32_t ids[2];
    for (int k = 0; k < 2; ++k)
      ASSERT_EQ(bytecomp_declare_tensor(c, tensors[k].name, tensors[k].count, BYTECOMP_FLOAT32,
                                        BYTECOMP_DEVICE_CPU, 0, &ids[k]),
                BYTECOMP_OK);
    ASSERT_EQ(bytecomp_start(c, 30000), BYTECOMP_OK) << bytecomp_last_error();
    const uint32_t grank = node * 2 + rank;
    for (uint64_t it = 0; it < kIters; ++it) {
      if (it == 3 || it == 6 || it == 9) {
        sync.arrive_and_wait();
        if (grank == 0 && it == 3) swap = switch_strategy(a_ps_b_ring, 1);
        if (grank == 0 && it == 6) back = switch_strategy(a_ring_b_ps, 2);
        if (grank == 0 && it == 9) {
          write("strategy.yaml", "version: 1\ndefault: {compressor: none, inter: reduce_broadcast}\n");
          nodes_[0]->daemon().signal(SIGHUP);
          single_refused = nodes_[0]->daemon().wait_output(
              "tensor 'a' would move from ring to ps_single", 10s);
        }
        sync.arrive_and_wait();
      }
      const auto i64 = static_cast<int64_t>(it);
      const bool swapped = swap >= 0 && i64 >= swap && (back < 0 || i64 < back);
      bytecomp_handle hs[2];
      float* p[2];
      for (int j = 0; j < 2; ++j) {
        const int k = (j + static_cast<int>(node)) % 2;  // each node in another order
        uint64_t bytes = 0;
        ASSERT_EQ(bytecomp_tensor_buffer(c, ids[k], reinterpret_cast<void**>(&p[k]), &bytes),
                  BYTECOMP_OK);
        const bool ps = (k == 0) == swapped;
        for (uint64_t i = 0; i < tensors[k].count; ++i)
          p[k][i] = ps ? ints(grank, it, i) : grad(grank, it, i);
        ASSERT_EQ(bytecomp_push_pull(c, ids[k], it, &hs[k]), BYTECOMP_OK);
      }
      for (int k = 0; k < 2; ++k) {
        ASSERT_EQ(bytecomp_wait(c, hs[k], 30000), BYTECOMP_OK) << bytecomp_last_error();
        if (rank == 0) got[node][k].emplace_back(p[k], p[k] + tensors[k].count);
      }
    }
    bytecomp_close(c);
  };
  on_every_rank(run);
  ASSERT_FALSE(HasFailure());
  ASSERT_GE(swap, 3) << nodes_[0]->daemon().output();
  ASSERT_GE(back, 6) << nodes_[0]->daemon().output();
  ASSERT_LT(back, 9);
  EXPECT_TRUE(single_refused) << nodes_[0]->daemon().output();
  uint64_t ps_rounds = 0;
  for (int k = 0; k < 2; ++k) {
    const T& t = tensors[k];
    for (uint64_t it = 0; it < kIters; ++it) {
      const auto i64 = static_cast<int64_t>(it);
      const bool swapped = i64 >= swap && i64 < back;
      const bool ps = (k == 0) == swapped;
      if (ps) ps_rounds += (t.count + kPartitionElements - 1) / kPartitionElements;
      const auto f = k == 0 ? bd::RingFormat::kFp32 : bd::RingFormat::kBf16;
      for (uint32_t node = 0; node < 2; ++node) {
        ASSERT_EQ(got[node][k].size(), static_cast<size_t>(kIters));
        size_t mismatches = 0;
        for (uint64_t i = 0; i < t.count; ++i) {
          const float expect = ps ? ints_sum(2, it, i) : ring_expect(2, t.count, it, i, f);
          mismatches += std::memcmp(&got[node][k][it][i], &expect, 4) != 0;
        }
        EXPECT_EQ(mismatches, 0u) << t.name << " node " << node << " iteration " << it << " ("
                                  << (ps ? "ps" : "ring") << "; swapped from " << swap
                                  << " to " << back << ")";
      }
    }
  }
  EXPECT_EQ(rounds_completed(), ps_rounds);
  for (auto& n : nodes_)
    EXPECT_EQ(n->daemon().output().find("aborted"), std::string::npos) << n->daemon().output();
}

// A daemon killed mid-ring: every rank of the other nodes gets an error
// naming it within the heartbeat bound, the killed node's ranks see their
// daemon gone, nothing is left in /dev/shm and the other daemons keep serving.
TEST_P(RingNodes, KilledDaemonMidRingAbortsEveryRankNamingIt) {
  peer_timeout_ms_ = 1000;
  start(3, "version: 1\ndefault: {compressor: none, inter: allreduce}\n");
  std::vector<std::unique_ptr<Process>> w;
  for (uint32_t n = 0; n < 3; ++n) {
    for (int r = 0; r < 2; ++r) {
      w.push_back(nodes_[n]->worker("killring", r, 2, 1000000, "f32:1000,f32:300000",
                                    {"--node", std::to_string(n) + "/3"}));
    }
  }
  for (auto& p : w) ASSERT_TRUE(p->wait_output("running", 30s)) << p->output();
  const auto t0 = std::chrono::steady_clock::now();
  nodes_[2]->daemon().signal(SIGKILL);
  for (size_t i = 0; i < 4; ++i) {
    auto st = w[i]->wait(10s);
    ASSERT_TRUE(st.has_value()) << w[i]->output();
    EXPECT_EQ(*st, 16) << w[i]->output();  // BYTECOMP_ERR_ABORTED
    EXPECT_NE(w[i]->output().find("node 102"), std::string::npos) << w[i]->output();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s) << "the others learnt of the death late";
  for (size_t i = 4; i < 6; ++i) {
    auto st = w[i]->wait(10s);
    ASSERT_TRUE(st.has_value()) << w[i]->output();
    EXPECT_EQ(*st, 17) << w[i]->output();  // BYTECOMP_ERR_UNAVAILABLE
  }
  for (uint32_t n = 0; n < 3; ++n) EXPECT_TRUE(no_shm_left(nodes_[n]->shm_prefix())) << n;
  EXPECT_FALSE(nodes_[0]->daemon().wait(0ms).has_value()) << "the daemon keeps serving";
  EXPECT_FALSE(nodes_[1]->daemon().wait(0ms).has_value()) << "the daemon keeps serving";
  nodes_[2]->drop_daemon();
}

INSTANTIATE_TEST_SUITE_P(Backends, RingNodes,
                         ::testing::ValuesIn(bytecomp::transport::available_backends()),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });
