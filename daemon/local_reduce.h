// Intra-node reduction over the local ranks' shared-memory buffers: after
// reduce_range() every buffer holds the element-wise sum of all of them over
// [begin, end). Works block by block so the sum is copied out while it is
// still in cache.
//
// Thread-safety: pure function of its arguments; concurrent calls on
// disjoint ranges are safe.
#pragma once

#include <cstdint>
#include <span>

#include "client/ipc/protocol.h"

namespace bytecomp::daemon {

// begin/end are byte offsets, multiples of the element size.
void reduce_range(ipc::DType dtype, std::span<char* const> buffers, uint64_t begin,
                  uint64_t end);

}  // namespace bytecomp::daemon
