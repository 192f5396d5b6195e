// The CUDA half of the compressor library (issue 15): one entry point the
// factory's device hook calls. Plain C++ (no CUDA types): builds without the
// toolkit link compress/cuda/none.cc instead, which says so in its errors.
//
// A CUDA compressor takes Device::kCuda float32 tensors and writes/reads the
// same wire format as the CPU library (compress/internal.h); the compressed
// buffer (the std::span<std::byte> of compress()/decompress()) is device
// memory on the same GPU. Work is ordered on the tensor view's stream
// (cudaStream_t; null = the legacy default stream).
//
// Host synchronisation: compress() of a fixed-size format never waits for the
// GPU; dgc's compress() reads its device-side pick count once per call.
// decompress() reads the header (and, for topk/dgc, the index check's
// verdict) once per call: the buffer is validated before anything is written.
// Allocation: make_state(n) allocates the residual/momentum vectors and the
// workspace for n elements once; compress() and decompress() allocate nothing
// after the first calls (decompress keeps a small pinned scratch per
// concurrent caller).
//
// States: make_state() binds the state to the current CUDA device; calls
// with one state must be ordered (same stream, or the caller orders them):
// the residual and the lazy sign scalars are read by the next call.
// reset() and copy_residual() synchronise the device (not steady-state calls).
//
// Thread-safety: as compressor.h (any number of threads, distinct states).
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include "compress/compressor.h"

namespace bytecomp::compress {
struct ParamValues;  // compress/catalogue.h
}

namespace bytecomp::compress::cuda {

// Whether this build has the CUDA kernels.
bool built() noexcept;
// Whether `name` (a compressor name of list_compressors()) has CUDA kernels
// in this build.
bool supported(std::string_view name) noexcept;
// The CUDA implementation of a validated, canonical spec (every parameter
// filled in, as make_compressor() builds it) with its parsed values. Throws
// Error(kInvalidArgument) when built without CUDA or the name has no kernels.
std::unique_ptr<Compressor> make_compressor(const CompressorSpec& canonical,
                                            const ParamValues& values);

// Device and pinned-host allocations made by the CUDA compressors so far
// (tests check that states free what they allocate and that steady-state
// calls allocate nothing).
struct AllocStats {
  uint64_t device_allocs = 0, device_frees = 0;
  uint64_t host_allocs = 0, host_frees = 0;
  int64_t device_bytes_live = 0, host_bytes_live = 0;
};
AllocStats alloc_stats() noexcept;

}  // namespace bytecomp::compress::cuda
