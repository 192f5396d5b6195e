// The parameter server's messages on top of transport::Message (internal to
// server/; the client library and the server both use it).
//
// Header use: type = MsgType; aux = job uid (0 for cluster-level messages);
// key = partition key; arg = iteration / barrier sequence / effective
// iteration. Control payloads are one buffer encoded with Writer/Reader
// below: a u16 protocol version first, then fields; every length and count
// is checked before use (Reader throws Error(kMalformed) naming the field).
//
// Replies: a request succeeds with a reply of type kOkReply (payload as
// documented per message) or fails with kErrorReply whose aux is the
// ErrorCode and whose single payload is the message text.
//
// Thread-safety: plain functions and values.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "server/job.h"
#include "transport/transport.h"

namespace bytecomp::server::proto {

inline constexpr uint16_t kVersion = 1;

// Header flag of kLeave: this node's part failed (e.g. a local client died);
// the coordinator aborts the job for every party instead of waiting for the
// others to time out.
inline constexpr uint16_t kLeaveAbort = 0x1;
// Header flag of kBroadcast: the sender's node holds the root rank.
inline constexpr uint16_t kBroadcastRoot = 0x1;
// Header flag of kAutoDecision: planning failed or timed out.
inline constexpr uint16_t kAutoFailed = 0x1;
// Bound of a probe's upload and answer.
inline constexpr uint64_t kMaxProbeBytes = 16ull << 20;

enum MsgType : uint16_t {
  // node -> coordinator
  kRegister = 0x5101,     // req: JobSpec + rank; reply (deferred): Admission
  kBarrier = 0x5102,      // req: aux=uid, arg=seq; reply when all arrived
  kSetStrategy = 0x5103,  // req: aux=uid, arg=iteration, payload: yaml
  kLeave = 0x5104,        // req: aux=uid; flags=kLeaveAbort + payload reason: abort the job
  // Automatic strategies (server/auto_planner.h, daemon/auto_tuner.h):
  kAutoProfile = 0x5105,  // req: aux=uid, arg=epoch, payloads: profile yaml, auto spec yaml
  kAutoReplan = 0x5106,   // req: aux=uid, arg=first iteration to profile, payload: reason
  // server -> coordinator
  kServerHello = 0x5110,  // req: ServerInfo
  kAbortRequest = 0x5111, // one-way: aux=uid, payload: reason (a server saw a node die)
  // coordinator -> server
  kJobSetup = 0x5120,     // req: Admission (rank ignored)
  kJobEnd = 0x5121,       // req: aux=uid, payload: reason ("" = normal end)
  kStrategyPrepare = 0x5122,  // req: aux=uid, arg=iteration, payload: yaml
  // coordinator -> nodes
  kStrategyUpdate = 0x5130,   // one-way: aux=uid, arg=iteration, payload: yaml
  kJobAborted = 0x5131,       // one-way: aux=uid, payload: reason
  // one-way: aux=uid, key=epoch, arg=first iteration to profile, payload: reason
  kAutoProfileRequest = 0x5132,
  // one-way: aux=uid, key=epoch, arg=predicted iteration us; flags 0: payloads
  // strategy yaml, decision yaml (planner/online.h), explanation text,
  // predicted timeline (Chrome trace JSON);
  // flags kAutoFailed: payload reason (the current strategy stays)
  kAutoDecision = 0x5133,
  // node -> server (data path)
  kPush = 0x5140,         // req: aux=uid, key, arg=iteration, payload: data
  kPull = 0x5141,         // req: aux=uid, key, arg=iteration; reply payload: result
  kStats = 0x5142,        // req; reply: ServerStats
  // req: arg=answer bytes, payload: ignored bytes; reply: arg bytes (link probe,
  // both at most kMaxProbeBytes)
  kProbe = 0x5144,
  kMetrics = 0x5143,      // req; reply payload: Prometheus text (server/metrics.h)
  // req: aux=uid, key (a partition key of the broadcast's tensor),
  // arg=iteration; payload 0: BroadcastMeta; flags kBroadcastRoot: this node
  // holds the root rank and payload 1 is the partition's bytes (raw). Every
  // node of the job sends one per partition; the server answers them all
  // once all arrived: the root with an empty ok, the others with the bytes;
  // a disagreement (meta, no root or two roots) fails every one of them,
  // naming it. Added within version 1: older servers refuse it by type.
  kBroadcast = 0x5145,
  // replies
  kOkReply = 0x51F0,
  kErrorReply = 0x51F1,
};

// Binary writer for control payloads (little-endian fixed-width integers,
// strings as u32 length + bytes).
class Writer {
 public:
  Writer() { u16(kVersion); }
  void u8(uint8_t v) { put(&v, 1); }
  void u16(uint16_t v) { put(&v, 2); }
  void u32(uint32_t v) { put(&v, 4); }
  void u64(uint64_t v) { put(&v, 8); }
  void str(std::string_view s) {
    u32(static_cast<uint32_t>(s.size()));
    put(s.data(), s.size());
  }
  transport::Buffer take() { return transport::Buffer::take(std::move(bytes_)); }
  std::string& bytes() { return bytes_; }

 private:
  void put(const void* p, size_t n) { bytes_.append(static_cast<const char*>(p), n); }
  std::string bytes_;
};

class Reader {
 public:
  // Checks the version; `what` names the message in errors.
  Reader(std::string_view bytes, std::string what);
  uint8_t u8(const char* field);
  uint16_t u16(const char* field);
  uint32_t u32(const char* field);
  uint64_t u64(const char* field);
  std::string str(const char* field, size_t max_len = 64u << 20);
  // A count that will be followed by at least `min_item_bytes` per item.
  uint32_t count(const char* field, size_t min_item_bytes);
  void end();  // throws if bytes are left over

 private:
  void need(size_t n, const char* field);
  template <class T>
  T fixed(const char* field);
  std::string_view bytes_;
  size_t pos_ = 0;
  std::string what_;
};

// The admission record: everything a party needs to compute the assignment.
struct Admission {
  std::string name;
  uint32_t uid = 0;
  uint32_t rank = 0;
  std::vector<NodeId> nodes;
  std::vector<TensorSpec> tensors;
  bool deterministic = false;
  uint64_t start_iteration = 0;
  uint64_t partition_bytes = 0;
  std::vector<ServerInfo> servers;
  std::string strategy_yaml;
  uint64_t digest = 0;  // the coordinator's assignment digest
  std::vector<std::string> peer_addresses;  // JobSpec::peer_address by rank
};

// The kStats reply (a server's counters; ps_client.h's ServerStats).
struct Stats {
  uint32_t jobs = 0;
  uint64_t job_bytes = 0;
  uint64_t rounds = 0;
  uint64_t pushes_refused = 0;
  uint64_t frames_refused = 0;
};

// What every node of a broadcast must agree on (kBroadcast's payload 0).
struct BroadcastMeta {
  uint32_t root = 0;    // global rank
  uint64_t nbytes = 0;  // of the whole broadcast (every partition)
  uint64_t tag = 0;     // the clients' agreement value
  bool operator==(const BroadcastMeta&) const = default;
};
// "root rank R, N bytes, tag 0x..": what error messages name.
std::string describe(const BroadcastMeta& m);

void write_spec(Writer& w, const JobSpec& spec);
JobSpec read_spec(Reader& r);
transport::Buffer encode(const Admission& a);
Admission decode_admission(std::string_view bytes);
transport::Buffer encode(const ServerInfo& s);
ServerInfo decode_server_info(std::string_view bytes);
transport::Buffer encode(const Stats& s);
// Throws Error(kMalformed) naming the field on a short, long or
// wrong-version reply.
Stats decode_stats(std::string_view bytes);
transport::Buffer encode(const BroadcastMeta& m);
// Throws Error(kMalformed) naming the field.
BroadcastMeta decode_broadcast_meta(std::string_view bytes);

// The answer to a kProbe request: `arg` zero bytes, or an error naming the
// bound when the request or the answer would exceed kMaxProbeBytes.
transport::Message probe_answer(const transport::Message& request);

// Concatenates all payloads of a control message (usually one).
std::string joined(const transport::Message& m);

transport::Message ok_reply(transport::Buffer payload = {});
transport::Message error_reply(ErrorCode code, const std::string& text);
// kOk for kOkReply; the carried error for kErrorReply; kMalformed otherwise.
Status reply_status(const transport::Message& m);

}  // namespace bytecomp::server::proto
