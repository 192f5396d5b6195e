// Writes shm_fuzz seeds: segments in which the real producer (Ring::push, as
// the client and the daemon call it) queued entries, cut to the region the
// target overwrites:
//   shm_fuzz_seeds DIR
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "client/ipc/shm_layout.h"

namespace ipc = bytecomp::ipc;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  int k = 0;
  for (int side = 0; side < 2; ++side) {
    for (uint32_t local_size : {1u, 2u}) {
      for (uint32_t pushes : {1u, 3u}) {
        const std::vector<uint64_t> tensors(4, 64);
        const ipc::Layout l = ipc::Layout::compute(local_size, tensors);
        auto mem = std::make_unique<std::byte[]>(l.total_bytes);
        std::memset(mem.get(), 0, l.total_bytes);
        ipc::init_segment(mem.get(), l);
        std::byte* base = mem.get();
        auto* clients = reinterpret_cast<ipc::ClientArea*>(base + l.clients_offset);
        for (uint32_t r = 0; r < local_size; ++r) {
          auto& h = side == 0 ? clients[r].submit : clients[r].complete;
          const uint64_t off = side == 0 ? l.submit_ring_offset(r) : l.complete_ring_offset(r);
          ipc::Ring ring(h, reinterpret_cast<ipc::RingEntry*>(base + off), l.ring_capacity);
          for (uint32_t i = 0; i < pushes; ++i) ring.push({i, 0, 7});
        }
        const size_t from = side == 1 ? 0 : l.clients_offset;
        const size_t to = side == 1 ? l.data_offset : l.tensors_offset;
        std::ofstream f(std::string(argv[1]) + "/seed-" + std::to_string(k++), std::ios::binary);
        const char head[2] = {static_cast<char>(side | ((local_size - 1) << 1)),
                              static_cast<char>(tensors.size() - 1)};
        f.write(head, 2);
        f.write(reinterpret_cast<const char*>(base + from), static_cast<std::streamsize>(to - from));
      }
    }
  }
  return 0;
}
