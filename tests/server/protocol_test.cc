// The typed cluster messages (server/protocol.h): every message survives its
// own to_message/from_message, header fields keep one meaning, and malformed
// messages are refused naming the message and what was wrong.
#include "server/protocol.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>

namespace bytecomp::server {
namespace {

using transport::Buffer;
using transport::Message;

JobSpec spec() {
  JobSpec s;
  s.name = "job";
  s.nodes = {100, 101};
  s.tensors = {{"g", 1000, compress::DType::kFloat32}};
  s.strategy_yaml = "version: 1\n";
  s.start_iteration = 3;
  s.peer_address = "tcp://10.0.0.1:5000";
  s.auto_spec_yaml = "version: 1\nmode: auto\n";
  return s;
}

proto::Admission admission() {
  proto::Admission a;
  a.name = "job";
  a.uid = 9;
  a.nodes = {100, 101};
  a.tensors = {{"g", 1000, compress::DType::kFloat32}};
  a.partition_bytes = 1 << 20;
  a.servers = {{7, "tcp://127.0.0.1:9000", 2}};
  a.digest = 42;
  a.peer_addresses = {"a", "b"};
  return a;
}

// Wire bytes of a message: every header field and every payload.
std::string wire(const Message& m) {
  std::string s = std::to_string(m.header.type) + "/" + std::to_string(m.header.flags) + "/" +
                  std::to_string(m.header.aux) + "/" + std::to_string(m.header.key) + "/" +
                  std::to_string(m.header.arg);
  for (const Buffer& b : m.payloads) s += "|" + std::string(b.view());
  return s;
}

template <class M>
void expect_round_trip(const M& m) {
  const Message once = proto::to_message(m);
  EXPECT_EQ(once.header.type, M::kType);
  const Message twice = proto::to_message(proto::from_message<M>(once));
  EXPECT_EQ(wire(once), wire(twice)) << "message type 0x" << std::hex << M::kType;
}

TEST(ProtocolTest, EveryMessageSurvivesItsOwnCodec) {
  expect_round_trip(proto::Register{spec()});
  expect_round_trip(proto::Barrier{9, 4});
  expect_round_trip(proto::SetStrategy{9, 12, "version: 1\n"});
  expect_round_trip(proto::Leave{9, true, "local rank 1 died"});
  expect_round_trip(proto::Leave{9, false, ""});
  expect_round_trip(proto::AutoProfile{9, 2, "profile", "spec"});
  expect_round_trip(proto::AutoReplan{9, 40, "drift"});
  expect_round_trip(proto::ServerHello{{7, "tcp://127.0.0.1:9000", 2}});
  expect_round_trip(proto::AbortRequest{9, "node 101 died"});
  expect_round_trip(proto::JobSetup{admission()});
  expect_round_trip(proto::JobEnd{9, ""});
  expect_round_trip(proto::StrategyPrepare{9, 7, true, ""});
  expect_round_trip(proto::StrategyUpdate{9, 7, "version: 1\n"});
  expect_round_trip(proto::JobAborted{9, "aborted"});
  expect_round_trip(proto::AutoProfileRequest{9, 1, 40, "link slower"});
  proto::AutoDecision d;
  d.uid = 9;
  d.epoch = 1;
  d.predicted_us = 1234.5;
  d.strategy_yaml = "version: 1\n";
  d.text = "why";
  expect_round_trip(d);
  expect_round_trip(proto::Push{9, (uint64_t{1} << 32) | 2, 4, Buffer::copy_of("abcd")});
  expect_round_trip(proto::Pull{9, 3, 4});
  expect_round_trip(proto::Broadcast{9, 3, 4, {1, 8, 0xabc}, true, Buffer::copy_of("12345678")});
  expect_round_trip(proto::Broadcast{9, 3, 4, {1, 8, 0xabc}, false, {}});
  expect_round_trip(proto::StatsRequest{});
  expect_round_trip(proto::MetricsRequest{});
  expect_round_trip(proto::Probe{16, 8});
}

TEST(ProtocolTest, FieldsComeBackWithTheirValues) {
  const auto d = proto::from_message<proto::AutoDecision>(proto::to_message(
      proto::AutoDecision{9, 3, false, 1234.5, "s", "d", "t", "j"}));
  EXPECT_EQ(d.uid, 9u);
  EXPECT_EQ(d.epoch, 3u);
  EXPECT_EQ(d.predicted_us, 1234.5);  // not truncated to whole microseconds
  EXPECT_EQ(d.timeline_json, "j");
  const auto l = proto::from_message<proto::Leave>(proto::to_message(proto::Leave{9, true, "why"}));
  EXPECT_TRUE(l.abort);
  EXPECT_EQ(l.reason, "why");
  const auto r = proto::from_message<proto::Register>(proto::to_message(proto::Register{spec()}));
  EXPECT_EQ(r.spec.name, "job");
  EXPECT_EQ(r.spec.peer_address, "tcp://10.0.0.1:5000");
  EXPECT_EQ(r.spec.auto_spec_yaml, "version: 1\nmode: auto\n");
}

TEST(ProtocolTest, HeaderKeyAndArgAreUsedByDataMessagesOnly) {
  // Control messages carry epochs, iterations and counts in their payload.
  for (const Message& m : {proto::to_message(proto::AutoProfileRequest{9, 5, 40, "r"}),
                           proto::to_message(proto::AutoDecision{9, 5, false, 77, "", "", "", ""}),
                           proto::to_message(proto::SetStrategy{9, 12, ""}),
                           proto::to_message(proto::Barrier{9, 4}),
                           proto::to_message(proto::Probe{16, 0})}) {
    EXPECT_EQ(m.header.key, 0u);
    EXPECT_EQ(m.header.arg, 0u);
    EXPECT_EQ(m.header.flags, 0u);
  }
  const Message push = proto::to_message(proto::Push{9, 77, 12, Buffer::copy_of("abcd")});
  EXPECT_EQ(push.header.aux, 9u);
  EXPECT_EQ(push.header.key, 77u);
  EXPECT_EQ(push.header.arg, 12u);
}

void expect_malformed(const std::function<void()>& f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "accepted; expected a refusal naming '" << part << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kMalformed) << e.what();
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(ProtocolTest, MalformedMessagesAreRefusedNamingWhatWasWrong) {
  Message m = proto::to_message(proto::SetStrategy{9, 12, "x"});
  expect_malformed([&] { (void)proto::from_message<proto::StrategyUpdate>(m); },
                   "strategy update: message type 0x5103");
  Message keyed = m;
  keyed.header.key = 5;
  expect_malformed([&] { (void)proto::from_message<proto::SetStrategy>(keyed); },
                   "set strategy: header key/arg set");
  Message flagged = m;
  flagged.header.flags = 1;
  expect_malformed([&] { (void)proto::from_message<proto::SetStrategy>(flagged); },
                   "set strategy: header flags");
  Message two = m;
  two.payloads.push_back(Buffer::copy_of("extra"));
  expect_malformed([&] { (void)proto::from_message<proto::SetStrategy>(two); },
                   "set strategy: 2 payloads (expected 1)");
  Message trailing = m;
  trailing.payloads[0] = Buffer::copy_of(std::string(m.payloads[0].view()) + "z");
  expect_malformed([&] { (void)proto::from_message<proto::SetStrategy>(trailing); },
                   "unexpected trailing bytes");
  Message truncated = m;
  truncated.payloads[0] = Buffer::copy_of(std::string(m.payloads[0].view().substr(0, 5)));
  expect_malformed([&] { (void)proto::from_message<proto::SetStrategy>(truncated); },
                   "truncated at field 'iteration'");
  Message old = m;
  std::string bytes(m.payloads[0].view());
  bytes[0] = 1;  // version 1: the header-field layout before the typed messages
  old.payloads[0] = Buffer::copy_of(bytes);
  expect_malformed([&] { (void)proto::from_message<proto::SetStrategy>(old); },
                   "protocol version 1 (accepted: 2)");
  Message leave = proto::to_message(proto::Leave{9, true, "x"});
  std::string lb(leave.payloads[0].view());
  lb[2] = 7;
  leave.payloads[0] = Buffer::copy_of(lb);
  expect_malformed([&] { (void)proto::from_message<proto::Leave>(leave); }, "abort 7");
  // A root broadcast without its bytes, a pull with a payload.
  Message root = proto::to_message(proto::Broadcast{9, 3, 4, {1, 8, 0}, true, Buffer::copy_of("12345678")});
  root.payloads.pop_back();
  expect_malformed([&] { (void)proto::from_message<proto::Broadcast>(root); },
                   "broadcast: 1 payloads (expected 2)");
  Message pull = proto::to_message(proto::Pull{9, 3, 4});
  pull.payloads.push_back(Buffer::copy_of("x"));
  expect_malformed([&] { (void)proto::from_message<proto::Pull>(pull); }, "pull: 1 payloads");
  // A cluster-level message with a job uid.
  Message stats = proto::to_message(proto::StatsRequest{});
  stats.header.aux = 3;
  expect_malformed([&] { (void)proto::from_message<proto::StatsRequest>(stats); },
                   "stats: header aux 3");
}

TEST(ProtocolTest, ErrorRepliesCarryTheirCodeInThePayload) {
  const Message e = proto::error_reply(ErrorCode::kAborted, "job 'j' aborted: node 3 died");
  EXPECT_EQ(e.header.aux, 0u);
  const Status s = proto::reply_status(e);
  EXPECT_EQ(s.code(), ErrorCode::kAborted);
  EXPECT_EQ(s.message(), "job 'j' aborted: node 3 died");
  EXPECT_TRUE(proto::reply_status(proto::ok_reply()).ok());
  Message bad = e;
  bad.payloads[0] = Buffer::copy_of("\x02\x00\x01");
  EXPECT_EQ(proto::reply_status(bad).code(), ErrorCode::kMalformed);
}

TEST(ProtocolTest, ProbeBoundsAreCheckedBeforeAnythingIsAllocated) {
  const Message ok = proto::probe_answer(proto::to_message(proto::Probe{16, 8}));
  EXPECT_TRUE(proto::reply_status(ok).ok());
  EXPECT_EQ(ok.payload_bytes(), 16u);
  const Message big = proto::probe_answer(proto::to_message(proto::Probe{proto::kMaxProbeBytes + 1, 0}));
  const Status s = proto::reply_status(big);
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("at most"), std::string::npos) << s.message();
}

}  // namespace

TEST(ProtocolTest, ShmMessagesCarryTheirByteRangesAndRefuseBadOnes) {
  expect_round_trip(proto::ShmAttach{9, "boot/4026531840", "bytecomp-ps.9.100.0.77", 4096});
  expect_round_trip(proto::ShmPush{9, (uint64_t{1} << 32) | 2, 4, 128, 4000});
  expect_round_trip(proto::ShmPull{9, 3, 4, 256, 4096});
  const auto a = proto::from_message<proto::ShmAttach>(
      proto::to_message(proto::ShmAttach{9, "h", "bytecomp-ps.9.100.0.77", 4096}));
  EXPECT_EQ(a.uid, 9u);
  EXPECT_EQ(a.host, "h");
  EXPECT_EQ(a.segment, "bytecomp-ps.9.100.0.77");
  EXPECT_EQ(a.bytes, 4096u);
  const auto p = proto::from_message<proto::ShmPush>(
      proto::to_message(proto::ShmPush{9, 77, 12, 128, 4000}));
  EXPECT_EQ(p.key, 77u);
  EXPECT_EQ(p.iteration, 12u);
  EXPECT_EQ(p.offset, 128u);
  EXPECT_EQ(p.length, 4000u);
  const auto q = proto::from_message<proto::ShmPull>(
      proto::to_message(proto::ShmPull{9, 77, 12, 256, 8192}));
  EXPECT_EQ(q.offset, 256u);
  EXPECT_EQ(q.capacity, 8192u);
  // A range past the end of the address space, a missing range, a wrong
  // type, a short range.
  expect_malformed([&] {
    (void)proto::from_message<proto::ShmPush>(
        proto::to_message(proto::ShmPush{9, 77, 12, UINT64_MAX - 10, 4000}));
  }, "shm push: offset 18446744073709551605 + length 4000 overflows");
  Message bare = proto::to_message(proto::ShmPull{9, 77, 12, 0, 8});
  bare.payloads.clear();
  expect_malformed([&] { (void)proto::from_message<proto::ShmPull>(bare); },
                   "shm pull: 0 payloads");
  Message other = proto::to_message(proto::ShmPull{9, 77, 12, 0, 8});
  expect_malformed([&] { (void)proto::from_message<proto::ShmPush>(other); }, "shm push: message type");
  Message shortm = proto::to_message(proto::ShmPush{9, 77, 12, 0, 8});
  shortm.payloads[0] = shortm.payloads[0].slice(0, 12);
  expect_malformed([&] { (void)proto::from_message<proto::ShmPush>(shortm); }, "length");
  // The pull's reply.
  const proto::ShmAnswer ans{4000, true};
  EXPECT_EQ(proto::decode_shm_answer(proto::encode(ans).view()), ans);
  std::string bad(proto::encode(ans).view());
  bad.back() = 7;
  expect_malformed([&] { (void)proto::decode_shm_answer(bad); }, "in_segment 7");
}

}  // namespace bytecomp::server
