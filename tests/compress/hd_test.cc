// Host-side checks of compress/hd.h, the per-element logic the CUDA kernels
// share with the CPU library: each test rebuilds a CPU compressor's output
// the way the CUDA kernels do (one thread per element, one 32-bit ballot per
// warp and bit plane, radix select by per-bucket tests) and compares bytes.
#include <gtest/gtest.h>

#include <boost/crc.hpp>

#include <algorithm>
#include <cstring>
#include <limits>

#include "compress/compressor.h"
#include "compress/cuda/cuda.h"
#include "compress/hd.h"
#include "compress/reduce.h"
#include "testutil.h"

namespace {

namespace hd = bytecomp::compress::hd;
using bctest::bc::make_compressor;
using bctest::bc::parse_compressor_spec;

struct Buf {
  std::vector<std::byte> bytes;
  uint32_t params_len() const { return get<uint32_t>(8); }
  uint64_t count() const { return get<uint64_t>(16); }
  const std::byte* params() const { return bytes.data() + 32; }
  const std::byte* payload() const { return bytes.data() + 32 + params_len(); }
  size_t payload_len() const { return bytes.size() - 32 - params_len(); }
  template <class T>
  T get(size_t off) const {
    T v;
    std::memcpy(&v, bytes.data() + off, sizeof v);
    return v;
  }
  template <class T>
  T param(size_t off) const { return get<T>(32 + off); }
};

Buf cpu_compress(const std::string& spec, const std::vector<float>& x,
                 const bctest::bc::CompressContext& ctx = {}) {
  auto c = make_compressor(parse_compressor_spec(spec));
  auto st = c->make_state(x.size());
  return {bctest::compress(*c, *st, x, ctx)};
}

// What a CUDA packing kernel writes: lane l of a warp covering elements
// [32 w, 32 w + 32) contributes bit j of code(i) to half-word plane_half(i, bits, j).
template <class Code>
std::vector<uint32_t> ballot_pack(size_t n, uint32_t bits, const Code& code) {
  std::vector<uint32_t> halves(2 * hd::plane_words(n, bits), 0);
  size_t padded = (n + 63) / 64 * 64;
  for (size_t w = 0; w < padded / 32; ++w)
    for (uint32_t j = 0; j < bits; ++j) {
      uint32_t ballot = 0;
      for (uint32_t l = 0; l < 32; ++l) {
        size_t i = 32 * w + l;
        uint32_t c = i < n ? code(i) : 0;
        ballot |= ((c >> j) & 1u) << l;
      }
      halves[hd::plane_half(32 * w, bits, j)] = ballot;
    }
  return halves;
}

void expect_payload(const Buf& b, const std::vector<uint32_t>& halves) {
  ASSERT_EQ(b.payload_len(), 4 * halves.size());
  EXPECT_EQ(0, std::memcmp(b.payload(), halves.data(), b.payload_len()));
}

const size_t kSizes[] = {1, 31, 32, 33, 63, 64, 65, 1000, 4096 + 17, 70000};

TEST(HostDevice, Crc32MatchesBoost) {
  for (size_t n : {0, 1, 7, 32, 64, 288}) {
    std::vector<uint8_t> d(n);
    for (size_t i = 0; i < n; ++i) d[i] = static_cast<uint8_t>(i * 37 + 11);
    boost::crc_32_type crc;
    crc.process_bytes(d.data(), n);
    EXPECT_EQ(crc.checksum(), ~hd::crc32_update(0xFFFFFFFFu, d.data(), n)) << n;
  }
}

TEST(HostDevice, HeaderMatchesCpuLibrary) {
  auto x = bctest::gaussian(1000, 3);
  for (const char* spec : {"fp16", "randomk:0.01", "topk:0.02", "qsgd:16", "terngrad", "onebit",
                           "efsignsgd", "signsgd"}) {
    Buf b = cpu_compress(spec, x, {.iteration = 5, .shared_seed = 9, .private_seed = 2});
    std::vector<uint8_t> h(32 + b.params_len(), 0xAB);
    // The CUDA encoders write params in place first, then the header.
    std::memcpy(h.data() + 32, b.params(), b.params_len());
    hd::write_header(h.data(), b.get<uint8_t>(5), b.count(), h.data() + 32, b.params_len(),
                     b.params_len(), b.payload_len());
    EXPECT_EQ(0, std::memcmp(h.data(), b.bytes.data(), h.size())) << spec;
    // And from a separate parameter block (unpadded length given).
    std::vector<uint8_t> h2(32 + b.params_len(), 0xCD);
    std::vector<uint8_t> p(b.params_len());
    std::memcpy(p.data(), b.params(), p.size());
    uint32_t used = b.params_len();
    while (used > 0 && p[used - 1] == 0) --used;
    hd::write_header(h2.data(), b.get<uint8_t>(5), b.count(), p.data(), used, b.params_len(),
                     b.payload_len());
    EXPECT_EQ(0, std::memcmp(h2.data(), b.bytes.data(), h2.size())) << spec;
  }
}

TEST(HostDevice, SignBitmapBallotsMatchCpu) {
  for (size_t n : kSizes) {
    auto x = bctest::gaussian(n, static_cast<uint32_t>(n));
    if (n > 3) x[1] = -0.0f, x[2] = std::numeric_limits<float>::quiet_NaN(), x[3] = 0.0f;
    Buf b = cpu_compress("signsgd", x);
    expect_payload(b, ballot_pack(n, 1, [&](size_t i) { return hd::sign_bit(x[i]); }));
  }
}

TEST(HostDevice, QsgdCodesAndPlanesMatchCpu) {
  for (unsigned levels : {1u, 3u, 16u, 127u})
    for (size_t n : kSizes) {
      auto x = bctest::gaussian(n, static_cast<uint32_t>(n + levels));
      bctest::bc::CompressContext ctx{.iteration = 7, .private_seed = 1234};
      Buf b = cpu_compress("qsgd:levels=" + std::to_string(levels), x, ctx);
      uint32_t bits = b.param<uint32_t>(4);
      float norm = b.param<float>(8);
      ASSERT_EQ(b.param<uint32_t>(0), levels);
      float scale = norm > 0 ? static_cast<float>(levels) / norm : 0.0f;
      auto code = [&](size_t i) -> uint32_t {
        uint64_t first = i / hd::kSeedChunk * hd::kSeedChunk;
        uint32_t seed = hd::quant_chunk_seed(ctx.private_seed, ctx.iteration, hd::kQsgdSalt, first);
        float u = hd::uniform01(hd::hash32(seed, static_cast<uint32_t>(i)));
        return hd::qsgd_code(x[i], u, scale, levels, bits - 1);
      };
      SCOPED_TRACE("levels " + std::to_string(levels) + " n " + std::to_string(n));
      expect_payload(b, ballot_pack(n, bits, code));
      // Decoding element-wise from the planes gives the CPU decoder's values.
      auto c = make_compressor(parse_compressor_spec("qsgd:levels=" + std::to_string(levels)));
      auto dense = bctest::decompress(*c, b.bytes, n);
      std::vector<uint64_t> words(hd::plane_words(n, bits));
      std::memcpy(words.data(), b.payload(), 8 * words.size());
      float unit = norm / static_cast<float>(levels);
      for (size_t i = 0; i < n; ++i) {
        uint32_t cc = hd::plane_code(words.data(), i, bits);
        ASSERT_EQ(cc, code(i)) << i;
        ASSERT_EQ(hd::f2u(dense[i]), hd::f2u(hd::code_value(cc, (1u << (bits - 1)) - 1, bits - 1, unit)))
            << i;
      }
    }
}

TEST(HostDevice, TernCodesMatchCpu) {
  for (size_t n : kSizes) {
    auto x = bctest::gaussian(n, static_cast<uint32_t>(3 * n));
    bctest::bc::CompressContext ctx{.iteration = 3, .private_seed = 77};
    Buf b = cpu_compress("terngrad", x, ctx);
    float scale = b.param<float>(0);
    float inv = scale > 0 ? 1.0f / scale : 0.0f;
    expect_payload(b, ballot_pack(n, 2, [&](size_t i) -> uint32_t {
      uint64_t first = i / hd::kSeedChunk * hd::kSeedChunk;
      uint32_t seed = hd::quant_chunk_seed(ctx.private_seed, ctx.iteration, hd::kTernSalt, first);
      return hd::tern_code(x[i], hd::uniform01(hd::hash32(seed, static_cast<uint32_t>(i))), scale, inv);
    }));
  }
}

TEST(HostDevice, RandomkIndicesMatchCpu) {
  for (size_t n : {1, 2, 100, 1000, 100003}) {
    auto x = bctest::gaussian(n, static_cast<uint32_t>(n));
    bctest::bc::CompressContext ctx{.iteration = 11, .shared_seed = 0xfeed};
    Buf b = cpu_compress("randomk:0.05,ef=false", x, ctx);
    uint64_t seed = b.param<uint64_t>(0), k = b.param<uint64_t>(8);
    EXPECT_EQ(seed, hd::randomk_seed(ctx.shared_seed, ctx.iteration));
    EXPECT_EQ(k, hd::sparse_k(n, 0.05));
    for (uint64_t i = 0; i < k; ++i) {
      uint64_t j = hd::randomk_index(seed, i, n, k);
      ASSERT_LT(j, n);
      float v;
      std::memcpy(&v, b.payload() + 4 * i, 4);
      ASSERT_EQ(hd::f2u(v), hd::f2u(x[j])) << i;
      if (i > 0) {
        ASSERT_GT(j, hd::randomk_index(seed, i - 1, n, k));
      }
    }
  }
  // Beyond 32-bit element indices the mapping stays in range and ordered.
  uint64_t n = (uint64_t{1} << 33) + 5, k = n / 1000;
  uint64_t prev = 0;
  for (uint64_t i : {uint64_t{0}, uint64_t{1}, k / 2, k / 2 + 1, k - 2, k - 1}) {
    uint64_t j = hd::randomk_index(42, i, n, k);
    EXPECT_LT(j, n);
    EXPECT_GE(j, hd::randomk_lo(i, n, k));
    EXPECT_LT(j, hd::randomk_lo(i + 1, n, k));
    if (i > 0) {
      EXPECT_GT(j, prev);
    }
    prev = j;
  }
}

TEST(HostDevice, RadixDigitsRebuildTheKey) {
  for (uint32_t key : {0u, 1u, 0x7fffffffu, 0x3f800000u, 0x7f800000u, 0x12345678u}) {
    uint32_t rebuilt = 0;
    for (int p = 0; p < hd::kRadixPasses; ++p) {
      ASSERT_LT(hd::radix_digit(key, p), hd::radix_buckets(p));
      rebuilt |= hd::radix_digit(key, p) << hd::radix_shift(p);
      EXPECT_TRUE(hd::radix_prefix_matches(key, rebuilt, p));
      EXPECT_FALSE(p > 0 && hd::radix_prefix_matches(key ^ (1u << 30), rebuilt, p));
    }
    EXPECT_EQ(rebuilt, key);
  }
  EXPECT_EQ(hd::abs_key(-2.0f), hd::abs_key(2.0f));
  EXPECT_LT(hd::abs_key(1.0f), hd::abs_key(-1.5f));
  EXPECT_LT(hd::abs_key(std::numeric_limits<float>::infinity()),
            hd::abs_key(std::numeric_limits<float>::quiet_NaN()));
}

TEST(HostDevice, SelectBucketAgreesWithPerBucketTest) {
  std::vector<uint32_t> h(2048, 0);
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint32_t>((i * 7919) % 5);
  uint32_t total = 0;
  for (auto c : h) total += c;
  for (uint32_t need : {1u, 2u, 3u, total / 2, total - 1, total}) {
    uint32_t above = 0;
    uint32_t t = hd::select_bucket<uint32_t>(h.data(), 2048, need, &above);
    uint32_t suffix = 0;
    int hits = 0;
    for (int b = 2047; b >= 0; --b) {  // what the CUDA select does, one bucket per thread
      if (hd::bucket_holds_rank<uint32_t>(suffix, h[static_cast<size_t>(b)], need)) {
        ++hits;
        EXPECT_EQ(static_cast<uint32_t>(b), t);
        EXPECT_EQ(suffix, above);
      }
      suffix += h[static_cast<size_t>(b)];
    }
    EXPECT_EQ(hits, 1) << need;
  }
}

// The CUDA topk: three histogram passes over the keys that match the prefix
// so far, a per-bucket select after each, then the picks are every key above
// the threshold and the first `need` equal to it in index order.
std::vector<uint32_t> radix_topk(const std::vector<float>& x, size_t k) {
  uint32_t prefix = 0;
  uint64_t need = k;
  for (int p = 0; p < hd::kRadixPasses; ++p) {
    std::vector<uint64_t> hist(hd::radix_buckets(p), 0);
    for (float f : x)
      if (hd::radix_prefix_matches(hd::abs_key(f), prefix, p)) ++hist[hd::radix_digit(hd::abs_key(f), p)];
    uint64_t suffix = 0;
    for (uint32_t b = hd::radix_buckets(p); b-- > 0;) {
      if (hd::bucket_holds_rank<uint64_t>(suffix, hist[b], need)) {
        prefix |= b << hd::radix_shift(p);
        need -= suffix;
        break;
      }
      suffix += hist[b];
    }
  }
  std::vector<uint32_t> idx;
  uint64_t eq = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    uint32_t key = hd::abs_key(x[i]);
    if (key > prefix || (key == prefix && eq++ < need)) idx.push_back(static_cast<uint32_t>(i));
  }
  return idx;
}

TEST(HostDevice, RadixTopkMatchesCpuTopkWithTies) {
  for (size_t n : {1, 2, 65, 1000, 70001}) {
    auto x = bctest::gaussian(n, static_cast<uint32_t>(n));
    for (size_t i = 0; i < n; i += 3) x[i] = (i % 2 ? -0.5f : 0.5f);  // many ties
    for (double ratio : {0.001, 0.01, 0.3, 1.0}) {
      Buf b = cpu_compress("topk:" + std::to_string(ratio) + ",ef=false", x);
      uint64_t k = b.param<uint64_t>(0);
      ASSERT_EQ(k, hd::sparse_k(n, ratio));
      auto idx = radix_topk(x, k);
      ASSERT_EQ(idx.size(), k);
      EXPECT_EQ(0, std::memcmp(idx.data(), b.payload(), 4 * k)) << n << " " << ratio;
    }
  }
}

TEST(HostDevice, HalfConversionsMatchCpuVectorPath) {
  std::vector<float> x = bctest::gaussian(4096, 5);
  const uint32_t specials[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00001u,
                               0xffbfffffu, 0x00000001u, 0x33800000u, 0x33000001u, 0x387fc000u,
                               0x38800000u, 0x477fefffu, 0x477ff000u, 0x3f801000u, 0x3f803000u,
                               0x3f808000u, 0x3f818000u, 0x7f7fffffu};
  for (size_t i = 0; i < std::size(specials); ++i) x[i] = hd::u2f(specials[i]);
  for (size_t i = 0; i < 1024; ++i) x[100 + i] = hd::u2f(static_cast<uint32_t>(i) * 0x3fffdu);
  for (const char* spec : {"fp16", "bf16"}) {
    Buf b = cpu_compress(spec, x);
    bool bf = std::string(spec) == "bf16";
    for (size_t i = 0; i < x.size(); ++i) {
      uint16_t h = b.get<uint16_t>(32 + 2 * i);
      ASSERT_EQ(h, bf ? hd::fp32_to_bf16_bits(x[i]) : hd::fp32_to_fp16_bits(x[i])) << spec << " " << i;
    }
    auto c = make_compressor(parse_compressor_spec(spec));
    auto dense = bctest::decompress(*c, b.bytes, x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      uint16_t h = b.get<uint16_t>(32 + 2 * i);
      ASSERT_EQ(hd::f2u(dense[i]), hd::f2u(bf ? hd::bf16_bits_to_fp32(h) : hd::fp16_bits_to_fp32(h)));
    }
  }
}

TEST(HostDevice, SizesMatchCompressorBounds) {
  for (size_t n : {0, 1, 99, 100000}) {
    auto topk = make_compressor(parse_compressor_spec("topk:0.01"));
    EXPECT_EQ(topk->max_compressed_bytes(n), 32 + 8 + 8 * hd::sparse_k(n, 0.01));
    auto dgc = make_compressor(parse_compressor_spec("dgc:0.01,warmup_iters=3"));
    EXPECT_EQ(dgc->max_compressed_bytes(n), 32 + 8 + 8 * hd::dgc_max_k(n, 0.01, 3));
  }
  EXPECT_EQ(hd::dgc_ratio_at(0.001, 10, 0), 0.25);
  EXPECT_EQ(hd::dgc_ratio_at(0.001, 10, 35), 0.004);
  EXPECT_EQ(hd::dgc_ratio_at(0.001, 10, 40), 0.001);
  EXPECT_EQ(hd::dgc_ratio_at(0.5, 10, 15), 0.5);
}

}  // namespace

namespace {

// The factory's device hook, on any machine (no GPU needed).
TEST(DeviceFactory, DispatchesByDevice) {
  namespace bc = bytecomp::compress;
  using bytecomp::Error;
  using bytecomp::ErrorCode;
  auto spec = bc::parse_compressor_spec("topk:0.02");
  auto c = bc::make_compressor(spec, bc::Device::kCpu);
  EXPECT_EQ(c->spec(), bc::make_compressor(spec)->spec());
  try {
    bc::make_compressor(bc::CompressorSpec{"nope", {}}, bc::Device::kCuda);
    ADD_FAILURE() << "unknown name accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("unknown compressor 'nope'"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(bc::cuda::supported("nope"));
  for (const auto& info : bc::list_compressors()) {
    SCOPED_TRACE(info.name);
    EXPECT_EQ(bc::cuda::supported(info.name), bc::cuda::built());
    bc::CompressorSpec s{info.name, {}};
    if (!bc::cuda::built()) {
      EXPECT_THROW(bc::make_compressor(s, bc::Device::kCuda), Error);
      continue;
    }
    auto g = bc::make_compressor(s, bc::Device::kCuda);
    auto cpu = bc::make_compressor(s);
    EXPECT_EQ(g->spec(), cpu->spec());
    EXPECT_EQ(g->additive(), cpu->additive());
    EXPECT_EQ(g->deterministic_size(), cpu->deterministic_size());
    for (size_t n : {0, 1, 1000, 25000000})
      EXPECT_EQ(g->max_compressed_bytes(n), cpu->max_compressed_bytes(n));
    // A CPU tensor is refused before any CUDA call, naming the device.
    std::vector<float> x(10, 1.0f);
    std::vector<std::byte> out(g->max_compressed_bytes(10));
    auto st = cpu->make_state(10);
    try {
      g->compress(bc::ConstTensorView::cpu(x.data(), 10), out, *st, {});
      ADD_FAILURE() << "cpu tensor accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("accepted: cuda"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
