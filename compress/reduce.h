// Vectorised reduction kernels for aggregation: the parameter server sums
// pushes with them and the node daemon reduces its local clients' shared-memory
// buffers. fp16/bf16 buffers are stored as raw 16-bit words and summed in fp32
// (one rounding per output element, round-to-nearest-even).
//
// Every kernel is a single pass, picks its instruction set at run time (no
// -march=native needed), and, when `pool` is given, splits the range over it
// (small ranges run inline; the pool is only borrowed). Buffers may not
// overlap unless stated.
//
// Thread-safety: the functions are reentrant; concurrent calls must not write
// the same destination.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace bytecomp {
class ThreadPool;
}

namespace bytecomp::compress {

// dst[i] += src[i]
void sum_into(float* dst, const float* src, size_t n, ThreadPool* pool = nullptr);
// dst[i] += sum_j srcs[j][i]  (one pass over dst, however many sources)
void sum_into(float* dst, std::span<const float* const> srcs, size_t n,
              ThreadPool* pool = nullptr);
// dst[i] = sum_j srcs[j][i]   (dst is not read; srcs must not be empty;
// dst may be one of the sources)
void sum(float* dst, std::span<const float* const> srcs, size_t n,
         ThreadPool* pool = nullptr);
// dst[i] *= a  (e.g. turning a sum into a mean)
void scale(float* dst, float a, size_t n, ThreadPool* pool = nullptr);

// fp16 / bf16 storage, fp32 arithmetic.
void sum_into_fp16(uint16_t* dst, const uint16_t* src, size_t n, ThreadPool* pool = nullptr);
void sum_fp16(uint16_t* dst, std::span<const uint16_t* const> srcs, size_t n,
              ThreadPool* pool = nullptr);
void sum_into_bf16(uint16_t* dst, const uint16_t* src, size_t n, ThreadPool* pool = nullptr);
void sum_bf16(uint16_t* dst, std::span<const uint16_t* const> srcs, size_t n,
              ThreadPool* pool = nullptr);
// dst (fp32) += src (fp16 / bf16): accumulating half-precision pushes into an
// fp32 sum without a converted copy.
void accumulate_fp16(float* dst, const uint16_t* src, size_t n, ThreadPool* pool = nullptr);
void accumulate_bf16(float* dst, const uint16_t* src, size_t n, ThreadPool* pool = nullptr);

// Conversions (round-to-nearest-even; NaN stays NaN, overflow becomes inf).
void fp32_to_fp16(uint16_t* dst, const float* src, size_t n, ThreadPool* pool = nullptr);
void fp16_to_fp32(float* dst, const uint16_t* src, size_t n, ThreadPool* pool = nullptr);
void fp32_to_bf16(uint16_t* dst, const float* src, size_t n, ThreadPool* pool = nullptr);
void bf16_to_fp32(float* dst, const uint16_t* src, size_t n, ThreadPool* pool = nullptr);

// Scalar reference conversions (also used for tails and by tests).
uint16_t fp32_to_fp16(float f) noexcept;
float fp16_to_fp32(uint16_t h) noexcept;
uint16_t fp32_to_bf16(float f) noexcept;
float bf16_to_fp32(uint16_t h) noexcept;

}  // namespace bytecomp::compress
