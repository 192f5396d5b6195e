// Tensor fusion through real processes (issue 25 part 3): two bytecompd with
// two local ranks each, two bytecomp-server (server 0 coordinates), many
// small tensors on push/pull (fp32, fp16) and on the daemons' ring (fp32,
// bf16) next to compressed ones, run once with fusion off and once on: the
// fused results must be the unfused ones bit for bit wherever fusing cannot
// change the arithmetic, and the servers must have run fewer rounds.
#include <bytecomp/bytecomp.h>
#include <gtest/gtest.h>

#include <barrier>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <future>
#include <regex>

#include "compress/reduce.h"
#include "server/cluster_config.h"
#include "server/ps_client.h"
#include "tests/daemon/harness.h"
#include "transport/transport.h"

using namespace bctest;
namespace cz = bytecomp::compress;

namespace {

class FusionNodes : public ::testing::TestWithParam<std::string> {
 public:
  void SetUp() override {
    std::string reason;
    if (!bytecomp::transport::backend_usable(GetParam(), &reason)) GTEST_SKIP() << reason;
  }
  std::string endpoint() const {
    return (GetParam() == "rdma" ? "rdma://" : "tcp://") + std::string("127.0.0.1:0");
  }
  void write(const std::string& name, const std::string& text) { std::ofstream(dir_ / name) << text; }
  std::string cluster(const std::string& coordinator, const std::string& second) const {
    std::string s = "version: 1\ncluster:\n  coordinator: 0\n  partition_bytes: 256KiB\n  servers:\n"
                    "    - {id: 0, address: \"" + coordinator + "\"}\n"
                    "    - {id: 1, address: \"" + second + "\"}\n"
                    "  daemons:\n    - {id: 100}\n    - {id: 101}\n"
                    "  timeouts: {admission_ms: 10000, request_ms: 10000, setup_ms: 5000}\n"
                    "transport: {backend: " + GetParam() +
                    ", heartbeat_interval_ms: 100, peer_timeout_ms: 3000, io_threads: 1}\n";
    return s;
  }
  // Two servers, two daemons with a peer endpoint, the strategy file and
  // `fusion` (the daemons' fusion section, "" for none).
  void start(const std::string& strategy_yaml, const std::string& fusion) {
    dir_ = fs::temp_directory_path() / ("bcd-fusion-" + std::to_string(::getpid()) + "-" +
                                        std::to_string(counter_++));
    fs::create_directories(dir_);
    std::string coordinator, second;
    for (int s = 0; s < 2; ++s) {
      write("server-cluster.yaml", cluster(s == 0 ? endpoint() : coordinator, endpoint()));
      const std::string ready = (dir_ / ("ready" + std::to_string(s))).string();
      write("server" + std::to_string(s) + ".yaml",
            "version: 1\nserver: {node_id: " + std::to_string(s) +
                ", cluster_file: server-cluster.yaml, engine_threads: 1}\ntransport: {backend: " +
                GetParam() + ", heartbeat_interval_ms: 100, peer_timeout_ms: 3000, io_threads: 1}\n");
      servers_.push_back(std::make_unique<Process>(
          std::vector<std::string>{build_root() + "/server/bytecomp-server", "--config",
                                   (dir_ / ("server" + std::to_string(s) + ".yaml")).string(),
                                   "--ready-file", ready},
          dir_ / ("server" + std::to_string(s) + ".log")));
      const auto deadline = std::chrono::steady_clock::now() + 15s;
      while (!fs::exists(ready) || read_file(ready).find('\n') == std::string::npos) {
        ASSERT_LT(std::chrono::steady_clock::now(), deadline) << servers_.back()->output();
        ASSERT_FALSE(servers_.back()->wait(0ms).has_value()) << servers_.back()->output();
        std::this_thread::sleep_for(10ms);
      }
      std::string a = read_file(ready);
      a.erase(a.find_last_not_of('\n') + 1);
      (s == 0 ? coordinator : second) = a;
    }
    write("cluster.yaml", cluster(coordinator, second));
    write("strategy.yaml", strategy_yaml);
    for (uint32_t k = 0; k < 2; ++k) {
      nodes_.push_back(std::make_unique<DaemonEnv>("fuse" + std::to_string(k)));
      nodes_[k]->write_config("internode:\n  cluster_file: " + (dir_ / "cluster.yaml").string() +
                              "\n  node_id: " + std::to_string(100 + k) +
                              "\n  nodes: [100, 101]\n  peer_listen: " + endpoint() +
                              "\n  ring_chunk_bytes: 16384\nstrategy:\n  file: " +
                              (dir_ / "strategy.yaml").string() + "\n" + fusion);
      nodes_[k]->start();
    }
  }
  void stop() {
    nodes_.clear();
    for (auto& s : servers_) {
      s->signal(SIGTERM);
      (void)s->wait(10s);
    }
    servers_.clear();
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  void TearDown() override { stop(); }
  bytecomp_client* connect_client(uint32_t node, uint32_t rank, const char* job) {
    bytecomp_connect_options o;
    bytecomp_connect_options_init(&o);
    o.socket_path = nodes_[node]->socket().c_str();
    o.job_id = job;
    o.local_rank = rank;
    o.local_size = 2;
    o.node_rank = node;
    o.num_nodes = 2;
    bytecomp_client* c = nullptr;
    if (bytecomp_connect(&o, &c) != BYTECOMP_OK) {
      ADD_FAILURE() << "connect to node " << node << ": " << bytecomp_last_error();
      return nullptr;
    }
    return c;
  }
  const std::vector<std::unique_ptr<DaemonEnv>>& nodes() const { return nodes_; }
  template <class Fn>
  void on_every_rank(const Fn& fn) {
    std::vector<std::future<void>> others;
    for (uint32_t g = 1; g < 4; ++g)
      others.push_back(std::async(std::launch::async, [&fn, g] { fn(g / 2, g % 2); }));
    fn(0u, 0u);
    for (auto& f : others) f.get();
  }
  uint64_t rounds_completed(uint32_t server) {
    namespace sv = bytecomp::server;
    sv::ClusterConfig c = sv::load_cluster_config((dir_ / "cluster.yaml").string());
    bytecomp::transport::TransportConfig tc = c.transport;
    tc.node_id = 150;
    tc.listen = {};
    return sv::PsClient::create(c, tc)->stats(server).rounds_completed;
  }

  static inline int counter_ = 0;
  fs::path dir_;
  std::vector<std::unique_ptr<Process>> servers_;
  std::vector<std::unique_ptr<DaemonEnv>> nodes_;
};

float grad(uint32_t grank, uint64_t it, uint64_t i, uint32_t t) {
  return static_cast<float>(std::sin(0.11 * static_cast<double>(i) + 0.7 * static_cast<double>(it) +
                                     1.9 * grank + 0.37 * t)) *
         static_cast<float>(1 + (i + t) % 9);
}

const char* kStrategy =
    "version: 1\ndefault: {compressor: none}\nrules:\n"
    "  - match: 'h*'\n    option: {compressor: fp16, inter: reduce_scatter_allgather}\n"
    "  - match: 'd*'\n    option: {compressor: fp16, inter: alltoall_allgather}\n"
    "  - match: 'r*'\n    option: {compressor: none, inter: allreduce}\n"
    "  - match: 'b*'\n    option: {compressor: bf16, inter: allreduce}\n"
    "  - match: 'k*'\n    option: {compressor: topk, params: {ratio: '0.25'}, inter: "
    "alltoall_allgather}\n";

struct T {
  std::string name;
  uint64_t count;
};

// Many small tensors of every kind, one above the cap (alone), sizes 1, odd,
// and across the 256 KiB partition.
std::vector<T> job_tensors() {
  std::vector<T> ts;
  const uint64_t sizes[] = {1, 7, 100, 333, 1000, 4097, 9, 2500, 64, 65, 17, 1023};
  const char* kinds[] = {"p", "h", "d", "r", "b", "k"};
  for (int rep = 0; rep < 2; ++rep)
    for (const char* k : kinds)
      for (size_t s = 0; s < std::size(sizes); s += 2)
        ts.push_back({std::string(k) + std::to_string(ts.size()), sizes[(s + rep) % std::size(sizes)]});
  ts.push_back({"p_large", 300000});  // 1.2 MB: above the 1 MiB cap below
  ts.push_back({"r_large", 70001});   // 280 KB, across partitions, fused
  return ts;
}

// got[node][tensor][iteration]
using Results = std::vector<std::vector<std::vector<std::vector<float>>>>;

Results run_job(FusionNodes& f, const char* job, const std::vector<T>& ts, int iters) {
  Results got(2, std::vector<std::vector<std::vector<float>>>(ts.size()));
  auto run = [&](uint32_t node, uint32_t rank) {
    bytecomp_client* c = f.connect_client(node, rank, job);
    ASSERT_NE(c, nullptr);
    std::vector<uint32_t> ids(ts.size());
    for (size_t k = 0; k < ts.size(); ++k) {
      ASSERT_EQ(bytecomp_declare_tensor(c, ts[k].name.c_str(), ts[k].count, BYTECOMP_FLOAT32,
                                        BYTECOMP_DEVICE_CPU, 0, &ids[k]),
                BYTECOMP_OK);
    }
    ASSERT_EQ(bytecomp_start(c, 30000), BYTECOMP_OK) << bytecomp_last_error();
    const uint32_t grank = node * 2 + rank;
    for (uint64_t it = 0; it < static_cast<uint64_t>(iters); ++it) {
      std::vector<bytecomp_handle> hs(ts.size());
      std::vector<float*> p(ts.size());
      // Backward's order (last declared first) on node 0, declaration
      // order on node 1: a bucket starts once all its members are in.
      for (size_t j = 0; j < ts.size(); ++j) {
        const size_t k = node == 0 ? ts.size() - 1 - j : j;
        uint64_t bytes = 0;
        ASSERT_EQ(bytecomp_tensor_buffer(c, ids[k], reinterpret_cast<void**>(&p[k]), &bytes),
                  BYTECOMP_OK);
        for (uint64_t i = 0; i < ts[k].count; ++i) p[k][i] = grad(grank, it, i, k);
        ASSERT_EQ(bytecomp_push_pull(c, ids[k], it, &hs[k]), BYTECOMP_OK);
      }
      for (size_t k = 0; k < ts.size(); ++k) {
        ASSERT_EQ(bytecomp_wait(c, hs[k], 30000), BYTECOMP_OK) << bytecomp_last_error();
        if (rank == 0) got[node][k].emplace_back(p[k], p[k] + ts[k].count);
      }
    }
    bytecomp_close(c);
  };
  f.on_every_rank(run);
  return got;
}

}  // namespace

TEST_P(FusionNodes, FusedResultsEqualUnfusedOnPushPullAndRing) {
  const std::vector<T> ts = job_tensors();
  constexpr int kIters = 3;
  start(kStrategy, "");
  if (HasFatalFailure()) return;
  const Results plain = run_job(*this, "plain", ts, kIters);
  ASSERT_FALSE(HasFailure());
  const uint64_t plain_rounds = rounds_completed(0) + rounds_completed(1);
  stop();

  start(kStrategy, "fusion: {enabled: true, first_bucket_bytes: 8KiB, bucket_cap_bytes: 1MiB}\n");
  if (HasFatalFailure()) return;
  const Results fused = run_job(*this, "fused", ts, kIters);
  ASSERT_FALSE(HasFailure());
  const uint64_t fused_rounds = rounds_completed(0) + rounds_completed(1);
  for (auto& n : nodes_) {
    EXPECT_NE(n->daemon().output().find("fused buckets hold"), std::string::npos)
        << n->daemon().output();
    EXPECT_EQ(n->daemon().output().find("aborted"), std::string::npos) << n->daemon().output();
  }
  // Fewer server rounds: the buckets replace their members' partitions.
  EXPECT_LT(fused_rounds, plain_rounds) << "fused " << fused_rounds << ", plain " << plain_rounds;

  size_t ring16_differ = 0, ring16_total = 0;
  for (size_t k = 0; k < ts.size(); ++k) {
    const char kind = ts[k].name[0];
    for (int it = 0; it < kIters; ++it) {
      size_t differ = 0, nodes_differ = 0;
      for (uint64_t i = 0; i < ts[k].count; ++i) {
        differ += std::memcmp(&plain[0][k][it][i], &fused[0][k][it][i], 4) != 0;
        nodes_differ += std::memcmp(&fused[0][k][it][i], &fused[1][k][it][i], 4) != 0;
        if (kind == 'b') {
          // bf16 on the ring rounds at each hop, and which node sends first
          // depends on the element's segment, which fusing moves: both
          // results are within the ring's bound of the exact sum (one bf16
          // half-ulp per rounding, of the node sums' magnitudes).
          const float a = plain[0][k][it][i], b = fused[0][k][it][i];
          const auto t = static_cast<uint32_t>(k);
          const float x0 = grad(0, it, i, t) + grad(1, it, i, t);
          const float x1 = grad(2, it, i, t) + grad(3, it, i, t);
          const float tol = std::ldexp(std::fabs(x0) + std::fabs(x1), -6);
          EXPECT_LE(std::fabs(a - b), tol) << ts[k].name << "[" << i << "]";
        }
      }
      EXPECT_EQ(nodes_differ, 0u) << ts[k].name << " iteration " << it << ": nodes differ";
      if (kind == 'b') {
        ring16_differ += differ;
        ring16_total += ts[k].count;
      } else {
        // none (servers and ring), fp16 through the servers (elementwise
        // casts, server sums elementwise) and topk (never fused): bit for bit.
        EXPECT_EQ(differ, 0u) << ts[k].name << " iteration " << it;
      }
    }
  }
  std::cout << "[ fusion ] server rounds plain " << plain_rounds << ", fused " << fused_rounds
            << "; bf16 ring elements differing from unfused: " << ring16_differ << " of "
            << ring16_total << "\n";
}

// With buckets, a strategy change that keeps every bucket's members on one
// fusable plan applies at one iteration on every node; one that would split
// a bucket is refused by the coordinator naming the tensor and the bucket,
// and the job carries on under its plans.
TEST_P(FusionNodes, StrategySwitchWithBucketsAppliesOrIsRefusedNamingTheBucket) {
  start("version: 1\ndefault: {compressor: none}\n",
        "fusion: {enabled: true, first_bucket_bytes: 1MiB, bucket_cap_bytes: 1MiB}\n");
  if (HasFatalFailure()) return;
  const uint64_t counts[] = {1000, 3, 4097, 250, 77};
  constexpr size_t kT = std::size(counts);
  constexpr int kIters = 10;
  std::vector<std::vector<float>> got[kT];
  std::barrier sync(4);
  int64_t switch_at = -1;
  bool refused = false;
  auto switch_to = [&](const std::string& yaml, const std::string& needle) {
    write("strategy.yaml", yaml);
    nodes_[0]->daemon().signal(SIGHUP);
    return nodes_[0]->daemon().wait_output(needle, 10s);
  };
  auto run = [&](uint32_t node, uint32_t rank) {
    bytecomp_client* c = connect_client(node, rank, "switch");
    ASSERT_NE(c, nullptr);
    uint32_t ids[kT];
    for (size_t k = 0; k < kT; ++k) {
      ASSERT_EQ(bytecomp_declare_tensor(c, ("w" + std::to_string(k)).c_str(), counts[k],
                                        BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, &ids[k]),
                BYTECOMP_OK);
    }
    ASSERT_EQ(bytecomp_start(c, 30000), BYTECOMP_OK) << bytecomp_last_error();
    const uint32_t grank = node * 2 + rank;
    for (uint64_t it = 0; it < kIters; ++it) {
      if (it == 3 || it == 5) {
        sync.arrive_and_wait();
        if (grank == 0 && it == 3) {
          refused = switch_to("version: 1\ndefault: {compressor: none}\nentries:\n"
                              "  - {tensor: w2, option: {compressor: fp16, inter: "
                              "alltoall_allgather}}\n",
                              "is fused into bucket");
        }
        if (grank == 0 && it == 5) {
          EXPECT_TRUE(switch_to("version: 1\ndefault: {compressor: fp16, inter: "
                                "alltoall_allgather}\n",
                                "applies on every node from iteration"))
              << nodes_[0]->daemon().output();
          std::smatch mt;
          const std::string log = nodes_[0]->daemon().output();
          if (std::regex_search(log, mt, std::regex("from iteration ([0-9]+)")))
            switch_at = std::stoll(mt[1]);
        }
        sync.arrive_and_wait();
      }
      bytecomp_handle hs[kT];
      float* p[kT];
      for (size_t j = 0; j < kT; ++j) {
        const size_t k = kT - 1 - j;
        uint64_t bytes = 0;
        ASSERT_EQ(bytecomp_tensor_buffer(c, ids[k], reinterpret_cast<void**>(&p[k]), &bytes),
                  BYTECOMP_OK);
        for (uint64_t i = 0; i < counts[k]; ++i) p[k][i] = grad(grank, it, i, k);
        ASSERT_EQ(bytecomp_push_pull(c, ids[k], it, &hs[k]), BYTECOMP_OK);
      }
      for (size_t k = 0; k < kT; ++k) {
        ASSERT_EQ(bytecomp_wait(c, hs[k], 30000), BYTECOMP_OK) << bytecomp_last_error();
        if (grank == 0) got[k].emplace_back(p[k], p[k] + counts[k]);
      }
    }
    bytecomp_close(c);
  };
  on_every_rank(run);
  ASSERT_FALSE(HasFailure());
  EXPECT_TRUE(refused) << nodes_[0]->daemon().output();
  EXPECT_NE(nodes_[0]->daemon().output().find("tensor 'w2' is fused into bucket"),
            std::string::npos)
      << nodes_[0]->daemon().output();
  ASSERT_GE(switch_at, 5);
  ASSERT_LT(switch_at, kIters);
  auto h = [](float v) { return cz::fp16_to_fp32(cz::fp32_to_fp16(v)); };
  for (size_t k = 0; k < kT; ++k) {
    ASSERT_EQ(got[k].size(), static_cast<size_t>(kIters));
    for (int it = 0; it < kIters; ++it) {
      size_t mismatches = 0;
      for (uint64_t i = 0; i < counts[k]; ++i) {
        const auto t = static_cast<uint32_t>(k);
        const float s0 = grad(0, it, i, t) + grad(1, it, i, t);
        const float s1 = grad(2, it, i, t) + grad(3, it, i, t);
        // Before the switch: the exact fp32 sum in the servers' order.
        const float expect = it >= switch_at ? h(h(s0) + h(s1)) : s0 + s1;
        mismatches += std::memcmp(&got[k][it][i], &expect, 4) != 0;
      }
      EXPECT_EQ(mismatches, 0u) << "w" << k << " iteration " << it << " (switch at " << switch_at
                                << ")";
    }
  }
}

// A fusion section the daemons disagree on fails the job on both nodes
// naming the difference (the coordinator compares the registrations).
TEST_P(FusionNodes, NodesWithDifferentFusionSettingsAreRefused) {
  start("version: 1\ndefault: {compressor: none}\n", "");
  if (HasFatalFailure()) return;
  nodes_[1]->daemon().signal(SIGTERM);
  (void)nodes_[1]->daemon().wait(10s);
  nodes_[1] = std::make_unique<DaemonEnv>("fuse1b");
  nodes_[1]->write_config("internode:\n  cluster_file: " + (dir_ / "cluster.yaml").string() +
                          "\n  node_id: 101\n  nodes: [100, 101]\n  peer_listen: " + endpoint() +
                          "\nstrategy:\n  file: " + (dir_ / "strategy.yaml").string() +
                          "\nfusion: {enabled: true}\n");
  nodes_[1]->start();
  std::string errors[2];
  auto run = [&](uint32_t node, uint32_t rank) {
    bytecomp_client* c = connect_client(node, rank, "differ");
    ASSERT_NE(c, nullptr);
    uint32_t id = 0;
    ASSERT_EQ(bytecomp_declare_tensor(c, "w", 10, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, &id),
              BYTECOMP_OK);
    const bytecomp_status s = bytecomp_start(c, 30000);
    bytecomp_handle hd = 0;
    bytecomp_status w = s;
    if (w == BYTECOMP_OK) w = bytecomp_push_pull(c, id, 0, &hd);
    if (w == BYTECOMP_OK) w = bytecomp_wait(c, hd, 30000);
    if (rank == 0) errors[node] = w == BYTECOMP_OK ? "" : bytecomp_last_error();
    bytecomp_close(c);
  };
  on_every_rank(run);
  for (int n = 0; n < 2; ++n)
    EXPECT_NE(errors[n].find("tensor fusion differs"), std::string::npos)
        << n << ": " << errors[n] << "\n" << nodes_[n]->daemon().output();
}

// A fused tensor keeps its own partitions for broadcasts (the servers keep
// their broadcast rounds, without a sum round): after a fused push_pull,
// a broadcast of one member from the last rank reaches every rank.
TEST_P(FusionNodes, BroadcastOfAFusedTensorAfterAFusedPushPull) {
  start("version: 1\ndefault: {compressor: none}\n", "fusion: {enabled: true}\n");
  if (HasFatalFailure()) return;
  const uint64_t counts[] = {300, 70001, 5};
  constexpr size_t kT = std::size(counts);
  std::vector<float> got[4];
  auto run = [&](uint32_t node, uint32_t rank) {
    bytecomp_client* c = connect_client(node, rank, "bcast");
    ASSERT_NE(c, nullptr);
    uint32_t ids[kT];
    for (size_t k = 0; k < kT; ++k) {
      ASSERT_EQ(bytecomp_declare_tensor(c, ("w" + std::to_string(k)).c_str(), counts[k],
                                        BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, &ids[k]),
                BYTECOMP_OK);
    }
    ASSERT_EQ(bytecomp_start(c, 30000), BYTECOMP_OK) << bytecomp_last_error();
    const uint32_t grank = node * 2 + rank;
    float* p[kT];
    bytecomp_handle hs[kT];
    for (size_t k = 0; k < kT; ++k) {
      uint64_t bytes = 0;
      ASSERT_EQ(bytecomp_tensor_buffer(c, ids[k], reinterpret_cast<void**>(&p[k]), &bytes),
                BYTECOMP_OK);
      for (uint64_t i = 0; i < counts[k]; ++i) p[k][i] = static_cast<float>((i + grank) % 50);
      ASSERT_EQ(bytecomp_push_pull(c, ids[k], 0, &hs[k]), BYTECOMP_OK);
    }
    for (size_t k = 0; k < kT; ++k) {
      ASSERT_EQ(bytecomp_wait(c, hs[k], 30000), BYTECOMP_OK) << bytecomp_last_error();
      for (uint64_t i = 0; i < counts[k]; ++i) {
        float e = 0;
        for (uint32_t g = 0; g < 4; ++g) e += static_cast<float>((i + g) % 50);
        ASSERT_EQ(p[k][i], e) << "w" << k << "[" << i << "]";
      }
    }
    // Tensor 1 from global rank 3.
    for (uint64_t i = 0; i < counts[1]; ++i) p[1][i] = grank == 3 ? static_cast<float>(i) : -1.0f;
    bytecomp_handle hb = 0;
    ASSERT_EQ(bytecomp_broadcast(c, ids[1], 1, 3, counts[1] * 4, 7, &hb), BYTECOMP_OK);
    ASSERT_EQ(bytecomp_wait(c, hb, 30000), BYTECOMP_OK) << bytecomp_last_error();
    got[grank].assign(p[1], p[1] + counts[1]);
    bytecomp_close(c);
  };
  on_every_rank(run);
  ASSERT_FALSE(HasFailure());
  EXPECT_NE(nodes_[0]->daemon().output().find("fused buckets hold"), std::string::npos)
      << nodes_[0]->daemon().output();
  for (uint32_t g = 0; g < 4; ++g) {
    ASSERT_EQ(got[g].size(), counts[1]);
    size_t bad = 0;
    for (uint64_t i = 0; i < counts[1]; ++i) bad += got[g][i] != static_cast<float>(i);
    EXPECT_EQ(bad, 0u) << "rank " << g;
  }
}

// Missing members (an unused parameter: tensor fusion has no
// find_unused_parameters). One bucket 'fused[0]:w4..w0' of five small
// tensors and 'solo', as large as a bucket, alone (unfused).
namespace {

const char* kMemberFusion =
    "fusion: {enabled: true, first_bucket_bytes: 4KiB, bucket_cap_bytes: 4KiB, "
    "member_timeout_ms: %d}\n";
constexpr uint64_t kMemberCount = 100;
constexpr uint64_t kSoloCount = 1024;  // 4 KiB: never fused

std::string member_fusion(int timeout_ms) {
  char buf[256];
  std::snprintf(buf, sizeof buf, kMemberFusion, timeout_ms);
  return buf;
}

// One rank's client with 'solo' (id 0) and w0..w4 (ids 1..5) declared.
struct MemberJob {
  bytecomp_client* c = nullptr;
  uint32_t ids[6] = {};
  float* p[6] = {};
  bytecomp_status first = BYTECOMP_OK;  // first failing call's status
  std::string error;                    // and its message

  bool open(FusionNodes& f, uint32_t node, uint32_t rank, const char* job) {
    c = f.connect_client(node, rank, job);
    if (c == nullptr) return false;
    for (uint32_t k = 0; k < 6; ++k) {
      const std::string name = k == 0 ? "solo" : "w" + std::to_string(k - 1);
      if (bytecomp_declare_tensor(c, name.c_str(), k == 0 ? kSoloCount : kMemberCount,
                                  BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, &ids[k]) != BYTECOMP_OK)
        return false;
    }
    if (bytecomp_start(c, 30000) != BYTECOMP_OK) return false;
    for (uint32_t k = 0; k < 6; ++k) {
      uint64_t bytes = 0;
      if (bytecomp_tensor_buffer(c, ids[k], reinterpret_cast<void**>(&p[k]), &bytes) !=
          BYTECOMP_OK)
        return false;
    }
    return true;
  }
  // Records the first failure; true while none happened.
  bool ok(bytecomp_status s) {
    if (s != BYTECOMP_OK && first == BYTECOMP_OK) {
      first = s;
      error = bytecomp_last_error();
    }
    return first == BYTECOMP_OK;
  }
  bool push(uint32_t k, uint64_t it, float v, bytecomp_handle& h) {
    for (uint64_t i = 0; i < (k == 0 ? kSoloCount : kMemberCount); ++i) p[k][i] = v;
    return ok(bytecomp_push_pull(c, ids[k], it, &h));
  }
  ~MemberJob() { bytecomp_close(c); }
};

// A fused job that pushes every member runs on both daemons: what the
// failure tests check after a failure (the daemons keep serving).
void expect_member_job_runs(FusionNodes& f, const char* job) {
  auto run = [&](uint32_t node, uint32_t rank) {
    MemberJob j;
    ASSERT_TRUE(j.open(f, node, rank, job)) << bytecomp_last_error();
    const auto grank = static_cast<float>(node * 2 + rank);
    for (uint64_t it = 0; it < 2; ++it) {
      bytecomp_handle h[6];
      for (uint32_t k = 6; k-- > 0;) ASSERT_TRUE(j.push(k, it, grank + 1, h[k])) << j.error;
      for (uint32_t k = 0; k < 6; ++k) {
        ASSERT_TRUE(j.ok(bytecomp_wait(j.c, h[k], 30000))) << j.error;
        EXPECT_EQ(j.p[k][0], 10.0f) << k;
      }
    }
  };
  f.on_every_rank(run);
}

// Every rank's job failed with BYTECOMP_ERR_ABORTED naming `needle`; the
// jobs are closed and nothing of them is left in /dev/shm.
void expect_every_rank_aborted(FusionNodes& f, MemberJob (&jobs)[4], const std::string& needle) {
  for (uint32_t g = 0; g < 4; ++g) {
    EXPECT_EQ(jobs[g].first, BYTECOMP_ERR_ABORTED) << g << ": " << jobs[g].error;
    EXPECT_NE(jobs[g].error.find(needle), std::string::npos) << g << ": " << jobs[g].error;
  }
  for (auto& j : jobs) {
    bytecomp_close(j.c);
    j.c = nullptr;
  }
  for (auto& n : f.nodes()) EXPECT_TRUE(no_shm_left(n->shm_prefix())) << n->daemon().output();
}

}  // namespace

// Node 1's ranks leave w2 out of iteration 1: after member_timeout_ms the
// job fails on every rank of both nodes naming w2, its bucket and the
// iteration; nothing is left in /dev/shm and both daemons run the next job.
TEST_P(FusionNodes, UnpushedMemberFailsEveryRankAfterTheMemberTimeout) {
  start("version: 1\ndefault: {compressor: none}\n", member_fusion(1000));
  if (HasFatalFailure()) return;
  MemberJob jobs[4];
  std::chrono::steady_clock::duration took[4];
  auto run = [&](uint32_t node, uint32_t rank) {
    MemberJob& j = jobs[node * 2 + rank];
    ASSERT_TRUE(j.open(*this, node, rank, "unused")) << bytecomp_last_error();
    for (uint64_t it = 0; it < 2; ++it) {
      const auto t0 = std::chrono::steady_clock::now();
      bytecomp_handle h[6] = {};
      for (uint32_t k = 6; k-- > 0;) {
        if (it == 1 && node == 1 && k == 3) continue;  // w2
        if (!j.push(k, it, 1.0f, h[k])) break;
      }
      // Without the member timeout every wait of iteration 1 times out.
      for (uint32_t k = 0; k < 6 && j.first == BYTECOMP_OK; ++k)
        if (h[k] != 0) j.ok(bytecomp_wait(j.c, h[k], 8000));
      took[node * 2 + rank] = std::chrono::steady_clock::now() - t0;
      if (it == 0) {
        ASSERT_EQ(j.first, BYTECOMP_OK) << j.error;
      }
    }
  };
  on_every_rank(run);
  ASSERT_FALSE(HasFatalFailure());
  expect_every_rank_aborted(*this, jobs,
                            "fused tensor 'w2' (bucket 'fused[0]:w4..w0', iteration 1) was "
                            "not pushed by local ranks 0, 1 of node rank 1 within "
                            "fusion.member_timeout_ms (1000 ms)");
  for (uint32_t g = 0; g < 4; ++g) EXPECT_LT(took[g], 6s) << g;
  expect_member_job_runs(*this, "after-unused");
  for (auto& n : nodes_) EXPECT_FALSE(n->daemon().wait(0ms).has_value()) << "still serving";
}

// One rank of node 1 leaves w2 out of iteration 1 and pushes 'solo' of
// iteration 2: the job fails at once (long before member_timeout_ms) on
// every rank, naming w2, the rank and the tensor of the later iteration.
TEST_P(FusionNodes, LaterIterationWhileABucketMissesAMemberFailsAtOnce) {
  start("version: 1\ndefault: {compressor: none}\n", member_fusion(60000));
  if (HasFatalFailure()) return;
  MemberJob jobs[4];
  std::chrono::steady_clock::duration took[4];
  auto run = [&](uint32_t node, uint32_t rank) {
    MemberJob& j = jobs[node * 2 + rank];
    ASSERT_TRUE(j.open(*this, node, rank, "moved-on")) << bytecomp_last_error();
    const bool skips = node == 1 && rank == 1;
    for (uint64_t it = 0; it < 2; ++it) {
      const auto t0 = std::chrono::steady_clock::now();
      bytecomp_handle h[6] = {};
      for (uint32_t k = 6; k-- > 0;) {
        if (it == 1 && skips && k == 3) continue;  // w2
        if (!j.push(k, it, 1.0f, h[k])) break;
      }
      if (it == 0) {
        for (uint32_t k = 0; k < 6; ++k) ASSERT_TRUE(j.ok(bytecomp_wait(j.c, h[k], 30000))) << j.error;
        continue;
      }
      // 'solo' is not fused: it completes, and its next iteration starts.
      bytecomp_handle next = 0;
      if (j.ok(bytecomp_wait(j.c, h[0], 30000)) && j.push(0, 2, 1.0f, next)) {
        for (uint32_t k = 1; k < 6 && j.first == BYTECOMP_OK; ++k)
          if (h[k] != 0) j.ok(bytecomp_wait(j.c, h[k], 8000));
      }
      took[node * 2 + rank] = std::chrono::steady_clock::now() - t0;
    }
  };
  on_every_rank(run);
  ASSERT_FALSE(HasFatalFailure());
  expect_every_rank_aborted(*this, jobs,
                            "fused tensor 'w2' (bucket 'fused[0]:w4..w0', iteration 1) was "
                            "not pushed by local rank 1 of node rank 1, which pushed tensor "
                            "'solo' of iteration 2 already");
  for (uint32_t g = 0; g < 4; ++g) EXPECT_LT(took[g], 6s) << g;
  expect_member_job_runs(*this, "after-moved-on");
  for (auto& n : nodes_) EXPECT_FALSE(n->daemon().wait(0ms).has_value()) << "still serving";
}

// A rank that waits for a fused tensor before pushing the rest of its
// bucket (against the documented rule) holds the bucket: after
// member_timeout_ms every rank gets the error naming the members it left.
TEST_P(FusionNodes, WaitBeforePushingTheRestOfTheBucketFailsAfterTheMemberTimeout) {
  start("version: 1\ndefault: {compressor: none}\n", member_fusion(1000));
  if (HasFatalFailure()) return;
  MemberJob jobs[4];
  auto run = [&](uint32_t node, uint32_t rank) {
    MemberJob& j = jobs[node * 2 + rank];
    ASSERT_TRUE(j.open(*this, node, rank, "waits-early")) << bytecomp_last_error();
    const bool early = node == 0 && rank == 1;
    bytecomp_handle h[6] = {};
    for (uint32_t k = 6; k-- > 0;) {
      if (!j.push(k, 0, 1.0f, h[k])) break;
      // Without the member timeout this waits out its own timeout.
      if (early && k == 3 && !j.ok(bytecomp_wait(j.c, h[k], 8000))) break;
    }
    for (uint32_t k = 0; k < 6 && j.first == BYTECOMP_OK; ++k)
      if (h[k] != 0) j.ok(bytecomp_wait(j.c, h[k], 8000));
  };
  on_every_rank(run);
  ASSERT_FALSE(HasFatalFailure());
  expect_every_rank_aborted(*this, jobs,
                            "fused tensors 'w1', 'w0' (bucket 'fused[0]:w4..w0', iteration "
                            "0) were not pushed by local rank 1 of node rank 0 within "
                            "fusion.member_timeout_ms (1000 ms)");
}

// A member pushed for an earlier iteration than the one its bucket collects
// fails the job at that push, naming both iterations (a bucket runs its
// members of one iteration). Node 1 pushes w4 and w3 for iteration 1 (the
// servers would refuse them: they collect iteration 0), then w2 for 0.
TEST_P(FusionNodes, MemberOfAnEarlierIterationThanItsBucketIsRefused) {
  start("version: 1\ndefault: {compressor: none}\n", member_fusion(60000));
  if (HasFatalFailure()) return;
  MemberJob jobs[4];
  auto run = [&](uint32_t node, uint32_t rank) {
    MemberJob& j = jobs[node * 2 + rank];
    ASSERT_TRUE(j.open(*this, node, rank, "stale")) << bytecomp_last_error();
    bytecomp_handle h[6] = {};
    for (uint32_t k = 6; k-- > 0;) {
      const uint64_t at = node == 1 && k != 3 ? 1 : 0;
      if (!j.push(k, at, 1.0f, h[k])) break;
    }
    for (uint32_t k = 0; k < 6 && j.first == BYTECOMP_OK; ++k)
      if (h[k] != 0) j.ok(bytecomp_wait(j.c, h[k], 8000));
  };
  on_every_rank(run);
  ASSERT_FALSE(HasFatalFailure());
  expect_every_rank_aborted(*this, jobs,
                            "pushed fused tensor 'w2' for iteration 0 while its bucket "
                            "'fused[0]:w4..w0' collects iteration 1");
}

// The member timeout counts per iteration from the bucket's first push: a
// job pausing between iterations longer than it, and pushing its members
// with gaps shorter than it, runs (a guard against a clock that keeps
// running across iterations; passes with or without the member timeout).
TEST_P(FusionNodes, MemberTimeoutCountsFromEachIterationsFirstPush) {
  start("version: 1\ndefault: {compressor: none}\n", member_fusion(1000));
  if (HasFatalFailure()) return;
  auto run = [&](uint32_t node, uint32_t rank) {
    MemberJob j;
    ASSERT_TRUE(j.open(*this, node, rank, "paused")) << bytecomp_last_error();
    for (uint64_t it = 0; it < 3; ++it) {
      std::this_thread::sleep_for(1200ms);
      bytecomp_handle h[6];
      for (uint32_t k = 6; k-- > 0;) {
        ASSERT_TRUE(j.push(k, it, 2.0f, h[k])) << j.error;
        if (k == 3) std::this_thread::sleep_for(300ms);
      }
      for (uint32_t k = 0; k < 6; ++k) {
        ASSERT_TRUE(j.ok(bytecomp_wait(j.c, h[k], 30000))) << j.error;
        EXPECT_EQ(j.p[k][kMemberCount - 1], 8.0f) << k;
      }
    }
  };
  on_every_rank(run);
  for (auto& n : nodes_)
    EXPECT_EQ(n->daemon().output().find("aborted"), std::string::npos) << n->daemon().output();
}

// A local rank that has not begun the bucket's iteration (checkpointing,
// say, while its sibling went on) is late, not missing a member: the bound
// counts from its own first push of the iteration. The old clock ran from
// the sibling's first push and failed the job after 1000 ms.
TEST_P(FusionNodes, ALocalRankThatHasNotBegunTheIterationIsLateNotMissing) {
  start("version: 1\ndefault: {compressor: none}\n", member_fusion(1000));
  if (HasFatalFailure()) return;
  auto run = [&](uint32_t node, uint32_t rank) {
    MemberJob j;
    ASSERT_TRUE(j.open(*this, node, rank, "lagging")) << bytecomp_last_error();
    for (uint64_t it = 0; it < 2; ++it) {
      if (rank == 1) std::this_thread::sleep_for(2500ms);
      bytecomp_handle h[6];
      for (uint32_t k = 6; k-- > 0;) ASSERT_TRUE(j.push(k, it, 2.0f, h[k])) << j.error;
      for (uint32_t k = 0; k < 6; ++k) {
        ASSERT_TRUE(j.ok(bytecomp_wait(j.c, h[k], 30000))) << j.error;
        EXPECT_EQ(j.p[k][kMemberCount - 1], 8.0f) << k;
      }
    }
  };
  on_every_rank(run);
  for (auto& n : nodes_)
    EXPECT_EQ(n->daemon().output().find("aborted"), std::string::npos) << n->daemon().output();
}

INSTANTIATE_TEST_SUITE_P(Backends, FusionNodes, ::testing::Values("zmq"),
                         [](const auto& info) { return info.param; });
