// Bit-packing kernels shared by the sign and quantising compressors: AVX2
// versions chosen at run time, portable versions otherwise (same output).
#include <immintrin.h>

#include <cmath>

#include "compress/internal.h"
#include "compress/simd.h"

namespace bytecomp::compress::detail {
namespace {

const bool kAvx2 = cpu_has_avx2();
const bool kAvx512 = cpu_has_avx512f();

void pack_block_scalar(const uint8_t* c, unsigned bits, std::byte* w) {
  for (unsigned j = 0; j < bits; ++j) {
    uint64_t word = 0;
    for (unsigned e = 0; e < 64; ++e) word |= static_cast<uint64_t>((c[e] >> j) & 1u) << e;
    store<uint64_t>(w + 8 * j, word);
  }
}

BC_TARGET_AVX2 void pack_block_avx2(const uint8_t* c, unsigned bits, std::byte* w) {
  __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
  __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32));
  for (unsigned j = 0; j < bits; ++j) {
    // Shifting 16-bit lanes left by 7-j brings bit j of both bytes to their
    // top bit, which movemask collects.
    __m128i sh = _mm_cvtsi32_si128(static_cast<int>(7 - j));
    uint32_t lo = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_sll_epi16(a, sh)));
    uint32_t hi = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_sll_epi16(b, sh)));
    store<uint64_t>(w + 8 * j, lo | (static_cast<uint64_t>(hi) << 32));
  }
}

void unpack_block_scalar(const std::byte* w, unsigned bits, uint8_t* c) {
  for (unsigned e = 0; e < 64; ++e) c[e] = 0;
  for (unsigned j = 0; j < bits; ++j) {
    uint64_t word = load<uint64_t>(w + 8 * j);
    for (unsigned e = 0; e < 64; ++e) c[e] |= static_cast<uint8_t>(((word >> e) & 1u) << j);
  }
}

// 32 mask bits -> 32 bytes of 0xFF / 0x00.
BC_TARGET_AVX2 inline __m256i expand32(uint32_t m) {
  const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i sel = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
  __m256i x = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(m)), shuf);
  return _mm256_cmpeq_epi8(_mm256_and_si256(x, sel), sel);
}

BC_TARGET_AVX2 void unpack_block_avx2(const std::byte* w, unsigned bits, uint8_t* c) {
  __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
  for (unsigned j = 0; j < bits; ++j) {
    uint64_t word = load<uint64_t>(w + 8 * j);
    __m256i bit = _mm256_set1_epi8(static_cast<char>(1u << j));
    a = _mm256_or_si256(a, _mm256_and_si256(expand32(static_cast<uint32_t>(word)), bit));
    b = _mm256_or_si256(b, _mm256_and_si256(expand32(static_cast<uint32_t>(word >> 32)), bit));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), a);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 32), b);
}

uint64_t signs_scalar(const float* x, size_t len) {
  uint64_t w = 0;
  for (size_t e = 0; e < len; ++e) w |= static_cast<uint64_t>(std::signbit(x[e]) ? 1 : 0) << e;
  return w;
}

BC_TARGET_AVX2 uint64_t signs_avx2(const float* x) {
  uint64_t w = 0;
  for (unsigned q = 0; q < 8; ++q)
    w |= static_cast<uint64_t>(_mm256_movemask_ps(_mm256_loadu_ps(x + 8 * q))) << (8 * q);
  return w;
}

template <Mode M>
BC_TARGET_AVX2 void unpack_signs_avx2(uint64_t w, float pos, float neg, float* out) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  __m256 vp = _mm256_set1_ps(pos), vn = _mm256_set1_ps(neg);
  for (unsigned q = 0; q < 8; ++q) {
    __m256i m = _mm256_set1_epi32(static_cast<int>((w >> (8 * q)) & 0xffu));
    __m256 mask = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(m, sel), sel));
    __m256 v = _mm256_blendv_ps(vp, vn, mask);
    float* o = out + 8 * q;
    if constexpr (M == Mode::kSet) _mm256_storeu_ps(o, v);
    else if constexpr (M == Mode::kAdd) _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), v));
    else _mm256_storeu_ps(o, _mm256_sub_ps(_mm256_loadu_ps(o), v));
  }
}

// 16 mask bits select 16 lanes directly (no broadcast-and-compare as in
// AVX2); the whole range in one call, so the loop is not a call per word.
template <Mode M>
BC_TARGET_AVX512 void unpack_signs_avx512(const std::byte* words, size_t blocks, float pos,
                                          float neg, float* out) {
  const __m512 vp = _mm512_set1_ps(pos), vn = _mm512_set1_ps(neg);
  for (size_t blk = 0; blk < blocks; ++blk) {
    const uint64_t w = load<uint64_t>(words + 8 * blk);
    for (unsigned q = 0; q < 4; ++q) {
      const __m512 v = _mm512_mask_blend_ps(static_cast<__mmask16>(w >> (16 * q)), vp, vn);
      float* o = out + 64 * blk + 16 * q;
      if constexpr (M == Mode::kSet) _mm512_storeu_ps(o, v);
      else if constexpr (M == Mode::kAdd) _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), v));
      else _mm512_storeu_ps(o, _mm512_sub_ps(_mm512_loadu_ps(o), v));
    }
  }
}

// kSet with non-temporal stores: the output goes to memory without first
// being read into the cache (a plain store reads each line before writing
// it), for outputs too large to be read back from the cache anyway.
// `out` 64-byte aligned.
BC_TARGET_AVX512 void unpack_signs_stream_avx512(const std::byte* words, size_t blocks, float pos,
                                                 float neg, float* out) {
  const __m512 vp = _mm512_set1_ps(pos), vn = _mm512_set1_ps(neg);
  for (size_t blk = 0; blk < blocks; ++blk) {
    const uint64_t w = load<uint64_t>(words + 8 * blk);
    for (unsigned q = 0; q < 4; ++q)
      _mm512_stream_ps(out + 64 * blk + 16 * q,
                       _mm512_mask_blend_ps(static_cast<__mmask16>(w >> (16 * q)), vp, vn));
  }
  // Non-temporal stores are weakly ordered: make them visible before
  // whatever tells another thread or process that the output is ready.
  _mm_sfence();
}

template <Mode M>
void unpack_signs_scalar(uint64_t w, size_t len, float pos, float neg, float* out) {
  for (size_t e = 0; e < len; ++e) {
    float v = (w >> e) & 1u ? neg : pos;
    if constexpr (M == Mode::kSet) out[e] = v;
    else if constexpr (M == Mode::kAdd) out[e] += v;
    else out[e] -= v;
  }
}

template <Mode M>
void unpack_signs_t(const std::byte* words, size_t len, float pos, float neg, float* out) {
  size_t full = len / 64;
  if (kAvx512) {
    unpack_signs_avx512<M>(words, full, pos, neg, out);
  } else {
    for (size_t blk = 0; blk < full; ++blk) {
      uint64_t w = load<uint64_t>(words + 8 * blk);
      if (kAvx2) unpack_signs_avx2<M>(w, pos, neg, out + 64 * blk);
      else unpack_signs_scalar<M>(w, 64, pos, neg, out + 64 * blk);
    }
  }
  if (len % 64)
    unpack_signs_scalar<M>(load<uint64_t>(words + 8 * full), len % 64, pos, neg, out + 64 * full);
}

size_t collect_scalar(const float* v, size_t b, size_t e, uint32_t tkey, uint32_t* out) {
  size_t o = 0;
  for (size_t i = b; i < e; ++i) {
    uint32_t u;
    std::memcpy(&u, v + i, 4);
    if ((u & 0x7fffffffu) >= tkey) out[o++] = static_cast<uint32_t>(i);
  }
  return o;
}

BC_TARGET_AVX2 size_t collect_avx2(const float* v, size_t b, size_t e, uint32_t tkey, uint32_t* out) {
  size_t o = 0, i = b;
  // Signed compare on keys < 2^31 is the unsigned order; tkey - 1 turns >= into >.
  const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
  if (tkey == 0) return collect_scalar(v, b, e, tkey, out);
  const __m256i t = _mm256_set1_epi32(static_cast<int>(tkey - 1));
  for (; i + 16 <= e; i += 16) {
    __m256i k0 = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i)), absmask);
    __m256i k1 = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i + 8)), absmask);
    uint32_t m = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(k0, t)))) |
                 (static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(k1, t)))) << 8);
    while (m) {
      out[o++] = static_cast<uint32_t>(i + static_cast<unsigned>(__builtin_ctz(m)));
      m &= m - 1;
    }
  }
  return o + collect_scalar(v, i, e, tkey, out + o);
}

}  // namespace

size_t collect_at_least(const float* v, size_t b, size_t e, uint32_t tkey, uint32_t* out) {
  return kAvx2 ? collect_avx2(v, b, e, tkey, out) : collect_scalar(v, b, e, tkey, out);
}

void pack_planes(const uint8_t* codes, size_t len, unsigned bits, std::byte* words) {
  size_t full = len / 64;
  for (size_t blk = 0; blk < full; ++blk) {
    if (kAvx2) pack_block_avx2(codes + 64 * blk, bits, words + 8 * bits * blk);
    else pack_block_scalar(codes + 64 * blk, bits, words + 8 * bits * blk);
  }
  if (len % 64) {
    uint8_t tmp[64] = {};
    std::memcpy(tmp, codes + 64 * full, len % 64);
    pack_block_scalar(tmp, bits, words + 8 * bits * full);
  }
}

void unpack_planes(const std::byte* words, size_t len, unsigned bits, uint8_t* codes) {
  size_t full = len / 64;
  for (size_t blk = 0; blk < full; ++blk) {
    if (kAvx2) unpack_block_avx2(words + 8 * bits * blk, bits, codes + 64 * blk);
    else unpack_block_scalar(words + 8 * bits * blk, bits, codes + 64 * blk);
  }
  if (len % 64) {
    uint8_t tmp[64];
    unpack_block_scalar(words + 8 * bits * full, bits, tmp);
    std::memcpy(codes + 64 * full, tmp, len % 64);
  }
}

void pack_signs(const float* x, size_t len, std::byte* words) {
  size_t full = len / 64;
  for (size_t blk = 0; blk < full; ++blk)
    store<uint64_t>(words + 8 * blk, kAvx2 ? signs_avx2(x + 64 * blk) : signs_scalar(x + 64 * blk, 64));
  if (len % 64) store<uint64_t>(words + 8 * full, signs_scalar(x + 64 * full, len % 64));
}

void unpack_signs_stream(const std::byte* words, size_t len, float pos, float neg, float* out) {
  const size_t full = len / 64;
  if (!kAvx512 || reinterpret_cast<uintptr_t>(out) % 64 != 0) {
    unpack_signs(words, len, pos, neg, out, Mode::kSet);
    return;
  }
  unpack_signs_stream_avx512(words, full, pos, neg, out);
  if (len % 64)
    unpack_signs_scalar<Mode::kSet>(load<uint64_t>(words + 8 * full), len % 64, pos, neg,
                                    out + 64 * full);
}

void unpack_signs(const std::byte* words, size_t len, float pos, float neg, float* out, Mode m) {
  switch (m) {
    case Mode::kSet: unpack_signs_t<Mode::kSet>(words, len, pos, neg, out); break;
    case Mode::kAdd: unpack_signs_t<Mode::kAdd>(words, len, pos, neg, out); break;
    case Mode::kSub: unpack_signs_t<Mode::kSub>(words, len, pos, neg, out); break;
  }
}

}  // namespace bytecomp::compress::detail
