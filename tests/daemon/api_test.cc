// Every misuse of the C API against a real daemon, from in-process clients
// (each client is its own connection, so threads stand in for ranks).
#include <bytecomp/bytecomp.h>
#include <bytecomp/bytecomp.hpp>
#include <gtest/gtest.h>

#include <fcntl.h>

#include <csignal>
#include <cstdio>
#include <fstream>

#include <future>

#include "tests/daemon/harness.h"

using namespace bctest;

namespace {

std::string last() { return bytecomp_last_error(); }

bytecomp_client* connect(const DaemonEnv& env, const char* job, uint32_t rank, uint32_t size,
                         bytecomp_status* status = nullptr, uint32_t daemon_timeout_ms = 0) {
  bytecomp_connect_options o;
  bytecomp_connect_options_init(&o);
  o.socket_path = env.socket().c_str();
  o.job_id = job;
  o.local_rank = rank;
  o.local_size = size;
  o.connect_timeout_ms = 5000;
  o.daemon_timeout_ms = daemon_timeout_ms;
  bytecomp_client* c = nullptr;
  bytecomp_status s = bytecomp_connect(&o, &c);
  if (status != nullptr) *status = s;
  return c;
}

class Api : public ::testing::Test {
 protected:
  void SetUp() override { env_.start(); }
  // Two local ranks of `job`, each with one 4-float tensor "x", started.
  void start_pair(const char* job, bytecomp_client*& a, bytecomp_client*& b) {
    a = connect(env_, job, 0, 2);
    b = connect(env_, job, 1, 2);
    for (auto* c : {a, b}) {
      ASSERT_EQ(bytecomp_declare_tensor(c, "x", 4, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, nullptr),
                BYTECOMP_OK);
    }
    auto fb = std::async(std::launch::async, [&] { return bytecomp_start(b, 5000); });
    ASSERT_EQ(bytecomp_start(a, 5000), BYTECOMP_OK);
    ASSERT_EQ(fb.get(), BYTECOMP_OK);
  }
  DaemonEnv env_{"api"};
};

}  // namespace

TEST_F(Api, DaemonNotRunning) {
  bytecomp_connect_options o;
  bytecomp_connect_options_init(&o);
  const std::string path = (env_.dir() / "nothing.sock").string();
  o.socket_path = path.c_str();
  o.job_id = "j";
  bytecomp_client* c = nullptr;
  EXPECT_EQ(bytecomp_connect(&o, &c), BYTECOMP_ERR_UNAVAILABLE);
  EXPECT_EQ(c, nullptr);
  EXPECT_NE(last().find("is the daemon running"), std::string::npos) << last();
}

TEST_F(Api, BadConnectOptions) {
  bytecomp_client* c = nullptr;
  EXPECT_EQ(bytecomp_connect(nullptr, &c), BYTECOMP_ERR_INVALID_ARGUMENT);
  bytecomp_connect_options o;
  bytecomp_connect_options_init(&o);
  o.socket_path = env_.socket().c_str();
  EXPECT_EQ(bytecomp_connect(&o, &c), BYTECOMP_ERR_INVALID_ARGUMENT);  // no job id
  o.job_id = "has space";
  EXPECT_EQ(bytecomp_connect(&o, &c), BYTECOMP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("[A-Za-z0-9._-]"), std::string::npos) << last();
  o.job_id = "j";
  o.local_rank = 2;
  o.local_size = 2;
  EXPECT_EQ(bytecomp_connect(&o, &c), BYTECOMP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("local_rank 2"), std::string::npos) << last();
  o.local_rank = 0;
  o.struct_size = 4;
  EXPECT_EQ(bytecomp_connect(&o, &c), BYTECOMP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("bytecomp_connect_options_init"), std::string::npos);
  EXPECT_EQ(bytecomp_close(nullptr), BYTECOMP_OK);
}

TEST_F(Api, DeclarationMisuse) {
  bytecomp_client* c = connect(env_, "decl", 0, 1);
  ASSERT_NE(c, nullptr) << last();
  uint32_t id = 99;
  EXPECT_EQ(bytecomp_start(c, 1000), BYTECOMP_ERR_STATE);  // nothing declared
  EXPECT_EQ(bytecomp_declare_tensor(c, "", 1, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, &id),
            BYTECOMP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bytecomp_declare_tensor(c, "z", 0, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, &id),
            BYTECOMP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bytecomp_declare_tensor(c, "d", 1, static_cast<bytecomp_dtype>(9),
                                    BYTECOMP_DEVICE_CPU, 0, &id),
            BYTECOMP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bytecomp_declare_tensor(c, "gpu", 10, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CUDA, 0, &id),
            BYTECOMP_ERR_UNSUPPORTED);
  EXPECT_NE(last().find("GPU"), std::string::npos) << last();
  ASSERT_EQ(bytecomp_declare_tensor(c, "w", 10, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, &id),
            BYTECOMP_OK);
  EXPECT_EQ(id, 0u);
  EXPECT_EQ(bytecomp_declare_tensor(c, "w", 10, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, &id),
            BYTECOMP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("already declared"), std::string::npos);
  void* p = nullptr;
  uint64_t n = 0;
  EXPECT_EQ(bytecomp_tensor_buffer(c, 0, &p, &n), BYTECOMP_ERR_STATE);
  bytecomp_handle h = 0;
  EXPECT_EQ(bytecomp_push_pull(c, 0, 0, &h), BYTECOMP_ERR_STATE);
  EXPECT_NE(last().find("before bytecomp_start"), std::string::npos) << last();
  ASSERT_EQ(bytecomp_start(c, 5000), BYTECOMP_OK) << last();
  EXPECT_EQ(bytecomp_declare_tensor(c, "late", 1, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, &id),
            BYTECOMP_ERR_STATE);
  EXPECT_EQ(bytecomp_start(c, 5000), BYTECOMP_ERR_STATE);
  uint32_t got = 7;
  EXPECT_EQ(bytecomp_tensor_id(c, "w", &got), BYTECOMP_OK);
  EXPECT_EQ(got, 0u);
  EXPECT_EQ(bytecomp_tensor_id(c, "nope", &got), BYTECOMP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bytecomp_close(c), BYTECOMP_OK) << last();
}

TEST_F(Api, PushPullMisuseAndTimeouts) {
  bytecomp_client* a = connect(env_, "pp", 0, 2);
  bytecomp_client* b = connect(env_, "pp", 1, 2);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  for (auto* c : {a, b}) {
    ASSERT_EQ(bytecomp_declare_tensor(c, "x", 4, BYTECOMP_INT32, BYTECOMP_DEVICE_CPU, 0, nullptr),
              BYTECOMP_OK);
  }
  auto fb = std::async(std::launch::async, [&] { return bytecomp_start(b, 5000); });
  ASSERT_EQ(bytecomp_start(a, 5000), BYTECOMP_OK) << last();
  ASSERT_EQ(fb.get(), BYTECOMP_OK);
  int32_t* pa = nullptr;
  int32_t* pb = nullptr;
  uint64_t n = 0;
  ASSERT_EQ(bytecomp_tensor_buffer(a, 0, reinterpret_cast<void**>(&pa), &n), BYTECOMP_OK);
  ASSERT_EQ(n, 16u);
  ASSERT_EQ(bytecomp_tensor_buffer(b, 0, reinterpret_cast<void**>(&pb), &n), BYTECOMP_OK);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(pa) % 64, 0u);
  EXPECT_EQ(bytecomp_tensor_buffer(a, 1, reinterpret_cast<void**>(&pa), &n),
            BYTECOMP_ERR_INVALID_ARGUMENT);
  bytecomp_handle h = 0, h2 = 0;
  EXPECT_EQ(bytecomp_push_pull(a, 5, 0, &h), BYTECOMP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("was not declared"), std::string::npos);
  for (int i = 0; i < 4; ++i) pa[i] = i, pb[i] = 100 * i;
  ASSERT_EQ(bytecomp_push_pull(a, 0, 5, &h), BYTECOMP_OK);
  EXPECT_EQ(bytecomp_push_pull(a, 0, 6, &h2), BYTECOMP_ERR_STATE);  // push twice
  EXPECT_NE(last().find("already has a push_pull in flight"), std::string::npos) << last();
  // Rank 1 has not pushed: the wait times out, the handle stays valid.
  int done = 1;
  EXPECT_EQ(bytecomp_poll(a, h, &done), BYTECOMP_OK);
  EXPECT_EQ(done, 0);
  EXPECT_EQ(bytecomp_wait(a, h, 50), BYTECOMP_ERR_TIMEOUT);
  ASSERT_EQ(bytecomp_push_pull(b, 0, 5, &h2), BYTECOMP_OK);
  EXPECT_EQ(bytecomp_wait(a, h, 5000), BYTECOMP_OK) << last();
  // A zero timeout still collects a completion that has arrived.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  bytecomp_status zs;
  while ((zs = bytecomp_wait(b, h2, 0)) == BYTECOMP_ERR_TIMEOUT &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(zs, BYTECOMP_OK) << last();
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(pa[i], 101 * i);
    EXPECT_EQ(pb[i], 101 * i);
  }
  EXPECT_EQ(bytecomp_wait(a, h, 10), BYTECOMP_ERR_INVALID_ARGUMENT);  // already waited
  EXPECT_EQ(bytecomp_wait(a, 12345, 10), BYTECOMP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bytecomp_push_pull(a, 0, 5, &h), BYTECOMP_ERR_INVALID_ARGUMENT);  // not increasing
  EXPECT_NE(last().find("must increase"), std::string::npos);
  // Ranks disagreeing on the iteration abort the job, with the reason.
  ASSERT_EQ(bytecomp_push_pull(a, 0, 7, &h), BYTECOMP_OK);
  ASSERT_EQ(bytecomp_push_pull(b, 0, 8, &h2), BYTECOMP_OK);
  EXPECT_EQ(bytecomp_wait(a, h, 5000), BYTECOMP_ERR_ABORTED);
  EXPECT_NE(last().find("disagree on the iteration"), std::string::npos) << last();
  EXPECT_EQ(bytecomp_wait(b, h2, 5000), BYTECOMP_ERR_ABORTED);
  EXPECT_EQ(bytecomp_push_pull(a, 0, 9, &h), BYTECOMP_ERR_ABORTED);
  EXPECT_EQ(bytecomp_close(a), BYTECOMP_ERR_ABORTED);
  EXPECT_EQ(bytecomp_close(b), BYTECOMP_ERR_ABORTED);
  EXPECT_TRUE(no_shm_left(env_.shm_prefix()));
}

TEST_F(Api, JobMembershipErrors) {
  bytecomp_status s;
  bytecomp_client* a = connect(env_, "m", 0, 2);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(connect(env_, "m", 0, 2, &s), nullptr);  // rank taken
  EXPECT_EQ(s, BYTECOMP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("already connected"), std::string::npos) << last();
  EXPECT_EQ(connect(env_, "m", 1, 3, &s), nullptr);  // size disagrees
  EXPECT_EQ(s, BYTECOMP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("all local ranks must agree"), std::string::npos) << last();
  // Declarations differ between the ranks: both are told why.
  bytecomp_client* b = connect(env_, "m", 1, 2);
  ASSERT_NE(b, nullptr) << last();
  ASSERT_EQ(bytecomp_declare_tensor(a, "w", 10, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, nullptr),
            BYTECOMP_OK);
  ASSERT_EQ(bytecomp_declare_tensor(b, "w", 11, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, nullptr),
            BYTECOMP_OK);
  auto fa = std::async(std::launch::async, [&] {
    bytecomp_status st = bytecomp_start(a, 5000);
    return std::make_pair(st, last());
  });
  EXPECT_EQ(bytecomp_start(b, 5000), BYTECOMP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("declared different tensors"), std::string::npos) << last();
  auto [sa, msg] = fa.get();
  EXPECT_EQ(sa, BYTECOMP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(msg.find("float32[11]"), std::string::npos) << msg;
  bytecomp_close(a);
  bytecomp_close(b);
}

TEST_F(Api, StartTimesOutWhenARankNeverComes) {
  bytecomp_client* a = connect(env_, "lonely", 0, 2);
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(bytecomp_declare_tensor(a, "w", 1, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, nullptr),
            BYTECOMP_OK);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(bytecomp_start(a, 300), BYTECOMP_ERR_TIMEOUT);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  EXPECT_NE(last().find("local ranks"), std::string::npos) << last();
  uint32_t id;
  EXPECT_EQ(bytecomp_declare_tensor(a, "x", 1, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, &id),
            BYTECOMP_ERR_STATE);
  EXPECT_EQ(bytecomp_close(a), BYTECOMP_ERR_TIMEOUT);
}

TEST_F(Api, GracefulCloseWhileAnotherRankWaitsAbortsIt) {
  bytecomp_client *a = nullptr, *b = nullptr;
  ASSERT_NO_FATAL_FAILURE(start_pair("bye", a, b));
  bytecomp_handle h;
  ASSERT_EQ(bytecomp_push_pull(a, 0, 0, &h), BYTECOMP_OK);
  EXPECT_EQ(bytecomp_close(b), BYTECOMP_OK);
  EXPECT_EQ(bytecomp_wait(a, h, 5000), BYTECOMP_ERR_ABORTED);
  EXPECT_NE(last().find("local rank 1 closed the job"), std::string::npos) << last();
  bytecomp_close(a);
  EXPECT_TRUE(no_shm_left(env_.shm_prefix()));
}

TEST_F(Api, CloseWithOwnPushPullInFlightAbortsTheOthers) {
  bytecomp_client *a = nullptr, *b = nullptr;
  ASSERT_NO_FATAL_FAILURE(start_pair("inflight", a, b));
  bytecomp_handle hb;
  ASSERT_EQ(bytecomp_push_pull(b, 0, 0, &hb), BYTECOMP_OK);
  EXPECT_EQ(bytecomp_close(b), BYTECOMP_OK);  // without waiting for hb
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  bytecomp_handle ha;
  bytecomp_status s = bytecomp_push_pull(a, 0, 0, &ha);
  if (s == BYTECOMP_OK) s = bytecomp_wait(a, ha, 5000);
  EXPECT_EQ(s, BYTECOMP_ERR_ABORTED);
  EXPECT_NE(last().find("local rank 1 closed the job with its push_pull of tensor 'x' "
                        "(iteration 0) still in flight"),
            std::string::npos)
      << last();
  bytecomp_close(a);
  EXPECT_TRUE(no_shm_left(env_.shm_prefix()));
}

TEST_F(Api, CppWrapper) {
  auto run = [&](uint32_t rank) {
    bytecomp::Client c({.job_id = "cpp", .local_rank = rank, .local_size = 2,
                        .socket_path = env_.socket()});
    const uint32_t w = c.declare("w", 3, BYTECOMP_FLOAT64);
    c.start(5000);
    std::span<double> g = c.buffer<double>(w);
    EXPECT_EQ(g.size(), 3u);
    for (uint64_t it = 0; it < 50; ++it) {
      for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<double>(rank + i + it);
      c.push_pull(w, it).wait(5000);
      for (size_t i = 0; i < g.size(); ++i) EXPECT_EQ(g[i], static_cast<double>(1 + 2 * (i + it)));
    }
    EXPECT_THROW(c.declare("late", 1, BYTECOMP_FLOAT32), bytecomp::ClientError);
  };
  auto f = std::async(std::launch::async, run, 1u);
  run(0);
  f.get();
}

TEST_F(Api, MultiNodeJobsAreRefusedUntilTheInterNodePathExists) {
  bytecomp_connect_options o;
  bytecomp_connect_options_init(&o);
  o.socket_path = env_.socket().c_str();
  o.job_id = "multi";
  o.node_rank = 0;
  o.num_nodes = 2;
  bytecomp_client* c = nullptr;
  ASSERT_EQ(bytecomp_connect(&o, &c), BYTECOMP_OK) << last();
  ASSERT_EQ(bytecomp_declare_tensor(c, "w", 10, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, nullptr),
            BYTECOMP_OK);
  EXPECT_EQ(bytecomp_start(c, 5000), BYTECOMP_ERR_UNAVAILABLE);
  EXPECT_NE(last().find("spans 2 nodes"), std::string::npos) << last();
  bytecomp_close(c);
}

#include <sys/mman.h>

#include "client/ipc/shm_layout.h"

namespace {

// Maps the only segment of the env's daemon, as a misbehaving client could.
struct RawSegment {
  explicit RawSegment(const DaemonEnv& env) {
    auto segs = shm_entries(env.shm_prefix());
    EXPECT_EQ(segs.size(), 1u);
    const int fd = ::open(("/dev/shm/" + segs.at(0)).c_str(), O_RDWR);
    bytes = static_cast<size_t>(::lseek(fd, 0, SEEK_END));
    base = static_cast<char*>(::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    ::close(fd);
  }
  ~RawSegment() { ::munmap(base, bytes); }
  char* base = nullptr;
  size_t bytes = 0;
};

bytecomp_client* single_rank_job(const DaemonEnv& env, const char* job) {
  bytecomp_client* c = connect(env, job, 0, 1);
  EXPECT_NE(c, nullptr);
  EXPECT_EQ(bytecomp_declare_tensor(c, "w", 8, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, nullptr),
            BYTECOMP_OK);
  EXPECT_EQ(bytecomp_start(c, 5000), BYTECOMP_OK) << last();
  return c;
}

}  // namespace

TEST_F(Api, CorruptRingCountersAbortTheJobNotTheDaemon) {
  bytecomp_client* c = single_rank_job(env_, "corrupt");
  {
    RawSegment seg(env_);
    auto l = bytecomp::ipc::Layout::compute(1, {32});
    auto* area = reinterpret_cast<bytecomp::ipc::ClientArea*>(seg.base + l.clients_offset);
    area->submit.head.value = 1000;  // far beyond the ring's capacity
  }
  bytecomp_handle h;
  ASSERT_EQ(bytecomp_push_pull(c, 0, 0, &h), BYTECOMP_ERR_INTERNAL);  // ring looks full
  // Wake the engine, as any later push would.
  {
    RawSegment seg(env_);
    reinterpret_cast<bytecomp::ipc::SegmentHeader*>(seg.base)->doorbell.post();
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  bytecomp_status s = BYTECOMP_OK;
  while (std::chrono::steady_clock::now() < deadline &&
         (s = bytecomp_push_pull(c, 0, 1, &h)) != BYTECOMP_ERR_ABORTED) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(s, BYTECOMP_ERR_ABORTED);
  EXPECT_NE(last().find("notification ring corrupt"), std::string::npos) << last();
  bytecomp_close(c);
  EXPECT_TRUE(no_shm_left(env_.shm_prefix()));
  EXPECT_FALSE(env_.daemon().wait(std::chrono::milliseconds(0)).has_value());
}

TEST_F(Api, ForgedSubmissionOfUndeclaredTensorAbortsTheJob) {
  bytecomp_client* c = single_rank_job(env_, "forged");
  {
    RawSegment seg(env_);
    auto l = bytecomp::ipc::Layout::compute(1, {32});
    auto* area = reinterpret_cast<bytecomp::ipc::ClientArea*>(seg.base + l.clients_offset);
    auto* ring = reinterpret_cast<bytecomp::ipc::RingEntry*>(seg.base + l.submit_ring_offset(0));
    ring[0] = {99, 0, 0};
    area->submit.head.value = 1;
    reinterpret_cast<bytecomp::ipc::SegmentHeader*>(seg.base)->doorbell.post();
  }
  bytecomp_handle h;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  bytecomp_status s = BYTECOMP_OK;
  uint64_t it = 0;
  while (std::chrono::steady_clock::now() < deadline &&
         (s = bytecomp_push_pull(c, 0, it++, &h)) != BYTECOMP_ERR_ABORTED) {
    bytecomp_wait(c, h, 10);
  }
  EXPECT_EQ(s, BYTECOMP_ERR_ABORTED);
  EXPECT_NE(last().find("pushed tensor id 99 but only 1 were declared"), std::string::npos)
      << last();
  bytecomp_close(c);
  EXPECT_TRUE(no_shm_left(env_.shm_prefix()));
}

// Issue 28 (3): a stopped daemon keeps its socket open and says nothing.
// Its clients watch its heartbeat in the job's shared memory and fail their
// wait within their own daemon_timeout_ms (1 s here), naming the daemon and
// the cause, long before their wait timeout (20 s). Before that, a busy
// daemon, a long wait for a slow rank and a long pause between calls (each
// longer than the bound) must not trip it.
TEST_F(Api, AStoppedDaemonFailsTheWaitWithinTheDaemonTimeoutNamingIt) {
  constexpr uint32_t kBoundMs = 1000;
  bytecomp_client* a = connect(env_, "silent", 0, 2, nullptr, kBoundMs);
  bytecomp_client* b = connect(env_, "silent", 1, 2, nullptr, kBoundMs);
  ASSERT_NE(a, nullptr) << last();
  ASSERT_NE(b, nullptr) << last();
  constexpr uint64_t kN = 1 << 16;
  for (auto* c : {a, b})
    ASSERT_EQ(bytecomp_declare_tensor(c, "x", kN, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, nullptr),
              BYTECOMP_OK);
  auto fb = std::async(std::launch::async, [&] { return bytecomp_start(b, 5000); });
  ASSERT_EQ(bytecomp_start(a, 5000), BYTECOMP_OK) << last();
  ASSERT_EQ(fb.get(), BYTECOMP_OK);
  float* pa = nullptr;
  float* pb = nullptr;
  uint64_t bytes = 0;
  ASSERT_EQ(bytecomp_tensor_buffer(a, 0, reinterpret_cast<void**>(&pa), &bytes), BYTECOMP_OK);
  ASSERT_EQ(bytecomp_tensor_buffer(b, 0, reinterpret_cast<void**>(&pb), &bytes), BYTECOMP_OK);
  uint64_t it = 0;
  // One iteration of both ranks; rank b pushes after `b_delay`.
  auto iteration = [&](std::chrono::milliseconds b_delay) {
    for (uint64_t i = 0; i < kN; ++i) pa[i] = 1.0f, pb[i] = 2.0f;
    bytecomp_handle ha = 0, hb = 0;
    ASSERT_EQ(bytecomp_push_pull(a, 0, it, &ha), BYTECOMP_OK) << last();
    auto rb = std::async(std::launch::async, [&] {
      std::this_thread::sleep_for(b_delay);
      bytecomp_status st = bytecomp_push_pull(b, 0, it, &hb);
      return st == BYTECOMP_OK ? bytecomp_wait(b, hb, 20000) : st;
    });
    ASSERT_EQ(bytecomp_wait(a, ha, 20000), BYTECOMP_OK) << last();
    ASSERT_EQ(rb.get(), BYTECOMP_OK);
    ASSERT_EQ(pa[kN - 1], 3.0f);
    ++it;
  };
  // Busy: back-to-back iterations of 256 KiB for twice the bound.
  const auto busy_until = std::chrono::steady_clock::now() + 2 * std::chrono::milliseconds(kBoundMs);
  while (std::chrono::steady_clock::now() < busy_until) {
    iteration(std::chrono::milliseconds(0));
    if (HasFatalFailure()) return;
  }
  // A slow rank: a waits 2.5 bounds for b, the daemon alive all along.
  iteration(std::chrono::milliseconds(5 * kBoundMs / 2));
  if (HasFatalFailure()) return;
  // A long pause in the training loop (no call into the library).
  std::this_thread::sleep_for(std::chrono::milliseconds(2 * kBoundMs));
  iteration(std::chrono::milliseconds(0));
  if (HasFatalFailure()) return;

  // Now the daemon stops: both ranks push and wait.
  env_.daemon().signal(SIGSTOP);
  // kill() only queues the stop: wait until every thread is stopped ('T').
  auto state = [&] {
    std::ifstream f("/proc/" + std::to_string(env_.daemon().pid()) + "/stat");
    std::string line;
    std::getline(f, line);
    const auto close = line.rfind(')');
    return close == std::string::npos || close + 2 >= line.size() ? '?' : line[close + 2];
  };
  const auto stop_by = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (state() != 'T' && std::chrono::steady_clock::now() < stop_by)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_EQ(state(), 'T');
  const auto stopped = std::chrono::steady_clock::now();
  bytecomp_handle ha = 0, hb = 0;
  ASSERT_EQ(bytecomp_push_pull(a, 0, it, &ha), BYTECOMP_OK) << last();
  ASSERT_EQ(bytecomp_push_pull(b, 0, it, &hb), BYTECOMP_OK) << last();
  auto wb = std::async(std::launch::async, [&] {
    bytecomp_status st = bytecomp_wait(b, hb, 20000);
    return std::make_pair(st, last());
  });
  const bytecomp_status sa = bytecomp_wait(a, ha, 20000);
  const std::string ea = last();
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - stopped).count();
  const auto [sb, eb] = wb.get();
  const double took_b = std::chrono::duration<double>(std::chrono::steady_clock::now() - stopped).count();
  env_.daemon().signal(SIGCONT);
  std::printf("stopped daemon noticed after %.2f s (rank 0), %.2f s (rank 1): %s\n", took, took_b,
              ea.c_str());
  EXPECT_EQ(sa, BYTECOMP_ERR_UNAVAILABLE) << ea;
  EXPECT_EQ(sb, BYTECOMP_ERR_UNAVAILABLE) << eb;
  const std::string who = "bytecompd (pid " + std::to_string(env_.daemon().pid()) + ") at " + env_.socket();
  for (const std::string& e : {ea, eb}) {
    EXPECT_NE(e.find(who + " not responding for "), std::string::npos) << e;
    EXPECT_NE(e.find("stopped or hung"), std::string::npos) << e;
  }
  // Not before the bound (the heartbeat moved up to 250 ms before the stop),
  // and well within the wait's own 20 s.
  EXPECT_GE(took, kBoundMs / 1000.0 - 0.3) << ea;
  EXPECT_LT(took, kBoundMs / 1000.0 + 1.5) << ea;
  EXPECT_LT(took_b, kBoundMs / 1000.0 + 1.5) << eb;
  EXPECT_EQ(bytecomp_close(a), BYTECOMP_ERR_UNAVAILABLE);
  EXPECT_EQ(bytecomp_close(b), BYTECOMP_ERR_UNAVAILABLE);
  // The daemon, continued, notices both ranks gone and frees the job.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!no_shm_left(env_.shm_prefix()) && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_TRUE(no_shm_left(env_.shm_prefix()));
  // And serves the next job.
  bytecomp_client* c = connect(env_, "after", 0, 1);
  ASSERT_NE(c, nullptr) << last();
  EXPECT_EQ(bytecomp_close(c), BYTECOMP_OK);
}
