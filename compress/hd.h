// Per-element and per-block logic shared by the CPU kernels (g++) and the
// CUDA kernels (nvcc): seeds and hashes, randomk's seed -> index mapping,
// quantisation codes, bit-plane layout, radix digits, fp16/bf16 rounding and
// the wire header's CRC. One definition keeps both devices on the same wire
// format and the same random choices; tests/compress/hd_test.cc checks these
// functions against the CPU library's outputs on the host.
//
// Everything here is header-only, constexpr-free plain functions of values
// (no allocation, no exceptions) so it compiles as __host__ __device__.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define BC_HD __host__ __device__ __forceinline__
#else
#include <bit>
#define BC_HD inline
#endif

namespace bytecomp::compress::hd {

// --- float bits ------------------------------------------------------------------

BC_HD uint32_t f2u(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#elif defined(__CUDACC__)
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
#else
  return std::bit_cast<uint32_t>(f);
#endif
}
BC_HD float u2f(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#elif defined(__CUDACC__)
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
#else
  return std::bit_cast<float>(u);
#endif
}
// "Negative" is the sign bit (so -0.0 and negative NaNs count as negative).
BC_HD uint32_t sign_bit(float f) { return f2u(f) >> 31; }
BC_HD float abs_f(float f) { return u2f(f2u(f) & 0x7fffffffu); }

// --- randomness --------------------------------------------------------------------

BC_HD uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
// Counter-based 32-bit hash (vectorises: 32-bit multiplies only).
BC_HD uint32_t hash32(uint32_t seed, uint32_t i) {
  uint32_t h = i * 0x9E3779B1u ^ seed;
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}
BC_HD float uniform01(uint32_t h) { return static_cast<float>(h >> 8) * (1.0f / 16777216.0f); }

// --- randomk: seed -> indices ----------------------------------------------------------

BC_HD uint64_t randomk_seed(uint64_t shared_seed, uint64_t iteration) {
  return splitmix64(shared_seed ^ splitmix64(iteration ^ 0x72616E646B00ull));
}
// Start of the i-th of k equal strata of [0, n) (floor(i * n / k), exact).
BC_HD uint64_t randomk_lo(uint64_t i, uint64_t n, uint64_t k) {
  __extension__ typedef unsigned __int128 u128;
  return static_cast<uint64_t>(static_cast<u128>(i) * n / k);
}
// Element i of the k indices: a uniform pick within the i-th stratum. Sorted,
// distinct, and computable in any order.
BC_HD uint64_t randomk_index(uint64_t seed, uint64_t i, uint64_t n, uint64_t k) {
  __extension__ typedef unsigned __int128 u128;
  uint64_t a = randomk_lo(i, n, k), len = randomk_lo(i + 1, n, k) - a;
  uint32_t h = hash32(static_cast<uint32_t>(seed ^ (seed >> 32) ^ ((i >> 32) * 0x9E3779B1u)),
                      static_cast<uint32_t>(i));
  return a + static_cast<uint64_t>((static_cast<u128>(h) * len) >> 32);
}

// --- quantisers ----------------------------------------------------------------------

// Elements per rounding-seed chunk: the CPU library's work chunk (internal.h's
// kChunk); a chunk never crosses a 2^32 index boundary.
constexpr uint64_t kSeedChunk = uint64_t{1} << 16;

// Seed of the chunk starting at element `first_index` (a multiple of
// kSeedChunk); the high index bits go into the seed, the hash takes the low 32.
BC_HD uint32_t quant_chunk_seed(uint64_t private_seed, uint64_t iteration, uint64_t salt,
                                uint64_t first_index) {
  return static_cast<uint32_t>(splitmix64(private_seed ^ splitmix64(iteration + salt) ^
                                          ((first_index >> 32) * 0x9E3779B97F4A7C15ull)));
}
constexpr uint64_t kQsgdSalt = 0x5153u;
constexpr uint64_t kTernSalt = 0x7467u;

// qsgd: level = floor(|x| * scale + u), u ~ U[0,1): unbiased, <= levels; the
// sign goes to bit `sign_shift`.
BC_HD uint8_t qsgd_code(float x, float u, float scale, uint32_t levels, uint32_t sign_shift) {
  const float cap = static_cast<float>(levels);
  float t = abs_f(x) * scale + u;
  t = t < cap ? t : cap;  // also maps NaN to the cap: the cast below stays defined
  uint32_t l = static_cast<uint32_t>(t);
  return static_cast<uint8_t>(l | (sign_bit(x) << sign_shift));
}
// terngrad: nonzero with probability min(|x|, scale) / scale; code = nz | sign << 1.
BC_HD uint8_t tern_code(float x, float u, float scale, float inv) {
  float a = abs_f(x);
  a = a < scale ? a : scale;
  uint32_t nz = u < a * inv ? 1u : 0u;
  return static_cast<uint8_t>(nz | (sign_bit(x) << 1));
}
// Code -> value: (code & lmask) * unit, negated when bit `shift` is set.
BC_HD float code_value(uint32_t code, uint32_t lmask, uint32_t shift, float unit) {
  float v = static_cast<float>(static_cast<int32_t>(code & lmask)) * unit;
  return u2f(f2u(v) ^ (((code >> shift) & 1u) << 31));
}

// --- bit planes ------------------------------------------------------------------------
// 64-element blocks; block b occupies `bits` u64 words, word j holding bit j
// of the codes of the block's 64 elements (element e at bit e). Sign bitmaps
// are the bits == 1 case. A partial last block is zero-padded.

BC_HD uint64_t plane_words(uint64_t n, uint32_t bits) { return (n + 63) / 64 * bits; }
// Index of the u64 word holding bit j of element i's code.
BC_HD uint64_t plane_word(uint64_t i, uint32_t bits, uint32_t j) { return (i / 64) * bits + j; }
// Index of the u32 half-word (little-endian) holding it: the CUDA kernels
// write one half-word per warp (32 elements) and plane.
BC_HD uint64_t plane_half(uint64_t i, uint32_t bits, uint32_t j) {
  return 2 * plane_word(i, bits, j) + ((i / 32) & 1);
}
BC_HD uint32_t plane_code(const uint64_t* words, uint64_t i, uint32_t bits) {
  uint32_t c = 0;
  const uint64_t* w = words + (i / 64) * bits;
  for (uint32_t j = 0; j < bits; ++j) c |= static_cast<uint32_t>((w[j] >> (i % 64)) & 1u) << j;
  return c;
}

// --- radix select over |x| -------------------------------------------------------------
// Keys are the magnitude's bit pattern (sign cleared): their unsigned order is
// the order of |x| (NaN above inf). Three digits of 11, 11 and 9 bits, most
// significant first.

constexpr int kRadixPasses = 3;
constexpr uint32_t kRadixMaxBuckets = 2048;
BC_HD uint32_t abs_key(float f) { return f2u(f) & 0x7fffffffu; }
BC_HD uint32_t radix_shift(int pass) { return pass == 0 ? 20u : pass == 1 ? 9u : 0u; }
BC_HD uint32_t radix_buckets(int pass) { return pass == 2 ? 512u : 2048u; }
BC_HD uint32_t radix_digit(uint32_t key, int pass) {
  return (key >> radix_shift(pass)) & (radix_buckets(pass) - 1);
}
// Whether `key` agrees with `prefix` on the digits of the passes before `pass`.
BC_HD bool radix_prefix_matches(uint32_t key, uint32_t prefix, int pass) {
  if (pass == 0) return true;
  uint32_t s = radix_shift(pass - 1);
  return (key >> s) == (prefix >> s);
}
// Bucket t (of a histogram walked from the top) holds the need-th largest
// when what lies above it is fewer than `need` and it brings the total to
// `need`. Each bucket can test this alone (the CUDA select runs one thread
// per bucket).
template <class C>
BC_HD bool bucket_holds_rank(C above, C count, C need) {
  return above < need && above + count >= need;
}
// Serial walk from the top bucket: returns the bucket holding the need-th
// largest (need >= 1, need <= total) and the count above it.
template <class C>
BC_HD uint32_t select_bucket(const C* hist, uint32_t buckets, C need, C* above_out) {
  C above = 0;
  uint32_t t = buckets - 1;
  while (t > 0 && above + hist[t] < need) above += hist[t--];
  *above_out = above;
  return t;
}

// --- fp16 / bf16 (round to nearest even) ---------------------------------------------

BC_HD uint16_t fp32_to_fp16_bits(float f) {
  // F. Giesen's construction: the FPU rounds subnormals, integers round
  // normals; bit-identical to F16C's vcvtps2ph.
  uint32_t x = f2u(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u)  // inf or NaN (NaN made quiet, payload truncated)
    return static_cast<uint16_t>(sign | (ax > 0x7f800000u ? 0x7e00u | ((ax >> 13) & 0x3ffu) : 0x7c00u));
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (ax < 0x38800000u) {  // result is subnormal or zero
    float t = u2f(ax) + u2f(((127u - 15u) + (23u - 10u) + 1u) << 23);
    return static_cast<uint16_t>(sign | (f2u(t) - (((127u - 15u) + (23u - 10u) + 1u) << 23)));
  }
  uint32_t odd = (ax >> 13) & 1u;
  ax += ((15u - 127u) << 23) + 0xfffu + odd;
  return static_cast<uint16_t>(sign | (ax >> 13));
}
BC_HD float fp16_bits_to_fp32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t em = h & 0x7fffu;
  if (em >= 0x7c00u) return u2f(sign | 0x7f800000u | ((em & 0x3ffu) << 13));
  if (em >= 0x0400u) return u2f(sign | ((em << 13) + ((127u - 15u) << 23)));
  return u2f(sign | f2u(static_cast<float>(em) * 5.9604644775390625e-08f));
}
BC_HD uint16_t fp32_to_bf16_bits(float f) {
  uint32_t x = f2u(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
BC_HD float bf16_bits_to_fp32(uint16_t h) { return u2f(static_cast<uint32_t>(h) << 16); }

// --- wire header ----------------------------------------------------------------------

// CRC-32 (IEEE 802.3, reflected, as boost::crc_32_type), bitwise: the CUDA
// encoders checksum at most 32 + 256 bytes in one thread.
BC_HD uint32_t crc32_update(uint32_t crc, const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int b = 0; b < 8; ++b) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  return crc;
}

BC_HD void put_le(uint8_t* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

// The version-1 header of compress/internal.h (write_wire) for float32
// tensors: writes 32 header bytes, then the params padded to params_padded
// (a multiple of 8), and the CRC over both. `params` may alias out + 32.
BC_HD void write_header(uint8_t* out, uint8_t algo, uint64_t count, const uint8_t* params,
                        uint32_t params_len, uint32_t params_padded, uint64_t payload_len) {
  put_le(out, 0x505A4342u, 4);
  out[4] = 1;
  out[5] = algo;
  out[6] = 0;
  out[7] = 0;
  put_le(out + 8, params_padded, 4);
  put_le(out + 12, 0, 4);
  put_le(out + 16, count, 8);
  put_le(out + 24, payload_len, 8);
  if (params != out + 32)
    for (uint32_t i = 0; i < params_len; ++i) out[32 + i] = params[i];
  for (uint32_t i = params_len; i < params_padded; ++i) out[32 + i] = 0;
  uint32_t crc = ~crc32_update(0xFFFFFFFFu, out, 32 + params_padded);
  put_le(out + 12, crc, 4);
}

// --- host-side sizes (the CUDA compressors size their launches with these) -----

// k of the sparsifiers: round(ratio * n), at least 1 for n > 0.
inline size_t sparse_k(size_t n, double ratio) {
  if (n == 0) return 0;
  double k = std::floor(ratio * static_cast<double>(n) + 0.5);
  return std::clamp<size_t>(static_cast<size_t>(k), 1, n);
}
// DGC's warm-up: exponentially shrinking ratios (DGC paper, section 3.3).
inline double dgc_ratio_at(double ratio, uint64_t warmup, uint64_t iteration) {
  constexpr double kStages[] = {0.25, 0.0625, 0.015625, 0.004};
  if (warmup == 0) return ratio;
  uint64_t stage = iteration / warmup;
  return stage < 4 ? std::max(ratio, kStages[stage]) : ratio;
}
// Most picks DGC sends: 1.3 k of the largest ratio it uses, plus one.
inline size_t dgc_max_k(size_t n, double ratio, uint64_t warmup) {
  size_t k = sparse_k(n, warmup ? std::max(ratio, 0.25) : ratio);
  return std::min(n, k + k * 3 / 10 + 1);
}

}  // namespace bytecomp::compress::hd
