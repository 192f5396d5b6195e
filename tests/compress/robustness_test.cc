// Decoder robustness: truncated, extended, bit-flipped and forged buffers get
// Error(kMalformed) and leave the output untouched, or decode to finite-size
// garbage; never a crash or an out-of-bounds access. CI also runs this binary
// under AddressSanitizer + UndefinedBehaviorSanitizer (scripts/test).
#include <gtest/gtest.h>

#include <boost/crc.hpp>

#include <cstring>
#include <random>

#include "testutil.h"

using namespace bctest;
using bytecomp::Error;
using bytecomp::ErrorCode;

namespace {

constexpr size_t kHeader = 32;

size_t header_and_params(const std::vector<std::byte>& b) {
  uint32_t plen;
  std::memcpy(&plen, b.data() + 8, 4);
  return kHeader + plen;
}

void fix_crc(std::vector<std::byte>& b) {
  size_t hp = header_and_params(b);
  if (hp > b.size()) return;
  std::memset(b.data() + 12, 0, 4);
  boost::crc_32_type crc;
  crc.process_bytes(b.data(), hp);
  uint32_t v = crc.checksum();
  std::memcpy(b.data() + 12, &v, 4);
}

// Decodes `buf`; returns true when accepted. A rejection must be kMalformed
// and leave `out` as it was.
bool try_decode(const bc::Compressor& c, std::span<const std::byte> buf, size_t n, bool accumulate) {
  std::vector<float> out(n, 3.0f);
  try {
    c.decompress(buf, bc::TensorView::cpu(out.data(), n), accumulate, {});
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kMalformed) << e.what();
    EXPECT_NE(std::string(e.what()).find("compressed buffer rejected"), std::string::npos);
    for (float v : out) EXPECT_EQ(v, 3.0f);
    return false;
  }
  return true;
}

class Robust : public ::testing::TestWithParam<std::string> {};

TEST_P(Robust, TruncatedAndExtendedBuffersAreRejected) {
  auto c = bc::make_compressor(bc::parse_compressor_spec(GetParam()));
  std::mt19937 rng(1);
  for (size_t n : {0ul, 1ul, 100ul, 5000ul}) {
    auto x = gaussian(n, 2);
    auto st = c->make_state(n);
    auto b = compress(*c, *st, x, {.iteration = 1, .shared_seed = 2});
    ASSERT_TRUE(try_decode(*c, b, n, false));
    std::vector<size_t> lens;
    if (b.size() <= 2048) {
      for (size_t l = 0; l < b.size(); ++l) lens.push_back(l);
    } else {
      for (size_t l = 0; l < 100; ++l) lens.push_back(l);
      for (int i = 0; i < 200; ++i) lens.push_back(rng() % b.size());
      lens.push_back(b.size() - 1);
    }
    for (size_t l : lens) {
      // A fresh allocation of exactly l bytes, so ASan sees any overread.
      std::vector<std::byte> t(b.begin(), b.begin() + static_cast<long>(l));
      EXPECT_FALSE(try_decode(*c, t, n, l % 2 == 0)) << GetParam() << " n=" << n << " len=" << l;
    }
    for (size_t extra : {1ul, 7ul, 8ul, 100ul}) {
      std::vector<std::byte> t = b;
      t.resize(b.size() + extra, std::byte{0});
      EXPECT_FALSE(try_decode(*c, t, n, false)) << GetParam() << " extra=" << extra;
    }
  }
}

TEST_P(Robust, BitFlipsAreRejectedOrHarmless) {
  auto c = bc::make_compressor(bc::parse_compressor_spec(GetParam()));
  std::mt19937 rng(3);
  const size_t n = 3000;
  auto x = gaussian(n, 4);
  auto st = c->make_state(n);
  auto b = compress(*c, *st, x, {.iteration = 5, .shared_seed = 6});
  size_t hp = header_and_params(b);
  size_t header_rejected = 0, header_flips = 0;
  for (int trial = 0; trial < 600; ++trial) {
    std::vector<std::byte> t = b;
    int flips = 1 + static_cast<int>(rng() % 3);
    bool in_header = trial % 2 == 0;  // half the trials aim at header + params
    for (int f = 0; f < flips; ++f) {
      size_t pos = in_header ? rng() % hp : rng() % t.size();
      t[pos] ^= std::byte{static_cast<unsigned char>(1u << (rng() % 8))};
    }
    bool accepted = try_decode(*c, t, n, trial % 3 == 0);
    if (in_header && t != b) {
      ++header_flips;
      header_rejected += !accepted;
    }
  }
  // The header checksum catches every corruption of header and parameters.
  EXPECT_EQ(header_rejected, header_flips);
}

TEST_P(Robust, ForgedHeadersWithValidChecksumAreRejectedOrHarmless) {
  auto c = bc::make_compressor(bc::parse_compressor_spec(GetParam()));
  std::mt19937_64 rng(5);
  const size_t n = 2000;
  auto x = gaussian(n, 6);
  auto st = c->make_state(n);
  auto b = compress(*c, *st, x, {.iteration = 2});
  size_t hp = header_and_params(b);
  size_t accepted = 0;
  for (int trial = 0; trial < 1500; ++trial) {
    std::vector<std::byte> t = b;
    // Rewrite a field with a hostile value and re-sign the header, so only
    // the decoder's own checks stand between the value and memory.
    size_t pos = rng() % hp;
    if (pos >= 12 && pos < 16) pos = 16 + rng() % 16;
    switch (rng() % 4) {
      case 0: t[pos] = std::byte{static_cast<unsigned char>(rng())}; break;
      case 1: {  // a 64-bit or 32-bit field at an 8/4-aligned spot: extremes
        uint64_t v = rng() % 2 ? ~uint64_t{0} : (uint64_t{1} << (rng() % 64));
        size_t at = pos & ~size_t{3};
        std::memcpy(t.data() + at, &v, std::min<size_t>(at + 8 <= hp ? 8 : 4, hp - at));
        break;
      }
      case 2: {  // a plausible small count or k
        uint64_t v = rng() % (2 * n + 2);
        size_t at = pos < kHeader ? 16 : (pos & ~size_t{7});
        std::memcpy(t.data() + at, &v, std::min<size_t>(8, hp - at));
        break;
      }
      default: {  // random bytes over the whole parameter block
        for (size_t i = kHeader; i < hp; ++i) t[i] = std::byte{static_cast<unsigned char>(rng())};
        break;
      }
    }
    fix_crc(t);
    uint64_t count;
    std::memcpy(&count, t.data() + 16, 8);
    size_t out_n = count <= 4 * n ? count : n;
    accepted += try_decode(*c, t, out_n, trial % 2 == 0);
    if (c->additive()) {  // aggregate() reads the same fields
      std::vector<std::byte> agg(c->max_compressed_bytes(out_n));
      std::vector<std::span<const std::byte>> ins{b, t};
      if (trial % 2) ins = {t, t};
      try {
        c->aggregate(ins, agg, {});
      } catch (const Error& e) {
        EXPECT_TRUE(e.code() == ErrorCode::kMalformed || e.code() == ErrorCode::kInvalidArgument)
            << e.what();
      }
    }
  }
  // Some forgeries are harmless (e.g. a different norm); most are not.
  EXPECT_LT(accepted, 1500u);
}

TEST_P(Robust, RandomGarbageIsRejected) {
  auto c = bc::make_compressor(bc::parse_compressor_spec(GetParam()));
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<std::byte> t(rng() % 512);
    for (auto& byte : t) byte = std::byte{static_cast<unsigned char>(rng())};
    if (t.size() >= 8 && trial % 2) std::memcpy(t.data(), "BCZP\x01", 5);  // get past the magic
    EXPECT_FALSE(try_decode(*c, t, 100, false));
  }
}

INSTANTIATE_TEST_SUITE_P(Compress, Robust, ::testing::ValuesIn(all_specs()),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (auto& ch : s)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return s;
                         });

}  // namespace
