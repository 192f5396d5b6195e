#include "client/ipc/protocol.h"

#include <algorithm>
#include <cstring>

#include "common/record.h"

namespace bytecomp::ipc {
namespace {

class Writer {
 public:
  explicit Writer(MsgType type) : type_(type) { buf_.resize(kHeaderBytes); }
  void u8(uint8_t v) { buf_.push_back(v); }
  void u16(uint16_t v) { put(v, 2); }
  void u32(uint32_t v) { put(v, 4); }
  void u64(uint64_t v) { put(v, 8); }
  void str(std::string_view s, size_t max) {
    if (s.size() > max || s.size() > 0xffff) {
      throw Error(ErrorCode::kInvalidArgument,
                  "string of " + std::to_string(s.size()) + " bytes exceeds the limit of " +
                      std::to_string(max));
    }
    u16(static_cast<uint16_t>(s.size()));
    buf_.insert(buf_.end(), s.begin(), s.end());
  }
  void raw(std::string_view s) { buf_.insert(buf_.end(), s.begin(), s.end()); }
  std::vector<uint8_t> finish() {
    const size_t payload = buf_.size() - kHeaderBytes;
    if (buf_.size() > kMaxMessageBytes) {
      throw Error(ErrorCode::kInvalidArgument,
                  "message of " + std::to_string(buf_.size()) + " bytes exceeds " +
                      std::to_string(kMaxMessageBytes));
    }
    std::vector<uint8_t> out = std::move(buf_);
    buf_.clear();
    size_t at = 0;
    auto put_at = [&](uint64_t v, int n) {
      for (int i = 0; i < n; ++i) out[at++] = static_cast<uint8_t>(v >> (8 * i));
    };
    put_at(kMagic, 4);
    put_at(kProtocolVersion, 2);
    put_at(static_cast<uint16_t>(type_), 2);
    put_at(payload, 4);
    put_at(0, 4);
    return out;
  }

 private:
  void put(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) buf_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  MsgType type_;
  std::vector<uint8_t> buf_;
};

class Reader {
 public:
  Reader(std::span<const uint8_t> b, const char* what) : b_(b), what_(what) {}
  uint64_t get(int n, const char* field) {
    need(static_cast<size_t>(n), field);
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(b_[at_ + i]) << (8 * i);
    at_ += n;
    return v;
  }
  uint8_t u8(const char* f) { return static_cast<uint8_t>(get(1, f)); }
  uint32_t u32(const char* f) { return static_cast<uint32_t>(get(4, f)); }
  uint64_t u64(const char* f) { return get(8, f); }
  std::string str(const char* field, size_t max) {
    const size_t n = get(2, field);
    if (n > max) {
      fail(std::string("field '") + field + "' is " + std::to_string(n) +
           " bytes, more than the limit of " + std::to_string(max));
    }
    need(n, field);
    std::string s(reinterpret_cast<const char*>(b_.data() + at_), n);
    at_ += n;
    return s;
  }
  std::string raw(const char* field, size_t n) {
    need(n, field);
    std::string s(reinterpret_cast<const char*>(b_.data() + at_), n);
    at_ += n;
    return s;
  }
  void end() {
    if (at_ != b_.size()) {
      fail(std::to_string(b_.size() - at_) + " unexpected trailing bytes");
    }
  }
  [[noreturn]] void fail(const std::string& problem) {
    throw Error(ErrorCode::kMalformed, std::string("malformed ") + what_ + " message: " + problem);
  }

 private:
  void need(size_t n, const char* field) {
    if (b_.size() - at_ < n) {
      fail(std::string("truncated at field '") + field + "' (" + std::to_string(n) +
           " bytes needed, " + std::to_string(b_.size() - at_) + " left)");
    }
  }
  std::span<const uint8_t> b_;
  size_t at_ = 0;
  const char* what_;
};

const char* type_name(uint16_t t) {
  switch (static_cast<MsgType>(t)) {
    case MsgType::kHello: return "HELLO";
    case MsgType::kWelcome: return "WELCOME";
    case MsgType::kDeclare: return "DECLARE";
    case MsgType::kStart: return "START";
    case MsgType::kReady: return "READY";
    case MsgType::kError: return "ERROR";
    case MsgType::kAbort: return "ABORT";
    case MsgType::kBye: return "BYE";
    case MsgType::kStrategy: return "STRATEGY";
    case MsgType::kCtlRequest: return "CTL_REQUEST";
    case MsgType::kCtlReply: return "CTL_REPLY";
    case MsgType::kCollective: return "COLLECTIVE";
  }
  return "unknown";
}

}  // namespace

static_assert(static_cast<uint8_t>(Device::kCpu) == 0 && static_cast<uint8_t>(Device::kCuda) == 1,
              "DECLARE writes Device values as its device codes");

uint8_t dtype_to_wire(DType t) noexcept {
  switch (t) {
    case DType::kFloat32: return 0;
    case DType::kFloat64: return 1;
    case DType::kInt32: return 2;
    case DType::kInt64: return 3;
    case DType::kFloat16:
    case DType::kBFloat16: break;
  }
  return kNoDTypeCode;
}

bool dtype_from_wire(uint8_t code, DType& out) noexcept {
  static constexpr DType kByCode[kNumDTypes] = {DType::kFloat32, DType::kFloat64, DType::kInt32,
                                                DType::kInt64};
  if (code >= kNumDTypes) return false;
  out = kByCode[code];
  return true;
}

std::string check_job_id(std::string_view id) {
  if (id.empty() || id.size() > kMaxJobIdBytes) {
    return "job id must be 1.." + std::to_string(kMaxJobIdBytes) + " characters, got " +
           std::to_string(id.size());
  }
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return "job id may only hold [A-Za-z0-9._-]";
  }
  return "";
}

std::vector<uint8_t> encode(const Hello& m) {
  Writer w(MsgType::kHello);
  w.str(m.job_id, kMaxJobIdBytes);
  w.u32(m.local_rank);
  w.u32(m.local_size);
  w.u32(m.node_rank);
  w.u32(m.num_nodes);
  w.str(m.client_version, 256);
  return w.finish();
}
std::vector<uint8_t> encode(const Welcome& m) {
  Writer w(MsgType::kWelcome);
  w.str(m.daemon_version, 256);
  w.str(m.instance, 256);
  return w.finish();
}
std::vector<uint8_t> encode(const Declare& m) {
  Writer w(MsgType::kDeclare);
  w.u32(m.index);
  w.str(m.name, kMaxTensorNameBytes);
  w.u64(m.count);
  const uint8_t dtype_code = dtype_to_wire(m.dtype);
  if (dtype_code == kNoDTypeCode)
    throw Error(ErrorCode::kInvalidArgument, std::string("DECLARE of tensor '") + m.name + "': dtype " +
                                                 dtype_name(m.dtype) + " has no code in the control protocol");
  w.u8(dtype_code);
  w.u8(static_cast<uint8_t>(m.device));
  w.u32(static_cast<uint32_t>(m.device_index));
  return w.finish();
}
std::vector<uint8_t> encode(const Start& m) {
  Writer w(MsgType::kStart);
  w.u32(m.num_tensors);
  return w.finish();
}
std::vector<uint8_t> encode(const Ready& m) {
  Writer w(MsgType::kReady);
  w.str(m.segment_name, 255);
  w.u64(m.segment_bytes);
  return w.finish();
}
std::vector<uint8_t> encode(const ErrorMsg& m, MsgType type) {
  Writer w(type);
  w.u32(m.code);
  // Reasons are for humans: cut rather than fail.
  w.str(std::string_view(m.message).substr(0, kMaxReasonBytes), kMaxReasonBytes);
  return w.finish();
}
std::vector<uint8_t> encode(const Bye&) { return Writer(MsgType::kBye).finish(); }
std::vector<uint8_t> encode(const StrategyMsg& m) {
  Writer w(MsgType::kStrategy);
  w.str(m.source, kMaxSourceNameBytes);
  w.u32(static_cast<uint32_t>(std::min<size_t>(m.text.size(), UINT32_MAX)));
  if (m.text.size() > kMaxStrategyBytes) {
    throw Error(ErrorCode::kInvalidArgument,
                "strategy text of " + std::to_string(m.text.size()) +
                    " bytes exceeds the limit of " + std::to_string(kMaxStrategyBytes));
  }
  w.raw(m.text);
  return w.finish();
}

std::vector<uint8_t> encode(const CtlRequest& m) {
  Writer w(MsgType::kCtlRequest);
  w.u16(m.ctl_version);
  w.str(m.command, kMaxCtlCommandBytes);
  w.str(m.arg, kMaxCtlArgBytes);
  return w.finish();
}
std::vector<uint8_t> encode(const CtlReply& m) {
  if (m.data.size() > kMaxCtlChunkBytes) {
    throw Error(ErrorCode::kInvalidArgument,
                "CTL_REPLY part of " + std::to_string(m.data.size()) +
                    " bytes exceeds the limit of " + std::to_string(kMaxCtlChunkBytes));
  }
  Writer w(MsgType::kCtlReply);
  w.u32(m.code);
  w.u8(m.last ? 1 : 0);
  w.u32(static_cast<uint32_t>(m.data.size()));
  w.raw(m.data);
  return w.finish();
}
std::vector<uint8_t> encode(const Collective& m) {
  Writer w(MsgType::kCollective);
  w.u8(static_cast<uint8_t>(m.op));
  w.u32(m.tensor);
  w.u64(m.iteration);
  w.u32(m.root);
  w.u64(m.nbytes);
  w.u64(m.tag);
  return w.finish();
}
std::vector<std::vector<uint8_t>> encode_ctl_reply(uint32_t code, std::string_view text) {
  std::vector<std::vector<uint8_t>> out;
  size_t at = 0;
  do {
    const size_t n = std::min(kMaxCtlChunkBytes, text.size() - at);
    out.push_back(encode(CtlReply{code, at + n == text.size(), std::string(text.substr(at, n))}));
    at += n;
  } while (at < text.size());
  return out;
}

Decoded decode(std::span<const uint8_t> bytes) {
  record_input("ipc", bytes.data(), bytes.size());
  Reader h(bytes, "control");
  if (bytes.size() < kHeaderBytes) {
    h.fail("datagram of " + std::to_string(bytes.size()) + " bytes is shorter than the " +
           std::to_string(kHeaderBytes) + "-byte header");
  }
  if (bytes.size() > kMaxMessageBytes) {
    h.fail("datagram of " + std::to_string(bytes.size()) + " bytes exceeds the limit of " +
           std::to_string(kMaxMessageBytes));
  }
  const uint32_t magic = h.u32("magic");
  if (magic != kMagic) h.fail("bad magic 0x" + [&] {
    char b[16];
    std::snprintf(b, sizeof b, "%08x", magic);
    return std::string(b);
  }());
  const auto version = static_cast<uint16_t>(h.get(2, "version"));
  if (version != kProtocolVersion) throw VersionMismatch(version);
  const auto type = static_cast<uint16_t>(h.get(2, "type"));
  const uint32_t payload = h.u32("payload_bytes");
  const uint32_t zero = h.u32("reserved");
  if (payload != bytes.size() - kHeaderBytes) {
    h.fail("header says " + std::to_string(payload) + " payload bytes, datagram holds " +
           std::to_string(bytes.size() - kHeaderBytes));
  }
  if (zero != 0) h.fail("reserved header field is not zero");

  Reader r(bytes.subspan(kHeaderBytes), type_name(type));
  Decoded d{static_cast<MsgType>(type), Bye{}};
  switch (static_cast<MsgType>(type)) {
    case MsgType::kHello: {
      Hello m;
      m.job_id = r.str("job_id", kMaxJobIdBytes);
      m.local_rank = r.u32("local_rank");
      m.local_size = r.u32("local_size");
      m.node_rank = r.u32("node_rank");
      m.num_nodes = r.u32("num_nodes");
      m.client_version = r.str("client_version", 256);
      r.end();
      if (std::string p = check_job_id(m.job_id); !p.empty()) r.fail(p);
      if (m.local_size == 0 || m.local_size > kMaxLocalSize) {
        r.fail("local_size " + std::to_string(m.local_size) + " not in 1.." +
               std::to_string(kMaxLocalSize));
      }
      if (m.local_rank >= m.local_size) {
        r.fail("local_rank " + std::to_string(m.local_rank) + " not below local_size " +
               std::to_string(m.local_size));
      }
      if (m.num_nodes == 0 || m.num_nodes > kMaxNodes) {
        r.fail("num_nodes " + std::to_string(m.num_nodes) + " not in 1.." +
               std::to_string(kMaxNodes));
      }
      if (m.node_rank >= m.num_nodes) {
        r.fail("node_rank " + std::to_string(m.node_rank) + " not below num_nodes " +
               std::to_string(m.num_nodes));
      }
      d.msg = std::move(m);
      break;
    }
    case MsgType::kWelcome: {
      Welcome m;
      m.daemon_version = r.str("daemon_version", 256);
      m.instance = r.str("instance", 256);
      r.end();
      d.msg = std::move(m);
      break;
    }
    case MsgType::kDeclare: {
      Declare m;
      m.index = r.u32("index");
      m.name = r.str("name", kMaxTensorNameBytes);
      m.count = r.u64("count");
      const uint8_t dt = r.u8("dtype");
      const uint8_t dev = r.u8("device");
      m.device_index = static_cast<int32_t>(r.u32("device_index"));
      r.end();
      if (m.index >= kMaxTensors) r.fail("tensor index " + std::to_string(m.index) + " too large");
      if (m.name.empty()) r.fail("empty tensor name");
      if (m.count == 0) r.fail("tensor '" + m.name + "' has 0 elements");
      if (!dtype_from_wire(dt, m.dtype)) r.fail("unknown dtype " + std::to_string(dt));
      if (dev > 1) r.fail("unknown device type " + std::to_string(dev));
      m.device = static_cast<Device>(dev);
      if (m.count > (uint64_t{1} << 40) / dtype_size(m.dtype)) {
        r.fail("tensor '" + m.name + "' of " + std::to_string(m.count) +
               " elements exceeds 1 TiB");
      }
      d.msg = std::move(m);
      break;
    }
    case MsgType::kStart: {
      Start m;
      m.num_tensors = r.u32("num_tensors");
      r.end();
      if (m.num_tensors == 0 || m.num_tensors > kMaxTensors) {
        r.fail("num_tensors " + std::to_string(m.num_tensors) + " not in 1.." +
               std::to_string(kMaxTensors));
      }
      d.msg = m;
      break;
    }
    case MsgType::kReady: {
      Ready m;
      m.segment_name = r.str("segment_name", 255);
      m.segment_bytes = r.u64("segment_bytes");
      r.end();
      if (m.segment_name.empty() || m.segment_name.find('/') != std::string::npos) {
        r.fail("bad segment name '" + m.segment_name + "'");
      }
      d.msg = std::move(m);
      break;
    }
    case MsgType::kError:
    case MsgType::kAbort: {
      ErrorMsg m;
      m.code = r.u32("code");
      m.message = r.str("message", kMaxReasonBytes);
      r.end();
      if (m.code == 0 || m.code > static_cast<uint32_t>(ErrorCode::kInternal)) {
        r.fail("error code " + std::to_string(m.code) + " out of range");
      }
      d.msg = std::move(m);
      break;
    }
    case MsgType::kBye:
      r.end();
      d.msg = Bye{};
      break;
    case MsgType::kStrategy: {
      StrategyMsg m;
      m.source = r.str("source", kMaxSourceNameBytes);
      const uint32_t n = r.u32("text_bytes");
      if (n == 0 || n > kMaxStrategyBytes) {
        r.fail("text_bytes " + std::to_string(n) + " not in 1.." +
               std::to_string(kMaxStrategyBytes));
      }
      m.text = r.raw("text", n);
      r.end();
      d.msg = std::move(m);
      break;
    }
    case MsgType::kCtlRequest: {
      CtlRequest m;
      m.ctl_version = static_cast<uint16_t>(r.get(2, "ctl_version"));
      m.command = r.str("command", kMaxCtlCommandBytes);
      m.arg = r.str("arg", kMaxCtlArgBytes);
      r.end();
      if (m.command.empty()) r.fail("empty command");
      d.msg = std::move(m);
      break;
    }
    case MsgType::kCtlReply: {
      CtlReply m;
      m.code = r.u32("code");
      const uint8_t last = r.u8("last");
      const uint32_t n = r.u32("data_bytes");
      if (n > kMaxCtlChunkBytes) {
        r.fail("data_bytes " + std::to_string(n) + " exceeds " + std::to_string(kMaxCtlChunkBytes));
      }
      m.data = r.raw("data", n);
      r.end();
      if (last > 1) r.fail("last flag " + std::to_string(last) + " is not 0 or 1");
      if (m.code > static_cast<uint32_t>(ErrorCode::kInternal)) {
        r.fail("error code " + std::to_string(m.code) + " out of range");
      }
      m.last = last == 1;
      d.msg = std::move(m);
      break;
    }
    case MsgType::kCollective: {
      Collective m;
      const uint8_t op = r.u8("op");
      m.tensor = r.u32("tensor");
      m.iteration = r.u64("iteration");
      m.root = r.u32("root");
      m.nbytes = r.u64("nbytes");
      m.tag = r.u64("tag");
      r.end();
      if (op != static_cast<uint8_t>(CollectiveOp::kBroadcast) &&
          op != static_cast<uint8_t>(CollectiveOp::kBarrier)) {
        r.fail("unknown collective op " + std::to_string(op));
      }
      m.op = static_cast<CollectiveOp>(op);
      if (m.iteration > static_cast<uint64_t>(INT64_MAX)) {
        r.fail("iteration " + std::to_string(m.iteration) + " exceeds 2^63 - 1");
      }
      if (m.op == CollectiveOp::kBarrier) {
        if (m.tensor != kBarrierTensor || m.root != 0 || m.nbytes != 0 || m.tag != 0)
          r.fail("a barrier carries no tensor, root, size or tag");
      } else {
        if (m.tensor >= kMaxTensors) r.fail("tensor id " + std::to_string(m.tensor) + " too large");
        if (m.root >= kMaxLocalSize * kMaxNodes) r.fail("root rank " + std::to_string(m.root) + " too large");
        if (m.nbytes > (uint64_t{1} << 40)) r.fail("broadcast of " + std::to_string(m.nbytes) + " bytes exceeds 1 TiB");
      }
      d.msg = m;
      break;
    }
    default:
      r.fail("unknown message type " + std::to_string(type));
  }
  return d;
}

}  // namespace bytecomp::ipc
