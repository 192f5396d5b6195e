// Client-compressed push_pulls (ipc::kSubmitCompressed,
// bytecomp_push_pull_compressed; docs/gpu.md §2): a client that compresses
// its own gradient (on its GPU in production; here the CPU library stands in
// for the CUDA compressors, which write the same wire format) hands the daemon
// the compressed partitions. Checked with real processes (client -> bytecompd
// -> bytecomp-server / peer daemons) against the same job pushed dense, which
// the daemon compresses itself: with one local rank per node the two must be
// equal bit for bit (deterministic compressors: the client's error feedback is
// the daemon's).
#include <bytecomp/bytecomp.h>
#include <gtest/gtest.h>

#include <barrier>
#include <cmath>
#include <cstring>
#include <future>
#include <optional>

#include "compress/compressor.h"
#include "compress/wire_prefix.h"
#include "planner/strategy/partition.h"
#include "planner/strategy/plan.h"
#include "tests/daemon/harness.h"
#include "tests/daemon/two_nodes.h"

namespace bctest {
namespace {

namespace cz = bytecomp::compress;
using namespace std::chrono_literals;

float cgrad(uint32_t rank, uint64_t it, uint64_t i) {
  return std::sin(0.37f * static_cast<float>(i % 9973) + 1.3f * static_cast<float>(rank) +
                  0.11f * static_cast<float>(it)) *
         (1.0f + static_cast<float>((i * 7 + it) % 13));
}

// What a GPU client does before its device -> host copy, on the CPU: per
// partition of the daemon's partition size, compress with its own state and
// write the payload at the start of the partition's range.
class StandInClient {
 public:
  StandInClient(const std::string& spec, std::string job, uint32_t node)
      : c_(cz::make_compressor(cz::parse_compressor_spec(spec))), job_(std::move(job)),
        node_(node) {}

  // Fills `buf` (the tensor's shared buffer) from `grad`; the first `dense`
  // partitions are left dense (cpu_share: the daemon compresses them).
  void compress_into(char* buf, const std::vector<float>& grad, uint32_t tensor, uint64_t it,
                     uint64_t partition_bytes, uint32_t dense = 0) {
    const uint64_t bytes = grad.size() * 4;
    size_t p = 0;
    for (uint64_t b = 0; b < bytes; b += partition_bytes, ++p) {
      const size_t n = static_cast<size_t>((std::min(bytes, b + partition_bytes) - b) / 4);
      if (states_.size() <= p) states_.push_back(c_->make_state(n));
      if (p < dense) {
        std::memcpy(buf + b, grad.data() + b / 4, n * 4);
        continue;
      }
      cz::CompressContext ctx;
      ctx.iteration = it;
      ctx.shared_seed = bytecomp::strategy::partition_seed(
          job_, bytecomp::strategy::partition_key(tensor, static_cast<uint32_t>(p)));
      ctx.private_seed = bytecomp::strategy::node_private_seed(ctx.shared_seed, node_);
      std::vector<std::byte> wire(c_->max_compressed_bytes(n));
      const size_t len =
          c_->compress(cz::ConstTensorView::cpu(grad.data() + b / 4, n), wire, *states_[p], ctx);
      ASSERT_LE(len, n * 4) << "payload larger than its partition";
      std::memcpy(buf + b, wire.data(), len);
    }
  }
  const cz::Compressor& compressor() const { return *c_; }

 private:
  std::unique_ptr<cz::Compressor> c_;
  std::vector<std::unique_ptr<cz::TensorState>> states_;
  std::string job_;
  uint32_t node_;
};

uint64_t wait_partition_bytes(bytecomp_client* c) {
  uint64_t pb = 0;
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (pb == 0 && std::chrono::steady_clock::now() < deadline) {
    EXPECT_EQ(bytecomp_partition_bytes(c, &pb), BYTECOMP_OK) << bytecomp_last_error();
    if (pb == 0) std::this_thread::sleep_for(5ms);
  }
  return pb;
}

// The tensor's own partitions as the daemon published them (its strategy's
// pieces), once the job's partition size is known; checked against the
// library's one formula (the daemon's).
std::pair<uint64_t, uint32_t> tensor_layout(bytecomp_client* c, uint32_t id, uint64_t count) {
  const uint64_t job_pb = wait_partition_bytes(c);
  uint64_t pb = 0;
  uint32_t parts = 0;
  EXPECT_EQ(bytecomp_tensor_partitions(c, id, &pb, &parts), BYTECOMP_OK) << bytecomp_last_error();
  EXPECT_GT(pb, 0u);
  EXPECT_LE(pb, job_pb);
  EXPECT_EQ(pb % 64, 0u);
  EXPECT_EQ(parts, bytecomp::strategy::partition_count(count * 4, pb));
  return {pb, parts};
}

// One client of `job` (local rank `rank` of `local_size`, node `node` of
// `nodes`) runs `iters` iterations of one tensor of kN elements; returns what
// it got back each iteration. `spec` non-empty: compressed by the client,
// laid out by the tensor's partitions (bytecomp_tensor_partitions). `layout`
// non-null: receives those partitions (size, count).
constexpr uint64_t kN = 40000;  // 160000 bytes: partitions of 64 KiB (three) or 256 KiB (one)
std::vector<std::vector<float>> run_client(const std::string& socket, const std::string& job,
                                           const std::string& strategy, const std::string& spec,
                                           uint32_t node, uint32_t nodes, uint32_t rank,
                                           uint32_t local_size, int iters, uint32_t dense = 0,
                                           uint64_t count = kN,
                                           std::pair<uint64_t, uint32_t>* layout = nullptr) {
  std::vector<std::vector<float>> got;
  bytecomp_connect_options o;
  bytecomp_connect_options_init(&o);
  o.socket_path = socket.c_str();
  o.job_id = job.c_str();
  o.local_rank = rank;
  o.local_size = local_size;
  o.node_rank = node;
  o.num_nodes = nodes;
  bytecomp_client* c = nullptr;
  EXPECT_EQ(bytecomp_connect(&o, &c), BYTECOMP_OK) << bytecomp_last_error();
  if (c == nullptr) return got;
  uint32_t id = 0;
  EXPECT_EQ(bytecomp_declare_tensor(c, "w", count, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, &id),
            BYTECOMP_OK);
  if (!strategy.empty()) {
    EXPECT_EQ(bytecomp_set_strategy(c, strategy.c_str(), "job.yaml"), BYTECOMP_OK)
        << bytecomp_last_error();
  }
  EXPECT_EQ(bytecomp_start(c, 30000), BYTECOMP_OK) << bytecomp_last_error();
  std::optional<StandInClient> client;
  uint64_t pb = 0;
  if (!spec.empty() || layout != nullptr) {
    const auto l = tensor_layout(c, id, count);
    pb = l.first;
    EXPECT_GT(pb, 0u) << "the daemon never published its partition size";
    if (layout != nullptr) *layout = l;
  }
  if (!spec.empty()) client.emplace(spec, job, node);
  const uint32_t grank = node * local_size + rank;
  for (int it = 0; it < iters && !::testing::Test::HasFailure(); ++it) {
    char* p = nullptr;
    uint64_t bytes = 0;
    EXPECT_EQ(bytecomp_tensor_buffer(c, id, reinterpret_cast<void**>(&p), &bytes), BYTECOMP_OK);
    std::vector<float> g(count);
    for (uint64_t i = 0; i < count; ++i) g[i] = cgrad(grank, it, i);
    bytecomp_handle h = 0;
    if (client) {
      client->compress_into(p, g, id, it, pb, dense);
      if (dense == 0) {
        EXPECT_EQ(bytecomp_push_pull_compressed(c, id, it, &h), BYTECOMP_OK)
            << bytecomp_last_error();
      } else {
        EXPECT_EQ(bytecomp_push_pull_split(c, id, it, dense, &h), BYTECOMP_OK)
            << bytecomp_last_error();
      }
    } else {
      std::memcpy(p, g.data(), count * 4);
      EXPECT_EQ(bytecomp_push_pull(c, id, it, &h), BYTECOMP_OK) << bytecomp_last_error();
    }
    EXPECT_EQ(bytecomp_wait(c, h, 30000), BYTECOMP_OK) << bytecomp_last_error();
    const float* f = reinterpret_cast<const float*>(p);
    got.emplace_back(f, f + count);
  }
  bytecomp_close(c);
  return got;
}

size_t mismatches(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return std::max(a.size(), b.size());
  size_t m = 0;
  for (size_t i = 0; i < a.size(); ++i) m += std::memcmp(&a[i], &b[i], 4) != 0;
  return m;
}

struct Case {
  const char* strategy;  // the job's strategy
  const char* spec;      // the same compressor, as the client makes it
};
const Case kCases[] = {
    {"version: 1\ndefault: {compressor: efsignsgd, inter: alltoall_allgather}\n", "efsignsgd"},
    {"version: 1\ndefault: {compressor: topk, params: {ratio: '0.05'}, error_feedback: true, "
     "inter: alltoall_allgather}\n",
     "topk:0.05,ef=true"},
    {"version: 1\ndefault: {compressor: fp16, inter: allgather}\n", "fp16"},
};

}  // namespace

// One node, one rank: the client's compression and the daemon's are the
// same computation, so the aggregates are equal bit for bit.
TEST(ClientCompressed, OneRankEqualsTheDaemonsCompressionBitForBit) {
  DaemonEnv env("ccmp1");
  env.write_config("", "  partition_bytes: 64KiB\n");
  env.start();
  constexpr int kIters = 5;
  int k = 0;
  for (const Case& cs : kCases) {
    SCOPED_TRACE(cs.spec);
    const std::string n = std::to_string(k++);
    const auto dense = run_client(env.socket(), "dense" + n, cs.strategy, "", 0, 1, 0, 1, kIters);
    const auto pre = run_client(env.socket(), "pre" + n, cs.strategy, cs.spec, 0, 1, 0, 1, kIters);
    ASSERT_EQ(dense.size(), static_cast<size_t>(kIters));
    ASSERT_EQ(pre.size(), static_cast<size_t>(kIters));
    for (int it = 0; it < kIters; ++it) EXPECT_EQ(mismatches(dense[it], pre[it]), 0u) << it;
  }
}

// One node, two ranks: the aggregate is the sum of the ranks' decoded
// payloads (each rank kept its own error feedback), rank 0's first.
TEST(ClientCompressed, TwoRanksSumTheirDecodedPayloads) {
  DaemonEnv env("ccmp2");
  env.write_config("", "  partition_bytes: 64KiB\n");
  env.start();
  constexpr int kIters = 4;
  const Case& cs = kCases[1];  // topk with error feedback
  auto other = std::async(std::launch::async, [&] {
    return run_client(env.socket(), "pre2", cs.strategy, cs.spec, 0, 1, 1, 2, kIters);
  });
  const auto got0 = run_client(env.socket(), "pre2", cs.strategy, cs.spec, 0, 1, 0, 2, kIters);
  const auto got1 = other.get();
  ASSERT_EQ(got0.size(), static_cast<size_t>(kIters));
  ASSERT_EQ(got1.size(), static_cast<size_t>(kIters));
  // Reference: each rank compresses its own gradient per 64 KiB partition.
  StandInClient ref[2] = {{cs.spec, "pre2", 0}, {cs.spec, "pre2", 0}};
  for (int it = 0; it < kIters; ++it) {
    std::vector<char> wire[2];
    for (uint32_t r = 0; r < 2; ++r) {
      std::vector<float> g(kN);
      for (uint64_t i = 0; i < kN; ++i) g[i] = cgrad(r, it, i);
      wire[r].assign(kN * 4, 0);
      ref[r].compress_into(wire[r].data(), g, 0, it, 65536);
    }
    std::vector<float> expect(kN);
    for (uint64_t b = 0; b < kN * 4; b += 65536) {
      const size_t n = static_cast<size_t>((std::min<uint64_t>(kN * 4, b + 65536) - b) / 4);
      for (uint32_t r = 0; r < 2; ++r) {
        const auto* p = reinterpret_cast<const std::byte*>(wire[r].data() + b);
        const cz::WireInfo w = cz::inspect_prefix({p, n * 4});
        ref[r].compressor().decompress({p, w.total_bytes},
                                       cz::TensorView::cpu(expect.data() + b / 4, n), r > 0, {});
      }
    }
    EXPECT_EQ(mismatches(got0[it], expect), 0u) << it;
    EXPECT_EQ(mismatches(got1[it], expect), 0u) << it;
  }
}

// What a client may not do: push compressed where the plan does not
// compress, garbage as a payload, ranks disagreeing on the form. Each aborts
// the job with a reason that names the tensor.
TEST(ClientCompressed, UnusablePayloadsAbortTheJobWithTheReason) {
  DaemonEnv env("ccmp3");
  env.write_config("", "  partition_bytes: 64KiB\n");
  env.start();
  auto one = [&](const std::string& job, const char* strategy, bool garbage) {
    bytecomp_connect_options o;
    bytecomp_connect_options_init(&o);
    o.socket_path = env.socket().c_str();
    o.job_id = job.c_str();
    bytecomp_client* c = nullptr;
    EXPECT_EQ(bytecomp_connect(&o, &c), BYTECOMP_OK) << bytecomp_last_error();
    if (c == nullptr) return std::string();
    uint32_t id = 0;
    uint64_t pb = 1;
    EXPECT_EQ(bytecomp_declare_tensor(c, "w", kN, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, &id),
              BYTECOMP_OK);
    // Before start: a state error, not a crash.
    EXPECT_EQ(bytecomp_partition_bytes(c, &pb), BYTECOMP_ERR_STATE);
    if (strategy != nullptr) {
      EXPECT_EQ(bytecomp_set_strategy(c, strategy, "j.yaml"), BYTECOMP_OK);
    }
    EXPECT_EQ(bytecomp_start(c, 10000), BYTECOMP_OK) << bytecomp_last_error();
    EXPECT_EQ(wait_partition_bytes(c), 65536u);
    char* p = nullptr;
    EXPECT_EQ(bytecomp_tensor_buffer(c, id, reinterpret_cast<void**>(&p), nullptr), BYTECOMP_OK);
    std::vector<float> g(kN, 1.0f);
    if (garbage) {
      std::memset(p, 0x5a, kN * 4);
    } else {
      StandInClient s("efsignsgd", job, 0);
      s.compress_into(p, g, id, 0, 65536);
    }
    bytecomp_handle h = 0;
    EXPECT_EQ(bytecomp_push_pull_compressed(c, id, 0, &h), BYTECOMP_OK);
    const bytecomp_status st = bytecomp_wait(c, h, 10000);
    const std::string why = bytecomp_last_error();
    EXPECT_NE(st, BYTECOMP_OK);
    bytecomp_close(c);
    return why;
  };
  std::string why = one("plain", nullptr, false);  // the default: uncompressed
  EXPECT_NE(why.find("tensor 'w'"), std::string::npos) << why;
  EXPECT_NE(why.find("does not compress"), std::string::npos) << why;
  why = one("garbage", kCases[0].strategy, true);
  EXPECT_NE(why.find("not a compressed buffer"), std::string::npos) << why;
  why = one("other", kCases[1].strategy, false);  // efsignsgd payload, topk plan
  EXPECT_NE(why.find("is efsignsgd but the plan in force compresses with topk"),
            std::string::npos)
      << why;
}

// The strategy's cpu_share executed (docs/gpu.md §4): of kN's three 64 KiB
// partitions, cpu_share 0.5 puts llround(1.5) = 2 on the daemon's CPU pool
// (the client leaves them dense) and the last in the client. The daemon's
// compression and the client's are the same computation, so the aggregates
// equal the all-daemon job's bit for bit.
const char* kSplit =
    "version: 1\ndefault: {compressor: efsignsgd, comp_device: gpu, decomp_device: cpu, "
    "inter: alltoall_allgather, cpu_share: 0.5}\n";

TEST(ClientCompressed, CpuShareSplitEqualsTheDaemonsCompressionBitForBit) {
  DaemonEnv env("ccmp4");
  env.write_config("", "  partition_bytes: 64KiB\n");
  env.start();
  constexpr int kIters = 5;
  const auto dense = run_client(env.socket(), "sdense", kSplit, "", 0, 1, 0, 1, kIters);
  const auto split =
      run_client(env.socket(), "split", kSplit, "efsignsgd", 0, 1, 0, 1, kIters, 2);
  ASSERT_EQ(dense.size(), static_cast<size_t>(kIters));
  ASSERT_EQ(split.size(), static_cast<size_t>(kIters));
  for (int it = 0; it < kIters; ++it) EXPECT_EQ(mismatches(dense[it], split[it]), 0u) << it;
}

// A split that is not the plan's aborts the job naming both counts; one
// that leaves nothing compressed is refused by the client library.
TEST(ClientCompressed, CpuShareSplitsTheDaemonDidNotPlanAreRefused) {
  DaemonEnv env("ccmp5");
  env.write_config("", "  partition_bytes: 64KiB\n");
  env.start();
  bytecomp_connect_options o;
  bytecomp_connect_options_init(&o);
  o.socket_path = env.socket().c_str();
  o.job_id = "badsplit";
  bytecomp_client* c = nullptr;
  ASSERT_EQ(bytecomp_connect(&o, &c), BYTECOMP_OK) << bytecomp_last_error();
  uint32_t id = 0;
  ASSERT_EQ(bytecomp_declare_tensor(c, "w", kN, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, &id),
            BYTECOMP_OK);
  ASSERT_EQ(bytecomp_set_strategy(c, kSplit, "j.yaml"), BYTECOMP_OK) << bytecomp_last_error();
  ASSERT_EQ(bytecomp_start(c, 10000), BYTECOMP_OK) << bytecomp_last_error();
  ASSERT_EQ(wait_partition_bytes(c), 65536u);
  char* p = nullptr;
  ASSERT_EQ(bytecomp_tensor_buffer(c, id, reinterpret_cast<void**>(&p), nullptr), BYTECOMP_OK);
  bytecomp_handle h = 7;
  EXPECT_EQ(bytecomp_push_pull_split(c, id, 0, 3, &h), BYTECOMP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(h, 0u);
  std::string why = bytecomp_last_error();
  EXPECT_NE(why.find("has 3 partitions"), std::string::npos) << why;
  EXPECT_NE(why.find("leaves none compressed"), std::string::npos) << why;
  EXPECT_EQ(bytecomp_push_pull_split(c, id, 0, 1u << 24, &h), BYTECOMP_ERR_INVALID_ARGUMENT);
  StandInClient s("efsignsgd", "badsplit", 0);
  s.compress_into(p, std::vector<float>(kN, 1.0f), id, 0, 65536, 1);
  ASSERT_EQ(bytecomp_push_pull_split(c, id, 0, 1, &h), BYTECOMP_OK) << bytecomp_last_error();
  EXPECT_NE(bytecomp_wait(c, h, 10000), BYTECOMP_OK);
  why = bytecomp_last_error();
  EXPECT_NE(why.find("tensor 'w'"), std::string::npos) << why;
  EXPECT_NE(why.find("first 1 of 3 partitions dense"), std::string::npos) << why;
  EXPECT_NE(why.find("puts 2 there"), std::string::npos) << why;
  bytecomp_close(c);
}

// Two nodes, one rank each, through the parameter server (decompress-sum-
// recompress) and the peer allgather: the client-compressed job's aggregate
// equals the daemon-compressed job's bit for bit.
TEST_P(TwoNodes, ClientCompressedPushesEqualTheDaemonsCompressionBitForBit) {
  start(1);
  constexpr int kIters = 4;
  int k = 0;
  for (const Case& cs : kCases) {
    SCOPED_TRACE(cs.spec);
    const std::string n = std::to_string(k++);
    auto both = [&](const std::string& job, const char* spec) {
      auto other = std::async(std::launch::async, [&] {
        return run_client(nodes_[1]->socket(), job, cs.strategy, spec, 1, 2, 0, 1, kIters);
      });
      auto mine = run_client(nodes_[0]->socket(), job, cs.strategy, spec, 0, 2, 0, 1, kIters);
      return std::make_pair(std::move(mine), other.get());
    };
    const auto dense = both("dense" + n, "");
    const auto pre = both("pre" + n, cs.spec);
    ASSERT_EQ(dense.first.size(), static_cast<size_t>(kIters));
    ASSERT_EQ(pre.first.size(), static_cast<size_t>(kIters));
    ASSERT_EQ(pre.second.size(), static_cast<size_t>(kIters));
    for (int it = 0; it < kIters; ++it) {
      EXPECT_EQ(mismatches(dense.first[it], pre.first[it]), 0u) << it;
      EXPECT_EQ(mismatches(dense.second[it], pre.second[it]), 0u) << it;
    }
  }
}

// The same with the cpu_share split, on both nodes: a tensor of five of
// the cluster's 256 KiB partitions, llround(2.5) = 3 daemon-compressed, two
// client-compressed.
TEST_P(TwoNodes, ClientSplitPushesEqualTheDaemonsCompressionBitForBit) {
  start(1);
  constexpr int kIters = 4;
  constexpr uint64_t kBig = 5 * 65536 - 1000;
  auto both = [&](const std::string& job, const char* spec, uint32_t dense) {
    auto other = std::async(std::launch::async, [&] {
      return run_client(nodes_[1]->socket(), job, kSplit, spec, 1, 2, 0, 1, kIters, dense, kBig);
    });
    auto mine =
        run_client(nodes_[0]->socket(), job, kSplit, spec, 0, 2, 0, 1, kIters, dense, kBig);
    return std::make_pair(std::move(mine), other.get());
  };
  const auto dense = both("sdense", "", 0);
  const auto split = both("split", "efsignsgd", 3);
  ASSERT_EQ(dense.first.size(), static_cast<size_t>(kIters));
  ASSERT_EQ(split.first.size(), static_cast<size_t>(kIters));
  ASSERT_EQ(split.second.size(), static_cast<size_t>(kIters));
  for (int it = 0; it < kIters; ++it) {
    EXPECT_EQ(mismatches(dense.first[it], split.first[it]), 0u) << it;
    EXPECT_EQ(mismatches(dense.second[it], split.second[it]), 0u) << it;
  }
}

}  // namespace bctest

namespace bctest {

// Option::pieces executed (docs/gpu.md §4): a tensor whose option has pieces
// q runs as partitions of the job's size / q, each the option's whole chain
// (own key, seed, error feedback).

// One node, one rank, efsignsgd with pieces 4 over 64 KiB partitions: the
// aggregate is every 16 KiB slice compressed and decompressed on its own
// (with its own error feedback), and the client's layout agrees.
TEST(ClientCompressed, PiecesOnOneNodeEqualTheReferencePerSlice) {
  DaemonEnv env("ccmp6");
  env.write_config("", "  partition_bytes: 64KiB\n");
  env.start();
  constexpr int kIters = 4;
  const char* strategy =
      "version: 1\ndefault: {compressor: efsignsgd, inter: alltoall_allgather, pieces: 4}\n";
  std::pair<uint64_t, uint32_t> layout;
  const auto got =
      run_client(env.socket(), "pcs1", strategy, "", 0, 1, 0, 1, kIters, 0, kN, &layout);
  ASSERT_EQ(got.size(), static_cast<size_t>(kIters));
  EXPECT_EQ(layout.first, 16384u);
  EXPECT_EQ(layout.second, 10u);  // 160000 bytes
  StandInClient ref("efsignsgd", "pcs1", 0);
  for (int it = 0; it < kIters; ++it) {
    std::vector<float> g(kN);
    for (uint64_t i = 0; i < kN; ++i) g[i] = cgrad(0, it, i);
    std::vector<char> wire(kN * 4, 0);
    ref.compress_into(wire.data(), g, 0, it, 16384);
    std::vector<float> expect(kN);
    for (uint64_t b = 0; b < kN * 4; b += 16384) {
      const size_t n = static_cast<size_t>((std::min<uint64_t>(kN * 4, b + 16384) - b) / 4);
      const auto* p = reinterpret_cast<const std::byte*>(wire.data() + b);
      const cz::WireInfo w = cz::inspect_prefix({p, n * 4});
      ref.compressor().decompress({p, w.total_bytes},
                                  cz::TensorView::cpu(expect.data() + b / 4, n), false, {});
    }
    EXPECT_EQ(mismatches(got[it], expect), 0u) << it;
  }
  // Without pieces the same job compresses whole 64 KiB partitions: other
  // scales, another aggregate (what pieces changed is real).
  const auto flat = run_client(env.socket(), "pcs1flat",
                               "version: 1\ndefault: {compressor: efsignsgd, inter: "
                               "alltoall_allgather}\n",
                               "", 0, 1, 0, 1, 1);
  ASSERT_EQ(flat.size(), 1u);
  EXPECT_GT(mismatches(flat[0], got[0]), 0u);
}

// Two nodes, one rank each, tensors of five of the cluster's 256 KiB
// partitions: with pieces 4 they run as twenty 64 KiB partitions through two
// servers, the ring and the peer allgather. Uncompressed, the sums are exact;
// compressed, the client's payloads (laid out by the partitions the library
// reports) equal the daemons' own compression bit for bit, so client,
// daemons and servers cut the tensor the same way.
TEST_P(TwoNodes, PiecesRunThroughServersRingAndPeersWithOneLayout) {
  start(2);
  constexpr int kIters = 3;
  constexpr uint64_t kBig = 5 * 65536 - 1000;
  auto both = [&](const std::string& job, const std::string& strategy, const char* spec,
                  uint32_t dense, std::pair<uint64_t, uint32_t>* layout) {
    std::pair<uint64_t, uint32_t> other_layout;
    auto other = std::async(std::launch::async, [&] {
      return run_client(nodes_[1]->socket(), job, strategy, spec, 1, 2, 0, 1, kIters, dense, kBig,
                        &other_layout);
    });
    auto mine = run_client(nodes_[0]->socket(), job, strategy, spec, 0, 2, 0, 1, kIters, dense,
                           kBig, layout);
    auto theirs = other.get();
    EXPECT_EQ(other_layout, *layout) << "the nodes published different partitions";
    return std::make_pair(std::move(mine), std::move(theirs));
  };
  // Exact sums, sharded over both servers and on the ring.
  for (const char* inter : {"reduce_scatter_allgather", "allreduce"}) {
    SCOPED_TRACE(inter);
    std::pair<uint64_t, uint32_t> layout;
    const auto got = both(std::string("raw") + inter[0],
                          std::string("version: 1\ndefault: {compressor: none, inter: ") + inter +
                              ", pieces: 4}\n",
                          "", 0, &layout);
    EXPECT_EQ(layout.first, 65536u);
    EXPECT_EQ(layout.second, 20u);
    ASSERT_EQ(got.first.size(), static_cast<size_t>(kIters));
    ASSERT_EQ(got.second.size(), static_cast<size_t>(kIters));
    for (int it = 0; it < kIters; ++it) {
      std::vector<float> expect(kBig);
      for (uint64_t i = 0; i < kBig; ++i) expect[i] = cgrad(0, it, i) + cgrad(1, it, i);
      EXPECT_EQ(mismatches(got.first[it], expect), 0u) << it;
      EXPECT_EQ(mismatches(got.second[it], expect), 0u) << it;
    }
  }
  // Compressed: the servers' decompress-sum-recompress and the peers'.
  struct PieceCase {
    const char* strategy;
    const char* spec;
  };
  const PieceCase cases[] = {
      {"version: 1\ndefault: {compressor: efsignsgd, inter: alltoall_allgather, pieces: 4}\n",
       "efsignsgd"},
      {"version: 1\ndefault: {compressor: topk, params: {ratio: '0.05'}, error_feedback: true, "
       "inter: allgather, pieces: 4}\n",
       "topk:0.05,ef=true"},
  };
  int k = 0;
  for (const PieceCase& cs : cases) {
    SCOPED_TRACE(cs.spec);
    const std::string n = std::to_string(k++);
    std::pair<uint64_t, uint32_t> dl, pl;
    const auto dense = both("pdense" + n, cs.strategy, "", 0, &dl);
    const auto pre = both("ppre" + n, cs.strategy, cs.spec, 0, &pl);
    EXPECT_EQ(dl, std::make_pair(uint64_t{65536}, uint32_t{20}));
    EXPECT_EQ(pl, dl);
    ASSERT_EQ(dense.first.size(), static_cast<size_t>(kIters));
    ASSERT_EQ(pre.first.size(), static_cast<size_t>(kIters));
    ASSERT_EQ(pre.second.size(), static_cast<size_t>(kIters));
    for (int it = 0; it < kIters; ++it) {
      EXPECT_EQ(mismatches(dense.first[it], pre.first[it]), 0u) << it;
      EXPECT_EQ(mismatches(dense.second[it], pre.second[it]), 0u) << it;
    }
  }
}

// cpu_share with pieces 2: the tensor's ten 128 KiB partitions, of which
// llround(0.5 * 10) = 5 stay dense for the daemons' CPU pools (the count of
// the new partitions, not of the cluster's five); equal to the all-daemon
// job bit for bit on both nodes.
TEST_P(TwoNodes, PiecesWithCpuShareSplitTheSlices) {
  start(1);
  constexpr int kIters = 3;
  constexpr uint64_t kBig = 5 * 65536 - 1000;
  const std::string strategy =
      "version: 1\ndefault: {compressor: efsignsgd, comp_device: gpu, decomp_device: cpu, "
      "inter: alltoall_allgather, cpu_share: 0.5, pieces: 2}\n";
  auto both = [&](const std::string& job, const char* spec, uint32_t dense) {
    std::pair<uint64_t, uint32_t> l0, l1;
    auto other = std::async(std::launch::async, [&] {
      return run_client(nodes_[1]->socket(), job, strategy, spec, 1, 2, 0, 1, kIters, dense, kBig,
                        &l1);
    });
    auto mine =
        run_client(nodes_[0]->socket(), job, strategy, spec, 0, 2, 0, 1, kIters, dense, kBig, &l0);
    auto theirs = other.get();
    EXPECT_EQ(l0, std::make_pair(uint64_t{131072}, uint32_t{10}));
    EXPECT_EQ(l1, l0);
    return std::make_pair(std::move(mine), std::move(theirs));
  };
  const auto dense = both("pcsdense", "", 0);
  const auto split = both("pcssplit", "efsignsgd", 5);
  ASSERT_EQ(dense.first.size(), static_cast<size_t>(kIters));
  ASSERT_EQ(split.first.size(), static_cast<size_t>(kIters));
  ASSERT_EQ(split.second.size(), static_cast<size_t>(kIters));
  for (int it = 0; it < kIters; ++it) {
    EXPECT_EQ(mismatches(dense.first[it], split.first[it]), 0u) << it;
    EXPECT_EQ(mismatches(dense.second[it], split.second[it]), 0u) << it;
  }
}

// A strategy change that changes a tensor's pieces would change its
// partitions under the servers: the coordinator refuses it naming the
// tensor, and the job goes on with its strategy (exact sums).
TEST_P(TwoNodes, PiecesChangeIsRefusedNamingTheTensor) {
  start(1, "version: 1\ndefault: {compressor: none}\n");
  constexpr uint64_t kCount = 3000;
  constexpr int kIters = 8;
  std::vector<std::vector<float>> got;
  std::barrier sync(4);
  auto run = [&](uint32_t node, uint32_t rank) {
    bytecomp_client* c = connect_client(node, rank, "pcschange");
    ASSERT_NE(c, nullptr);
    uint32_t id = 0;
    ASSERT_EQ(bytecomp_declare_tensor(c, "w", kCount, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0,
                                      &id),
              BYTECOMP_OK);
    ASSERT_EQ(bytecomp_start(c, 30000), BYTECOMP_OK) << bytecomp_last_error();
    const uint32_t grank = node * 2 + rank;
    for (uint64_t it = 0; it < kIters; ++it) {
      if (it == 3) {
        sync.arrive_and_wait();
        if (grank == 0) {
          write("strategy.yaml", "version: 1\ndefault: {compressor: none, pieces: 4}\n");
          nodes_[0]->daemon().signal(SIGHUP);
          EXPECT_TRUE(nodes_[0]->daemon().wait_output("would change pieces", 10s))
              << nodes_[0]->daemon().output();
        }
        sync.arrive_and_wait();
      }
      float* p = nullptr;
      ASSERT_EQ(bytecomp_tensor_buffer(c, id, reinterpret_cast<void**>(&p), nullptr),
                BYTECOMP_OK);
      for (uint64_t i = 0; i < kCount; ++i) p[i] = cgrad(grank, it, i);
      bytecomp_handle hd = 0;
      ASSERT_EQ(bytecomp_push_pull(c, id, it, &hd), BYTECOMP_OK);
      ASSERT_EQ(bytecomp_wait(c, hd, 30000), BYTECOMP_OK) << bytecomp_last_error();
      if (grank == 0) got.emplace_back(p, p + kCount);
    }
    bytecomp_close(c);
  };
  on_every_rank(run);
  const std::string log = nodes_[0]->daemon().output();
  EXPECT_NE(log.find("tensor 'w' would change pieces from 1 to 4"), std::string::npos) << log;
  ASSERT_EQ(got.size(), static_cast<size_t>(kIters));
  for (uint64_t it = 0; it < kIters; ++it) {
    size_t bad = 0;
    for (uint64_t i = 0; i < kCount; ++i) {
      const float s0 = cgrad(0, it, i) + cgrad(1, it, i);
      const float s1 = cgrad(2, it, i) + cgrad(3, it, i);
      bad += got[it][i] != s0 + s1;
    }
    EXPECT_EQ(bad, 0u) << "iteration " << it;
  }
}

}  // namespace bctest
