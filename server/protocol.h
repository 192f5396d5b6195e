// The parameter server's messages on top of transport::Message (internal to
// server/; the node's PS client, the servers and the coordinator use it).
//
// Every message is a typed struct below with one to_message()/from_message()
// pair; nobody assembles a header by hand. Header fields have one meaning
// each, whatever the message:
//   type  MsgType;
//   aux   the job uid on job-scoped messages (0 on cluster-level ones and on
//         kRegister / kJobSetup, whose record carries the job);
//   key   a partition key, data messages only (kPush, kPull, kBroadcast,
//         kShmPush, kShmPull);
//   arg   an iteration, data messages only;
//   flags kBroadcastRoot on kBroadcast, 0 elsewhere.
// Every other field of a control message travels in payload 0, written with
// Writer below: a u16 protocol version first, then fields; every length and
// count is checked before use (Reader throws Error(kMalformed) naming the
// message and field). from_message() also refuses a wrong type, a header
// field a message does not use, or a wrong number of payloads.
//
// Replies: a request succeeds with a reply of type kOkReply (payload as
// documented per message) or fails with kErrorReply whose payload 0 holds
// the ErrorCode and the message text.
//
// Thread-safety: plain functions and values.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "common/error.h"
#include "server/job.h"
#include "transport/transport.h"

namespace bytecomp::server::proto {

// 2: the typed messages (auto messages, kLeave's abort, error replies carry
// their fields in payload 0, not in header fields).
inline constexpr uint16_t kVersion = 2;

// Header flag of kBroadcast: the sender's node holds the root rank.
inline constexpr uint16_t kBroadcastRoot = 0x1;
// Bound of a probe's upload and answer.
inline constexpr uint64_t kMaxProbeBytes = 16ull << 20;

// What each message carries: its struct below.
enum MsgType : uint16_t {
  // node -> coordinator
  kRegister = 0x5101,     // req: Register; reply (deferred): Admission
  kBarrier = 0x5102,      // req: Barrier; reply when all arrived
  kSetStrategy = 0x5103,  // req: SetStrategy
  kLeave = 0x5104,        // req: Leave
  // Automatic strategies (server/auto_planner.h, daemon/auto_tuner.h):
  kAutoProfile = 0x5105,  // req: AutoProfile
  kAutoReplan = 0x5106,   // req: AutoReplan
  // server -> coordinator
  kServerHello = 0x5110,  // req: ServerHello
  kAbortRequest = 0x5111, // one-way: AbortRequest (a server saw a node die)
  // coordinator -> server
  kJobSetup = 0x5120,     // req: JobSetup
  kJobEnd = 0x5121,       // req: JobEnd
  kStrategyPrepare = 0x5122,  // req: StrategyPrepare
  // coordinator -> nodes
  kStrategyUpdate = 0x5130,   // req: StrategyUpdate
  kJobAborted = 0x5131,       // one-way: JobAborted
  kAutoProfileRequest = 0x5132,  // one-way: AutoProfileRequest
  kAutoDecision = 0x5133,        // one-way: AutoDecision
  // node -> server (data path)
  kPush = 0x5140,         // req: Push
  kPull = 0x5141,         // req: Pull; reply payload: the answer
  kStats = 0x5142,        // req: StatsRequest; reply: Stats
  kMetrics = 0x5143,      // req: MetricsRequest; reply payload: Prometheus text
  kProbe = 0x5144,        // req: Probe; reply: answer_bytes zero bytes
  kBroadcast = 0x5145,    // req: Broadcast
  // node -> the server on its own host (server/local_shm.h)
  kShmAttach = 0x5146,    // req: ShmAttach
  kShmPush = 0x5147,      // req: ShmPush
  kShmPull = 0x5148,      // req: ShmPull; reply: ShmAnswer (+ the bytes when not in the segment)
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
  FusionConfig fusion;                       // rank 0's JobSpec::fusion (all agree)
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

// ---------------------------------------------------------------------------
// The typed messages. `uid` fields travel in header.aux; data messages' `key`
// and `iteration` in header.key and header.arg; everything else in payload 0.
//
// (Data messages, kShmPush and kShmPull included, carry uid, key and
// iteration in the header.)
// A control message lists its payload fields once, in wire order, with the
// names its refusals use (`fields(m)`); one codec writes and reads every such
// list (u64, bool as a 0/1 byte, double as its IEEE bits, string as u32
// length + bytes). Messages whose payload is a record with a codec of its own
// (Register, ServerHello, JobSetup) and the data messages have their own pair.

template <class T>
struct Field {
  const char* name;
  T& value;
};
template <class T>
Field<T> field(const char* name, T& value) {
  return {name, value};
}

struct Register {  // node -> coordinator; the node's declaration
  static constexpr MsgType kType = kRegister;
  JobSpec spec;
};
struct Barrier {
  static constexpr MsgType kType = kBarrier;
  uint32_t uid = 0;
  uint64_t seq = 0;  // the node's barrier count in the job
  template <class Self>
  static auto fields(Self& m) { return std::tuple{field("seq", m.seq)}; }
};
// A strategy change from `iteration` on: asked by a node (SetStrategy),
// announced to every node, which applies it and answers (StrategyUpdate).
template <MsgType T>
struct StrategyChangeMsg {
  static constexpr MsgType kType = T;
  uint32_t uid = 0;
  uint64_t iteration = 0;
  std::string yaml;
  template <class Self>
  static auto fields(Self& m) {
    return std::tuple{field("iteration", m.iteration), field("strategy", m.yaml)};
  }
};
using SetStrategy = StrategyChangeMsg<kSetStrategy>;
using StrategyUpdate = StrategyChangeMsg<kStrategyUpdate>;

// A job ends or is aborted, with why: a server asks the coordinator to abort
// (AbortRequest), the coordinator ends the job on the servers (JobEnd, ""
// for a normal end) and tells the nodes (JobAborted).
template <MsgType T>
struct JobNotice {
  static constexpr MsgType kType = T;
  uint32_t uid = 0;
  std::string reason;
  template <class Self>
  static auto fields(Self& m) { return std::tuple{field("reason", m.reason)}; }
};
using AbortRequest = JobNotice<kAbortRequest>;
using JobEnd = JobNotice<kJobEnd>;
using JobAborted = JobNotice<kJobAborted>;
struct Leave {  // this node is done; `abort`: its part failed (reason says why)
  static constexpr MsgType kType = kLeave;
  uint32_t uid = 0;
  bool abort = false;
  std::string reason;
  template <class Self>
  static auto fields(Self& m) { return std::tuple{field("abort", m.abort), field("reason", m.reason)}; }
};
struct AutoProfile {  // planner::online::NodeProfile and strategy::AutoSpec YAML
  static constexpr MsgType kType = kAutoProfile;
  uint32_t uid = 0;
  uint64_t epoch = 0;
  std::string profile_yaml, spec_yaml;
  template <class Self>
  static auto fields(Self& m) {
    return std::tuple{field("epoch", m.epoch), field("profile", m.profile_yaml),
                      field("auto spec", m.spec_yaml)};
  }
};
struct AutoReplan {
  static constexpr MsgType kType = kAutoReplan;
  uint32_t uid = 0;
  uint64_t from_iteration = 0;  // first iteration every node should profile
  std::string reason;
  template <class Self>
  static auto fields(Self& m) {
    return std::tuple{field("from_iteration", m.from_iteration), field("reason", m.reason)};
  }
};
struct ServerHello {
  static constexpr MsgType kType = kServerHello;
  ServerInfo info;
};
struct JobSetup {  // the admission (its rank is ignored by servers)
  static constexpr MsgType kType = kJobSetup;
  Admission admission;
};
struct StrategyPrepare {  // `cancel`: drop the change prepared for `iteration`
  static constexpr MsgType kType = kStrategyPrepare;
  uint32_t uid = 0;
  uint64_t iteration = 0;
  bool cancel = false;
  std::string yaml;
  template <class Self>
  static auto fields(Self& m) {
    return std::tuple{field("iteration", m.iteration), field("cancel", m.cancel),
                      field("strategy", m.yaml)};
  }
};
struct AutoProfileRequest {  // a re-plan: profile again
  static constexpr MsgType kType = kAutoProfileRequest;
  uint32_t uid = 0;
  uint64_t epoch = 0;
  uint64_t from_iteration = 0;
  std::string reason;
  template <class Self>
  static auto fields(Self& m) {
    return std::tuple{field("epoch", m.epoch), field("from_iteration", m.from_iteration),
                      field("reason", m.reason)};
  }
};
struct AutoDecision {  // `failed`: no plan (text says why), the strategy stays
  static constexpr MsgType kType = kAutoDecision;
  uint32_t uid = 0;
  uint64_t epoch = 0;
  bool failed = false;
  double predicted_us = 0;  // predicted iteration time
  // strategy YAML, decision YAML (planner/online.h), the explanation (or the
  // failure's reason) and the predicted timeline (Chrome trace JSON).
  std::string strategy_yaml, decision_yaml, text, timeline_json;
  template <class Self>
  static auto fields(Self& m) {
    return std::tuple{field("epoch", m.epoch), field("failed", m.failed),
                      field("predicted_us", m.predicted_us), field("strategy", m.strategy_yaml),
                      field("decision", m.decision_yaml), field("text", m.text),
                      field("timeline", m.timeline_json)};
  }
};
struct Push {  // payload 0: the partition's bytes (raw fp32 or compressed)
  static constexpr MsgType kType = kPush;
  uint32_t uid = 0;
  uint64_t key = 0;
  uint64_t iteration = 0;
  transport::Buffer data;
};
struct Pull {
  static constexpr MsgType kType = kPull;
  uint32_t uid = 0;
  uint64_t key = 0;
  uint64_t iteration = 0;
};
// One node's part of a broadcast: payload 0 the meta every node must agree
// on; the root's node also sends payload 1, the partition's bytes. The
// server answers every part once all arrived: the root with an empty ok, the
// others with the bytes; a disagreement fails every one of them, naming it.
struct Broadcast {
  static constexpr MsgType kType = kBroadcast;
  uint32_t uid = 0;
  uint64_t key = 0;
  uint64_t iteration = 0;
  BroadcastMeta meta;
  bool is_root = false;
  transport::Buffer data;  // is_root only
};
struct StatsRequest {
  static constexpr MsgType kType = kStats;
  template <class Self>
  static auto fields(Self&) { return std::tuple{}; }
};
struct MetricsRequest {
  static constexpr MsgType kType = kMetrics;
  template <class Self>
  static auto fields(Self&) { return std::tuple{}; }
};
struct Probe {  // a link probe: `upload_bytes` sent, `answer_bytes` asked back
  static constexpr MsgType kType = kProbe;
  uint64_t answer_bytes = 0;
  uint64_t upload_bytes = 0;  // payload 1 (zero bytes)
};

// The node's colocated server maps the job's segment (server/local_shm.h):
// `host` is the node's host_identity() (the server refuses another host's),
// `segment` its shm_segment_name() for this job and node, `bytes` its size.
struct ShmAttach {
  static constexpr MsgType kType = kShmAttach;
  uint32_t uid = 0;
  std::string host, segment;
  uint64_t bytes = 0;
  template <class Self>
  static auto fields(Self& m) {
    return std::tuple{field("host", m.host), field("segment", m.segment), field("bytes", m.bytes)};
  }
};
// A push whose bytes are [offset, offset + length) of the node's attached
// segment (payload 0: offset, length). The node leaves them untouched until
// the round is complete (its pull answered).
struct ShmPush {
  static constexpr MsgType kType = kShmPush;
  uint32_t uid = 0;
  uint64_t key = 0;
  uint64_t iteration = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};
// A pull whose answer goes to [offset, offset + capacity) of the segment
// (payload 0: offset, capacity); the reply's ShmAnswer says where it is.
struct ShmPull {
  static constexpr MsgType kType = kShmPull;
  uint32_t uid = 0;
  uint64_t key = 0;
  uint64_t iteration = 0;
  uint64_t offset = 0;
  uint64_t capacity = 0;
};
// kShmPull's ok reply, payload 0: the answer's length; `in_segment`: written
// at the pull's offset, else (longer than its capacity) carried in payload 1.
struct ShmAnswer {
  uint64_t length = 0;
  bool in_segment = false;
  bool operator==(const ShmAnswer&) const = default;
};
transport::Buffer encode(const ShmAnswer& a);
// Throws Error(kMalformed) naming the field.
ShmAnswer decode_shm_answer(std::string_view bytes);

// One pair per message. from_message() throws Error(kMalformed) naming the
// message and what was wrong (wrong type, an unused header field set, a
// wrong payload count, a truncated or over-long field, trailing bytes).
template <class M>
transport::Message to_message(const M& m);
template <class M>
M from_message(const transport::Message& m);

// Every message type, for tests and the fuzz target.
template <class... M>
struct MessageList {};
using AllMessages =
    MessageList<Register, Barrier, SetStrategy, Leave, AutoProfile, AutoReplan, ServerHello,
                AbortRequest, JobSetup, JobEnd, StrategyPrepare, StrategyUpdate, JobAborted,
                AutoProfileRequest, AutoDecision, Push, Pull, Broadcast, StatsRequest,
                MetricsRequest, Probe, ShmAttach, ShmPush, ShmPull>;

// Concatenates all payloads of a control message (usually one).
std::string joined(const transport::Message& m);

transport::Message ok_reply(transport::Buffer payload = {});
transport::Message error_reply(ErrorCode code, const std::string& text);
// kOk for kOkReply; the carried error for kErrorReply; kMalformed otherwise.
Status reply_status(const transport::Message& m);

}  // namespace bytecomp::server::proto
