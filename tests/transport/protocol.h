// Message types spoken between the transport tests and transport_peer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace bytecomp::transport::testproto {

enum Type : uint16_t {
  kEcho = 1,    // request: reply with the same header and payloads; data: send it back
  kSeq = 2,     // data: key = stream, arg = sequence number (checked per sender+stream)
  kStats = 3,   // request: reply "msgs=N errors=E bytes=B lost=a,b"
  kSlow = 5,    // request: sleep `arg` ms, then reply
  kBlast = 6,   // request: send `arg` kSeq messages of `aux` bytes to node `key`, reply when done
  kStall = 7,   // data: block the handler for `arg` ms
  kHash = 8,    // request: reply with key = checksum of payload 0, arg = its size
  kEchoInline = 9,  // kEcho, registered with set_inline_handler (the server's data path's way)
  kUnhandled = 100,  // no handler anywhere
};

// Position-dependent, so reordering or shifted bytes are caught.
inline uint64_t checksum(std::span<const std::byte> data) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ data.size();
  size_t i = 0;
  for (; i + 8 <= data.size(); i += 8) {
    uint64_t w = 0;
    for (int b = 0; b < 8; ++b) w |= static_cast<uint64_t>(std::to_integer<uint8_t>(data[i + b])) << (8 * b);
    h = (h ^ w) * 0x100000001B3ull + i;
  }
  for (; i < data.size(); ++i) h = (h ^ std::to_integer<uint8_t>(data[i])) * 0x100000001B3ull;
  return h;
}

// Fills a buffer with a pattern that depends on `seed` and the offset.
inline void fill_pattern(std::byte* p, size_t n, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; ++i) {
    if (i % 8 == 0) x = x * 6364136223846793005ull + 1442695040888963407ull;
    p[i] = static_cast<std::byte>(x >> (8 * (i % 8)));
  }
}

}  // namespace bytecomp::transport::testproto
