#include "daemon/scheduler.h"

#include "planner/strategy/partition.h"

#include <gtest/gtest.h>

using bytecomp::daemon::Scheduler;
using bytecomp::daemon::Task;

TEST(Scheduler, PartitionsCoverTheTensorExactly) {
  Scheduler s;
  EXPECT_EQ(s.add(0, 1, 1000, 256, 4), 4u);
  auto b = s.next_batch(10, 1 << 20);
  ASSERT_EQ(b.size(), 4u);
  uint64_t at = 0;
  uint32_t index = 0;
  for (const Task& t : b) {
    EXPECT_EQ(t.begin, at);
    EXPECT_EQ(t.begin % 64, 0u);
    // The identity every path and the servers use, computed once here.
    EXPECT_EQ(t.index, index);
    EXPECT_EQ(t.key, bytecomp::strategy::partition_key(0, index));
    EXPECT_EQ(t.count, (t.end - t.begin) / 4);
    ++index;
    at = t.end;
  }
  EXPECT_EQ(at, 1000u);
  EXPECT_TRUE(s.empty());
  EXPECT_EQ(s.add(1, 1, 4, 4096, 4), 1u);  // a single tiny partition
}

// cpu_share (docs/gpu.md §4): a compressed round whose client left its
// first partitions dense has the daemon compress exactly those.
TEST(Scheduler, ADenseLeadOfACompressedRoundIsTheDaemonsToCompress) {
  Scheduler s;
  EXPECT_EQ(s.add(0, 1, 1000, 256, 4, {}, true, 2), 4u);
  const auto b = s.next_batch(10, 1 << 20);
  ASSERT_EQ(b.size(), 4u);
  for (const Task& t : b) EXPECT_EQ(t.compressed, t.index >= 2) << t.index;
  EXPECT_EQ(s.add(1, 1, 1000, 256, 4, {}, false, 0), 4u);
  for (const Task& t : s.next_batch(10, 1 << 20)) EXPECT_FALSE(t.compressed);
}

TEST(Scheduler, FirstDeclaredTensorGoesFirstAndOvertakesALargeOne) {
  Scheduler s;
  s.add(7, 0, 10 * 64, 64, 4);  // large, low priority, arrived first
  auto first = s.next_batch(2, 1 << 20);
  ASSERT_EQ(first.size(), 2u);
  EXPECT_EQ(first[0].tensor, 7u);
  s.add(2, 0, 64, 64, 4);  // arrives while tensor 7 is in progress
  s.add(0, 0, 64, 64, 4);
  auto next = s.next_batch(3, 1 << 20);
  ASSERT_EQ(next.size(), 3u);
  EXPECT_EQ(next[0].tensor, 0u);
  EXPECT_EQ(next[1].tensor, 2u);
  EXPECT_EQ(next[2].tensor, 7u);
  EXPECT_EQ(next[2].begin, 128u);  // tensor 7 resumes where it stopped
}

// The engine's per-link credit windows: a partition its link has no room
// for stays queued in its place, lower-priority ones for other links go,
// and it goes first once admitted.
TEST(Scheduler, APartitionRefusedByItsLinkKeepsItsPlace) {
  Scheduler s;
  s.add(0, 0, 64, 64, 4);       // link 0 (full below)
  s.add(3, 0, 4 * 64, 64, 4);   // links 1, 0, 1, 0 (index parity)
  auto link_of = [](const Task& t) { return t.tensor == 0 ? 0u : t.index % 2 == 0 ? 1u : 0u; };
  auto only_link1 = [&](Task& t) {
    if (link_of(t) != 1) return false;
    t.link = 1;
    t.link_bytes = t.bytes();
    return true;
  };
  const auto b = s.next_batch(10, 1 << 20, only_link1);
  ASSERT_EQ(b.size(), 2u);
  for (const Task& t : b) {
    EXPECT_EQ(t.tensor, 3u);
    EXPECT_EQ(t.index % 2, 0u);
    EXPECT_EQ(t.link, 1);  // what the admission charged travels with the task
    EXPECT_EQ(t.link_bytes, 64u);
  }
  EXPECT_TRUE(s.next_batch(10, 1 << 20, only_link1).empty());  // nothing for link 1 left
  EXPECT_EQ(s.size(), 3u);
  const auto rest = s.next_batch(10, 1 << 20, [](Task&) { return true; });
  ASSERT_EQ(rest.size(), 3u);
  EXPECT_EQ(rest[0].tensor, 0u);  // the refused high-priority one, still first
  EXPECT_EQ(rest[1].index, 1u);
  EXPECT_EQ(rest[2].index, 3u);
  EXPECT_EQ(rest[0].link, -1);  // not charged
}

TEST(Scheduler, BatchRespectsBytesInFlight) {
  Scheduler s;
  s.add(0, 0, 1000 * 64, 256, 4);
  auto b = s.next_batch(100, 1024);
  EXPECT_EQ(b.size(), 4u);  // 4 x 256 bytes
  auto one = s.next_batch(100, 1);  // the first partition always fits
  EXPECT_EQ(one.size(), 1u);
}

#include <cstdlib>

#include "common/config.h"
#include "daemon/config.h"

using bytecomp::daemon::DaemonConfig;
namespace config = bytecomp::config;

TEST(DaemonConfig, ExampleFileParses) {
  const std::string root = std::getenv("BYTECOMP_SOURCE_ROOT");
  DaemonConfig c = DaemonConfig::parse(config::Document::load_file(root + "/configs/daemon.yaml"));
  EXPECT_EQ(c.socket_path, "/run/bytecomp/bytecompd.sock");
  EXPECT_EQ(c.socket_mode, 0666u);
  EXPECT_EQ(c.partition_bytes, 4u << 20);
  EXPECT_EQ(c.max_job_bytes, 16ull << 30);
}

// The error a daemon.yaml text gets ("" when it parses).
static std::string config_error(const std::string& text) {
  try {
    DaemonConfig::parse(config::Document::parse(text, "d.yaml"));
  } catch (const config::ConfigError& e) {
    return std::string(e.what());
  }
  return std::string();
}

TEST(DaemonConfig, FusionMemberTimeoutIsValidated) {
  auto err = config_error;
  EXPECT_EQ(DaemonConfig::parse(config::Document::parse("version: 1\n", "d.yaml"))
                .fusion_member_timeout_ms,
            20000u);
  EXPECT_EQ(DaemonConfig::parse(config::Document::parse(
                                    "version: 1\nfusion: {member_timeout_ms: 250}\n", "d.yaml"))
                .fusion_member_timeout_ms,
            250u);
  for (const char* bad : {"50", "0", "3600001", "soon", "-1"}) {
    const std::string e =
        err(std::string("version: 1\nfusion: {member_timeout_ms: ") + bad + "}\n");
    EXPECT_NE(e.find("fusion.member_timeout_ms"), std::string::npos) << bad << ": " << e;
    EXPECT_NE(e.find("d.yaml"), std::string::npos) << bad << ": " << e;
    EXPECT_EQ(e.find("unknown key"), std::string::npos) << bad << ": " << e;
  }
}

TEST(DaemonConfig, ErrorsNameTheKey) {
  auto err = config_error;
  EXPECT_NE(err("version: 1\ncontrol: {socket: rel.sock}\n").find("control.socket"),
            std::string::npos);
  EXPECT_NE(err("version: 1\nshm: {instance: 'a.b'}\n").find("shm.instance"), std::string::npos);
  EXPECT_NE(err("version: 1\nscheduler: {partition_bytes: 8MiB, max_inflight_bytes: 4MiB}\n")
                .find("scheduler.max_inflight_bytes"),
            std::string::npos);
  EXPECT_NE(err("version: 1\nscheduler: {thread: 2}\n").find("unknown key"), std::string::npos);
  EXPECT_NE(err("version: 1\nscheduler: {link_window: 1025}\n").find("scheduler.link_window"),
            std::string::npos);
  EXPECT_NE(err("version: 1\nscheduler: {link_window: -1}\n").find("scheduler.link_window"),
            std::string::npos);
  EXPECT_EQ(DaemonConfig::parse(config::Document::parse("version: 1\n", "d.yaml")).link_window, 2u);
  // The peer endpoint: an endpoint, and only with a cluster to learn peers from.
  const std::string bad_endpoint =
      err("version: 1\ninternode: {cluster_file: c.yaml, nodes: [1], peer_listen: 'localhost:9'}\n");
  EXPECT_NE(bad_endpoint.find("internode.peer_listen"), std::string::npos) << bad_endpoint;
  EXPECT_NE(bad_endpoint.find("tcp://HOST:PORT"), std::string::npos) << bad_endpoint;
  EXPECT_NE(err("version: 1\ninternode: {peer_listen: 'tcp://127.0.0.1:0'}\n").find("cluster_file"),
            std::string::npos);
  const DaemonConfig ok = DaemonConfig::parse(config::Document::parse(
      "version: 1\ninternode: {cluster_file: c.yaml, nodes: [1], peer_listen: 'tcp://127.0.0.1:0'}\n",
      "d.yaml"));
  EXPECT_EQ(ok.peer_listen, "tcp://127.0.0.1:0");
  EXPECT_TRUE(ok.phase_timestamps);  // the default
  const std::string bad_switch = err("version: 1\nengine: {phase_timestamps: sometimes}\n");
  EXPECT_NE(bad_switch.find("engine.phase_timestamps"), std::string::npos) << bad_switch;
  EXPECT_NE(err("version: 1\nengine: {phase_stamps: true}\n").find("unknown key"),
            std::string::npos);
  EXPECT_FALSE(DaemonConfig::parse(config::Document::parse(
                                       "version: 1\nengine: {phase_timestamps: false}\n", "d.yaml"))
                   .phase_timestamps);
}
