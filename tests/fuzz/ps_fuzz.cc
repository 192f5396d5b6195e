// libFuzzer target for the parameter server's control messages
// (server/protocol.h): input byte 0 picks the message, the rest is its
// payload.
//   0 kRegister (node -> coordinator): Reader + read_spec + end
//   1 admission (coordinator -> node, kJobSetup to servers): decode_admission
//   2 kServerHello (server -> coordinator): decode_server_info
//   3 a reply: u16 header type, u32 aux, then the payload: reply_status
//   0xB0 (only that value, so the other inputs keep their meaning):
//     kBroadcast's BroadcastMeta: decode_broadcast_meta
//   0xB1 (likewise): kShmPull's reply, ShmAnswer: decode_shm_answer
//   0x40 + i (i < the number of typed messages, proto::AllMessages): the
//     i-th typed message's from_message(), the rest of the input being a
//     whole transport message (typed_message() below: header fields, then
//     payloads); an accepted one must survive to_message/from_message
//     unchanged.
// Push and pull payloads are compressed buffers (compress_fuzz) or raw fp32
// whose length is checked against the partition; kSetStrategy's payload is
// strategy YAML (strategy_fuzz). Error(kMalformed) is a correct rejection; a
// crash, a sanitizer report, another exception, or an accepted message
// whose re-encoding does not decode to the same encoding is a bug.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz_common.h"
#include "server/protocol.h"

namespace proto = bytecomp::server::proto;
using bytecomp::Error;
using bytecomp::ErrorCode;

namespace {

std::string spec_bytes(const bytecomp::server::JobSpec& s) {
  proto::Writer w;
  proto::write_spec(w, s);
  return w.bytes();
}

void check_code(const Error& e) {
  if (e.code() != ErrorCode::kMalformed) bcfuzz::broken("ps", e.what());
}

// A transport message from fuzz bytes: u16 flags, u32 aux, u64 key, u64 arg,
// u8 payload count (mod 4); each payload but the last as u32 length + bytes
// (clipped to what is left), the last one the rest.
bytecomp::transport::Message typed_message(bcfuzz::Bytes& in, uint16_t type) {
  bytecomp::transport::Message m;
  m.header.type = type;
  m.header.flags = in.u16();
  m.header.aux = in.u32();
  m.header.key = in.u32() | (uint64_t{in.u32()} << 32);
  m.header.arg = in.u32() | (uint64_t{in.u32()} << 32);
  const unsigned n = in.u8() % 4;
  for (unsigned i = 0; i < n; ++i) {
    std::string p;
    if (i + 1 < n) {
      const auto bytes = in.take(in.u32());
      p.assign(bytes.begin(), bytes.end());
    } else {
      const auto rest = in.rest();
      p.assign(reinterpret_cast<const char*>(rest.data()), rest.size());
    }
    m.payloads.push_back(bytecomp::transport::Buffer::copy_of(p));
  }
  return m;
}

// Header and payload bytes: what the wire carries.
std::string wire_of(const bytecomp::transport::Message& m) {
  std::string s = std::to_string(m.header.type) + "/" + std::to_string(m.header.flags) + "/" +
                  std::to_string(m.header.aux) + "/" + std::to_string(m.header.key) + "/" +
                  std::to_string(m.header.arg);
  for (const auto& b : m.payloads) s += "|" + std::to_string(b.size()) + ":" + std::string(b.view());
  return s;
}

template <class M>
void fuzz_typed(bcfuzz::Bytes& in) {
  const bytecomp::transport::Message m = typed_message(in, M::kType);
  M first;
  try {
    first = proto::from_message<M>(m);
  } catch (const Error& e) {
    check_code(e);
    return;
  }
  const std::string once = wire_of(proto::to_message(first));
  try {
    if (wire_of(proto::to_message(proto::from_message<M>(proto::to_message(first)))) != once)
      bcfuzz::broken("ps", "typed message not stable");
  } catch (const Error& e) {
    bcfuzz::broken("ps", std::string("re-encoded typed message does not decode: ") + e.what());
  }
}

template <class... M>
bool fuzz_nth(proto::MessageList<M...>, size_t i, bcfuzz::Bytes& in) {
  size_t k = 0;
  bool hit = false;
  ((k++ == i ? (fuzz_typed<M>(in), hit = true) : false), ...);
  return hit;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string payload(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] >= 0x40 && data[0] < 0x80) {
    bcfuzz::Bytes in(data + 1, size - 1);
    if (fuzz_nth(proto::AllMessages{}, data[0] - 0x40u, in)) return 0;
  }
  if (data[0] == 0xB0) {
    proto::BroadcastMeta m;
    try {
      m = proto::decode_broadcast_meta(payload);
    } catch (const Error& e) {
      check_code(e);
      return 0;
    }
    const std::string once(proto::encode(m).view());
    try {
      if (!(proto::decode_broadcast_meta(once) == m)) bcfuzz::broken("ps", "broadcast meta not stable");
    } catch (const Error& e) {
      bcfuzz::broken("ps", std::string("re-encoded broadcast meta does not decode: ") + e.what());
    }
    return 0;
  }
  if (data[0] == 0xB1) {
    proto::ShmAnswer a;
    try {
      a = proto::decode_shm_answer(payload);
    } catch (const Error& e) {
      check_code(e);
      return 0;
    }
    try {
      if (!(proto::decode_shm_answer(proto::encode(a).view()) == a))
        bcfuzz::broken("ps", "shm answer not stable");
    } catch (const Error& e) {
      bcfuzz::broken("ps", std::string("re-encoded shm answer does not decode: ") + e.what());
    }
    return 0;
  }
  switch (data[0] % 4) {
    case 0: {
      bytecomp::server::JobSpec s;
      try {
        proto::Reader r(payload, "register");
        s = proto::read_spec(r);
        r.end();
      } catch (const Error& e) {
        check_code(e);
        return 0;
      }
      const std::string once = spec_bytes(s);
      try {
        proto::Reader r(once, "register");
        if (spec_bytes(proto::read_spec(r)) != once) bcfuzz::broken("ps", "register not stable");
        r.end();
      } catch (const Error& e) {
        bcfuzz::broken("ps", std::string("re-encoded register does not decode: ") + e.what());
      }
      break;
    }
    case 1: {
      proto::Admission a;
      try {
        a = proto::decode_admission(payload);
      } catch (const Error& e) {
        check_code(e);
        return 0;
      }
      const std::string once(proto::encode(a).view());
      try {
        if (std::string(proto::encode(proto::decode_admission(once)).view()) != once)
          bcfuzz::broken("ps", "admission not stable");
      } catch (const Error& e) {
        bcfuzz::broken("ps", std::string("re-encoded admission does not decode: ") + e.what());
      }
      break;
    }
    case 2: {
      bytecomp::server::ServerInfo s;
      try {
        s = proto::decode_server_info(payload);
      } catch (const Error& e) {
        check_code(e);
        return 0;
      }
      const std::string once(proto::encode(s).view());
      try {
        if (std::string(proto::encode(proto::decode_server_info(once)).view()) != once)
          bcfuzz::broken("ps", "server hello not stable");
      } catch (const Error& e) {
        bcfuzz::broken("ps", std::string("re-encoded server hello does not decode: ") + e.what());
      }
      break;
    }
    case 3: {
      bcfuzz::Bytes in(data + 1, size - 1);
      bytecomp::transport::Message m;
      m.header.type = in.u16();
      m.header.aux = in.u32();
      const auto text = in.rest();
      if (!text.empty())
        m.payloads.push_back(bytecomp::transport::Buffer::copy_of(
            std::string_view(reinterpret_cast<const char*>(text.data()), text.size())));
      const bytecomp::Status st = proto::reply_status(m);
      if (m.header.type == proto::kOkReply ? !st.ok() : st.ok())
        bcfuzz::broken("ps", "reply status does not follow the reply type");
      break;
    }
  }
  return 0;
}
