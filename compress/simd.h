// Internal: how kernels pick their instruction set at run time. Shipped
// binaries are built for baseline x86-64; hot loops are compiled several times
// (target_clones, resolved once by the loader through an ifunc) or, where
// intrinsics are needed, guarded by a CPU probe taken once at start-up.
#pragma once

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
