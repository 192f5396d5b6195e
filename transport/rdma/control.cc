#include "transport/rdma/control.h"

#include <cerrno>
#include <cstring>

#include "common/error.h"
#include "transport/wire.h"

namespace bytecomp::transport::rdma {

void encode_ctl(const Ctl& ctl, std::byte* out) { std::memcpy(out, &ctl, sizeof ctl); }

bool decode_ctl(const std::byte* data, size_t len, Ctl& ctl, std::string& error) {
  if (len < sizeof ctl) {
    error = "control message of " + std::to_string(len) + " bytes";
    return false;
  }
  std::memcpy(&ctl, data, sizeof ctl);
  if (ctl.magic != kCtlMagic || ctl.version != kCtlVersion) {
    error = "control header with bad magic or version " + std::to_string(ctl.version);
    return false;
  }
  return true;
}

bool wire_header_bytes(const std::byte* data, size_t len, size_t& header_len, std::string& error) {
  if (len < wire::kFixedBytes) {
    error = "message shorter than a wire header";
    return false;
  }
  // payload_count: u16 at offset 6 (transport/wire.h), little-endian.
  const uint16_t count = static_cast<uint16_t>(std::to_integer<uint8_t>(data[6]) |
                                               (std::to_integer<uint8_t>(data[7]) << 8));
  header_len = wire::kFixedBytes + 8ull * count;
  if (header_len > len) {
    error = "wire header runs past the message";
    return false;
  }
  return true;
}

std::string check_request_hello(const void* data, size_t len, NodeId self, Hello& hello) {
  if (!data || len < sizeof(Hello)) return "connection request without a ByteComp hello";
  std::memcpy(&hello, data, sizeof hello);
  if (hello.magic != kCtlMagic) return "connection request with a bad magic";
  if (hello.version != kCtlVersion)
    return "connection request with protocol version " + std::to_string(hello.version);
  if (hello.node == kNoNode || hello.node == self)
    return "connection request from invalid node id " + std::to_string(hello.node);
  if (hello.recv_slots < 2)
    return "connection request offering " + std::to_string(hello.recv_slots) + " receive slots";
  return "";
}

bool accepted_hello_matches(const void* data, size_t len, NodeId expected, Hello& hello) {
  hello = Hello{};
  if (data && len >= sizeof(Hello)) std::memcpy(&hello, data, sizeof hello);
  return hello.magic == kCtlMagic && hello.version == kCtlVersion && hello.node == expected;
}

Endpoint parse_endpoint(const std::string& address, const char* what) {
  const std::string scheme = "rdma://";
  auto colon = address.rfind(':');
  if (address.rfind(scheme, 0) != 0 || colon == std::string::npos || colon <= scheme.size() ||
      colon + 1 >= address.size())
    throw Error(ErrorCode::kInvalidArgument, std::string("transport rdma: ") + what + " '" + address +
                                                 "' is not an rdma endpoint (accepted: rdma://host:port)");
  return {address.substr(scheme.size(), colon - scheme.size()), address.substr(colon + 1)};
}

std::string errno_text(const std::string& what) { return what + ": " + std::strerror(errno); }

}  // namespace bytecomp::transport::rdma
