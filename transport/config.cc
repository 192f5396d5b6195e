#include <zmq.h>

#include <array>

#include "common/config.h"
#include "transport/transport.h"

namespace bytecomp::transport {
namespace {

using config::Range;

bool is_z85_key(const std::string& key) {
  std::array<uint8_t, 32> raw{};
  return key.size() == 40 && zmq_z85_decode(raw.data(), key.c_str()) != nullptr;
}

Millis read_ms(config::Reader& r, std::string_view key, Millis value, int64_t min, int64_t max) {
  int64_t v = value.count();
  r.get(key, v, Range<int64_t>{min, max});
  return Millis{v};
}

}  // namespace

std::string_view to_string(PeerState state) noexcept {
  switch (state) {
    case PeerState::kUnknown: return "unknown";
    case PeerState::kConnecting: return "connecting";
    case PeerState::kAlive: return "alive";
    case PeerState::kLost: return "lost";
  }
  return "?";
}

void TransportConfig::validate() const {
  auto bad = [](const std::string& what) {
    throw config::ConfigError("transport config: " + what);
  };
  if (backend != "zmq" && backend != "rdma")
    bad("backend '" + backend + "' is unknown (accepted: zmq, rdma)");
  if (node_id == kNoNode) bad("node_id " + std::to_string(node_id) + " is reserved");
  if (io_threads < 1 || io_threads > 64)
    bad("io_threads " + std::to_string(io_threads) + " is out of range (accepted: 1..64)");
  if (handler_threads < 1 || handler_threads > 64)
    bad("handler_threads " + std::to_string(handler_threads) +
        " is out of range (accepted: 1..64)");
  if (heartbeat_interval.count() < 10)
    bad("heartbeat_interval_ms " + std::to_string(heartbeat_interval.count()) +
        " is too small (accepted: >= 10)");
  if (peer_timeout < 2 * heartbeat_interval)
    bad("peer_timeout_ms " + std::to_string(peer_timeout.count()) +
        " must be at least twice heartbeat_interval_ms (" +
        std::to_string(heartbeat_interval.count()) + ")");
  if (default_request_timeout.count() < 1)
    bad("default_request_timeout_ms must be >= 1");
  if (max_frame_bytes < 4096 || max_frame_bytes > (1ull << 31))
    bad("max_frame_bytes " + std::to_string(max_frame_bytes) +
        " is out of range (accepted: 4096..2147483648)");
  if (max_message_bytes < 1 || max_message_bytes > (1ull << 40))
    bad("max_message_bytes " + std::to_string(max_message_bytes) + " is out of range");
  if (max_payloads < 1 || max_payloads > 4096)
    bad("max_payloads " + std::to_string(max_payloads) + " is out of range (accepted: 1..4096)");
  if (wait_spin.count() < 0 || wait_spin.count() > 1000)
    bad("wait_spin_us " + std::to_string(wait_spin.count()) +
        " is out of range (accepted: 0..1000)");
  if (send_queue_messages < 1) bad("send_queue_messages must be >= 1");
  if (send_queue_bytes < 1) bad("send_queue_bytes must be >= 1");
  if (receive_queue_messages < 1) bad("receive_queue_messages must be >= 1");
  if (send_block_timeout.count() < 0) bad("send_block_timeout_ms must be >= 0");
  for (const std::string& l : listen)
    if (l.empty()) bad("listen holds an empty endpoint");
  if (curve.enabled) {
    if (!is_z85_key(curve.public_key))
      bad("curve.public_key is not a 40-character Z85 key");
    if (!is_z85_key(curve.secret_key))
      bad("curve.secret_key is not a 40-character Z85 key");
    std::array<char, 41> derived{};
    if (zmq_curve_public(derived.data(), curve.secret_key.c_str()) != 0 ||
        curve.public_key != derived.data())
      bad("curve.public_key does not belong to curve.secret_key");
    for (const std::string& k : curve.authorized_keys)
      if (!is_z85_key(k)) bad("curve.authorized_keys holds '" + k + "', not a Z85 key");
  }
  if (rdma.recv_buffers < 2 || rdma.recv_buffers > 16384)
    bad("rdma.recv_buffers out of range (accepted: 2..16384)");
  if (rdma.buffer_bytes < 4096 || rdma.buffer_bytes > (64ull << 20))
    bad("rdma.buffer_bytes out of range (accepted: 4096..67108864)");
  if (rdma.eager_limit + 64 + 8ull * max_payloads > rdma.buffer_bytes)
    bad("rdma.eager_limit must leave room for the header inside rdma.buffer_bytes");
}

TransportConfig read_transport_config(config::Reader& r) {
  TransportConfig c;
  r.get_enum("backend", c.backend, {"zmq", "rdma"});
  r.get("node_id", c.node_id, Range<uint32_t>{0, kNoNode - 1});
  if (r.has("listen")) {
    c.listen.clear();
    r.get("listen", c.listen);
  }
  r.get("io_threads", c.io_threads, Range<int>{1, 64});
  r.get("handler_threads", c.handler_threads, Range<int>{1, 64});
  r.get("inline_handlers", c.inline_handlers);
  r.get("local_ipc", c.local_ipc);
  int64_t spin_us = c.wait_spin.count();
  r.get("wait_spin_us", spin_us, Range<int64_t>{0, 1000});
  c.wait_spin = std::chrono::microseconds{spin_us};
  c.heartbeat_interval = read_ms(r, "heartbeat_interval_ms", c.heartbeat_interval, 10, 600000);
  c.peer_timeout = read_ms(r, "peer_timeout_ms", c.peer_timeout, 20, 3600000);
  c.default_request_timeout =
      read_ms(r, "default_request_timeout_ms", c.default_request_timeout, 1, 86400000);
  r.get_bytes("max_frame_bytes", c.max_frame_bytes, Range<uint64_t>{4096, 1ull << 31});
  r.get_bytes("max_message_bytes", c.max_message_bytes, Range<uint64_t>{1, 1ull << 40});
  r.get("max_payloads", c.max_payloads, Range<uint32_t>{1, 4096});
  r.get("send_queue_messages", c.send_queue_messages, Range<uint32_t>{1, 1u << 24});
  r.get_bytes("send_queue_bytes", c.send_queue_bytes, Range<uint64_t>{1, 1ull << 40});
  r.get("receive_queue_messages", c.receive_queue_messages, Range<uint32_t>{1, 1u << 24});
  std::string bp = "block";
  r.get_enum("backpressure", bp, {"block", "fail"});
  c.backpressure = bp == "block" ? TransportConfig::Backpressure::kBlock
                                 : TransportConfig::Backpressure::kFail;
  c.send_block_timeout = read_ms(r, "send_block_timeout_ms", c.send_block_timeout, 0, 3600000);

  config::Reader cv = r.section("curve");
  cv.get("enabled", c.curve.enabled)
      .get("public_key", c.curve.public_key)
      .get("secret_key", c.curve.secret_key)
      .get("authorized_keys", c.curve.authorized_keys);
  if (c.curve.enabled) {
    if (!is_z85_key(c.curve.public_key))
      cv.fail("public_key", "is missing or not a Z85 key", "40 Z85 characters");
    if (!is_z85_key(c.curve.secret_key))
      cv.fail("secret_key", "is missing or not a Z85 key", "40 Z85 characters");
    std::array<char, 41> derived{};
    if (zmq_curve_public(derived.data(), c.curve.secret_key.c_str()) != 0 ||
        c.curve.public_key != derived.data())
      cv.fail("public_key", "does not belong to curve.secret_key",
              "the public half of secret_key");
    for (const std::string& k : c.curve.authorized_keys)
      if (!is_z85_key(k))
        cv.fail("authorized_keys", "holds '" + k + "', not a Z85 key", "40 Z85 characters");
  }
  cv.finish();

  config::Reader rd = r.section("rdma");
  rd.get("device", c.rdma.device)
      .get("port", c.rdma.port, Range<int>{1, 255})
      .get("gid_index", c.rdma.gid_index, Range<int>{0, 255})
      .get("recv_buffers", c.rdma.recv_buffers, Range<uint32_t>{2, 16384})
      .get_bytes("buffer_bytes", c.rdma.buffer_bytes, Range<uint64_t>{4096, 64ull << 20})
      .get_bytes("eager_limit", c.rdma.eager_limit, Range<uint64_t>{0, 64ull << 20})
      .get("max_send_wr", c.rdma.max_send_wr, Range<uint32_t>{16, 32768})
      .get_bytes("registration_cache_bytes", c.rdma.registration_cache_bytes,
                 Range<uint64_t>{1ull << 20, 1ull << 40});
  rd.finish();

  if (c.peer_timeout < 2 * c.heartbeat_interval)
    r.fail("peer_timeout_ms",
           std::to_string(c.peer_timeout.count()) + " is less than twice heartbeat_interval_ms (" +
               std::to_string(c.heartbeat_interval.count()) + ")",
           ">= 2 * heartbeat_interval_ms");
  if (c.rdma.eager_limit + 64 + 8ull * c.max_payloads > c.rdma.buffer_bytes)
    rd.fail("eager_limit", "eager_limit plus the header does not fit in buffer_bytes",
            "eager_limit <= buffer_bytes - header");
  r.finish();
  c.validate();
  return c;
}

}  // namespace bytecomp::transport
