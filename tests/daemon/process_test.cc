// End-to-end tests with real processes: bytecompd + several bc_worker
// processes, real sockets and real shared memory.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <sstream>

#include "tests/daemon/harness.h"

using namespace bctest;

namespace {

constexpr auto kRun = std::chrono::seconds(60);

void expect_ok(Process& p) {
  auto st = p.wait(kRun);
  ASSERT_TRUE(st.has_value()) << "worker still running: " << p.output();
  EXPECT_EQ(*st, 0) << p.output();
  EXPECT_NE(p.output().find("ok"), std::string::npos) << p.output();
}

}  // namespace

TEST(Daemon, ExactSumsOverManyIterationsAndDtypes) {
  DaemonEnv env("sums");
  env.write_config("", "  partition_bytes: 64KiB\n");
  env.start();
  // 1 element to 4 MiB, mixed dtypes, odd sizes (partition tails).
  const std::string spec = "f32:1,f64:3,i32:1000,i64:4099,f32:1048583,f64:20001";
  std::vector<std::unique_ptr<Process>> w;
  for (int r = 0; r < 3; ++r) w.push_back(env.worker("sums", r, 3, 300, spec));
  for (auto& p : w) expect_ok(*p);
  EXPECT_TRUE(no_shm_left(env.shm_prefix()));
}

TEST(Daemon, SixtyFourMiBTensorExactSums) {
  DaemonEnv env("big");
  env.start();
  const std::string spec = "f32:16777216,f32:1";  // 64 MiB + 1 element
  auto a = env.worker("big", 0, 2, 100, spec);
  auto b = env.worker("big", 1, 2, 100, spec);
  expect_ok(*a);
  expect_ok(*b);
  EXPECT_TRUE(no_shm_left(env.shm_prefix()));
}

TEST(Daemon, ClientThreadsShareOneClient) {
  DaemonEnv env("threads");
  env.start();
  const std::string spec = "f32:1,f32:4096,i64:100000,f64:7";
  auto a = env.worker("thr", 0, 2, 200, spec, {"--threads"});
  auto b = env.worker("thr", 1, 2, 200, spec, {"--threads"});
  expect_ok(*a);
  expect_ok(*b);
}

TEST(Daemon, SegmentIsPrivateToTheUser) {
  DaemonEnv env("mode");
  env.start();
  auto a = env.worker("mode", 0, 2, 1000000, "f32:1000");
  auto b = env.worker("mode", 1, 2, 1000000, "f32:1000");
  ASSERT_TRUE(a->wait_output("running", 20s)) << a->output();
  auto segs = shm_entries(env.shm_prefix());
  ASSERT_EQ(segs.size(), 1u);
  struct stat st{};
  ASSERT_EQ(::stat(("/dev/shm/" + segs[0]).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(st.st_uid, ::geteuid());
  env.daemon().signal(SIGTERM);
  EXPECT_EQ(env.daemon().wait(10s), std::optional<int>(0)) << env.daemon().output();
}

TEST(Daemon, KilledClientAbortsJobForOthersAndFreesEverything) {
  DaemonEnv env("kill");
  env.start();
  std::vector<std::unique_ptr<Process>> w;
  for (int r = 0; r < 3; ++r) w.push_back(env.worker("kill", r, 3, 1000000, "f32:1,f32:100000"));
  for (auto& p : w) ASSERT_TRUE(p->wait_output("running", 20s)) << p->output();
  ASSERT_EQ(shm_entries(env.shm_prefix()).size(), 1u);
  const auto t0 = std::chrono::steady_clock::now();
  w[1]->signal(SIGKILL);
  for (int r : {0, 2}) {
    auto st = w[r]->wait(5s);
    ASSERT_TRUE(st.has_value()) << "rank " << r << " did not notice: " << w[r]->output();
    // 10 + BYTECOMP_ERR_ABORTED: the job was aborted; the message names the rank.
    EXPECT_EQ(*st, 16) << w[r]->output();
    EXPECT_NE(w[r]->output().find("local rank 1"), std::string::npos) << w[r]->output();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  EXPECT_TRUE(no_shm_left(env.shm_prefix()));
  // The daemon keeps serving: a new job with the same id works.
  auto a = env.worker("kill", 0, 2, 20, "f32:10");
  auto b = env.worker("kill", 1, 2, 20, "f32:10");
  expect_ok(*a);
  expect_ok(*b);
  EXPECT_FALSE(env.daemon().wait(0ms).has_value());
}

TEST(Daemon, KilledDaemonIsReportedAndRestartCleansUp) {
  DaemonEnv env("kd");
  env.start();
  auto a = env.worker("kd", 0, 2, 1000000, "f32:1,f32:50000");
  auto b = env.worker("kd", 1, 2, 1000000, "f32:1,f32:50000");
  ASSERT_TRUE(a->wait_output("running", 20s));
  ASSERT_TRUE(b->wait_output("running", 20s));
  env.daemon().signal(SIGKILL);
  for (auto* p : {a.get(), b.get()}) {
    auto st = p->wait(5s);
    ASSERT_TRUE(st.has_value()) << p->output();
    EXPECT_EQ(*st, 10 + 7) << p->output();  // BYTECOMP_ERR_UNAVAILABLE
    EXPECT_NE(p->output().find("connection to bytecompd"), std::string::npos) << p->output();
  }
  // The clients removed the dead daemon's segment.
  EXPECT_TRUE(no_shm_left(env.shm_prefix()));
  // Restart on the same (stale) socket path: it serves again.
  env.start();
  auto c = env.worker("kd", 0, 2, 30, "f64:1000");
  auto d = env.worker("kd", 1, 2, 30, "f64:1000");
  expect_ok(*c);
  expect_ok(*d);
}

TEST(Daemon, StaleSegmentsOfDeadPredecessorRemovedAtStart) {
  DaemonEnv env("stale");
  // A segment named as a crashed daemon's (pid that cannot exist) and one of
  // a live process (this test), which must survive.
  const std::string dead = env.shm_prefix() + "999999999.0";
  const std::string live = env.shm_prefix() + std::to_string(::getpid()) + ".0";
  for (const auto& n : {dead, live}) {
    std::ofstream("/dev/shm/" + n) << "x";
  }
  env.start();
  auto segs = shm_entries(env.shm_prefix());
  EXPECT_EQ(segs, std::vector<std::string>{live});
  fs::remove("/dev/shm/" + live);
}

TEST(Daemon, TwoDaemonsOnOneMachineDoNotCollide) {
  DaemonEnv e1("two1"), e2("two2");
  e1.start();
  e2.start();
  // Same job id on both daemons at once.
  auto a = e1.worker("same", 0, 2, 100, "f32:1000,i32:3");
  auto b = e1.worker("same", 1, 2, 100, "f32:1000,i32:3");
  auto c = e2.worker("same", 0, 2, 100, "f32:1000,i32:3");
  auto d = e2.worker("same", 1, 2, 100, "f32:1000,i32:3");
  for (auto* p : {a.get(), b.get(), c.get(), d.get()}) expect_ok(*p);
  // A second daemon on a live socket refuses to start.
  Process dup({build_root() + "/daemon/bytecompd", "--config", (e1.dir() / "daemon.yaml").string()},
              e1.dir() / "dup.log");
  EXPECT_EQ(dup.wait(10s), std::optional<int>(1));
  EXPECT_NE(dup.output().find("another bytecompd"), std::string::npos) << dup.output();
}

TEST(Daemon, SigtermAbortsRunningJobsAndExitsCleanly) {
  DaemonEnv env("term");
  env.start();
  auto a = env.worker("term", 0, 2, 1000000, "f32:1000");
  auto b = env.worker("term", 1, 2, 1000000, "f32:1000");
  ASSERT_TRUE(a->wait_output("running", 20s));
  ASSERT_TRUE(b->wait_output("running", 20s));
  env.daemon().signal(SIGTERM);
  EXPECT_EQ(env.daemon().wait(10s), std::optional<int>(0)) << env.daemon().output();
  for (auto* p : {a.get(), b.get()}) {
    auto st = p->wait(5s);
    ASSERT_TRUE(st.has_value());
    EXPECT_EQ(*st, 16) << p->output();
    EXPECT_NE(p->output().find("shutting down"), std::string::npos) << p->output();
  }
  EXPECT_TRUE(no_shm_left(env.shm_prefix()));
  EXPECT_FALSE(fs::exists(env.socket()));
}

TEST(Daemon, SighupReloadsAndKeepsOldConfigOnError) {
  DaemonEnv env("hup");
  env.start();
  env.write_config("logging:\n  levels: info\n", "  partition_bytes: 1MiB\n");
  env.daemon().signal(SIGHUP);
  EXPECT_TRUE(env.daemon().wait_output("reloaded (partition_bytes 1048576 for new jobs", 5s))
      << env.daemon().output();
  env.write_config("", "  partition_bytes: 12\n");
  env.daemon().signal(SIGHUP);
  EXPECT_TRUE(env.daemon().wait_output("not reloaded", 5s)) << env.daemon().output();
  EXPECT_NE(env.daemon().output().find("partition_bytes"), std::string::npos);
  // Still serving, with the reloaded partition size.
  auto a = env.worker("hup", 0, 2, 20, "f32:1000000");
  auto b = env.worker("hup", 1, 2, 20, "f32:1000000");
  expect_ok(*a);
  expect_ok(*b);
}

TEST(Daemon, BadConfigIsRejectedWithLocation) {
  DaemonEnv env("badcfg");
  env.write_config("", "  partition_bytes: 12\n");
  Process p({build_root() + "/daemon/bytecompd", "--config", (env.dir() / "daemon.yaml").string()},
            env.dir() / "bad.log");
  EXPECT_EQ(p.wait(10s), std::optional<int>(2));
  EXPECT_NE(p.output().find("scheduler.partition_bytes"), std::string::npos) << p.output();
}

namespace {
// CPU time (utime + stime, in clock ticks) of a process and all its threads.
long cpu_ticks(pid_t pid) {
  std::string s = read_file("/proc/" + std::to_string(pid) + "/stat");
  std::istringstream in(s.substr(s.rfind(')') + 2));
  std::string field;
  long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && in >> field; ++i) {
    if (i == 14) utime = std::stol(field);
    if (i == 15) stime = std::stol(field);
  }
  return utime + stime;
}
}  // namespace

TEST(Daemon, IdleJobBurnsNoCpu) {
  DaemonEnv env("idle");
  env.start();
  // A started job whose clients wait forever for a rank that never pushes:
  // daemon engine and client waiter are both blocked in timed waits.
  auto a = env.worker("idle", 0, 3, 1, "f32:10");
  auto b = env.worker("idle", 1, 3, 1, "f32:10");
  auto c = env.worker("idle", 2, 3, 1, "f32:10", {"--stall"});
  ASSERT_TRUE(c->wait_output("stalling", std::chrono::seconds(20))) << c->output();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const long d0 = cpu_ticks(env.daemon().pid());
  const long a0 = cpu_ticks(a->pid());
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  const long d1 = cpu_ticks(env.daemon().pid());
  const long a1 = cpu_ticks(a->pid());
  // 100 ticks = one core for the second; spinning would show tens.
  EXPECT_LE(d1 - d0, 5);
  EXPECT_LE(a1 - a0, 5);
  EXPECT_FALSE(a->wait(std::chrono::milliseconds(0)).has_value()) << a->output();
}

// A rank that closes right after its last wait must not abort the job for a
// rank that has not read its last results yet.
TEST(Daemon, CleanCloseLeavesPeersFinishedWorkIntact) {
  DaemonEnv env("linger");
  env.start();
  const std::string spec = "f32:1,f32:70000,i64:5";
  for (int round = 0; round < 3; ++round) {
    const std::string job = "linger" + std::to_string(round);
    auto fast = env.worker(job, 0, 3, 20, spec);
    auto slow = env.worker(job, 1, 3, 20, spec, {"--linger", "400"});
    auto fast2 = env.worker(job, 2, 3, 20, spec);
    expect_ok(*fast);
    expect_ok(*fast2);
    expect_ok(*slow);
  }
  EXPECT_TRUE(no_shm_left(env.shm_prefix()));
  EXPECT_EQ(env.daemon().output().find("aborted"), std::string::npos) << env.daemon().output();
}
