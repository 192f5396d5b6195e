#include "transport/wire.h"

#include <cstring>
#include <sstream>

#include "common/record.h"

namespace bytecomp::transport::wire {
namespace {

template <class T>
void put(std::byte* p, T v) {
  for (size_t i = 0; i < sizeof(T); ++i)
    p[i] = static_cast<std::byte>((static_cast<uint64_t>(v) >> (8 * i)) & 0xFF);
}
template <class T>
T get(const std::byte* p) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i)
    v |= static_cast<uint64_t>(std::to_integer<uint8_t>(p[i])) << (8 * i);
  return static_cast<T>(v);
}

}  // namespace

const char* kind_name(Kind kind) noexcept {
  switch (kind) {
    case Kind::kData: return "data";
    case Kind::kRequest: return "request";
    case Kind::kResponse: return "response";
    case Kind::kError: return "error";
    case Kind::kHeartbeat: return "heartbeat";
  }
  return "?";
}

uint64_t WireHeader::total_payload_bytes() const noexcept {
  uint64_t n = 0;
  for (uint64_t s : payload_sizes) n += s;
  return n;
}

void encode(const WireHeader& h, std::vector<std::byte>& out) {
  size_t base = out.size();
  out.resize(base + h.encoded_size());
  std::byte* p = out.data() + base;
  put<uint32_t>(p + 0, kMagic);
  put<uint8_t>(p + 4, kVersion);
  put<uint8_t>(p + 5, static_cast<uint8_t>(h.kind));
  put<uint16_t>(p + 6, static_cast<uint16_t>(h.payload_sizes.size()));
  put<uint32_t>(p + 8, h.src);
  put<uint32_t>(p + 12, h.dst);
  put<uint16_t>(p + 16, h.user.type);
  put<uint16_t>(p + 18, h.user.flags);
  put<uint32_t>(p + 20, h.user.aux);
  put<uint64_t>(p + 24, h.user.key);
  put<uint64_t>(p + 32, h.user.arg);
  put<uint64_t>(p + 40, h.correlation);
  put<uint64_t>(p + 48, h.total_payload_bytes());
  put<uint32_t>(p + 56, h.status_code);
  put<uint32_t>(p + 60, 0);
  for (size_t i = 0; i < h.payload_sizes.size(); ++i)
    put<uint64_t>(p + kFixedBytes + 8 * i, h.payload_sizes[i]);
}

std::vector<std::byte> encode(const WireHeader& header) {
  std::vector<std::byte> out;
  encode(header, out);
  return out;
}

bool decode(std::span<const std::byte> bytes, const Limits& limits,
            WireHeader& out, std::string& error) {
  auto fail = [&](const std::string& what) {
    error = what;
    return false;
  };
  record_input("wire", bytes.data(), bytes.size());
  if (bytes.size() < kFixedBytes)
    return fail("header is " + std::to_string(bytes.size()) +
                " bytes, shorter than the fixed " + std::to_string(kFixedBytes));
  const std::byte* p = bytes.data();
  uint32_t magic = get<uint32_t>(p);
  if (magic != kMagic) {
    std::ostringstream s;
    s << "bad magic 0x" << std::hex << magic << " (expected 0x" << kMagic << ")";
    return fail(s.str());
  }
  uint8_t version = get<uint8_t>(p + 4);
  if (version != kVersion)
    return fail("unsupported wire version " + std::to_string(version) +
                " (supported: " + std::to_string(kVersion) + ")");
  uint8_t kind = get<uint8_t>(p + 5);
  if (kind < static_cast<uint8_t>(Kind::kData) || kind > static_cast<uint8_t>(Kind::kHeartbeat))
    return fail("unknown message kind " + std::to_string(kind));
  out.kind = static_cast<Kind>(kind);
  uint16_t count = get<uint16_t>(p + 6);
  if (count > limits.max_payloads)
    return fail("payload count " + std::to_string(count) + " exceeds the limit " +
                std::to_string(limits.max_payloads));
  if (bytes.size() != kFixedBytes + 8ull * count)
    return fail("header is " + std::to_string(bytes.size()) + " bytes but " +
                std::to_string(count) + " payloads need " +
                std::to_string(kFixedBytes + 8ull * count));
  out.src = get<uint32_t>(p + 8);
  out.dst = get<uint32_t>(p + 12);
  if (out.src == kNoNode) return fail("source node id is the reserved value");
  out.user.type = get<uint16_t>(p + 16);
  out.user.flags = get<uint16_t>(p + 18);
  out.user.aux = get<uint32_t>(p + 20);
  out.user.key = get<uint64_t>(p + 24);
  out.user.arg = get<uint64_t>(p + 32);
  out.correlation = get<uint64_t>(p + 40);
  uint64_t total = get<uint64_t>(p + 48);
  out.status_code = get<uint32_t>(p + 56);
  if (get<uint32_t>(p + 60) != 0) return fail("reserved field is not zero");
  if (out.kind != Kind::kHeartbeat && out.user.type > kMaxUserType)
    return fail("message type " + std::to_string(out.user.type) +
                " is in the reserved range (> " + std::to_string(kMaxUserType) + ")");
  if ((out.kind == Kind::kRequest || out.kind == Kind::kResponse ||
       out.kind == Kind::kError) && out.correlation == 0)
    return fail(std::string(kind_name(out.kind)) + " without a correlation id");
  if (out.kind == Kind::kError &&
      (out.status_code == 0 || out.status_code > static_cast<uint32_t>(ErrorCode::kInternal)))
    return fail("error response with invalid status code " + std::to_string(out.status_code));
  out.payload_sizes.resize(count);
  uint64_t sum = 0;
  for (uint16_t i = 0; i < count; ++i) {
    uint64_t s = get<uint64_t>(p + kFixedBytes + 8 * i);
    if (s > limits.max_message_bytes || sum + s > limits.max_message_bytes)
      return fail("payload " + std::to_string(i) + " of " + std::to_string(s) +
                  " bytes takes the message past the limit of " +
                  std::to_string(limits.max_message_bytes) + " bytes");
    sum += s;
    out.payload_sizes[i] = s;
  }
  if (sum != total)
    return fail("payload sizes add up to " + std::to_string(sum) +
                " bytes but the header declares " + std::to_string(total));
  return true;
}

}  // namespace bytecomp::transport::wire
