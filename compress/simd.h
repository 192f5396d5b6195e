// Internal: how kernels pick their instruction set at run time. Shipped
// binaries are built for baseline x86-64; hot loops are compiled several times
// (target_clones, resolved once by the loader through an ifunc) or, where
// intrinsics are needed, guarded by a CPU probe taken once at start-up.
#pragma once

#include <cstdint>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#if defined(__x86_64__) && !defined(BYTECOMP_NO_CLONES)
#define BC_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define BC_TARGET_F16C __attribute__((target("avx2,f16c")))
#define BC_TARGET_AVX2 __attribute__((target("avx2")))
#define BC_TARGET_AVX512 __attribute__((target("avx512f")))
#else
#define BC_CLONES
#define BC_TARGET_F16C
#define BC_TARGET_AVX2
#define BC_TARGET_AVX512
#endif

namespace bytecomp::compress {

inline bool cpu_has_f16c() {
#if defined(__x86_64__)
  // clang 14's __builtin_cpu_supports does not know "f16c": ask cpuid (leaf
  // 1, ECX bit 29); the avx2 probe covers the OS saving YMM state.
  __builtin_cpu_init();
  unsigned a, b, c, d;
  return __builtin_cpu_supports("avx2") && __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
#else
  return false;
#endif
}

inline bool cpu_has_avx2() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}

inline bool cpu_has_avx512f() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

}  // namespace bytecomp::compress

namespace bytecomp::compress::simd {

// GCC/Clang vector extensions: 8 lanes, lowered to whatever the enclosing
// target_clones variant offers (2 x SSE, AVX2, AVX-512). Reductions are
// written with them so each lane accumulates independently (no reliance on
// the auto-vectoriser reassociating floating point).
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));

// Macros and by-reference helpers rather than by-value vector functions:
// clang rejects passing 32-byte vectors by value in the baseline clone.
#define BC_V8_LOAD(dst, p) __builtin_memcpy(&(dst), (p), sizeof(dst))
#define BC_V8_ABS(v)                                                        \
  reinterpret_cast<::bytecomp::compress::simd::v8f>(                        \
      reinterpret_cast<::bytecomp::compress::simd::v8u>(v) & 0x7fffffffu)

inline float hsum(const v8f& v) {
  float s = 0;
  for (int l = 0; l < 8; ++l) s += v[l];
  return s;
}
inline float hmax(const v8f& v) {
  float s = 0;
  for (int l = 0; l < 8; ++l) s = v[l] > s ? v[l] : s;
  return s;
}

}  // namespace bytecomp::compress::simd
