// Internal: how kernels pick their instruction set at run time. Shipped
// binaries are built for baseline x86-64; hot loops are compiled several times
// (target_clones, resolved once by the loader through an ifunc) or, where
// intrinsics are needed, guarded by a CPU probe taken once at start-up.
#pragma once

#include <cstdint>

#if defined(__x86_64__) && !defined(BYTECOMP_NO_CLONES)
#define BC_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define BC_TARGET_F16C __attribute__((target("avx2,f16c")))
#define BC_TARGET_AVX2 __attribute__((target("avx2,bmi2,popcnt")))
#else
#define BC_CLONES
#define BC_TARGET_F16C
#define BC_TARGET_AVX2
#endif

namespace bytecomp::compress {

inline bool cpu_has_f16c() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

inline bool cpu_has_avx2() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2");
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

__attribute__((always_inline)) inline v8f load8(const float* p) {
  v8f v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
__attribute__((always_inline)) inline v8f abs8(v8f v) { return reinterpret_cast<v8f>(reinterpret_cast<v8u>(v) & 0x7fffffffu); }
__attribute__((always_inline)) inline float hsum(v8f v) {
  float s = 0;
  for (int l = 0; l < 8; ++l) s += v[l];
  return s;
}
__attribute__((always_inline)) inline float hmax(v8f v) {
  float s = 0;
  for (int l = 0; l < 8; ++l) s = v[l] > s ? v[l] : s;
  return s;
}

}  // namespace bytecomp::compress::simd
