// libFuzzer target for the transport's wire header and the frame check a
// receiver applies to the payload frames after it (wire::decode,
// wire::split_frames). Input: u16 header length L, L header bytes, then the
// sizes of the payload frames as u32 each. A rejection (false + error) is
// correct; a crash, a sanitizer report, an accepted header that does not
// re-encode to the same bytes, or spans that do not add up is a bug.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/error.h"
#include "fuzz_common.h"
#include "transport/wire.h"

namespace wire = bytecomp::transport::wire;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  bcfuzz::Bytes in(data, size);
  const size_t header_len = in.u16();
  const std::vector<uint8_t> raw = in.take(header_len);
  std::vector<uint64_t> frames;
  while (in.left() >= 4) frames.push_back(in.u32());

  std::vector<std::byte> header(raw.size());
  if (!header.empty()) std::memcpy(header.data(), raw.data(), raw.size());
  // The defaults of TransportConfig (max_message_bytes, max_payloads).
  const wire::Limits limits{1ull << 30, 64};
  wire::WireHeader h;
  std::string error;
  if (!wire::decode(header, limits, h, error)) {
    if (error.empty()) bcfuzz::broken("wire", "rejected without a reason");
    return 0;
  }
  if (wire::encode(h) != header) bcfuzz::broken("wire", "accepted header does not re-encode");

  std::vector<wire::FrameSpan> spans;
  error.clear();
  if (!wire::split_frames(h, 0, frames.size(), [&](size_t f) { return frames.at(f); }, spans,
                          error)) {
    if (error.empty()) bcfuzz::broken("wire", "frames rejected without a reason");
    return 0;
  }
  if (spans.size() != h.payload_sizes.size()) bcfuzz::broken("wire", "one span per payload");
  size_t next = 0;
  for (size_t p = 0; p < spans.size(); ++p) {
    if (spans[p].first != next) bcfuzz::broken("wire", "spans not contiguous");
    uint64_t sum = 0;
    for (size_t f = spans[p].first; f < spans[p].first + spans[p].count; ++f) sum += frames.at(f);
    if (sum != h.payload_sizes[p]) bcfuzz::broken("wire", "frames do not fill their payload");
    next += spans[p].count;
  }
  if (next != frames.size()) bcfuzz::broken("wire", "frames left over");
  return 0;
}
