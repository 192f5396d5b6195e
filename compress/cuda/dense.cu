// CUDA compressors, dense family (issue 27 split of compressors.cu): fp16/bf16
// casts, randomk, the sign family (signsgd, signum, efsignsgd, onebit) and
// qsgd/terngrad -- kernels, the encoder (which hands topk/dgc to sparse.cu)
// and the decoder. Kernel families as described in compressors.cu.
#include "compress/cuda/internal.cuh"

namespace bytecomp::compress::cuda::impl {
namespace {

// --- casts -------------------------------------------------------------------------

template <bool BF>
__device__ __forceinline__ uint16_t to_half(float f) {
  return BF ? hd::fp32_to_bf16_bits(f) : hd::fp32_to_fp16_bits(f);
}
template <bool BF>
__device__ __forceinline__ float from_half(uint16_t h) {
  return BF ? hd::bf16_bits_to_fp32(h) : hd::fp16_bits_to_fp32(h);
}

// EF: p = g + beta r; h = cast(p); r = p - uncast(h) (the CPU wrapper's
// generic update, fused).
template <bool BF, bool EF>
__global__ void k_cast(const float* __restrict g, float* __restrict r, float beta,
                       uint16_t* __restrict out, uint64_t n) {
  for (uint64_t i = gtid(); i < n; i += gstride()) {
    float p = g[i];
    if (EF) p = g[i] + beta * r[i];
    uint16_t h = to_half<BF>(p);
    out[i] = h;
    if (EF) r[i] = p - from_half<BF>(h);
  }
}

template <bool BF>
__global__ void k_uncast(const uint16_t* __restrict h, float* __restrict out, uint64_t n, bool add) {
  for (uint64_t i = gtid(); i < n; i += gstride()) {
    float v = from_half<BF>(h[i]);
    out[i] = add ? out[i] + v : v;
  }
}

// --- randomk -------------------------------------------------------------------------

__global__ void k_add_scaled(const float* __restrict g, float* __restrict r, float beta, uint64_t n) {
  for (uint64_t i = gtid(); i < n; i += gstride()) r[i] = g[i] + beta * r[i];
}

// vals[i] = src[index(i)]; with `zero` the pick is cleared there (the EF
// residual keeps what was not sent).
__global__ void k_randomk_gather(const float* src, float* zero, float* __restrict vals, uint64_t seed,
                                 uint64_t n, uint64_t k) {
  for (uint64_t i = gtid(); i < k; i += gstride()) {
    uint64_t j = hd::randomk_index(seed, i, n, k);
    vals[i] = src[j];
    if (zero != nullptr) zero[j] = 0.0f;
  }
}

// Indices are distinct: no two threads touch the same element.
__global__ void k_randomk_scatter(const float* __restrict vals, float* __restrict out, uint64_t seed,
                                  uint64_t n, uint64_t k, bool add) {
  for (uint64_t i = gtid(); i < k; i += gstride()) {
    uint64_t j = hd::randomk_index(seed, i, n, k);
    out[j] = add ? out[j] + vals[i] : vals[i];
  }
}

// --- sign family ---------------------------------------------------------------------

enum class SignVar : int { kSign = 0, kSignum = 1, kScaled = 2, kOneBit = 3 };



template <SignVar V, bool EF>
__global__ void k_sign(const float* __restrict g, float* __restrict st, float beta, float momentum,
                       const Lazy* lazy, uint32_t* __restrict words, SignPartial* part, uint64_t n) {
  __shared__ double sh[kThreads];
  double a = 0, b = 0;
  unsigned long long c = 0;
  uint64_t padded = padded64(n);
  Lazy lz = EF ? *lazy : Lazy{0, 0, 0};
  for (uint64_t i = gtid(); i < padded; i += gstride()) {
    float v = 0.0f;
    bool in = i < n;
    if (in) {
      if (EF) {
        float r = st[i];
        if (lz.lazy) r = r - (hd::sign_bit(r) ? lz.neg : lz.pos);
        v = g[i] + beta * r;
        st[i] = v;
      } else if (V == SignVar::kSignum) {
        v = momentum * st[i] + (1.0f - momentum) * g[i];
        st[i] = v;
      } else {
        v = g[i];
      }
      if (V == SignVar::kScaled) a += fabsf(v);
      if (V == SignVar::kOneBit) {
        if (hd::sign_bit(v)) b += v, ++c;
        else a += v;
      }
    }
    uint32_t ballot = __ballot_sync(0xffffffffu, in && hd::sign_bit(v));
    if ((threadIdx.x & 31) == 0) words[i / 32] = ballot;
  }
  if (V == SignVar::kScaled || V == SignVar::kOneBit) {
    double ta = block_sum(a, sh), tb = block_sum(b, sh), tc = block_sum(static_cast<double>(c), sh);
    if (threadIdx.x == 0) part[blockIdx.x] = {ta, tb, static_cast<unsigned long long>(tc)};
  }
}

// Sums the partials in block order, writes params (at out + 32), header and
// the lazy residual scalars.
template <SignVar V>
__global__ void k_sign_finish(const SignPartial* part, int parts, uint64_t n, uint8_t* out,
                              HeaderArgs h, Lazy* lazy) {
  if (threadIdx.x != 0) return;
  double a = 0, b = 0;
  unsigned long long c = 0;
  if (V == SignVar::kScaled || V == SignVar::kOneBit)
    for (int i = 0; i < parts; ++i) a += part[i].a, b += part[i].b, c += part[i].c;
  float pos = 1.0f, neg = -1.0f;
  if (V == SignVar::kScaled) {
    pos = n ? static_cast<float>(a / static_cast<double>(n)) : 0.0f;
    neg = -pos;
    hd::put_le(out + 32, hd::f2u(pos), 4);
  } else if (V == SignVar::kOneBit) {
    uint64_t pos_cnt = n - c;
    pos = pos_cnt ? static_cast<float>(a / static_cast<double>(pos_cnt)) : 0.0f;
    neg = c ? static_cast<float>(b / static_cast<double>(c)) : 0.0f;
    hd::put_le(out + 32, hd::f2u(pos), 4);
    hd::put_le(out + 36, hd::f2u(neg), 4);
  }
  if (lazy != nullptr) *lazy = {1, pos, neg};
  hd::write_header(out, h.algo, h.count, out + 32, h.params_len, h.params_padded, h.payload_len);
}

__global__ void k_unsign(const uint64_t* __restrict words, float pos, float neg, float* __restrict out,
                         uint64_t n, bool add) {
  for (uint64_t i = gtid(); i < n; i += gstride()) {
    float v = (words[i / 64] >> (i % 64)) & 1u ? neg : pos;
    out[i] = add ? out[i] + v : v;
  }
}

// Dense residual of a lazy state (copy_residual).
__global__ void k_settle(const float* __restrict r, const Lazy* lazy, float* __restrict out, uint64_t n) {
  Lazy lz = *lazy;
  for (uint64_t i = gtid(); i < n; i += gstride())
    out[i] = lz.lazy ? r[i] - (hd::sign_bit(r[i]) ? lz.neg : lz.pos) : r[i];
}

// --- qsgd / terngrad --------------------------------------------------------------------


template <bool EF>
__global__ void k_moments(const float* __restrict g, float* __restrict r, float beta, uint64_t n,
                          QuantPartial* part) {
  __shared__ double sh[kThreads];
  __shared__ float shf[kThreads];
  float s = 0, q = 0, m = 0;
  for (uint64_t i = gtid(); i < n; i += gstride()) {
    float v = g[i];
    if (EF) {
      v = g[i] + beta * r[i];
      r[i] = v;
    }
    s += v;
    q += v * v;
    m = fmaxf(m, fabsf(v));
  }
  double ts = block_sum(s, sh), tq = block_sum(q, sh);
  float tm = block_max(m, shf);
  if (threadIdx.x == 0) part[blockIdx.x] = {ts, tq, tm};
}

__global__ void k_quant_finish(const QuantPartial* part, int parts, uint64_t n, bool tern,
                               uint32_t levels, uint32_t bits, uint8_t* out, HeaderArgs h,
                               QuantScal* scal) {
  if (threadIdx.x != 0) return;
  double sum = 0, sumsq = 0;
  float maxabs = 0;
  for (int i = 0; i < parts; ++i) {
    sum += part[i].sum;
    sumsq += part[i].sumsq;
    maxabs = fmaxf(maxabs, part[i].maxabs);
  }
  if (!tern) {
    float norm = static_cast<float>(sqrt(sumsq));
    float scale = norm > 0 ? static_cast<float>(levels) / norm : 0.0f;
    *scal = {scale, 0.0f, norm / static_cast<float>(levels)};
    hd::put_le(out + 32, levels, 4);
    hd::put_le(out + 36, bits, 4);
    hd::put_le(out + 40, hd::f2u(norm), 4);
  } else {
    double mean = n ? sum / static_cast<double>(n) : 0.0;
    double var = n ? fmax(0.0, sumsq / static_cast<double>(n) - mean * mean) : 0.0;
    float clip = static_cast<float>(2.5 * sqrt(var));
    float scale = clip > 0 ? fminf(maxabs, clip) : maxabs;
    float inv = scale > 0 ? 1.0f / scale : 0.0f;
    *scal = {scale, inv, scale};
    hd::put_le(out + 32, hd::f2u(scale), 4);
  }
  hd::write_header(out, h.algo, h.count, out + 32, h.params_len, h.params_padded, h.payload_len);
}

// Codes of x (the input, or p in r with EF), packed by ballots; with EF r
// becomes p - decoded.
template <bool TERN, bool EF>
__global__ void k_codes(const float* x, float* r, uint64_t n, uint64_t private_seed, uint64_t iteration,
                        uint32_t levels, uint32_t bits, const QuantScal* scal,
                        uint32_t* __restrict halves) {
  QuantScal sc = *scal;
  uint64_t padded = padded64(n);
  uint32_t lmask = (1u << (bits - 1)) - 1, shift = bits - 1;
  for (uint64_t i = gtid(); i < padded; i += gstride()) {
    uint32_t code = 0;
    if (i < n) {
      uint64_t first = i / hd::kSeedChunk * hd::kSeedChunk;
      uint32_t seed = hd::quant_chunk_seed(private_seed, iteration, TERN ? hd::kTernSalt : hd::kQsgdSalt,
                                           first);
      float u = hd::uniform01(hd::hash32(seed, static_cast<uint32_t>(i)));
      float v = x[i];
      code = TERN ? hd::tern_code(v, u, sc.scale, sc.inv) : hd::qsgd_code(v, u, sc.scale, levels, shift);
      if (EF) r[i] = v - hd::code_value(code, lmask, shift, sc.unit);
    }
    for (uint32_t j = 0; j < bits; ++j) {
      uint32_t ballot = __ballot_sync(0xffffffffu, (code >> j) & 1u);
      if ((threadIdx.x & 31) == 0) halves[hd::plane_half(i, bits, j)] = ballot;
    }
  }
}

__global__ void k_uncode(const uint64_t* __restrict words, uint64_t n, uint32_t bits, float unit,
                         float* __restrict out, bool add) {
  uint32_t lmask = (1u << (bits - 1)) - 1, shift = bits - 1;
  for (uint64_t i = gtid(); i < n; i += gstride()) {
    float v = hd::code_value(hd::plane_code(words, i, bits), lmask, shift, unit);
    out[i] = add ? out[i] + v : v;
  }
}

}  // namespace

// --- codecs ---------------------------------------------------------------------

void CudaState::copy_residual(std::span<float> out) const {
  if (!has_residual()) TensorState::copy_residual(out);
  if (out.size() != n_)
    throw Error(ErrorCode::kInvalidArgument, "copy_residual: out has " + std::to_string(out.size()) +
                                                 " elements, state has " + std::to_string(n_));
  if (n_ == 0) return;
  DeviceGuard dg(device_);
  ck(cudaDeviceSynchronize(), "copy_residual");  // the last compress() may be on any stream
  const DevBuf& src = v.bytes() ? v : r;
  if (lazy.bytes()) {
    DevBuf tmp(n_ * sizeof(float));
    k_settle<<<grid_for(n_), kThreads>>>(src.as<float>(), lazy.as<Lazy>(), tmp.as<float>(), n_);
    ck_launch("settle");
    ck(cudaMemcpy(out.data(), tmp.as<void>(), n_ * sizeof(float), cudaMemcpyDeviceToHost), "copy_residual");
  } else {
    ck(cudaMemcpy(out.data(), src.as<void>(), n_ * sizeof(float), cudaMemcpyDeviceToHost), "copy_residual");
  }
}

size_t CudaCompressor::encode(const float* x, size_t n, std::byte* out, CudaState& st, const CompressContext& ctx,
                              cudaStream_t s) const {
  auto* o8 = reinterpret_cast<uint8_t*>(out);
  switch (algo_) {
    case Algo::kFp16:
    case Algo::kBf16: {
      auto* h = reinterpret_cast<uint16_t*>(out + kHeaderBytes);
      bool bf = algo_ == Algo::kBf16;
      float* r = st.r.as<float>();
      if (n) {
        if (bf && ef_) k_cast<true, true><<<grid_for(n), kThreads, 0, s>>>(x, r, beta_, h, n);
        else if (bf) k_cast<true, false><<<grid_for(n), kThreads, 0, s>>>(x, r, beta_, h, n);
        else if (ef_) k_cast<false, true><<<grid_for(n), kThreads, 0, s>>>(x, r, beta_, h, n);
        else k_cast<false, false><<<grid_for(n), kThreads, 0, s>>>(x, r, beta_, h, n);
        ck_launch("cast kernel");
      }
      launch_header(out, header_args(algo_, n, 0, 2 * n), s);
      return kHeaderBytes + 2 * n;
    }
    case Algo::kRandomK: {
      uint64_t seed = hd::randomk_seed(ctx.shared_seed, ctx.iteration), k = hd::sparse_k(n, ratio_);
      auto* vals = reinterpret_cast<float*>(out + kHeaderBytes + 16);
      if (n) {
        const float* src = x;
        if (ef_) {
          k_add_scaled<<<grid_for(n), kThreads, 0, s>>>(x, st.r.as<float>(), beta_, n);
          ck_launch("randomk ef");
          src = st.r.as<float>();
        }
        k_randomk_gather<<<grid_for(k), kThreads, 0, s>>>(src, ef_ ? st.r.as<float>() : nullptr, vals,
                                                          seed, n, k);
        ck_launch("randomk gather");
      }
      HeaderArgs h = header_args(algo_, n, 16, 4 * k);
      hd::put_le(h.params, seed, 8);
      hd::put_le(h.params + 8, k, 8);
      launch_header(out, h, s);
      return kHeaderBytes + 16 + 4 * k;
    }
    case Algo::kSignSgd:
    case Algo::kSignum:
    case Algo::kEfSignSgd:
    case Algo::kOneBit: {
      uint32_t pb = algo_ == Algo::kEfSignSgd ? 4 : algo_ == Algo::kOneBit ? 8 : 0;
      auto* words = reinterpret_cast<uint32_t*>(out + kHeaderBytes + pad8(pb));
      float* stv = ef_ ? st.r.as<float>() : st.m.as<float>();
      Lazy* lz = st.lazy.as<Lazy>();
      auto* part = st.part.as<SignPartial>();
      unsigned grid = grid_for(padded64(n), kStatBlocks);
      if (n) {
#define BC_SIGN(V, E) k_sign<V, E><<<grid, kThreads, 0, s>>>(x, stv, beta_, momentum_, lz, words, part, n)
        switch (algo_) {
          case Algo::kSignSgd:
            if (ef_) BC_SIGN(SignVar::kSign, true);
            else BC_SIGN(SignVar::kSign, false);
            break;
          case Algo::kSignum: BC_SIGN(SignVar::kSignum, false); break;
          case Algo::kEfSignSgd: BC_SIGN(SignVar::kScaled, true); break;
          default: BC_SIGN(SignVar::kOneBit, true); break;
        }
#undef BC_SIGN
        ck_launch("sign kernel");
      }
      uint64_t payload = (n + 63) / 64 * 8;
      HeaderArgs h = header_args(algo_, n, pb, payload);
      int parts = n ? static_cast<int>(grid) : 0;
      Lazy* lzw = ef_ ? lz : nullptr;
      if (algo_ == Algo::kEfSignSgd) k_sign_finish<SignVar::kScaled><<<1, 32, 0, s>>>(part, parts, n, o8, h, lzw);
      else if (algo_ == Algo::kOneBit) k_sign_finish<SignVar::kOneBit><<<1, 32, 0, s>>>(part, parts, n, o8, h, lzw);
      else k_sign_finish<SignVar::kSign><<<1, 32, 0, s>>>(part, parts, n, o8, h, lzw);
      ck_launch("sign finish");
      return kHeaderBytes + pad8(pb) + payload;
    }
    case Algo::kQsgd:
    case Algo::kTernGrad: {
      bool tern = algo_ == Algo::kTernGrad;
      uint32_t bits = tern ? 2 : bits_, plen = tern ? 4 : 12;
      uint64_t payload = hd::plane_words(n, bits) * 8;
      auto* halves = reinterpret_cast<uint32_t*>(out + kHeaderBytes + pad8(plen));
      auto* part = st.part.as<QuantPartial>();
      auto* scal = st.scal.as<QuantScal>();
      float* r = st.r.as<float>();
      unsigned sgrid = grid_for(n, kStatBlocks);
      if (n) {
        if (ef_) k_moments<true><<<sgrid, kThreads, 0, s>>>(x, r, beta_, n, part);
        else k_moments<false><<<sgrid, kThreads, 0, s>>>(x, r, beta_, n, part);
        ck_launch("moments kernel");
      }
      k_quant_finish<<<1, 32, 0, s>>>(part, n ? static_cast<int>(sgrid) : 0, n, tern, levels_, bits, o8,
                                      header_args(algo_, n, plen, payload), scal);
      ck_launch("quant finish");
      if (n) {
        const float* src = ef_ ? r : x;
        unsigned cgrid = grid_for(padded64(n));
#define BC_CODES(T, E) \
k_codes<T, E><<<cgrid, kThreads, 0, s>>>(src, r, n, ctx.private_seed, ctx.iteration, levels_, bits, scal, halves)
        if (tern && ef_) BC_CODES(true, true);
        else if (tern) BC_CODES(true, false);
        else if (ef_) BC_CODES(false, true);
        else BC_CODES(false, false);
#undef BC_CODES
        ck_launch("codes kernel");
      }
      return kHeaderBytes + pad8(plen) + payload;
    }
    case Algo::kTopK: return encode_topk(x, n, out, st, s);
    case Algo::kDgc: return encode_dgc(x, n, out, st, ctx, s);
  }
  throw Error(ErrorCode::kInternal, "cuda compressor: unknown algorithm");
}

void CudaCompressor::decode(const detail::Parsed& p, const std::byte* payload, unsigned long long bad, float* out,
                            bool add, cudaStream_t s) const {
  uint64_t n = p.count;
  std::string elems = std::to_string(n) + " elements";
  switch (algo_) {
    case Algo::kFp16:
    case Algo::kBf16: {
      expect_params(p, 0);
      expect_payload(p, 2 * n, elems);
      if (!n) return;
      auto* h = reinterpret_cast<const uint16_t*>(payload);
      if (algo_ == Algo::kBf16) k_uncast<true><<<grid_for(n), kThreads, 0, s>>>(h, out, n, add);
      else k_uncast<false><<<grid_for(n), kThreads, 0, s>>>(h, out, n, add);
      ck_launch("uncast kernel");
      return;
    }
    case Algo::kRandomK: {
      expect_params(p, 16);
      uint64_t seed = param<uint64_t>(p, 0), k = param<uint64_t>(p, 8);
      if (k > n || (k == 0 && n != 0))
        malformed("randomk k = " + std::to_string(k) + " for " + elems + " (accepted: 1..count)");
      expect_payload(p, 4 * k, "k = " + std::to_string(k));
      if (!n) return;
      if (!add) ck(cudaMemsetAsync(out, 0, n * sizeof(float), s), "randomk decode");
      k_randomk_scatter<<<grid_for(k), kThreads, 0, s>>>(reinterpret_cast<const float*>(payload), out, seed,
                                                         n, k, add);
      ck_launch("randomk scatter");
      return;
    }
    case Algo::kTopK:
    case Algo::kDgc:
      decode_sparse(p, payload, bad, out, add, s);
      return;
    case Algo::kSignSgd:
    case Algo::kSignum:
    case Algo::kEfSignSgd:
    case Algo::kOneBit: {
      size_t pb = algo_ == Algo::kEfSignSgd ? 4 : algo_ == Algo::kOneBit ? 8 : 0;
      expect_params(p, pb);
      float pos = 1.0f, neg = -1.0f;
      if (algo_ == Algo::kEfSignSgd) pos = param<float>(p, 0), neg = -pos;
      if (algo_ == Algo::kOneBit) pos = param<float>(p, 0), neg = param<float>(p, 4);
      expect_payload(p, (n + 63) / 64 * 8, elems);
      if (!n) return;
      k_unsign<<<grid_for(n), kThreads, 0, s>>>(reinterpret_cast<const uint64_t*>(payload), pos, neg, out, n, add);
      ck_launch("unsign kernel");
      return;
    }
    case Algo::kQsgd:
    case Algo::kTernGrad: {
      uint32_t bits = 2;
      float unit;
      if (algo_ == Algo::kQsgd) {
        expect_params(p, 12);
        uint32_t levels = param<uint32_t>(p, 0);
        bits = param<uint32_t>(p, 4);
        if (levels < 1 || levels > 127 || bits != 1 + static_cast<uint32_t>(std::bit_width(levels)))
          malformed("qsgd levels " + std::to_string(levels) + " with " + std::to_string(bits) +
                    " bits per element (accepted: levels 1..127, bits = 1 + bit width of levels)");
        unit = param<float>(p, 8) / static_cast<float>(levels);
      } else {
        expect_params(p, 4);
        unit = param<float>(p, 0);
      }
      expect_payload(p, hd::plane_words(n, bits) * 8, elems);
      if (!n) return;
      k_uncode<<<grid_for(n), kThreads, 0, s>>>(reinterpret_cast<const uint64_t*>(payload), n, bits, unit, out,
                                                add);
      ck_launch("uncode kernel");
      return;
    }
  }
}

}  // namespace bytecomp::compress::cuda::impl
