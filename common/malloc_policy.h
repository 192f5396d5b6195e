// Process-wide malloc policy for the processes that move large messages
// (bytecomp-server, bytecompd). Call once at the start of main().
//
// Why: every received message is a fresh allocation of the partition's size
// (4 MiB by default). glibc maps allocations above M_MMAP_THRESHOLD afresh
// and unmaps them on free, and gives freed heap tops above M_TRIM_THRESHOLD
// back to the kernel; either way the next message faults its pages in again
// and the kernel zeroes them, a cost of the order of a copy. Measured (two nodes, one server, 256 MiB
// model, 21 iterations, scripts/bench-daemon's setup): minor faults in the
// server 735k -> 290k (what is left is the job's own blocks, touched once),
// in each daemon 214k -> 11k. The price: freed memory up to the trim
// threshold stays mapped to the process for reuse.
#pragma once

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace bytecomp {

inline void keep_freed_memory_for_reuse() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's maximum on 64-bit
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
#endif
}

}  // namespace bytecomp
