// libFuzzer target for a job's shared-memory segment (client/ipc/shm_layout.h),
// the bytes each side reads that the other wrote. Input byte 0: bit 0 picks
// the side, bits 1-2 the local size - 1; byte 1: the tensor count - 1 (of
// 64-byte tensors); the rest overwrites part of a freshly initialised segment:
//   daemon side (bit 0 = 0): the client areas and rings (what a client may
//     scribble over), then every submit ring is drained with Ring::pop as the
//     daemon's engine does;
//   client side (bit 0 = 1): the header and tensor table, checked with
//     check_segment as the client does after mapping, then every completion
//     ring is drained.
// Error(kMalformed) is a correct rejection; a crash, a sanitizer report, a
// ring yielding more entries than it holds, or a pop outside the ring is a bug.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "client/ipc/shm_layout.h"
#include "common/error.h"
#include "fuzz_common.h"

namespace ipc = bytecomp::ipc;

namespace {

void drain(ipc::RingHeader& h, ipc::RingEntry* entries, uint32_t cap) {
  ipc::Ring ring(h, entries, cap);
  ipc::RingEntry e;
  uint32_t n = 0;
  try {
    while (ring.pop(e)) {
      if (++n > cap) bcfuzz::broken("shm", "a ring yielded more entries than its capacity");
    }
  } catch (const bytecomp::Error& err) {
    if (err.code() != bytecomp::ErrorCode::kMalformed) bcfuzz::broken("shm", err.what());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const bool client_side = data[0] & 1;
  const uint32_t local_size = ((data[0] >> 1) & 3) + 1;
  const std::vector<uint64_t> tensors(data[1] + 1u, 64);
  const ipc::Layout l = ipc::Layout::compute(local_size, tensors);
  // Exactly the segment's size, so any access past it hits ASan's redzone.
  auto mem = std::make_unique<std::byte[]>(l.total_bytes);
  std::memset(mem.get(), 0, l.total_bytes);
  ipc::SegmentHeader* h = ipc::init_segment(mem.get(), l);
  std::byte* base = mem.get();
  const size_t from = client_side ? 0 : l.clients_offset;
  const size_t to = client_side ? l.data_offset : l.tensors_offset;
  std::memcpy(base + from, data + 2, std::min(size - 2, to - from));

  auto* clients = reinterpret_cast<ipc::ClientArea*>(base + l.clients_offset);
  auto* rings = reinterpret_cast<ipc::RingEntry*>(base + l.rings_offset);
  if (!client_side) {
    for (uint32_t r = 0; r < local_size; ++r)
      drain(clients[r].submit, rings + (l.submit_ring_offset(r) - l.rings_offset) / sizeof(ipc::RingEntry),
            l.ring_capacity);
    return 0;
  }
  try {
    if (ipc::check_segment(base, l.total_bytes, l) != h) bcfuzz::broken("shm", "header moved");
  } catch (const bytecomp::Error& err) {
    if (err.code() != bytecomp::ErrorCode::kMalformed) bcfuzz::broken("shm", err.what());
    return 0;
  }
  for (uint32_t r = 0; r < local_size; ++r)
    drain(clients[r].complete,
          rings + (l.complete_ring_offset(r) - l.rings_offset) / sizeof(ipc::RingEntry),
          l.ring_capacity);
  return 0;
}
