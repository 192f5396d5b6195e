// The RDMA backend's device-free codecs (transport/rdma/control.h): control
// header layout and validation, the connection hello, work-request ids and
// endpoints. Runs without an RDMA device or libibverbs.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "common/error.h"
#include "transport/rdma/control.h"
#include "transport/wire.h"

namespace bytecomp::transport::rdma {
namespace {

template <class T>
T read_at(const std::vector<std::byte>& b, size_t off) {
  T v;
  std::memcpy(&v, b.data() + off, sizeof v);
  return v;
}

Ctl sample_ctl() {
  Ctl c;
  c.op = static_cast<uint8_t>(Op::kCts);
  c.credits = 0xBEEF;
  c.rdv_id = 0x0102030405060708ull;
  c.addr = 0x1122334455667788ull;
  c.rkey = 0xA1B2C3D4u;
  c.slot = 0x00ABCDEFu;
  c.length = 64ull << 20;
  return c;
}

TEST(RdmaControl, CtlHasTheDocumentedLayout) {
  std::vector<std::byte> b(sizeof(Ctl));
  encode_ctl(sample_ctl(), b.data());
  ASSERT_EQ(b.size(), 40u);
  EXPECT_EQ(read_at<uint32_t>(b, 0), 0x44524342u);  // "BCRD"
  EXPECT_EQ(read_at<uint8_t>(b, 4), 1);             // version
  EXPECT_EQ(read_at<uint8_t>(b, 5), 3);             // kCts
  EXPECT_EQ(read_at<uint16_t>(b, 6), 0xBEEF);
  EXPECT_EQ(read_at<uint64_t>(b, 8), 0x0102030405060708ull);
  EXPECT_EQ(read_at<uint64_t>(b, 16), 0x1122334455667788ull);
  EXPECT_EQ(read_at<uint32_t>(b, 24), 0xA1B2C3D4u);
  EXPECT_EQ(read_at<uint32_t>(b, 28), 0x00ABCDEFu);
  EXPECT_EQ(read_at<uint64_t>(b, 32), 64ull << 20);
}

TEST(RdmaControl, CtlRoundTripsWithTrailingBytes) {
  std::vector<std::byte> b(sizeof(Ctl) + 100, std::byte{0x5A});
  const Ctl in = sample_ctl();
  encode_ctl(in, b.data());
  Ctl out;
  std::string error;
  ASSERT_TRUE(decode_ctl(b.data(), b.size(), out, error)) << error;
  EXPECT_EQ(out.op, in.op);
  EXPECT_EQ(out.credits, in.credits);
  EXPECT_EQ(out.rdv_id, in.rdv_id);
  EXPECT_EQ(out.addr, in.addr);
  EXPECT_EQ(out.rkey, in.rkey);
  EXPECT_EQ(out.slot, in.slot);
  EXPECT_EQ(out.length, in.length);
}

TEST(RdmaControl, CtlDecodeRejectsShortAndForeignHeaders) {
  std::vector<std::byte> b(sizeof(Ctl));
  encode_ctl(sample_ctl(), b.data());
  Ctl out;
  std::string error;
  EXPECT_FALSE(decode_ctl(b.data(), sizeof(Ctl) - 1, out, error));
  EXPECT_EQ(error, "control message of 39 bytes");
  EXPECT_FALSE(decode_ctl(b.data(), 0, out, error));
  EXPECT_EQ(error, "control message of 0 bytes");

  std::vector<std::byte> bad = b;
  bad[0] = std::byte{0};
  EXPECT_FALSE(decode_ctl(bad.data(), bad.size(), out, error));
  EXPECT_NE(error.find("bad magic"), std::string::npos) << error;

  bad = b;
  bad[4] = std::byte{7};
  EXPECT_FALSE(decode_ctl(bad.data(), bad.size(), out, error));
  EXPECT_EQ(error, "control header with bad magic or version 7");
}

TEST(RdmaControl, WireHeaderLengthComesFromItsPayloadCount) {
  wire::WireHeader h;
  h.src = 1;
  h.dst = 2;
  h.payload_sizes = {10, 0, 4096};
  std::vector<std::byte> b = wire::encode(h);
  ASSERT_EQ(b.size(), wire::kFixedBytes + 3 * 8);
  const size_t exact = b.size();
  b.resize(exact + 4106);  // the eager payload follows
  size_t len = 0;
  std::string error;
  ASSERT_TRUE(wire_header_bytes(b.data(), b.size(), len, error)) << error;
  EXPECT_EQ(len, exact);
  ASSERT_TRUE(wire_header_bytes(b.data(), exact, len, error)) << error;
  EXPECT_EQ(len, exact);

  EXPECT_FALSE(wire_header_bytes(b.data(), exact - 1, len, error));
  EXPECT_EQ(error, "wire header runs past the message");
  EXPECT_FALSE(wire_header_bytes(b.data(), wire::kFixedBytes - 1, len, error));
  EXPECT_EQ(error, "message shorter than a wire header");
}

TEST(RdmaControl, RequestHelloIsChecked) {
  Hello good;
  good.node = 3;
  good.recv_slots = 64;
  Hello got;
  EXPECT_EQ(check_request_hello(&good, sizeof good, 1, got), "");
  EXPECT_EQ(got.node, 3u);
  EXPECT_EQ(got.recv_slots, 64u);

  EXPECT_EQ(check_request_hello(nullptr, 0, 1, got), "connection request without a ByteComp hello");
  EXPECT_EQ(check_request_hello(&good, sizeof good - 1, 1, got),
            "connection request without a ByteComp hello");
  Hello h = good;
  h.magic = 0x12345678u;
  EXPECT_EQ(check_request_hello(&h, sizeof h, 1, got), "connection request with a bad magic");
  h = good;
  h.version = 2;
  EXPECT_EQ(check_request_hello(&h, sizeof h, 1, got), "connection request with protocol version 2");
  h = good;
  h.node = kNoNode;
  EXPECT_EQ(check_request_hello(&h, sizeof h, 1, got),
            "connection request from invalid node id " + std::to_string(kNoNode));
  EXPECT_EQ(check_request_hello(&good, sizeof good, 3, got), "connection request from invalid node id 3");
  h = good;
  h.recv_slots = 1;
  EXPECT_EQ(check_request_hello(&h, sizeof h, 1, got), "connection request offering 1 receive slots");
}

TEST(RdmaControl, AcceptedHelloMustNameTheExpectedNode) {
  Hello h;
  h.node = 5;
  h.recv_slots = 16;
  Hello got;
  EXPECT_TRUE(accepted_hello_matches(&h, sizeof h, 5, got));
  EXPECT_EQ(got.recv_slots, 16u);
  EXPECT_FALSE(accepted_hello_matches(&h, sizeof h, 6, got));
  EXPECT_FALSE(accepted_hello_matches(nullptr, 0, 5, got));
  EXPECT_EQ(got.node, kNoNode);  // nothing was read
  EXPECT_FALSE(accepted_hello_matches(&h, sizeof h - 1, 5, got));
  Hello v = h;
  v.version = 9;
  EXPECT_FALSE(accepted_hello_matches(&v, sizeof v, 5, got));
}

TEST(RdmaControl, WorkRequestIdsRoundTrip) {
  for (WrKind kind : {kWrRecv, kWrSend, kWrWrite, kWrCtl}) {
    const uint64_t id = wr_id(0xFEDCBA98u, kind, 0x123456u);
    EXPECT_EQ(wr_serial(id), 0xFEDCBA98u);
    EXPECT_EQ(wr_kind(id), kind);
    EXPECT_EQ(wr_index(id), 0x123456u);
  }
  // The index has 24 bits: higher bits never reach the kind or the serial.
  const uint64_t id = wr_id(7, kWrCtl, 0xFF000001u);
  EXPECT_EQ(wr_serial(id), 7u);
  EXPECT_EQ(wr_kind(id), kWrCtl);
  EXPECT_EQ(wr_index(id), 1u);
}

TEST(RdmaControl, EndpointsAreParsedOrRejectedByName) {
  Endpoint ep = parse_endpoint("rdma://10.0.0.7:7000", "listen endpoint");
  EXPECT_EQ(ep.host, "10.0.0.7");
  EXPECT_EQ(ep.port, "7000");
  ep = parse_endpoint("rdma://host.example:0", "peer address");
  EXPECT_EQ(ep.host, "host.example");
  EXPECT_EQ(ep.port, "0");
  for (const char* bad : {"tcp://10.0.0.7:7000", "rdma://:7000", "rdma://10.0.0.7:", "rdma://10.0.0.7", ""}) {
    try {
      parse_endpoint(bad, "peer address");
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      const std::string msg = e.what();
      EXPECT_NE(msg.find(std::string("peer address '") + bad + "'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("accepted: rdma://host:port"), std::string::npos) << msg;
    }
  }
}

}  // namespace
}  // namespace bytecomp::transport::rdma
