// Peer allgather between daemons (inter: allgather): real bytecompd
// processes on loopback exchanging node payloads directly (the server only
// coordinates), and the peer protocol's checks against a hand-made sender.
#include <bytecomp/bytecomp.h>
#include <gtest/gtest.h>

#include <cmath>
#include <condition_variable>
#include <cstring>
#include <future>
#include <mutex>
#include <set>

#include "compress/compressor.h"
#include "daemon/peer_allgather.h"
#include "server/job.h"
#include "server/ps_client.h"
#include "tests/daemon/two_nodes.h"
#include "transport/transport.h"

using namespace bctest;
namespace cz = bytecomp::compress;

namespace {

float grad(uint32_t grank, uint64_t it, uint64_t i) {
  return static_cast<float>(std::sin(0.13 * static_cast<double>(i) + 0.5 * static_cast<double>(it) +
                                     2.3 * grank)) *
         static_cast<float>(1 + i % 5);
}

struct Case {
  const char* compressor;
  const char* params;  // YAML flow mapping body
  bool error_feedback;
  uint64_t count;
};

// Every compressor of the library, at sizes from one element to 4 MiB.
const Case kCases[] = {
    {"fp16", "", false, 1},
    {"bf16", "", false, 1000},
    {"randomk", "ratio: '0.1'", true, 70000},
    {"topk", "ratio: '0.05'", true, 1048576},
    {"dgc", "ratio: '0.05'", false, 300000},
    {"signsgd", "", true, 65536},
    {"signum", "momentum: '0.9'", false, 3},
    {"efsignsgd", "", true, 70001},
    {"onebit", "", true, 200000},
    {"qsgd", "levels: '16'", false, 100000},
    {"terngrad", "", false, 131072},
};

bool has_ef_param(const std::string& name) {
  for (const auto& info : cz::list_compressors()) {
    if (info.name != name) continue;
    for (const auto& p : info.params) {
      if (p.name == "ef") return true;
    }
  }
  return false;
}

// What the daemon builds for the option (daemon/plan.cc): the option's
// params, and its error_feedback as "ef" where the compressor has one.
std::unique_ptr<cz::Compressor> reference_compressor(const Case& c) {
  cz::CompressorSpec spec{c.compressor, {}};
  std::string params = c.params;
  if (!params.empty()) {
    const auto colon = params.find(':');
    std::string value = params.substr(colon + 1);
    value.erase(0, value.find_first_not_of(" '"));
    value.erase(value.find_last_not_of(" '") + 1);
    spec.params[params.substr(0, colon)] = value;
  }
  if (has_ef_param(c.compressor)) spec.params["ef"] = c.error_feedback ? "true" : "false";
  return cz::make_compressor(spec);
}

constexpr uint64_t kPartitionElements = 65536;  // the fixture's 256 KiB partitions

uint64_t rounds_completed(const fs::path& cluster_file) {
  namespace sv = bytecomp::server;
  sv::ClusterConfig cluster = sv::load_cluster_config(cluster_file.string());
  bytecomp::transport::TransportConfig tc = cluster.transport;
  tc.node_id = 150;
  tc.listen = {};
  auto client = sv::PsClient::create(cluster, tc);
  return client->stats(0).rounds_completed;
}

}  // namespace

// Every tensor by allgather, one compressor each; the two nodes' results are
// bit-identical and equal the reference: per 256 KiB partition, each node's
// sum compressed with its own error-feedback state and the daemon's seeds,
// then decompressed and summed in node order. No partition touches a server.
TEST_P(TwoNodes, AllgatherEveryCompressorMatchesTheReference) {
  std::string yaml = "version: 1\nrules:\n";
  for (const Case& c : kCases) {
    yaml += std::string("  - match: ") + c.compressor + "\n    option: {compressor: " +
            c.compressor + ", params: {" + c.params + "}, error_feedback: " +
            (c.error_feedback ? "true" : "false") + ", inter: allgather}\n";
  }
  start(1, yaml);
  constexpr int kIters = 6;
  constexpr size_t kTensors = std::size(kCases);
  const char* job = "every";
  // got[node][tensor][iteration]: local rank 0's results on each node.
  std::vector<std::vector<float>> got[2][kTensors];
  auto run = [&](uint32_t node, uint32_t rank) {
    bytecomp_client* c = connect_client(node, rank, job);
    ASSERT_NE(c, nullptr);
    uint32_t ids[kTensors];
    for (size_t k = 0; k < kTensors; ++k) {
      ASSERT_EQ(bytecomp_declare_tensor(c, kCases[k].compressor, kCases[k].count, BYTECOMP_FLOAT32,
                                        BYTECOMP_DEVICE_CPU, 0, &ids[k]),
                BYTECOMP_OK);
    }
    ASSERT_EQ(bytecomp_start(c, 30000), BYTECOMP_OK) << bytecomp_last_error();
    const uint32_t grank = node * 2 + rank;
    for (uint64_t it = 0; it < kIters; ++it) {
      bytecomp_handle hs[kTensors];
      float* p[kTensors];
      for (size_t k = kTensors; k-- > 0;) {
        uint64_t bytes = 0;
        ASSERT_EQ(bytecomp_tensor_buffer(c, ids[k], reinterpret_cast<void**>(&p[k]), &bytes),
                  BYTECOMP_OK);
        for (uint64_t i = 0; i < kCases[k].count; ++i) p[k][i] = grad(grank, it, i);
        ASSERT_EQ(bytecomp_push_pull(c, ids[k], it, &hs[k]), BYTECOMP_OK);
      }
      for (size_t k = 0; k < kTensors; ++k) {
        ASSERT_EQ(bytecomp_wait(c, hs[k], 30000), BYTECOMP_OK) << bytecomp_last_error();
        if (rank == 0) got[node][k].emplace_back(p[k], p[k] + kCases[k].count);
      }
    }
    bytecomp_close(c);
  };
  on_every_rank(run);
  ASSERT_FALSE(HasFailure());

  for (size_t k = 0; k < kTensors; ++k) {
    const Case& c = kCases[k];
    ASSERT_EQ(got[0][k].size(), static_cast<size_t>(kIters)) << c.compressor;
    ASSERT_EQ(got[1][k].size(), static_cast<size_t>(kIters)) << c.compressor;
    auto comp = reference_compressor(c);
    const uint64_t parts = (c.count + kPartitionElements - 1) / kPartitionElements;
    std::vector<std::unique_ptr<cz::TensorState>> state[2];
    for (uint64_t p = 0; p < parts; ++p) {
      const size_t n = static_cast<size_t>(std::min(kPartitionElements, c.count - p * kPartitionElements));
      for (auto& s : state) s.push_back(comp->make_state(n));
    }
    size_t nonzero = 0;  // so an all-zero result cannot pass
    for (uint64_t it = 0; it < kIters; ++it) {
      std::vector<float> expect(c.count);
      for (uint64_t p = 0; p < parts; ++p) {
        const uint64_t begin = p * kPartitionElements;
        const size_t n = static_cast<size_t>(std::min(kPartitionElements, c.count - begin));
        cz::CompressContext ctx;
        ctx.iteration = it;
        ctx.shared_seed = bytecomp::server::partition_seed(
            job, bytecomp::server::partition_key(static_cast<uint32_t>(k), static_cast<uint32_t>(p)));
        float* out = expect.data() + begin;
        for (uint32_t node = 0; node < 2; ++node) {
          std::vector<float> local(n);
          for (size_t i = 0; i < n; ++i) {
            local[i] = grad(node * 2, it, begin + i) + grad(node * 2 + 1, it, begin + i);
          }
          cz::CompressContext own = ctx;
          own.private_seed = ctx.shared_seed ^ (0x9e3779b97f4a7c15ull * (node + 1));
          std::vector<std::byte> wire(comp->max_compressed_bytes(n));
          const size_t len =
              comp->compress(cz::ConstTensorView::cpu(local.data(), n), wire, *state[node][p], own);
          comp->decompress({wire.data(), len}, cz::TensorView::cpu(out, n), node > 0, ctx);
        }
      }
      size_t mismatches = 0, differ = 0;
      for (uint64_t i = 0; i < c.count; ++i) {
        nonzero += expect[i] != 0.0f;
        mismatches += std::memcmp(&got[0][k][it][i], &expect[i], 4) != 0;
        differ += std::memcmp(&got[0][k][it][i], &got[1][k][it][i], 4) != 0;
      }
      EXPECT_EQ(mismatches, 0u) << c.compressor << " iteration " << it;
      EXPECT_EQ(differ, 0u) << c.compressor << " iteration " << it << ": nodes differ";
    }
    EXPECT_GT(nonzero, 0u) << c.compressor;
  }
  EXPECT_EQ(rounds_completed(dir_ / "cluster.yaml"), 0u) << "an allgather job used a server";
  for (auto& n : nodes_) EXPECT_TRUE(no_shm_left(n->shm_prefix()));
}

// One job, some tensors through the server and some by allgather (topk
// keeping every element, so sums are exact and bc_worker checks them),
// from one element to 4 MiB, many iterations.
TEST_P(TwoNodes, MixedPsAndAllgatherJobExactSums) {
  start(1,
        "version: 1\nrules:\n"
        "  - match: 't[023]'\n"
        "    option: {compressor: topk, params: {ratio: '1'}, inter: allgather}\n");
  auto w = workers("mixed", 40, "f32:1,f32:1000,f32:65537,f32:1048576");
  for (auto& p : w) expect_ok(*p);
  EXPECT_GT(rounds_completed(dir_ / "cluster.yaml"), 0u) << "t1 should go through the server";
  for (auto& n : nodes_) {
    EXPECT_NE(n->daemon().output().find("allgather with 1 peer daemon"), std::string::npos)
        << n->daemon().output();
    EXPECT_TRUE(no_shm_left(n->shm_prefix()));
  }
}

// A peer daemon killed mid-job: the other node's clients get an error naming
// it within the heartbeat bound (peer_timeout 1 s), nothing is left in
// /dev/shm, and the surviving daemon keeps serving.
TEST_P(TwoNodes, KilledPeerDaemonAbortsTheAllgatherJob) {
  peer_timeout_ms_ = 1000;  // the detection bound is asserted
  start(1, "version: 1\ndefault: {compressor: topk, params: {ratio: '1'}, inter: allgather}\n");
  auto w = workers("killpeer", 1000000, "f32:1000,f32:300000");
  for (auto& p : w) ASSERT_TRUE(p->wait_output("running", 30s)) << p->output();
  const auto t0 = std::chrono::steady_clock::now();
  nodes_[1]->daemon().signal(SIGKILL);
  for (size_t i = 0; i < 2; ++i) {
    auto st = w[i]->wait(10s);
    ASSERT_TRUE(st.has_value()) << w[i]->output();
    EXPECT_EQ(*st, 16) << w[i]->output();  // BYTECOMP_ERR_ABORTED
    EXPECT_NE(w[i]->output().find("node 101"), std::string::npos) << w[i]->output();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 4s) << "node 0 learnt of the death late";
  for (size_t i = 2; i < 4; ++i) {
    auto st = w[i]->wait(10s);
    ASSERT_TRUE(st.has_value()) << w[i]->output();
    EXPECT_EQ(*st, 17) << w[i]->output();  // BYTECOMP_ERR_UNAVAILABLE
  }
  EXPECT_TRUE(no_shm_left(nodes_[0]->shm_prefix()));
  EXPECT_TRUE(no_shm_left(nodes_[1]->shm_prefix()));
  EXPECT_FALSE(nodes_[0]->daemon().wait(0ms).has_value()) << "the daemon keeps serving";
  nodes_[1]->drop_daemon();
}

// ---------------------------------------------------------------------------
// The peer protocol itself: two PeerHubs on loopback (real transports), raw
// fp32 rounds summed exactly, and a hand-made sender whose malformed
// messages are refused with a reason while the hub keeps working.

namespace {

namespace bd = bytecomp::daemon;
namespace bt = bytecomp::transport;

bt::TransportConfig peer_config(bt::NodeId id, const std::string& backend) {
  bt::TransportConfig c;
  c.backend = backend;
  c.node_id = id;
  c.listen = {backend == "rdma" ? "rdma://127.0.0.1:0" : "tcp://127.0.0.1:0"};
  c.io_threads = 1;
  c.heartbeat_interval = std::chrono::milliseconds(100);
  c.peer_timeout = std::chrono::milliseconds(1000);
  return c;
}

// Collects ready rounds and failures of one PeerJob.
struct Events {
  std::mutex mu;
  std::condition_variable cv;
  std::set<std::pair<uint32_t, uint64_t>> ready;  // (index, iteration)
  std::vector<std::string> failures;
  bd::PeerJob::ReadyFn on_ready() {
    return [this](uint32_t, uint32_t index, uint64_t iteration) {
      std::lock_guard l(mu);
      ready.insert({index, iteration});
      cv.notify_all();
    };
  }
  bd::PeerJob::FailFn on_fail() {
    return [this](const bytecomp::Status& s) {
      std::lock_guard l(mu);
      failures.push_back(s.message());
      cv.notify_all();
    };
  }
  int acked = 0;  // payloads every peer acknowledged
  bd::PeerJob::AckedFn on_acked() {
    return [this] {
      std::lock_guard l(mu);
      ++acked;
      cv.notify_all();
    };
  }
  bool wait_acked(int n) {
    std::unique_lock l(mu);
    return cv.wait_for(l, 10s, [&] { return acked >= n; });
  }
  bool wait_ready(uint32_t index, uint64_t iteration) {
    std::unique_lock l(mu);
    return cv.wait_for(l, 10s, [&] { return ready.count({index, iteration}) != 0; });
  }
};

bd::PeerJobSpec job_spec(uint32_t uid, uint32_t rank, std::vector<bt::NodeId> nodes,
                         std::vector<std::string> addresses) {
  bd::PeerJobSpec s;
  s.name = "raw" + std::to_string(uid);
  s.uid = uid;
  s.rank = rank;
  s.nodes = std::move(nodes);
  s.addresses = std::move(addresses);
  s.tensor_names = {"w"};
  s.partitions = {3};
  s.partition_count = [](uint32_t, uint32_t index) -> uint64_t { return index < 2 ? 1000 : 500; };
  s.timeout = std::chrono::milliseconds(5000);
  return s;
}

bt::Buffer floats(uint64_t n, float base) {
  std::vector<float> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = base + 0.37f * static_cast<float>(i % 97) - 3.1f;
  return bt::Buffer::copy_of(v.data(), n * 4);
}

}  // namespace

class PeerAllgather : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string reason;
    if (!bt::backend_usable(GetParam(), &reason)) GTEST_SKIP() << reason;
  }
};

TEST_P(PeerAllgather, RawFp32RoundsAreExactAndMalformedMessagesRefused) {
  bd::PeerHub a(peer_config(100, GetParam())), b(peer_config(101, GetParam()));
  Events ea, eb;
  auto ja = a.open(job_spec(7, 0, {100, 101}, {a.address(), b.address()}), ea.on_ready(), ea.on_fail());
  auto jb = b.open(job_spec(7, 1, {100, 101}, {a.address(), b.address()}), eb.on_ready(), eb.on_fail());
  auto exchange = [&](uint64_t it) {
    for (uint32_t index = 0; index < 3; ++index) {
      const uint64_t n = index < 2 ? 1000 : 500;
      bd::PeerHeader h;
      h.format = bd::PeerFormat::kRawFp32;
      h.count = n;
      ja->contribute(0, index, it, h, floats(n, 1.0f + static_cast<float>(it + index)),
                     ea.on_acked());
      jb->contribute(0, index, it, h, floats(n, -0.25f * static_cast<float>(it + 2 * index)),
                     eb.on_acked());
    }
    // Each payload's acknowledgement (what the engine's bytes-in-flight
    // bound waits for) comes once, whether or not its round was taken.
    ASSERT_TRUE(ea.wait_acked(static_cast<int>(3 * (it + 1))));
    ASSERT_TRUE(eb.wait_acked(static_cast<int>(3 * (it + 1))));
    for (uint32_t index = 0; index < 3; ++index) {
      ASSERT_TRUE(ea.wait_ready(index, it)) << index << "/" << it;
      ASSERT_TRUE(eb.wait_ready(index, it)) << index << "/" << it;
      auto pa = ja->take(0, index, it);
      auto pb = jb->take(0, index, it);
      ASSERT_EQ(pa.size(), 2u);
      ASSERT_EQ(pb.size(), 2u);
      // By rank on both nodes: the same bytes in the same order.
      for (size_t r = 0; r < 2; ++r) {
        ASSERT_EQ(pa[r].data.size(), pb[r].data.size());
        EXPECT_EQ(std::memcmp(pa[r].data.data(), pb[r].data.data(), pa[r].data.size()), 0);
        EXPECT_EQ(pa[r].header.sender_rank, r);
      }
    }
  };
  for (uint64_t it = 0; it < 5; ++it) exchange(it);

  // A stranger (node 102) in its own job uid 8 with node 100.
  bt::TransportConfig xc = peer_config(102, GetParam());
  auto x = bt::make_transport(xc);
  x->start();
  Events e8;
  auto j8 = a.open(job_spec(8, 0, {100, 102}, {a.address(), x->local_addresses().front()}),
                   e8.on_ready(), e8.on_fail());
  x->add_peer(100, a.address());
  auto send = [&](uint32_t uid, uint64_t key, uint64_t it, std::vector<bt::Buffer> payloads) {
    bt::Message m;
    m.header.type = bd::kPeerData;
    m.header.aux = uid;
    m.header.key = key;
    m.header.arg = it;
    m.payloads = std::move(payloads);
    bt::Response r = x->call(100, std::move(m), std::chrono::milliseconds(5000));
    EXPECT_TRUE(r.status.ok()) << r.status.to_string();
    std::string text;
    for (const auto& p : r.response.payloads) text.append(p.view());
    return std::make_pair(r.response.header.type, text);
  };
  auto header = [](uint32_t rank, uint64_t count, uint64_t bytes) {
    bd::PeerHeader h;
    h.format = bd::PeerFormat::kRawFp32;
    h.sender_rank = rank;
    h.count = count;
    h.data_bytes = bytes;
    return bd::encode_peer_header(h);
  };
  auto refused = [&](std::pair<uint16_t, std::string> r, const std::string& needle) {
    EXPECT_EQ(r.first, bd::kPeerError) << r.second;
    EXPECT_NE(r.second.find(needle), std::string::npos) << r.second;
  };
  const bt::Buffer data = floats(1000, 2.0f);
  refused(send(8, 0, 0, {header(1, 1000, 4000)}), "payloads");
  refused(send(8, 0, 0, {bt::Buffer::copy_of("short", 5), data}), "header is 5 bytes");
  {
    std::string h(header(1, 1000, 4000).view());
    h[0] = 2;  // version
    refused(send(8, 0, 0, {bt::Buffer::copy_of(h), data}), "peer protocol version 2");
    h = std::string(header(1, 1000, 4000).view());
    h[2] = 9;  // format
    refused(send(8, 0, 0, {bt::Buffer::copy_of(h), data}), "format 9");
  }
  refused(send(8, 0, 0, {header(1, 1000, 3996), data}), "header says 3996 bytes");
  refused(send(99, 0, 0, {header(1, 1000, 4000), data}), "no job with uid 99");
  refused(send(7, 0, 0, {header(1, 1000, 4000), data}), "not a peer of job 'raw7'");
  refused(send(8, 0, 0, {header(0, 1000, 4000), data}), "claims rank 0");
  refused(send(8, uint64_t{5} << 32, 0, {header(1, 1000, 4000), data}), "no allgather partition");
  refused(send(8, 2, 0, {header(1, 1000, 4000), data}), "1000 elements sent, the partition has 500");
  EXPECT_EQ(send(8, 0, 0, {header(1, 1000, 4000), data}).first, bd::kPeerOk);
  refused(send(8, 0, 0, {header(1, 1000, 4000), data}), "sent twice");
  EXPECT_EQ(send(8, 0, 4, {header(1, 1000, 4000), data}).first, bd::kPeerOk);
  refused(send(8, 0, 5, {header(1, 1000, 4000), data}), "too far ahead");
  {
    bt::Message m;  // one-way: dropped with a logged error
    m.header.type = bd::kPeerData;
    m.header.aux = 8;
    m.payloads = {header(1, 1000, 4000), data};
    EXPECT_TRUE(x->send_wait(100, std::move(m)).ok());
  }
  // Refusals do not fail the receiving job; the hub keeps serving.
  {
    std::lock_guard l(e8.mu);
    EXPECT_TRUE(e8.failures.empty()) << e8.failures.front();
  }
  exchange(5);

  // Node 102 goes away: job 8 fails naming it within the heartbeat bound;
  // job 7 is not affected.
  const auto t0 = std::chrono::steady_clock::now();
  x->shutdown();
  {
    std::unique_lock l(e8.mu);
    ASSERT_TRUE(e8.cv.wait_for(l, 5s, [&] { return !e8.failures.empty(); }));
    EXPECT_NE(e8.failures.front().find("node 102 (rank 1)"), std::string::npos)
        << e8.failures.front();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  exchange(6);
  std::lock_guard la(ea.mu);
  std::lock_guard lb(eb.mu);
  EXPECT_TRUE(ea.failures.empty());
  EXPECT_TRUE(eb.failures.empty());
  EXPECT_EQ(ea.acked, 21);  // 3 partitions x 7 iterations, each acknowledged once
  EXPECT_EQ(eb.acked, 21);
}

#include <regex>

// Junk sent to a live bytecompd's peer endpoint while an allgather job runs:
// each message is refused with the reason, the job is not disturbed and the
// daemon keeps serving.
TEST_P(TwoNodes, MalformedPeerMessagesToALiveDaemonAreRefused) {
  start(1, "version: 1\ndefault: {compressor: topk, params: {ratio: '1'}, inter: allgather}\n");
  std::smatch m;
  const std::string log = nodes_[0]->daemon().output();
  ASSERT_TRUE(std::regex_search(log, m, std::regex("peer endpoint ((tcp|rdma)://[0-9.:]+)"))) << log;
  auto x = bt::make_transport(peer_config(102, GetParam()));
  x->start();
  x->add_peer(100, m[1]);
  auto w = workers("junk", 60, "f32:1000,f32:70000");
  for (auto& p : w) ASSERT_TRUE(p->wait_output("running", 30s)) << p->output();
  auto send = [&](uint32_t uid, std::vector<bt::Buffer> payloads) {
    bt::Message msg;
    msg.header.type = bd::kPeerData;
    msg.header.aux = uid;
    msg.payloads = std::move(payloads);
    bt::Response r = x->call(100, std::move(msg), std::chrono::milliseconds(5000));
    EXPECT_TRUE(r.status.ok()) << r.status.to_string();
    EXPECT_EQ(r.response.header.type, bd::kPeerError);
    std::string text;
    for (const auto& p : r.response.payloads) text.append(p.view());
    return text;
  };
  bd::PeerHeader h;
  h.sender_rank = 1;
  h.count = 1000;
  h.data_bytes = 4000;
  const bt::Buffer data = floats(1000, 1.0f);
  EXPECT_NE(send(1, {data}).find("payloads"), std::string::npos);
  EXPECT_NE(send(1, {bt::Buffer::copy_of(std::string(32, '\x7f')), data}).find("version"),
            std::string::npos);
  // The running job, which node 102 is no part of (its uid from the
  // daemon's log: the coordinator numbers jobs from a random point), and
  // uids of no job.
  const std::string dlog = nodes_[0]->daemon().output();
  std::smatch u;
  ASSERT_TRUE(std::regex_search(dlog, u, std::regex("admitted \\(uid ([0-9]+)"))) << dlog;
  const uint32_t running = static_cast<uint32_t>(std::stoul(u[1]));
  for (uint32_t uid : {running, running + 1, running - 1}) {
    const std::string why = send(uid, {bd::encode_peer_header(h), data});
    EXPECT_TRUE(why.find("not a peer") != std::string::npos ||
                why.find("no job with uid") != std::string::npos)
        << why;
  }
  for (auto& p : w) expect_ok(*p);
  EXPECT_NE(nodes_[0]->daemon().output().find("refused"), std::string::npos);
  EXPECT_FALSE(nodes_[0]->daemon().wait(0ms).has_value());
  for (auto& n : nodes_) EXPECT_TRUE(no_shm_left(n->shm_prefix()));
}

#include <barrier>

#include "compress/reduce.h"

// SIGHUP on node 0 switches an allgather tensor from topk keeping every
// element (exact sums) to fp16 allgather at one iteration on both nodes
// (announced by the coordinator): from it on each node's sum is cast to fp16
// and the two are summed in fp32, in node order.
TEST_P(TwoNodes, AllgatherStrategyChangeAppliesOnBothNodesAtOneIteration) {
  start(1, "version: 1\ndefault: {compressor: topk, params: {ratio: '1'}, inter: allgather}\n");
  constexpr uint64_t kN = 70000;  // two partitions
  constexpr int kIters = 12;
  std::vector<std::vector<float>> got[2];
  std::barrier sync(4);
  int64_t switch_at = -1;
  auto h = [](float v) {
    return bytecomp::compress::fp16_to_fp32(bytecomp::compress::fp32_to_fp16(v));
  };
  auto run = [&](uint32_t node, uint32_t rank) {
    bytecomp_client* c = connect_client(node, rank, "agswitch");
    ASSERT_NE(c, nullptr);
    uint32_t id = 0;
    ASSERT_EQ(bytecomp_declare_tensor(c, "w", kN, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, &id),
              BYTECOMP_OK);
    ASSERT_EQ(bytecomp_start(c, 30000), BYTECOMP_OK) << bytecomp_last_error();
    const uint32_t grank = node * 2 + rank;
    for (uint64_t it = 0; it < kIters; ++it) {
      if (it == 4) {
        sync.arrive_and_wait();
        if (grank == 0) {
          switch_at = switch_strategy("version: 1\ndefault: {compressor: fp16, inter: allgather}\n");
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
      if (rank == 0) got[node].emplace_back(p, p + kN);
    }
    bytecomp_close(c);
  };
  on_every_rank(run);
  ASSERT_GE(switch_at, 4);
  ASSERT_LT(switch_at, kIters);
  for (uint32_t node = 0; node < 2; ++node) {
    ASSERT_EQ(got[node].size(), static_cast<size_t>(kIters));
    for (uint64_t it = 0; it < kIters; ++it) {
      size_t mismatches = 0;
      for (uint64_t i = 0; i < kN; ++i) {
        const float s0 = grad(0, it, i) + grad(1, it, i);
        const float s1 = grad(2, it, i) + grad(3, it, i);
        const float expect = static_cast<int64_t>(it) >= switch_at ? h(s0) + h(s1) : s0 + s1;
        mismatches += got[node][it][i] != expect;
      }
      EXPECT_EQ(mismatches, 0u) << "node " << node << " iteration " << it << " (switch at "
                                << switch_at << ")";
    }
  }
}

// Node 0's ranks close right after their last wait while node 1's ranks have
// not read their last results: with allgather, node 1 must still get them
// (and node 0's daemon must not drop its last queued replies).
TEST_P(TwoNodes, AllgatherCleanCloseOnOneNodeLeavesTheOtherNodesWorkIntact) {
  start(1, "version: 1\ndefault: {compressor: topk, params: {ratio: '1'}, inter: allgather}\n");
  // Short jobs back to back, every other one with node 1 lingering: the
  // node that finishes first must still deliver its last sends and replies.
  for (int round = 0; round < 6; ++round) {
    std::vector<std::unique_ptr<Process>> w;
    for (int n = 0; n < 2; ++n) {
      for (int r = 0; r < 2; ++r) {
        std::vector<std::string> extra{"--node", std::to_string(n) + "/2"};
        if (n == 1 && round % 2 == 1) extra.insert(extra.end(), {"--linger", "300"});
        w.push_back(nodes_[n]->worker("aglinger" + std::to_string(round), r, 2, 5,
                                      "f32:1,f32:1000", extra));
      }
    }
    for (auto& p : w) expect_ok(*p);
  }
  for (auto& n : nodes_) {
    EXPECT_EQ(n->daemon().output().find("aborted"), std::string::npos) << n->daemon().output();
    EXPECT_TRUE(no_shm_left(n->shm_prefix()));
  }
}

// Without internode.peer_listen a daemon refuses a job that uses allgather
// at start, saying which key to set.
TEST_P(TwoNodes, AllgatherWithoutPeerEndpointIsRefusedAtStart) {
  peer_listen_ = false;
  start(1, "version: 1\ndefault: {compressor: topk, params: {ratio: '1'}, inter: allgather}\n");
  auto p = nodes_[0]->worker("nopeer", 0, 1, 1, "f32:10", {"--node", "0/2"});
  auto st = p->wait(30s);
  ASSERT_TRUE(st.has_value()) << p->output();
  EXPECT_EQ(*st, 17) << p->output();  // BYTECOMP_ERR_UNAVAILABLE
  EXPECT_NE(p->output().find("set internode.peer_listen"), std::string::npos) << p->output();
  EXPECT_TRUE(no_shm_left(nodes_[0]->shm_prefix()));
}

// Allgather under a bytes-in-flight bound of one partition, with the nodes
// starting partitions in different orders: node 0 has only the last tensor
// ready for a while (its clients push backwards, pausing after the first),
// node 1 pushes forwards. Each node's first payload fills its bound, and
// that round waits for the other node's payload of it. A bound held until
// the round completes leaves both waiting for the peers' rounds timeout
// (10 s here: "no data from node ..."); released when the peer acknowledged
// receipt, every partition goes out and the sums are exact.
TEST_P(TwoNodes, AllgatherWithDifferentPartitionOrdersOnTheNodesDoesNotDeadlock) {
  start(1, "version: 1\ndefault: {compressor: topk, params: {ratio: '1'}, inter: allgather}\n",
        "  partition_bytes: 256KiB\n  max_inflight_bytes: 256KiB\n");
  constexpr uint64_t kN = 131072;  // two 256 KiB partitions per tensor
  constexpr uint32_t kTensors = 3;
  constexpr int kIters = 3;
  auto run = [&](uint32_t node) {
    bytecomp_client* c = connect_client(node, 0, "agorder", 1);
    ASSERT_NE(c, nullptr);
    uint32_t ids[kTensors];
    float* p[kTensors];
    for (uint32_t k = 0; k < kTensors; ++k) {
      const std::string name = "t" + std::to_string(k);
      ASSERT_EQ(bytecomp_declare_tensor(c, name.c_str(), kN, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU,
                                        0, &ids[k]),
                BYTECOMP_OK);
    }
    ASSERT_EQ(bytecomp_start(c, 30000), BYTECOMP_OK) << bytecomp_last_error();
    for (uint32_t k = 0; k < kTensors; ++k) {
      uint64_t bytes = 0;
      ASSERT_EQ(bytecomp_tensor_buffer(c, ids[k], reinterpret_cast<void**>(&p[k]), &bytes),
                BYTECOMP_OK);
    }
    for (uint64_t it = 0; it < kIters; ++it) {
      // Iteration 0 in the same order on both nodes (everything is ready by
      // the time the engines opened the job); later ones crossed.
      const bool crossed = it > 0 && node == 0;
      bytecomp_handle hs[kTensors];
      for (uint32_t j = 0; j < kTensors; ++j) {
        const uint32_t k = crossed ? kTensors - 1 - j : j;
        for (uint64_t i = 0; i < kN; ++i) p[k][i] = grad(node * kTensors + k, it, i);
        ASSERT_EQ(bytecomp_push_pull(c, ids[k], it, &hs[k]), BYTECOMP_OK);
        if (crossed && j == 0) std::this_thread::sleep_for(400ms);  // the last tensor alone
      }
      for (uint32_t k = 0; k < kTensors; ++k) {
        ASSERT_EQ(bytecomp_wait(c, hs[k], 30000), BYTECOMP_OK)
            << "node " << node << " tensor " << k << " iteration " << it << ": "
            << bytecomp_last_error();
        size_t mismatches = 0;
        for (uint64_t i = 0; i < kN; ++i) {
          // topk keeping every element: each node's payload is its exact
          // value, summed in node order.
          mismatches += p[k][i] != grad(k, it, i) + grad(kTensors + k, it, i);
        }
        EXPECT_EQ(mismatches, 0u) << "node " << node << " tensor " << k << " iteration " << it;
      }
    }
    bytecomp_close(c);
  };
  auto other = std::async(std::launch::async, run, 1);
  run(0);
  other.get();
  for (auto& n : nodes_) {
    EXPECT_EQ(n->daemon().output().find("aborted"), std::string::npos) << n->daemon().output();
    EXPECT_TRUE(no_shm_left(n->shm_prefix()));
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, PeerAllgather,
                         ::testing::ValuesIn(bytecomp::transport::available_backends()),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });
