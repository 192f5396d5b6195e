#include "server/protocol.h"

#include <cstdio>
#include <cstring>

#include "common/record.h"

namespace bytecomp::server::proto {

namespace {

std::string type_hex(uint16_t t) {
  char b[8];
  std::snprintf(b, sizeof b, "%04x", t);
  return b;
}

}  // namespace

Reader::Reader(std::string_view bytes, std::string what)
    : bytes_(bytes), what_(std::move(what)) {
  if (recording_inputs()) record_input_always("ps-" + what_, bytes_.data(), bytes_.size());
  uint16_t v = u16("version");
  if (v != kVersion)
    throw Error(ErrorCode::kMalformed, what_ + ": protocol version " + std::to_string(v) +
                                           " (accepted: " + std::to_string(kVersion) + ")");
}

void Reader::need(size_t n, const char* field) {
  if (bytes_.size() - pos_ < n)
    throw Error(ErrorCode::kMalformed, what_ + ": truncated at field '" + field + "' (needs " +
                                           std::to_string(n) + " bytes, " +
                                           std::to_string(bytes_.size() - pos_) + " left)");
}

template <class T>
T Reader::fixed(const char* field) {
  need(sizeof(T), field);
  T v;
  std::memcpy(&v, bytes_.data() + pos_, sizeof(T));  // unaligned-safe
  pos_ += sizeof(T);
  return v;
}
uint8_t Reader::u8(const char* field) { return fixed<uint8_t>(field); }
uint16_t Reader::u16(const char* field) { return fixed<uint16_t>(field); }
uint32_t Reader::u32(const char* field) { return fixed<uint32_t>(field); }
uint64_t Reader::u64(const char* field) { return fixed<uint64_t>(field); }
std::string Reader::str(const char* field, size_t max_len) {
  uint32_t n = u32(field);
  if (n > max_len)
    throw Error(ErrorCode::kMalformed, what_ + ": field '" + field + "' length " +
                                           std::to_string(n) + " exceeds " +
                                           std::to_string(max_len));
  need(n, field);
  std::string s(bytes_.substr(pos_, n));
  pos_ += n;
  return s;
}
uint32_t Reader::count(const char* field, size_t min_item_bytes) {
  uint32_t n = u32(field);
  if (min_item_bytes > 0 && n > (bytes_.size() - pos_) / min_item_bytes)
    throw Error(ErrorCode::kMalformed, what_ + ": count " + std::to_string(n) + " of '" +
                                           field + "' exceeds what the message holds");
  return n;
}
void Reader::end() {
  if (pos_ != bytes_.size())
    throw Error(ErrorCode::kMalformed, what_ + ": " + std::to_string(bytes_.size() - pos_) +
                                           " unexpected trailing bytes");
}

namespace {

void write_tensors(Writer& w, const std::vector<TensorSpec>& ts) {
  w.u32(static_cast<uint32_t>(ts.size()));
  for (const TensorSpec& t : ts) {
    w.str(t.name);
    w.u64(t.count);
    w.u8(static_cast<uint8_t>(t.dtype));
  }
}

std::vector<TensorSpec> read_tensors(Reader& r) {
  uint32_t n = r.count("tensors", 4 + 8 + 1);
  std::vector<TensorSpec> ts(n);
  for (TensorSpec& t : ts) {
    t.name = r.str("tensor.name", 4096);
    t.count = r.u64("tensor.count");
    uint8_t d = r.u8("tensor.dtype");
    if (d > 2) throw Error(ErrorCode::kMalformed, "tensor '" + t.name + "': dtype code " +
                                                      std::to_string(d) + " (accepted: 0..2)");
    t.dtype = static_cast<compress::DType>(d);
  }
  return ts;
}

void write_nodes(Writer& w, const std::vector<NodeId>& nodes) {
  w.u32(static_cast<uint32_t>(nodes.size()));
  for (NodeId n : nodes) w.u32(n);
}

std::vector<NodeId> read_nodes(Reader& r) {
  uint32_t n = r.count("nodes", 4);
  std::vector<NodeId> nodes(n);
  for (NodeId& id : nodes) id = r.u32("node");
  return nodes;
}

void write_server(Writer& w, const ServerInfo& s) {
  w.u32(s.id);
  w.str(s.address);
  w.u32(s.engine_threads);
}

ServerInfo read_server(Reader& r) {
  ServerInfo s;
  s.id = r.u32("server.id");
  s.address = r.str("server.address", 4096);
  s.engine_threads = r.u32("server.engine_threads");
  if (s.engine_threads == 0 || s.engine_threads > 1024)
    throw Error(ErrorCode::kMalformed, "server " + std::to_string(s.id) + ": engine_threads " +
                                           std::to_string(s.engine_threads) +
                                           " (accepted: 1..1024)");
  return s;
}

// Tensor fusion: u8 enabled | u64 first bucket bytes | u64 cap bytes.
void write_fusion(Writer& w, const FusionConfig& f) {
  w.u8(f.enabled ? 1 : 0);
  w.u64(f.first_bucket_bytes);
  w.u64(f.bucket_cap_bytes);
}

FusionConfig read_fusion(Reader& r) {
  FusionConfig f;
  const uint8_t on = r.u8("fusion.enabled");
  if (on > 1)
    throw Error(ErrorCode::kMalformed, "fusion.enabled " + std::to_string(on) + " (accepted: 0, 1)");
  f.enabled = on == 1;
  f.first_bucket_bytes = r.u64("fusion.first_bucket_bytes");
  f.bucket_cap_bytes = r.u64("fusion.bucket_cap_bytes");
  if (f.enabled && (f.first_bucket_bytes == 0 || f.bucket_cap_bytes == 0 ||
                    f.first_bucket_bytes > f.bucket_cap_bytes || f.bucket_cap_bytes > (1ull << 34)))
    throw Error(ErrorCode::kMalformed, "fusion: first bucket " +
                                           std::to_string(f.first_bucket_bytes) + " B, cap " +
                                           std::to_string(f.bucket_cap_bytes) +
                                           " B (accepted: 0 < first <= cap <= 16 GiB)");
  return f;
}

}  // namespace

void write_spec(Writer& w, const JobSpec& spec) {
  w.str(spec.name);
  write_nodes(w, spec.nodes);
  write_tensors(w, spec.tensors);
  w.str(spec.strategy_yaml);
  w.u8(spec.deterministic ? 1 : 0);
  w.u64(spec.start_iteration);
  w.str(spec.peer_address);
  write_fusion(w, spec.fusion);
  w.str(spec.auto_spec_yaml);
}

JobSpec read_spec(Reader& r) {
  JobSpec s;
  s.name = r.str("job.name", 1024);
  s.nodes = read_nodes(r);
  s.tensors = read_tensors(r);
  s.strategy_yaml = r.str("job.strategy");
  s.deterministic = r.u8("job.deterministic") != 0;
  s.start_iteration = r.u64("job.start_iteration");
  s.peer_address = r.str("job.peer_address", 4096);
  s.fusion = read_fusion(r);
  s.auto_spec_yaml = r.str("job.auto_spec", 1u << 20);
  return s;
}

transport::Buffer encode(const Admission& a) {
  Writer w;
  w.str(a.name);
  w.u32(a.uid);
  w.u32(a.rank);
  write_nodes(w, a.nodes);
  write_tensors(w, a.tensors);
  w.u8(a.deterministic ? 1 : 0);
  w.u64(a.start_iteration);
  w.u64(a.partition_bytes);
  w.u32(static_cast<uint32_t>(a.servers.size()));
  for (const ServerInfo& s : a.servers) write_server(w, s);
  w.str(a.strategy_yaml);
  w.u64(a.digest);
  w.u32(static_cast<uint32_t>(a.peer_addresses.size()));
  for (const std::string& p : a.peer_addresses) w.str(p);
  write_fusion(w, a.fusion);
  return w.take();
}

Admission decode_admission(std::string_view bytes) {
  Reader r(bytes, "admission");
  Admission a;
  a.name = r.str("name", 1024);
  a.uid = r.u32("uid");
  a.rank = r.u32("rank");
  a.nodes = read_nodes(r);
  a.tensors = read_tensors(r);
  a.deterministic = r.u8("deterministic") != 0;
  a.start_iteration = r.u64("start_iteration");
  a.partition_bytes = r.u64("partition_bytes");
  uint32_t ns = r.count("servers", 12);
  for (uint32_t i = 0; i < ns; ++i) a.servers.push_back(read_server(r));
  a.strategy_yaml = r.str("strategy");
  a.digest = r.u64("digest");
  const uint32_t np = r.count("peer_addresses", 4);
  for (uint32_t i = 0; i < np; ++i) a.peer_addresses.push_back(r.str("peer_address", 4096));
  a.fusion = read_fusion(r);
  r.end();
  return a;
}

transport::Buffer encode(const ServerInfo& s) {
  Writer w;
  write_server(w, s);
  return w.take();
}

ServerInfo decode_server_info(std::string_view bytes) {
  Reader r(bytes, "server hello");
  ServerInfo s = read_server(r);
  r.end();
  return s;
}

transport::Buffer encode(const Stats& s) {
  Writer w;
  w.u32(s.jobs);
  w.u64(s.job_bytes);
  w.u64(s.rounds);
  w.u64(s.pushes_refused);
  w.u64(s.frames_refused);
  return w.take();
}

Stats decode_stats(std::string_view bytes) {
  Reader rd(bytes, "stats");
  Stats s;
  s.jobs = rd.u32("jobs");
  s.job_bytes = rd.u64("job_bytes");
  s.rounds = rd.u64("rounds");
  s.pushes_refused = rd.u64("pushes_refused");
  s.frames_refused = rd.u64("frames_refused");
  rd.end();
  return s;
}

transport::Buffer encode(const BroadcastMeta& m) {
  Writer w;
  w.u32(m.root);
  w.u64(m.nbytes);
  w.u64(m.tag);
  return w.take();
}

BroadcastMeta decode_broadcast_meta(std::string_view bytes) {
  Reader rd(bytes, "broadcast");
  BroadcastMeta m;
  m.root = rd.u32("root");
  m.nbytes = rd.u64("nbytes");
  m.tag = rd.u64("tag");
  rd.end();
  if (m.nbytes > (uint64_t{1} << 40))
    throw Error(ErrorCode::kMalformed, "broadcast: nbytes " + std::to_string(m.nbytes) +
                                           " exceeds 1 TiB");
  return m;
}

std::string describe(const BroadcastMeta& m) {
  char tag[24];
  std::snprintf(tag, sizeof tag, "0x%llx", static_cast<unsigned long long>(m.tag));
  return "root rank " + std::to_string(m.root) + ", " + std::to_string(m.nbytes) + " bytes, tag " +
         tag;
}

std::string joined(const transport::Message& m) {
  if (m.payloads.size() == 1) return std::string(m.payloads[0].view());
  std::string s;
  for (const transport::Buffer& b : m.payloads) s.append(b.view());
  return s;
}

transport::Message ok_reply(transport::Buffer payload) {
  transport::Message m;
  m.header.type = kOkReply;
  if (!payload.empty()) m.payloads.push_back(std::move(payload));
  return m;
}

transport::Message error_reply(ErrorCode code, const std::string& text) {
  transport::Message m;
  m.header.type = kErrorReply;
  Writer w;
  w.u32(static_cast<uint32_t>(code));
  w.str(text);
  m.payloads.push_back(w.take());
  return m;
}

Status reply_status(const transport::Message& m) {
  if (m.header.type == kOkReply) return Status::Ok();
  if (m.header.type == kErrorReply) {
    try {
      if (m.payloads.size() != 1)
        throw Error(ErrorCode::kMalformed, "error reply: " + std::to_string(m.payloads.size()) +
                                               " payloads (expected 1)");
      Reader r(m.payloads[0].view(), "error reply");
      const uint32_t c = r.u32("code");
      std::string text = r.str("text");
      r.end();
      const ErrorCode code = (c >= 1 && c <= static_cast<uint32_t>(ErrorCode::kInternal))
                                 ? static_cast<ErrorCode>(c)
                                 : ErrorCode::kInternal;
      return Status(code, std::move(text));
    } catch (const Error& e) {
      return Status(ErrorCode::kMalformed, e.what());
    }
  }
  return Status(ErrorCode::kMalformed, "unexpected reply type 0x" + type_hex(m.header.type));
}

// ---------------------------------------------------------------------------
// Typed messages

namespace {

const char* name_of(MsgType t) {
  switch (t) {
    case kRegister: return "register";
    case kBarrier: return "barrier";
    case kSetStrategy: return "set strategy";
    case kLeave: return "leave";
    case kAutoProfile: return "auto profile";
    case kAutoReplan: return "auto re-plan";
    case kServerHello: return "server hello";
    case kAbortRequest: return "abort request";
    case kJobSetup: return "job setup";
    case kJobEnd: return "job end";
    case kStrategyPrepare: return "strategy prepare";
    case kStrategyUpdate: return "strategy update";
    case kJobAborted: return "job aborted";
    case kAutoProfileRequest: return "auto profile request";
    case kAutoDecision: return "auto decision";
    case kPush: return "push";
    case kPull: return "pull";
    case kStats: return "stats";
    case kMetrics: return "metrics";
    case kProbe: return "probe";
    case kBroadcast: return "broadcast";
    case kShmAttach: return "shm attach";
    case kShmPush: return "shm push";
    case kShmPull: return "shm pull";
    case kOkReply: return "ok reply";
    case kErrorReply: return "error reply";
  }
  return "message";
}

[[noreturn]] void malformed(MsgType t, const std::string& why) {
  throw Error(ErrorCode::kMalformed, std::string(name_of(t)) + ": " + why);
}

// What every message shares: its type, the header fields it does not use
// left 0, and its payload count within [min, max].
void check_shape(const transport::Message& m, MsgType t, bool uses_uid, bool data,
                 uint16_t flags_allowed, size_t min_payloads, size_t max_payloads) {
  const transport::Header& h = m.header;
  if (h.type != t) malformed(t, "message type 0x" + type_hex(h.type));
  if (!uses_uid && h.aux != 0) malformed(t, "header aux " + std::to_string(h.aux) + " (unused, must be 0)");
  if (!data && (h.key != 0 || h.arg != 0))
    malformed(t, "header key/arg set (used by data messages only)");
  if ((h.flags & ~flags_allowed) != 0)
    malformed(t, "header flags 0x" + type_hex(h.flags) + " (accepted: 0x" +
                     type_hex(flags_allowed) + ")");
  if (m.payloads.size() < min_payloads || m.payloads.size() > max_payloads)
    malformed(t, std::to_string(m.payloads.size()) + " payloads (expected " +
                     std::to_string(min_payloads) +
                     (max_payloads != min_payloads ? ".." + std::to_string(max_payloads) : "") + ")");
}

// A control message: header type (+ uid), payload 0 from `w`.
transport::Message control(MsgType t, uint32_t uid, Writer& w) {
  transport::Message m;
  m.header.type = t;
  m.header.aux = uid;
  m.payloads.push_back(w.take());
  return m;
}

// Checks a control message's shape and opens payload 0 (version checked).
Reader open(const transport::Message& m, MsgType t, bool uses_uid) {
  check_shape(m, t, uses_uid, false, 0, 1, 1);
  return Reader(m.payloads[0].view(), name_of(t));
}

// Messages whose payload is one record with a codec of its own.
template <class M, class Decode>
M from_record(const transport::Message& m, Decode decode) {
  check_shape(m, M::kType, false, false, 0, 1, 1);
  return decode(m.payloads[0].view());
}

void put(Writer& w, uint64_t v) { w.u64(v); }
void put(Writer& w, bool v) { w.u8(v ? 1 : 0); }
void put(Writer& w, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  w.u64(bits);
}
void put(Writer& w, const std::string& v) { w.str(v); }

void get(Reader& r, MsgType, const char* name, uint64_t& v) { v = r.u64(name); }
void get(Reader& r, MsgType t, const char* name, bool& v) {
  const uint8_t b = r.u8(name);
  if (b > 1) malformed(t, std::string(name) + " " + std::to_string(b) + " (accepted: 0, 1)");
  v = b == 1;
}
void get(Reader& r, MsgType t, const char* name, double& v) {
  const uint64_t bits = r.u64(name);
  std::memcpy(&v, &bits, 8);
  if (!(v >= 0) || v > 1e15)
    malformed(t, std::string(name) + " " + std::to_string(v) + " (accepted: 0..1e15)");
}
void get(Reader& r, MsgType, const char* name, std::string& v) { v = r.str(name); }

// A control message: header type and (job-scoped ones) uid, payload 0 from
// its field list.
template <class M>
transport::Message encode_fields(const M& m) {
  Writer w;
  std::apply([&](const auto&... f) { (put(w, f.value), ...); }, M::fields(m));
  uint32_t uid = 0;
  if constexpr (requires { m.uid; }) uid = m.uid;
  return control(M::kType, uid, w);
}

template <class M>
M decode_fields(const transport::Message& in) {
  constexpr bool job = requires(M m) { m.uid; };
  Reader r = open(in, M::kType, job);
  M m{};
  std::apply([&](const auto&... f) { (get(r, M::kType, f.name, f.value), ...); }, M::fields(m));
  r.end();
  if constexpr (job) m.uid = in.header.aux;
  return m;
}

}  // namespace

// The control messages: one codec over their field lists.
#define BC_CONTROL_MESSAGE(M)                                                          \
  template <>                                                                          \
  transport::Message to_message(const M& m) {                                          \
    return encode_fields(m);                                                           \
  }                                                                                    \
  template <>                                                                          \
  M from_message(const transport::Message& m) {                                        \
    return decode_fields<M>(m);                                                        \
  }
BC_CONTROL_MESSAGE(Barrier)
BC_CONTROL_MESSAGE(SetStrategy)
BC_CONTROL_MESSAGE(Leave)
BC_CONTROL_MESSAGE(AutoProfile)
BC_CONTROL_MESSAGE(AutoReplan)
BC_CONTROL_MESSAGE(AbortRequest)
BC_CONTROL_MESSAGE(JobEnd)
BC_CONTROL_MESSAGE(StrategyPrepare)
BC_CONTROL_MESSAGE(StrategyUpdate)
BC_CONTROL_MESSAGE(JobAborted)
BC_CONTROL_MESSAGE(AutoProfileRequest)
BC_CONTROL_MESSAGE(AutoDecision)
BC_CONTROL_MESSAGE(StatsRequest)
BC_CONTROL_MESSAGE(MetricsRequest)
BC_CONTROL_MESSAGE(ShmAttach)
#undef BC_CONTROL_MESSAGE

template <>
transport::Message to_message(const Register& m) {
  Writer w;
  write_spec(w, m.spec);
  return control(kRegister, 0, w);
}
template <>
Register from_message(const transport::Message& m) {
  Reader r = open(m, kRegister, false);
  Register out{read_spec(r)};
  r.end();
  return out;
}

template <>
transport::Message to_message(const ServerHello& m) {
  transport::Message out;
  out.header.type = kServerHello;
  out.payloads.push_back(encode(m.info));
  return out;
}
template <>
ServerHello from_message(const transport::Message& m) {
  return from_record<ServerHello>(m, [](std::string_view b) { return ServerHello{decode_server_info(b)}; });
}

template <>
transport::Message to_message(const JobSetup& m) {
  transport::Message out;
  out.header.type = kJobSetup;
  out.payloads.push_back(encode(m.admission));
  return out;
}
template <>
JobSetup from_message(const transport::Message& m) {
  return from_record<JobSetup>(m, [](std::string_view b) { return JobSetup{decode_admission(b)}; });
}

namespace {

// A data message's header: its type, the job, the partition and the iteration.
template <class M>
transport::Message data_message(const M& m) {
  transport::Message out;
  out.header.type = M::kType;
  out.header.aux = m.uid;
  out.header.key = m.key;
  out.header.arg = m.iteration;
  return out;
}

}  // namespace

template <>
transport::Message to_message(const Push& m) {
  transport::Message out = data_message(m);
  out.payloads.push_back(m.data);
  return out;
}
template <>
Push from_message(const transport::Message& m) {
  check_shape(m, kPush, true, true, 0, 1, 1);
  return Push{m.header.aux, m.header.key, m.header.arg, m.payloads[0]};
}

template <>
transport::Message to_message(const Pull& m) {
  transport::Message out = data_message(m);
  return out;
}
template <>
Pull from_message(const transport::Message& m) {
  check_shape(m, kPull, true, true, 0, 0, 0);
  return Pull{m.header.aux, m.header.key, m.header.arg};
}

template <>
transport::Message to_message(const Broadcast& m) {
  transport::Message out = data_message(m);
  out.header.flags = m.is_root ? kBroadcastRoot : 0;
  out.payloads.push_back(encode(m.meta));
  if (m.is_root) out.payloads.push_back(m.data);
  return out;
}
template <>
Broadcast from_message(const transport::Message& m) {
  const bool root = (m.header.flags & kBroadcastRoot) != 0;
  check_shape(m, kBroadcast, true, true, kBroadcastRoot, root ? 2 : 1, root ? 2 : 1);
  Broadcast out;
  out.uid = m.header.aux;
  out.key = m.header.key;
  out.iteration = m.header.arg;
  out.meta = decode_broadcast_meta(m.payloads[0].view());
  out.is_root = root;
  if (root) out.data = m.payloads[1];
  return out;
}

transport::Buffer encode(const ShmAnswer& a) {
  Writer w;
  w.u64(a.length);
  w.u8(a.in_segment ? 1 : 0);
  return w.take();
}

ShmAnswer decode_shm_answer(std::string_view bytes) {
  Reader r(bytes, "shm answer");
  ShmAnswer a;
  a.length = r.u64("length");
  const uint8_t in = r.u8("in_segment");
  if (in > 1) malformed(kShmPull, "answer's in_segment " + std::to_string(in) + " (accepted: 0, 1)");
  a.in_segment = in == 1;
  r.end();
  return a;
}

namespace {

// kShmPush / kShmPull: a data header and payload 0 holding a byte range of
// the segment.
template <class M>
transport::Message shm_data(const M& m, uint64_t offset, uint64_t length) {
  transport::Message out = data_message(m);
  Writer w;
  w.u64(offset);
  w.u64(length);
  out.payloads.push_back(w.take());
  return out;
}

template <class M>
M shm_data_from(const transport::Message& m, const char* length_name, uint64_t M::*length) {
  check_shape(m, M::kType, true, true, 0, 1, 1);
  Reader r(m.payloads[0].view(), name_of(M::kType));
  M out;
  out.uid = m.header.aux;
  out.key = m.header.key;
  out.iteration = m.header.arg;
  out.offset = r.u64("offset");
  out.*length = r.u64(length_name);
  r.end();
  if (out.offset > UINT64_MAX - out.*length)
    malformed(M::kType, "offset " + std::to_string(out.offset) + " + " + length_name + " " +
                            std::to_string(out.*length) + " overflows");
  return out;
}

}  // namespace

template <>
transport::Message to_message(const ShmPush& m) {
  return shm_data(m, m.offset, m.length);
}
template <>
ShmPush from_message(const transport::Message& m) {
  return shm_data_from<ShmPush>(m, "length", &ShmPush::length);
}
template <>
transport::Message to_message(const ShmPull& m) {
  return shm_data(m, m.offset, m.capacity);
}
template <>
ShmPull from_message(const transport::Message& m) {
  return shm_data_from<ShmPull>(m, "capacity", &ShmPull::capacity);
}

template <>
transport::Message to_message(const Probe& m) {
  Writer w;
  w.u64(m.answer_bytes);
  transport::Message out = control(kProbe, 0, w);
  if (m.upload_bytes > 0) out.payloads.push_back(transport::Buffer::allocate(m.upload_bytes));
  return out;
}
template <>
Probe from_message(const transport::Message& m) {
  check_shape(m, kProbe, false, false, 0, 1, 2);
  Reader r(m.payloads[0].view(), name_of(kProbe));
  Probe out;
  out.answer_bytes = r.u64("answer_bytes");
  r.end();
  out.upload_bytes = m.payloads.size() > 1 ? m.payloads[1].size() : 0;
  return out;
}

transport::Message probe_answer(const transport::Message& request) {
  const Probe p = from_message<Probe>(request);
  if (p.upload_bytes > kMaxProbeBytes || p.answer_bytes > kMaxProbeBytes)
    return error_reply(ErrorCode::kInvalidArgument,
                       "probe of " + std::to_string(p.upload_bytes) + " bytes asking " +
                           std::to_string(p.answer_bytes) + " bytes back: at most " +
                           std::to_string(kMaxProbeBytes) + " each way");
  return ok_reply(transport::Buffer::take(std::string(p.answer_bytes, '\0')));
}

}  // namespace bytecomp::server::proto
