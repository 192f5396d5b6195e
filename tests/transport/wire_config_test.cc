// The shared pieces without processes: wire header validation, the YAML
// section, Buffer ownership.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <zmq.h>

#include <atomic>

#include "common/config.h"
#include "transport/transport.h"
#include "transport/wire.h"

namespace bytecomp::transport {
namespace {

wire::Limits kLimits{1 << 20, 8};

wire::WireHeader sample() {
  wire::WireHeader h;
  h.kind = wire::Kind::kRequest;
  h.src = 3;
  h.dst = 4;
  h.user = {12, 0xABCD, 0xDEADBEEF, 0x0123456789ABCDEFull, 42};
  h.correlation = 99;
  h.payload_sizes = {0, 5, 1000};
  return h;
}

std::string decode_error(std::vector<std::byte> bytes) {
  wire::WireHeader out;
  std::string err;
  EXPECT_FALSE(wire::decode(bytes, kLimits, out, err));
  return err;
}

TEST(Wire, RoundTripsEveryField) {
  wire::WireHeader h = sample();
  std::vector<std::byte> b = wire::encode(h);
  ASSERT_EQ(b.size(), wire::kFixedBytes + 3 * 8);
  wire::WireHeader d;
  std::string err;
  ASSERT_TRUE(wire::decode(b, kLimits, d, err)) << err;
  EXPECT_EQ(d.kind, h.kind);
  EXPECT_EQ(d.src, 3u);
  EXPECT_EQ(d.dst, 4u);
  EXPECT_EQ(d.user.type, 12);
  EXPECT_EQ(d.user.flags, 0xABCD);
  EXPECT_EQ(d.user.aux, 0xDEADBEEFu);
  EXPECT_EQ(d.user.key, 0x0123456789ABCDEFull);
  EXPECT_EQ(d.user.arg, 42u);
  EXPECT_EQ(d.correlation, 99u);
  EXPECT_EQ(d.payload_sizes, h.payload_sizes);
  // Little-endian on the wire regardless of the host.
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(b.data()), 4), "BCTP");
}

TEST(Wire, RejectsEveryBadField) {
  auto mutate = [](size_t off, uint8_t v) {
    std::vector<std::byte> b = wire::encode(sample());
    b[off] = std::byte{v};
    return b;
  };
  EXPECT_NE(decode_error({}).find("shorter than"), std::string::npos);
  EXPECT_NE(decode_error(mutate(1, 0)).find("bad magic"), std::string::npos);
  EXPECT_NE(decode_error(mutate(4, 2)).find("wire version 2"), std::string::npos);
  EXPECT_NE(decode_error(mutate(5, 0)).find("unknown message kind 0"), std::string::npos);
  EXPECT_NE(decode_error(mutate(5, 6)).find("unknown message kind 6"), std::string::npos);
  EXPECT_NE(decode_error(mutate(6, 9)).find("payload count 9 exceeds"), std::string::npos);
  EXPECT_NE(decode_error(mutate(6, 2)).find("payloads need"), std::string::npos);
  EXPECT_NE(decode_error(mutate(48, 0)).find("declares"), std::string::npos);
  EXPECT_NE(decode_error(mutate(60, 1)).find("reserved field"), std::string::npos);
  EXPECT_NE(decode_error(mutate(17, 0xF1)).find("reserved range"), std::string::npos);
  wire::WireHeader h = sample();
  h.src = kNoNode;
  EXPECT_NE(decode_error(wire::encode(h)).find("source node"), std::string::npos);
  h = sample();
  h.correlation = 0;
  EXPECT_NE(decode_error(wire::encode(h)).find("correlation"), std::string::npos);
  h = sample();
  h.payload_sizes = {1 << 20, 1};
  EXPECT_NE(decode_error(wire::encode(h)).find("past the limit"), std::string::npos);
  h = sample();
  h.payload_sizes = {~0ull, 2};  // a sum that would overflow
  EXPECT_NE(decode_error(wire::encode(h)).find("past the limit"), std::string::npos);
  h = sample();
  h.kind = wire::Kind::kError;
  h.status_code = 0;
  EXPECT_NE(decode_error(wire::encode(h)).find("invalid status code"), std::string::npos);
  std::vector<std::byte> longer = wire::encode(sample());
  longer.push_back(std::byte{0});
  EXPECT_NE(decode_error(longer).find("payloads need"), std::string::npos);
}

TEST(Wire, RandomBytesNeverPass) {
  std::vector<std::byte> b(wire::kFixedBytes + 8);
  uint64_t x = 1;
  for (int round = 0; round < 20000; ++round) {
    for (auto& c : b) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      c = static_cast<std::byte>(x >> 56);
    }
    wire::WireHeader out;
    std::string err;
    EXPECT_FALSE(wire::decode(b, kLimits, out, err));
    EXPECT_FALSE(err.empty());
  }
}

config::Document doc(const std::string& body) {
  return config::Document::parse("version: 1\ntransport:\n" + body, "t.yaml");
}

TransportConfig read(const std::string& body) {
  config::Document d = doc(body);
  config::Reader root = d.root("BCTPTEST");
  config::Reader t = root.section("transport");
  TransportConfig c = read_transport_config(t);
  root.finish();
  return c;
}

std::string read_error(const std::string& body) {
  try {
    read(body);
  } catch (const config::ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(Wire, SplitFramesChecksEveryFrameAgainstItsPayload) {
  wire::WireHeader h;
  h.payload_sizes = {5, 0, 3};
  auto split = [&](std::vector<uint64_t> frames, std::vector<wire::FrameSpan>& spans) {
    std::string error;
    const bool ok = wire::split_frames(
        h, 0, frames.size(), [&](size_t f) { return frames.at(f); }, spans, error);
    return ok ? std::string() : error;
  };
  std::vector<wire::FrameSpan> spans;
  ASSERT_EQ(split({2, 3, 3}, spans), "");
  ASSERT_EQ(spans.size(), 3u);
  EXPECT_EQ(spans[0].first, 0u);
  EXPECT_EQ(spans[0].count, 2u);
  EXPECT_EQ(spans[1].count, 0u);
  EXPECT_EQ(spans[2].first, 2u);
  EXPECT_EQ(spans[2].count, 1u);
  EXPECT_EQ(split({5}, spans), "payload 2 declared 3 bytes but the message ends after 0");
  EXPECT_EQ(split({4, 2, 3}, spans), "payload 0 frame of 2 bytes does not fit the 1 bytes left");
  EXPECT_EQ(split({5, 0, 3}, spans), "payload 2 frame of 0 bytes does not fit the 3 bytes left");
  EXPECT_EQ(split({5, 3, 1, 1}, spans), "2 frames beyond the declared payloads");
}

TEST(TransportConfig, ReadsEveryKey) {
  char pub[41] = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7";
  char sec[41] = "JTKVSB%%)wK0E.X)V>+}o?pNmC{O&4W4b!Ni{Lh6";
  TransportConfig c = read(std::string() +
                           "  backend: zmq\n  node_id: 7\n  listen: [\"tcp://0.0.0.0:7100\", \"ipc:///run/x.sock\"]\n"
                           "  io_threads: 4\n  handler_threads: 2\n  inline_handlers: true\n  wait_spin_us: 35\n"
                           "  heartbeat_interval_ms: 250\n"
                           "  peer_timeout_ms: 2000\n  default_request_timeout_ms: 1500\n"
                           "  max_frame_bytes: 8MiB\n  max_message_bytes: 2GiB\n  max_payloads: 16\n"
                           "  send_queue_messages: 100\n  send_queue_bytes: 1GiB\n"
                           "  receive_queue_messages: 50\n  backpressure: fail\n  send_block_timeout_ms: 10\n"
                           "  curve:\n    enabled: true\n    public_key: \"" + pub + "\"\n    secret_key: \"" + sec +
                           "\"\n    authorized_keys: [\"" + pub + "\"]\n"
                           "  rdma:\n    device: mlx5_0\n    port: 2\n    gid_index: 3\n    recv_buffers: 32\n"
                           "    buffer_bytes: 128KiB\n    eager_limit: 32KiB\n    max_send_wr: 512\n"
                           "    registration_cache_bytes: 2GiB\n");
  EXPECT_EQ(c.node_id, 7u);
  EXPECT_EQ(c.listen.size(), 2u);
  EXPECT_EQ(c.io_threads, 4);
  EXPECT_EQ(c.handler_threads, 2);
  EXPECT_TRUE(c.inline_handlers);
  EXPECT_EQ(c.wait_spin, std::chrono::microseconds{35});
  EXPECT_EQ(c.heartbeat_interval, Millis{250});
  EXPECT_EQ(c.peer_timeout, Millis{2000});
  EXPECT_EQ(c.default_request_timeout, Millis{1500});
  EXPECT_EQ(c.max_frame_bytes, 8u << 20);
  EXPECT_EQ(c.max_message_bytes, 2ull << 30);
  EXPECT_EQ(c.max_payloads, 16u);
  EXPECT_EQ(c.send_queue_messages, 100u);
  EXPECT_EQ(c.receive_queue_messages, 50u);
  EXPECT_EQ(c.backpressure, TransportConfig::Backpressure::kFail);
  EXPECT_TRUE(c.curve.enabled);
  EXPECT_EQ(c.curve.public_key, pub);
  EXPECT_EQ(c.rdma.device, "mlx5_0");
  EXPECT_EQ(c.rdma.buffer_bytes, 128u << 10);
  EXPECT_EQ(c.rdma.registration_cache_bytes, 2ull << 30);
}

TEST(TransportConfig, DefaultsAreValid) {
  TransportConfig c = read("");
  EXPECT_EQ(c.backend, "zmq");
  EXPECT_EQ(c.peer_timeout, Millis{3000});
  EXPECT_NO_THROW(TransportConfig{}.validate());
}

TEST(TransportConfig, ErrorsNameFileKeyAndAcceptedValues) {
  EXPECT_NE(read_error("  backend: tcp\n").find("t.yaml:3:12: key 'transport.backend'"), std::string::npos)
      << read_error("  backend: tcp\n");
  EXPECT_NE(read_error("  io_threads: 99\n").find("accepted: 1..64"), std::string::npos);
  EXPECT_NE(read_error("  wait_spin_us: 5000\n").find("wait_spin_us"), std::string::npos)
      << read_error("  wait_spin_us: 5000\n");
  TransportConfig spin;
  spin.wait_spin = std::chrono::microseconds{-1};
  EXPECT_THROW(spin.validate(), config::ConfigError);
  EXPECT_NE(read_error("  bogus: 1\n").find("bogus"), std::string::npos);
  EXPECT_NE(read_error("  heartbeat_interval_ms: 1000\n  peer_timeout_ms: 1500\n").find("twice"),
            std::string::npos);
  EXPECT_NE(read_error("  backpressure: drop\n").find("block, fail"), std::string::npos)
      << read_error("  backpressure: drop\n");
  EXPECT_NE(read_error("  curve:\n    enabled: true\n").find("curve.public_key"), std::string::npos)
      << read_error("  curve:\n    enabled: true\n");
  char p1[41], s1[41], p2[41], s2[41];
  ASSERT_EQ(zmq_curve_keypair(p1, s1), 0);
  ASSERT_EQ(zmq_curve_keypair(p2, s2), 0);
  std::string mismatch = std::string("  curve:\n    enabled: true\n    public_key: \"") + p1 +
                         "\"\n    secret_key: \"" + s2 + "\"\n";
  EXPECT_NE(read_error(mismatch).find("does not belong"), std::string::npos) << read_error(mismatch);
  EXPECT_NE(read_error("  rdma:\n    buffer_bytes: 8KiB\n").find("eager_limit"), std::string::npos);
  EXPECT_NE(read_error("  max_frame_bytes: 100\n").find("max_frame_bytes"), std::string::npos);
}

TEST(TransportConfig, EnvironmentOverrides) {
  setenv("BCTPTEST_TRANSPORT_IO_THREADS", "9", 1);
  EXPECT_EQ(read("").io_threads, 9);
  setenv("BCTPTEST_TRANSPORT_IO_THREADS", "0", 1);
  EXPECT_NE(read_error("").find("BCTPTEST_TRANSPORT_IO_THREADS"), std::string::npos) << read_error("");
  unsetenv("BCTPTEST_TRANSPORT_IO_THREADS");
}

TEST(Factory, RejectsUnknownBackendAndBadAddresses) {
  TransportConfig c;
  EXPECT_THROW(make_transport("carrier-pigeon", c), Error);
  c.listen = {"udp://1.2.3.4:5"};
  try {
    make_transport("zmq", c);
    ADD_FAILURE() << "bad listen endpoint accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("udp://1.2.3.4:5"), std::string::npos);
  }
  c.listen = {"tcp://127.0.0.1:0"};
  auto t = make_transport("zmq", c);
  EXPECT_THROW(t->add_peer(1, "nonsense"), Error);
  EXPECT_THROW(t->add_peer(t->self(), "tcp://127.0.0.1:1"), Error);
  EXPECT_THROW(t->set_handler(0xF000, nullptr), Error);
  Incoming not_a_request;
  EXPECT_THROW(t->reply(not_a_request, {}, nullptr), Error);
  // Oversized messages fail their completion, never throw.
  Message big;
  big.payloads.resize(c.max_payloads + 1);
  Status s = t->send_wait(1, std::move(big));
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << s.to_string();
  // After shutdown everything completes with kUnavailable.
  t->shutdown();
  EXPECT_EQ(t->send_wait(1, {}).code(), ErrorCode::kUnavailable);
  EXPECT_EQ(t->call(1, {}, Millis{100}).status.code(), ErrorCode::kUnavailable);
}

TEST(Factory, RdmaWithoutDeviceFailsWithTheReason) {
  std::string reason;
  bool built = false;
  for (const std::string& b : available_backends()) built |= b == "rdma";
  if (!built) GTEST_SKIP() << "rdma backend not built (libibverbs/librdmacm missing)";
  if (backend_usable("rdma", &reason)) GTEST_SKIP() << "an RDMA device exists; the backend tests cover it";
  TransportConfig c;
  c.listen = {"rdma://127.0.0.1:0"};
  try {
    make_transport("rdma", c);
    ADD_FAILURE() << "rdma transport created without a device";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnavailable);
    EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
  }
}

TEST(Buffer, ReleasesOnceAfterLastReference) {
  std::atomic<int> released{0};
  char data[16] = "abcdefghijklmno";
  {
    Buffer a = Buffer::wrap(data, sizeof data, [&] { released++; });
    Buffer b = a.slice(2, 3);
    EXPECT_EQ(b.view(), "cde");
    a = Buffer();
    EXPECT_EQ(released.load(), 0);
    EXPECT_THROW(b.slice(2, 2), Error);
    EXPECT_THROW(b.slice(4, 0), Error);
    EXPECT_NO_THROW(b.slice(3, 0));
  }
  EXPECT_EQ(released.load(), 1);
  Buffer c = Buffer::copy_of("xyz");
  EXPECT_THROW(c.mutable_data(), Error);
  Buffer d = Buffer::allocate(4);
  d.mutable_data()[0] = std::byte{1};
  EXPECT_EQ(std::to_integer<int>(d.data()[0]), 1);
}

}  // namespace
}  // namespace bytecomp::transport
