// The fixture of the server tests (server_test.cc, restart_test.cc):
// bytecomp-server processes on loopback, one per test backend, their cluster
// files, clients of the client library, bounded waits for readiness and for
// released memory.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "server/cluster_config.h"
#include "server/ps_client.h"
#include "tests/server/proc.h"
#include "tests/server/testdata.h"
#include "transport/transport.h"

namespace bytecomp::server::testing {

using namespace std::chrono_literals;
using testing_proc = Process;
namespace td = bytecomp::server::testing;

inline constexpr uint64_t kPartitionBytes = 64 * 1024;

class ServerFixture : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string reason;
    if (!transport::backend_usable(GetParam(), &reason)) GTEST_SKIP() << reason;
    char tmpl[] = "/tmp/bytecomp-server-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    workers_.clear();
    if (server1_) {
      server1_->kill(SIGTERM);
      EXPECT_TRUE(server1_->wait(10s)) << "server 1 did not exit on SIGTERM";
      EXPECT_EQ(server1_->exit_code(), 0) << server1_->err();
      server1_.reset();
    }
    if (server_) {
      server_->kill(SIGTERM);
      bool exited = server_->wait(10s);
      EXPECT_TRUE(exited) << "server did not exit on SIGTERM";
      if (exited && !server_killed_) {
        EXPECT_EQ(server_->exit_code(), 0) << server_->err();
        EXPECT_NE(server_->err().find("stopped"), std::string::npos) << server_->err();
      }
      server_.reset();
    }
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  // `host_port` on this test's backend.
  std::string endpoint(const std::string& host_port) const {
    return (GetParam() == "rdma" ? "rdma://" : "tcp://") + host_port;
  }
  std::string backend_yaml() const { return "backend: " + GetParam() + ", "; }

  void write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ + "/" + name) << text;
  }

  std::string cluster_yaml(const std::vector<std::string>& addresses, int admission_ms) {
    std::string servers;
    for (size_t i = 0; i < addresses.size(); ++i)
      servers += "    - {id: " + std::to_string(i) + ", address: \"" + addresses[i] + "\"}\n";
    return "version: 1\ncluster:\n  coordinator: 0\n  partition_bytes: " +
           std::to_string(kPartitionBytes) + "\n  servers:\n" + servers +
           "  daemons:\n    - {id: 100, address: \"" + endpoint("127.0.0.1:9") + "\"}\n"
           "  timeouts: {admission_ms: " +
           std::to_string(admission_ms) +
           ", request_ms: 10000, setup_ms: 5000}\n"
           "transport: {" + backend_yaml() +
           "heartbeat_interval_ms: 100, peer_timeout_ms: 1000, io_threads: 1}\n";
  }

  std::unique_ptr<testing_proc> launch_server(int id, const std::string& cluster_file,
                                              const std::string& ready) {
    std::string cfg = "server" + std::to_string(id) + ".yaml";
    write(cfg, "version: 1\nserver: {node_id: " + std::to_string(id) + ", cluster_file: " +
                   cluster_file +
                   ", engine_threads: 2}\ntransport: {" + backend_yaml() +
                   "heartbeat_interval_ms: 100, "
                   "peer_timeout_ms: 1000, io_threads: 1, handler_threads: 2}\n"
                   "logging: {levels: info}\n");
    return std::make_unique<testing_proc>(
        std::vector<std::string>{td::self_dir() + "/../../server/bytecomp-server", "--config",
                                 dir_ + "/" + cfg, "--ready-file", ready},
        dir_ + "/server" + std::to_string(id) + ".out", dir_ + "/server" + std::to_string(id) + ".err",
        std::vector<std::string>{"BYTECOMP_LOG=warn,server=info,coordinator=info"});
  }

  std::string wait_ready(testing_proc& p, const std::string& ready) {
    auto until = std::chrono::steady_clock::now() + 15s;
    while (!std::filesystem::exists(ready)) {
      if (!p.running() || std::chrono::steady_clock::now() > until) {
        ADD_FAILURE() << "server did not get ready: " << p.err();
        return {};
      }
      std::this_thread::sleep_for(10ms);
    }
    std::string addr = td::read_file(ready);
    addr.erase(addr.find_last_not_of("\n") + 1);
    return addr;
  }

  // Starts the coordinator (server 0) on an ephemeral port, and with
  // `servers` == 2 a second server that registers with it; writes
  // cluster.yaml for the clients (only the coordinator's address is real:
  // clients learn the others at admission).
  void start_server(int admission_ms = 5000, int servers = 1) {
    std::vector<std::string> any(static_cast<size_t>(servers), endpoint("127.0.0.1:0"));
    write("server-cluster.yaml", cluster_yaml(any, admission_ms));
    server_ = launch_server(0, "server-cluster.yaml", dir_ + "/ready0");
    address_ = wait_ready(*server_, dir_ + "/ready0");
    ASSERT_FALSE(address_.empty());
    any[0] = address_;
    write("cluster.yaml", cluster_yaml(any, admission_ms));
    if (servers == 2) {
      server1_ = launch_server(1, "cluster.yaml", dir_ + "/ready1");
      address1_ = wait_ready(*server1_, dir_ + "/ready1");
      ASSERT_FALSE(address1_.empty());
    }
    cluster_ = load_cluster_config(dir_ + "/cluster.yaml");
  }

  testing_proc& worker(const std::string& tag, std::vector<std::string> args) {
    args.insert(args.begin(), {td::self_dir() + "/bytecomp-ps-worker", "--cluster",
                               dir_ + "/cluster.yaml"});
    workers_.push_back(std::make_unique<testing_proc>(args, dir_ + "/" + tag + ".out",
                                                      dir_ + "/" + tag + ".err"));
    return *workers_.back();
  }

  // Both nodes join `spec` at once (admission waits for every node);
  // returns (node a's job, node b's job).
  static std::pair<std::shared_ptr<PsJob>, std::shared_ptr<PsJob>> join_both(PsClient& a, PsClient& b,
                                                                             const JobSpec& spec) {
    auto fa = std::async(std::launch::async, [&] { return a.join(spec); });
    auto jb = b.join(spec);
    return {fa.get(), jb};
  }

  std::unique_ptr<PsClient> client(NodeId id) {
    transport::TransportConfig tc = cluster_.transport;
    tc.node_id = id;
    tc.listen = {};
    return PsClient::create(cluster_, tc);
  }

  ServerStats stats(NodeId server = 0) {
    ClusterConfig known = cluster_;
    if (server1_) known.servers.at(1).address = address1_;  // a real address to reach it
    transport::TransportConfig tc = known.transport;
    tc.node_id = 199;
    tc.listen = {};
    return PsClient::create(known, tc)->stats(server);
  }

  // Polls until the server holds no job (memory released).
  void expect_released() {
    ServerStats s;
    auto until = std::chrono::steady_clock::now() + 5s;
    do {
      s = stats();
      if (s.jobs == 0 && s.job_bytes == 0) return;
      std::this_thread::sleep_for(50ms);
    } while (std::chrono::steady_clock::now() < until);
    ADD_FAILURE() << "server still holds " << s.jobs << " jobs, " << s.job_bytes << " bytes";
  }

  std::string dir_;
  std::string address_, address1_;
  ClusterConfig cluster_;
  std::unique_ptr<testing_proc> server_, server1_;
  bool server_killed_ = false;
  std::vector<std::unique_ptr<testing_proc>> workers_;
};

}  // namespace bytecomp::server::testing
