// Compressor::sum_compress (a server's decompress-sum-recompress in one call)
// against the reference it must equal bit for bit: decompress the first
// input into an fp32 buffer, accumulate the others in order, compress that
// buffer. Compared over several rounds, so the error-feedback residual the
// state carries (and the lazy form the sign family keeps it in) must match
// too; the fused sign-family path and the generic one alike.
#include <gtest/gtest.h>

#include <cstring>

#include "common/thread_pool.h"
#include "compress/compressor.h"
#include "testutil.h"

using namespace bctest;
using bytecomp::Error;
using bytecomp::ErrorCode;
using bytecomp::ThreadPool;

namespace {

struct Case {
  std::string spec;
  bool server_ef;
};

// The reference: what a server did before sum_compress existed.
size_t reference_sum_compress(const bc::Compressor& c, const std::vector<std::vector<std::byte>>& in,
                              size_t n, std::vector<std::byte>& out, bc::TensorState& st,
                              const bc::CompressContext& ctx) {
  std::vector<float> sum(n, -7.0f);
  for (size_t i = 0; i < in.size(); ++i)
    c.decompress(in[i], bc::TensorView::cpu(sum.data(), n), i > 0, ctx);
  return c.compress(bc::ConstTensorView::cpu(sum.data(), n), out, st, ctx);
}

std::vector<float> residual_of(const bc::TensorState& st) {
  std::vector<float> r(st.count());
  if (st.has_residual()) st.copy_residual(r);
  return r;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

class SumCompress : public ::testing::TestWithParam<Case> {};

TEST_P(SumCompress, BitIdenticalToDecompressSumCompressOverRounds) {
  const Case cs = GetParam();
  const bc::CompressorSpec spec = bc::parse_compressor_spec(cs.spec);
  auto node = bc::make_compressor(spec);
  auto server = bc::make_sum_recompressor(spec, cs.server_ef);
  ThreadPool pool(2);
  // Sizes around the 64-element words, the 4096-element sub-blocks and the
  // 65536-element chunks the kernels split work by.
  for (size_t n : {size_t{1}, size_t{63}, size_t{64}, size_t{4095}, size_t{4097},
                   size_t{65536 + 77}, size_t{200003}}) {
    for (size_t nodes : {size_t{1}, size_t{2}, size_t{3}}) {
      SCOPED_TRACE(cs.spec + " server_ef=" + std::to_string(cs.server_ef) +
                   " n=" + std::to_string(n) + " nodes=" + std::to_string(nodes));
      std::vector<std::unique_ptr<bc::TensorState>> node_st;
      for (size_t k = 0; k < nodes; ++k) node_st.push_back(node->make_state(n));
      auto st_ref = server->make_state(n);
      auto st_new = server->make_state(n);
      std::vector<float> scratch(n, 99.0f);
      for (uint64_t it = 0; it < 4; ++it) {
        bc::CompressContext ctx;
        ctx.iteration = it;
        ctx.shared_seed = 17;
        ctx.pool = it % 2 ? &pool : nullptr;
        std::vector<std::vector<std::byte>> pushes;
        std::vector<std::span<const std::byte>> spans;
        for (size_t k = 0; k < nodes; ++k) {
          // Differently scaled nodes, so the sum's signs and scales vary.
          auto g = gaussian(n, static_cast<uint32_t>(1000 * it + 7 * k + n), 1.0f + k);
          bc::CompressContext nctx = ctx;
          nctx.private_seed = k;
          pushes.push_back(compress(*node, *node_st[k], g, nctx));
        }
        for (const auto& p : pushes) spans.emplace_back(p);
        std::vector<std::byte> ref(server->max_compressed_bytes(n)), got(ref.size());
        const size_t lr = reference_sum_compress(*server, pushes, n, ref, *st_ref, ctx);
        const size_t lg =
            server->sum_compress(spans, n, server->fuses_sum_compress() ? nullptr : scratch.data(),
                                 got, *st_new, ctx);
        ASSERT_EQ(lr, lg) << "iteration " << it;
        ASSERT_EQ(0, std::memcmp(ref.data(), got.data(), lr)) << "iteration " << it;
        ASSERT_TRUE(same_bits(residual_of(*st_ref), residual_of(*st_new))) << "iteration " << it;
      }
      if (server->fuses_sum_compress()) {
        EXPECT_EQ(scratch, std::vector<float>(n, 99.0f)) << "the fused path wrote its scratch";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Specs, SumCompress,
    ::testing::Values(Case{"efsignsgd", true}, Case{"efsignsgd:ef_beta=0.7", true},
                      Case{"onebit", true}, Case{"signsgd", false}, Case{"signsgd:ef=true", true},
                      Case{"signum", false}, Case{"topk:0.05", true}, Case{"qsgd:levels=16", false},
                      Case{"dgc:0.05", true}),
    [](const auto& info) {
      std::string s = info.param.spec + (info.param.server_ef ? "_ef" : "");
      for (char& ch : s)
        if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      return s;
    });

TEST(SumCompressCalls, SignFamilyFusesOthersDoNot) {
  for (const char* s : {"efsignsgd", "onebit", "signsgd", "signum"})
    EXPECT_TRUE(bc::make_sum_recompressor(bc::parse_compressor_spec(s), true)->fuses_sum_compress() ||
                std::string(s) == "signum")
        << s;
  EXPECT_TRUE(
      bc::make_sum_recompressor(bc::parse_compressor_spec("signum"), false)->fuses_sum_compress());
  // The nodes' signum (momentum) has no sum form.
  EXPECT_FALSE(bc::make_compressor(bc::parse_compressor_spec("signum"))->fuses_sum_compress());
  EXPECT_FALSE(bc::make_sum_recompressor(bc::parse_compressor_spec("topk:0.01"), true)
                   ->fuses_sum_compress());
}

TEST(SumCompressCalls, BadInputThrowsBeforeTheStateChanges) {
  const size_t n = 5000;
  auto spec = bc::parse_compressor_spec("efsignsgd");
  auto node = bc::make_compressor(spec);
  auto server = bc::make_sum_recompressor(spec, true);
  auto nst = node->make_state(n);
  auto good = compress(*node, *nst, gaussian(n, 1));
  auto st = server->make_state(n);
  std::vector<std::byte> out(server->max_compressed_bytes(n));
  // One round, so the state has a residual to keep.
  std::vector<std::span<const std::byte>> one = {good};
  server->sum_compress(one, n, nullptr, out, *st, {});
  const std::vector<float> before = residual_of(*st);

  auto short_payload = good;
  short_payload.resize(good.size() - 8);
  auto other_count = compress(*node, *node->make_state(n + 64), gaussian(n + 64, 2));
  auto topk = compress(*bc::make_compressor(bc::parse_compressor_spec("topk:0.1")),
                       *bc::make_compressor(bc::parse_compressor_spec("topk:0.1"))->make_state(n),
                       gaussian(n, 3));
  for (const auto* bad : {&short_payload, &other_count, &topk}) {
    std::vector<std::span<const std::byte>> in = {good, *bad};
    try {
      server->sum_compress(in, n, nullptr, out, *st, {});
      ADD_FAILURE() << "a bad second input was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kMalformed) << e.what();
    }
    EXPECT_THROW(server->check(*bad, n), Error);
    EXPECT_TRUE(same_bits(before, residual_of(*st))) << "the state changed on a refused input";
  }
  EXPECT_NO_THROW(server->check(good, n));

  std::vector<std::span<const std::byte>> none;
  try {
    server->sum_compress(none, n, nullptr, out, *st, {});
    ADD_FAILURE() << "no inputs accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  }
  std::vector<std::byte> small(out.size() - 1);
  EXPECT_THROW(server->sum_compress(one, n, nullptr, small, *st, {}), Error);
  auto wrong_state = server->make_state(n + 1);
  EXPECT_THROW(server->sum_compress(one, n, nullptr, out, *wrong_state, {}), Error);
  // The generic path needs its scratch buffer.
  auto tk = bc::make_sum_recompressor(bc::parse_compressor_spec("topk:0.1"), false);
  auto tst = tk->make_state(n);
  std::vector<std::span<const std::byte>> tin = {topk};
  std::vector<std::byte> tout(tk->max_compressed_bytes(n));
  EXPECT_THROW(tk->sum_compress(tin, n, nullptr, tout, *tst, {}), Error);
}

TEST(SumCompressCalls, MisalignedInputsSumLikeAlignedOnes) {
  const size_t n = 9000;
  auto spec = bc::parse_compressor_spec("onebit");
  auto node = bc::make_compressor(spec);
  auto server = bc::make_sum_recompressor(spec, true);
  auto a = compress(*node, *node->make_state(n), gaussian(n, 4));
  auto b = compress(*node, *node->make_state(n), gaussian(n, 5));
  std::vector<std::byte> shifted(b.size() + 1);
  std::memcpy(shifted.data() + 1, b.data(), b.size());
  std::span<const std::byte> mis(shifted.data() + 1, b.size());
  auto st1 = server->make_state(n), st2 = server->make_state(n);
  std::vector<std::byte> o1(server->max_compressed_bytes(n)), o2(o1.size());
  std::vector<std::span<const std::byte>> in1 = {a, b}, in2 = {a, mis};
  const size_t l1 = server->sum_compress(in1, n, nullptr, o1, *st1, {});
  const size_t l2 = server->sum_compress(in2, n, nullptr, o2, *st2, {});
  ASSERT_EQ(l1, l2);
  EXPECT_EQ(0, std::memcmp(o1.data(), o2.data(), l1));
  EXPECT_NO_THROW(server->check(mis, n));
}

}  // namespace

namespace {

// The sign decoders (AVX-512, AVX2 or scalar by CPU; non-temporal stores for
// large aligned outputs not read again soon) against the definition:
// element i is neg where bit i of the bitmap is set, else pos; accumulate
// adds that in float32.
TEST(SignDecode, EveryElementIsItsBitsLevelSetOrAdded) {
  auto c = bc::make_compressor(bc::parse_compressor_spec("onebit"));
  for (size_t n : {size_t{1}, size_t{63}, size_t{64}, size_t{65}, size_t{4096 + 3},
                   size_t{(1u << 18) + 64 + 5}, size_t{(1u << 20) + 7}}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    auto st = c->make_state(n);
    auto buf = compress(*c, *st, gaussian(n, static_cast<uint32_t>(n)));
    float pos, neg;
    std::memcpy(&pos, buf.data() + 32, 4);
    std::memcpy(&neg, buf.data() + 36, 4);
    const std::byte* words = buf.data() + 40;
    auto level = [&](size_t i) {
      uint64_t w;
      std::memcpy(&w, words + 8 * (i / 64), 8);
      return (w >> (i % 64)) & 1u ? neg : pos;
    };
    // 64-byte aligned output (the streaming path) and a misaligned one.
    for (size_t k = 0; k < 4; ++k) {
      const size_t shift = k % 2;
      bc::CompressContext ctx;
      ctx.output_not_reread = k >= 2;
      std::vector<float> storage(n + 32, 5.0f);
      auto* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) &
                                            ~uintptr_t{63});
      float* out = base + shift;
      ASSERT_LE(out + n, storage.data() + storage.size());
      c->decompress(buf, bc::TensorView::cpu(out, n), false, ctx);
      size_t bad = 0;
      for (size_t i = 0; i < n; ++i) {
        const float want = level(i);
        if (std::memcmp(&out[i], &want, 4) != 0 && ++bad < 4)
          ADD_FAILURE() << "set: element " << i << " is " << out[i] << ", want " << want;
      }
      std::vector<float> prior(n);
      for (size_t i = 0; i < n; ++i) prior[i] = out[i] = static_cast<float>(i % 97) * 0.37f;
      c->decompress(buf, bc::TensorView::cpu(out, n), true, ctx);
      for (size_t i = 0; i < n; ++i) {
        const float want = prior[i] + level(i);
        if (std::memcmp(&out[i], &want, 4) != 0 && ++bad < 4)
          ADD_FAILURE() << "add: element " << i << " is " << out[i] << ", want " << want;
      }
      EXPECT_EQ(bad, 0u) << "shift " << shift << " not reread " << ctx.output_not_reread;
    }
  }
}

}  // namespace
