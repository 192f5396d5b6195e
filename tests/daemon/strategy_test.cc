// The daemon executes the planner's strategy: compressors from compress/ on
// the node's sum, error-feedback state kept per tensor partition across
// iterations, checked against a reference built from the same library.
#include <bytecomp/bytecomp.h>
#include <gtest/gtest.h>

#include <cmath>
#include <future>

#include "compress/compressor.h"
#include "compress/reduce.h"
#include "tests/daemon/harness.h"

using namespace bctest;
namespace cz = bytecomp::compress;

namespace {

struct Tensor {
  std::string name;
  uint64_t count;
  bytecomp_dtype dtype = BYTECOMP_FLOAT32;
};

float grad(uint32_t rank, uint64_t it, uint64_t i) {
  // Not representable in fp16, signs mixed, magnitudes spread.
  return static_cast<float>(std::sin(0.37 * static_cast<double>(i) + 1.3 * static_cast<double>(it) +
                                     2.1 * rank)) *
         (1.0f + static_cast<float>(i % 13));
}

// Two in-process ranks; fn(rank, client, ids) runs on each.
template <class Fn>
void two_ranks(const DaemonEnv& env, const std::string& job, const std::vector<Tensor>& ts,
               Fn fn, const char* strategy = nullptr) {
  auto run = [&](uint32_t rank) {
    bytecomp_connect_options o;
    bytecomp_connect_options_init(&o);
    o.socket_path = env.socket().c_str();
    o.job_id = job.c_str();
    o.local_rank = rank;
    o.local_size = 2;
    bytecomp_client* c = nullptr;
    ASSERT_EQ(bytecomp_connect(&o, &c), BYTECOMP_OK) << bytecomp_last_error();
    for (const auto& t : ts) {
      ASSERT_EQ(bytecomp_declare_tensor(c, t.name.c_str(), t.count, t.dtype, BYTECOMP_DEVICE_CPU,
                                        0, nullptr),
                BYTECOMP_OK);
    }
    if (strategy != nullptr) {
      ASSERT_EQ(bytecomp_set_strategy(c, strategy, "job-strategy.yaml"), BYTECOMP_OK)
          << bytecomp_last_error();
    }
    ASSERT_EQ(bytecomp_start(c, 10000), BYTECOMP_OK) << bytecomp_last_error();
    fn(rank, c);
    bytecomp_close(c);
  };
  auto other = std::async(std::launch::async, run, 1u);
  run(0);
  other.get();
}

// Runs one iteration on both ranks for tensor `id` and returns rank 0's result.
class Lockstep {
 public:
  explicit Lockstep(bytecomp_client* c) : c_(c) {}
  std::vector<float> round(uint32_t rank, uint32_t id, uint64_t n, uint64_t it) {
    float* p = nullptr;
    uint64_t bytes = 0;
    EXPECT_EQ(bytecomp_tensor_buffer(c_, id, reinterpret_cast<void**>(&p), &bytes), BYTECOMP_OK);
    for (uint64_t i = 0; i < n; ++i) p[i] = grad(rank, it, i);
    bytecomp_handle h = 0;
    EXPECT_EQ(bytecomp_push_pull(c_, id, it, &h), BYTECOMP_OK) << bytecomp_last_error();
    EXPECT_EQ(bytecomp_wait(c_, h, 20000), BYTECOMP_OK) << bytecomp_last_error();
    return std::vector<float>(p, p + n);
  }

 private:
  bytecomp_client* c_;
};

std::vector<float> exact_sum(uint64_t n, uint64_t it) {
  std::vector<float> s(n);
  for (uint64_t i = 0; i < n; ++i) s[i] = grad(0, it, i) + grad(1, it, i);
  return s;
}

std::string write_strategy(const DaemonEnv& env, const std::string& name, const std::string& yaml) {
  const std::string path = (env.dir() / name).string();
  std::ofstream(path) << yaml;
  return path;
}

constexpr const char* kStrategy = R"(version: 1
default: {compressor: none}
rules:
  - match: "*.bias"
    option: {compressor: none}
  - match: "fp.*"
    option: {compressor: fp16, inter: allreduce}
  - match: "*"
    min_bytes: 1KiB
    option:
      compressor: topk
      params: {ratio: "0.05"}
      error_feedback: true
      inter: alltoall_allgather
)";

}  // namespace

TEST(Strategy, CompressorsAndErrorFeedbackMatchTheReference) {
  DaemonEnv env("strat");
  const std::string file = write_strategy(env, "s.yaml", kStrategy);
  env.write_config("strategy:\n  file: " + file + "\n", "  partition_bytes: 64KiB\n");
  env.start();
  const uint64_t kW = 100000;  // 400000 bytes: 7 partitions of <= 64 KiB
  const std::vector<Tensor> ts = {{"l1.weight", kW}, {"l1.bias", 100}, {"fp.w", 5000},
                                  {"small", 10}, {"count", 7, BYTECOMP_INT32}};
  constexpr int kIters = 12;
  std::vector<std::vector<float>> got_w(kIters), got_fp(kIters), got_bias(kIters), got_small(kIters);
  two_ranks(env, "strat", ts, [&](uint32_t rank, bytecomp_client* c) {
    Lockstep ls(c);
    for (uint64_t it = 0; it < kIters; ++it) {
      auto w = ls.round(rank, 0, kW, it);
      auto b = ls.round(rank, 1, 100, it);
      auto f = ls.round(rank, 2, 5000, it);
      auto s = ls.round(rank, 3, 10, it);
      if (rank == 0) {
        got_w[it] = std::move(w);
        got_bias[it] = std::move(b);
        got_fp[it] = std::move(f);
        got_small[it] = std::move(s);
      }
    }
  });

  // Reference: topk 0.05 with error feedback, one state per 64 KiB partition.
  auto topk = cz::make_compressor(cz::parse_compressor_spec("topk:0.05,ef=true"));
  const uint64_t part = 65536 / 4;
  std::vector<std::unique_ptr<cz::TensorState>> states;
  for (uint64_t b = 0; b < kW; b += part) states.push_back(topk->make_state(std::min(part, kW - b)));
  std::vector<double> in_total(kW, 0), out_total(kW, 0);
  for (uint64_t it = 0; it < kIters; ++it) {
    std::vector<float> sum = exact_sum(kW, it);
    for (uint64_t i = 0; i < kW; ++i) in_total[i] += sum[i];
    for (size_t p = 0; p * part < kW; ++p) {
      const size_t n = static_cast<size_t>(std::min(part, kW - p * part));
      std::vector<std::byte> wire(topk->max_compressed_bytes(n));
      cz::CompressContext ctx;
      ctx.iteration = it;
      const size_t len =
          topk->compress(cz::ConstTensorView::cpu(sum.data() + p * part, n), wire, *states[p], ctx);
      topk->decompress({wire.data(), len}, cz::TensorView::cpu(sum.data() + p * part, n), false,
                       ctx);
    }
    ASSERT_EQ(got_w[it], sum) << "topk+EF result differs from the reference at iteration " << it;
    for (uint64_t i = 0; i < kW; ++i) out_total[i] += got_w[it][i];
    // Only ~5% of the elements travel each iteration.
    const auto nonzero = std::count_if(got_w[it].begin(), got_w[it].end(),
                                       [](float v) { return v != 0.0f; });
    EXPECT_LE(nonzero, static_cast<long>(kW / 20 + 8));
    EXPECT_GE(nonzero, static_cast<long>(kW / 20 - 8));

    std::vector<float> fp = exact_sum(5000, it);
    for (float& v : fp) v = cz::fp16_to_fp32(cz::fp32_to_fp16(v));
    EXPECT_EQ(got_fp[it], fp) << "fp16 at iteration " << it;
    EXPECT_EQ(got_bias[it], exact_sum(100, it)) << "bias must be uncompressed";
    EXPECT_EQ(got_small[it], exact_sum(10, it)) << "below 1 KiB: default (none)";
  }
  // Error feedback: what was sent over all iterations plus what is still
  // held back equals what came in (nothing is lost, only delayed).
  std::vector<float> residual(part);
  double worst = 0;
  for (size_t p = 0; p * part < kW; ++p) {
    const size_t n = static_cast<size_t>(std::min(part, kW - p * part));
    residual.resize(n);
    states[p]->copy_residual(residual);
    for (size_t i = 0; i < n; ++i) {
      const uint64_t g = p * part + i;
      worst = std::max(worst, std::abs(out_total[g] + residual[i] - in_total[g]));
    }
  }
  EXPECT_LT(worst, 1e-3);
}

TEST(Strategy, MismatchesAreRefusedNamingTheTensor) {
  struct Case {
    std::string yaml;
    std::vector<Tensor> tensors;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"version: 1\nentries:\n  - tensor: ghost\n    option: {compressor: none}\n",
       {{"w", 10}}, "ghost"},
      {"version: 1\ndefault: {compressor: topk, params: {ratio: '0.1'}, inter: alltoall_allgather}\n",
       {{"ids", 100, BYTECOMP_INT64}}, "take float32 tensors, this one is int64"},
      {"version: 1\ndefault: {compressor: none, scheme: flat, inter: allreduce, intra: allreduce}\n",
       {{"w", 10}}, "hierarchical"},
      {"version: 1\ndefault: {compressor: signum, error_feedback: true, inter: allgather}\n",
       {{"w", 1000}}, "has no error feedback"},
  };
  for (size_t k = 0; k < cases.size(); ++k) {
    DaemonEnv env("sbad");
    const std::string file = write_strategy(env, "s.yaml", cases[k].yaml);
    env.write_config("strategy:\n  file: " + file + "\n");
    env.start();
    bytecomp_connect_options o;
    bytecomp_connect_options_init(&o);
    o.socket_path = env.socket().c_str();
    o.job_id = "bad";
    bytecomp_client* c = nullptr;
    ASSERT_EQ(bytecomp_connect(&o, &c), BYTECOMP_OK);
    for (const auto& t : cases[k].tensors) {
      ASSERT_EQ(bytecomp_declare_tensor(c, t.name.c_str(), t.count, t.dtype, BYTECOMP_DEVICE_CPU,
                                        0, nullptr),
                BYTECOMP_OK);
    }
    EXPECT_EQ(bytecomp_start(c, 5000), BYTECOMP_ERR_INVALID_ARGUMENT) << k;
    const std::string msg = bytecomp_last_error();
    EXPECT_NE(msg.find(cases[k].expect), std::string::npos) << k << ": " << msg;
    EXPECT_NE(msg.find(file), std::string::npos) << msg;
    bytecomp_close(c);
  }
}

TEST(Strategy, BadStrategyFileStopsTheDaemonWithItsLocation) {
  DaemonEnv env("sfile");
  const std::string file = write_strategy(env, "s.yaml", "version: 1\ndefault: {compressor: zip}\n");
  env.write_config("strategy:\n  file: " + file + "\n");
  Process p({build_root() + "/daemon/bytecompd", "--config", (env.dir() / "daemon.yaml").string()},
            env.dir() / "bad.log");
  EXPECT_EQ(p.wait(std::chrono::seconds(10)), std::optional<int>(2));
  EXPECT_NE(p.output().find("s.yaml:2:"), std::string::npos) << p.output();
  EXPECT_NE(p.output().find("zip"), std::string::npos) << p.output();
}

TEST(Strategy, SighupSwitchesEveryTensorAtOneIteration) {
  DaemonEnv env("shup");
  env.start();
  const std::vector<Tensor> ts = {{"a", 300}, {"b", 50}};
  std::vector<std::vector<float>> got_a(10), got_b(10);
  std::promise<void> reloaded;
  std::shared_future<void> reloaded_f = reloaded.get_future().share();
  std::promise<void> at_five[2];
  two_ranks(env, "hup", ts, [&](uint32_t rank, bytecomp_client* c) {
    Lockstep ls(c);
    for (uint64_t it = 0; it < 10; ++it) {
      if (it == 5) {
        at_five[rank].set_value();
        if (rank == 0) {
          at_five[1].get_future().wait();
          const std::string file = write_strategy(
              env, "s.yaml", "version: 1\ndefault: {compressor: fp16, inter: allreduce}\n");
          env.write_config("strategy:\n  file: " + file + "\n");
          env.daemon().signal(SIGHUP);
          EXPECT_TRUE(env.daemon().wait_output("new strategy applies from iteration 5",
                                               std::chrono::seconds(5)))
              << env.daemon().output();
          reloaded.set_value();
        }
        reloaded_f.wait();
      }
      auto a = ls.round(rank, 0, 300, it);
      auto b = ls.round(rank, 1, 50, it);
      if (rank == 0) {
        got_a[it] = std::move(a);
        got_b[it] = std::move(b);
      }
    }
  });
  for (uint64_t it = 0; it < 10; ++it) {
    auto ea = exact_sum(300, it), eb = exact_sum(50, it);
    if (it >= 5) {
      for (float& v : ea) v = cz::fp16_to_fp32(cz::fp32_to_fp16(v));
      for (float& v : eb) v = cz::fp16_to_fp32(cz::fp32_to_fp16(v));
    }
    EXPECT_EQ(got_a[it], ea) << "tensor a, iteration " << it;
    EXPECT_EQ(got_b[it], eb) << "tensor b, iteration " << it;
  }
}

// A one-node job's partitions are cut by its tensors' pieces at start and
// fixed: a SIGHUP strategy that changes a tensor's pieces is refused naming
// the tensor (Engine::set_plans), the job keeps its strategy (exact sums);
// one that keeps them switches as usual.
TEST(Strategy, SighupRefusesAPiecesChangeNamingTheTensor) {
  DaemonEnv env("shuppcs");
  env.start();
  const std::vector<Tensor> ts = {{"a", 300}, {"b", 50}};
  constexpr uint64_t kIters = 8;
  std::vector<std::vector<float>> got_a(kIters);
  std::promise<void> reloaded;
  std::shared_future<void> reloaded_f = reloaded.get_future().share();
  std::promise<void> at_four[2];
  two_ranks(env, "huppcs", ts, [&](uint32_t rank, bytecomp_client* c) {
    Lockstep ls(c);
    for (uint64_t it = 0; it < kIters; ++it) {
      if (it == 4) {
        at_four[rank].set_value();
        if (rank == 0) {
          at_four[1].get_future().wait();
          const std::string file = write_strategy(
              env, "s.yaml",
              "version: 1\ndefault: {compressor: none}\nentries:\n"
              "  - {tensor: b, option: {compressor: none, pieces: 2}}\n");
          env.write_config("strategy:\n  file: " + file + "\n");
          env.daemon().signal(SIGHUP);
          EXPECT_TRUE(env.daemon().wait_output("would change pieces", std::chrono::seconds(5)))
              << env.daemon().output();
          reloaded.set_value();
        }
        reloaded_f.wait();
      }
      auto a = ls.round(rank, 0, 300, it);
      ls.round(rank, 1, 50, it);
      if (rank == 0) got_a[it] = std::move(a);
    }
  });
  const std::string log = env.daemon().output();
  EXPECT_NE(log.find("tensor 'b' would change pieces from 1 to 2"), std::string::npos) << log;
  EXPECT_NE(log.find("keeps its strategy"), std::string::npos) << log;
  EXPECT_EQ(log.find("new strategy applies"), std::string::npos) << log;
  for (uint64_t it = 0; it < kIters; ++it) EXPECT_EQ(got_a[it], exact_sum(300, it)) << it;
}

// bytecomp_set_strategy: the job's own strategy runs instead of the daemon's
// default, for that job only.
TEST(Strategy, PerJobStrategyOverridesTheDefaultForThatJobOnly) {
  DaemonEnv env("sjob");
  env.start();  // default: no strategy, everything uncompressed
  const std::vector<Tensor> ts = {{"fp.w", 5000}, {"l.bias", 100}};
  constexpr int kIters = 3;
  std::vector<std::vector<float>> own(kIters), plain(kIters);
  auto body = [&](std::vector<std::vector<float>>& out) {
    return [&out](uint32_t rank, bytecomp_client* c) {
      Lockstep ls(c);
      for (uint64_t it = 0; it < kIters; ++it) {
        auto f = ls.round(rank, 0, 5000, it);
        (void)ls.round(rank, 1, 100, it);
        if (rank == 0) out[it] = std::move(f);
      }
    };
  };
  two_ranks(env, "own", ts, body(own), kStrategy);
  two_ranks(env, "plain", ts, body(plain));
  for (uint64_t it = 0; it < kIters; ++it) {
    std::vector<float> fp = exact_sum(5000, it);
    for (float& v : fp) v = cz::fp16_to_fp32(cz::fp32_to_fp16(v));
    EXPECT_EQ(own[it], fp) << "the job's strategy (fp16) at iteration " << it;
    EXPECT_EQ(plain[it], exact_sum(5000, it)) << "the default (none) at iteration " << it;
  }
  EXPECT_TRUE(no_shm_left(env.shm_prefix()));
}

// Option::pieces (the planner's pipelining) runs on one node with two
// ranks: the tensor is cut into 8 times smaller partitions; fp16 is
// elementwise, so the result is that of the same option in one piece.
// (tests/daemon/client_compressed_test.cc checks the layout and a
// compressor whose result depends on it.)
TEST(Strategy, PiecesRunOnOneNodeWithTheOptionsResult) {
  DaemonEnv env("spieces");
  env.start();
  const std::vector<Tensor> ts = {{"fp.w", 5000}};
  constexpr int kIters = 2;
  std::vector<std::vector<float>> got(kIters);
  two_ranks(env, "pieces", ts, [&](uint32_t rank, bytecomp_client* c) {
    Lockstep ls(c);
    for (uint64_t it = 0; it < kIters; ++it) {
      auto f = ls.round(rank, 0, 5000, it);
      if (rank == 0) got[it] = std::move(f);
    }
  }, "version: 1\ndefault: {compressor: fp16, inter: allreduce, pieces: 8}\n");
  for (uint64_t it = 0; it < kIters; ++it) {
    std::vector<float> fp = exact_sum(5000, it);
    for (float& v : fp) v = cz::fp16_to_fp32(cz::fp32_to_fp16(v));
    EXPECT_EQ(got[it], fp) << "iteration " << it;
  }
  EXPECT_TRUE(no_shm_left(env.shm_prefix()));
}

TEST(Strategy, PerJobStrategyDisagreementAndErrorsAreRefused) {
  DaemonEnv env("sjobbad");
  env.start();
  auto connect = [&](const std::string& job, uint32_t rank, uint32_t size) {
    bytecomp_connect_options o;
    bytecomp_connect_options_init(&o);
    o.socket_path = env.socket().c_str();
    o.job_id = job.c_str();
    o.local_rank = rank;
    o.local_size = size;
    bytecomp_client* c = nullptr;
    EXPECT_EQ(bytecomp_connect(&o, &c), BYTECOMP_OK) << bytecomp_last_error();
    EXPECT_EQ(bytecomp_declare_tensor(c, "w", 1000, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0,
                                      nullptr),
              BYTECOMP_OK);
    return c;
  };
  // Local ranks with different texts: both starts fail, naming the ranks.
  {
    bytecomp_client* a = connect("differ", 0, 2);
    bytecomp_client* b = connect("differ", 1, 2);
    ASSERT_EQ(bytecomp_set_strategy(a, kStrategy, "a.yaml"), BYTECOMP_OK);
    ASSERT_EQ(bytecomp_set_strategy(b, "version: 1\ndefault: {compressor: none}\n", "b.yaml"),
              BYTECOMP_OK);
    auto fb = std::async(std::launch::async, [&] {
      const bytecomp_status s = bytecomp_start(b, 5000);
      return std::make_pair(s, std::string(bytecomp_last_error()));
    });
    const bytecomp_status sa = bytecomp_start(a, 5000);
    const std::string ma = bytecomp_last_error();
    const auto [sb, mb] = fb.get();
    EXPECT_NE(sa, BYTECOMP_OK);
    EXPECT_NE(sb, BYTECOMP_OK);
    for (const std::string& m : {ma, mb}) {
      EXPECT_NE(m.find("local ranks disagree on the job's strategy"), std::string::npos) << m;
      EXPECT_NE(m.find("a.yaml"), std::string::npos) << m;
      EXPECT_NE(m.find("b.yaml"), std::string::npos) << m;
    }
    bytecomp_close(a);
    bytecomp_close(b);
  }
  // Checked against the job's tensors, naming the source.
  {
    bytecomp_client* a = connect("ghost", 0, 1);
    ASSERT_EQ(bytecomp_set_strategy(
                  a, "version: 1\nentries:\n  - tensor: ghost\n    option: {compressor: none}\n",
                  "mine.yaml"),
              BYTECOMP_OK);
    EXPECT_EQ(bytecomp_start(a, 5000), BYTECOMP_ERR_INVALID_ARGUMENT);
    const std::string m = bytecomp_last_error();
    EXPECT_NE(m.find("mine.yaml"), std::string::npos) << m;
    EXPECT_NE(m.find("ghost"), std::string::npos) << m;
    bytecomp_close(a);
  }
  // A pieces count the format does not allow, named with its reason.
  {
    bytecomp_client* a = connect("pieces3", 0, 1);
    ASSERT_EQ(bytecomp_set_strategy(a, "version: 1\ndefault: {compressor: none, pieces: 3}\n",
                                    "p3.yaml"),
              BYTECOMP_OK);
    EXPECT_EQ(bytecomp_start(a, 5000), BYTECOMP_ERR_INVALID_ARGUMENT);
    const std::string m = bytecomp_last_error();
    EXPECT_NE(m.find("p3.yaml"), std::string::npos) << m;
    EXPECT_NE(m.find("pieces must be 1, 2, 4 or 8"), std::string::npos) << m;
    bytecomp_close(a);
  }
  // Not YAML of the planner's format.
  {
    bytecomp_client* a = connect("junk", 0, 1);
    ASSERT_EQ(bytecomp_set_strategy(a, "version: 1\ndefault: {compressor: [\n", "junk.yaml"),
              BYTECOMP_OK);
    EXPECT_EQ(bytecomp_start(a, 5000), BYTECOMP_ERR_INVALID_ARGUMENT);
    const std::string m = bytecomp_last_error();
    EXPECT_NE(m.find("junk.yaml"), std::string::npos) << m;
    bytecomp_close(a);
  }
  // Misuse.
  {
    bytecomp_client* a = connect("late", 0, 1);
    EXPECT_EQ(bytecomp_set_strategy(a, nullptr, "x"), BYTECOMP_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(bytecomp_set_strategy(a, "", "x"), BYTECOMP_ERR_INVALID_ARGUMENT);
    const std::string huge(70000, '#');
    EXPECT_EQ(bytecomp_set_strategy(a, huge.c_str(), "x"), BYTECOMP_ERR_INVALID_ARGUMENT);
    ASSERT_EQ(bytecomp_start(a, 5000), BYTECOMP_OK) << bytecomp_last_error();
    EXPECT_EQ(bytecomp_set_strategy(a, kStrategy, "x"), BYTECOMP_ERR_STATE);
    EXPECT_NE(std::string(bytecomp_last_error()).find("before starting"), std::string::npos);
    bytecomp_close(a);
  }
  EXPECT_TRUE(no_shm_left(env.shm_prefix()));
}
