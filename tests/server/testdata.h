// Deterministic test gradients shared by bytecomp-ps-worker and the tests,
// so a test can recompute what every worker pushed and the reference sum.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace bytecomp::server::testing {

inline uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Values in about [-4, 4) with full random mantissas, so fp32 sums depend on
// the order they are taken in (which makes the deterministic test meaningful).
inline void fill(float* out, uint64_t n, uint64_t seed, uint32_t rank, uint32_t tensor,
                 uint64_t iteration, uint64_t offset) {
  uint64_t base = splitmix(seed ^ splitmix(rank * 1000003ull + tensor * 7919ull + iteration * 104729ull));
  for (uint64_t i = 0; i < n; ++i) {
    uint64_t r = splitmix(base + offset + i);
    float f = static_cast<float>(static_cast<int64_t>(r >> 11) - (int64_t{1} << 52)) /
              static_cast<float>(int64_t{1} << 50);
    out[i] = f;
  }
}

}  // namespace bytecomp::server::testing
