// The RDMA backend's device-free parts: the control header in front of every
// SEND, the connection hello, work-request ids and endpoint parsing. Pure
// codecs with no verbs dependency, so they are unit-tested on any machine
// (tests/transport/rdma_control_test.cc). Internal to transport/rdma/.
//
// Wire values: version kCtlVersion of both the control header and the hello;
// fields in host order (little-endian hosts only). Thread-compatible.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string>

#include "transport/transport.h"

namespace bytecomp::transport::rdma {

static_assert(std::endian::native == std::endian::little,
              "the RDMA control header is written in host order; hosts must be little-endian");

constexpr uint32_t kCtlMagic = 0x44524342u;  // "BCRD"
constexpr uint8_t kCtlVersion = 1;

// Control header in front of every SEND (wire header and eager payload follow
// for kEager and kRts).
enum class Op : uint8_t { kEager = 1, kRts = 2, kCts = 3, kCredit = 4, kNack = 5 };

struct Ctl {
  uint32_t magic = kCtlMagic;
  uint8_t version = kCtlVersion;
  uint8_t op = 0;
  uint16_t credits = 0;   // receive slots re-posted since our last report
  uint64_t rdv_id = 0;    // sender's rendezvous id (RTS, CTS, NACK)
  uint64_t addr = 0;      // CTS: target address
  uint32_t rkey = 0;      // CTS: target key
  uint32_t slot = 0;      // CTS: receiver's region id, echoed as immediate data
  uint64_t length = 0;    // RTS/CTS: payload bytes
};
static_assert(sizeof(Ctl) == 40);

// Writes `ctl` into the first sizeof(Ctl) bytes of `out`.
void encode_ctl(const Ctl& ctl, std::byte* out);
// Reads a control header from a received message of `len` bytes; false (with
// `error` naming the problem) when it is too short or has another magic or
// version. The op is not checked here: the receiver rejects unknown ops.
bool decode_ctl(const std::byte* data, size_t len, Ctl& ctl, std::string& error);

// The wire header that follows the control header of kEager and kRts: its
// length from its payload count, checked against the `len` bytes there.
bool wire_header_bytes(const std::byte* data, size_t len, size_t& header_len, std::string& error);

// Connection private data: who is calling, in which protocol version.
struct Hello {
  uint32_t magic = kCtlMagic;
  uint8_t version = kCtlVersion;
  uint8_t pad[3] = {};
  uint32_t node = kNoNode;
  uint32_t recv_slots = 0;  // how many receives the sender of this hello posted
};
static_assert(sizeof(Hello) == 16);

// An inbound connection request's private data (`data` may be null). Returns
// "" and fills `hello` when it is acceptable for node `self`; else what is
// wrong with it.
std::string check_request_hello(const void* data, size_t len, NodeId self, Hello& hello);
// The hello our outbound connection was accepted with: true when it is from
// `expected` in our protocol version.
bool accepted_hello_matches(const void* data, size_t len, NodeId expected, Hello& hello);

// wr_id layout: connection serial (32 bits) | kind (8) | index (24).
// kWrSend: an eager message whose Outgoing completes with it; kWrCtl: RTS,
// CTS, NACK, credits, heartbeats (nothing to complete).
enum WrKind : uint64_t { kWrRecv = 1, kWrSend = 2, kWrWrite = 3, kWrCtl = 4 };
inline uint64_t wr_id(uint32_t serial, WrKind kind, uint32_t index) {
  return (static_cast<uint64_t>(serial) << 32) | (static_cast<uint64_t>(kind) << 24) | (index & 0xFFFFFF);
}
inline uint32_t wr_serial(uint64_t id) { return static_cast<uint32_t>(id >> 32); }
inline WrKind wr_kind(uint64_t id) { return static_cast<WrKind>((id >> 24) & 0xFF); }
inline uint32_t wr_index(uint64_t id) { return static_cast<uint32_t>(id & 0xFFFFFF); }

struct Endpoint {
  std::string host;
  std::string port;
};
// "rdma://host:port"; throws Error(kInvalidArgument) naming `what` otherwise.
Endpoint parse_endpoint(const std::string& address, const char* what);

// `what`: strerror(errno), for the backend's error messages.
std::string errno_text(const std::string& what);

}  // namespace bytecomp::transport::rdma
