#include "compress/reduce.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/thread_pool.h"

namespace bc = bytecomp::compress;

namespace {

std::vector<float> randv(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Reference: exact rounding via double arithmetic on the representable halves.
double half_value(uint16_t h) {
  int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) ? -v : v;
}

}  // namespace

TEST(Reduce, SumIntoMatchesScalarAcrossSizesAndThreads) {
  bytecomp::ThreadPool pool(1);
  for (size_t n : {0ul, 1ul, 7ul, 63ul, 1000ul, 300001ul}) {
    auto a = randv(n, 1), b = randv(n, 2);
    auto ref = a;
    for (size_t i = 0; i < n; ++i) ref[i] += b[i];
    auto x = a;
    bc::sum_into(x.data(), b.data(), n);
    EXPECT_EQ(x, ref) << n;
    x = a;
    bc::sum_into(x.data(), b.data(), n, &pool);
    EXPECT_EQ(x, ref) << n;
  }
}

TEST(Reduce, ManySourcesSumAndSumInto) {
  bytecomp::ThreadPool pool(1);
  const size_t n = 100003;
  for (size_t m : {1ul, 2ul, 3ul, 5ul}) {
    std::vector<std::vector<float>> s;
    std::vector<const float*> p;
    for (size_t j = 0; j < m; ++j) s.push_back(randv(n, 10 + static_cast<uint32_t>(j)));
    for (auto& v : s) p.push_back(v.data());
    std::vector<float> base = randv(n, 99), out(n), acc = base;
    bc::sum(out.data(), p, n, &pool);
    bc::sum_into(acc.data(), p, n, &pool);
    for (size_t i = 0; i < n; ++i) {
      double r = 0;
      for (size_t j = 0; j < m; ++j) r += s[j][i];
      ASSERT_NEAR(out[i], r, 1e-5) << i;
      ASSERT_NEAR(acc[i], r + base[i], 1e-5) << i;
    }
    // In place: dst is the first source.
    std::vector<float> inplace = s[0];
    p[0] = inplace.data();
    bc::sum(inplace.data(), p, n);
    EXPECT_EQ(inplace, out);
  }
}

TEST(Reduce, ScaleMultiplies) {
  auto v = randv(5000, 3), r = v;
  bc::scale(v.data(), 0.25f, v.size());
  for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(v[i], r[i] * 0.25f);
}

TEST(Reduce, Fp16ScalarConversionIsCorrectlyRounded) {
  // Every half value round-trips, and random floats land on the nearest half
  // (ties to even), checked against exact double arithmetic.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    uint16_t hh = static_cast<uint16_t>(h);
    float f = bc::fp16_to_fp32(hh);
    if (((h >> 10) & 0x1f) == 0x1f && !(h & 0x3ff)) {
      EXPECT_TRUE(std::isinf(f));
      EXPECT_EQ(bc::fp32_to_fp16(f), hh);
      continue;
    }
    if (std::isnan(f)) {
      EXPECT_TRUE(((h >> 10) & 0x1f) == 0x1f && (h & 0x3ff));
      continue;
    }
    EXPECT_EQ(f, static_cast<float>(half_value(hh))) << h;
    EXPECT_EQ(bc::fp32_to_fp16(f), hh) << h;
  }
  std::mt19937 g(5);
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = g();
    float f;
    std::memcpy(&f, &u, 4);
    if (std::isnan(f)) continue;
    uint16_t h = bc::fp32_to_fp16(f);
    double err = std::fabs(static_cast<double>(f) - half_value(h));
    if (std::fabs(f) >= 65520.0f) {
      EXPECT_EQ(h & 0x7fff, 0x7c00) << f;
      continue;
    }
    // No other half is closer; on a tie the mantissa is even.
    for (int d : {-1, 1}) {
      uint16_t o = static_cast<uint16_t>(h + d);
      if (((o >> 10) & 0x1f) == 0x1f || (o & 0x8000) != (h & 0x8000)) continue;
      double oe = std::fabs(static_cast<double>(f) - half_value(o));
      ASSERT_LE(err, oe) << f;
      if (err == oe) {
        ASSERT_EQ(h & 1, 0) << f;
      }
    }
  }
}

TEST(Reduce, VectorFp16MatchesScalarIncludingSpecials) {
  std::vector<float> v = randv(100000, 7, 3000.0f);
  v.insert(v.end(), {0.0f, -0.0f, 65504.0f, 65520.0f, -1e9f, 1e-8f, -6e-8f, 3e-5f,
                     INFINITY, -INFINITY, NAN, 1.0009765625f, 2049.0f, 2051.0f});
  std::vector<uint16_t> h(v.size());
  bytecomp::ThreadPool pool(1);
  bc::fp32_to_fp16(h.data(), v.data(), v.size(), &pool);
  for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(h[i], bc::fp32_to_fp16(v[i])) << v[i];
  std::vector<float> back(v.size());
  bc::fp16_to_fp32(back.data(), h.data(), h.size(), &pool);
  for (size_t i = 0; i < v.size(); ++i)
    ASSERT_EQ(bits(back[i]), bits(bc::fp16_to_fp32(h[i]))) << i;
  // Relative rounding bound for normal halves: 2^-11.
  for (size_t i = 0; i < 100000; ++i)
    if (std::fabs(v[i]) > 6.2e-5f && std::fabs(v[i]) < 65504.0f) {
      ASSERT_LE(std::fabs(back[i] - v[i]), std::fabs(v[i]) * 0x1p-11f) << v[i];
    }
}

TEST(Reduce, Bf16RoundsToNearestEven) {
  std::vector<float> v = randv(50000, 8, 1e3f);
  v.insert(v.end(), {INFINITY, -INFINITY, NAN, 0.0f, -0.0f, 3.4028235e38f});
  std::vector<uint16_t> h(v.size());
  bc::fp32_to_bf16(h.data(), v.data(), v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    ASSERT_EQ(h[i], bc::fp32_to_bf16(v[i]));
    float b = bc::bf16_to_fp32(h[i]);
    if (std::isnan(v[i])) {
      ASSERT_TRUE(std::isnan(b));
      continue;
    }
    if (std::isinf(v[i])) {
      ASSERT_EQ(b, v[i]);
      continue;
    }
    if (std::isinf(b) && !std::isinf(v[i])) continue;  // FLT_MAX rounds up to inf
    ASSERT_LE(std::fabs(b - v[i]), std::fabs(v[i]) * 0x1p-8f) << v[i];
    // Exact reference: the two neighbouring bf16 values by truncation.
    uint32_t lo = bits(v[i]) & 0xffff0000u, rem = bits(v[i]) & 0xffffu;
    uint32_t expect = rem > 0x8000u || (rem == 0x8000u && (lo & 0x10000u)) ? lo + 0x10000u : lo;
    ASSERT_EQ(static_cast<uint32_t>(h[i]) << 16, expect) << v[i];
  }
}

TEST(Reduce, HalfSumsAccumulateInFp32) {
  const size_t n = 70001;
  bytecomp::ThreadPool pool(1);
  auto a = randv(n, 11), b = randv(n, 12), c = randv(n, 13);
  std::vector<uint16_t> ha(n), hb(n), hc(n);
  bc::fp32_to_fp16(ha.data(), a.data(), n);
  bc::fp32_to_fp16(hb.data(), b.data(), n);
  bc::fp32_to_fp16(hc.data(), c.data(), n);
  std::vector<const uint16_t*> srcs{ha.data(), hb.data(), hc.data()};
  std::vector<uint16_t> out(n);
  bc::sum_fp16(out.data(), srcs, n, &pool);
  for (size_t i = 0; i < n; ++i) {
    float r = bc::fp16_to_fp32(ha[i]) + bc::fp16_to_fp32(hb[i]) + bc::fp16_to_fp32(hc[i]);
    ASSERT_EQ(out[i], bc::fp32_to_fp16(r)) << i;
  }
  std::vector<uint16_t> acc = ha;
  bc::sum_into_fp16(acc.data(), hb.data(), n, &pool);
  for (size_t i = 0; i < n; ++i)
    ASSERT_EQ(acc[i], bc::fp32_to_fp16(bc::fp16_to_fp32(ha[i]) + bc::fp16_to_fp32(hb[i])));
  std::vector<float> f = a;
  bc::accumulate_fp16(f.data(), hb.data(), n, &pool);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(f[i], a[i] + bc::fp16_to_fp32(hb[i]));

  std::vector<uint16_t> ba(n), bb(n), bo(n);
  bc::fp32_to_bf16(ba.data(), a.data(), n);
  bc::fp32_to_bf16(bb.data(), b.data(), n);
  std::vector<const uint16_t*> bs{ba.data(), bb.data()};
  bc::sum_bf16(bo.data(), bs, n, &pool);
  std::vector<uint16_t> bi = ba;
  bc::sum_into_bf16(bi.data(), bb.data(), n, &pool);
  f = a;
  bc::accumulate_bf16(f.data(), bb.data(), n, &pool);
  for (size_t i = 0; i < n; ++i) {
    uint16_t r = bc::fp32_to_bf16(bc::bf16_to_fp32(ba[i]) + bc::bf16_to_fp32(bb[i]));
    ASSERT_EQ(bo[i], r);
    ASSERT_EQ(bi[i], r);
    ASSERT_EQ(f[i], a[i] + bc::bf16_to_fp32(bb[i]));
  }
}
