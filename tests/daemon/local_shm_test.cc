// The partitions a daemon shares with a server on its own host travel
// through shared memory (server/local_shm.h): two emulated nodes on one
// loopback host, so each daemon reaches both servers that way; with
// internode.local_shm off they go over the sockets. Sums stay exact either
// way and no segment name is left in /dev/shm.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "server/cluster_config.h"
#include "server/local_shm.h"
#include "server/ps_client.h"
#include "tests/daemon/two_nodes.h"

using namespace bctest;

namespace {

class LocalShm : public TwoNodes {
 protected:
  // bytecomp_server_shm_bytes_total of `server` (0 and a failure when the
  // server does not report it).
  uint64_t shm_bytes(uint32_t server) {
    namespace sv = bytecomp::server;
    sv::ClusterConfig c = sv::load_cluster_config((dir_ / "cluster.yaml").string());
    for (auto& s : c.servers) {
      const fs::path ready = dir_ / ("ready" + std::to_string(s.id));
      std::string a = read_file(ready.string());
      a.erase(a.find_last_not_of('\n') + 1);
      s.address = a;  // the real (ephemeral) address, to reach it before any join
    }
    bytecomp::transport::TransportConfig tc = c.transport;
    tc.node_id = 150;
    tc.listen = {};
    const std::string text = sv::PsClient::create(c, tc)->metrics(server);
    const std::string name = "\nbytecomp_server_shm_bytes_total ";
    const auto at = text.find(name);
    if (at == std::string::npos) {
      ADD_FAILURE() << "server " << server << " reports no bytecomp_server_shm_bytes_total";
      return 0;
    }
    return std::stoull(text.substr(at + name.size()));
  }
  static bool no_segment_names() {
    for (const auto& e : fs::directory_iterator("/dev/shm"))
      if (e.path().filename().string().rfind(bytecomp::server::kShmPrefix, 0) == 0) return false;
    return true;
  }
};

TEST_P(LocalShm, PartitionsOfServersOnThisHostGoThroughSharedMemoryAndSumsStayExact) {
  internode_extra_ = "  local_shm: true\n";  // the fixture's default is off
  start(2);
  auto w = workers("shm2", 20, "f32:1,f32:1000,f32:65537,f32:1048576");
  for (auto& p : w) expect_ok(*p);
  // Every push and answer of both servers' partitions: 4 MiB of the large
  // tensor alone, pushed by 2 nodes and answered to 2, 20 times.
  EXPECT_GE(shm_bytes(0) + shm_bytes(1), 20ull * 2 * 2 * 4 * 1048576);
  EXPECT_GT(shm_bytes(0), 0u);
  EXPECT_GT(shm_bytes(1), 0u);
  for (auto& n : nodes_) {
    EXPECT_NE(n->daemon().output().find("go through shared memory"), std::string::npos)
        << n->daemon().output();
    EXPECT_TRUE(no_shm_left(n->shm_prefix()));
  }
  EXPECT_TRUE(no_segment_names());
}

TEST_P(LocalShm, OffOnTheDaemonsTheSocketsCarryEverything) {
  internode_extra_ = "  local_shm: false\n";
  start(2);
  auto w = workers("shm0", 20, "f32:1,f32:65537");
  for (auto& p : w) expect_ok(*p);
  EXPECT_EQ(shm_bytes(0), 0u);
  EXPECT_EQ(shm_bytes(1), 0u);
  EXPECT_TRUE(no_segment_names());
}

}  // namespace

INSTANTIATE_TEST_SUITE_P(Backends, LocalShm,
                         ::testing::ValuesIn(bytecomp::transport::available_backends()),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });
