// libFuzzer target for the RDMA backend's receive decoders
// (transport/rdma/control.h: device-free, built on every machine).
// Input byte 0 picks the decoder, the rest is what a peer sent:
//   0: a received SEND as RdmaTransport::on_recv parses it: decode_ctl, then
//      for kEager / kRts wire_header_bytes + wire::decode of the header, the
//      eager payloads sliced by the header's sizes (exact-size copies, so an
//      overread hits ASan's redzone), the RTS length check;
//   1: an inbound connection request's hello (check_request_hello);
//   2: the hello an outbound connection was accepted with
//      (accepted_hello_matches);
//   3: an endpoint string (parse_endpoint; Error(kInvalidArgument) is a
//      correct rejection).
// Properties: an accepted control header re-encodes to its bytes; a
// refusal names its reason; an accepted wire header lies within the message.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/error.h"
#include "fuzz_common.h"
#include "transport/rdma/control.h"
#include "transport/wire.h"

namespace rd = bytecomp::transport::rdma;
namespace wire = bytecomp::transport::wire;

namespace {

constexpr bytecomp::transport::NodeId kSelf = 7;
constexpr bytecomp::transport::NodeId kPeer = 3;

void on_recv(const std::vector<uint8_t>& msg) {
  const auto* data = reinterpret_cast<const std::byte*>(msg.data());
  rd::Ctl ctl;
  std::string error;
  if (!rd::decode_ctl(data, msg.size(), ctl, error)) {
    if (error.empty()) bcfuzz::broken("rdma", "decode_ctl refused without a reason");
    return;
  }
  std::byte again[sizeof(rd::Ctl)];
  rd::encode_ctl(ctl, again);
  if (std::memcmp(again, data, sizeof again) != 0)
    bcfuzz::broken("rdma", "accepted control header does not re-encode");
  const auto op = static_cast<rd::Op>(ctl.op);
  if (op != rd::Op::kEager && op != rd::Op::kRts) return;
  const std::byte* rest = data + sizeof ctl;
  const size_t rest_len = msg.size() - sizeof ctl;
  size_t header_len = 0;
  if (!rd::wire_header_bytes(rest, rest_len, header_len, error)) {
    if (error.empty()) bcfuzz::broken("rdma", "wire_header_bytes refused without a reason");
    return;
  }
  if (header_len > rest_len) bcfuzz::broken("rdma", "wire header runs past the message");
  // An exact-size copy of the header, as a separate allocation.
  const std::vector<std::byte> header(rest, rest + header_len);
  wire::WireHeader h;
  const wire::Limits limits{64u << 20, 1024};
  if (!wire::decode(header, limits, h, error)) {
    if (error.empty()) bcfuzz::broken("rdma", "wire::decode refused without a reason");
    return;
  }
  if (op == rd::Op::kRts) {
    (void)(h.total_payload_bytes() != ctl.length || ctl.length == 0);
    return;
  }
  if (h.total_payload_bytes() != rest_len - header_len) return;
  const std::byte* p = rest + header_len;
  for (uint64_t s : h.payload_sizes) {
    std::vector<std::byte> payload(p, p + s);
    p += s;
  }
  if (p != rest + rest_len) bcfuzz::broken("rdma", "eager payloads do not fill the message");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  bcfuzz::Bytes in(data, size);
  const uint8_t pick = in.u8();
  const std::vector<uint8_t> rest = in.rest();
  switch (pick % 4) {
    case 0:
      on_recv(rest);
      break;
    case 1: {
      rd::Hello hello;
      const std::string why =
          rd::check_request_hello(rest.empty() ? nullptr : rest.data(), rest.size(), kSelf, hello);
      if (why.empty() && (hello.node == kSelf || hello.node == bytecomp::transport::kNoNode ||
                          hello.recv_slots < 2))
        bcfuzz::broken("rdma", "check_request_hello accepted an unusable hello");
      break;
    }
    case 2: {
      rd::Hello hello;
      if (rd::accepted_hello_matches(rest.empty() ? nullptr : rest.data(), rest.size(), kPeer,
                                     hello) &&
          (hello.node != kPeer || rest.size() < sizeof(rd::Hello)))
        bcfuzz::broken("rdma", "accepted_hello_matches accepted another node's hello");
      break;
    }
    default: {
      const std::string address(rest.begin(), rest.end());
      try {
        const rd::Endpoint e = rd::parse_endpoint(address, "fuzzed endpoint");
        if (e.host.empty() || e.port.empty())
          bcfuzz::broken("rdma", "parse_endpoint accepted an empty host or port");
      } catch (const bytecomp::Error& e) {
        if (e.code() != bytecomp::ErrorCode::kInvalidArgument) bcfuzz::broken("rdma", e.what());
      }
      break;
    }
  }
  return 0;
}
