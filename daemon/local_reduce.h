// Intra-node reduction over the local ranks' shared-memory buffers, block by
// block so the sum is copied out while it is still in cache.
//
//   reduce_range():  every buffer ends up holding the element-wise sum.
//   sum_to_first():  buffers[0] holds the sum, the others are untouched
//                    (compressed tensors: compress, decompress, then
//                    copy_from_first()).
// float32 uses compress/reduce.h's vectorised kernel (one pass over all
// sources); float64/int32/int64, which it has no kernel for, use plain loops
// (integers wrap instead of overflowing).
//
// Thread-safety: pure functions; concurrent calls on disjoint ranges are safe.
#pragma once

#include <cstdint>
#include <span>

#include "client/ipc/protocol.h"

namespace bytecomp::daemon {

// begin/end are byte offsets, multiples of the element size.
void reduce_range(ipc::DType dtype, std::span<char* const> buffers, uint64_t begin,
                  uint64_t end);
void sum_to_first(ipc::DType dtype, std::span<char* const> buffers, uint64_t begin,
                  uint64_t end);
void copy_from_first(std::span<char* const> buffers, uint64_t begin, uint64_t end);

}  // namespace bytecomp::daemon
