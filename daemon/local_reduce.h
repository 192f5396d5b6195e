// Intra-node reduction: summing one partition over the local ranks' buffers
// and copying the result back out to every rank.
//
//   reduce():          every buffer ends up holding the element-wise sum.
//   sum_to_first():    buffers[0] holds the sum, the others are untouched
//                      (the inter-node paths: compress or send the sum, then
//                      copy_from_first() what came back).
//   copy_from_first(): buffers[0]'s range into every other buffer.
// begin/end are byte offsets, multiples of the element size. buffers[r] is
// local rank r's copy of the tensor.
//
// The engine holds one IntraNodeReducer per job and calls it from its pool's
// workers on disjoint ranges concurrently: implementations must allow that.
// ShmSimdReducer is the CPU implementation over shared memory (an NCCL one
// for device buffers comes with the GPU path).
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "client/ipc/protocol.h"

namespace bytecomp::daemon {

class IntraNodeReducer {
 public:
  virtual ~IntraNodeReducer() = default;
  virtual std::string_view name() const = 0;
  virtual void reduce(ipc::DType dtype, std::span<char* const> buffers, uint64_t begin,
                      uint64_t end) = 0;
  virtual void sum_to_first(ipc::DType dtype, std::span<char* const> buffers, uint64_t begin,
                            uint64_t end) = 0;
  virtual void copy_from_first(std::span<char* const> buffers, uint64_t begin, uint64_t end) = 0;
};

// Block by block (32 KiB), so the sum is copied out while it is still in
// cache. float32 uses compress/reduce.h's vectorised kernel (one pass over
// all sources); float64/int32/int64, which it has no kernel for, use plain
// loops (integers wrap instead of overflowing).
// Thread-safety: stateless; concurrent calls on disjoint ranges are safe.
class ShmSimdReducer final : public IntraNodeReducer {
 public:
  std::string_view name() const override { return "shm-simd"; }
  void reduce(ipc::DType dtype, std::span<char* const> buffers, uint64_t begin,
              uint64_t end) override;
  void sum_to_first(ipc::DType dtype, std::span<char* const> buffers, uint64_t begin,
                    uint64_t end) override;
  void copy_from_first(std::span<char* const> buffers, uint64_t begin, uint64_t end) override;
};

}  // namespace bytecomp::daemon
