#include "server/protocol.h"

#include <cstdio>
#include <cstring>

#include "common/record.h"

namespace bytecomp::server::proto {

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

}  // namespace

void write_spec(Writer& w, const JobSpec& spec) {
  w.str(spec.name);
  write_nodes(w, spec.nodes);
  write_tensors(w, spec.tensors);
  w.str(spec.strategy_yaml);
  w.u8(spec.deterministic ? 1 : 0);
  w.u64(spec.start_iteration);
  w.str(spec.peer_address);
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

transport::Message probe_answer(const transport::Message& request) {
  uint64_t up = 0;
  for (const transport::Buffer& b : request.payloads) up += b.size();
  if (up > kMaxProbeBytes || request.header.arg > kMaxProbeBytes)
    return error_reply(ErrorCode::kInvalidArgument,
                       "probe of " + std::to_string(up) + " bytes asking " +
                           std::to_string(request.header.arg) + " bytes back: at most " +
                           std::to_string(kMaxProbeBytes) + " each way");
  return ok_reply(transport::Buffer::take(std::string(request.header.arg, '\0')));
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
  m.header.aux = static_cast<uint32_t>(code);
  m.payloads.push_back(transport::Buffer::copy_of(text));
  return m;
}

Status reply_status(const transport::Message& m) {
  if (m.header.type == kOkReply) return Status::Ok();
  if (m.header.type == kErrorReply) {
    uint32_t c = m.header.aux;
    ErrorCode code = (c >= 1 && c <= static_cast<uint32_t>(ErrorCode::kInternal))
                         ? static_cast<ErrorCode>(c)
                         : ErrorCode::kInternal;
    return Status(code, joined(m));
  }
  return Status(ErrorCode::kMalformed,
                "unexpected reply type 0x" + [&] {
                  char b[8];
                  std::snprintf(b, sizeof b, "%04x", m.header.type);
                  return std::string(b);
                }());
}

}  // namespace bytecomp::server::proto
