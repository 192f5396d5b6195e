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
// Outputs the caller will not read again soon (decode_not_reread) of at
// least this many elements are written with non-temporal stores: 1 MiB, an L2.
constexpr size_t kStreamElems = size_t{1} << 18;

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
    return run(n, out, ctx, [&](size_t b, size_t e, float*) -> const float* {
      if (m == nullptr) return x + b;
      k_momentum(x + b, m + b, momentum_, e - b);
      return m + b;
    }, nullptr);
  }

  size_t encode_ef(const float* g, size_t n, float beta, Residual& res, TensorState& st,
                   std::byte* out, const CompressContext& ctx) const override {
    if (v_ == Variant::kSignum) return Base::encode_ef(g, n, beta, res, st, out, ctx);
    return run(n, out, ctx, [&](size_t b, size_t e, float*) -> const float* {
      apply_lazy(g, beta, res, b, e);
      return res.r.data() + b;
    }, &res);
  }

  void decode(const Parsed& p, float* out, Mode mode, ThreadPool* pool) const override {
    const Levels l = levels(p);
    for_chunks(pool, p.count, [&](size_t, size_t b, size_t e) {
      unpack_signs(l.words + b / 8, e - b, l.pos, l.neg, out + b, mode);
    });
  }

  // Past the L2, an output nobody reads soon costs a read of every line
  // before it is written, unless written with non-temporal stores.
  void decode_not_reread(const Parsed& p, float* out, ThreadPool* pool) const override {
    if (p.count < kStreamElems) return decode(p, out, Mode::kSet, pool);
    const Levels l = levels(p);
    for_chunks(pool, p.count, [&](size_t, size_t b, size_t e) {
      unpack_signs_stream(l.words + b / 8, e - b, l.pos, l.neg, out + b);
    });
  }

  // A server's sum of the nodes' sign buffers, recompressed: each sub-block
  // is decoded and summed into a stack buffer (L1) and encoded from there,
  // the same kernels on the same ranges as decode-all-then-encode, so the
  // same bits; signum's momentum variant has no sum form (its server
  // recompressor is the plain sign).
  bool fused_sum() const override { return v_ != Variant::kSignum; }
  void check_parsed(const Parsed& p) const override { (void)levels(p); }

  size_t encode_sum(std::span<const Parsed> in, size_t n, std::byte* out, TensorState&,
                    const CompressContext& ctx) const override {
    const std::vector<Levels> ls = all_levels(in);
    return run(n, out, ctx, [&](size_t b, size_t e, float* tmp) -> const float* {
      sum_block(ls, b, e, tmp);
      return tmp;
    }, nullptr);
  }

  size_t encode_sum_ef(std::span<const Parsed> in, size_t n, float beta, Residual& res,
                       TensorState&, std::byte* out, const CompressContext& ctx) const override {
    const std::vector<Levels> ls = all_levels(in);
    return run(n, out, ctx, [&](size_t b, size_t e, float* tmp) -> const float* {
      sum_block(ls, b, e, tmp);
      apply_lazy_block(tmp, beta, res, b, e);
      return res.r.data() + b;
    }, &res);
  }

 private:
  // A checked buffer's bitmap and the two values its bits decode to.
  struct Levels {
    const std::byte* words;
    float pos, neg;
  };

  Levels levels(const Parsed& p) const {
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
    return {p.payload.data(), pos, neg};
  }
  std::vector<Levels> all_levels(std::span<const Parsed> in) const {
    std::vector<Levels> ls;
    ls.reserve(in.size());
    for (const Parsed& p : in) ls.push_back(levels(p));
    return ls;
  }
  // tmp[0, e - b) = the sum over the inputs of their decoded [b, e), first
  // set, then added in order (b is a multiple of 64: whole bitmap words).
  static void sum_block(const std::vector<Levels>& ls, size_t b, size_t e, float* tmp) {
    for (size_t i = 0; i < ls.size(); ++i)
      unpack_signs(ls[i].words + b / 8, e - b, ls[i].pos, ls[i].neg, tmp,
                   i == 0 ? Mode::kSet : Mode::kAdd);
  }

  // prepare(b, e, scratch) makes the values of [b, e) ready and returns
  // where they are (element b first); scratch is kSub floats of this
  // thread's stack it may use. The signs and statistics are taken from there.
  template <class Prepare>
  size_t run(size_t n, std::byte* out, const CompressContext& ctx, const Prepare& prepare,
             Residual* res) const {
    std::byte* payload = out + kHeaderBytes + pad8(params_bytes());
    std::vector<ChunkStats> stats(num_chunks(n));
    for_chunks(ctx.pool, n, [&](size_t c, size_t cb, size_t ce) {
      ChunkStats s;
      alignas(64) float scratch[kSub];
      for (size_t b = cb; b < ce; b += kSub) {
        size_t e = std::min(ce, b + kSub);
        const float* src = prepare(b, e, scratch);
        if (v_ == Variant::kScaled) {
          s.abs_sum += k_abs_sum(src, e - b);
        } else if (v_ == Variant::kOneBit) {
          float ps, qs;
          uint32_t cnt;
          k_pos_neg(src, e - b, &ps, &qs, &cnt);
          s.pos_sum += ps;
          s.neg_sum += qs;
          s.neg_cnt += cnt;
        }
        pack_signs(src, e - b, payload + b / 8);
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
