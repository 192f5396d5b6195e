// The wire header shared by every backend (internal to transport/).
//
// Layout, little-endian, version 1 (kFixedBytes = 64, then payload sizes):
//   0 u32 magic 'BCTP'     4 u8 version      5 u8 kind     6 u16 payload_count
//   8 u32 src node        12 u32 dst node
//  16 u16 type            18 u16 flags      20 u32 aux
//  24 u64 key             32 u64 arg        40 u64 correlation id
//  48 u64 total payload bytes               56 u32 status code  60 u32 reserved(0)
//  64 payload_count x u64 payload sizes
// Every field is checked by decode() before anything else reads the message;
// a receiver also checks the payload frames against the declared sizes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace bytecomp::transport::wire {

inline constexpr uint32_t kMagic = 0x50544342u;  // "BCTP" little-endian
inline constexpr uint8_t kVersion = 1;
inline constexpr size_t kFixedBytes = 64;

enum class Kind : uint8_t {
  kData = 1,       // one-way send()
  kRequest = 2,    // request(): expects kResponse or kError with same id
  kResponse = 3,
  kError = 4,      // a response carrying a failure (status code + message payload)
  kHeartbeat = 5,  // liveness only; never reaches handlers
};
const char* kind_name(Kind kind) noexcept;

struct WireHeader {
  Kind kind = Kind::kData;
  NodeId src = kNoNode;
  NodeId dst = kNoNode;
  Header user;
  uint64_t correlation = 0;
  uint32_t status_code = 0;  // ErrorCode for kError
  std::vector<uint64_t> payload_sizes;

  uint64_t total_payload_bytes() const noexcept;
  size_t encoded_size() const noexcept { return kFixedBytes + 8 * payload_sizes.size(); }
};

struct Limits {
  uint64_t max_message_bytes = 0;
  uint32_t max_payloads = 0;
};

// Appends the encoding to `out`.
void encode(const WireHeader& header, std::vector<std::byte>& out);
std::vector<std::byte> encode(const WireHeader& header);

// Parses and validates. On failure returns false and sets `error` to a
// message naming the field and its value; `out` is then unspecified.
bool decode(std::span<const std::byte> bytes, const Limits& limits,
            WireHeader& out, std::string& error);

// Which of a message's frames carry each payload, as a receiver checks them:
// payload p is frames [spans[p].first, spans[p].first + spans[p].count)
// (count 0 for an empty payload). The frames in [first, end) must fill the
// payloads in order, every frame non-empty and within what its payload still
// lacks, with none left over. `frame_size(i)` is the size of frame i. On
// failure returns false and sets `error` naming the payload and the sizes.
struct FrameSpan {
  size_t first = 0;
  size_t count = 0;
};
template <class FrameSize>
bool split_frames(const WireHeader& header, size_t first, size_t end, FrameSize&& frame_size,
                  std::vector<FrameSpan>& spans, std::string& error) {
  spans.clear();
  spans.reserve(header.payload_sizes.size());
  size_t idx = first;
  for (size_t p = 0; p < header.payload_sizes.size(); ++p) {
    const uint64_t want = header.payload_sizes[p];
    const size_t start = idx;
    uint64_t got = 0;
    while (got < want) {
      if (idx >= end) {
        error = "payload " + std::to_string(p) + " declared " + std::to_string(want) +
                " bytes but the message ends after " + std::to_string(got);
        return false;
      }
      const uint64_t sz = frame_size(idx);
      if (sz == 0 || sz > want - got) {
        error = "payload " + std::to_string(p) + " frame of " + std::to_string(sz) +
                " bytes does not fit the " + std::to_string(want - got) + " bytes left";
        return false;
      }
      got += sz;
      ++idx;
    }
    spans.push_back({start, idx - start});
  }
  if (idx != end) {
    error = std::to_string(end - idx) + " frames beyond the declared payloads";
    return false;
  }
  return true;
}

// Splitting of one payload into frames of at most `frame_bytes` (>0): number
// of frames (0 for an empty payload).
inline uint64_t frame_count(uint64_t size, uint64_t frame_bytes) noexcept {
  return (size + frame_bytes - 1) / frame_bytes;
}

}  // namespace bytecomp::transport::wire
