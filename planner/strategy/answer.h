// The pull answer format (PullFormat): the one encoder (the servers, from a
// partition's fp32 sum) and the one decoder (the daemon, into the tensor).
//
//   kFp32        count * 4 bytes: the sum's raw little-endian floats. The
//                servers send the sum's own memory (no encoding step), so
//                encode_answer() is for the other formats.
//   kFp16        count * 2 bytes: the sum rounded to IEEE half (raw words).
//   kCompressed  the sum compressed in the plan's compressor's wire format
//                (self-describing) by the server's recompressor
//                (compress::make_sum_recompressor: no momentum; a residual
//                in its TensorState when the plan says server_error_feedback).
//
// Thread-safety: pure functions; `state` is used by one caller at a time.
#pragma once

#include <cstddef>
#include <span>

#include "compress/compressor.h"
#include "planner/strategy/plan.h"

namespace bytecomp::strategy {

// True when the answer is the sum's bytes as they are (kFp32): the caller
// may send its buffer without a copy.
inline bool answer_is_raw_sum(PullFormat f) { return f == PullFormat::kFp32; }

// Encodes the `n`-element fp32 `sum` as format `f` into `out` (at least
// pull_bytes_bound() bytes, 8-byte aligned for kCompressed); returns bytes
// written. kCompressed needs `c` and `state` (else Error(kInternal)).
size_t encode_answer(PullFormat f, const float* sum, size_t n, std::span<std::byte> out,
                     const compress::Compressor* c, compress::TensorState* state,
                     const compress::CompressContext& ctx);

// Decodes an answer of format `f` into `out` (`n` floats, overwritten).
// Throws Error(kMalformed) when its size or content does not fit `n`, and
// Error(kInternal) for kCompressed without `c`.
void decode_answer(PullFormat f, std::span<const std::byte> in, float* out, size_t n,
                   const compress::Compressor* c, const compress::CompressContext& ctx);

}  // namespace bytecomp::strategy
