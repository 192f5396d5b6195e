#include "compress/reduce.h"

#include <immintrin.h>

#include <cstring>

#include "common/thread_pool.h"
#include "compress/hd.h"
#include "compress/simd.h"

namespace bytecomp::compress {

namespace {

// Below this many elements per task, splitting costs more than it saves.
constexpr size_t kMinChunk = 1 << 15;

template <class F>
void run(ThreadPool* pool, size_t n, const F& f) {
  if (pool == nullptr || pool->concurrency() < 2 || n < 2 * kMinChunk) {
    f(0, n);
    return;
  }
  pool->parallel_for(n, kMinChunk, f);
}

BC_CLONES void k_sum_into(float* __restrict dst, const float* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] += src[i];
}

BC_CLONES void k_sum_into2(float* __restrict dst, const float* __restrict a,
                           const float* __restrict b, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] += a[i] + b[i];
}

BC_CLONES void k_sum2(float* dst, const float* a, const float* b, size_t n) {
  // dst may alias a or b (element-wise, same index), so no __restrict.
  for (size_t i = 0; i < n; ++i) dst[i] = a[i] + b[i];
}

BC_CLONES void k_scale(float* dst, float a, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] *= a;
}

// Many sources: walk them in cache-sized tiles so dst is read and written once
// per tile while it is hot, whatever the number of sources.
constexpr size_t kTile = 2048;

void sum_many(float* dst, std::span<const float* const> srcs, size_t b, size_t e,
              bool init) {
  for (size_t t = b; t < e; t += kTile) {
    size_t len = std::min(kTile, e - t);
    size_t j = 0;
    if (init) {
      if (srcs.size() == 1) {
        if (dst != srcs[0]) std::memmove(dst + t, srcs[0] + t, len * sizeof(float));
        continue;
      }
      k_sum2(dst + t, srcs[0] + t, srcs[1] + t, len);
      j = 2;
    }
    for (; j + 1 < srcs.size(); j += 2) k_sum_into2(dst + t, srcs[j] + t, srcs[j + 1] + t, len);
    if (j < srcs.size()) k_sum_into(dst + t, srcs[j] + t, len);
  }
}

// --- half precision -------------------------------------------------------

BC_TARGET_F16C void f16c_to_half(uint16_t* dst, const float* src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(src + i);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
}

BC_TARGET_F16C void f16c_to_float(float* dst, const uint16_t* src, size_t n, bool acc) {
  size_t i = 0;
  if (acc) {
    for (; i + 8 <= n; i += 8) {
      __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(dst + i), v));
    }
    for (; i < n; ++i) dst[i] += fp16_to_fp32(src[i]);
  } else {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i,
                       _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    for (; i < n; ++i) dst[i] = fp16_to_fp32(src[i]);
  }
}

// dst16 = half(float(a16) + float(b16))
BC_TARGET_F16C void f16c_sum_half(uint16_t* dst, const uint16_t* a, const uint16_t* b, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i)));
    __m256 y = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_add_ps(x, y), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i < n; ++i) dst[i] = fp32_to_fp16(fp16_to_fp32(a[i]) + fp16_to_fp32(b[i]));
}

void soft_to_half(uint16_t* dst, const float* src, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
}
void soft_to_float(float* dst, const uint16_t* src, size_t n, bool acc) {
  if (acc)
    for (size_t i = 0; i < n; ++i) dst[i] += fp16_to_fp32(src[i]);
  else
    for (size_t i = 0; i < n; ++i) dst[i] = fp16_to_fp32(src[i]);
}

BC_CLONES void k_to_bf16(uint16_t* __restrict dst, const float* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t x;
    std::memcpy(&x, src + i, 4);
    uint32_t rne = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    uint32_t nan = (x >> 16) | 0x40u;
    dst[i] = static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? nan : rne);
  }
}

BC_CLONES void k_from_bf16(float* __restrict dst, const uint16_t* __restrict src, size_t n,
                           bool acc) {
  if (acc) {
    for (size_t i = 0; i < n; ++i) {
      uint32_t x = static_cast<uint32_t>(src[i]) << 16;
      float f;
      std::memcpy(&f, &x, 4);
      dst[i] += f;
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
      uint32_t x = static_cast<uint32_t>(src[i]) << 16;
      std::memcpy(dst + i, &x, 4);
    }
  }
}

BC_CLONES void k_sum_bf16(uint16_t* dst, const uint16_t* a, const uint16_t* b, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t xa = static_cast<uint32_t>(a[i]) << 16, xb = static_cast<uint32_t>(b[i]) << 16;
    float fa, fb;
    std::memcpy(&fa, &xa, 4);
    std::memcpy(&fb, &xb, 4);
    float s = fa + fb;
    uint32_t x;
    std::memcpy(&x, &s, 4);
    uint32_t rne = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    uint32_t nan = (x >> 16) | 0x40u;
    dst[i] = static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? nan : rne);
  }
}

const bool kHaveF16C = cpu_has_f16c();

// Sum of several half sources into a half destination, through an fp32 tile.
template <bool kBf16>
void sum_half_many(uint16_t* dst, std::span<const uint16_t* const> srcs, size_t b, size_t e,
                   bool init) {
  alignas(64) float acc[kTile];
  for (size_t t = b; t < e; t += kTile) {
    size_t len = std::min(kTile, e - t);
    size_t j = 0;
    if (init) {
      if constexpr (kBf16) k_from_bf16(acc, srcs[0] + t, len, false);
      else if (kHaveF16C) f16c_to_float(acc, srcs[0] + t, len, false);
      else soft_to_float(acc, srcs[0] + t, len, false);
      j = 1;
    } else {
      if constexpr (kBf16) k_from_bf16(acc, dst + t, len, false);
      else if (kHaveF16C) f16c_to_float(acc, dst + t, len, false);
      else soft_to_float(acc, dst + t, len, false);
    }
    for (; j < srcs.size(); ++j) {
      if constexpr (kBf16) k_from_bf16(acc, srcs[j] + t, len, true);
      else if (kHaveF16C) f16c_to_float(acc, srcs[j] + t, len, true);
      else soft_to_float(acc, srcs[j] + t, len, true);
    }
    if constexpr (kBf16) k_to_bf16(dst + t, acc, len);
    else if (kHaveF16C) f16c_to_half(dst + t, acc, len);
    else soft_to_half(dst + t, acc, len);
  }
}

}  // namespace

// --- scalar conversions -----------------------------------------------------

// Shared with the CUDA kernels (compress/hd.h); bit-identical to F16C's
// vcvtps2ph.
uint16_t fp32_to_fp16(float f) noexcept { return hd::fp32_to_fp16_bits(f); }
float fp16_to_fp32(uint16_t h) noexcept { return hd::fp16_bits_to_fp32(h); }
uint16_t fp32_to_bf16(float f) noexcept { return hd::fp32_to_bf16_bits(f); }
float bf16_to_fp32(uint16_t h) noexcept { return hd::bf16_bits_to_fp32(h); }

// --- fp32 -------------------------------------------------------------------

void sum_into(float* dst, const float* src, size_t n, ThreadPool* pool) {
  run(pool, n, [&](size_t b, size_t e) { k_sum_into(dst + b, src + b, e - b); });
}

void sum_into(float* dst, std::span<const float* const> srcs, size_t n, ThreadPool* pool) {
  if (srcs.empty()) return;
  run(pool, n, [&](size_t b, size_t e) { sum_many(dst, srcs, b, e, false); });
}

void sum(float* dst, std::span<const float* const> srcs, size_t n, ThreadPool* pool) {
  if (srcs.empty()) {
    std::memset(dst, 0, n * sizeof(float));
    return;
  }
  run(pool, n, [&](size_t b, size_t e) { sum_many(dst, srcs, b, e, true); });
}

void scale(float* dst, float a, size_t n, ThreadPool* pool) {
  run(pool, n, [&](size_t b, size_t e) { k_scale(dst + b, a, e - b); });
}

// --- half ---------------------------------------------------------------------

void sum_into_fp16(uint16_t* dst, const uint16_t* src, size_t n, ThreadPool* pool) {
  run(pool, n, [&](size_t b, size_t e) {
    if (kHaveF16C) {
      f16c_sum_half(dst + b, dst + b, src + b, e - b);
    } else {
      for (size_t i = b; i < e; ++i) dst[i] = fp32_to_fp16(fp16_to_fp32(dst[i]) + fp16_to_fp32(src[i]));
    }
  });
}

void sum_fp16(uint16_t* dst, std::span<const uint16_t* const> srcs, size_t n, ThreadPool* pool) {
  if (srcs.empty()) {
    std::memset(dst, 0, n * 2);
    return;
  }
  run(pool, n, [&](size_t b, size_t e) { sum_half_many<false>(dst, srcs, b, e, true); });
}

void sum_into_bf16(uint16_t* dst, const uint16_t* src, size_t n, ThreadPool* pool) {
  run(pool, n, [&](size_t b, size_t e) { k_sum_bf16(dst + b, dst + b, src + b, e - b); });
}

void sum_bf16(uint16_t* dst, std::span<const uint16_t* const> srcs, size_t n, ThreadPool* pool) {
  if (srcs.empty()) {
    std::memset(dst, 0, n * 2);
    return;
  }
  run(pool, n, [&](size_t b, size_t e) { sum_half_many<true>(dst, srcs, b, e, true); });
}

void accumulate_fp16(float* dst, const uint16_t* src, size_t n, ThreadPool* pool) {
  run(pool, n, [&](size_t b, size_t e) {
    if (kHaveF16C) f16c_to_float(dst + b, src + b, e - b, true);
    else soft_to_float(dst + b, src + b, e - b, true);
  });
}

void accumulate_bf16(float* dst, const uint16_t* src, size_t n, ThreadPool* pool) {
  run(pool, n, [&](size_t b, size_t e) { k_from_bf16(dst + b, src + b, e - b, true); });
}

void fp32_to_fp16(uint16_t* dst, const float* src, size_t n, ThreadPool* pool) {
  run(pool, n, [&](size_t b, size_t e) {
    if (kHaveF16C) f16c_to_half(dst + b, src + b, e - b);
    else soft_to_half(dst + b, src + b, e - b);
  });
}

void fp16_to_fp32(float* dst, const uint16_t* src, size_t n, ThreadPool* pool) {
  run(pool, n, [&](size_t b, size_t e) {
    if (kHaveF16C) f16c_to_float(dst + b, src + b, e - b, false);
    else soft_to_float(dst + b, src + b, e - b, false);
  });
}

void fp32_to_bf16(uint16_t* dst, const float* src, size_t n, ThreadPool* pool) {
  run(pool, n, [&](size_t b, size_t e) { k_to_bf16(dst + b, src + b, e - b); });
}

void bf16_to_fp32(float* dst, const uint16_t* src, size_t n, ThreadPool* pool) {
  run(pool, n, [&](size_t b, size_t e) { k_from_bf16(dst + b, src + b, e - b, false); });
}

}  // namespace bytecomp::compress
