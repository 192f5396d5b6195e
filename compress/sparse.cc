// Sparsifiers: randomk (shared-seed indices, values only on the wire), exact
// topk, and DGC. topk/dgc payload: k strictly increasing u32 indices, then k
// f32 values; the decoder checks the order and range of every index before it
// writes anything.
#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>

#include "compress/internal.h"
#include "compress/simd.h"

namespace bytecomp::compress::detail {
namespace {

__extension__ typedef unsigned __int128 u128;

constexpr size_t kSub = 4096;
constexpr uint64_t kMaxIndexed = 0xffffffffull;  // u32 indices on the wire

void check_indexed(const std::string& name, size_t n) {
  if (n > kMaxIndexed)
    throw Error(ErrorCode::kInvalidArgument,
                "compress: '" + name + "' sends 32-bit indices; " + std::to_string(n) +
                    " elements is too many (split the tensor into partitions)");
}

// --- shared sparse payload (topk, dgc) ---------------------------------------


void decode_sparse(const char* algo, const Parsed& p, float* out, Mode mode, ThreadPool* pool) {
  ParamReader pr(p.params, 8, algo);
  uint64_t k = pr.get<uint64_t>();
  if (k > p.count)
    malformed(std::string(algo) + " sends " + std::to_string(k) + " elements of " +
              std::to_string(p.count));
  if (p.payload.size() != 8 * k)
    malformed(std::string(algo) + " payload is " + std::to_string(p.payload.size()) +
              " bytes for k = " + std::to_string(k) + " (expected " + std::to_string(8 * k) + ")");
  const std::byte* ip = p.payload.data();
  const std::byte* vp = ip + 4 * k;
  uint64_t prev = 0;
  for (uint64_t j = 0; j < k; ++j) {
    uint64_t i = load<uint32_t>(ip + 4 * j);
    if (i >= p.count || (j > 0 && i <= prev))
      malformed(std::string(algo) + " index #" + std::to_string(j) + " = " + std::to_string(i) +
                (i >= p.count ? " is out of range (count " + std::to_string(p.count) + ")"
                              : " is not above the previous index " + std::to_string(prev)));
    prev = i;
  }
  if (mode == Mode::kSet)
    for_chunks(pool, p.count, [&](size_t, size_t b, size_t e) {
      std::memset(out + b, 0, (e - b) * sizeof(float));
    });
  float sign = mode == Mode::kSub ? -1.0f : 1.0f;
  for_chunks(pool, k, [&](size_t, size_t b, size_t e) {
    for (size_t j = b; j < e; ++j) out[load<uint32_t>(ip + 4 * j)] += sign * load<float>(vp + 4 * j);
  });
}

// Writes the payload for sorted `idx`, taking values from v and, when
// `zero` is set, clearing them there (the residual / DGC masking).
size_t write_sparse(std::byte* out, Algo algo, size_t n, const std::vector<uint32_t>& idx,
                    float* v, float* zero2, bool zero, ThreadPool* pool) {
  size_t k = idx.size();
  std::byte* ip = out + kHeaderBytes + 8;
  std::byte* vp = ip + 4 * k;
  if (k) std::memcpy(ip, idx.data(), 4 * k);
  for_chunks(pool, k, [&](size_t, size_t b, size_t e) {
    for (size_t j = b; j < e; ++j) {
      uint32_t i = idx[j];
      store<float>(vp + 4 * j, v[i]);
      if (zero) v[i] = 0.0f;
      if (zero2) zero2[i] = 0.0f;
    }
  });
  ParamWriter pw;
  pw.put<uint64_t>(k);
  return write_wire({out, sparse_bytes(k)}, algo, n, pw.bytes(), 8 * k);
}

// --- randomk -------------------------------------------------------------------

class RandomK final : public Base {
 public:
  RandomK(CompressorSpec s, double ratio) : Base(std::move(s), Algo::kRandomK), ratio_(ratio) {}

  size_t max_compressed_bytes(size_t n) const override {
    return kHeaderBytes + 16 + 4 * k_of(n, ratio_);
  }
  bool additive() const override { return true; }
  bool deterministic_size() const override { return true; }

  // The seed -> index mapping is shared with the CUDA kernels (compress/hd.h).
  static uint64_t seed_of(const CompressContext& ctx) {
    return hd::randomk_seed(ctx.shared_seed, ctx.iteration);
  }
  static uint64_t lo(uint64_t i, uint64_t n, uint64_t k) { return hd::randomk_lo(i, n, k); }
  static uint64_t index(uint64_t seed, uint64_t i, uint64_t n, uint64_t k) {
    return hd::randomk_index(seed, i, n, k);
  }

  size_t encode(const float* x, size_t n, std::byte* out, TensorState&,
                const CompressContext& ctx) const override {
    uint64_t seed = seed_of(ctx), k = k_of(n, ratio_);
    std::byte* vp = out + kHeaderBytes + 16;
    for_chunks(ctx.pool, k, [&](size_t, size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) store<float>(vp + 4 * i, x[index(seed, i, n, k)]);
    });
    return finish(out, n, seed, k);
  }

  size_t encode_ef(const float* g, size_t n, float beta, Residual& res, TensorState&,
                   std::byte* out, const CompressContext& ctx) const override {
    uint64_t seed = seed_of(ctx), k = k_of(n, ratio_);
    std::byte* vp = out + kHeaderBytes + 16;
    float* r = res.r.data();
    // One pass: p = g + beta * r into r, then, while that block is in cache,
    // send and clear the picked elements that fall inside it.
    for_chunks(ctx.pool, n, [&](size_t, size_t cb, size_t ce) {
      for (size_t b = cb; b < ce; b += kSub) {
        size_t e = std::min(ce, b + kSub);
        apply_lazy(g, beta, res, b, e);
        uint64_t i = static_cast<uint64_t>(static_cast<u128>(b) * k / n);
        i = i > 0 ? i - 1 : 0;
        for (; i < k && lo(i, n, k) < e; ++i) {
          uint64_t j = index(seed, i, n, k);
          if (j < b || j >= e) continue;
          store<float>(vp + 4 * i, r[j]);
          r[j] = 0.0f;
        }
      }
    });
    return finish(out, n, seed, k);
  }

  size_t finish(std::byte* out, size_t n, uint64_t seed, uint64_t k) const {
    ParamWriter pw;
    pw.put<uint64_t>(seed).put<uint64_t>(k);
    return write_wire({out, max_compressed_bytes(n)}, algo(), n, pw.bytes(), 4 * k);
  }

  struct Info {
    uint64_t seed, k;
  };
  static Info check(const Parsed& p) {
    ParamReader pr(p.params, 16, "randomk");
    Info in{pr.get<uint64_t>(), pr.get<uint64_t>()};
    if (in.k > p.count || (in.k == 0 && p.count != 0))
      malformed("randomk k = " + std::to_string(in.k) + " for " + std::to_string(p.count) +
                " elements (accepted: 1..count)");
    if (p.payload.size() != 4 * in.k)
      malformed("randomk payload is " + std::to_string(p.payload.size()) + " bytes for k = " +
                std::to_string(in.k) + " (expected " + std::to_string(4 * in.k) + ")");
    return in;
  }

  void decode(const Parsed& p, float* out, Mode mode, ThreadPool* pool) const override {
    Info in = check(p);
    size_t n = p.count;
    const std::byte* vp = p.payload.data();
    if (mode == Mode::kSet) {
      // Zero each block and drop in its picks while it is in cache: one pass.
      for_chunks(pool, n, [&](size_t, size_t cb, size_t ce) {
        for (size_t b = cb; b < ce; b += kSub) {
          size_t e = std::min(ce, b + kSub);
          std::memset(out + b, 0, (e - b) * sizeof(float));
          uint64_t i = static_cast<uint64_t>(static_cast<u128>(b) * in.k / n);
          i = i > 0 ? i - 1 : 0;
          for (; i < in.k && lo(i, n, in.k) < e; ++i) {
            uint64_t j = index(in.seed, i, n, in.k);
            if (j >= b && j < e) out[j] = load<float>(vp + 4 * i);
          }
        }
      });
      return;
    }
    float sign = mode == Mode::kSub ? -1.0f : 1.0f;
    for_chunks(pool, in.k, [&](size_t, size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) out[index(in.seed, i, n, in.k)] += sign * load<float>(vp + 4 * i);
    });
  }

  size_t aggregate(std::span<const std::span<const std::byte>> inputs, std::span<std::byte> out,
                   const CompressContext& ctx) const override {
    if (inputs.empty()) throw Error(ErrorCode::kInvalidArgument, "aggregate: no inputs");
    std::vector<Parsed> ps;
    Info first{};
    for (size_t j = 0; j < inputs.size(); ++j) {
      Parsed p = parse_own(inputs[j], j == 0 ? parse_wire(inputs[j]).count : ps[0].count);
      Info in = check(p);
      if (j == 0) first = in;
      else if (in.seed != first.seed || in.k != first.k)
        malformed("randomk input #" + std::to_string(j) +
                  " was made with a different seed or k (another iteration or tensor?)");
      ps.push_back(p);
    }
    size_t n = ps[0].count;
    // k comes from the inputs, which may have been made with another ratio.
    size_t need = kHeaderBytes + 16 + 4 * first.k;
    if (out.size() < need)
      throw Error(ErrorCode::kInvalidArgument, "aggregate: output buffer of " +
                                                   std::to_string(out.size()) + " bytes, the sum needs " +
                                                   std::to_string(need));
    if (reinterpret_cast<uintptr_t>(out.data()) % 8 != 0)
      throw Error(ErrorCode::kInvalidArgument, "aggregate: output must be 8-byte aligned");
    std::byte* vp = out.data() + kHeaderBytes + 16;
    for_chunks(ctx.pool, first.k, [&](size_t, size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) {
        float s = 0;
        for (const auto& p : ps) s += load<float>(p.payload.data() + 4 * i);
        store<float>(vp + 4 * i, s);
      }
    });
    ParamWriter pw;
    pw.put<uint64_t>(first.seed).put<uint64_t>(first.k);
    return write_wire(out, algo(), n, pw.bytes(), 4 * first.k);
  }

 private:
  double ratio_;
};

// --- exact topk --------------------------------------------------------------------

constexpr unsigned kBucketShift = 19;  // 4096 buckets of |x|'s top bits
constexpr size_t kBuckets = size_t{1} << (31 - kBucketShift);

inline uint32_t key_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u & 0x7fffffffu;
}

// Keeps the `need` best of `items` under the strict total order `better`,
// in their current (index) order: one selection on a copy finds the
// cutoff, one pass keeps what is not worse than it. Sorting the picks back
// into index order instead was the largest serial step of topk and dgc.
template <class T, class Better>
void keep_best_in_order(std::vector<T>& items, size_t need, const Better& better) {
  if (need >= items.size()) return;
  if (need == 0) {
    items.clear();
    return;
  }
  std::vector<T> tmp(items);
  std::nth_element(tmp.begin(), tmp.begin() + static_cast<ptrdiff_t>(need) - 1, tmp.end(), better);
  const T cutoff = tmp[need - 1];
  size_t w = 0;
  for (const T& x : items)
    if (!better(cutoff, x)) items[w++] = x;
  items.resize(w);
}

BC_CLONES void k_hist(const float* x, size_t n, uint32_t* h) {
  for (size_t i = 0; i < n; ++i) ++h[key_of(x[i]) >> kBucketShift];
}

// Sorted indices of the k largest |v| (ties: lower index), exact. prepare(b, e)
// makes v[b, e) ready first (the error-feedback add), fused into the
// histogram pass.
template <class Prepare>
std::vector<uint32_t> select_topk(const float* v, size_t n, size_t k, ThreadPool* pool,
                                  const Prepare& prepare) {
  size_t chunks = num_chunks(n);
  // Each chunk zeroes its own histogram: the pages are touched (and the
  // 16 KiB per chunk cleared) on the pool's threads, not serially here.
  std::unique_ptr<uint32_t[]> hist(new uint32_t[chunks * kBuckets]);
  // Small index ranges (buckets, chunks) over the pool.
  auto par = [pool](size_t count, size_t min_chunk, const std::function<void(size_t, size_t)>& f) {
    if (pool == nullptr || pool->concurrency() < 2) f(0, count);
    else pool->parallel_for(count, min_chunk, f);
  };
  for_chunks(pool, n, [&](size_t c, size_t cb, size_t ce) {
    uint32_t* h = hist.get() + c * kBuckets;
    std::fill(h, h + kBuckets, 0u);
    for (size_t b = cb; b < ce; b += kSub) {
      size_t e = std::min(ce, b + kSub);
      prepare(b, e);
      k_hist(v + b, e - b, h);
    }
  });
  std::vector<uint64_t> total(kBuckets, 0);
  par(kBuckets, 512, [&](size_t jb, size_t je) {
    for (size_t c = 0; c < chunks; ++c)
      for (size_t j = jb; j < je; ++j) total[j] += hist[c * kBuckets + j];
  });
  std::vector<uint32_t> idx;
  if (k == 0) return idx;
  uint64_t above = 0;
  size_t t = hd::select_bucket<uint64_t>(total.data(), static_cast<uint32_t>(kBuckets), k, &above);
  size_t need = k - above;
  // Offsets of each chunk's sure picks and candidates.
  std::vector<uint64_t> sure_off(chunks + 1, 0), cand_off(chunks + 1, 0);
  par(chunks, 16, [&](size_t cb, size_t ce) {
    for (size_t c = cb; c < ce; ++c) {
      const uint32_t* h = hist.get() + c * kBuckets;
      uint64_t s = 0;
      for (size_t j = t + 1; j < kBuckets; ++j) s += h[j];
      sure_off[c + 1] = s;
      cand_off[c + 1] = h[t];
    }
  });
  for (size_t c = 0; c < chunks; ++c) {
    sure_off[c + 1] += sure_off[c];
    cand_off[c + 1] += cand_off[c];
  }
  std::vector<uint32_t> sure(above);
  std::vector<uint64_t> cand(total[t]);  // (key << 32) | index
  const uint32_t tb = static_cast<uint32_t>(t);
  for_chunks(pool, n, [&](size_t c, size_t b, size_t e) {
    uint32_t* sp = sure.data() + sure_off[c];
    uint64_t* cp = cand.data() + cand_off[c];
    thread_local std::vector<uint32_t> hits(kChunk);  // see Dgc::collect
    size_t got = collect_at_least(v, b, e, tb << kBucketShift, hits.data());
    for (size_t j = 0; j < got; ++j) {
      uint32_t i = hits[j];
      uint32_t key = key_of(v[i]);
      if ((key >> kBucketShift) > tb) *sp++ = i;
      else *cp++ = (static_cast<uint64_t>(key) << 32) | i;
    }
  });
  // cand is in index order (chunks in order, each scanned in order). Larger
  // key first, then lower index: order by (key desc, index asc).
  keep_best_in_order(cand, need, [](uint64_t a, uint64_t b) {
    uint32_t ka = static_cast<uint32_t>(a >> 32), kb = static_cast<uint32_t>(b >> 32);
    return ka != kb ? ka > kb : static_cast<uint32_t>(a) < static_cast<uint32_t>(b);
  });
  for (auto& c : cand) c &= 0xffffffffull;
  idx.resize(k);
  std::merge(sure.begin(), sure.end(), cand.begin(), cand.end(), idx.begin(),
             [](uint64_t a, uint64_t b) { return a < b; });
  return idx;
}

class TopK final : public Base {
 public:
  TopK(CompressorSpec s, double ratio) : Base(std::move(s), Algo::kTopK), ratio_(ratio) {}

  size_t max_compressed_bytes(size_t n) const override { return sparse_bytes(k_of(n, ratio_)); }
  bool additive() const override { return false; }
  bool deterministic_size() const override { return true; }

  size_t encode(const float* x, size_t n, std::byte* out, TensorState&,
                const CompressContext& ctx) const override {
    check_indexed(name(), n);
    auto idx = select_topk(x, n, k_of(n, ratio_), ctx.pool, [](size_t, size_t) {});
    return write_sparse(out, algo(), n, idx, const_cast<float*>(x), nullptr, false, ctx.pool);
  }

  size_t encode_ef(const float* g, size_t n, float beta, Residual& res, TensorState&,
                   std::byte* out, const CompressContext& ctx) const override {
    check_indexed(name(), n);
    auto idx = select_topk(res.r.data(), n, k_of(n, ratio_), ctx.pool,
                           [&](size_t b, size_t e) { apply_lazy(g, beta, res, b, e); });
    res.lazy = false;
    return write_sparse(out, algo(), n, idx, res.r.data(), nullptr, true, ctx.pool);
  }

  void decode(const Parsed& p, float* out, Mode mode, ThreadPool* pool) const override {
    decode_sparse("topk", p, out, mode, pool);
  }

 private:
  double ratio_;
};

// --- DGC --------------------------------------------------------------------------

BC_CLONES void k_dgc_update(const float* __restrict g, float* __restrict u, float* __restrict v,
                            float m, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    float ui = m * u[i] + g[i];
    u[i] = ui;
    v[i] += ui;
  }
}

// What a DGC instance keeps between calls: a node keeps its momentum u and
// accumulation v (the DGC paper's momentum correction and local gradient
// accumulation); a server recompressing a sum keeps no momentum (the nodes
// applied it), only v when it has error feedback, or nothing.
enum class DgcState { kMomentumAndResidual, kResidual, kNone };

class Dgc final : public Base {
 public:
  Dgc(CompressorSpec s, double ratio, double momentum, double sample_ratio, uint64_t warmup,
      unsigned refine, DgcState state)
      : Base(std::move(s), Algo::kDgc),
        state_(state),
        ratio_(ratio),
        momentum_(static_cast<float>(momentum)),
        stride_(std::max<size_t>(1, static_cast<size_t>(std::llround(1.0 / sample_ratio)))),
        warmup_(warmup),
        refine_(refine) {}

  // Warm-up: exponentially shrinking ratios (DGC paper, section 3.3).
  double ratio_at(uint64_t iteration) const { return hd::dgc_ratio_at(ratio_, warmup_, iteration); }
  size_t max_k(size_t n) const { return hd::dgc_max_k(n, ratio_, warmup_); }

  size_t max_compressed_bytes(size_t n) const override { return sparse_bytes(max_k(n)); }
  bool additive() const override { return false; }
  bool deterministic_size() const override { return false; }

  std::unique_ptr<TensorState> new_state(size_t n) const override {
    switch (state_) {
      case DgcState::kMomentumAndResidual:
        return std::make_unique<VectorState>(n, 2, true, algo());  // u (momentum), v (accumulated)
      case DgcState::kResidual: return std::make_unique<VectorState>(n, 1, true, algo());  // v
      case DgcState::kNone: break;
    }
    return std::make_unique<EmptyState>(n);
  }

  size_t encode(const float* g, size_t n, std::byte* out, TensorState& st,
                const CompressContext& ctx) const override {
    check_indexed(name(), n);
    float* u = nullptr;
    // Without a residual the selection reads g itself and clears nothing.
    float* v = const_cast<float*>(g);
    if (state_ != DgcState::kNone) {
      auto& vs = state_as<VectorState>(st, name());
      if (state_ == DgcState::kMomentumAndResidual) {
        u = vs.data(0);
        v = vs.data(1);
      } else {
        v = vs.data(0);
      }
    }
    size_t k = k_of(n, ratio_at(ctx.iteration));
    // Pass 1: momentum correction, accumulation and strided sampling of |v|.
    std::vector<float> sample((n + stride_ - 1) / stride_);
    for_chunks(ctx.pool, n, [&](size_t, size_t cb, size_t ce) {
      for (size_t b = cb; b < ce; b += kSub) {
        size_t e = std::min(ce, b + kSub);
        if (u != nullptr) k_dgc_update(g + b, u + b, v + b, momentum_, e - b);
        else if (state_ == DgcState::kResidual) add_scaled(g, 1.0f, v, b, e);
        for (size_t i = (b + stride_ - 1) / stride_ * stride_; i < e; i += stride_)
          sample[i / stride_] = std::fabs(v[i]);
      }
    });
    std::vector<uint32_t> idx;
    if (k > 0) idx = select(v, n, k, sample, ctx.pool);
    return write_sparse(out, algo(), n, idx, v, u, state_ != DgcState::kNone, ctx.pool);
  }

  void decode(const Parsed& p, float* out, Mode mode, ThreadPool* pool) const override {
    decode_sparse("dgc", p, out, mode, pool);
  }

 private:
  std::vector<uint32_t> select(const float* v, size_t n, size_t k, std::vector<float>& sample,
                               ThreadPool* pool) const {
    size_t s = sample.size();
    auto rank_thr = [&](double rank) {  // the rank-th largest sampled magnitude
      size_t r = static_cast<size_t>(std::clamp(std::ceil(rank), 1.0, static_cast<double>(s)));
      std::nth_element(sample.begin(), sample.begin() + static_cast<ptrdiff_t>(r) - 1, sample.end(),
                       std::greater<float>());
      return sample[r - 1];
    };
    double rank = static_cast<double>(s) * static_cast<double>(k) / static_cast<double>(n);
    float thr = rank_thr(rank);
    std::vector<uint32_t> idx;
    for (unsigned attempt = 0;; ++attempt) {
      idx = collect(v, n, thr, pool);
      size_t got = idx.size();
      if (got * 10 > k * 13) return trim(v, idx, k);
      if (got * 10 >= k * 7 || attempt >= refine_ || thr <= 0.0f) return idx;
      // Too few: move down the sample in proportion, at least halfway to 0.
      rank *= static_cast<double>(k) / static_cast<double>(std::max<size_t>(got, 1));
      float next = rank_thr(rank);
      thr = next < thr ? next : thr * 0.5f;
    }
  }

  static std::vector<uint32_t> collect(const float* v, size_t n, float thr, ThreadPool* pool) {
    std::vector<std::vector<uint32_t>> part(num_chunks(n));
    uint32_t tkey = key_of(thr);
    for_chunks(pool, n, [&](size_t c, size_t b, size_t e) {
      // Per-thread scratch of one chunk: allocating it per call would cost a
      // page fault per 4 KiB, more than the scan itself.
      thread_local std::vector<uint32_t> scratch(kChunk);
      size_t got = collect_at_least(v, b, e, tkey, scratch.data());
      part[c].assign(scratch.begin(), scratch.begin() + static_cast<ptrdiff_t>(got));
    });
    std::vector<uint32_t> idx;
    for (auto& p : part) idx.insert(idx.end(), p.begin(), p.end());
    return idx;
  }

  // Exactly k of the candidates (in index order, as collect() gives them),
  // largest |v| first (ties: lower index); the result stays in index order.
  static std::vector<uint32_t> trim(const float* v, std::vector<uint32_t>& idx, size_t k) {
    keep_best_in_order(idx, k, [&](uint32_t a, uint32_t b) {
      uint32_t ka = key_of(v[a]), kb = key_of(v[b]);
      return ka != kb ? ka > kb : a < b;
    });
    return idx;
  }

  DgcState state_;
  double ratio_;
  float momentum_;
  size_t stride_;
  uint64_t warmup_;
  unsigned refine_;
};

}  // namespace

std::unique_ptr<Base> make_randomk(CompressorSpec s, double ratio) {
  return std::make_unique<RandomK>(std::move(s), ratio);
}
std::unique_ptr<Base> make_topk(CompressorSpec s, double ratio) {
  return std::make_unique<TopK>(std::move(s), ratio);
}
std::unique_ptr<Base> make_dgc(CompressorSpec s, double ratio, double momentum, double sample_ratio,
                               uint64_t warmup_iters, unsigned refine) {
  return std::make_unique<Dgc>(std::move(s), ratio, momentum, sample_ratio, warmup_iters, refine,
                               DgcState::kMomentumAndResidual);
}
std::unique_ptr<Base> make_dgc_for_sum(CompressorSpec s, double ratio, double sample_ratio,
                                       uint64_t warmup_iters, unsigned refine, bool residual) {
  return std::make_unique<Dgc>(std::move(s), ratio, 0.0, sample_ratio, warmup_iters, refine,
                               residual ? DgcState::kResidual : DgcState::kNone);
}

}  // namespace bytecomp::compress::detail
