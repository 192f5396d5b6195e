// Partition keys and compression seeds: the one formula every party (each
// node's daemon on every path, and the parameter servers) derives them with.
// A seed that differs between two parties silently breaks randomk (each picks
// other indices), so nobody computes them by hand.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string_view>

namespace bytecomp::strategy {

// FNV-1a over 64-bit words (little-endian bytes): cheap, stable across
// builds and machines (unlike std::hash), so every party gets the same value.
struct Fnv1a {
  uint64_t h = 1469598103934665603ull;
  void add(uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xFF;
      h *= 1099511628211ull;
    }
  }
};

// Wire key of a tensor's partition: (tensor << 32) | index, and back.
inline uint64_t partition_key(uint32_t tensor, uint32_t index) {
  return (uint64_t{tensor} << 32) | index;
}
inline uint32_t partition_tensor(uint64_t key) { return static_cast<uint32_t>(key >> 32); }
inline uint32_t partition_index(uint64_t key) { return static_cast<uint32_t>(key & 0xFFFFFFFFu); }

// CompressContext::shared_seed of every compression of one partition
// (randomk's indices): the same on every node and server of the job.
inline uint64_t partition_seed(std::string_view job_name, uint64_t key) {
  Fnv1a d;
  for (char ch : job_name) d.add(static_cast<unsigned char>(ch));
  d.add(key);
  return d.h;
}

// CompressContext::private_seed of node `rank` (stochastic rounding must not
// be correlated across nodes).
inline uint64_t node_private_seed(uint64_t shared_seed, uint32_t rank) {
  return shared_seed ^ (0x9e3779b97f4a7c15ull * (uint64_t{rank} + 1));
}

// CompressContext::private_seed of the server `server_id` recompressing a
// partition's sum.
inline uint64_t server_private_seed(uint64_t server_id, uint64_t key) {
  return (server_id << 32) ^ key;
}

}  // namespace bytecomp::strategy
