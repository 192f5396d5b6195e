#include "compress/compressor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <type_traits>

#include "common/config.h"
#include "common/thread_pool.h"
#include "compress/reduce.h"
#include "testutil.h"

using namespace bctest;
using bytecomp::Error;
using bytecomp::ErrorCode;
using bytecomp::ThreadPool;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

bc::CompressorSpec yaml_spec(const std::string& text) {
  auto doc = bytecomp::config::Document::parse("version: 1\ncompressor: " + text + "\n", "job.yaml");
  auto root = doc.root("");
  auto r = root.section("compressor");
  auto s = bc::parse_compressor_spec(r);
  root.finish();
  return s;
}

}  // namespace

// --- the shared vocabulary (common/types.h) and its codes in a buffer ------------

TEST(Vocabulary, CompressUsesCommonTypesAndKeepsItsBufferCodes) {
  static_assert(std::is_same_v<bc::DType, bytecomp::DType>);
  static_assert(std::is_same_v<bc::Device, bytecomp::Device>);
  EXPECT_EQ(bc::to_string(bc::DType::kFloat32), "float32");
  EXPECT_EQ(bc::to_string(bc::DType::kBFloat16), "bfloat16");
  EXPECT_EQ(bc::to_string(bc::Device::kCuda), "cuda");
  EXPECT_EQ(bc::dtype_size(bc::DType::kFloat16), 2u);
  EXPECT_EQ(bc::dtype_size(bc::DType::kFloat64), 8u);
  // Byte 6 of a compressed buffer is its dtype code: float32 is 0, as before
  // the vocabulary was shared; other codes are refused by name.
  auto c = bc::make_compressor(bc::parse_compressor_spec("topk:0.1"));
  auto x = gaussian(1000, 5);
  auto st = c->make_state(x.size());
  auto b = compress(*c, *st, x, {});
  ASSERT_GT(b.size(), 8u);
  EXPECT_EQ(std::to_integer<int>(b[6]), 0);
  EXPECT_EQ(bc::inspect(b).dtype, bc::DType::kFloat32);
  for (int code : {1, 2, 3}) {
    auto bad = b;
    bad[6] = static_cast<std::byte>(code);
    EXPECT_NE(error_of([&] { bc::inspect(bad); }).find("dtype id " + std::to_string(code)),
              std::string::npos);
  }
}

// --- specs, factory ---------------------------------------------------------------

TEST(Spec, ListsEveryCompressorWithParameters) {
  std::vector<std::string> names;
  for (const auto& c : bc::list_compressors()) names.push_back(c.name);
  EXPECT_EQ(names, (std::vector<std::string>{"fp16", "bf16", "randomk", "topk", "dgc", "signsgd",
                                             "signum", "efsignsgd", "onebit", "qsgd", "terngrad"}));
  for (const auto& c : bc::list_compressors()) {
    auto comp = bc::make_compressor({c.name, {}});
    EXPECT_EQ(comp->additive(), c.additive) << c.name;
    EXPECT_EQ(comp->deterministic_size(), c.deterministic_size) << c.name;
    EXPECT_EQ(comp->spec().params.size(), c.params.size()) << c.name;
  }
  std::string d = bc::describe_compressors();
  EXPECT_NE(d.find("qsgd"), std::string::npos);
  EXPECT_NE(d.find("levels (positional) = 16"), std::string::npos);
}

TEST(Spec, ParsesCliForms) {
  EXPECT_EQ(bc::parse_compressor_spec("topk:0.01"), (bc::CompressorSpec{"topk", {{"ratio", "0.01"}}}));
  EXPECT_EQ(bc::parse_compressor_spec("qsgd:levels=16"),
            (bc::CompressorSpec{"qsgd", {{"levels", "16"}}}));
  EXPECT_EQ(bc::parse_compressor_spec("dgc:0.001,momentum=0.8"),
            (bc::CompressorSpec{"dgc", {{"ratio", "0.001"}, {"momentum", "0.8"}}}));
  EXPECT_EQ(bc::parse_compressor_spec("signsgd"), (bc::CompressorSpec{"signsgd", {}}));
  auto c = bc::make_compressor(bc::parse_compressor_spec("topk:0.05"));
  EXPECT_EQ(bc::to_string(c->spec()), "topk:ef=true,ef_beta=1,ratio=0.05");
  EXPECT_EQ(bc::parse_compressor_spec(bc::to_string(c->spec())), c->spec());
}

TEST(Spec, CliErrorsSayWhatIsAccepted) {
  std::string e = error_of([] { bc::parse_compressor_spec("topq:0.1"); });
  EXPECT_NE(e.find("unknown compressor 'topq'"), std::string::npos) << e;
  EXPECT_NE(e.find("fp16, bf16, randomk, topk, dgc"), std::string::npos) << e;
  e = error_of([] { bc::parse_compressor_spec("qsgd:bits=4"); });
  EXPECT_NE(e.find("unknown parameter 'bits'"), std::string::npos) << e;
  EXPECT_NE(e.find("accepted: levels, ef, ef_beta"), std::string::npos) << e;
  e = error_of([] { bc::parse_compressor_spec("topk:1.5"); });
  EXPECT_NE(e.find("'1.5' is out of range (accepted: a number with 0 < x <= 1)"), std::string::npos) << e;
  e = error_of([] { bc::parse_compressor_spec("qsgd:levels=0"); });
  EXPECT_NE(e.find("an integer 1..127"), std::string::npos) << e;
  e = error_of([] { bc::parse_compressor_spec("topk:abc"); });
  EXPECT_NE(e.find("'abc' is not a number"), std::string::npos) << e;
  e = error_of([] { bc::parse_compressor_spec("signsgd:0.1"); });
  EXPECT_NE(e.find("needs the form key=value"), std::string::npos) << e;
  e = error_of([] { bc::parse_compressor_spec("topk:ratio=0.1,ratio=0.2"); });
  EXPECT_NE(e.find("given twice"), std::string::npos) << e;
  e = error_of([] { bc::make_compressor({"topk", {{"ef", "maybe"}}}); });
  EXPECT_NE(e.find("'maybe' is not a boolean (accepted: true|false)"), std::string::npos) << e;
}

TEST(Spec, ParsesYamlWithLocatedErrors) {
  EXPECT_EQ(yaml_spec("{name: topk, ratio: 0.02, ef: false}"),
            (bc::CompressorSpec{"topk", {{"ratio", "0.02"}, {"ef", "false"}}}));
  EXPECT_EQ(yaml_spec("{name: qsgd, levels: 8}"), (bc::CompressorSpec{"qsgd", {{"levels", "8"}}}));
  std::string e = error_of([] { yaml_spec("{name: qsgd, level: 8}"); });
  EXPECT_NE(e.find("job.yaml:2"), std::string::npos) << e;
  EXPECT_NE(e.find("unknown key 'compressor.level'"), std::string::npos) << e;
  EXPECT_NE(e.find("levels"), std::string::npos) << e;
  e = error_of([] { yaml_spec("{name: zip}"); });
  EXPECT_NE(e.find("unknown compressor 'zip'"), std::string::npos) << e;
  EXPECT_NE(e.find("terngrad"), std::string::npos) << e;
  e = error_of([] { yaml_spec("{name: dgc, momentum: 1.5}"); });
  EXPECT_NE(e.find("compressor.momentum"), std::string::npos) << e;
  EXPECT_NE(e.find("0 <= x <= 0.999"), std::string::npos) << e;
  e = error_of([] { yaml_spec("{ratio: 0.1}"); });
  EXPECT_NE(e.find("name"), std::string::npos) << e;
}

// --- generic properties of every compressor ------------------------------------------

class Every : public ::testing::TestWithParam<std::string> {};

TEST_P(Every, RoundTripsWithinBoundAndAccumulates) {
  auto c = bc::make_compressor(bc::parse_compressor_spec(GetParam()));
  for (size_t n : {0ul, 1ul, 63ul, 64ul, 65ul, 1000ul, 200003ul}) {
    auto x = gaussian(n, 3);
    auto st = c->make_state(n);
    auto b = compress(*c, *st, x, {.iteration = 0, .shared_seed = 1});
    EXPECT_LE(b.size(), c->max_compressed_bytes(n));
    if (c->deterministic_size()) {
      EXPECT_EQ(b.size(), c->max_compressed_bytes(n)) << n;
    }
    auto info = bc::inspect(b);
    EXPECT_EQ(info.count, n);
    EXPECT_EQ(info.total_bytes, b.size());
    auto d = decompress(*c, b, n);
    auto acc = gaussian(n, 9);
    auto expect = acc;
    for (size_t i = 0; i < n; ++i) expect[i] += d[i];
    c->decompress(b, bc::TensorView::cpu(acc.data(), n), true, {});
    EXPECT_EQ(acc, expect) << n;
    for (float v : d) ASSERT_TRUE(std::isfinite(v));
  }
}

TEST_P(Every, ThreadPoolGivesIdenticalBytes) {
  auto c = bc::make_compressor(bc::parse_compressor_spec(GetParam()));
  const size_t n = 300007;
  ThreadPool pool(2);
  auto s1 = c->make_state(n), s2 = c->make_state(n);
  for (uint64_t it = 0; it < 3; ++it) {
    auto x = gaussian(n, static_cast<uint32_t>(it + 20));
    bc::CompressContext a{.iteration = it, .shared_seed = 5, .private_seed = 7};
    bc::CompressContext b = a;
    b.pool = &pool;
    auto ba = compress(*c, *s1, x, a), bb = compress(*c, *s2, x, b);
    ASSERT_EQ(ba, bb) << it;
    ASSERT_EQ(decompress(*c, ba, n, a), decompress(*c, bb, n, b));
  }
}

TEST_P(Every, RejectsBadCalls) {
  auto c = bc::make_compressor(bc::parse_compressor_spec(GetParam()));
  const size_t n = 1000;
  auto x = gaussian(n, 1);
  auto st = c->make_state(n);
  std::vector<std::byte> buf(c->max_compressed_bytes(n));
  auto code = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return e.code();
    }
    return ErrorCode::kOk;
  };
  EXPECT_EQ(code([&] {
              c->compress({x.data(), n, bc::DType::kFloat16}, buf, *st, {});
            }),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(code([&] {
              c->compress({x.data(), n, bc::DType::kFloat32, bc::Device::kCuda}, buf, *st, {});
            }),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(code([&] {
              c->compress(bc::ConstTensorView::cpu(x.data(), n),
                          std::span<std::byte>(buf).first(buf.size() - 1), *st, {});
            }),
            ErrorCode::kInvalidArgument);
  auto small = c->make_state(n - 1);
  EXPECT_EQ(code([&] { c->compress(bc::ConstTensorView::cpu(x.data(), n), buf, *small, {}); }),
            ErrorCode::kInvalidArgument);
  auto b = compress(*c, *st, x);
  std::vector<float> out(n + 1);
  EXPECT_EQ(code([&] { c->decompress(b, bc::TensorView::cpu(out.data(), n + 1), false, {}); }),
            ErrorCode::kMalformed);
  auto other = bc::make_compressor({GetParam().rfind("fp16", 0) == 0 ? "bf16" : "fp16", {}});
  EXPECT_EQ(code([&] { other->decompress(b, bc::TensorView::cpu(out.data(), n), false, {}); }),
            ErrorCode::kMalformed);
  // A state made by a different kind of compressor is refused.
  auto dgc = bc::make_compressor({GetParam().rfind("dgc", 0) == 0 ? "signum" : "dgc", {}});
  auto foreign = dgc->make_state(n);
  if (st->has_residual() || GetParam() == "signum") {
    EXPECT_EQ(code([&] { c->compress(bc::ConstTensorView::cpu(x.data(), n), buf, *foreign, {}); }),
              ErrorCode::kInvalidArgument)
        << GetParam();
  }
  if (!c->additive()) {
    std::vector<std::span<const std::byte>> ins{b, b};
    EXPECT_EQ(code([&] { c->aggregate(ins, buf, {}); }), ErrorCode::kInvalidArgument);
  }
}

// Error feedback: what was sent plus the new residual is the input plus the old
// residual (scaled by ef_beta), for every compressor that keeps one.
class Feedback : public ::testing::TestWithParam<std::string> {};

TEST_P(Feedback, ConservesMass) {
  std::string spec = GetParam();
  auto c = bc::make_compressor(bc::parse_compressor_spec(spec));
  const size_t n = 50000;
  auto st = c->make_state(n);
  ASSERT_TRUE(st->has_residual());
  bool dgc = spec.rfind("dgc", 0) == 0;
  float beta = std::stof(c->spec().params.count("ef_beta") ? c->spec().params.at("ef_beta") : "1");
  float m = dgc ? std::stof(c->spec().params.at("momentum")) : 0.0f;
  std::vector<float> old_r(n, 0.0f), new_r(n), u(n, 0.0f);
  for (uint64_t it = 0; it < 4; ++it) {
    auto g = gaussian(n, static_cast<uint32_t>(100 + it));
    st->copy_residual(old_r);
    auto b = compress(*c, *st, g, {.iteration = it, .shared_seed = 3, .private_seed = 4});
    auto d = decompress(*c, b, n);
    st->copy_residual(new_r);
    double err = 0;
    size_t nonzero = 0;
    for (size_t i = 0; i < n; ++i) {
      // DGC accumulates the momentum-corrected gradient u = m*u + g.
      float in = dgc ? (u[i] = m * u[i] + g[i]) : g[i];
      double lhs = static_cast<double>(d[i]) + new_r[i];
      double rhs = static_cast<double>(in) + (dgc ? 1.0f : beta) * old_r[i];
      // float rounding of p - decoded is relative to the larger of the two
      err = std::max(err, std::fabs(lhs - rhs) / (1.0 + std::fabs(rhs) + std::fabs(d[i])));
      nonzero += d[i] != 0.0f;
      if (dgc && d[i] != 0.0f) u[i] = 0.0f;  // momentum factor masking
    }
    EXPECT_LT(err, 2e-6) << spec << " iteration " << it;
    EXPECT_GT(nonzero, 0u);
  }
  st->reset();
  st->copy_residual(new_r);
  EXPECT_TRUE(std::all_of(new_r.begin(), new_r.end(), [](float v) { return v == 0.0f; }));
}

std::string param_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string s = info.param;
  for (auto& ch : s)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return s;
}

INSTANTIATE_TEST_SUITE_P(Compress, Every, ::testing::ValuesIn(all_specs()), param_name);

std::vector<std::string> feedback_specs() {
  std::vector<std::string> out;
  for (const auto& s : all_specs())
    if (bc::make_compressor(bc::parse_compressor_spec(s))->make_state(1)->has_residual())
      out.push_back(s);
  out.push_back("topk:0.01,ef_beta=0.5");
  return out;
}

INSTANTIATE_TEST_SUITE_P(Compress, Feedback, ::testing::ValuesIn(feedback_specs()), param_name);

TEST(Feedback, StatelessCompressorsKeepNoResidual) {
  for (std::string s : {"fp16", "bf16", "signsgd", "signum", "qsgd", "terngrad", "randomk:0.1,ef=false",
                        "topk:0.1,ef=false"}) {
    auto st = bc::make_compressor(bc::parse_compressor_spec(s))->make_state(10);
    EXPECT_FALSE(st->has_residual()) << s;
    std::vector<float> r(10);
    EXPECT_THROW(st->copy_residual(r), Error) << s;
  }
  EXPECT_EQ(feedback_specs().size(), 11u);  // all_specs() entries with a residual, + 1
}

// --- per-compressor reference checks -----------------------------------------------------

TEST(Cast, Fp16AndBf16WithinRoundingBoundsAndAdditive) {
  const size_t n = 100000;
  auto x = gaussian(n, 4, 10.0f);
  for (std::string name : {"fp16", "bf16"}) {
    auto c = bc::make_compressor({name, {}});
    auto st = c->make_state(n);
    auto d = decompress(*c, compress(*c, *st, x), n);
    float rel = name == "fp16" ? 0x1p-11f : 0x1p-8f;
    for (size_t i = 0; i < n; ++i) {
      if (name == "fp16" && std::fabs(x[i]) < 6.2e-5f) {
        ASSERT_LE(std::fabs(d[i] - x[i]), 0x1p-25f);
        continue;
      }
      ASSERT_LE(std::fabs(d[i] - x[i]), std::fabs(x[i]) * rel) << name << " " << x[i];
    }
    // aggregate() in the compressed domain equals rounding the decoded sum.
    auto y = gaussian(n, 5), z = gaussian(n, 6);
    auto by = compress(*c, *st, y), bz = compress(*c, *st, z), bx = compress(*c, *st, x);
    std::vector<std::span<const std::byte>> ins{bx, by, bz};
    std::vector<std::byte> agg(c->max_compressed_bytes(n));
    agg.resize(c->aggregate(ins, agg, {}));
    auto sum = decompress(*c, agg, n);
    auto dx = decompress(*c, bx, n), dy = decompress(*c, by, n), dz = decompress(*c, bz, n);
    for (size_t i = 0; i < n; ++i) {
      float r = dx[i] + dy[i] + dz[i];
      float rr = name == "fp16" ? bc::fp16_to_fp32(bc::fp32_to_fp16(r))
                                : bc::bf16_to_fp32(bc::fp32_to_bf16(r));
      ASSERT_EQ(sum[i], rr) << i;
    }
  }
}

// Reference topk: nth_element over (|x| desc, index asc).
std::vector<uint32_t> ref_topk(const std::vector<float>& x, size_t k) {
  std::vector<uint32_t> idx(x.size());
  std::iota(idx.begin(), idx.end(), 0u);
  std::nth_element(idx.begin(), idx.begin() + static_cast<long>(k) - 1, idx.end(),
                   [&](uint32_t a, uint32_t b) {
                     float fa = std::fabs(x[a]), fb = std::fabs(x[b]);
                     return fa != fb ? fa > fb : a < b;
                   });
  idx.resize(k);
  std::sort(idx.begin(), idx.end());
  return idx;
}

TEST(TopK, EqualsNthElementReferenceIncludingTies) {
  ThreadPool pool(1);
  for (size_t n : {1ul, 100ul, 4097ul, 300000ul}) {
    for (int variant = 0; variant < 3; ++variant) {
      std::vector<float> x = gaussian(n, static_cast<uint32_t>(n));
      if (variant == 1)  // heavy ties: few distinct magnitudes, both signs
        for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(static_cast<int>(i * 7919 % 13) - 6);
      if (variant == 2) std::fill(x.begin(), x.end(), 0.5f);
      for (double ratio : {0.01, 0.1, 1.0}) {
        auto c = bc::make_compressor({"topk", {{"ratio", std::to_string(ratio)}, {"ef", "false"}}});
        auto st = c->make_state(n);
        auto b = compress(*c, *st, x, {.pool = &pool});
        size_t k = std::max<size_t>(1, static_cast<size_t>(std::floor(ratio * n + 0.5)));
        auto ref = ref_topk(x, k);
        auto d = decompress(*c, b, n);
        std::vector<uint32_t> got;
        for (size_t i = 0; i < n; ++i)
          if (d[i] != 0.0f) got.push_back(static_cast<uint32_t>(i));
        // zero values can be selected legitimately; compare on the reference set
        for (uint32_t i : ref) ASSERT_EQ(d[i], x[i]) << n << " " << variant << " " << ratio;
        size_t nonzero_ref = std::count_if(ref.begin(), ref.end(), [&](uint32_t i) { return x[i] != 0; });
        ASSERT_EQ(got.size(), nonzero_ref) << n << " " << variant << " " << ratio;
        EXPECT_EQ(b.size(), c->max_compressed_bytes(n));
      }
    }
  }
}

TEST(TopK, WithErrorFeedbackSendsTopOfAccumulatedGradient) {
  const size_t n = 100000;
  auto c = bc::make_compressor(bc::parse_compressor_spec("topk:0.01"));
  auto st = c->make_state(n);
  std::vector<float> acc(n, 0.0f);
  for (int it = 0; it < 3; ++it) {
    auto g = gaussian(n, 50 + it);
    for (size_t i = 0; i < n; ++i) acc[i] += g[i];
    auto ref = ref_topk(acc, 1000);
    auto d = decompress(*c, compress(*c, *st, g), n);
    for (uint32_t i : ref) {
      ASSERT_EQ(d[i], acc[i]);
      acc[i] = 0.0f;
    }
  }
}

TEST(RandomK, SharedSeedPicksSameIndicesOnEveryWorker) {
  const size_t n = 100000;
  auto c = bc::make_compressor(bc::parse_compressor_spec("randomk:0.01,ef=false"));
  auto picked = [&](const std::vector<float>& x, uint64_t it, uint64_t seed) {
    auto st = c->make_state(n);
    auto d = decompress(*c, compress(*c, *st, x, {.iteration = it, .shared_seed = seed}), n);
    std::vector<uint32_t> idx;
    for (size_t i = 0; i < n; ++i)
      if (d[i] != 0.0f) idx.push_back(static_cast<uint32_t>(i));
    return idx;
  };
  auto w0 = uniform(n, 1, 1.0f, 2.0f), w1 = uniform(n, 2, 1.0f, 2.0f);  // never zero
  auto a = picked(w0, 7, 42);
  EXPECT_EQ(a.size(), 1000u);
  EXPECT_EQ(a, picked(w1, 7, 42));
  auto b = picked(w0, 8, 42), cdiff = picked(w0, 7, 43);
  auto overlap = [](const std::vector<uint32_t>& p, const std::vector<uint32_t>& q) {
    std::vector<uint32_t> o;
    std::set_intersection(p.begin(), p.end(), q.begin(), q.end(), std::back_inserter(o));
    return o.size();
  };
  EXPECT_LT(overlap(a, b), 50u);  // expected ~10 by chance (1% of 1000)
  EXPECT_LT(overlap(a, cdiff), 50u);
  // Payloads of two workers add up in the compressed domain.
  auto s0 = c->make_state(n), s1 = c->make_state(n);
  bc::CompressContext ctx{.iteration = 7, .shared_seed = 42};
  auto b0 = compress(*c, *s0, w0, ctx), b1 = compress(*c, *s1, w1, ctx);
  std::vector<std::span<const std::byte>> ins{b0, b1};
  std::vector<std::byte> agg(c->max_compressed_bytes(n));
  agg.resize(c->aggregate(ins, agg, {}));
  auto sum = decompress(*c, agg, n);
  for (uint32_t i : a) ASSERT_EQ(sum[i], w0[i] + w1[i]);
  auto b2 = compress(*c, *s1, w1, {.iteration = 8, .shared_seed = 42});
  std::vector<std::span<const std::byte>> bad{b0, b2};
  EXPECT_THROW(c->aggregate(bad, agg, {}), Error);
}

TEST(RandomK, EveryElementEquallyLikely) {
  const size_t n = 1000, iters = 4000;
  auto c = bc::make_compressor(bc::parse_compressor_spec("randomk:0.1,ef=false"));
  std::vector<float> x(n, 1.0f), hits(n, 0.0f);
  auto st = c->make_state(n);
  for (uint64_t it = 0; it < iters; ++it)
    c->decompress(compress(*c, *st, x, {.iteration = it, .shared_seed = 9}),
                  bc::TensorView::cpu(hits.data(), n), true, {});
  // Each element: Binomial(4000, 0.1): mean 400, sd 19; 6 sd bounds.
  for (size_t i = 0; i < n; ++i) ASSERT_NEAR(hits[i], 400.0, 114.0) << i;
}

// Unbiasedness: the mean of many independent decompressions converges to the
// input; per-element bound from the quantiser's variance (6 sigma).
void expect_unbiased(const std::string& spec, const std::vector<float>& x, double var_bound) {
  auto c = bc::make_compressor(bc::parse_compressor_spec(spec));
  const size_t n = x.size(), reps = 2000;
  std::vector<float> sum(n, 0.0f);
  auto st = c->make_state(n);
  for (uint64_t r = 0; r < reps; ++r)
    c->decompress(compress(*c, *st, x, {.iteration = r, .private_seed = 77}),
                  bc::TensorView::cpu(sum.data(), n), true, {});
  double tol = 6.0 * std::sqrt(var_bound / reps);
  double mean_err = 0;
  for (size_t i = 0; i < n; ++i) {
    double m = sum[i] / static_cast<double>(reps);
    ASSERT_NEAR(m, x[i], tol) << spec << " element " << i;
    mean_err += m - x[i];
  }
  EXPECT_LT(std::fabs(mean_err / n), 6.0 * std::sqrt(var_bound / reps / n)) << spec;
}

TEST(Quantizers, QsgdIsUnbiased) {
  auto x = gaussian(2000, 11);
  double norm = 0;
  for (float v : x) norm += v * v;
  norm = std::sqrt(norm);
  for (int s : {4, 16}) {
    double unit = norm / s;
    expect_unbiased("qsgd:" + std::to_string(s), x, unit * unit / 4);
  }
}

TEST(Quantizers, QsgdLevelsAreMultiplesOfNormOverS) {
  auto x = gaussian(5000, 12);
  double norm = 0;
  for (float v : x) norm += v * v;
  norm = std::sqrt(norm);
  auto c = bc::make_compressor(bc::parse_compressor_spec("qsgd:16"));
  auto st = c->make_state(x.size());
  auto b = compress(*c, *st, x);
  EXPECT_EQ(b.size(), 32u + 16u + (5000 + 63) / 64 * 6 * 8);  // 6 bits per element
  auto d = decompress(*c, b, x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    double l = std::fabs(d[i]) / (norm / 16);
    ASSERT_NEAR(l, std::round(l), 1e-3);
    ASSERT_LE(std::fabs(std::fabs(d[i]) - std::fabs(x[i])), norm / 16 * 1.0001);
    if (d[i] != 0) {
      ASSERT_EQ(std::signbit(d[i]), std::signbit(x[i]));
    }
  }
}

TEST(Quantizers, TernGradIsUnbiasedWithoutClipping) {
  auto x = uniform(2000, 13);  // 2.5 sigma = 1.44 > max |x|: no clipping
  float mx = 0;
  for (float v : x) mx = std::max(mx, std::fabs(v));
  expect_unbiased("terngrad", x, mx * mx / 4);
  auto c = bc::make_compressor({"terngrad", {}});
  auto st = c->make_state(x.size());
  auto d = decompress(*c, compress(*c, *st, x), x.size());
  for (float v : d) ASSERT_TRUE(v == 0.0f || std::fabs(v) == mx);
}

TEST(Quantizers, TernGradClipsAtTwoPointFiveSigma) {
  auto x = gaussian(100000, 14);
  x[17] = 1000.0f;  // outlier
  double s = 0, q = 0;
  for (float v : x) s += v, q += v * v;
  double mean = s / x.size(), sigma = std::sqrt(q / x.size() - mean * mean);
  auto c = bc::make_compressor({"terngrad", {}});
  auto st = c->make_state(x.size());
  auto d = decompress(*c, compress(*c, *st, x), x.size());
  for (float v : d) ASSERT_TRUE(v == 0.0f || std::fabs(std::fabs(v) - 2.5 * sigma) < 1e-3 * sigma);
  EXPECT_GT(d[17], 0.0f);  // clipped to the scale, kept with probability 1
}

TEST(Sign, SignSgdMajorityVoteByDecompressSumRecompress) {
  const size_t n = 10000, workers = 5;
  auto c = bc::make_compressor({"signsgd", {}});
  std::vector<std::vector<float>> g;
  std::vector<float> sum(n, 0.0f);
  for (size_t w = 0; w < workers; ++w) {
    g.push_back(gaussian(n, static_cast<uint32_t>(200 + w)));
    auto st = c->make_state(n);
    auto b = compress(*c, *st, g.back());
    c->decompress(b, bc::TensorView::cpu(sum.data(), n), true, {});
  }
  auto st = c->make_state(n);
  auto vote = decompress(*c, compress(*c, *st, sum), n);
  for (size_t i = 0; i < n; ++i) {
    int neg = 0;
    for (size_t w = 0; w < workers; ++w) neg += std::signbit(g[w][i]) ? 1 : 0;
    ASSERT_EQ(vote[i], neg * 2 > static_cast<int>(workers) ? -1.0f : 1.0f) << i;
    ASSERT_EQ(sum[i], static_cast<float>(static_cast<int>(workers) - 2 * neg));
  }
}

TEST(Sign, SignumFollowsMomentumReference) {
  const size_t n = 5000;
  auto c = bc::make_compressor(bc::parse_compressor_spec("signum:0.8"));
  auto st = c->make_state(n);
  std::vector<float> m(n, 0.0f);
  for (int it = 0; it < 4; ++it) {
    auto g = gaussian(n, 300 + it);
    for (size_t i = 0; i < n; ++i) m[i] = 0.8f * m[i] + 0.2f * g[i];
    auto d = decompress(*c, compress(*c, *st, g), n);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(d[i], std::signbit(m[i]) ? -1.0f : 1.0f) << it;
  }
}

TEST(Sign, EfSignSgdAndOneBitScalesMatchReference) {
  const size_t n = 20000;
  auto x = gaussian(n, 400);
  for (std::string name : {"efsignsgd", "onebit"}) {
    auto c = bc::make_compressor({name, {}});
    auto st = c->make_state(n);
    auto d = decompress(*c, compress(*c, *st, x), n);
    double l1 = 0, ps = 0, ns = 0;
    size_t pc = 0, nc = 0;
    for (float v : x) {
      l1 += std::fabs(v);
      if (std::signbit(v)) ns += v, ++nc;
      else ps += v, ++pc;
    }
    for (size_t i = 0; i < n; ++i) {
      double want = name == "efsignsgd" ? (std::signbit(x[i]) ? -l1 / n : l1 / n)
                                        : (std::signbit(x[i]) ? ns / nc : ps / pc);
      ASSERT_NEAR(d[i], want, 1e-5 * std::fabs(want)) << name;
    }
  }
}

TEST(Dgc, SelectsNearTargetCountAndFollowsWarmup) {
  const size_t n = 500000;
  ThreadPool pool(1);
  auto c = bc::make_compressor(bc::parse_compressor_spec("dgc:0.001,warmup_iters=2"));
  auto st = c->make_state(n);
  size_t expect[] = {125000, 125000, 31250, 31250, 7813, 7813, 2000, 2000, 500, 500, 500};
  for (uint64_t it = 0; it < 11; ++it) {
    auto g = gaussian(n, static_cast<uint32_t>(500 + it));
    auto b = compress(*c, *st, g, {.iteration = it, .pool = &pool});
    size_t k = (b.size() - 40) / 8;
    EXPECT_GE(k * 10, expect[it] * 7) << it;
    EXPECT_LE(k * 10, expect[it] * 13) << it;
    EXPECT_LE(b.size(), c->max_compressed_bytes(n));
  }
  // Heavy-tailed and sparse inputs too.
  auto c2 = bc::make_compressor(bc::parse_compressor_spec("dgc:0.01,momentum=0"));
  for (int kind = 0; kind < 3; ++kind) {
    auto g = gaussian(n, 600 + kind);
    if (kind == 1) for (auto& v : g) v = v * v * v;
    if (kind == 2) for (size_t i = 0; i < n; ++i) if (i % 7) g[i] = 0.0f;
    auto st2 = c2->make_state(n);
    auto b = compress(*c2, *st2, g);
    size_t k = (b.size() - 40) / 8;
    EXPECT_GE(k * 10, 5000u * 7) << kind;
    EXPECT_LE(k * 10, 5000u * 13) << kind;
    // The selected values are the large ones: every sent |v| >= every unsent.
    auto d = decompress(*c2, b, n);
    float min_sent = INFINITY, max_unsent = 0;
    for (size_t i = 0; i < n; ++i) {
      if (d[i] != 0.0f) min_sent = std::min(min_sent, std::fabs(d[i]));
      else max_unsent = std::max(max_unsent, std::fabs(g[i]));
    }
    EXPECT_GE(min_sent, max_unsent) << kind;
  }
}

TEST(Wire, MisalignedInputDecodes) {
  auto c = bc::make_compressor(bc::parse_compressor_spec("qsgd:16"));
  auto x = gaussian(777, 1);
  auto st = c->make_state(777);
  auto b = compress(*c, *st, x);
  std::vector<std::byte> shifted(b.size() + 1);
  std::memcpy(shifted.data() + 1, b.data(), b.size());
  std::vector<float> out(777);
  c->decompress(std::span<const std::byte>(shifted).subspan(1), bc::TensorView::cpu(out.data(), 777),
                false, {});
  EXPECT_EQ(out, decompress(*c, b, 777));
}
