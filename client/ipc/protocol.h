// Control protocol between libbytecomp and bytecompd, version 1.
//
// Transport: a Unix SOCK_SEQPACKET socket, so every message is one datagram
// with its boundaries kept; a connection closing is how each side sees the
// other die. Every message is a 16-byte header followed by the payload:
//
//   u32 magic 'BCMP' | u16 version | u16 type | u32 payload_bytes | u32 zero
//
// all little-endian. Payload fields are fixed-width little-endian integers
// and strings as u16 length + bytes. Decoding checks the magic, the version,
// the type, that payload_bytes equals the datagram's remaining length, every
// field against the bytes left, and every value against its limits; anything
// else throws Error(kMalformed) naming what was wrong. Messages never exceed
// kMaxMessageBytes.
//
// Conversation (C: client, D: daemon):
//   C HELLO        -> D WELCOME | ERROR (then D closes)
//   C DECLARE x N  (no replies; pipelined)
//   C STRATEGY     (optional, once, before START: the job's strategy YAML)
//   C START        -> D READY (once every local rank started) | ERROR
//   then data moves through shared memory (shm_layout.h); on the socket:
//   C COLLECTIVE   (a broadcast or barrier; no reply: it completes through
//                   the completion ring like a push_pull, see Collective)
//   D ABORT        (the job was aborted; D closes afterwards)
//   C BYE          (graceful leave; C closes)
//
// Operator requests (bytecompctl) use the same socket and header, on a
// connection that never sends HELLO; the daemon answers each with one or more
// CTL_REPLY datagrams (the last one flagged) or ERROR:
//   C CTL_REQUEST  -> D CTL_REPLY x N | ERROR
// CTL_REQUEST carries its own version (kCtlVersion), so the operator
// commands can evolve without touching the clients' protocol version.
//
// Thread-safety: the functions here are pure; thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "common/error.h"
#include "common/types.h"

namespace bytecomp::ipc {

inline constexpr uint32_t kMagic = 0x504d4342;  // "BCMP" little-endian
inline constexpr uint16_t kProtocolVersion = 1;
inline constexpr size_t kHeaderBytes = 16;
inline constexpr size_t kMaxMessageBytes = 64 * 1024;
inline constexpr size_t kMaxJobIdBytes = 128;
inline constexpr size_t kMaxTensorNameBytes = 1024;
inline constexpr size_t kMaxReasonBytes = 4000;
inline constexpr uint32_t kMaxLocalSize = 256;
inline constexpr uint32_t kMaxNodes = 65536;
inline constexpr uint32_t kMaxTensors = 1u << 20;
inline constexpr size_t kMaxSourceNameBytes = 1024;
// What is left of one datagram for a strategy's text.
inline constexpr size_t kMaxStrategyBytes =
    kMaxMessageBytes - kHeaderBytes - 2 - kMaxSourceNameBytes - 4;

enum class MsgType : uint16_t {
  kHello = 1,
  kWelcome = 2,
  kDeclare = 3,
  kStart = 4,
  kReady = 5,
  kError = 6,
  kAbort = 7,
  kBye = 8,
  kStrategy = 9,  // added within version 1: older daemons refuse it by type
  kCtlRequest = 10,  // added within version 1 (bytecompctl), as kStrategy
  kCtlReply = 11,
  kCollective = 12,  // added within version 1 (broadcast, barrier), as kStrategy
};

// Version of the operator requests' payload (CtlRequest.ctl_version).
inline constexpr uint16_t kCtlVersion = 1;
inline constexpr size_t kMaxCtlCommandBytes = 32;
// Room for a `gpu_profile` report (bytecomp/gpu_profile.py: ~470 bytes per
// measured compressor) besides a job id; a daemon of an older release
// refuses an arg above 1024 bytes, naming the field and both sizes.
inline constexpr size_t kMaxCtlArgBytes = 32 * 1024;
static_assert(kHeaderBytes + 2 + 2 + kMaxCtlCommandBytes + 2 + kMaxCtlArgBytes <= kMaxMessageBytes);
// Reply bytes per CTL_REPLY datagram, and over all parts of one reply.
inline constexpr size_t kMaxCtlChunkBytes = kMaxMessageBytes - kHeaderBytes - 4 - 1 - 4;
inline constexpr size_t kMaxCtlReplyBytes = 16u << 20;

// Element types and devices: the shared vocabulary (common/types.h).
using DType = bytecomp::DType;
using Device = bytecomp::Device;
// DECLARE's dtype codes on the wire, equal to bytecomp_dtype: float32 0,
// float64 1, int32 2, int64 3 (kNumDTypes of them). They are not
// common/types.h's values: the conversions below are the only way between
// the two. Device codes are common/types.h's values (cpu 0, cuda 1).
inline constexpr uint8_t kNumDTypes = 4;
inline constexpr uint8_t kNoDTypeCode = 0xFF;
// kNoDTypeCode for a dtype the protocol has no code for (float16, bfloat16).
uint8_t dtype_to_wire(DType t) noexcept;
// False for a code outside 0..kNumDTypes-1.
bool dtype_from_wire(uint8_t code, DType& out) noexcept;
using bytecomp::dtype_name;
using bytecomp::dtype_size;

struct Hello {
  std::string job_id;
  uint32_t local_rank = 0;
  uint32_t local_size = 1;
  uint32_t node_rank = 0;
  uint32_t num_nodes = 1;
  std::string client_version;
};
struct Welcome {
  std::string daemon_version;
  std::string instance;
};
struct Declare {
  uint32_t index = 0;  // must equal the number declared before it
  std::string name;
  uint64_t count = 0;
  DType dtype = DType::kFloat32;
  Device device = Device::kCpu;
  int32_t device_index = 0;
};
struct Start {
  uint32_t num_tensors = 0;
};
struct Ready {
  std::string segment_name;
  uint64_t segment_bytes = 0;
};
struct ErrorMsg {  // kError and kAbort
  uint32_t code = 0;  // bytecomp::ErrorCode value
  std::string message;
};
struct Bye {};
// The job's strategy (planner format), overriding the daemon's default for
// this job. `source` names it in error messages.
struct StrategyMsg {
  std::string source;
  std::string text;
};

// An operator request: `command` (e.g. "status"), its argument (a job id or
// ""), in the version of the operator protocol the tool speaks.
struct CtlRequest {
  uint16_t ctl_version = kCtlVersion;
  std::string command;
  std::string arg;
};
// One part of the answer (UTF-8 text, JSON or Prometheus text by command);
// `code` is an ErrorCode value (0: ok), `last` ends the reply.
struct CtlReply {
  uint32_t code = 0;
  bool last = true;
  std::string data;
};

// A collective operation of this local rank, after READY. Every rank of the
// job (all nodes) sends the same one: same op, tensor, iteration, root,
// nbytes and tag; the daemon (and across nodes the servers) check that and
// fail the job naming what differed.
//   kBroadcast: the first `nbytes` bytes of `tensor`'s buffer of global rank
//     `root` (= node_rank * local_size + local_rank) are copied, raw, into
//     every rank's buffer of `tensor`. `iteration` follows the tensor's
//     push_pull rule (increasing; one operation per tensor in flight).
//     Completes as a ring entry {tensor, status, iteration}.
//   kBarrier: no payload; completes once every rank of the job entered it.
//     tensor = kBarrierTensor, root = nbytes = tag = 0, iteration = the
//     rank's barrier sequence number (0, 1, ...); its completion is the ring
//     entry {kBarrierTensor, status, iteration}.
enum class CollectiveOp : uint8_t { kBroadcast = 1, kBarrier = 2 };
inline constexpr uint32_t kBarrierTensor = 0xFFFFFFFFu;
struct Collective {
  CollectiveOp op = CollectiveOp::kBroadcast;
  uint32_t tensor = 0;
  uint64_t iteration = 0;
  uint32_t root = 0;
  uint64_t nbytes = 0;
  uint64_t tag = 0;  // a value every rank must pass equal (e.g. a hash of what travels)
};

using Message = std::variant<Hello, Welcome, Declare, Start, Ready, ErrorMsg, Bye, StrategyMsg,
                             CtlRequest, CtlReply, Collective>;

struct Decoded {
  MsgType type;
  Message msg;
};

// Checks the job id's charset and length; "" when fine, else the problem.
std::string check_job_id(std::string_view id);

std::vector<uint8_t> encode(const Hello& m);
std::vector<uint8_t> encode(const Welcome& m);
std::vector<uint8_t> encode(const Declare& m);
std::vector<uint8_t> encode(const Start& m);
std::vector<uint8_t> encode(const Ready& m);
std::vector<uint8_t> encode(const ErrorMsg& m, MsgType type = MsgType::kError);
std::vector<uint8_t> encode(const Bye& m);
std::vector<uint8_t> encode(const StrategyMsg& m);
std::vector<uint8_t> encode(const CtlRequest& m);
std::vector<uint8_t> encode(const CtlReply& m);
std::vector<uint8_t> encode(const Collective& m);
// Cuts `text` into CTL_REPLY datagrams of at most kMaxCtlChunkBytes each,
// the last one flagged (one empty datagram for empty text).
std::vector<std::vector<uint8_t>> encode_ctl_reply(uint32_t code, std::string_view text);

// Thrown by decode() when only the header's version differs, so either side
// can report a version mismatch rather than garbage.
struct VersionMismatch : Error {
  explicit VersionMismatch(uint16_t got)
      : Error(ErrorCode::kMalformed,
              "protocol version " + std::to_string(got) + " (this side speaks " +
                  std::to_string(kProtocolVersion) + ")"),
        version(got) {}
  uint16_t version;
};

// Throws VersionMismatch for another protocol version, Error(kMalformed) for
// anything else that is not a well-formed version-1 message.
Decoded decode(std::span<const uint8_t> bytes);

}  // namespace bytecomp::ipc
