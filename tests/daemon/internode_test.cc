// Two emulated nodes: two bytecompd (own sockets, own shm instances) and a
// real bytecomp-server on loopback, two client processes per node. Results
// must equal the exact sum over all four clients.
#include <bytecomp/bytecomp.h>
#include <gtest/gtest.h>

#include "tests/daemon/two_nodes.h"

using namespace bctest;


TEST_P(TwoNodes, ShardedOverTwoServersExactSums) {
  start(2);
  // 1 element to 4 MiB (16 partitions of 256 KiB over both servers).
  auto w = workers("ps2", 60, "f32:1,f32:1000,f32:65537,f32:1048576");
  for (auto& p : w) expect_ok(*p);
  for (auto& n : nodes_) EXPECT_TRUE(no_shm_left(n->shm_prefix()));
}

TEST_P(TwoNodes, SingleServerPlacementExactSums) {
  start(1, "version: 1\ndefault: {compressor: none, inter: reduce_broadcast}\n");
  auto w = workers("ps1", 40, "f32:3,f32:300000");
  for (auto& p : w) expect_ok(*p);
}

TEST_P(TwoNodes, KilledDaemonAbortsTheOtherNode) {
  peer_timeout_ms_ = 1000;  // detection time is what this test waits for
  start(1);
  auto w = workers("kd2", 1000000, "f32:1000");
  for (auto& p : w) ASSERT_TRUE(p->wait_output("running", 30s)) << p->output();
  nodes_[1]->daemon().signal(SIGKILL);
  for (int i = 0; i < 2; ++i) {  // node 0's clients
    auto st = w[static_cast<size_t>(i)]->wait(10s);
    ASSERT_TRUE(st.has_value()) << w[static_cast<size_t>(i)]->output();
    EXPECT_EQ(*st, 16) << w[static_cast<size_t>(i)]->output();  // BYTECOMP_ERR_ABORTED
  }
  for (size_t i = 2; i < 4; ++i) {  // node 1's clients lost their daemon
    auto st = w[i]->wait(10s);
    ASSERT_TRUE(st.has_value()) << w[i]->output();
    EXPECT_EQ(*st, 17) << w[i]->output();  // BYTECOMP_ERR_UNAVAILABLE
  }
  EXPECT_TRUE(no_shm_left(nodes_[0]->shm_prefix()));
  EXPECT_TRUE(no_shm_left(nodes_[1]->shm_prefix()));  // removed by its clients
  nodes_[1]->drop_daemon();
}

// A training process dying on one node aborts the job on the other node at
// once, through the coordinator, well before the cluster's 10 s request
// deadline would end the other node's waits.
TEST_P(TwoNodes, KilledClientAbortsTheOtherNodeAtOnce) {
  start(1);
  auto w = workers("kc2", 1000000, "f32:1000");
  for (auto& p : w) ASSERT_TRUE(p->wait_output("running", 30s)) << p->output();
  const auto t0 = std::chrono::steady_clock::now();
  w[3]->signal(SIGKILL);  // node 1, local rank 1
  for (size_t i = 0; i < 3; ++i) {
    auto st = w[i]->wait(10s);
    ASSERT_TRUE(st.has_value()) << w[i]->output();
    EXPECT_EQ(*st, 16) << w[i]->output();  // BYTECOMP_ERR_ABORTED
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 4s) << "node 0 learnt of the death late";
  EXPECT_NE(w[0]->output().find("aborted the job"), std::string::npos) << w[0]->output();
  (void)w[3]->wait(5s);
  for (auto& n : nodes_) EXPECT_TRUE(no_shm_left(n->shm_prefix()));
}


#include <cmath>
#include <future>

#include "compress/reduce.h"

namespace {

float grad(uint32_t grank, uint64_t it, uint64_t i) {
  return static_cast<float>(std::sin(0.11 * static_cast<double>(i) + 0.7 * static_cast<double>(it) +
                                     1.9 * grank)) *
         static_cast<float>(1 + i % 7);
}

float h(float v) {
  return bytecomp::compress::fp16_to_fp32(bytecomp::compress::fp32_to_fp16(v));
}

}  // namespace

// fp16 through the servers under both placements of the strategy format:
// dense sum of decompressed pushes answered as fp16 (alltoall_allgather) and
// a compressed-domain sum (reduce_scatter_allgather). Reference: each node's exact local
// sum, cast to fp16, summed in fp32, cast to fp16 again.
TEST_P(TwoNodes, Fp16ThroughTheServersMatchesTheReference) {
  start(1,
        "version: 1\nrules:\n"
        "  - match: dense\n    option: {compressor: fp16, inter: alltoall_allgather}\n"
        "  - match: summed\n    option: {compressor: fp16, inter: reduce_scatter_allgather}\n");
  constexpr uint64_t kN = 70000;  // 280000 bytes: two 256 KiB partitions
  constexpr int kIters = 8;
  std::vector<std::vector<float>> got[2];
  auto run = [&](uint32_t node, uint32_t rank) {
    bytecomp_client* c = connect_client(node, rank, "fp16");
    ASSERT_NE(c, nullptr);
    uint32_t ids[2];
    ASSERT_EQ(bytecomp_declare_tensor(c, "dense", kN, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0,
                                      &ids[0]),
              BYTECOMP_OK);
    ASSERT_EQ(bytecomp_declare_tensor(c, "summed", kN, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0,
                                      &ids[1]),
              BYTECOMP_OK);
    ASSERT_EQ(bytecomp_start(c, 30000), BYTECOMP_OK) << bytecomp_last_error();
    const uint32_t grank = node * 2 + rank;
    for (uint64_t it = 0; it < kIters; ++it) {
      bytecomp_handle hs[2];
      float* p[2];
      for (int k = 0; k < 2; ++k) {
        uint64_t bytes = 0;
        ASSERT_EQ(bytecomp_tensor_buffer(c, ids[k], reinterpret_cast<void**>(&p[k]), &bytes),
                  BYTECOMP_OK);
        for (uint64_t i = 0; i < kN; ++i) p[k][i] = grad(grank, it, i);
        ASSERT_EQ(bytecomp_push_pull(c, ids[k], it, &hs[k]), BYTECOMP_OK);
      }
      for (int k = 0; k < 2; ++k) {
        ASSERT_EQ(bytecomp_wait(c, hs[k], 30000), BYTECOMP_OK) << bytecomp_last_error();
        if (grank == 0) got[k].emplace_back(p[k], p[k] + kN);
      }
    }
    bytecomp_close(c);
  };
  on_every_rank(run);
  for (int k = 0; k < 2; ++k) {
    ASSERT_EQ(got[k].size(), static_cast<size_t>(kIters));
    for (uint64_t it = 0; it < kIters; ++it) {
      size_t mismatches = 0;
      for (uint64_t i = 0; i < kN; ++i) {
        const float s0 = grad(0, it, i) + grad(1, it, i);
        const float s1 = grad(2, it, i) + grad(3, it, i);
        const float expect = h(h(s0) + h(s1));
        mismatches += got[k][it][i] != expect;
      }
      EXPECT_EQ(mismatches, 0u) << (k == 0 ? "dense" : "summed") << " iteration " << it;
    }
  }
}

#include <barrier>
#include <regex>

// SIGHUP on node 0 with a new strategy file: the coordinator switches every
// node and server at one iteration; before it sums are exact, from it on
// they are the fp16 reference.
TEST_P(TwoNodes, StrategyChangeAppliesOnEveryNodeAtOneIteration) {
  start(1, "version: 1\ndefault: {compressor: none}\n");
  constexpr uint64_t kN = 3000;
  constexpr int kIters = 12;
  std::vector<std::vector<float>> got;
  std::barrier sync(4);
  int64_t switch_at = -1;
  auto run = [&](uint32_t node, uint32_t rank) {
    bytecomp_client* c = connect_client(node, rank, "switch");
    ASSERT_NE(c, nullptr);
    uint32_t id = 0;
    ASSERT_EQ(bytecomp_declare_tensor(c, "w", kN, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, &id),
              BYTECOMP_OK);
    ASSERT_EQ(bytecomp_start(c, 30000), BYTECOMP_OK) << bytecomp_last_error();
    const uint32_t grank = node * 2 + rank;
    for (uint64_t it = 0; it < kIters; ++it) {
      if (it == 5) {
        sync.arrive_and_wait();  // every rank finished iteration 4
        if (grank == 0) {
          switch_at = switch_strategy("version: 1\ndefault: {compressor: fp16, inter: reduce_scatter_allgather}\n");
        }
        sync.arrive_and_wait();
      }
      float* p = nullptr;
      uint64_t bytes = 0;
      ASSERT_EQ(bytecomp_tensor_buffer(c, id, reinterpret_cast<void**>(&p), &bytes), BYTECOMP_OK);
      for (uint64_t i = 0; i < kN; ++i) p[i] = grad(grank, it, i);
      bytecomp_handle hd = 0;
      ASSERT_EQ(bytecomp_push_pull(c, id, it, &hd), BYTECOMP_OK);
      ASSERT_EQ(bytecomp_wait(c, hd, 30000), BYTECOMP_OK) << bytecomp_last_error();
      if (grank == 0) got.emplace_back(p, p + kN);
    }
    bytecomp_close(c);
  };
  on_every_rank(run);
  ASSERT_EQ(got.size(), static_cast<size_t>(kIters));
  ASSERT_GE(switch_at, 5);
  ASSERT_LT(switch_at, kIters);
  for (uint64_t it = 0; it < kIters; ++it) {
    size_t mismatches = 0;
    for (uint64_t i = 0; i < kN; ++i) {
      const float s0 = grad(0, it, i) + grad(1, it, i);
      const float s1 = grad(2, it, i) + grad(3, it, i);
      const float expect = static_cast<int64_t>(it) >= switch_at ? h(h(s0) + h(s1)) : s0 + s1;
      mismatches += got[it][i] != expect;
    }
    EXPECT_EQ(mismatches, 0u) << "iteration " << it << " (switch at " << switch_at << ")";
  }
}

// Two different strategy changes on a job idle in between: both apply, the
// second at a later iteration than the first. The second used to ask for
// the same iteration (latest begun + 2, unchanged while idle) and was
// refused ("iteration 7 is not after the last change"), leaving the job on
// the first.
TEST_P(TwoNodes, TwoChangesOnAnIdleJobBothApplyInOrder) {
  start(1, "version: 1\ndefault: {compressor: none}\n");
  constexpr uint64_t kN = 3000;
  constexpr int kIters = 12;
  std::vector<std::vector<float>> got;
  std::barrier sync(4);
  std::vector<int64_t> at;
  auto run = [&](uint32_t node, uint32_t rank) {
    bytecomp_client* c = connect_client(node, rank, "twochanges");
    ASSERT_NE(c, nullptr);
    uint32_t id = 0;
    ASSERT_EQ(bytecomp_declare_tensor(c, "w", kN, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, &id),
              BYTECOMP_OK);
    ASSERT_EQ(bytecomp_start(c, 30000), BYTECOMP_OK) << bytecomp_last_error();
    const uint32_t grank = node * 2 + rank;
    for (uint64_t it = 0; it < kIters; ++it) {
      if (it == 5) {
        sync.arrive_and_wait();  // every rank finished iteration 4: the job is idle
        if (grank == 0) {
          const char* yaml[2] = {"version: 1\ndefault: {compressor: fp16, inter: reduce_scatter_allgather}\n",
                                 "version: 1\ndefault: {compressor: none}\n"};
          for (size_t i = 0; i < 2; ++i) at.push_back(switch_strategy(yaml[i], i + 1));
        }
        sync.arrive_and_wait();
      }
      float* p = nullptr;
      uint64_t bytes = 0;
      ASSERT_EQ(bytecomp_tensor_buffer(c, id, reinterpret_cast<void**>(&p), &bytes), BYTECOMP_OK);
      for (uint64_t i = 0; i < kN; ++i) p[i] = grad(grank, it, i);
      bytecomp_handle hd = 0;
      ASSERT_EQ(bytecomp_push_pull(c, id, it, &hd), BYTECOMP_OK);
      ASSERT_EQ(bytecomp_wait(c, hd, 30000), BYTECOMP_OK) << bytecomp_last_error();
      if (grank == 0) got.emplace_back(p, p + kN);
    }
    bytecomp_close(c);
  };
  on_every_rank(run);
  const std::string log = nodes_[0]->daemon().output();
  EXPECT_EQ(log.find("strategy change refused"), std::string::npos) << log;
  ASSERT_EQ(at.size(), 2u) << log;
  EXPECT_GE(at[0], 5);
  EXPECT_GT(at[1], at[0]);
  ASSERT_LT(at[1], kIters);
  ASSERT_EQ(got.size(), static_cast<size_t>(kIters));
  for (uint64_t it = 0; it < kIters; ++it) {
    const bool fp16 = static_cast<int64_t>(it) >= at[0] && static_cast<int64_t>(it) < at[1];
    size_t mismatches = 0;
    for (uint64_t i = 0; i < kN; ++i) {
      const float s0 = grad(0, it, i) + grad(1, it, i);
      const float s1 = grad(2, it, i) + grad(3, it, i);
      mismatches += got[it][i] != (fp16 ? h(h(s0) + h(s1)) : s0 + s1);
    }
    EXPECT_EQ(mismatches, 0u) << "iteration " << it << " (changes at " << at[0] << ", " << at[1]
                              << ")";
  }
}

// A reload that leaves the strategy file as it was (bench-cluster turns
// fusion on and off with a drop-in and `bytecompctl reload`) asks the
// coordinator for nothing. Node 0 used to ask for the strategy the job
// already ran at each reload; twice on a job idle in between, the second
// asked for the same iteration again and was refused at ERROR ("iteration 2
// is not after the last change").
TEST_P(TwoNodes, ReloadWithAnUnchangedStrategyAsksForNoChange) {
  start(1, "version: 1\ndefault: {compressor: none}\n");
  constexpr uint64_t kN = 1000;
  constexpr int kIters = 4;
  std::barrier sync(4);
  auto skipped = [&] {
    const std::string log = nodes_[0]->daemon().output();
    size_t n = 0;
    for (size_t at = log.find("already runs this strategy"); at != std::string::npos;
         at = log.find("already runs this strategy", at + 1))
      ++n;
    return n;
  };
  auto run = [&](uint32_t node, uint32_t rank) {
    bytecomp_client* c = connect_client(node, rank, "samestrategy");
    ASSERT_NE(c, nullptr);
    uint32_t id = 0;
    ASSERT_EQ(bytecomp_declare_tensor(c, "w", kN, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, &id),
              BYTECOMP_OK);
    ASSERT_EQ(bytecomp_start(c, 30000), BYTECOMP_OK) << bytecomp_last_error();
    const uint32_t grank = node * 2 + rank;
    for (uint64_t it = 0; it < kIters; ++it) {
      if (it == 2) {
        sync.arrive_and_wait();  // every rank finished iteration 1: the job is idle
        if (grank == 0) {
          for (size_t i = 1; i <= 2; ++i) {
            nodes_[0]->daemon().signal(SIGHUP);
            const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
            while (skipped() < i && std::chrono::steady_clock::now() < deadline)
              std::this_thread::sleep_for(std::chrono::milliseconds(10));
            EXPECT_EQ(skipped(), i) << "reload " << i << ": " << nodes_[0]->daemon().output();
          }
        }
        sync.arrive_and_wait();
      }
      float* p = nullptr;
      uint64_t bytes = 0;
      ASSERT_EQ(bytecomp_tensor_buffer(c, id, reinterpret_cast<void**>(&p), &bytes), BYTECOMP_OK);
      for (uint64_t i = 0; i < kN; ++i) p[i] = grad(grank, it, i);
      bytecomp_handle hd = 0;
      ASSERT_EQ(bytecomp_push_pull(c, id, it, &hd), BYTECOMP_OK);
      ASSERT_EQ(bytecomp_wait(c, hd, 30000), BYTECOMP_OK) << bytecomp_last_error();
      size_t mismatches = 0;
      for (uint64_t i = 0; i < kN; ++i)
        mismatches += p[i] != (grad(0, it, i) + grad(1, it, i)) + (grad(2, it, i) + grad(3, it, i));
      EXPECT_EQ(mismatches, 0u) << "iteration " << it;
    }
    bytecomp_close(c);
  };
  on_every_rank(run);
  const std::string log = nodes_[0]->daemon().output();
  EXPECT_EQ(log.find("strategy change refused"), std::string::npos) << log;
  EXPECT_EQ(log.find("applies on every node"), std::string::npos) << log;
}

// The same change while every rank keeps going: node 0 asks for it at the
// iteration it has reached (E = latest begun + 2) and holds its rounds from
// E - 1 until the coordinator confirms that every node applied it; without
// that, node 1 could finish E - 1 and push E under the old plan before its
// update arrived (a raw push the servers refuse: "bad magic").
TEST_P(TwoNodes, StrategyChangeWhileTrainingContinuesAppliesAtOneIteration) {
  start(1, "version: 1\ndefault: {compressor: none}\n");
  constexpr uint64_t kN = 3000;
  constexpr int kIters = 14;
  std::vector<std::vector<float>> got;
  auto run = [&](uint32_t node, uint32_t rank) {
    bytecomp_client* c = connect_client(node, rank, "switchlive");
    ASSERT_NE(c, nullptr);
    uint32_t id = 0;
    ASSERT_EQ(bytecomp_declare_tensor(c, "w", kN, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, &id),
              BYTECOMP_OK);
    ASSERT_EQ(bytecomp_start(c, 30000), BYTECOMP_OK) << bytecomp_last_error();
    const uint32_t grank = node * 2 + rank;
    for (uint64_t it = 0; it < kIters; ++it) {
      if (grank == 0 && it == 5) {
        write("strategy.yaml", "version: 1\ndefault: {compressor: fp16, inter: reduce_scatter_allgather}\n");
        nodes_[0]->daemon().signal(SIGHUP);
      }
      // Bounds the switch iteration (<= 10) without stopping the others.
      if (grank == 0 && it == 8) {
        ASSERT_TRUE(nodes_[0]->daemon().wait_output("applies on every node from iteration",
                                                    std::chrono::seconds(20)))
            << nodes_[0]->daemon().output();
      }
      float* p = nullptr;
      uint64_t bytes = 0;
      ASSERT_EQ(bytecomp_tensor_buffer(c, id, reinterpret_cast<void**>(&p), &bytes), BYTECOMP_OK);
      for (uint64_t i = 0; i < kN; ++i) p[i] = grad(grank, it, i);
      bytecomp_handle hd = 0;
      ASSERT_EQ(bytecomp_push_pull(c, id, it, &hd), BYTECOMP_OK);
      ASSERT_EQ(bytecomp_wait(c, hd, 30000), BYTECOMP_OK) << bytecomp_last_error();
      if (grank == 0) got.emplace_back(p, p + kN);
    }
    bytecomp_close(c);
  };
  on_every_rank(run);
  ASSERT_EQ(got.size(), static_cast<size_t>(kIters));
  std::smatch m;
  const std::string log = nodes_[0]->daemon().output();
  ASSERT_TRUE(std::regex_search(log, m, std::regex("applies on every node from iteration ([0-9]+)")))
      << log;
  const int64_t switch_at = std::stoll(m[1]);
  ASSERT_GE(switch_at, 6);
  ASSERT_LE(switch_at, 10);
  for (uint64_t it = 0; it < kIters; ++it) {
    size_t mismatches = 0;
    for (uint64_t i = 0; i < kN; ++i) {
      const float s0 = grad(0, it, i) + grad(1, it, i);
      const float s1 = grad(2, it, i) + grad(3, it, i);
      const float expect = static_cast<int64_t>(it) >= switch_at ? h(h(s0) + h(s1)) : s0 + s1;
      mismatches += got[it][i] != expect;
    }
    EXPECT_EQ(mismatches, 0u) << "iteration " << it << " (switch at " << switch_at << ")";
  }
}

TEST_P(TwoNodes, KilledServerIsReportedOnBothNodes) {
  peer_timeout_ms_ = 1000;  // detection time is what this test waits for
  start(1);
  auto w = workers("ks", 1000000, "f32:100000");
  for (auto& p : w) ASSERT_TRUE(p->wait_output("running", 30s)) << p->output();
  const auto t0 = std::chrono::steady_clock::now();
  servers_[0]->signal(SIGKILL);
  for (auto& p : w) {
    auto st = p->wait(15s);
    ASSERT_TRUE(st.has_value()) << p->output();
    EXPECT_EQ(*st, 16) << p->output();  // BYTECOMP_ERR_ABORTED, naming the cause
  }
  // peer_timeout is 1 s; the request deadline (10 s) is the outer bound.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 12s);
  for (auto& n : nodes_) {
    EXPECT_TRUE(no_shm_left(n->shm_prefix()));
    EXPECT_FALSE(n->daemon().wait(0ms).has_value()) << "the daemon keeps serving";
  }
}

#include "compress/compressor.h"

// topk with error feedback through the servers (alltoall_allgather: each
// node compresses its sum with its own residual, the server decompresses,
// sums and recompresses with its residual). Reference: the same steps with
// compress/ in this process, per 256 KiB partition.
TEST_P(TwoNodes, TopkWithErrorFeedbackOnNodesAndServerMatchesTheReference) {
  namespace cz = bytecomp::compress;
  start(1,
        "version: 1\ndefault: {compressor: topk, params: {ratio: '0.05'}, error_feedback: true, "
        "inter: alltoall_allgather}\n");
  constexpr uint64_t kN = 70000;  // partitions of 65536 and 4464 elements
  constexpr int kIters = 6;
  std::vector<std::vector<float>> got;
  auto run = [&](uint32_t node, uint32_t rank) {
    bytecomp_client* c = connect_client(node, rank, "topk");
    ASSERT_NE(c, nullptr);
    uint32_t id = 0;
    ASSERT_EQ(bytecomp_declare_tensor(c, "w", kN, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, &id),
              BYTECOMP_OK);
    ASSERT_EQ(bytecomp_start(c, 30000), BYTECOMP_OK) << bytecomp_last_error();
    const uint32_t grank = node * 2 + rank;
    for (uint64_t it = 0; it < kIters; ++it) {
      float* p = nullptr;
      uint64_t bytes = 0;
      ASSERT_EQ(bytecomp_tensor_buffer(c, id, reinterpret_cast<void**>(&p), &bytes), BYTECOMP_OK);
      for (uint64_t i = 0; i < kN; ++i) p[i] = grad(grank, it, i);
      bytecomp_handle hd = 0;
      ASSERT_EQ(bytecomp_push_pull(c, id, it, &hd), BYTECOMP_OK);
      ASSERT_EQ(bytecomp_wait(c, hd, 30000), BYTECOMP_OK) << bytecomp_last_error();
      if (grank == 0) got.emplace_back(p, p + kN);
    }
    bytecomp_close(c);
  };
  on_every_rank(run);
  ASSERT_EQ(got.size(), static_cast<size_t>(kIters));

  auto topk = cz::make_compressor(cz::parse_compressor_spec("topk:0.05,ef=true"));
  const uint64_t part = 65536;
  std::vector<std::unique_ptr<cz::TensorState>> node_state[2], server_state;
  for (uint64_t b = 0; b < kN; b += part) {
    const size_t n = static_cast<size_t>(std::min(part, kN - b));
    for (auto& s : node_state) s.push_back(topk->make_state(n));
    server_state.push_back(topk->make_state(n));
  }
  for (uint64_t it = 0; it < kIters; ++it) {
    std::vector<float> expect(kN);
    for (size_t p = 0; p * part < kN; ++p) {
      const size_t n = static_cast<size_t>(std::min(part, kN - p * part));
      cz::CompressContext ctx;
      ctx.iteration = it;
      std::vector<float> sum(n, 0.0f);
      for (uint32_t node = 0; node < 2; ++node) {
        std::vector<float> local(n);
        for (size_t i = 0; i < n; ++i) {
          const uint64_t g = p * part + i;
          local[i] = grad(node * 2, it, g) + grad(node * 2 + 1, it, g);
        }
        std::vector<std::byte> wire(topk->max_compressed_bytes(n));
        const size_t len =
            topk->compress(cz::ConstTensorView::cpu(local.data(), n), wire, *node_state[node][p], ctx);
        topk->decompress({wire.data(), len}, cz::TensorView::cpu(sum.data(), n), node > 0, ctx);
      }
      std::vector<std::byte> wire(topk->max_compressed_bytes(n));
      const size_t len =
          topk->compress(cz::ConstTensorView::cpu(sum.data(), n), wire, *server_state[p], ctx);
      topk->decompress({wire.data(), len}, cz::TensorView::cpu(expect.data() + p * part, n), false,
                       ctx);
    }
    size_t mismatches = 0;
    for (uint64_t i = 0; i < kN; ++i) mismatches += got[it][i] != expect[i];
    EXPECT_EQ(mismatches, 0u) << "iteration " << it;
  }
}

// Node 0's ranks close right after their last wait while node 1's ranks have
// not read their last results: node 1 must still get them.
TEST_P(TwoNodes, CleanCloseOnOneNodeLeavesTheOtherNodesWorkIntact) {
  start(1);
  const std::string spec = "f32:1,f32:300000";
  std::vector<std::unique_ptr<Process>> w;
  for (int n = 0; n < 2; ++n) {
    for (int r = 0; r < 2; ++r) {
      std::vector<std::string> extra{"--node", std::to_string(n) + "/2"};
      if (n == 1) extra.insert(extra.end(), {"--linger", "600"});
      w.push_back(nodes_[n]->worker("linger", r, 2, 15, spec, extra));
    }
  }
  for (auto& p : w) expect_ok(*p);
  for (auto& n : nodes_) {
    EXPECT_EQ(n->daemon().output().find("aborted"), std::string::npos) << n->daemon().output();
  }
}

// bytecomp_set_strategy in a multi-node job: the coordinator distributes one
// strategy, so nodes with different texts are refused, naming the nodes; an
// agreeing job's strategy is the one the nodes run.
TEST_P(TwoNodes, PerJobStrategyMustAgreeAcrossNodes) {
  start(1);
  write("a.yaml", "version: 1\ndefault: {compressor: none, inter: reduce_broadcast}\n");
  write("b.yaml", "version: 1\ndefault: {compressor: none}\n");
  const std::string spec = "f32:1000";
  {
    std::vector<std::unique_ptr<Process>> w;
    for (int n = 0; n < 2; ++n) {
      for (int r = 0; r < 2; ++r) {
        w.push_back(nodes_[n]->worker(
            "differ", r, 2, 3, spec,
            {"--node", std::to_string(n) + "/2", "--strategy",
             (dir_ / (n == 0 ? "a.yaml" : "b.yaml")).string()}));
      }
    }
    for (auto& p : w) {
      auto st = p->wait(30s);
      ASSERT_TRUE(st.has_value()) << p->output();
      EXPECT_NE(*st, 0) << p->output();
      // Named in the order the nodes registered.
      const std::string out = p->output();
      EXPECT_NE(out.find("the strategy differs on node 10"), std::string::npos) << out;
      EXPECT_NE(out.find("node 100 (rank 0)"), std::string::npos) << out;
      EXPECT_NE(out.find("node 101 (rank 1)"), std::string::npos) << out;
    }
  }
  {
    // Agreeing texts: the job runs, with exact sums.
    std::vector<std::unique_ptr<Process>> w;
    for (int n = 0; n < 2; ++n) {
      for (int r = 0; r < 2; ++r) {
        w.push_back(nodes_[n]->worker("agree", r, 2, 10, spec,
                                      {"--node", std::to_string(n) + "/2", "--strategy",
                                       (dir_ / "a.yaml").string()}));
      }
    }
    for (auto& p : w) expect_ok(*p);
  }
  {
    // The job's text, not the daemons' default, decides: this one sends
    // every tensor by peer allgather (topk keeping every element: exact).
    write("g.yaml", "version: 1\ndefault: {compressor: topk, params: {ratio: '1'}, inter: allgather}\n");
    std::vector<std::unique_ptr<Process>> w;
    for (int n = 0; n < 2; ++n) {
      for (int r = 0; r < 2; ++r) {
        w.push_back(nodes_[n]->worker("gather", r, 2, 5, spec,
                                      {"--node", std::to_string(n) + "/2", "--strategy",
                                       (dir_ / "g.yaml").string()}));
      }
    }
    for (auto& p : w) expect_ok(*p);
    EXPECT_NE(nodes_[0]->daemon().output().find("allgather with 1 peer daemon"), std::string::npos)
        << nodes_[0]->daemon().output();
  }
  for (auto& n : nodes_) EXPECT_TRUE(no_shm_left(n->shm_prefix()));
}

// The nodes start their partitions in different orders (priority order is
// local: node 0 has only 'b' ready when node 1 has both), with a bytes-in-
// flight bound of one partition. Every node must still push every partition:
// a bound that held bytes until their pull answered would leave node 0
// waiting for 'b' (which needs node 1's push of 'b') and node 1 waiting for
// 'a' (which needs node 0's push of 'a') until the request deadline.
TEST_P(TwoNodes, DifferentPartitionOrdersOnTheNodesDoNotDeadlock) {
  start(1, "", "  partition_bytes: 256KiB\n  max_inflight_bytes: 256KiB\n");
  constexpr uint64_t kN = 65536;  // one 256 KiB partition per tensor
  constexpr int kIters = 3;
  auto run = [&](uint32_t node) {
    bytecomp_client* c = connect_client(node, 0, "order", 1);
    ASSERT_NE(c, nullptr);
    uint32_t ids[2];
    float* p[2];
    for (int k = 0; k < 2; ++k) {
      ASSERT_EQ(bytecomp_declare_tensor(c, k == 0 ? "a" : "b", kN, BYTECOMP_FLOAT32,
                                        BYTECOMP_DEVICE_CPU, 0, &ids[k]),
                BYTECOMP_OK);
    }
    ASSERT_EQ(bytecomp_start(c, 30000), BYTECOMP_OK) << bytecomp_last_error();
    for (int k = 0; k < 2; ++k) {
      uint64_t bytes = 0;
      ASSERT_EQ(bytecomp_tensor_buffer(c, ids[k], reinterpret_cast<void**>(&p[k]), &bytes),
                BYTECOMP_OK);
    }
    for (uint64_t it = 0; it < kIters; ++it) {
      // Iteration 0 in the same order on both nodes (the engines have joined
      // the servers after it); later ones crossed.
      const bool crossed = it > 0 && node == 0;
      bytecomp_handle hs[2];
      for (int j = 0; j < 2; ++j) {
        const int k = crossed ? 1 - j : j;
        for (uint64_t i = 0; i < kN; ++i) p[k][i] = grad(node * 2 + static_cast<uint32_t>(k), it, i);
        ASSERT_EQ(bytecomp_push_pull(c, ids[k], it, &hs[k]), BYTECOMP_OK);
        if (crossed && j == 0) std::this_thread::sleep_for(400ms);  // 'b' alone for a while
      }
      for (int k = 0; k < 2; ++k) {
        ASSERT_EQ(bytecomp_wait(c, hs[k], 30000), BYTECOMP_OK)
            << "node " << node << " tensor " << k << " iteration " << it << ": "
            << bytecomp_last_error();
        size_t mismatches = 0;
        for (uint64_t i = 0; i < kN; ++i) {
          mismatches += p[k][i] != grad(static_cast<uint32_t>(k), it, i) + grad(2 + static_cast<uint32_t>(k), it, i);
        }
        EXPECT_EQ(mismatches, 0u) << "node " << node << " tensor " << k << " iteration " << it;
      }
    }
    bytecomp_close(c);
  };
  auto other = std::async(std::launch::async, run, 1);
  run(0);
  other.get();
  for (auto& n : nodes_) EXPECT_TRUE(no_shm_left(n->shm_prefix()));
}

// Ending a multi-node job tells the coordinator without waiting for its
// answer on the daemon's control thread: with the coordinator stopped
// (SIGSTOP), a single-node job on the same daemon is served at once. (The
// leave used to block the control thread until the coordinator answered,
// the peer was declared lost — 3 s here — or 2 s passed.)
TEST_P(TwoNodes, JobEndDoesNotStallTheDaemonWhenTheCoordinatorIsUnresponsive) {
  start(1);
  constexpr uint64_t kN = 1000;
  bytecomp_client* c[2] = {nullptr, nullptr};
  auto join = [&](uint32_t node) {
    c[node] = connect_client(node, 0, "stall", 1);
    ASSERT_NE(c[node], nullptr);
    uint32_t id = 0;
    ASSERT_EQ(bytecomp_declare_tensor(c[node], "w", kN, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, &id),
              BYTECOMP_OK);
    ASSERT_EQ(bytecomp_start(c[node], 30000), BYTECOMP_OK) << bytecomp_last_error();
    bytecomp_handle h = 0;
    ASSERT_EQ(bytecomp_push_pull(c[node], id, 0, &h), BYTECOMP_OK);
    ASSERT_EQ(bytecomp_wait(c[node], h, 30000), BYTECOMP_OK) << bytecomp_last_error();
  };
  auto other = std::async(std::launch::async, join, 1);
  join(0);
  other.get();
  ASSERT_NE(c[0], nullptr);
  ASSERT_NE(c[1], nullptr);
  servers_[0]->signal(SIGSTOP);
  bytecomp_close(c[0]);  // node 0's job ends: its leave goes to a stopped coordinator
  const auto t0 = std::chrono::steady_clock::now();
  bytecomp_connect_options o;
  bytecomp_connect_options_init(&o);
  o.socket_path = nodes_[0]->socket().c_str();
  o.job_id = "local";
  o.local_size = 1;
  bytecomp_client* local = nullptr;
  bool served = false;
  if (bytecomp_connect(&o, &local) == BYTECOMP_OK) {
    uint32_t id = 0;
    bytecomp_handle h = 0;
    served = bytecomp_declare_tensor(local, "x", 4, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, &id) ==
                 BYTECOMP_OK &&
             bytecomp_start(local, 10000) == BYTECOMP_OK &&
             bytecomp_push_pull(local, id, 0, &h) == BYTECOMP_OK &&
             bytecomp_wait(local, h, 10000) == BYTECOMP_OK;
    if (!served) ADD_FAILURE() << bytecomp_last_error();
    bytecomp_close(local);
  }
  const auto took = std::chrono::steady_clock::now() - t0;
  servers_[0]->signal(SIGCONT);
  bytecomp_close(c[1]);
  EXPECT_TRUE(served);
  EXPECT_LT(took, 500ms) << "a single-node job waited "
                         << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                         << " ms behind the leave of another job";
  for (auto& n : nodes_) EXPECT_TRUE(no_shm_left(n->shm_prefix()));
}

// Issue 28 (5): right after a coordinator comes back (here: SIGCONT after
// both daemons declared it lost; in the chaos runs: a healed partition) the
// daemons still hold it as lost until its heartbeats arrive. A job started
// then used to fail at once on one node ("node 0 is lost") while the other
// node, registered, waited for it until admission_ms (10 s here). Now a join
// waits (bounded) for a lost coordinator to come back: the job runs, and
// starts well within admission_ms.
TEST_P(TwoNodes, AJobRightAfterTheCoordinatorComesBackIsAdmittedWithoutWaitingAdmissionMs) {
  peer_timeout_ms_ = 1000;
  start(1);
  servers_[0]->signal(SIGSTOP);
  // Both daemons declare the coordinator lost.
  const auto lost_by = std::chrono::steady_clock::now() + 10s;
  auto lost_on = [&](int n) {
    return nodes_[n]->daemon().output().find("sent nothing for 1000 ms") != std::string::npos;
  };
  while (!(lost_on(0) && lost_on(1)) && std::chrono::steady_clock::now() < lost_by)
    std::this_thread::sleep_for(20ms);
  const bool lost = lost_on(0) && lost_on(1);
  servers_[0]->signal(SIGCONT);
  ASSERT_TRUE(lost) << nodes_[0]->daemon().output() << nodes_[1]->daemon().output();
  const auto t0 = std::chrono::steady_clock::now();
  constexpr uint64_t kN = 1000;
  std::chrono::steady_clock::duration started[2]{};
  auto run = [&](uint32_t node) {
    bytecomp_client* c = connect_client(node, 0, "healed", 1);
    ASSERT_NE(c, nullptr);
    uint32_t id = 0;
    ASSERT_EQ(bytecomp_declare_tensor(c, "w", kN, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, &id),
              BYTECOMP_OK);
    ASSERT_EQ(bytecomp_start(c, 30000), BYTECOMP_OK) << bytecomp_last_error();
    started[node] = std::chrono::steady_clock::now() - t0;
    float* p = nullptr;
    uint64_t bytes = 0;
    ASSERT_EQ(bytecomp_tensor_buffer(c, id, reinterpret_cast<void**>(&p), &bytes), BYTECOMP_OK);
    for (uint64_t i = 0; i < kN; ++i) p[i] = static_cast<float>(node + 1);
    bytecomp_handle h = 0;
    ASSERT_EQ(bytecomp_push_pull(c, id, 0, &h), BYTECOMP_OK);
    ASSERT_EQ(bytecomp_wait(c, h, 30000), BYTECOMP_OK) << bytecomp_last_error();
    EXPECT_EQ(p[kN - 1], 3.0f);
    EXPECT_EQ(bytecomp_close(c), BYTECOMP_OK) << bytecomp_last_error();
  };
  auto other = std::async(std::launch::async, run, 1);
  run(0);
  other.get();
  for (int n = 0; n < 2; ++n)
    EXPECT_LT(started[n], 5s) << "node " << n << " started after "
                              << std::chrono::duration_cast<std::chrono::milliseconds>(started[n]).count()
                              << " ms (admission_ms is 10000)\n" << nodes_[n]->daemon().output();
  for (auto& n : nodes_) EXPECT_TRUE(no_shm_left(n->shm_prefix()));
}

// One instantiation for every TEST_P of the fixture (internode_test.cc and
// peer_test.cc): each runs once per transport backend of the build.
INSTANTIATE_TEST_SUITE_P(Backends, TwoNodes,
                         ::testing::ValuesIn(bytecomp::transport::available_backends()),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });
