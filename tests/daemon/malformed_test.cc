// Malformed control messages sent on a raw socket: each gets an ERROR reply
// naming the problem and the connection is closed; the daemon keeps serving.
#include <gtest/gtest.h>

#include "client/ipc/protocol.h"
#include "tests/daemon/harness.h"

using namespace bctest;
namespace ipc = bytecomp::ipc;

namespace {

int raw_connect(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, path.c_str(), sizeof a.sun_path - 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return -1;
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

// Sends the datagrams, returns the daemon's ERROR text ("" if none) and
// whether it then closed the connection.
std::pair<std::string, bool> exchange(const std::string& path,
                                      const std::vector<std::vector<uint8_t>>& msgs) {
  const int fd = raw_connect(path);
  EXPECT_GE(fd, 0);
  for (const auto& m : msgs) ::send(fd, m.data(), m.size(), MSG_NOSIGNAL);
  std::string text;
  std::vector<uint8_t> buf(ipc::kMaxMessageBytes);
  bool closed = false;
  for (;;) {
    const ssize_t n = ::recv(fd, buf.data(), buf.size(), 0);
    if (n == 0) {
      closed = true;
      break;
    }
    if (n < 0) break;  // timeout: not closed
    auto d = ipc::decode(std::span<const uint8_t>(buf.data(), static_cast<size_t>(n)));
    if (d.type == ipc::MsgType::kError) text = std::get<ipc::ErrorMsg>(d.msg).message;
  }
  ::close(fd);
  return {text, closed};
}

std::vector<uint8_t> hello(const std::string& job = "mal", uint32_t rank = 0, uint32_t size = 1) {
  ipc::Hello h;
  h.job_id = job;
  h.local_rank = rank;
  h.local_size = size;
  return ipc::encode(h);
}

}  // namespace

TEST(Malformed, EachBadMessageGetsAClearErrorAndTheDaemonSurvives) {
  DaemonEnv env("mal");
  env.start();
  struct Case {
    const char* name;
    std::vector<std::vector<uint8_t>> msgs;
    const char* expect;
  };
  std::vector<Case> cases;
  cases.push_back({"short", {{1, 2, 3}}, "shorter than the 16-byte header"});
  auto bad_magic = hello();
  bad_magic[0] ^= 0xff;
  cases.push_back({"magic", {bad_magic}, "bad magic"});
  auto v2 = hello();
  v2[4] = 2;
  cases.push_back({"version", {v2}, "protocol version 2"});
  auto len = hello();
  len[8] += 1;
  cases.push_back({"length", {len}, "payload bytes"});
  auto trunc = hello();
  trunc.resize(trunc.size() - 3);
  trunc[8] -= 3;
  cases.push_back({"truncated", {trunc}, "truncated at field"});
  auto trailing = hello();
  trailing.push_back(0);
  trailing[8] += 1;
  cases.push_back({"trailing", {trailing}, "trailing bytes"});
  auto type = hello();
  type[6] = 99;
  cases.push_back({"type", {type}, "unknown message type 99"});
  auto strlen_big = hello();
  strlen_big[16] = 0xff;  // job id length field
  strlen_big[17] = 0xff;
  cases.push_back({"strlen", {strlen_big}, "more than the limit"});
  cases.push_back({"rank", {hello("mal", 3, 2)}, "local_rank 3 not below local_size 2"});
  cases.push_back({"jobid", {hello("a/b")}, "[A-Za-z0-9._-]"});
  cases.push_back({"declare-first", {ipc::encode(ipc::Declare{0, "w", 1})}, "DECLARE outside"});
  cases.push_back({"hello-twice", {hello("mal2"), hello("mal2")}, "HELLO sent twice"});
  cases.push_back({"index", {hello("mal3"), ipc::encode(ipc::Declare{4, "w", 1})},
                   "DECLARE index 4, expected 0"});
  cases.push_back({"zero", {hello("mal4"), ipc::encode(ipc::Declare{0, "w", 0})}, "0 elements"});
  cases.push_back({"start-count",
                   {hello("mal5"), ipc::encode(ipc::Declare{0, "w", 1}), ipc::encode(ipc::Start{2})},
                   "START says 2 tensors, 1 were declared"});
  cases.push_back({"server-msg", {hello("mal6"), ipc::encode(ipc::Ready{"x", 1})},
                   "may not send this message type"});
  cases.push_back({"strategy-first", {ipc::encode(ipc::StrategyMsg{"s", "version: 1\n"})},
                   "STRATEGY outside the declaration phase"});
  cases.push_back({"strategy-twice",
                   {hello("mal7"), ipc::encode(ipc::StrategyMsg{"s", "version: 1\n"}),
                    ipc::encode(ipc::StrategyMsg{"s", "version: 1\n"})},
                   "STRATEGY sent twice"});
  cases.push_back({"oversize", {std::vector<uint8_t>(ipc::kMaxMessageBytes + 100, 0)},
                   "exceeds the limit"});
  for (const auto& c : cases) {
    auto [text, closed] = exchange(env.socket(), c.msgs);
    EXPECT_NE(text.find(c.expect), std::string::npos) << c.name << ": got '" << text << "'";
    EXPECT_TRUE(closed) << c.name;
  }
  EXPECT_FALSE(env.daemon().wait(std::chrono::milliseconds(0)).has_value());
  // Still serving real clients, and nothing left in /dev/shm.
  auto a = env.worker("after", 0, 2, 10, "f32:100");
  auto b = env.worker("after", 1, 2, 10, "f32:100");
  EXPECT_EQ(a->wait(std::chrono::seconds(30)), std::optional<int>(0)) << a->output();
  EXPECT_EQ(b->wait(std::chrono::seconds(30)), std::optional<int>(0)) << b->output();
  EXPECT_TRUE(no_shm_left(env.shm_prefix()));
}

TEST(Malformed, SilentConnectionsAndIncompleteJobsTimeOut) {
  DaemonEnv env("silent");
  env.start({"BYTECOMPD_CONTROL_SETUP_TIMEOUT_MS=300"});
  const auto t0 = std::chrono::steady_clock::now();
  auto [text, closed] = exchange(env.socket(), {});
  EXPECT_NE(text.find("no HELLO within"), std::string::npos) << text;
  EXPECT_TRUE(closed);
  // One of two ranks starts; the daemon gives up on the job by itself.
  auto [text2, closed2] = exchange(
      env.socket(),
      {hello("half", 0, 2), ipc::encode(ipc::Declare{0, "w", 1}), ipc::encode(ipc::Start{1})});
  EXPECT_NE(text2.find("1 of 2 local ranks connected, 1 started"), std::string::npos) << text2;
  EXPECT_TRUE(closed2);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(4));
}
