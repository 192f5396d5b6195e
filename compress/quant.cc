// Stochastic quantisers: qsgd (s levels of the L2 norm) and terngrad
// (ternary after 2.5-sigma clipping). Codes are bit-plane packed (internal.h);
// rounding noise comes from a counter-based hash of (private seed, iteration,
// element index), so results do not depend on the number of threads.
#include <bit>
#include <cmath>

#include "compress/internal.h"
#include "compress/simd.h"

namespace bytecomp::compress::detail {
namespace {

constexpr size_t kSub = 4096;  // elements per codes buffer (on the stack)

uint32_t chunk_seed(const CompressContext& ctx, uint64_t salt, size_t first_index) {
  // A chunk never crosses a 2^32 boundary, so the high index bits are folded
  // into the seed and the hash works on the low 32 bits.
  return hd::quant_chunk_seed(ctx.private_seed, ctx.iteration, salt, first_index);
}

using namespace simd;

BC_CLONES float k_sumsq(const float* x, size_t n) {
  v8f a0 = {}, a1 = {};
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v8f v, w;
    BC_V8_LOAD(v, x + i);
    BC_V8_LOAD(w, x + i + 8);
    a0 += v * v;
    a1 += w * w;
  }
  v8f t = a0 + a1;
  float s = hsum(t);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

BC_CLONES void k_moments(const float* x, size_t n, float* sum, float* sumsq, float* maxabs) {
  v8f a = {}, b = {}, m = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    v8f v;
    BC_V8_LOAD(v, x + i);
    a += v;
    b += v * v;
    v8f f = BC_V8_ABS(v);
    m = f > m ? f : m;
  }
  float s = hsum(a), q = hsum(b), mx = hmax(m);
  for (; i < n; ++i) {
    s += x[i];
    q += x[i] * x[i];
    mx = std::max(mx, std::fabs(x[i]));
  }
  *sum = s;
  *sumsq = q;
  *maxabs = mx;
}

// level = floor(|x| * scale + u), u ~ U[0,1): unbiased, <= levels.
BC_CLONES void k_qsgd_codes(const float* x, size_t n, uint32_t seed, uint32_t first, float scale,
                            uint32_t levels, uint32_t sign_shift, uint8_t* codes) {
  for (size_t i = 0; i < n; ++i) {
    float u = uniform01(hash32(seed, first + static_cast<uint32_t>(i)));
    codes[i] = hd::qsgd_code(x[i], u, scale, levels, sign_shift);
  }
}

// nonzero with probability min(|x|, scale) / scale; code = nz | sign << 1.
BC_CLONES void k_tern_codes(const float* x, size_t n, uint32_t seed, uint32_t first, float scale,
                            float inv, uint8_t* codes) {
  for (size_t i = 0; i < n; ++i) {
    float u = uniform01(hash32(seed, first + static_cast<uint32_t>(i)));
    codes[i] = hd::tern_code(x[i], u, scale, inv);
  }
}

// code -> value: (code & lmask) * unit, negated when bit `shift` is set.
template <Mode M>
inline void codes_to_float(const uint8_t* c, size_t n, uint32_t lmask, uint32_t shift, float unit,
                           float* out) {
  for (size_t i = 0; i < n; ++i) {
    float v = hd::code_value(c[i], lmask, shift, unit);
    if constexpr (M == Mode::kSet) out[i] = v;
    else if constexpr (M == Mode::kAdd) out[i] += v;
    else out[i] -= v;
  }
}
BC_CLONES void k_codes_set(const uint8_t* c, size_t n, uint32_t m, uint32_t s, float u, float* o) {
  codes_to_float<Mode::kSet>(c, n, m, s, u, o);
}
BC_CLONES void k_codes_add(const uint8_t* c, size_t n, uint32_t m, uint32_t s, float u, float* o) {
  codes_to_float<Mode::kAdd>(c, n, m, s, u, o);
}
BC_CLONES void k_codes_sub(const uint8_t* c, size_t n, uint32_t m, uint32_t s, float u, float* o) {
  codes_to_float<Mode::kSub>(c, n, m, s, u, o);
}

void decode_codes(const std::byte* words, size_t n, unsigned bits, float unit, float* out, Mode mode,
                  ThreadPool* pool) {
  uint32_t lmask = (1u << (bits - 1)) - 1, shift = bits - 1;
  for_chunks(pool, n, [&](size_t, size_t cb, size_t ce) {
    alignas(64) uint8_t codes[kSub];
    for (size_t b = cb; b < ce; b += kSub) {
      size_t e = std::min(ce, b + kSub);
      unpack_planes(words + (b / 64) * bits * 8, e - b, bits, codes);
      if (mode == Mode::kSet) k_codes_set(codes, e - b, lmask, shift, unit, out + b);
      else if (mode == Mode::kAdd) k_codes_add(codes, e - b, lmask, shift, unit, out + b);
      else k_codes_sub(codes, e - b, lmask, shift, unit, out + b);
    }
  });
}

void check_payload(const char* algo, const Parsed& p, unsigned bits) {
  size_t want = plane_words(p.count, bits) * 8;
  if (p.payload.size() != want)
    malformed(std::string(algo) + " payload is " + std::to_string(p.payload.size()) + " bytes for " +
              std::to_string(p.count) + " elements (expected " + std::to_string(want) + ")");
}

class Qsgd final : public Base {
 public:
  Qsgd(CompressorSpec s, unsigned levels)
      : Base(std::move(s), Algo::kQsgd), levels_(levels), bits_(1 + std::bit_width(levels)) {}

  static constexpr size_t kParams = 12;  // u32 levels, u32 bits, f32 norm
  size_t max_compressed_bytes(size_t n) const override {
    return kHeaderBytes + pad8(kParams) + plane_words(n, bits_) * 8;
  }
  bool additive() const override { return false; }
  bool deterministic_size() const override { return true; }

  size_t encode(const float* x, size_t n, std::byte* out, TensorState&,
                const CompressContext& ctx) const override {
    std::vector<double> part(num_chunks(n));
    for_chunks(ctx.pool, n, [&](size_t c, size_t b, size_t e) { part[c] = k_sumsq(x + b, e - b); });
    double ss = 0;
    for (double p : part) ss += p;
    float norm = static_cast<float>(std::sqrt(ss));
    float scale = norm > 0 ? static_cast<float>(levels_) / norm : 0.0f;
    std::byte* payload = out + kHeaderBytes + pad8(kParams);
    for_chunks(ctx.pool, n, [&](size_t, size_t cb, size_t ce) {
      uint32_t seed = chunk_seed(ctx, hd::kQsgdSalt, cb);
      alignas(64) uint8_t codes[kSub];
      for (size_t b = cb; b < ce; b += kSub) {
        size_t e = std::min(ce, b + kSub);
        k_qsgd_codes(x + b, e - b, seed, static_cast<uint32_t>(b), scale, levels_, bits_ - 1, codes);
        pack_planes(codes, e - b, bits_, payload + (b / 64) * bits_ * 8);
      }
    });
    ParamWriter pw;
    pw.put<uint32_t>(levels_).put<uint32_t>(bits_).put<float>(norm);
    return write_wire({out, max_compressed_bytes(n)}, algo(), n, pw.bytes(),
                      plane_words(n, bits_) * 8);
  }

  void decode(const Parsed& p, float* out, Mode mode, ThreadPool* pool) const override {
    ParamReader pr(p.params, kParams, "qsgd");
    uint32_t levels = pr.get<uint32_t>(), bits = pr.get<uint32_t>();
    float norm = pr.get<float>();
    if (levels < 1 || levels > 127 || bits != 1 + std::bit_width(levels))
      malformed("qsgd levels " + std::to_string(levels) + " with " + std::to_string(bits) +
                " bits per element (accepted: levels 1..127, bits = 1 + bit width of levels)");
    check_payload("qsgd", p, bits);
    decode_codes(p.payload.data(), p.count, bits, norm / static_cast<float>(levels), out, mode, pool);
  }

 private:
  uint32_t levels_;
  uint32_t bits_;
};

class TernGrad final : public Base {
 public:
  explicit TernGrad(CompressorSpec s) : Base(std::move(s), Algo::kTernGrad) {}

  size_t max_compressed_bytes(size_t n) const override {
    return kHeaderBytes + 8 + plane_words(n, 2) * 8;
  }
  bool additive() const override { return false; }
  bool deterministic_size() const override { return true; }

  size_t encode(const float* x, size_t n, std::byte* out, TensorState&,
                const CompressContext& ctx) const override {
    struct M {
      double sum = 0, sumsq = 0;
      float maxabs = 0;
    };
    std::vector<M> part(num_chunks(n));
    for_chunks(ctx.pool, n, [&](size_t c, size_t b, size_t e) {
      float s, q, m;
      k_moments(x + b, e - b, &s, &q, &m);
      part[c] = {s, q, m};
    });
    M t;
    for (const auto& p : part) {
      t.sum += p.sum;
      t.sumsq += p.sumsq;
      t.maxabs = std::max(t.maxabs, p.maxabs);
    }
    double mean = n ? t.sum / static_cast<double>(n) : 0.0;
    double var = n ? std::max(0.0, t.sumsq / static_cast<double>(n) - mean * mean) : 0.0;
    float clip = static_cast<float>(2.5 * std::sqrt(var));
    float scale = clip > 0 ? std::min(t.maxabs, clip) : t.maxabs;
    float inv = scale > 0 ? 1.0f / scale : 0.0f;
    std::byte* payload = out + kHeaderBytes + 8;
    for_chunks(ctx.pool, n, [&](size_t, size_t cb, size_t ce) {
      uint32_t seed = chunk_seed(ctx, hd::kTernSalt, cb);
      alignas(64) uint8_t codes[kSub];
      for (size_t b = cb; b < ce; b += kSub) {
        size_t e = std::min(ce, b + kSub);
        k_tern_codes(x + b, e - b, seed, static_cast<uint32_t>(b), scale, inv, codes);
        pack_planes(codes, e - b, 2, payload + (b / 64) * 2 * 8);
      }
    });
    ParamWriter pw;
    pw.put<float>(scale);
    return write_wire({out, max_compressed_bytes(n)}, algo(), n, pw.bytes(), plane_words(n, 2) * 8);
  }

  void decode(const Parsed& p, float* out, Mode mode, ThreadPool* pool) const override {
    ParamReader pr(p.params, 4, "terngrad");
    float scale = pr.get<float>();
    check_payload("terngrad", p, 2);
    decode_codes(p.payload.data(), p.count, 2, scale, out, mode, pool);
  }
};

}  // namespace

std::unique_ptr<Base> make_qsgd(CompressorSpec s, unsigned levels) {
  return std::make_unique<Qsgd>(std::move(s), levels);
}
std::unique_ptr<Base> make_terngrad(CompressorSpec s) { return std::make_unique<TernGrad>(std::move(s)); }

}  // namespace bytecomp::compress::detail
