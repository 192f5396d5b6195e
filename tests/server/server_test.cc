// bytecomp-server with real processes on loopback: a server process, worker
// processes (bytecomp-ps-worker, built on the client library the daemon
// links) and in-process clients of that same library for the refusal cases.
// Every test runs once per transport backend the build has (servers,
// workers and clients all on it); a backend the machine cannot run (rdma
// without a device) skips with the reason.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <zmq.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <thread>

#include "compress/compressor.h"
#include "compress/reduce.h"
#include "server/local_shm.h"
#include "server/protocol.h"
#include "server/ps_client.h"
#include "tests/server/proc.h"
#include "tests/server/server_fixture.h"
#include "tests/server/testdata.h"
#include "transport/transport.h"

using namespace bytecomp;
using namespace bytecomp::server;
using namespace std::chrono_literals;
using testing_proc = bytecomp::server::testing::Process;
namespace td = bytecomp::server::testing;

namespace {

using td::kPartitionBytes;

struct Dump {
  std::map<std::pair<uint64_t, uint64_t>, std::string> results;  // (iteration, key) -> bytes
};

Dump read_dump(const std::string& path) {
  Dump d;
  std::string s = td::read_file(path);
  size_t pos = 0;
  while (pos + 24 <= s.size()) {
    uint64_t h[3];
    std::memcpy(h, s.data() + pos, 24);
    pos += 24;
    if (pos + h[2] > s.size()) break;
    d.results[{h[0], h[1]}] = s.substr(pos, h[2]);
    pos += h[2];
  }
  return d;
}

class ServerTest : public td::ServerFixture {};

std::string nodes_arg(const std::vector<NodeId>& n) {
  std::string s;
  for (NodeId id : n) s += (s.empty() ? "" : ",") + std::to_string(id);
  return s;
}

// Reference of a raw fp32 job: sums in rank order, one float addition per
// element and rank, like the server's deterministic mode.
std::vector<float> raw_reference(uint64_t seed, uint32_t ranks, uint32_t tensor, uint64_t it,
                                 const Partition& p) {
  std::vector<float> sum(p.count), tmp(p.count);
  td::fill(sum.data(), p.count, seed, 0, tensor, it, p.offset);
  for (uint32_t r = 1; r < ranks; ++r) {
    td::fill(tmp.data(), p.count, seed, r, tensor, it, p.offset);
    for (uint64_t i = 0; i < p.count; ++i) sum[i] += tmp[i];
  }
  return sum;
}

std::vector<TensorSpec> parse_tensors(const std::string& s) {
  std::vector<TensorSpec> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    auto c = item.find(':');
    out.push_back({item.substr(0, c), std::stoull(item.substr(c + 1)), compress::DType::kFloat32});
  }
  return out;
}

void check_raw_dump(const Dump& d, const std::vector<TensorSpec>& tensors, uint64_t seed,
                    uint32_t ranks, uint64_t start, uint64_t iterations, bool exact) {
  std::vector<TensorPlan> plans(tensors.size());
  ServerInfo s0{0, "", 2};
  Assignment a = assign_partitions(tensors, plans, {s0}, kPartitionBytes);
  size_t checked = 0;
  for (uint64_t it = start; it < start + iterations; ++it)
    for (const Partition& p : a.partitions) {
      auto f = d.results.find({it, p.key});
      ASSERT_NE(f, d.results.end()) << "no result for iteration " << it << " key " << p.key;
      std::vector<float> ref = raw_reference(seed, ranks, p.tensor, it, p);
      ASSERT_EQ(f->second.size(), ref.size() * 4);
      std::vector<float> got(ref.size());
      std::memcpy(got.data(), f->second.data(), ref.size() * 4);
      if (exact) {
        ASSERT_EQ(std::memcmp(got.data(), ref.data(), ref.size() * 4), 0)
            << "iteration " << it << " key " << p.key << " differs bitwise";
      } else {
        for (size_t i = 0; i < ref.size(); ++i)
          ASSERT_NEAR(got[i], ref[i], 1e-5f * ranks * 4) << "iteration " << it << " element " << i;
      }
      ++checked;
    }
  EXPECT_EQ(checked, iterations * a.partitions.size());
}

}  // namespace

TEST_P(ServerTest, DeterministicSumsAreExactOverManyIterations) {
  start_server();
  const std::string tensors = "emb:70000,fc:20000,bias:7";  // 5 + 2 + 1 partitions
  const std::vector<NodeId> nodes = {100, 101, 102};
  const uint64_t iters = 15;
  for (size_t r = 0; r < nodes.size(); ++r)
    worker("w" + std::to_string(r),
           {"--node", std::to_string(nodes[r]), "--job", "det", "--nodes", nodes_arg(nodes),
            "--tensors", tensors, "--deterministic", "--iterations", std::to_string(iters),
            "--start", "3", "--seed", "42", "--dump", dir_ + "/w" + std::to_string(r) + ".bin",
            "--leave"});
  for (auto& w : workers_) {
    ASSERT_TRUE(w->wait(60s)) << w->out() << w->err();
    ASSERT_EQ(w->exit_code(), 0) << w->out() << w->err();
    EXPECT_NE(w->out().find("OK"), std::string::npos);
  }
  for (size_t r = 0; r < nodes.size(); ++r)
    check_raw_dump(read_dump(dir_ + "/w" + std::to_string(r) + ".bin"), parse_tensors(tensors), 42,
                   3, 3, iters, /*exact=*/true);
  expect_released();
  EXPECT_GE(stats().rounds_completed, iters * 8);
}

TEST_P(ServerTest, TwoServersShareTheJobAndSumsStayExact) {
  start_server(5000, /*servers=*/2);
  const std::string tensors = "emb:70000,fc:20000,bias:7";
  const std::vector<NodeId> nodes = {100, 101};
  for (size_t r = 0; r < nodes.size(); ++r)
    worker("w" + std::to_string(r),
           {"--node", std::to_string(nodes[r]), "--job", "two", "--nodes", nodes_arg(nodes),
            "--tensors", tensors, "--deterministic", "--iterations", "6", "--seed", "8", "--dump",
            dir_ + "/w" + std::to_string(r) + ".bin", "--leave"});
  for (auto& w : workers_) {
    ASSERT_TRUE(w->wait(60s)) << w->out() << w->err();
    ASSERT_EQ(w->exit_code(), 0) << w->out() << w->err();
  }
  for (size_t r = 0; r < nodes.size(); ++r)
    check_raw_dump(read_dump(dir_ + "/w" + std::to_string(r) + ".bin"), parse_tensors(tensors), 8,
                   2, 0, 6, /*exact=*/true);
  // 8 partitions balanced by bytes: both servers summed rounds.
  EXPECT_GT(stats(0).rounds_completed, 0u);
  EXPECT_GT(stats(1).rounds_completed, 0u);
  expect_released();
  EXPECT_NE(server1_->err().find("registered with coordinator 0"), std::string::npos) << server1_->err();
}

TEST_P(ServerTest, ArrivalOrderSumsMatchReferenceWithinRounding) {
  start_server();
  const std::string tensors = "a:30000,b:100";
  const std::vector<NodeId> nodes = {100, 101, 102, 103};
  for (size_t r = 0; r < nodes.size(); ++r)
    worker("w" + std::to_string(r),
           {"--node", std::to_string(nodes[r]), "--job", "fast", "--nodes", nodes_arg(nodes),
            "--tensors", tensors, "--iterations", "8", "--seed", "5", "--dump",
            dir_ + "/w" + std::to_string(r) + ".bin", "--leave"});
  for (auto& w : workers_) {
    ASSERT_TRUE(w->wait(60s)) << w->out() << w->err();
    ASSERT_EQ(w->exit_code(), 0) << w->out() << w->err();
  }
  for (size_t r = 0; r < nodes.size(); ++r)
    check_raw_dump(read_dump(dir_ + "/w" + std::to_string(r) + ".bin"), parse_tensors(tensors), 5,
                   4, 0, 8, /*exact=*/false);
  expect_released();
}

TEST_P(ServerTest, TwoJobsAtOnceDoNotSeeEachOthersData) {
  start_server();
  const std::string tensors = "w:40000,b:50";  // same names in both jobs
  struct J {
    std::string name;
    std::vector<NodeId> nodes;
    uint64_t seed;
  };
  std::vector<J> jobs = {{"jobA", {100, 101}, 11}, {"jobB", {102, 103}, 22}};
  for (const J& j : jobs)
    for (size_t r = 0; r < j.nodes.size(); ++r)
      worker(j.name + std::to_string(r),
             {"--node", std::to_string(j.nodes[r]), "--job", j.name, "--nodes", nodes_arg(j.nodes),
              "--tensors", tensors, "--deterministic", "--iterations", "10", "--seed",
              std::to_string(j.seed), "--dump", dir_ + "/" + j.name + std::to_string(r) + ".bin",
              "--leave"});
  for (auto& w : workers_) {
    ASSERT_TRUE(w->wait(60s)) << w->out() << w->err();
    ASSERT_EQ(w->exit_code(), 0) << w->out() << w->err();
  }
  for (const J& j : jobs)
    for (size_t r = 0; r < j.nodes.size(); ++r)
      check_raw_dump(read_dump(dir_ + "/" + j.name + std::to_string(r) + ".bin"),
                     parse_tensors(tensors), j.seed, 2, 0, 10, /*exact=*/true);
  expect_released();
}

// One job with a tensor per compressor (and per server-side treatment): what
// the workers pull equals, byte for byte, the reference computed here from
// the same compressors: decompress-and-sum in rank order then recompress
// with the server's recompressor (make_sum_recompressor; or cast to fp16),
// or aggregate() in the compressed domain for the additive ones.
TEST_P(ServerTest, CompressedPushesMatchReferenceDecompressAndSum) {
  start_server();
  std::string entries;
  std::vector<TensorSpec> tensors;
  for (const auto& info : compress::list_compressors()) {
    std::string ef = (info.name == "topk" || info.name == "qsgd") ? ", error_feedback: true" : "";
    tensors.push_back({"d_" + info.name, 20000, compress::DType::kFloat32});
    entries += "  - {tensor: d_" + info.name + ", option: {compressor: " + info.name + ef +
               ", inter: alltoall_allgather}}\n";
    if (info.additive) {
      tensors.push_back({"c_" + info.name, 20000, compress::DType::kFloat32});
      entries += "  - {tensor: c_" + info.name + ", option: {compressor: " + info.name +
                 ", inter: reduce_scatter_allgather}}\n";
    }
  }
  std::string yaml = "version: 1\nentries:\n" + entries;
  write("strategy.yaml", yaml);
  std::string targ;
  for (const auto& t : tensors) targ += (targ.empty() ? "" : ",") + t.name + ":" + std::to_string(t.count);
  const std::vector<NodeId> nodes = {100, 101, 102};
  const uint64_t iters = 3, seed = 9;
  for (size_t r = 0; r < nodes.size(); ++r)
    worker("w" + std::to_string(r),
           {"--node", std::to_string(nodes[r]), "--job", "cmp", "--nodes", nodes_arg(nodes),
            "--tensors", targ, "--strategy", dir_ + "/strategy.yaml", "--deterministic",
            "--iterations", std::to_string(iters), "--seed", std::to_string(seed), "--dump",
            dir_ + "/w" + std::to_string(r) + ".bin", "--leave"});
  for (auto& w : workers_) {
    ASSERT_TRUE(w->wait(90s)) << w->out() << w->err();
    ASSERT_EQ(w->exit_code(), 0) << w->out() << w->err();
  }
  std::vector<TensorPlan> plans = plan_job(tensors, yaml);
  Assignment a = assign_partitions(tensors, plans, {ServerInfo{0, "", 2}}, kPartitionBytes);
  std::vector<Dump> dumps;
  for (size_t r = 0; r < nodes.size(); ++r)
    dumps.push_back(read_dump(dir_ + "/w" + std::to_string(r) + ".bin"));
  size_t compared = 0;
  for (const Partition& p : a.partitions) {
    const TensorPlan& plan = plans[p.tensor];
    ASSERT_TRUE(plan.compressed_push());
    auto comp = compress::make_compressor(plan.spec());
    std::vector<std::unique_ptr<compress::TensorState>> wstate;
    for (size_t r = 0; r < nodes.size(); ++r) wstate.push_back(comp->make_state(p.count));
    // The server recompresses with its own compressor: no momentum, its own
    // residual as the plan says (test_semantics checks what that means).
    auto scomp = compress::make_sum_recompressor(plan.spec(), plan.server_error_feedback);
    auto sstate = scomp->make_state(p.count);
    for (uint64_t it = 0; it < iters; ++it) {
      std::vector<std::vector<std::byte>> pushed;
      for (uint32_t r = 0; r < nodes.size(); ++r) {
        std::vector<float> g(p.count);
        td::fill(g.data(), p.count, seed, r, p.tensor, it, p.offset);
        std::vector<std::byte> out(comp->max_compressed_bytes(p.count));
        compress::CompressContext ctx;
        ctx.iteration = it;
        ctx.shared_seed = partition_seed("cmp", p.key);
        ctx.private_seed = td::splitmix(r * 31 + p.key);
        out.resize(comp->compress(compress::ConstTensorView::cpu(g.data(), p.count), out,
                                  *wstate[r], ctx));
        pushed.push_back(std::move(out));
      }
      compress::CompressContext sctx;
      sctx.iteration = it;
      sctx.shared_seed = partition_seed("cmp", p.key);
      sctx.private_seed = p.key;  // server node id 0
      std::string expected;
      if (plan.sum == SumMode::kCompressed) {
        std::vector<std::span<const std::byte>> in;
        for (auto& b : pushed) in.emplace_back(b);
        std::vector<std::byte> out(comp->max_compressed_bytes(p.count));
        out.resize(comp->aggregate(in, out, sctx));
        expected.assign(reinterpret_cast<const char*>(out.data()), out.size());
      } else {
        std::vector<float> sum(p.count);
        for (uint32_t r = 0; r < nodes.size(); ++r)
          comp->decompress(pushed[r], compress::TensorView::cpu(sum.data(), p.count), r > 0, sctx);
        if (plan.pull == PullFormat::kFp16) {
          std::vector<uint16_t> h(p.count);
          compress::fp32_to_fp16(h.data(), sum.data(), p.count);
          expected.assign(reinterpret_cast<const char*>(h.data()), h.size() * 2);
        } else {
          ASSERT_EQ(plan.pull, PullFormat::kCompressed);
          std::vector<std::byte> out(scomp->max_compressed_bytes(p.count));
          out.resize(scomp->compress(compress::ConstTensorView::cpu(sum.data(), p.count), out,
                                     *sstate, sctx));
          expected.assign(reinterpret_cast<const char*>(out.data()), out.size());
        }
      }
      for (size_t r = 0; r < nodes.size(); ++r) {
        auto f = dumps[r].results.find({it, p.key});
        ASSERT_NE(f, dumps[r].results.end());
        ASSERT_EQ(f->second.size(), expected.size())
            << tensors[p.tensor].name << " (" << plan.describe() << ") iteration " << it;
        ASSERT_TRUE(f->second == expected)
            << tensors[p.tensor].name << " (" << plan.describe() << ") iteration " << it
            << " differs from the reference";
        ++compared;
      }
    }
  }
  EXPECT_EQ(compared, a.partitions.size() * iters * nodes.size());
  expect_released();
}

// In-process clients (the same library) for every refusal of the round.
TEST_P(ServerTest, RefusesBadPushesAndPullsNamingWhatWasWrong) {
  start_server();
  auto a = client(100), b = client(101);
  JobSpec spec;
  spec.name = "refuse";
  spec.nodes = {100, 101};
  spec.tensors = {{"w", 1000}, {"c", 1000}};
  spec.strategy_yaml =
      "version: 1\nentries:\n  - {tensor: c, option: {compressor: topk, inter: alltoall_allgather}}\n";
  auto [ja, jb] = join_both(*a, *b, spec);
  const uint64_t key = partition_key(0, 0), ckey = partition_key(1, 0);

  auto push = [](PsJob& j, uint64_t k, uint64_t it, size_t floats, float v = 1.0f) {
    std::vector<float> d(floats, v);
    std::promise<Status> p;
    j.push(k, it, transport::Buffer::copy_of(d.data(), d.size() * 4),
           [&](const Status& s) { p.set_value(s); });
    return p.get_future().get();
  };
  auto pull = [](PsJob& j, uint64_t k, uint64_t it) {
    std::promise<std::pair<Status, transport::Buffer>> p;
    j.pull(k, it, [&](const Status& s, transport::Buffer r) { p.set_value({s, r}); });
    return p.get_future().get();
  };
  auto expect_refused = [](const Status& s, const std::string& text) {
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find(text), std::string::npos) << s.to_string();
  };

  ASSERT_TRUE(push(*ja, key, 0, 1000).ok());
  expect_refused(push(*ja, key, 0, 1000), "duplicate push from node 100 (rank 0)");
  expect_refused(push(*ja, key, 1, 1000), "future iteration 1");
  expect_refused(push(*jb, key, 0, 999), "wrong length 3996 bytes");
  expect_refused(push(*jb, partition_key(7, 0), 0, 1000), "unknown key 0x700000000");
  expect_refused(push(*jb, partition_key(0, 3), 0, 1000), "has no partition 3");
  expect_refused(push(*jb, ckey, 0, 1000), "malformed compressed buffer");
  // A pull that arrives early waits for the round.
  // Structured bindings are captured as copies, by name (clang 14 refuses
  // to capture them implicitly).
  auto early = std::async(std::launch::async, [&, a = ja] { return pull(*a, key, 0); });
  EXPECT_EQ(early.wait_for(300ms), std::future_status::timeout);
  expect_refused(pull(*ja, key, 0).first, "duplicate pull from node 100");
  ASSERT_TRUE(push(*jb, key, 0, 1000, 2.0f).ok());
  auto [st, res] = early.get();
  ASSERT_TRUE(st.ok()) << st.to_string();
  ASSERT_EQ(res.size(), 4000u);
  float last = 0;  // received buffers need not be 4-byte aligned
  std::memcpy(&last, res.data() + 3996, 4);
  EXPECT_EQ(last, 3.0f);
  expect_refused(push(*ja, key, 0, 1000), "stale iteration 0");
  expect_refused(pull(*ja, key, 5).first, "future iteration 5");
  // Round 1 completes; iteration 0's result is then gone.
  ASSERT_TRUE(pull(*jb, key, 0).first.ok());
  ASSERT_TRUE(push(*ja, key, 1, 1000).ok());
  ASSERT_TRUE(push(*jb, key, 1, 1000).ok());
  ASSERT_TRUE(pull(*ja, key, 1).first.ok());
  expect_refused(pull(*ja, key, 0).first, "stale iteration 0");
  EXPECT_GE(stats().pushes_refused, 8u);
  // The job keeps working after all that.
  ASSERT_TRUE(push(*ja, key, 2, 1000).ok());
  ASSERT_TRUE(push(*jb, key, 2, 1000).ok());
  EXPECT_TRUE(pull(*jb, key, 2).first.ok());
  EXPECT_TRUE(ja->leave().ok());
  EXPECT_TRUE(jb->leave().ok());
  expect_released();
}

// A node whose local part failed aborts the job through the coordinator: the
// other nodes learn at once (a waiting pull fails with the reason) instead of
// waiting for their request deadline.
TEST_P(ServerTest, NodeAbortReachesTheOtherNodesAtOnce) {
  start_server();
  auto a = client(100), b = client(101);
  JobSpec spec;
  spec.name = "abortive";
  spec.nodes = {100, 101};
  spec.tensors = {{"w", 1000}};
  auto [ja, jb] = join_both(*a, *b, spec);
  std::vector<float> d(1000, 1.0f);
  std::promise<Status> pushed;
  jb->push(partition_key(0, 0), 0, transport::Buffer::copy_of(d.data(), d.size() * 4),
           [&](const Status& s) { pushed.set_value(s); });
  ASSERT_TRUE(pushed.get_future().get().ok());
  std::promise<Status> pulled;
  jb->pull(partition_key(0, 0), 0,
           [&](const Status& s, transport::Buffer) { pulled.set_value(s); });
  auto result = pulled.get_future();
  EXPECT_EQ(result.wait_for(200ms), std::future_status::timeout);  // waits for node 100
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(ja->abort("local rank 1 died").ok());
  ASSERT_EQ(result.wait_for(3s), std::future_status::ready) << "the other node was not told";
  Status st = result.get();
  EXPECT_EQ(st.code(), ErrorCode::kAborted) << st.to_string();
  EXPECT_NE(st.message().find("local rank 1 died"), std::string::npos) << st.to_string();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  EXPECT_EQ(jb->status().code(), ErrorCode::kAborted);
  EXPECT_EQ(ja->status().code(), ErrorCode::kAborted);
  // A push that was already on its way when the job ended is refused with
  // the job's end reason (what a node racing the abort reports to its
  // clients), not as an unknown job.
  {
    transport::TransportConfig tc = cluster_.transport;
    tc.node_id = 101;
    tc.listen = {};
    auto tp = transport::make_transport(tc);
    tp->start();
    tp->add_peer(0, address_);
    transport::Response r = tp->call(
        0,
        proto::to_message(proto::Push{jb->info().uid, partition_key(0, 0), 0,
                                      transport::Buffer::copy_of(d.data(), d.size() * 4)}),
        5000ms);
    ASSERT_TRUE(r.status.ok()) << r.status.to_string();
    Status late = proto::reply_status(r.response);
    EXPECT_EQ(late.code(), ErrorCode::kAborted) << late.to_string();
    EXPECT_NE(late.message().find("local rank 1 died"), std::string::npos) << late.to_string();
    tp->shutdown();
  }
  jb->leave();
  expect_released();
}

// abort_async() returns at once; destroying the client right after still
// tells the coordinator (close() waits for the answer), so the other node
// learns the reason instead of waiting for its request deadline.
TEST_P(ServerTest, AsyncAbortReachesTheCoordinatorWhenTheClientGoesAtOnce) {
  start_server();
  auto a = client(100), b = client(101);
  JobSpec spec;
  spec.name = "async-abort";
  spec.nodes = {100, 101};
  spec.tensors = {{"w", 1000}};
  auto [ja, jb] = join_both(*a, *b, spec);
  std::promise<Status> pulled;
  jb->pull(partition_key(0, 0), 0,
           [&](const Status& s, transport::Buffer) { pulled.set_value(s); });
  auto result = pulled.get_future();
  EXPECT_EQ(result.wait_for(200ms), std::future_status::timeout);  // waits for node 100
  std::promise<Status> answered;
  const auto t0 = std::chrono::steady_clock::now();
  ja->abort_async("local rank 0 died", [&](const Status& s) { answered.set_value(s); });
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 100ms) << "abort_async blocked";
  EXPECT_EQ(ja->status().code(), ErrorCode::kAborted);  // the handle is closed at once
  std::promise<Status> late;
  ja->push(partition_key(0, 0), 0, transport::Buffer::copy_of("x"),
           [&](const Status& s) { late.set_value(s); });
  EXPECT_EQ(late.get_future().get().code(), ErrorCode::kAborted);
  ja.reset();
  a.reset();  // close(): waits for the coordinator's answer
  auto answer = answered.get_future();
  ASSERT_EQ(answer.wait_for(0ms), std::future_status::ready) << "client closed before the answer";
  EXPECT_TRUE(answer.get().ok());
  ASSERT_EQ(result.wait_for(3s), std::future_status::ready) << "the other node was not told";
  Status st = result.get();
  EXPECT_EQ(st.code(), ErrorCode::kAborted) << st.to_string();
  EXPECT_NE(st.message().find("local rank 0 died"), std::string::npos) << st.to_string();
  jb->leave();
  expect_released();
}

// A node that aborts its job gets the coordinator's kJobAborted after the
// answer to its abort, i.e. for a job its client no longer holds. The client
// kept such aborts for good (meant for aborts overtaking an admission), and
// a restarted coordinator numbers jobs from 1 again: the next job of the
// reused uid failed on that node at its join with the old job's reason
// (found by scripts/chaos: kill-rank, kill-coordinator, new job).
TEST_P(ServerTest, AStaleAbortDoesNotFailALaterJobAndNoUidIsReusedAfterACoordinatorRestart) {
  start_server();
  auto a = client(100), b = client(101);
  JobSpec spec;
  spec.nodes = {100, 101};
  spec.tensors = {{"w", 1000}};
  // Whether the kJobAborted or the answer to the abort is handled first on
  // node 100 depends on the transport's threads: several jobs make a stale
  // entry (the answer first) all but certain.
  constexpr int kJobs = 8;
  std::vector<uint32_t> old_uids;
  for (int i = 0; i < kJobs; ++i) {
    spec.name = "before-restart-" + std::to_string(i);
    auto [ja, jb] = join_both(*a, *b, spec);
    old_uids.push_back(ja->info().uid);
    ASSERT_TRUE(ja->abort("local rank 0 of job " + spec.name + " died").ok());
    auto until = std::chrono::steady_clock::now() + 5s;
    while (jb->status().ok() && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(10ms);
    ASSERT_EQ(jb->status().code(), ErrorCode::kAborted) << jb->status().to_string();
  }
  std::this_thread::sleep_for(300ms);  // the last kJobAborted reaches node 100

  // The coordinator restarts on the same address.
  server_->kill(SIGKILL);
  ASSERT_TRUE(server_->wait(5s));
  write("restart-cluster.yaml", cluster_yaml({address_}, 5000));
  std::filesystem::remove(dir_ + "/ready0");
  server_ = launch_server(0, "restart-cluster.yaml", dir_ + "/ready0");
  ASSERT_EQ(wait_ready(*server_, dir_ + "/ready0"), address_);

  std::vector<float> d(1000, 1.0f);
  for (int i = 0; i < kJobs; ++i) {
    spec.name = "after-restart-" + std::to_string(i);
    std::shared_ptr<PsJob> ja, jb;
    auto until = std::chrono::steady_clock::now() + 15s;
    std::string last;
    while (!ja && std::chrono::steady_clock::now() < until) {
      try {
        std::tie(ja, jb) = join_both(*a, *b, spec);  // refused while the clients see it lost
      } catch (const Error& e) {
        last = e.what();
        std::this_thread::sleep_for(200ms);
      }
    }
    ASSERT_TRUE(ja) << "no job admitted by the restarted coordinator: " << last;
    // Since issue 28 a restarted coordinator numbers its jobs from a random
    // point: the uids whose late aborts node 100 may still hear are not
    // reused at all (the early-abort fix above guards the rest).
    ASSERT_EQ(std::count(old_uids.begin(), old_uids.end(), ja->info().uid), 0)
        << "the restarted coordinator reused uid " << ja->info().uid;
    ASSERT_TRUE(ja->status().ok()) << spec.name << ": " << ja->status().to_string();
    ASSERT_TRUE(jb->status().ok()) << spec.name << ": " << jb->status().to_string();
    for (PsJob* j : {ja.get(), jb.get()}) {
      std::promise<Status> pushed;
      j->push(partition_key(0, 0), 0, transport::Buffer::copy_of(d.data(), d.size() * 4),
              [&](const Status& s) { pushed.set_value(s); });
      EXPECT_TRUE(pushed.get_future().get().ok());
    }
    std::promise<Status> pulled;
    transport::Buffer sum;
    ja->pull(partition_key(0, 0), 0, [&](const Status& s, transport::Buffer r) {
      sum = std::move(r);
      pulled.set_value(s);
    });
    Status st = pulled.get_future().get();
    ASSERT_TRUE(st.ok()) << spec.name << ": " << st.to_string();
    ASSERT_EQ(sum.size(), d.size() * 4);
    float first = 0;
    std::memcpy(&first, sum.data(), 4);
    EXPECT_EQ(first, 2.0f);
    ja->leave();
    jb->leave();
  }
}

namespace {

// The names of shared memory this test's processes created in /dev/shm.
std::vector<std::string> shm_names(uint32_t uid) {
  std::vector<std::string> out;
  const std::string prefix = std::string(kShmPrefix) + std::to_string(uid) + ".";
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm"))
    if (e.path().filename().string().rfind(prefix, 0) == 0) out.push_back(e.path().string());
  return out;
}

// Lines of /proc/PID/maps naming a segment of job `uid` (mapped, even when
// its name is gone).
std::string shm_mappings(pid_t pid, uint32_t uid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/maps");
  const std::string prefix = std::string(kShmPrefix) + std::to_string(uid) + ".";
  std::string line, out;
  while (std::getline(f, line))
    if (line.find(prefix) != std::string::npos) out += line + "\n";
  return out;
}

uint64_t shm_bytes_metric(const std::string& text) {
  const std::string name = "bytecomp_server_shm_bytes_total ";
  const auto at = text.find("\n" + name);
  if (at == std::string::npos) return UINT64_MAX;
  return std::stoull(text.substr(at + 1 + name.size()));
}

// Pushes and pulls every partition of `job` for `iterations` iterations
// (node value: rank + 1 + element index % 7, scaled by the iteration) and
// checks every sum.
// `kept`: node a's answers of the last iteration, as pulled (Buffers).
void run_iterations(PsJob& a, PsJob& b, uint64_t first, uint64_t end,
                    std::vector<transport::Buffer>* kept = nullptr) {
  for (uint64_t it = first; it < end; ++it) {
    std::vector<std::future<Status>> pushes;
    std::vector<std::pair<const Partition*, std::future<std::pair<Status, std::string>>>> pulls;
    for (int node = 0; node < 2; ++node) {
      PsJob& j = node == 0 ? a : b;
      for (const Partition& p : j.info().assignment.partitions) {
        std::vector<float> v(p.count);
        for (uint64_t i = 0; i < p.count; ++i)
          v[i] = static_cast<float>((node + 1 + (p.offset + i) % 7) * (it + 1));
        auto pp = std::make_shared<std::promise<Status>>();
        pushes.push_back(pp->get_future());
        j.push(p.key, it, transport::Buffer::copy_of(v.data(), v.size() * 4),
               [pp](const Status& s) { pp->set_value(s); });
        auto pl = std::make_shared<std::promise<std::pair<Status, std::string>>>();
        pulls.emplace_back(&p, pl->get_future());
        std::vector<transport::Buffer>* keep = node == 0 && it + 1 == end ? kept : nullptr;
        j.pull(p.key, it, [pl, keep](const Status& s, transport::Buffer r) {
          if (keep) keep->push_back(r);  // completions run on one thread
          std::string bytes(r.view());
          // Released before the test thread wakes: a held answer keeps its
          // slot, and the next round's push would then take the socket.
          r = transport::Buffer();
          pl->set_value({s, std::move(bytes)});
        });
      }
    }
    for (auto& f : pushes) {
      ASSERT_EQ(f.wait_for(10s), std::future_status::ready);
      EXPECT_TRUE(f.get().ok());
    }
    for (auto& [p, f] : pulls) {
      ASSERT_EQ(f.wait_for(10s), std::future_status::ready);
      auto [st, bytes] = f.get();
      ASSERT_TRUE(st.ok()) << st.to_string();
      ASSERT_EQ(bytes.size(), p->count * 4);
      std::vector<float> got(p->count);
      std::memcpy(got.data(), bytes.data(), bytes.size());
      for (uint64_t i = 0; i < p->count; ++i)
        ASSERT_EQ(got[i], static_cast<float>((3 + 2 * ((p->offset + i) % 7)) * (it + 1)))
            << "iteration " << it << " key " << p->key << " element " << i;
    }
  }
}

}  // namespace

TEST_P(ServerTest, LocalShmCarriesThisHostsPartitionsAndLeavesNothingBehind) {
  if (GetParam() != "zmq") GTEST_SKIP() << "one backend is enough for the shared memory path";
  start_server();
  constexpr uint64_t kCount = 20000, kIterations = 3;
  JobSpec spec;
  spec.name = "shm";
  spec.nodes = {100, 101};
  spec.tensors = {{"x", kCount, compress::DType::kFloat32}};
  auto a = client(100), b = client(101);
  auto [ja, jb] = join_both(*a, *b, spec);
  // Attached and already unlinked: the mappings hold the memory.
  EXPECT_TRUE(shm_names(ja->info().uid).empty());
  EXPECT_NE(shm_mappings(server_->pid(), ja->info().uid), "");
  run_iterations(*ja, *jb, 0, kIterations);
  // Both nodes' pushes and answers, every byte, went through shared memory.
  EXPECT_EQ(shm_bytes_metric(a->metrics(0)), kIterations * 2 * 2 * kCount * 4);
  // A pulled answer still held stays intact while the next rounds run: its
  // slot is not reused (those rounds go over the socket for node a).
  std::vector<transport::Buffer> kept;
  run_iterations(*ja, *jb, kIterations, kIterations + 1, &kept);
  ASSERT_EQ(kept.size(), ja->info().assignment.partitions.size());
  std::vector<std::string> copies;
  for (const auto& k : kept) copies.emplace_back(k.view());
  run_iterations(*ja, *jb, kIterations + 1, kIterations + 3);
  for (size_t i = 0; i < kept.size(); ++i)
    EXPECT_TRUE(kept[i].view() == copies[i]) << "held answer " << i << " was overwritten";
  kept.clear();
  // Released, the slots carry the next rounds again.
  const uint64_t held_end = shm_bytes_metric(a->metrics(0));
  run_iterations(*ja, *jb, kIterations + 3, kIterations + 4);
  EXPECT_EQ(shm_bytes_metric(a->metrics(0)) - held_end, 2 * 2 * kCount * 4);
  const uint32_t uid = ja->info().uid;
  EXPECT_TRUE(ja->leave().ok());
  EXPECT_TRUE(jb->leave().ok());
  expect_released();
  EXPECT_EQ(shm_mappings(server_->pid(), uid), "") << "the server still maps the job's segments";
  ja.reset();
  jb.reset();
  EXPECT_EQ(shm_mappings(getpid(), uid), "") << "the clients still map the job's segments";

  // A node with local_shm off: only the other node's bytes go through it.
  transport::TransportConfig tc = cluster_.transport;
  tc.node_id = 102;
  tc.listen = {};
  PsClientOptions off;
  off.local_shm = false;
  auto c = PsClient::create(cluster_, tc, off);
  spec.name = "shm-one-node";
  spec.nodes = {100, 102};
  auto [ka, kc] = join_both(*a, *c, spec);
  const uint64_t before = shm_bytes_metric(a->metrics(0));
  run_iterations(*ka, *kc, 0, kIterations);
  EXPECT_EQ(shm_bytes_metric(a->metrics(0)) - before, kIterations * 2 * kCount * 4);
  // A node that aborts: the server ends the job and unmaps its segment.
  const uint32_t uid2 = ka->info().uid;
  EXPECT_TRUE(kc->abort("test").ok());
  expect_released();
  EXPECT_EQ(shm_mappings(server_->pid(), uid2), "");
  EXPECT_TRUE(shm_names(uid2).empty());
}

namespace {

// Whether every thread of `pid` is stopped (SIGSTOP took effect), within 5 s.
bool wait_stopped(pid_t pid) {
  const auto until = std::chrono::steady_clock::now() + 5s;
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  do {
    bool all = true;
    for (const auto& t : std::filesystem::directory_iterator(tasks)) {
      std::string stat = td::read_file(t.path().string() + "/stat");
      const auto paren = stat.rfind(')');
      const char state = paren == std::string::npos || paren + 2 >= stat.size() ? '?' : stat[paren + 2];
      if (state != 'T' && state != 't') all = false;
    }
    if (all) return true;
    std::this_thread::sleep_for(5ms);
  } while (std::chrono::steady_clock::now() < until);
  return false;
}

}  // namespace

// A shared-memory pull that timed out may still wait on the server, which
// writes the answer into the slot whenever it comes: the slot must not take
// this node's next push meanwhile. The server is stopped past the pull's
// deadline and continued after the next push was sent, so the late answer
// lands (in the server's order of the node's messages) just before that
// push is read.
TEST_P(ServerTest, LocalShmPullThatTimedOutKeepsItsSlotUntilTheServerIsPastItsRound) {
  if (GetParam() != "zmq") GTEST_SKIP() << "one backend is enough for the shared memory path";
  start_server();
  constexpr uint64_t kCount = 1000;
  JobSpec spec;
  spec.name = "shm-late";
  spec.nodes = {100, 101};
  spec.tensors = {{"x", kCount, compress::DType::kFloat32}};
  auto a = client(100), b = client(101);
  auto [ja, jb] = join_both(*a, *b, spec);
  ASSERT_EQ(ja->info().assignment.partitions.size(), 1u);
  const uint64_t key = ja->info().assignment.partitions[0].key;
  auto push = [&](PsJob& j, uint64_t it, float v) {
    std::vector<float> d(kCount, v);
    auto p = std::make_shared<std::promise<Status>>();
    j.push(key, it, transport::Buffer::copy_of(d.data(), d.size() * 4),
           [p](const Status& s) { p->set_value(s); });
    return p->get_future();
  };
  // The pulled sum's elements, all equal, or NaN if they differ.
  auto pull = [&](PsJob& j, uint64_t it, Millis timeout, transport::Buffer* keep = nullptr) {
    auto p = std::make_shared<std::promise<std::pair<Status, float>>>();
    j.pull(key, it, [p, keep](const Status& s, transport::Buffer r) {
      float v = std::nanf("");
      if (s.ok() && r.size() == kCount * 4) {
        std::vector<float> got(kCount);
        std::memcpy(got.data(), r.data(), r.size());
        if (std::all_of(got.begin(), got.end(), [&](float g) { return g == got[0]; })) v = got[0];
      }
      if (keep) *keep = std::move(r);
      r = transport::Buffer();
      p->set_value({s, v});
    }, timeout);
    return p->get_future();
  };
  auto ok = [](std::future<Status> f) {
    if (f.wait_for(10s) != std::future_status::ready) return Status(ErrorCode::kTimeout, "test: no answer");
    return f.get();
  };
  auto sum = [](std::future<std::pair<Status, float>> f) {
    if (f.wait_for(10s) != std::future_status::ready)
      return std::make_pair(Status(ErrorCode::kTimeout, "test: no answer"), 0.0f);
    return f.get();
  };
  // Iteration 0; node a keeps its answer, so its slot is busy and its push
  // of iteration 1 goes over the socket: nothing of a's lives in the slot.
  transport::Buffer held;
  ASSERT_TRUE(ok(push(*ja, 0, 1)).ok());
  ASSERT_TRUE(ok(push(*jb, 0, 2)).ok());
  auto [s0, v0] = sum(pull(*ja, 0, Millis{0}, &held));
  ASSERT_TRUE(s0.ok()) << s0.to_string();
  EXPECT_EQ(v0, 3.0f);
  ASSERT_TRUE(ok(push(*ja, 1, 10)).ok());
  ASSERT_TRUE(ok(push(*jb, 1, 20)).ok());
  held = transport::Buffer();
  // a's pull of iteration 1 takes the free slot and times out on a stopped
  // server; a's push of iteration 2 is sent while the server still is.
  const pid_t server = server_->pid();
  ASSERT_EQ(::kill(server, SIGSTOP), 0);
  struct Continue {
    pid_t pid;
    ~Continue() { ::kill(pid, SIGCONT); }
  } resume{server};
  ASSERT_TRUE(wait_stopped(server));
  auto [s1, v1] = sum(pull(*ja, 1, Millis{200}));
  EXPECT_EQ(s1.code(), ErrorCode::kTimeout) << s1.to_string();
  std::future<Status> pushed2 = push(*ja, 2, 100);
  ASSERT_EQ(::kill(server, SIGCONT), 0);
  ASSERT_TRUE(ok(std::move(pushed2)).ok());
  ASSERT_TRUE(ok(push(*jb, 2, 200)).ok());
  // Had the push gone through the slot, the late answer of iteration 1 (30)
  // would have replaced a's 100 before the server read it.
  auto [sa2, va2] = sum(pull(*ja, 2, Millis{0}));
  auto [sb2, vb2] = sum(pull(*jb, 2, Millis{0}));
  ASSERT_TRUE(sa2.ok()) << sa2.to_string();
  ASSERT_TRUE(sb2.ok()) << sb2.to_string();
  EXPECT_EQ(va2, 300.0f);
  EXPECT_EQ(vb2, 300.0f);
  // The answered pull of iteration 2 showed the server past iteration 1:
  // a's slot carries its push and pull again.
  const uint64_t before = shm_bytes_metric(a->metrics(0));
  ASSERT_TRUE(ok(push(*ja, 3, 1000)).ok());
  ASSERT_TRUE(ok(push(*jb, 3, 2000)).ok());
  auto [sa3, va3] = sum(pull(*ja, 3, Millis{0}));
  auto [sb3, vb3] = sum(pull(*jb, 3, Millis{0}));
  EXPECT_TRUE(sa3.ok() && sb3.ok()) << sa3.to_string() << " " << sb3.to_string();
  EXPECT_EQ(va3, 3000.0f);
  EXPECT_EQ(vb3, 3000.0f);
  EXPECT_EQ(shm_bytes_metric(a->metrics(0)) - before, 2 * 2 * kCount * 4)
      << "a's slot stayed reserved after the server answered a later pull";
  EXPECT_TRUE(ja->leave().ok());
  EXPECT_TRUE(jb->leave().ok());
  expect_released();
}

TEST_P(ServerTest, BadShmControlMessagesGetClearErrorsAndTheServerSurvives) {
  if (GetParam() != "zmq") GTEST_SKIP() << "one backend is enough for the shared memory path";
  start_server();
  transport::TransportConfig tc = cluster_.transport;
  tc.node_id = 150;
  tc.listen = {};
  auto tp = transport::make_transport(tc);
  tp->start();
  tp->add_peer(0, address_);
  auto call = [&](const transport::Message& m) {
    transport::Response r = tp->call(0, m, 5000ms);
    EXPECT_TRUE(r.status.ok()) << r.status.to_string();
    return r;
  };
  JobSpec spec;
  spec.name = "raw-shm";
  spec.nodes = {150};
  spec.tensors = {{"x", 100, compress::DType::kFloat32}};
  transport::Response r = call(proto::to_message(proto::Register{spec}));
  ASSERT_TRUE(proto::reply_status(r.response).ok()) << proto::reply_status(r.response).to_string();
  const proto::Admission adm = proto::decode_admission(proto::joined(r.response));
  const uint32_t uid = adm.uid;
  std::vector<TensorPlan> plans(adm.tensors.size());
  const Assignment as = assign_partitions(adm.tensors, plans, adm.servers, adm.partition_bytes);
  ASSERT_EQ(as.partitions.size(), 1u);
  const uint64_t key = as.partitions[0].key;
  auto status_of = [&](const transport::Message& m) { return proto::reply_status(call(m).response); };

  Status s = status_of(proto::to_message(proto::ShmPush{uid, key, 0, 0, 400}));
  EXPECT_NE(s.message().find("node 150 attached no shared memory to server 0"), std::string::npos)
      << s.to_string();
  s = status_of(proto::to_message(proto::ShmAttach{uid, "elsewhere/1", "bytecomp-ps.1.150.0.1", 4096}));
  EXPECT_EQ(s.code(), ErrorCode::kUnavailable);
  EXPECT_NE(s.message().find("another host or network namespace"), std::string::npos) << s.to_string();
  s = status_of(proto::to_message(proto::ShmAttach{uid, host_identity(), "bytecomp.dae.1.1", 4096}));
  EXPECT_NE(s.message().find("segment name 'bytecomp.dae.1.1' is not bytecomp-ps."), std::string::npos)
      << s.to_string();
  const std::string name = shm_segment_name(uid, 150, 0, getpid());
  s = status_of(proto::to_message(proto::ShmAttach{uid, host_identity(), name, 4096}));
  EXPECT_NE(s.message().find("cannot open shared memory " + name), std::string::npos) << s.to_string();
  auto seg = LocalShm::create(name, 4096);
  s = status_of(proto::to_message(proto::ShmAttach{uid, host_identity(), name, 8192}));
  EXPECT_NE(s.message().find("holds 4096 bytes, not the 8192 announced"), std::string::npos)
      << s.to_string();
  s = status_of(proto::to_message(proto::ShmAttach{uid, host_identity(), name, 4096}));
  ASSERT_TRUE(s.ok()) << s.to_string();
  seg->unlink();
  s = status_of(proto::to_message(proto::ShmAttach{uid, host_identity(), name, 4096}));
  EXPECT_NE(s.message().find("already attached"), std::string::npos) << s.to_string();
  // Ranges outside the segment, the edge included.
  s = status_of(proto::to_message(proto::ShmPush{uid, key, 0, 4000, 400}));
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("bytes [4000, 4000+400) lie outside node 150's segment of 4096 bytes"),
            std::string::npos) << s.to_string();
  s = status_of(proto::to_message(proto::ShmPull{uid, key, 0, 5000, 1}));
  EXPECT_NE(s.message().find("lie outside"), std::string::npos) << s.to_string();
  s = status_of(proto::to_message(proto::ShmPush{uid, key, 0, 4096, 1}));
  EXPECT_NE(s.message().find("lie outside"), std::string::npos) << s.to_string();
  // The round's rules hold as for a socket push: a wrong length is refused.
  s = status_of(proto::to_message(proto::ShmPush{uid, key, 0, 0, 396}));
  EXPECT_NE(s.message().find("wrong length 396 bytes"), std::string::npos) << s.to_string();
  // A good round: the push is read from the segment, the answer written to it.
  std::vector<float> v(100);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i) * 0.5f;
  std::memcpy(seg->data(), v.data(), 400);
  s = status_of(proto::to_message(proto::ShmPush{uid, key, 0, 0, 400}));
  ASSERT_TRUE(s.ok()) << s.to_string();
  r = call(proto::to_message(proto::ShmPull{uid, key, 0, 512, 512}));
  ASSERT_TRUE(proto::reply_status(r.response).ok());
  ASSERT_EQ(r.response.payloads.size(), 1u);
  EXPECT_EQ(proto::decode_shm_answer(r.response.payloads[0].view()), (proto::ShmAnswer{400, true}));
  EXPECT_EQ(std::memcmp(seg->data() + 512, v.data(), 400), 0);
  // An answer longer than the pull's capacity travels in the reply.
  r = call(proto::to_message(proto::ShmPull{uid, key, 0, 1024, 100}));
  ASSERT_TRUE(proto::reply_status(r.response).ok());
  ASSERT_EQ(r.response.payloads.size(), 2u);
  EXPECT_EQ(proto::decode_shm_answer(r.response.payloads[0].view()), (proto::ShmAnswer{400, false}));
  EXPECT_EQ(std::memcmp(r.response.payloads[1].data(), v.data(), 400), 0);
  // Garbage in the control payload.
  transport::Message junk = proto::to_message(proto::ShmPush{uid, key, 1, 0, 400});
  junk.payloads[0] = transport::Buffer::copy_of("\x02\x00zz");
  s = status_of(junk);
  EXPECT_EQ(s.code(), ErrorCode::kMalformed);
  EXPECT_NE(s.message().find("shm push"), std::string::npos) << s.to_string();
  EXPECT_NE(shm_mappings(server_->pid(), uid), "");
  s = proto::reply_status(call(proto::to_message(proto::Leave{uid, false, ""})).response);
  EXPECT_TRUE(s.ok()) << s.to_string();
  tp->shutdown();
  expect_released();
  EXPECT_EQ(shm_mappings(server_->pid(), uid), "") << "the server still maps the segment";
}

// A compressed push through shared memory is checked when it arrives but
// (summed compressed) decoded when the round completes; the node can still
// write its segment meanwhile. What it writes after the push was accepted
// must not reach the sum.
TEST_P(ServerTest, ShmCompressedPushRewrittenAfterItWasAcceptedDoesNotChangeTheSum) {
  if (GetParam() != "zmq") GTEST_SKIP() << "one backend is enough for the shared memory path";
  start_server();
  auto transport_of = [&](NodeId id) {
    transport::TransportConfig tc = cluster_.transport;
    tc.node_id = id;
    tc.listen = {};
    auto tp = transport::make_transport(tc);
    tp->start();
    tp->add_peer(0, address_);
    return tp;
  };
  auto ta = transport_of(150), tb = transport_of(151);
  auto status_of = [](transport::Transport& tp, const transport::Message& m) {
    transport::Response r = tp.call(0, m, 5000ms);
    return r.status.ok() ? proto::reply_status(r.response) : r.status;
  };
  constexpr uint64_t kCount = 100;
  JobSpec spec;
  spec.name = "shm-toctou";
  spec.nodes = {150, 151};
  spec.tensors = {{"x", kCount, compress::DType::kFloat32}};
  // fp16 under a reducing collective: the server stores the pushes and sums
  // them compressed at the round's end.
  spec.strategy_yaml =
      "version: 1\nentries:\n  - {tensor: x, option: {compressor: fp16, inter: reduce_scatter_allgather}}\n";
  auto fb = std::async(std::launch::async,
                       [&] { return tb->call(0, proto::to_message(proto::Register{spec}), 10000ms); });
  transport::Response r = ta->call(0, proto::to_message(proto::Register{spec}), 10000ms);
  ASSERT_TRUE(r.status.ok() && proto::reply_status(r.response).ok())
      << r.status.to_string() << proto::reply_status(r.response).to_string();
  ASSERT_TRUE(proto::reply_status(fb.get().response).ok());
  const proto::Admission adm = proto::decode_admission(proto::joined(r.response));
  const uint32_t uid = adm.uid;
  const std::vector<TensorPlan> plans = plan_job(adm.tensors, spec.strategy_yaml);
  ASSERT_EQ(plans[0].sum, SumMode::kCompressed) << plans[0].describe();
  const Assignment as = assign_partitions(adm.tensors, plans, adm.servers, adm.partition_bytes);
  ASSERT_EQ(as.partitions.size(), 1u);
  const uint64_t key = as.partitions[0].key;
  auto comp = compress::make_compressor(plans[0].spec());
  auto state = comp->make_state(kCount);
  auto compressed = [&](float value) {
    std::vector<float> v(kCount);
    for (size_t i = 0; i < v.size(); ++i) v[i] = value + static_cast<float>(i) * 0.25f;
    std::vector<std::byte> out(comp->max_compressed_bytes(kCount));
    out.resize(comp->compress(compress::ConstTensorView::cpu(v.data(), kCount), out, *state, {}));
    return out;
  };
  const std::vector<std::byte> pa = compressed(1), pb = compressed(2), rewritten = compressed(1000);
  ASSERT_EQ(rewritten.size(), pa.size());

  const std::string name = shm_segment_name(uid, 150, 0, getpid());
  auto seg = LocalShm::create(name, 4096);
  Status s = status_of(*ta, proto::to_message(proto::ShmAttach{uid, host_identity(), name, 4096}));
  ASSERT_TRUE(s.ok()) << s.to_string();
  seg->unlink();
  std::memcpy(seg->data(), pa.data(), pa.size());
  s = status_of(*ta, proto::to_message(proto::ShmPush{uid, key, 0, 0, pa.size()}));
  ASSERT_TRUE(s.ok()) << s.to_string();
  // Accepted (the reply comes after the round took the push): now rewritten.
  std::memcpy(seg->data(), rewritten.data(), rewritten.size());
  s = status_of(*tb, proto::to_message(
                         proto::Push{uid, key, 0, transport::Buffer::copy_of(pb.data(), pb.size())}));
  ASSERT_TRUE(s.ok()) << s.to_string();
  r = ta->call(0, proto::to_message(proto::Pull{uid, key, 0}), 5000ms);
  ASSERT_TRUE(r.status.ok() && proto::reply_status(r.response).ok())
      << r.status.to_string() << proto::reply_status(r.response).to_string();
  const std::string got = proto::joined(r.response);
  std::vector<std::span<const std::byte>> in{pa, pb};
  std::vector<std::byte> expected(comp->max_compressed_bytes(kCount));
  expected.resize(comp->aggregate(in, expected, {}));
  ASSERT_EQ(got.size(), expected.size());
  EXPECT_EQ(std::memcmp(got.data(), expected.data(), expected.size()), 0)
      << "the sum holds bytes written to the segment after the push was accepted";
  for (auto* tp : {ta.get(), tb.get()}) {
    s = status_of(*tp, proto::to_message(proto::Leave{uid, false, ""}));
    EXPECT_TRUE(s.ok()) << s.to_string();
  }
  ta->shutdown();
  tb->shutdown();
  expect_released();
}

TEST_P(ServerTest, GarbageFramesAndUnknownJobsAreRefusedAndTheServerSurvives) {
  if (GetParam() != "zmq") GTEST_SKIP() << "raw frames are thrown at the zmq backend's socket";
  start_server();
  // Raw ZeroMQ garbage: not even a transport header.
  {
    void* ctx = zmq_ctx_new();
    void* s = zmq_socket(ctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    ASSERT_EQ(zmq_connect(s, address_.c_str()), 0);
    for (int i = 0; i < 20; ++i) {
      std::string junk(static_cast<size_t>(1 + i * 37), static_cast<char>(i * 13));
      zmq_send(s, junk.data(), junk.size(), i % 2 ? ZMQ_SNDMORE : 0);
    }
    zmq_send(s, "x", 1, 0);
    std::this_thread::sleep_for(200ms);
    zmq_close(s);
    zmq_ctx_term(ctx);
  }
  // Valid transport frames, invalid server messages.
  {
    transport::TransportConfig tc = cluster_.transport;
    tc.node_id = 150;
    tc.listen = {};
    auto tp = transport::make_transport(tc);
    tp->start();
    tp->add_peer(0, address_);
    auto call = [&](uint16_t type, uint32_t aux, std::string payload) {
      transport::Message m;
      m.header.type = type;
      m.header.aux = aux;
      if (!payload.empty()) m.payloads.push_back(transport::Buffer::copy_of(payload));
      transport::Response r = tp->call(0, std::move(m), 5000ms);
      EXPECT_TRUE(r.status.ok()) << r.status.to_string();
      return proto::reply_status(r.response);
    };
    Status s = call(proto::kRegister, 0, std::string("\x01\x00garbage", 9));
    EXPECT_EQ(s.code(), ErrorCode::kMalformed) << s.to_string();
    EXPECT_NE(s.message().find("register"), std::string::npos) << s.to_string();
    s = call(proto::kRegister, 0, std::string("\x09\x00", 2));
    EXPECT_NE(s.message().find("protocol version 9"), std::string::npos) << s.to_string();
    s = call(0x1234, 0, "");
    EXPECT_NE(s.message().find("unknown message type 0x1234"), std::string::npos) << s.to_string();
    s = call(proto::kPush, 999, "abcd");
    EXPECT_NE(s.message().find("unknown job uid 999"), std::string::npos) << s.to_string();
    s = call(proto::kJobSetup, 5, "zz");
    EXPECT_NE(s.message().find("not the coordinator"), std::string::npos) << s.to_string();
    tp->shutdown();
  }
  EXPECT_GE(stats().frames_refused, 3u);
  // Still serving.
  const std::vector<NodeId> nodes = {100, 101};
  for (size_t r = 0; r < nodes.size(); ++r)
    worker("w" + std::to_string(r),
           {"--node", std::to_string(nodes[r]), "--job", "after", "--nodes", nodes_arg(nodes),
            "--tensors", "x:1000", "--iterations", "3", "--leave"});
  for (auto& w : workers_) {
    ASSERT_TRUE(w->wait(30s));
    EXPECT_EQ(w->exit_code(), 0) << w->out() << w->err();
  }
}

TEST_P(ServerTest, MismatchedDeclarationsFailNamingTensorAndNode) {
  start_server();
  auto a = client(100), b = client(101);
  JobSpec sa, sb;
  sa.name = sb.name = "mismatch";
  sa.nodes = sb.nodes = {100, 101};
  sa.tensors = {{"emb", 1000}, {"fc", 200}};
  sb.tensors = {{"emb", 1000}, {"fc", 300}};
  auto fa = std::async(std::launch::async, [&]() -> std::string {
    try {
      a->join(sa);
    } catch (const Error& e) {
      return e.what();
    }
    return "joined";
  });
  std::this_thread::sleep_for(100ms);
  std::string eb;
  try {
    b->join(sb);
  } catch (const Error& e) {
    eb = e.what();
  }
  std::string ea = fa.get();
  for (const std::string& e : {ea, eb}) {
    EXPECT_NE(e.find("tensor #1 differs on node 101"), std::string::npos) << e;
    EXPECT_NE(e.find("'fc' 300 x float32"), std::string::npos) << e;
    EXPECT_NE(e.find("'fc' 200 x float32"), std::string::npos) << e;
  }
  // A node outside the declared list is refused too.
  auto c = client(105);
  try {
    c->join(sa);
    ADD_FAILURE() << "node 105 joined a job of nodes 100, 101";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not in the job's node list"), std::string::npos) << e.what();
  }
  expect_released();
}

TEST_P(ServerTest, AdmissionTimesOutNamingTheMissingNodes) {
  start_server(/*admission_ms=*/800);
  auto a = client(101);
  JobSpec s;
  s.name = "incomplete";
  s.nodes = {101, 100, 102};
  s.tensors = {{"w", 10}};
  auto t0 = std::chrono::steady_clock::now();
  try {
    a->join(s);
    FAIL() << "admitted with missing nodes";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    std::string m = e.what();
    EXPECT_NE(m.find("node 100 (" + endpoint("127.0.0.1:9") + ") (rank 1)"), std::string::npos)
        << m;
    EXPECT_NE(m.find("node 102 (rank 2)"), std::string::npos) << m;
    EXPECT_EQ(m.find("node 101", m.find("missing:")), std::string::npos) << m;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
}

TEST_P(ServerTest, BarrierAndStrategyChangeAtAnIterationBoundary) {
  start_server();
  auto a = client(100), b = client(101);
  JobSpec spec;
  spec.name = "change";
  spec.nodes = {100, 101};
  spec.tensors = {{"w", 5000}};
  spec.deterministic = true;
  auto [ja, jb] = join_both(*a, *b, spec);
  // Barrier: nobody passes until both arrived.
  std::promise<Status> pa;
  ja->barrier([&](const Status& s) { pa.set_value(s); }, 5000ms);
  auto fpa = pa.get_future();
  EXPECT_EQ(fpa.wait_for(300ms), std::future_status::timeout);
  EXPECT_TRUE(jb->barrier(5000ms).ok());
  EXPECT_TRUE(fpa.get().ok());

  std::atomic<int> seen{0};
  for (auto* j : {ja.get(), jb.get()})
    j->on_strategy_change([&](const StrategyChange& c) {
      EXPECT_EQ(c.iteration, 2u);
      ++seen;
    });
  auto round = [&, a = ja.get(), b = jb.get()](uint64_t it) {
    std::vector<std::future<std::pair<Status, transport::Buffer>>> fs;
    for (auto* j : {a, b}) {
      TensorPlan plan = j->timeline().plan(0, it);
      std::vector<float> g(5000);
      td::fill(g.data(), g.size(), 3, j->info().rank, 0, it, 0);
      transport::Buffer payload;
      if (plan.compressed_push()) {
        auto c = compress::make_compressor(plan.spec());
        auto st = c->make_state(g.size());
        std::vector<std::byte> out(c->max_compressed_bytes(g.size()));
        out.resize(c->compress(compress::ConstTensorView::cpu(g.data(), g.size()), out, *st, {}));
        payload = transport::Buffer::take(std::move(out));
      } else {
        payload = transport::Buffer::copy_of(g.data(), g.size() * 4);
      }
      j->push(partition_key(0, 0), it, payload, [](const Status& s) { EXPECT_TRUE(s.ok()) << s.to_string(); });
      auto p = std::make_shared<std::promise<std::pair<Status, transport::Buffer>>>();
      fs.push_back(p->get_future());
      j->pull(partition_key(0, 0), it, [p](const Status& s, transport::Buffer r) { p->set_value({s, r}); });
    }
    std::vector<transport::Buffer> out;
    for (auto& f : fs) {
      auto [s, r] = f.get();
      EXPECT_TRUE(s.ok()) << s.to_string();
      out.push_back(r);
    }
    return out;
  };
  EXPECT_EQ(round(0)[0].size(), 20000u);
  const std::string fp16 =
      "version: 1\nentries:\n  - {tensor: w, option: {compressor: fp16, inter: alltoall_allgather}}\n";
  Status s = ja->set_strategy(fp16, 2, 5000ms);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_GE(seen.load(), 1);  // the requester saw the change before its done
  EXPECT_EQ(round(1)[0].size(), 20000u);  // still fp32 at iteration 1
  auto r2 = round(2);                     // fp16 from iteration 2, for everyone
  EXPECT_EQ(r2[0].size(), 10000u);
  EXPECT_EQ(r2[1].size(), 10000u);
  EXPECT_EQ(seen.load(), 2);
  EXPECT_EQ(ja->timeline().plan(0, 1).pull, PullFormat::kFp32);
  EXPECT_EQ(jb->timeline().plan(0, 2).pull, PullFormat::kFp16);
  // Too late: iteration 3 already started on the server.
  std::vector<float> g(5000, 1.0f);
  auto c = compress::make_compressor(ja->timeline().plan(0, 3).spec());
  auto st = c->make_state(g.size());
  std::vector<std::byte> out(c->max_compressed_bytes(g.size()));
  out.resize(c->compress(compress::ConstTensorView::cpu(g.data(), g.size()), out, *st, {}));
  std::promise<Status> pushed;
  ja->push(partition_key(0, 0), 3, transport::Buffer::take(std::move(out)),
           [&](const Status& s2) { pushed.set_value(s2); });
  ASSERT_TRUE(pushed.get_future().get().ok());
  s = ja->set_strategy("version: 1\n", 3, 5000ms);
  EXPECT_NE(s.message().find("already started iteration 3"), std::string::npos) << s.to_string();
  s = jb->set_strategy(
      "version: 1\nentries:\n  - {tensor: w, option: {compressor: none, inter: reduce_broadcast}}\n", 9,
      5000ms);
  EXPECT_NE(s.message().find("tensor 'w' would move from ps to ps_single"), std::string::npos)
      << s.to_string();
  EXPECT_NE(s.message().find("to or from ps_single or allgather needs a new job"),
            std::string::npos)
      << s.to_string();
  // ps -> ring is a move the servers could take, but these nodes have no
  // peer endpoint, so no ring was opened: refused, naming tensor and node.
  s = jb->set_strategy(
      "version: 1\nentries:\n  - {tensor: w, option: {compressor: none, inter: allreduce}}\n", 9,
      5000ms);
  EXPECT_NE(s.message().find("tensor 'w' would move from ps to the daemons' ring, but node 100"),
            std::string::npos)
      << s.to_string();
  EXPECT_NE(s.message().find("has no peer endpoint"), std::string::npos) << s.to_string();
  EXPECT_TRUE(ja->leave().ok());
  EXPECT_TRUE(jb->leave().ok());
  expect_released();
}

TEST_P(ServerTest, WorkerKilledMidIterationAbortsTheJobForEveryone) {
  start_server();
  const std::vector<NodeId> nodes = {100, 101, 102};
  for (size_t r = 0; r < nodes.size(); ++r) {
    std::vector<std::string> args = {"--node", std::to_string(nodes[r]), "--job", "victim", "--nodes",
                                     nodes_arg(nodes), "--tensors", "w:50000", "--iterations", "50",
                                     "--timeout-ms", "30000"};
    if (r == 2) args.insert(args.end(), {"--pause-at", "3:1"});  // pushes 1 of 4 partitions
    worker("w" + std::to_string(r), args);
  }
  ASSERT_TRUE(workers_[2]->wait_for_output("PAUSED", 30s)) << workers_[2]->out() << workers_[2]->err();
  auto mid = stats();
  EXPECT_EQ(mid.jobs, 1u);
  EXPECT_GT(mid.job_bytes, 0u);
  auto t0 = std::chrono::steady_clock::now();
  workers_[2]->kill(SIGKILL);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(workers_[r]->wait(10s)) << "worker " << r << " hangs";
    EXPECT_EQ(workers_[r]->exit_code(), 3) << workers_[r]->out();
    EXPECT_NE(workers_[r]->out().find("ERROR aborted"), std::string::npos) << workers_[r]->out();
    EXPECT_NE(workers_[r]->out().find("node 102"), std::string::npos) << workers_[r]->out();
  }
  // Heartbeat bound: peer_timeout 1 s plus scheduling.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  expect_released();
}

TEST_P(ServerTest, ServerKilledWorkersGetAnErrorNotAHang) {
  start_server();
  const std::vector<NodeId> nodes = {100, 101};
  worker("w0", {"--node", "100", "--job", "orphan", "--nodes", nodes_arg(nodes), "--tensors", "w:1000",
                "--iterations", "50", "--timeout-ms", "30000"});
  worker("w1", {"--node", "101", "--job", "orphan", "--nodes", nodes_arg(nodes), "--tensors", "w:1000",
                "--iterations", "50", "--timeout-ms", "30000", "--pause-at", "2:0"});
  ASSERT_TRUE(workers_[1]->wait_for_output("PAUSED", 30s)) << workers_[1]->err();
  auto t0 = std::chrono::steady_clock::now();
  server_->kill(SIGKILL);
  server_killed_ = true;
  ASSERT_TRUE(workers_[0]->wait(10s)) << "worker hangs after the server died";
  EXPECT_EQ(workers_[0]->exit_code(), 3) << workers_[0]->out();
  EXPECT_NE(workers_[0]->out().find("ERROR peer lost"), std::string::npos) << workers_[0]->out();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
}

TEST_P(ServerTest, SecondServerKilledAbortsTheJobAndReleasesTheCoordinatorsShare) {
  start_server(5000, /*servers=*/2);
  const std::vector<NodeId> nodes = {100, 101};
  worker("w0", {"--node", "100", "--job", "half", "--nodes", nodes_arg(nodes), "--tensors",
                "a:40000,b:40000", "--iterations", "50", "--timeout-ms", "30000"});
  worker("w1", {"--node", "101", "--job", "half", "--nodes", nodes_arg(nodes), "--tensors",
                "a:40000,b:40000", "--iterations", "50", "--timeout-ms", "30000", "--pause-at",
                "2:0"});
  ASSERT_TRUE(workers_[1]->wait_for_output("PAUSED", 30s)) << workers_[1]->err();
  EXPECT_EQ(stats(0).jobs, 1u);
  auto t0 = std::chrono::steady_clock::now();
  server1_->kill(SIGKILL);
  server1_.reset();
  ASSERT_TRUE(workers_[0]->wait(10s)) << "worker hangs after server 1 died";
  EXPECT_EQ(workers_[0]->exit_code(), 3) << workers_[0]->out();
  EXPECT_NE(workers_[0]->out().find("server 1 lost"), std::string::npos) << workers_[0]->out();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  expect_released();  // the coordinator dropped the job and its memory too
}

TEST_P(ServerTest, SigtermShutsDownCleanlyWithAJobRunning) {
  start_server();
  auto a = client(100);
  JobSpec s;
  s.name = "solo";
  s.nodes = {100};
  s.tensors = {{"w", 100}};
  auto j = a->join(s);
  // A one-node job: the sum is the push itself.
  std::vector<float> g(100);
  td::fill(g.data(), g.size(), 4, 0, 0, 0, 0);
  std::promise<std::pair<Status, transport::Buffer>> p0;
  j->push(partition_key(0, 0), 0, transport::Buffer::copy_of(g.data(), 400), nullptr);
  j->pull(partition_key(0, 0), 0, [&](const Status& st, transport::Buffer b) { p0.set_value({st, b}); });
  auto [st0, b0] = p0.get_future().get();
  ASSERT_TRUE(st0.ok()) << st0.to_string();
  ASSERT_EQ(b0.size(), 400u);
  EXPECT_EQ(std::memcmp(b0.data(), g.data(), 400), 0);
  std::promise<Status> p;
  j->pull(partition_key(0, 0), 1, [&](const Status& st, transport::Buffer) { p.set_value(st); });
  auto f = p.get_future();
  EXPECT_EQ(f.wait_for(200ms), std::future_status::timeout);
  server_->kill(SIGTERM);
  ASSERT_TRUE(server_->wait(10s));
  EXPECT_EQ(server_->exit_code(), 0) << server_->err();
  ASSERT_EQ(f.wait_for(5s), std::future_status::ready);
  Status st = f.get();
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("shut down"), std::string::npos) << st.to_string();
  std::string log = server_->err();
  for (const char* line : {"serving on", "job 'solo'", "admitted", "received SIGTERM", "stopped"})
    EXPECT_NE(log.find(line), std::string::npos) << line << "\n" << log;
  server_.reset();
}

INSTANTIATE_TEST_SUITE_P(Backends, ServerTest,
                         ::testing::ValuesIn(bytecomp::transport::available_backends()),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });
