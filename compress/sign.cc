// The sign family: signsgd, signum (sign of momentum), efsignsgd's scaled sign
// and onebit (sign + means of both halves). One bit per element; "negative"
// means the sign bit is set, so the encoder and the lazy residual update agree
// on -0.0 and NaN.
#include <cmath>

#include "compress/internal.h"
#include "compress/simd.h"

namespace bytecomp::compress::detail {
namespace {

enum class Variant { kSign, kSignum, kScaled, kOneBit };

struct ChunkStats {
  double abs_sum = 0, pos_sum = 0, neg_sum = 0;
  uint64_t neg_cnt = 0;
};

using namespace simd;

BC_CLONES float k_abs_sum(const float* x, size_t n) {
  v8f a0 = {}, a1 = {};
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v8f v, w;
    BC_V8_LOAD(v, x + i);
    BC_V8_LOAD(w, x + i + 8);
    a0 += BC_V8_ABS(v);
    a1 += BC_V8_ABS(w);
  }
  v8f t = a0 + a1;
  float s = hsum(t);
  for (; i < n; ++i) s += std::fabs(x[i]);
  return s;
}

// Sums of the non-negative and negative parts (by sign bit) and the count of
// negatives, from plain sums: pos = (sum + |sum|) / 2 per element.
BC_CLONES void k_pos_neg(const float* x, size_t n, float* pos, float* neg, uint32_t* negcnt) {
  v8f s = {}, a = {};
  v8u c = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    v8f v;
    BC_V8_LOAD(v, x + i);
    s += v;
    a += BC_V8_ABS(v);
    c += reinterpret_cast<v8u>(v) >> 31;
  }
  float ss = hsum(s), as = hsum(a);
  uint32_t cs = 0;
  for (int l = 0; l < 8; ++l) cs += c[l];
  for (; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, 4);
    ss += x[i];
    as += std::fabs(x[i]);
    cs += u >> 31;
  }
  *pos = 0.5f * (ss + as);
  *neg = 0.5f * (ss - as);
  *negcnt = cs;
}

BC_CLONES void k_momentum(const float* __restrict g, float* __restrict m, float beta, size_t n) {
  for (size_t i = 0; i < n; ++i) m[i] = beta * m[i] + (1.0f - beta) * g[i];
}

// Sub-blocks keep each element in L1 between the update and the packing.
constexpr size_t kSub = 4096;

class Sign final : public Base {
 public:
  Sign(CompressorSpec s, Algo a, Variant v, float momentum)
      : Base(std::move(s), a), v_(v), momentum_(momentum) {}

  size_t params_bytes() const {
    return v_ == Variant::kScaled ? 4 : v_ == Variant::kOneBit ? 8 : 0;
  }
  size_t payload_bytes(size_t n) const { return (n + 63) / 64 * 8; }
  size_t max_compressed_bytes(size_t n) const override {
    return kHeaderBytes + pad8(params_bytes()) + payload_bytes(n);
  }
  bool additive() const override { return false; }
  bool deterministic_size() const override { return true; }

  std::unique_ptr<TensorState> new_state(size_t n) const override {
    if (v_ == Variant::kSignum) return std::make_unique<VectorState>(n, 1, false, algo());
    return std::make_unique<EmptyState>(n);
  }

  size_t encode(const float* x, size_t n, std::byte* out, TensorState& st,
                const CompressContext& ctx) const override {
    float* m = nullptr;
    if (v_ == Variant::kSignum) m = state_as<VectorState>(st, name()).data(0);
    return run(x, n, out, ctx, [&](size_t b, size_t e) -> const float* {
      if (m == nullptr) return x;
      k_momentum(x + b, m + b, momentum_, e - b);
      return m;
    }, nullptr);
  }

  size_t encode_ef(const float* g, size_t n, float beta, Residual& res, TensorState& st,
                   std::byte* out, const CompressContext& ctx) const override {
    if (v_ == Variant::kSignum) return Base::encode_ef(g, n, beta, res, st, out, ctx);
    return run(g, n, out, ctx, [&](size_t b, size_t e) -> const float* {
      apply_lazy(g, beta, res, b, e);
      return res.r.data();
    }, &res);
  }

  void decode(const Parsed& p, float* out, Mode mode, ThreadPool* pool) const override {
    ParamReader pr(p.params, params_bytes(), algo_name(algo()));
    float pos = 1.0f, neg = -1.0f;
    if (v_ == Variant::kScaled) {
      pos = pr.get<float>();
      neg = -pos;
    } else if (v_ == Variant::kOneBit) {
      pos = pr.get<float>();
      neg = pr.get<float>();
    }
    if (p.payload.size() != payload_bytes(p.count))
      malformed(std::string(algo_name(algo())) + " payload is " + std::to_string(p.payload.size()) +
                " bytes for " + std::to_string(p.count) + " elements (expected " +
                std::to_string(payload_bytes(p.count)) + ")");
    const std::byte* w = p.payload.data();
    for_chunks(pool, p.count, [&](size_t, size_t b, size_t e) {
      unpack_signs(w + b / 8, e - b, pos, neg, out + b, mode);
    });
  }

 private:
  // prepare(b, e) makes the values of [b, e) ready and returns the array they
  // are in; the signs and statistics are then taken from it.
  template <class Prepare>
  size_t run(const float*, size_t n, std::byte* out, const CompressContext& ctx,
             const Prepare& prepare, Residual* res) const {
    std::byte* payload = out + kHeaderBytes + pad8(params_bytes());
    std::vector<ChunkStats> stats(num_chunks(n));
    for_chunks(ctx.pool, n, [&](size_t c, size_t cb, size_t ce) {
      ChunkStats s;
      for (size_t b = cb; b < ce; b += kSub) {
        size_t e = std::min(ce, b + kSub);
        const float* src = prepare(b, e);
        if (v_ == Variant::kScaled) {
          s.abs_sum += k_abs_sum(src + b, e - b);
        } else if (v_ == Variant::kOneBit) {
          float ps, qs;
          uint32_t cnt;
          k_pos_neg(src + b, e - b, &ps, &qs, &cnt);
          s.pos_sum += ps;
          s.neg_sum += qs;
          s.neg_cnt += cnt;
        }
        pack_signs(src + b, e - b, payload + b / 8);
      }
      stats[c] = s;
    });
    ChunkStats t;
    for (const auto& s : stats) {
      t.abs_sum += s.abs_sum;
      t.pos_sum += s.pos_sum;
      t.neg_sum += s.neg_sum;
      t.neg_cnt += s.neg_cnt;
    }
    ParamWriter pw;
    float pos = 1.0f, neg = -1.0f;
    if (v_ == Variant::kScaled) {
      pos = n ? static_cast<float>(t.abs_sum / static_cast<double>(n)) : 0.0f;
      neg = -pos;
      pw.put(pos);
    } else if (v_ == Variant::kOneBit) {
      uint64_t pos_cnt = n - t.neg_cnt;
      pos = pos_cnt ? static_cast<float>(t.pos_sum / static_cast<double>(pos_cnt)) : 0.0f;
      neg = t.neg_cnt ? static_cast<float>(t.neg_sum / static_cast<double>(t.neg_cnt)) : 0.0f;
      pw.put(pos).put(neg);
    }
    if (res != nullptr) {  // residual = p - decoded(p), settled lazily
      res->lazy = true;
      res->pos = pos;
      res->neg = neg;
    }
    return write_wire({out, max_compressed_bytes(n)}, algo(), n, pw.bytes(), payload_bytes(n));
  }

  Variant v_;
  float momentum_;
};

}  // namespace

std::unique_ptr<Base> make_signsgd(CompressorSpec s) {
  return std::make_unique<Sign>(std::move(s), Algo::kSignSgd, Variant::kSign, 0.0f);
}
std::unique_ptr<Base> make_signum(CompressorSpec s, double momentum) {
  return std::make_unique<Sign>(std::move(s), Algo::kSignum, Variant::kSignum,
                                static_cast<float>(momentum));
}
std::unique_ptr<Base> make_signum_for_sum(CompressorSpec s) {
  return std::make_unique<Sign>(std::move(s), Algo::kSignum, Variant::kSign, 0.0f);
}
std::unique_ptr<Base> make_scaledsign(CompressorSpec s) {
  return std::make_unique<Sign>(std::move(s), Algo::kEfSignSgd, Variant::kScaled, 0.0f);
}
std::unique_ptr<Base> make_onebit(CompressorSpec s) {
  return std::make_unique<Sign>(std::move(s), Algo::kOneBit, Variant::kOneBit, 0.0f);
}

}  // namespace bytecomp::compress::detail
