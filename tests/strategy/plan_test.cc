// The strategy library: the option -> plan mapping on both scopes (the rules
// the servers and the daemon applied before they shared one mapping), the
// partition key and seed formulas, and the pull answer codec.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/error.h"
#include "compress/catalogue.h"
#include "compress/compressor.h"
#include "planner/strategy/answer.h"
#include "planner/strategy/partition.h"
#include "planner/strategy/plan.h"

using namespace bytecomp;
using bytecomp::planner::Collective;
using bytecomp::planner::Option;
namespace st = bytecomp::strategy;

namespace {

Option opt(const std::string& comp, Collective inter, bool ef = false,
           std::map<std::string, std::string> params = {}) {
  Option o;
  o.compressor = comp;
  o.inter = inter;
  o.error_feedback = ef;
  o.params = std::move(params);
  return o;
}

std::string error_of(const Option& o, st::Scope scope) {
  try {
    st::plan_for_option(o, "t", scope);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool has_ef_param(const std::string& name) {
  for (const auto& c : compress::list_compressors())
    if (c.name == name)
      for (const auto& p : c.params)
        if (p.name == "ef") return true;
  return false;
}

}  // namespace

TEST(PlanMapping, PlacementSumAndPullFollowTheInterCollective) {
  struct Case {
    Option o;
    st::Placement placement;
    st::SumMode sum;
    st::PullFormat pull;
    bool server_ef;
  };
  const Case cases[] = {
      {opt("none", Collective::kReduceScatterAllgather), st::Placement::kSharded,
       st::SumMode::kDense, st::PullFormat::kFp32, false},
      // allreduce with none / fp16 / bf16: the daemons' ring (sum and pull unused).
      {opt("none", Collective::kAllreduce), st::Placement::kRing, st::SumMode::kDense,
       st::PullFormat::kFp32, false},
      {opt("fp16", Collective::kAllreduce), st::Placement::kRing, st::SumMode::kCompressed,
       st::PullFormat::kCompressed, false},
      {opt("bf16", Collective::kAllreduce), st::Placement::kRing, st::SumMode::kCompressed,
       st::PullFormat::kCompressed, false},
      // Any other additive compressor under allreduce: summed compressed by the servers.
      {opt("randomk", Collective::kAllreduce, false, {{"ratio", "0.1"}}), st::Placement::kSharded,
       st::SumMode::kCompressed, st::PullFormat::kCompressed, false},
      {opt("none", Collective::kReduceBroadcast), st::Placement::kSingle, st::SumMode::kDense,
       st::PullFormat::kFp32, false},
      {opt("fp16", Collective::kReduceScatterAllgather), st::Placement::kSharded,
       st::SumMode::kCompressed, st::PullFormat::kCompressed, false},
      {opt("bf16", Collective::kReduceBroadcast), st::Placement::kSingle,
       st::SumMode::kCompressed, st::PullFormat::kCompressed, false},
      {opt("fp16", Collective::kAlltoallAllgather), st::Placement::kSharded, st::SumMode::kDense,
       st::PullFormat::kFp16, false},
      {opt("topk", Collective::kAlltoallAllgather, true), st::Placement::kSharded,
       st::SumMode::kDense, st::PullFormat::kCompressed, true},
      {opt("qsgd", Collective::kGatherBroadcast), st::Placement::kSingle, st::SumMode::kDense,
       st::PullFormat::kCompressed, false},
      {opt("signum", Collective::kAlltoallAllgather, true), st::Placement::kSharded,
       st::SumMode::kDense, st::PullFormat::kCompressed, true},
  };
  for (const Case& c : cases) {
    st::TensorPlan p = st::plan_for_option(c.o, "t");
    EXPECT_EQ(p.placement, c.placement) << c.o.describe();
    EXPECT_EQ(p.sum, c.sum) << c.o.describe();
    EXPECT_EQ(p.pull, c.pull) << c.o.describe();
    EXPECT_EQ(p.server_error_feedback, c.server_ef) << c.o.describe();
    EXPECT_EQ(p.compressed_push(), c.o.compressed()) << c.o.describe();
    ASSERT_NE(p.option, nullptr);
    EXPECT_EQ(*p.option, c.o);
  }
  // A peer tensor is on no server: the daemons run it by themselves, so the
  // job's one timeline (cluster scope) carries the same plan a node would
  // make for it, compressor and error feedback included.
  Option peer = opt("topk", Collective::kAllgather, true);
  st::TensorPlan cluster = st::plan_for_option(peer, "t", st::Scope::kCluster);
  EXPECT_EQ(cluster.placement, st::Placement::kPeer);
  ASSERT_TRUE(cluster.compressed_push());
  st::TensorPlan node = st::plan_for_option(peer, "t", st::Scope::kNode);
  EXPECT_EQ(node.placement, st::Placement::kPeer);
  ASSERT_TRUE(node.compressed_push());
  EXPECT_EQ(node.spec().params.at("ef"), "true");
  EXPECT_EQ(cluster, node);
  // Neither is a ring tensor's: the servers never see it.
  EXPECT_TRUE(st::between_daemons(st::Placement::kPeer));
  EXPECT_TRUE(st::between_daemons(st::Placement::kRing));
  EXPECT_FALSE(st::between_daemons(st::Placement::kSharded));
  EXPECT_FALSE(st::between_daemons(st::Placement::kSingle));
  EXPECT_EQ(st::to_string(st::Placement::kRing), "ring");
  // runtime_inter_mode names what the daemon runs.
  EXPECT_EQ(planner::runtime_inter_mode(opt("none", Collective::kAllreduce)), "ring");
  EXPECT_EQ(planner::runtime_inter_mode(opt("bf16", Collective::kAllreduce)), "ring");
  EXPECT_EQ(planner::runtime_inter_mode(opt("randomk", Collective::kAllreduce, false,
                                            {{"ratio", "0.1"}})),
            "ps");
  EXPECT_EQ(planner::runtime_inter_mode(opt("none", Collective::kReduceScatterAllgather)), "ps");
}

TEST(PlanMapping, ErrorFeedbackRuleOfEachScope) {
  // Every compressor under a reducing (when additive) and a gathering inter
  // collective, with and without error feedback.
  for (const auto& info : compress::list_compressors()) {
    for (bool ef : {false, true}) {
      for (Collective inter : {Collective::kReduceScatterAllgather, Collective::kAlltoallAllgather}) {
        if (planner::is_reducing(inter) && !info.additive) continue;
        const Option o = opt(info.name, inter, ef);
        const bool reducing = planner::is_reducing(inter);
        const std::string what = o.describe();
        // Servers: ef follows the option under a gathering collective; under a
        // reducing one it stays at the compressor's default.
        st::TensorPlan c = st::plan_for_option(o, "t", st::Scope::kCluster);
        auto expected = compress::make_compressor(
            {info.name, !reducing && has_ef_param(info.name)
                            ? std::map<std::string, std::string>{{"ef", ef ? "true" : "false"}}
                            : std::map<std::string, std::string>{}});
        EXPECT_EQ(c.spec(), expected->spec()) << what;
        // The server's own residual: as asked, and always where feedback is
        // part of the algorithm; fp16 answers raw words and keeps none.
        const bool builtin = compress::find_compressor(info.name)->builtin_feedback;
        EXPECT_EQ(c.server_error_feedback, !reducing && (ef || builtin) && info.name != "fp16")
            << what;
        // Daemon: ef always follows the option; asking it of a compressor
        // without feedback is refused unless the feedback is built in.
        if (has_ef_param(info.name)) {
          st::TensorPlan n = st::plan_for_option(o, "t", st::Scope::kNode);
          EXPECT_EQ(n.spec().params.at("ef"), ef ? "true" : "false") << what;
        } else if (ef && !builtin) {
          EXPECT_NE(error_of(o, st::Scope::kNode).find("has no error feedback"), std::string::npos)
              << what;
        } else {
          st::TensorPlan n = st::plan_for_option(o, "t", st::Scope::kNode);
          EXPECT_EQ(n.spec(), compress::make_compressor({info.name, {}})->spec()) << what;
        }
      }
    }
  }
}

TEST(PlanMapping, Refusals) {
  // The servers cannot sum a non-additive compressor compressed.
  std::string e = error_of(opt("topk", Collective::kReduceScatterAllgather), st::Scope::kCluster);
  EXPECT_NE(e.find("tensor 't'"), std::string::npos) << e;
  EXPECT_NE(e.find("not additive"), std::string::npos) << e;
  // params.ef: the servers pass it to the factory, the daemon refuses it.
  Option pef = opt("randomk", Collective::kReduceScatterAllgather, false, {{"ef", "false"}});
  EXPECT_EQ(st::plan_for_option(pef, "t").spec().params.at("ef"), "false");
  EXPECT_NE(error_of(pef, st::Scope::kNode).find("not params.ef"), std::string::npos);
  // Bad parameters name the tensor and the parameter.
  e = error_of(opt("topk", Collective::kAlltoallAllgather, false, {{"ratio", "2"}}),
               st::Scope::kCluster);
  EXPECT_NE(e.find("tensor 't'"), std::string::npos) << e;
  EXPECT_NE(e.find("ratio"), std::string::npos) << e;
}

TEST(PlanMapping, MakePlansChecksTheJob) {
  planner::Strategy s = planner::Strategy::parse(
      "version: 1\nentries:\n"
      "  - {tensor: a, option: {compressor: randomk, params: {ratio: '0.5'}, error_feedback: false}}\n"
      "  - {tensor: b, option: {compressor: none}}\n",
      "s.yaml");
  std::vector<st::PlanTensor> tensors = {{"a", 100, bytecomp::DType::kFloat32},
                                          {"b", 5, bytecomp::DType::kInt64}};
  auto plans = st::make_plans(s, "s.yaml", tensors);
  ASSERT_EQ(plans.size(), 2u);
  // The daemon's rule: ef = the option's error_feedback, also under a
  // reducing collective (where the servers' rule keeps randomk's default).
  EXPECT_EQ(plans[0].spec().params.at("ef"), "false");
  EXPECT_EQ(st::plan_for_option(*plans[0].option, "a").spec().params.at("ef"), "true");
  EXPECT_FALSE(plans[1].compressed_push());
  tensors[0].dtype = bytecomp::DType::kFloat16;
  tensors[0].count = 200;  // the same 400 bytes
  try {
    st::make_plans(s, "s.yaml", tensors);
    FAIL() << "compressed a float16 tensor";
  } catch (const Error& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("strategy s.yaml: tensor 'a'"), std::string::npos) << w;
    EXPECT_NE(w.find("float16"), std::string::npos) << w;
  }
  std::vector<st::PlanTensor> other = {{"c", 10, bytecomp::DType::kFloat32}};
  EXPECT_THROW(st::make_plans(s, "s.yaml", other), Error);  // entries name undeclared tensors
  EXPECT_EQ(st::uncompressed_plans(3).size(), 3u);
  EXPECT_FALSE(st::uncompressed_plans(1)[0].compressed_push());
}

TEST(PlanMapping, CopiesShareAndCompareByWireBehaviour) {
  st::TensorPlan a = st::plan_for_option(opt("randomk", Collective::kAllreduce), "t");
  st::TensorPlan b = a;
  EXPECT_EQ(a.compressor.get(), b.compressor.get());
  EXPECT_TRUE(a == b);
  st::TensorPlan c = st::plan_for_option(opt("randomk", Collective::kAllreduce), "t");
  EXPECT_NE(a.compressor.get(), c.compressor.get());
  EXPECT_TRUE(a == c);  // same spec, another object
  st::TensorPlan d = st::plan_for_option(
      opt("randomk", Collective::kAllreduce, false, {{"ratio", "0.5"}}), "t");
  EXPECT_FALSE(a == d);
  EXPECT_NE(a.describe().find("push=randomk"), std::string::npos) << a.describe();
  EXPECT_NE(a.describe().find("sum=compressed"), std::string::npos) << a.describe();
  EXPECT_TRUE(st::TensorPlan{} == st::uncompressed_plans(1)[0]);
  EXPECT_EQ(st::TensorPlan{}.spec().name, "");
}

TEST(PlanMapping, ByteBounds) {
  st::TensorPlan raw;
  EXPECT_EQ(st::push_bytes_bound(raw, 10), 40u);
  EXPECT_EQ(st::pull_bytes_bound(raw, 10), 40u);
  st::TensorPlan half = st::plan_for_option(opt("fp16", Collective::kAlltoallAllgather), "t");
  EXPECT_EQ(st::pull_bytes_bound(half, 10), 20u);
  EXPECT_EQ(st::push_bytes_bound(half, 10), half.compressor->max_compressed_bytes(10));
  st::TensorPlan topk = st::plan_for_option(opt("topk", Collective::kAlltoallAllgather), "t");
  EXPECT_EQ(st::pull_bytes_bound(topk, 1000), topk.compressor->max_compressed_bytes(1000));
}

TEST(PartitionSeeds, OneFormulaPinned) {
  EXPECT_EQ(st::partition_key(3, 7), (uint64_t{3} << 32) | 7);
  // FNV-1a of the name's bytes (one 64-bit word each) then the key, written
  // out here so a change to the formula (which would desynchronise nodes of
  // different versions) fails this test.
  auto fnv = [](const std::string& name, uint64_t key) {
    uint64_t h = 1469598103934665603ull;
    auto word = [&](uint64_t v) {
      for (int i = 0; i < 8; ++i) {
        h ^= (v >> (8 * i)) & 0xFF;
        h *= 1099511628211ull;
      }
    };
    for (unsigned char c : name) word(c);
    word(key);
    return h;
  };
  for (const std::string job : {"", "job", "a-much-longer-job-name"}) {
    for (uint64_t key : {uint64_t{0}, st::partition_key(1, 2), ~uint64_t{0}}) {
      EXPECT_EQ(st::partition_seed(job, key), fnv(job, key));
    }
  }
  EXPECT_NE(st::partition_seed("a", 1), st::partition_seed("b", 1));
  EXPECT_NE(st::partition_seed("a", 1), st::partition_seed("a", 2));
  const uint64_t s = st::partition_seed("job", 5);
  EXPECT_EQ(st::node_private_seed(s, 0), s ^ 0x9e3779b97f4a7c15ull);
  EXPECT_EQ(st::node_private_seed(s, 2), s ^ (0x9e3779b97f4a7c15ull * 3));
  EXPECT_EQ(st::server_private_seed(0, 5), 5u);
  EXPECT_EQ(st::server_private_seed(2, 5), (uint64_t{2} << 32) ^ 5);
}

namespace {

std::vector<float> ramp(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(static_cast<int>(i % 64) - 32) * 0.25f;
  return v;
}

std::vector<std::byte> encode(const st::TensorPlan& plan, const std::vector<float>& sum,
                              compress::TensorState* state) {
  std::vector<std::byte> out(st::pull_bytes_bound(plan, sum.size()));
  out.resize(st::encode_answer(plan.pull, sum.data(), sum.size(), out, plan.compressor.get(),
                               state, {}));
  return out;
}

}  // namespace

TEST(AnswerCodec, RoundTripsEveryFormat) {
  const size_t n = 1000;
  const std::vector<float> sum = ramp(n);  // exact in fp16
  st::TensorPlan raw;
  auto b = encode(raw, sum, nullptr);
  ASSERT_EQ(b.size(), n * 4);
  std::vector<float> got(n, -1);
  st::decode_answer(raw.pull, b, got.data(), n, nullptr, {});
  EXPECT_EQ(got, sum);

  st::TensorPlan half = st::plan_for_option(opt("fp16", Collective::kAlltoallAllgather), "t");
  ASSERT_EQ(half.pull, st::PullFormat::kFp16);
  b = encode(half, sum, nullptr);
  ASSERT_EQ(b.size(), n * 2);
  std::fill(got.begin(), got.end(), -1.0f);
  st::decode_answer(half.pull, b, got.data(), n, half.compressor.get(), {});
  EXPECT_EQ(got, sum);
  // An answer need not be aligned.
  std::vector<std::byte> shifted(b.size() + 1);
  std::memcpy(shifted.data() + 1, b.data(), b.size());
  std::fill(got.begin(), got.end(), -1.0f);
  st::decode_answer(half.pull, std::span<const std::byte>(shifted).subspan(1), got.data(), n,
                    nullptr, {});
  EXPECT_EQ(got, sum);

  for (const char* name : {"topk", "qsgd", "onebit"}) {
    st::TensorPlan c = st::plan_for_option(opt(name, Collective::kAlltoallAllgather), "t");
    ASSERT_EQ(c.pull, st::PullFormat::kCompressed) << name;
    auto state = c.compressor->make_state(n);
    b = encode(c, sum, state.get());
    // The same as the compressor's own output, decoded the compressor's way.
    auto ref_state = c.compressor->make_state(n);
    std::vector<std::byte> ref(c.compressor->max_compressed_bytes(n));
    ref.resize(c.compressor->compress(compress::ConstTensorView::cpu(sum.data(), n), ref,
                                      *ref_state, {}));
    EXPECT_EQ(b, ref) << name;
    std::vector<float> want(n);
    c.compressor->decompress(ref, compress::TensorView::cpu(want.data(), n), false, {});
    std::fill(got.begin(), got.end(), -1.0f);
    st::decode_answer(c.pull, b, got.data(), n, c.compressor.get(), {});
    EXPECT_EQ(got, want) << name;
  }
}

TEST(AnswerCodec, RefusesAnswersThatDoNotFit) {
  const size_t n = 10;
  std::vector<float> out(n, 7.0f);
  std::vector<std::byte> short_answer(n * 4 - 1);
  auto code_of = [&](st::PullFormat f, std::span<const std::byte> in,
                     const compress::Compressor* c) {
    try {
      st::decode_answer(f, in, out.data(), n, c, {});
    } catch (const Error& e) {
      return e.code();
    }
    return ErrorCode::kOk;
  };
  EXPECT_EQ(code_of(st::PullFormat::kFp32, short_answer, nullptr), ErrorCode::kMalformed);
  EXPECT_EQ(code_of(st::PullFormat::kFp16, short_answer, nullptr), ErrorCode::kMalformed);
  EXPECT_EQ(code_of(st::PullFormat::kCompressed, short_answer, nullptr), ErrorCode::kInternal);
  auto topk = compress::make_compressor({"topk", {}});
  EXPECT_EQ(code_of(st::PullFormat::kCompressed, short_answer, topk.get()), ErrorCode::kMalformed);
  for (float v : out) EXPECT_EQ(v, 7.0f);  // nothing written
  std::vector<float> sum(n);
  std::vector<std::byte> small(n * 2 - 1);
  EXPECT_THROW(st::encode_answer(st::PullFormat::kFp16, sum.data(), n, small, nullptr, nullptr, {}),
               Error);
  EXPECT_THROW(st::encode_answer(st::PullFormat::kCompressed, sum.data(), n, small, nullptr,
                                 nullptr, {}),
               Error);
}

TEST(PlanMapping, ReadsTheCatalogue) {
  // Today's built-in feedback set (the daemon accepted error_feedback for
  // exactly these compressors without an "ef" switch).
  std::vector<std::string> builtin;
  for (const auto& e : compress::catalogue())
    if (e.builtin_feedback) builtin.emplace_back(e.name);
  EXPECT_EQ(builtin, (std::vector<std::string>{"dgc", "efsignsgd", "onebit"}));
  // The strategy format knows every catalogue compressor, and its additive
  // set is the catalogue's.
  const auto& names = planner::compressor_names();
  ASSERT_EQ(names.size(), compress::catalogue().size() + 1);
  EXPECT_EQ(names[0], "none");
  for (size_t i = 0; i < compress::catalogue().size(); ++i) {
    const auto& e = compress::catalogue()[i];
    EXPECT_EQ(names[i + 1], e.name);
    EXPECT_EQ(planner::is_additive_compressor(e.name), e.additive) << e.name;
    planner::Strategy s = planner::Strategy::parse(
        std::string("version: 1\ndefault: {compressor: ") + e.name +
            ", inter: alltoall_allgather}\n",
        "s.yaml");
    EXPECT_EQ(s.default_option().compressor, e.name);
    // Every compressor has a plan under a gathering collective on both scopes.
    EXPECT_TRUE(st::plan_for_option(s.default_option(), "t").compressed_push()) << e.name;
    EXPECT_TRUE(st::plan_for_option(s.default_option(), "t", st::Scope::kNode).compressed_push())
        << e.name;
  }
  EXPECT_FALSE(planner::is_additive_compressor("none"));
}
