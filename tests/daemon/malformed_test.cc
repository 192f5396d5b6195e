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

// Issue 18: oversized declarations are refused, naming the limit, before
// anything proportional to them is allocated: a tensor of more than 1 TiB
// (a count whose byte size would overflow included), a name over 1024
// bytes, a tensor index past 2^20, more than 64 MiB of declarations on one
// connection, and a job larger than shm.max_job_bytes (1 MiB here) at START,
// before its segment exists. The daemon's RSS stays far below what any of
// them asked for, and it keeps serving.
TEST(Malformed, OversizedDeclarationsAreRefusedBeforeAnyAllocation) {
  DaemonEnv env("big");
  env.start();
  struct Case {
    const char* name;
    std::vector<std::vector<uint8_t>> msgs;
    const char* expect;
  };
  std::vector<Case> cases;
  cases.push_back({"tib", {hello("big1"), ipc::encode(ipc::Declare{0, "w", (1ull << 38) + 1})},
                   "exceeds 1 TiB"});
  ipc::Declare f64{0, "w", 1ull << 62};
  f64.dtype = ipc::DType::kFloat64;  // 2^62 x 8 bytes: the byte size overflows 64 bits
  cases.push_back({"overflow", {hello("big2"), ipc::encode(f64)}, "exceeds 1 TiB"});
  ipc::Declare max_count{0, "w", ~0ull};
  cases.push_back({"max-count", {hello("big3"), ipc::encode(max_count)}, "exceeds 1 TiB"});
  // ipc::encode refuses such a name itself: widen a 1024-byte one by hand
  // (u16 name length at payload offset 4, payload length in the header).
  auto long_name = ipc::encode(ipc::Declare{0, std::string(1024, 'n'), 1});
  long_name[20] = 1025 & 0xff;
  long_name[21] = 1025 >> 8;
  long_name.insert(long_name.begin() + 22, 'n');
  long_name[8] += 1;
  cases.push_back({"name", {hello("big4"), long_name}, "more than the limit of 1024"});
  cases.push_back({"index", {hello("big5"), ipc::encode(ipc::Declare{1u << 20, "w", 1})},
                   "tensor index 1048576 too large"});
  cases.push_back({"start-count", {hello("big6"), ipc::encode(ipc::Start{(1u << 20) + 1})},
                   "START"});
  for (const auto& c : cases) {
    auto [text, closed] = exchange(env.socket(), c.msgs);
    EXPECT_NE(text.find(c.expect), std::string::npos) << c.name << ": got '" << text << "'";
    EXPECT_TRUE(closed) << c.name;
  }

  // 64 MiB of names and metadata on one connection: ~1 KiB names, one
  // datagram each, until the daemon refuses.
  {
    const int fd = raw_connect(env.socket());
    ASSERT_GE(fd, 0);
    auto h = hello("big7");
    ASSERT_EQ(::send(fd, h.data(), h.size(), MSG_NOSIGNAL), static_cast<ssize_t>(h.size()));
    std::vector<uint8_t> buf(ipc::kMaxMessageBytes);
    std::string text;
    uint32_t sent = 0;
    for (; sent < 80000 && text.empty(); ++sent) {
      auto d = ipc::encode(ipc::Declare{sent, std::string(1000, 'a') + std::to_string(sent), 1});
      if (::send(fd, d.data(), d.size(), MSG_NOSIGNAL) < 0) break;  // closed after the ERROR
      if (sent % 1024 == 0) {
        const ssize_t n = ::recv(fd, buf.data(), buf.size(), MSG_DONTWAIT);
        if (n > 0) {
          auto m = ipc::decode(std::span<const uint8_t>(buf.data(), static_cast<size_t>(n)));
          if (m.type == ipc::MsgType::kError) text = std::get<ipc::ErrorMsg>(m.msg).message;
        }
      }
    }
    for (int i = 0; text.empty() && i < 50; ++i) {
      const ssize_t n = ::recv(fd, buf.data(), buf.size(), 0);
      if (n <= 0) break;
      auto m = ipc::decode(std::span<const uint8_t>(buf.data(), static_cast<size_t>(n)));
      if (m.type == ipc::MsgType::kError) text = std::get<ipc::ErrorMsg>(m.msg).message;
    }
    ::close(fd);
    EXPECT_NE(text.find("declarations exceed 64 MiB of names and metadata"), std::string::npos)
        << "after " << sent << " declarations: '" << text << "'";
    EXPECT_GT(sent, 60000u);  // refused at the limit, not before
  }

  // A job of 4 MiB x 2 ranks against a daemon restarted with 1 MiB.
  env.daemon().signal(SIGTERM);
  ASSERT_TRUE(env.daemon().wait(std::chrono::seconds(10)).has_value());
  // A drop-in (daemon.yaml.d/): shm.max_job_bytes 1 MiB, the smallest accepted.
  std::filesystem::create_directories(env.dir() / "daemon.yaml.d");
  std::ofstream(env.dir() / "daemon.yaml.d" / "10-small.yaml")
      << "version: 1\nshm:\n  max_job_bytes: 1MiB\n";
  env.start();
  auto a = env.worker("toobig", 0, 2, 1, "f32:1048576");
  auto b = env.worker("toobig", 1, 2, 1, "f32:1048576");
  EXPECT_NE(a->wait(std::chrono::seconds(30)), std::optional<int>(0)) << a->output();
  EXPECT_NE(b->wait(std::chrono::seconds(30)), std::optional<int>(0)) << b->output();
  EXPECT_NE(a->output().find("more than shm.max_job_bytes 1048576"), std::string::npos)
      << a->output();
  EXPECT_TRUE(no_shm_left(env.shm_prefix()));

  // Nothing of the above was allocated: the daemon holds well under the
  // smallest request (1 TiB, 64 MiB, 8 MiB).
  const std::string status = read_file("/proc/" + std::to_string(env.daemon().pid()) + "/status");
  const auto at = status.find("VmRSS:");
  ASSERT_NE(at, std::string::npos);
  EXPECT_LT(std::stoull(status.substr(at + 6)), 48ull * 1024) << status.substr(at, 40);
  EXPECT_FALSE(env.daemon().wait(std::chrono::milliseconds(0)).has_value());
  auto c = env.worker("after-big", 0, 1, 5, "f32:100");
  EXPECT_EQ(c->wait(std::chrono::seconds(30)), std::optional<int>(0)) << c->output();
}
