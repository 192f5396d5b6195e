// The partition round state machine (server/rounds.h) driven directly, with
// no transport: pushes of N nodes in any order, duplicate / stale / future /
// malformed pushes, pulls before and after completion, a job ending with a
// round half done, and a strategy change at an iteration boundary. Sums are
// compared with a reference computed here (exactly: the inputs are integers,
// or, for the deterministic mode, the rank-order sum bit for bit).
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "compress/compressor.h"
#include "compress/hd.h"
#include "planner/strategy/answer.h"
#include "planner/strategy/partition.h"
#include "server/job.h"
#include "server/rounds.h"

using namespace bytecomp;
using namespace bytecomp::server;
using transport::Buffer;
using transport::Incoming;

namespace {

constexpr NodeId kFirstNode = 100;
const std::string kJob = "rounds";

std::string strategy_text(const std::string& entries) {
  return "version: 1\nentries:\n" + entries;
}
const std::string kFp16 = strategy_text(
    "  - {tensor: g, option: {compressor: fp16, inter: reduce_scatter_allgather}}\n");
const std::string kBf16 = strategy_text(
    "  - {tensor: g, option: {compressor: bf16, inter: reduce_scatter_allgather}}\n");
const std::string kEfSign = strategy_text(
    "  - {tensor: g, option: {compressor: efsignsgd, inter: alltoall_allgather}}\n");

// One partition (the whole of tensor 'g') of a job of `nodes` nodes.
struct Fixture {
  Fixture(uint32_t nodes, uint64_t count, const std::string& yaml = "", bool deterministic = false,
          uint64_t start = 0)
      : tensors{{"g", count}},
        plans(start, plan_job(tensors, yaml)),
        round(setup(nodes, count, deterministic, start), plans) {}

  static RoundSetup setup(uint32_t nodes, uint64_t count, bool deterministic, uint64_t start) {
    RoundSetup s;
    s.part.key = strategy::partition_key(0, 0);
    s.part.count = count;
    s.label = "job '" + kJob + "' tensor 'g' partition 0 (key 0x0)";
    s.start_iteration = start;
    s.nodes = nodes;
    s.deterministic = deterministic;
    s.shared_seed = strategy::partition_seed(kJob, s.part.key);
    s.private_seed = strategy::server_private_seed(0, s.part.key);
    return s;
  }

  PushOutcome push(uint32_t rank, uint64_t it, const std::vector<float>& v) {
    return round.push(kFirstNode + rank, rank, it, {Buffer::copy_of(v.data(), v.size() * 4)});
  }
  PushOutcome push_bytes(uint32_t rank, uint64_t it, Buffer b) {
    return round.push(kFirstNode + rank, rank, it, {std::move(b)});
  }
  std::optional<RoundAnswer> pull(uint32_t rank, uint64_t it) {
    Incoming in;
    in.from = kFirstNode + rank;
    in.expects_reply = true;
    in.request_id = 1000 * it + rank;
    in.message.header.arg = it;
    return round.pull(std::move(in));
  }

  std::vector<TensorSpec> tensors;
  Timeline plans;
  PartitionRound round;
};

// Small integers: every fp32 (and fp16/bf16) sum of a few of them is exact,
// whatever the order.
std::vector<float> ints(uint32_t rank, uint64_t it, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = static_cast<float>(static_cast<int>((i * 7 + rank * 13 + it * 5) % 61) - 30);
  return v;
}

// What a server's prepare_strategy does: the change is admitted only while no
// round fixed its plan at or past it.
Status prepare(Timeline& plans, uint64_t it, std::vector<TensorPlan> p,
               const std::vector<const PartitionRound*>& rounds) {
  return plans.add(it, std::move(p), "", [&] { return rounds_admit_change(it, rounds, "server 0"); });
}

std::vector<float> sum_of(const std::vector<std::vector<float>>& parts) {
  std::vector<float> s = parts.at(0);
  for (size_t r = 1; r < parts.size(); ++r)
    for (size_t i = 0; i < s.size(); ++i) s[i] += parts[r][i];
  return s;
}

std::vector<float> floats_of(const Buffer& b) {
  std::vector<float> v(b.size() / 4);
  std::memcpy(v.data(), b.data(), v.size() * 4);
  return v;
}

void expect_contains(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "'" << part << "' not in: " << text;
}

}  // namespace

TEST(RoundsTest, RawSumOfNodesInAnyArrivalOrderIsExact) {
  constexpr uint32_t kNodes = 4;
  constexpr size_t kCount = 1001;
  Fixture f(kNodes, kCount);
  const uint32_t order[3][kNodes] = {{2, 0, 3, 1}, {0, 1, 2, 3}, {3, 2, 1, 0}};
  for (uint64_t it = 0; it < 3; ++it) {
    std::vector<std::vector<float>> in;
    for (uint32_t r = 0; r < kNodes; ++r) in.push_back(ints(r, it, kCount));
    for (uint32_t k = 0; k < kNodes; ++k) {
      PushOutcome o = f.push(order[it][k], it, in[order[it][k]]);
      ASSERT_TRUE(o.status.ok()) << o.status.message();
      EXPECT_EQ(o.completed, k + 1 == kNodes) << "iteration " << it << " push #" << k;
      EXPECT_TRUE(o.failure.empty());
      EXPECT_TRUE(o.answers.empty());  // nobody pulled yet
    }
    EXPECT_EQ(f.round.collecting(), it + 1);
    std::optional<RoundAnswer> a = f.pull(1, it);
    ASSERT_TRUE(a.has_value());
    ASSERT_TRUE(a->status.ok()) << a->status.message();
    EXPECT_EQ(a->to.from, kFirstNode + 1);
    EXPECT_EQ(floats_of(a->payload), sum_of(in)) << "iteration " << it;
  }
}

TEST(RoundsTest, MisalignedAndSingleNodePushesSumLikeAlignedOnes) {
  constexpr size_t kCount = 257;
  // A push whose bytes do not start on a float boundary (a transport may
  // hand one over) is copied before summing.
  Fixture f(2, kCount);
  std::vector<float> a = ints(0, 0, kCount), b = ints(1, 0, kCount);
  Buffer raw = Buffer::allocate(kCount * 4 + 1);
  std::memcpy(raw.mutable_data() + 1, b.data(), kCount * 4);
  ASSERT_TRUE(f.push_bytes(1, 0, raw.slice(1, kCount * 4)).status.ok());
  PushOutcome o = f.push(0, 0, a);
  ASSERT_TRUE(o.status.ok()) << o.status.message();
  ASSERT_TRUE(o.completed);
  EXPECT_EQ(floats_of(f.pull(0, 0)->payload), sum_of({a, b}));

  // One node: its push is the sum.
  Fixture one(1, kCount);
  PushOutcome p = one.push(0, 0, a);
  ASSERT_TRUE(p.status.ok() && p.completed);
  EXPECT_EQ(floats_of(one.pull(0, 0)->payload), a);
}

TEST(RoundsTest, DeterministicSumIsTheRankOrderSumWhateverTheArrival) {
  constexpr uint32_t kNodes = 5;
  constexpr size_t kCount = 333;
  std::mt19937 rng(12);
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  std::vector<std::vector<float>> in(kNodes, std::vector<float>(kCount));
  for (auto& v : in)
    for (float& x : v) x = d(rng) * 1e3f;
  std::vector<float> ref = sum_of(in);  // ((x0 + x1) + x2) + ...
  for (const std::vector<uint32_t>& order :
       {std::vector<uint32_t>{4, 3, 2, 1, 0}, {1, 3, 0, 4, 2}, {0, 1, 2, 3, 4}}) {
    Fixture f(kNodes, kCount, "", /*deterministic=*/true);
    PushOutcome last;
    for (uint32_t r : order) {
      last = f.push(r, 0, in[r]);
      ASSERT_TRUE(last.status.ok()) << last.status.message();
    }
    ASSERT_TRUE(last.completed);
    std::vector<float> got = floats_of(f.pull(0, 0)->payload);
    ASSERT_EQ(got.size(), kCount);
    EXPECT_EQ(0, std::memcmp(got.data(), ref.data(), kCount * 4))
        << "arrival order " << order[0] << order[1] << order[2] << order[3] << order[4];
  }
}

TEST(RoundsTest, DuplicateLateAndBadPushesAreRefusedAndChangeNothing) {
  constexpr uint32_t kNodes = 3;
  constexpr size_t kCount = 100;
  Fixture f(kNodes, kCount);
  std::vector<std::vector<float>> in;
  for (uint32_t r = 0; r < kNodes; ++r) in.push_back(ints(r, 0, kCount));

  ASSERT_TRUE(f.push(1, 0, in[1]).status.ok());
  PushOutcome dup = f.push(1, 0, ints(7, 7, kCount));
  EXPECT_EQ(dup.status.code(), ErrorCode::kInvalidArgument);
  expect_contains(dup.status.message(),
                  "push refused: duplicate push from node 101 (rank 1) for iteration 0 of job "
                  "'rounds' tensor 'g' partition 0 (key 0x0)");
  PushOutcome future = f.push(0, 1, in[0]);
  EXPECT_EQ(future.status.code(), ErrorCode::kInvalidArgument);
  expect_contains(future.status.message(), "future iteration 1 from node 100 (rank 0)");
  expect_contains(future.status.message(), "is collecting iteration 0");
  std::vector<float> shorter(kCount - 1, 1.f);
  PushOutcome wrong = f.push(0, 0, shorter);
  EXPECT_EQ(wrong.status.code(), ErrorCode::kInvalidArgument);
  expect_contains(wrong.status.message(), "wrong length 396 bytes from node 100 (rank 0)");
  expect_contains(wrong.status.message(), "(expected 400 = 100 fp32)");
  PushOutcome two = f.round.push(kFirstNode, 0, 0,
                                 {Buffer::copy_of(in[0].data(), kCount * 4),
                                  Buffer::copy_of(in[0].data(), kCount * 4)});
  EXPECT_EQ(two.status.code(), ErrorCode::kInvalidArgument);
  expect_contains(two.status.message(), "2 payload buffers");
  PushOutcome none = f.round.push(kFirstNode, 0, 0, {});
  expect_contains(none.status.message(), "0 payload buffers");
  for (const PushOutcome* o : {&dup, &future, &wrong, &two, &none}) {
    EXPECT_FALSE(o->completed);
    EXPECT_TRUE(o->answers.empty());
  }

  ASSERT_TRUE(f.push(0, 0, in[0]).status.ok());
  PushOutcome done = f.push(2, 0, in[2]);
  ASSERT_TRUE(done.status.ok() && done.completed);
  EXPECT_EQ(floats_of(f.pull(2, 0)->payload), sum_of(in));  // the refused ones left no trace

  // A late push of the finished round.
  PushOutcome late = f.push(1, 0, in[1]);
  EXPECT_EQ(late.status.code(), ErrorCode::kInvalidArgument);
  expect_contains(late.status.message(),
                  "stale iteration 0 from node 101 (rank 1): job 'rounds' tensor 'g' partition 0 "
                  "(key 0x0) is collecting iteration 1");
}

TEST(RoundsTest, PullsWaitForTheRoundAndAreAnsweredByTheLastPush) {
  constexpr uint32_t kNodes = 3;
  constexpr size_t kCount = 64;
  Fixture f(kNodes, kCount);
  EXPECT_FALSE(f.pull(0, 0).has_value());  // waits
  EXPECT_FALSE(f.pull(2, 0).has_value());
  std::optional<RoundAnswer> dup = f.pull(0, 0);
  ASSERT_TRUE(dup.has_value());
  EXPECT_EQ(dup->status.code(), ErrorCode::kInvalidArgument);
  expect_contains(dup->status.message(), "duplicate pull from node 100 for iteration 0");
  std::optional<RoundAnswer> future = f.pull(1, 1);
  ASSERT_TRUE(future.has_value());
  expect_contains(future->status.message(), "pull refused: future iteration 1");

  std::vector<std::vector<float>> in;
  for (uint32_t r = 0; r < kNodes; ++r) in.push_back(ints(r, 0, kCount));
  EXPECT_TRUE(f.push(0, 0, in[0]).answers.empty());
  EXPECT_TRUE(f.push(1, 0, in[1]).answers.empty());
  PushOutcome last = f.push(2, 0, in[2]);
  ASSERT_TRUE(last.completed);
  ASSERT_EQ(last.answers.size(), 2u);
  std::vector<NodeId> to;
  for (const RoundAnswer& a : last.answers) {
    ASSERT_TRUE(a.status.ok()) << a.status.message();
    EXPECT_TRUE(a.to.expects_reply);
    EXPECT_EQ(a.to.request_id, a.to.from - kFirstNode);  // the waiting request itself
    EXPECT_EQ(floats_of(a.payload), sum_of(in));
    to.push_back(a.to.from);
  }
  EXPECT_EQ(to, (std::vector<NodeId>{kFirstNode, kFirstNode + 2}));  // in arrival order

  // After completion: answered at once, as often as asked.
  for (int k = 0; k < 2; ++k) {
    std::optional<RoundAnswer> a = f.pull(1, 0);
    ASSERT_TRUE(a.has_value() && a->status.ok());
    EXPECT_EQ(floats_of(a->payload), sum_of(in));
  }
  // Round 1 finishes: the answer of 0 is gone.
  std::vector<std::vector<float>> in1;
  for (uint32_t r = 0; r < kNodes; ++r) in1.push_back(ints(r, 1, kCount));
  for (uint32_t r = 0; r < kNodes; ++r) ASSERT_TRUE(f.push(r, 1, in1[r]).status.ok());
  std::optional<RoundAnswer> stale = f.pull(0, 0);
  ASSERT_TRUE(stale.has_value());
  EXPECT_EQ(stale->status.code(), ErrorCode::kInvalidArgument);
  expect_contains(stale->status.message(),
                  "stale iteration 0 of job 'rounds' tensor 'g' partition 0 (key 0x0): its result "
                  "is gone (holding iteration 1, collecting 2)");
  EXPECT_EQ(floats_of(f.pull(0, 1)->payload), sum_of(in1));
}

TEST(RoundsTest, JobEndingMidRoundAnswersTheWaitingPullsAndFreesTheRound) {
  // A node is lost with the round half done: the server ends the job and
  // releases the round with the abort reason.
  constexpr uint32_t kNodes = 3;
  constexpr size_t kCount = 50;
  Fixture f(kNodes, kCount);
  ASSERT_TRUE(f.push(0, 0, ints(0, 0, kCount)).status.ok());
  ASSERT_TRUE(f.push(1, 0, ints(1, 0, kCount)).status.ok());
  EXPECT_FALSE(f.pull(0, 0).has_value());
  EXPECT_FALSE(f.pull(1, 0).has_value());
  const Status why(ErrorCode::kAborted, "job 'rounds' aborted: node 102 lost: missed heartbeats");
  std::vector<RoundAnswer> answers = f.round.release(why);
  ASSERT_EQ(answers.size(), 2u);
  for (const RoundAnswer& a : answers) {
    EXPECT_EQ(a.status.code(), ErrorCode::kAborted);
    EXPECT_EQ(a.status.message(), why.message());
    EXPECT_TRUE(a.payload.empty());
  }
  EXPECT_EQ(answers[0].to.from, kFirstNode);
  EXPECT_EQ(answers[1].to.from, kFirstNode + 1);
  EXPECT_TRUE(f.round.released());
  EXPECT_TRUE(f.round.release(why).empty());  // once

  PushOutcome after = f.push(2, 0, ints(2, 0, kCount));
  EXPECT_FALSE(after.status.ok());
  EXPECT_FALSE(after.completed);
  std::optional<RoundAnswer> pull = f.pull(2, 0);
  ASSERT_TRUE(pull.has_value());
  EXPECT_FALSE(pull->status.ok());

  // A release without an error still answers the waiting pulls with one.
  Fixture g(2, kCount);
  EXPECT_FALSE(g.pull(0, 0).has_value());
  std::vector<RoundAnswer> ended = g.round.release(Status::Ok());
  ASSERT_EQ(ended.size(), 1u);
  EXPECT_EQ(ended[0].status.code(), ErrorCode::kUnavailable);
}

TEST(RoundsTest, StrategyChangeAppliesFromItsIterationOn) {
  constexpr uint32_t kNodes = 3;
  constexpr size_t kCount = 128;
  Fixture f(kNodes, kCount, "", false, /*start=*/5);
  std::vector<const PartitionRound*> rounds = {&f.round};
  EXPECT_EQ(f.round.frozen(), -1);
  auto run_raw = [&](uint64_t it) {
    std::vector<std::vector<float>> in;
    for (uint32_t r = 0; r < kNodes; ++r) in.push_back(ints(r, it, kCount));
    for (uint32_t r = 0; r < kNodes; ++r) {
      PushOutcome o = f.push(r, it, in[r]);
      ASSERT_TRUE(o.status.ok()) << o.status.message();
    }
    EXPECT_EQ(floats_of(f.pull(0, it)->payload), sum_of(in));
  };
  run_raw(5);
  EXPECT_EQ(f.round.frozen(), 5);

  std::vector<TensorPlan> fp16 = plan_job(f.tensors, kFp16);
  ASSERT_EQ(fp16[0].sum, SumMode::kCompressed);
  // The round fixed its plan for 6 at its first push: a change at 6 is late.
  ASSERT_TRUE(f.push(0, 6, ints(0, 6, kCount)).status.ok());
  EXPECT_EQ(f.round.frozen(), 6);
  Status late = prepare(f.plans, 6, fp16, rounds);
  EXPECT_EQ(late.code(), ErrorCode::kInvalidArgument);
  expect_contains(late.message(),
                  "server 0: job 'rounds' tensor 'g' partition 0 (key 0x0) already started "
                  "iteration 6 (request changes at least one iteration ahead)");
  ASSERT_TRUE(prepare(f.plans, 7, fp16, rounds).ok());
  // A change prepared and then cancelled (another server refused it).
  ASSERT_TRUE(prepare(f.plans, 8, plan_job(f.tensors, kBf16), rounds).ok());
  f.plans.cancel(8);

  // Iteration 6 still runs the old plan.
  for (uint32_t r = 1; r < kNodes; ++r) ASSERT_TRUE(f.push(r, 6, ints(r, 6, kCount)).status.ok());
  EXPECT_EQ(floats_of(f.pull(0, 6)->payload),
            sum_of({ints(0, 6, kCount), ints(1, 6, kCount), ints(2, 6, kCount)}));

  // From 7 on: fp16 pushes, summed in the compressed domain, compressed answer.
  auto comp = compress::make_compressor(fp16[0].spec());
  for (uint64_t it = 7; it <= 8; ++it) {
    compress::CompressContext ctx;
    ctx.iteration = it;
    ctx.shared_seed = strategy::partition_seed(kJob, 0);
    PushOutcome raw = f.push(0, it, ints(0, it, kCount));
    EXPECT_FALSE(raw.status.ok()) << "a raw push accepted under the fp16 plan";
    expect_contains(raw.status.message(), "push refused");
    std::vector<std::vector<float>> in;
    PushOutcome last;
    for (uint32_t r = 0; r < kNodes; ++r) {
      in.push_back(ints(r, it, kCount));
      auto state = comp->make_state(kCount);
      Buffer b = Buffer::allocate(comp->max_compressed_bytes(kCount));
      size_t len = comp->compress(compress::ConstTensorView::cpu(in[r].data(), kCount),
                                  {b.mutable_data(), b.size()}, *state, ctx);
      last = f.push_bytes(r, it, b.slice(0, len));
      ASSERT_TRUE(last.status.ok()) << last.status.message();
    }
    ASSERT_TRUE(last.completed);
    std::optional<RoundAnswer> a = f.pull(1, it);
    ASSERT_TRUE(a.has_value() && a->status.ok());
    EXPECT_LT(a->payload.size(), kCount * 4);  // compressed, not the fp32 sum
    std::vector<float> got(kCount);
    strategy::decode_answer(fp16[0].pull, a->payload.span(), got.data(), kCount, comp.get(), ctx);
    EXPECT_EQ(got, sum_of(in)) << "iteration " << it;
  }
}

TEST(RoundsTest, ReservationCoversWhatARoundHolds) {
  std::vector<TensorSpec> t = {{"g", 1000}};
  TensorPlan raw = plan_job(t, "")[0];
  TensorPlan fp16 = plan_job(t, kFp16)[0];
  EXPECT_EQ(round_reservation(raw, 1000, 4, false), 16000u);
  // Deterministic rounds keep every rank's push.
  EXPECT_EQ(round_reservation(raw, 1000, 4, true), 16000u + 4 * push_bytes_bound(raw, 1000));
  EXPECT_EQ(round_reservation(fp16, 1000, 4, false),
            16000u + 4 * push_bytes_bound(fp16, 1000) + 2 * pull_bytes_bound(fp16, 1000));
  // A fused sign sum keeps every rank's (compressed) push until the round
  // completes, and the server's residual.
  TensorPlan sign = plan_job(t, kEfSign)[0];
  EXPECT_EQ(round_reservation(sign, 1000, 4, false),
            16000u + 4 * push_bytes_bound(sign, 1000) + 2 * pull_bytes_bound(sign, 1000) + 4000u);
}

// efsignsgd under a gathering collective: the server keeps the compressed
// pushes and decodes, sums (rank order, whatever the arrival) and
// recompresses them in one fused pass when the round completes. Its answer
// and error-feedback residual are those of decompressing into an fp32 sum in
// rank order and compressing that, bit for bit, round after round.
TEST(RoundsTest, SignSumIsFusedAndEqualsRankOrderDecompressSumRecompress) {
  constexpr uint32_t kNodes = 3;
  constexpr size_t kCount = 70001;  // chunks, sub-blocks and a partial word
  Fixture f(kNodes, kCount, kEfSign);
  const TensorPlan plan = f.plans.plan(0, 0);
  ASSERT_TRUE(fuses_sum(plan)) << plan.describe();
  ASSERT_TRUE(plan.server_error_feedback);
  auto node = compress::make_compressor(plan.spec());
  auto ref = compress::make_sum_recompressor(plan.spec(), true);
  auto ref_state = ref->make_state(kCount);
  std::vector<std::unique_ptr<compress::TensorState>> node_states;
  for (uint32_t r = 0; r < kNodes; ++r) node_states.push_back(node->make_state(kCount));
  std::mt19937 rng(5);
  std::normal_distribution<float> d(0.f, 1.f);
  const std::vector<std::vector<uint32_t>> orders = {{2, 0, 1}, {1, 2, 0}, {0, 1, 2}, {2, 1, 0}};
  for (uint64_t it = 0; it < orders.size(); ++it) {
    // Ranks 0 and 2 send opposite large values, rank 1 small ones: in rank
    // order rank 1's part vanishes in rank 0's ((a + b) - a == 0), in an
    // arrival order starting 2, 0 it survives ((-a + a) + b == b).
    std::vector<float> big(kCount);
    for (float& x : big) x = d(rng) * 1e4f;
    std::vector<Buffer> pushes;
    for (uint32_t r = 0; r < kNodes; ++r) {
      std::vector<float> g(kCount);
      for (size_t i = 0; i < kCount; ++i) g[i] = r == 0 ? big[i] : r == 2 ? -big[i] : d(rng);
      std::vector<std::byte> out(node->max_compressed_bytes(kCount));
      out.resize(node->compress(compress::ConstTensorView::cpu(g.data(), kCount), out,
                                *node_states[r], {}));
      pushes.push_back(Buffer::copy_of(out.data(), out.size()));
    }
    // The reference: decode in rank order into an fp32 sum, then recompress.
    std::vector<float> sum(kCount);
    compress::CompressContext ctx;
    ctx.iteration = it;
    ctx.shared_seed = strategy::partition_seed(kJob, strategy::partition_key(0, 0));
    ctx.private_seed = strategy::server_private_seed(0, strategy::partition_key(0, 0));
    for (uint32_t r = 0; r < kNodes; ++r)
      ref->decompress(pushes[r].span(), compress::TensorView::cpu(sum.data(), kCount), r > 0, ctx);
    std::vector<std::byte> want(ref->max_compressed_bytes(kCount));
    want.resize(ref->compress(compress::ConstTensorView::cpu(sum.data(), kCount), want,
                              *ref_state, ctx));
    PushOutcome last;
    for (uint32_t r : orders[it]) {
      last = f.push_bytes(r, it, pushes[r]);
      ASSERT_TRUE(last.status.ok()) << last.status.message();
    }
    ASSERT_TRUE(last.completed);
    ASSERT_TRUE(last.failure.empty()) << last.failure;
    const Buffer got = f.pull(0, it)->payload;
    ASSERT_EQ(got.size(), want.size()) << "iteration " << it;
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), want.size())) << "iteration " << it;
  }
}

TEST(RoundsTest, FusedSignSumRefusesAMalformedPushAtOnce) {
  constexpr size_t kCount = 1000;
  Fixture f(2, kCount, kEfSign);
  auto node = compress::make_compressor(f.plans.plan(0, 0).spec());
  auto st = node->make_state(kCount);
  std::vector<float> g(kCount, 0.5f);
  std::vector<std::byte> good(node->max_compressed_bytes(kCount));
  good.resize(node->compress(compress::ConstTensorView::cpu(g.data(), kCount), good, *st, {}));
  // A well-formed header (checksum right) whose payload is one word short
  // for its element count: only the sign decoder's own check finds it.
  std::vector<uint8_t> bad(good.size() - 8);
  const uint8_t scale[4] = {0, 0, 0x80, 0x3f};  // 1.0f
  compress::hd::write_header(bad.data(), 8, kCount, scale, 4, 8, bad.size() - 40);
  PushOutcome o = f.push_bytes(1, 0, Buffer::copy_of(bad.data(), bad.size()));
  EXPECT_EQ(o.status.code(), ErrorCode::kMalformed);
  expect_contains(o.status.message(), "push refused: cannot decode buffer from node 101 (rank 1)");
  expect_contains(o.status.message(), "efsignsgd payload is 120 bytes for 1000 elements");
  // The refused push left no trace: both ranks still complete the round.
  ASSERT_TRUE(f.push_bytes(1, 0, Buffer::copy_of(good.data(), good.size())).status.ok());
  PushOutcome done = f.push_bytes(0, 0, Buffer::copy_of(good.data(), good.size()));
  ASSERT_TRUE(done.status.ok() && done.completed);
  EXPECT_TRUE(done.failure.empty()) << done.failure;
}

// A ring tensor's round (assign_partitions gives it one for a switch to
// ps): it reserves nothing, refuses pushes of iterations on the ring, and
// joins at the switch iteration by skipping those the ring ran; back on the
// ring and on ps again, it skips again. An iteration that was on the
// servers is never skipped.
TEST(RoundsTest, ARingTensorsRoundSkipsTheRingIterationsAndJoinsAtTheSwitch) {
  constexpr size_t kCount = 333;
  const std::string ring = strategy_text("  - {tensor: g, option: {compressor: none, inter: allreduce}}\n");
  Fixture f(2, kCount, ring);
  ASSERT_EQ(f.plans.plan(0, 0).placement, Placement::kRing);
  EXPECT_EQ(round_reservation(f.plans.plan(0, 0), kCount, 2, false), 0u);
  EXPECT_EQ(round_reservation(f.plans.plan(0, 0), kCount, 2, true), 0u);
  PushOutcome o = f.push(0, 0, ints(0, 0, kCount));
  EXPECT_EQ(o.status.code(), ErrorCode::kInvalidArgument);
  expect_contains(o.status.message(), "goes round the daemons' ring at iteration 0");
  std::optional<RoundAnswer> ring_pull = f.pull(1, 2);
  ASSERT_TRUE(ring_pull.has_value());
  expect_contains(ring_pull->status.message(), "pull refused: " + f.round.label() +
                                                   " goes round the daemons' ring at iteration 2");
  // ps from 4, ring from 7, ps from 9.
  ASSERT_TRUE(prepare(f.plans, 4, plan_job(f.tensors, ""), {&f.round}).ok());
  ASSERT_TRUE(prepare(f.plans, 7, plan_job(f.tensors, ring), {&f.round}).ok());
  ASSERT_TRUE(prepare(f.plans, 9, plan_job(f.tensors, ""), {&f.round}).ok());
  auto run = [&](uint64_t it) {
    SCOPED_TRACE("iteration " + std::to_string(it));
    std::vector<std::vector<float>> in = {ints(0, it, kCount), ints(1, it, kCount)};
    PushOutcome a = f.push(1, it, in[1]);
    ASSERT_TRUE(a.status.ok()) << a.status.message();
    // The other node pulls first: it waits for the round.
    EXPECT_FALSE(f.pull(0, it).has_value());
    PushOutcome b = f.push(0, it, in[0]);
    ASSERT_TRUE(b.status.ok()) << b.status.message();
    ASSERT_TRUE(b.completed);
    ASSERT_EQ(b.answers.size(), 1u);
    EXPECT_EQ(floats_of(b.answers[0].payload), sum_of(in));
    EXPECT_EQ(f.round.collecting(), it + 1);
  };
  run(4);
  run(5);
  run(6);
  // 7 and 8 went round the ring; a pull of 9 (before any push) joins too.
  EXPECT_FALSE(f.pull(1, 9).has_value());
  EXPECT_EQ(f.round.collecting(), 9u);
  PushOutcome late = f.push(0, 8, ints(0, 8, kCount));
  expect_contains(late.status.message(), "stale iteration 8");
  std::vector<std::vector<float>> in = {ints(0, 9, kCount), ints(1, 9, kCount)};
  ASSERT_TRUE(f.push(0, 9, in[0]).status.ok());
  PushOutcome done = f.push(1, 9, in[1]);
  ASSERT_TRUE(done.completed);
  ASSERT_EQ(done.answers.size(), 1u);
  EXPECT_EQ(floats_of(done.answers[0].payload), sum_of(in));
  // 10 was on the servers: a push of 11 is a future one, not a skip.
  PushOutcome ahead = f.push(0, 11, ints(0, 11, kCount));
  expect_contains(ahead.status.message(), "future iteration 11");
  EXPECT_EQ(f.round.collecting(), 10u);
}

// ---------------------------------------------------------------------------
// BroadcastRound: the root's bytes to every node once all nodes sent their
// part; disagreements fail everyone who sent.

namespace {

struct Bcast {
  // Partition 1 of a tensor cut at 1000 elements (bytes 4000..7999).
  Bcast(uint32_t nodes, uint64_t count = 1000)
      : round(part(count), "job 'b' tensor 'x' partition 1 (key 0x1)", nodes) {}
  static Partition part(uint64_t count) {
    Partition p;
    p.key = strategy::partition_key(0, 1);
    p.index = 1;
    p.offset = 1000;
    p.count = count;
    return p;
  }
  BroadcastOutcome add(uint32_t rank, uint64_t it, proto::BroadcastMeta meta,
                       const std::string* bytes = nullptr) {
    Incoming in;
    in.from = kFirstNode + rank;
    in.expects_reply = true;
    in.request_id = 1000 * it + rank;
    in.message.header.arg = it;
    in.message.payloads.push_back(proto::encode(meta));
    if (bytes) in.message.payloads.push_back(Buffer::copy_of(*bytes));
    return round.add(std::move(in), rank, bytes != nullptr);
  }
  BroadcastRound round;
};

}  // namespace

TEST(BroadcastRound, AnswersEveryNodeWithTheRootsBytesOnceAllArrived) {
  Bcast b(3);
  const proto::BroadcastMeta meta{4, 6000, 77};  // this partition holds bytes 4000..5999
  std::string bytes(2000, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 37);
  EXPECT_TRUE(b.add(0, 0, meta).answers.empty());
  EXPECT_TRUE(b.add(2, 0, meta, &bytes).answers.empty());
  BroadcastOutcome out = b.add(1, 0, meta);
  ASSERT_TRUE(out.failure.empty()) << out.failure;
  ASSERT_EQ(out.answers.size(), 3u);
  for (const RoundAnswer& a : out.answers) {
    ASSERT_TRUE(a.status.ok()) << a.status.to_string();
    if (a.to.from == kFirstNode + 2) {
      EXPECT_TRUE(a.payload.empty());  // the root has them
    } else {
      EXPECT_EQ(a.payload.view(), bytes);
    }
  }
  // The next iteration starts afresh; the finished one is stale.
  out = b.add(0, 0, meta);
  ASSERT_EQ(out.answers.size(), 1u);
  EXPECT_NE(out.answers[0].status.message().find("is not after the last one (0)"),
            std::string::npos)
      << out.answers[0].status.message();
}

TEST(BroadcastRound, DisagreeingNodesFailEveryoneWhoSentNamingTheValues) {
  Bcast b(3);
  EXPECT_TRUE(b.add(0, 5, {0, 8000, 1}).answers.empty());
  BroadcastOutcome out = b.add(1, 5, {0, 8004, 1});
  ASSERT_EQ(out.answers.size(), 2u);
  EXPECT_NE(out.failure.find("the ranks disagree: node 101 (rank 1) passed root rank 0, 8004 "
                             "bytes"),
            std::string::npos)
      << out.failure;
  EXPECT_NE(out.failure.find("rank 0 passed root rank 0, 8000 bytes"), std::string::npos)
      << out.failure;
  for (const RoundAnswer& a : out.answers) {
    EXPECT_EQ(a.status.code(), ErrorCode::kInvalidArgument);
    EXPECT_EQ(a.status.message(), out.failure);
  }
}

TEST(BroadcastRound, RootProblemsAreDetected) {
  const proto::BroadcastMeta meta{0, 8000, 0};
  const std::string full(4000, 'x'), short_(3999, 'x');
  {
    Bcast b(2);  // two roots
    EXPECT_TRUE(b.add(0, 0, meta, &full).answers.empty());
    BroadcastOutcome out = b.add(1, 0, meta, &full);
    EXPECT_NE(out.failure.find("both hold root rank 0"), std::string::npos) << out.failure;
    EXPECT_EQ(out.answers.size(), 2u);
  }
  {
    Bcast b(2);  // nobody holds the root
    EXPECT_TRUE(b.add(0, 0, meta).answers.empty());
    BroadcastOutcome out = b.add(1, 0, meta);
    EXPECT_NE(out.failure.find("no node holds root rank 0"), std::string::npos) << out.failure;
    EXPECT_EQ(out.answers.size(), 2u);
  }
  {
    Bcast b(2);  // the root's bytes do not fill the partition's share
    BroadcastOutcome out = b.add(0, 0, meta, &short_);
    EXPECT_NE(out.failure.find("sent 3999 bytes for a partition of 4000"), std::string::npos)
        << out.failure;
  }
  {
    Bcast b(2);  // the broadcast ends before this partition
    BroadcastOutcome out = b.add(0, 0, {0, 4000, 0});
    EXPECT_NE(out.failure.find("beyond the broadcast's 4000 bytes"), std::string::npos)
        << out.failure;
  }
}

TEST(BroadcastRound, ReleaseAnswersWhatWaitsAndMalformedMetaIsRefused) {
  Bcast b(3);
  EXPECT_TRUE(b.add(0, 0, {0, 8000, 0}).answers.empty());
  std::vector<RoundAnswer> gone =
      b.round.release(Status(ErrorCode::kAborted, "job 'b' aborted: node 102 died"));
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0].status.message(), "job 'b' aborted: node 102 died");
  Bcast c(2);
  Incoming in;
  in.from = kFirstNode;
  // The current version, then one byte of a four-byte field.
  std::string truncated(reinterpret_cast<const char*>(&proto::kVersion), 2);
  truncated += '\x02';
  in.message.payloads.push_back(Buffer::copy_of(truncated));
  BroadcastOutcome out = c.round.add(std::move(in), 0, false);
  ASSERT_EQ(out.answers.size(), 1u);
  EXPECT_EQ(out.answers[0].status.code(), ErrorCode::kMalformed);
  EXPECT_NE(out.answers[0].status.message().find("truncated at field 'root'"), std::string::npos)
      << out.answers[0].status.message();
}
