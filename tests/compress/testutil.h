// Helpers shared by the compress test binaries.
#pragma once

#include <random>
#include <vector>

#include "compress/catalogue.h"
#include "compress/compressor.h"

namespace bctest {

namespace bc = bytecomp::compress;

inline std::vector<float> gaussian(size_t n, uint32_t seed, float sigma = 1.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

inline std::vector<float> uniform(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

inline std::vector<std::byte> compress(const bc::Compressor& c, bc::TensorState& st,
                                       const std::vector<float>& x,
                                       const bc::CompressContext& ctx = {}) {
  std::vector<std::byte> buf(c.max_compressed_bytes(x.size()));
  size_t len = c.compress(bc::ConstTensorView::cpu(x.data(), x.size()), buf, st, ctx);
  EXPECT_LE(len, buf.size());
  buf.resize(len);
  return buf;
}

inline std::vector<float> decompress(const bc::Compressor& c, const std::vector<std::byte>& b,
                                     size_t n, const bc::CompressContext& ctx = {}) {
  std::vector<float> out(n, 12345.0f);
  c.decompress(b, bc::TensorView::cpu(out.data(), n), false, ctx);
  return out;
}

// Every compressor at a typical setting, plus error-feedback variants.
// Hand-picked settings, plus the defaults of every catalogue compressor not
// named here (so a new one is covered without editing this list).
inline std::vector<std::string> all_specs() {
  std::vector<std::string> s = {
      "fp16", "bf16", "randomk:0.01", "randomk:0.05,ef=false", "topk:0.01", "topk:0.1,ef=false",
      "dgc:0.01", "dgc:0.05,warmup_iters=2", "signsgd", "signsgd:ef=true", "signum",
      "efsignsgd", "onebit", "qsgd:levels=16", "qsgd:levels=3,ef=true", "qsgd:127", "terngrad",
      "terngrad:ef=true", "fp16:ef=true"};
  for (const auto& e : bytecomp::compress::catalogue()) {
    bool named = false;
    for (const auto& t : s) named = named || t.substr(0, t.find(':')) == e.name;
    if (!named) s.emplace_back(e.name);
  }
  return s;
}

}  // namespace bctest
