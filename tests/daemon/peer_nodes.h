// Fixture of the multi-daemon peer tests (ring, broadcast chain): one
// bytecomp-server coordinating and N real bytecompd processes on loopback,
// each with a peer endpoint, parameterised by transport backend.
#pragma once

#include <gtest/gtest.h>

#include <csignal>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/daemon/harness.h"
#include "transport/transport.h"

namespace bctest {

class PeerNodes : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string reason;
    if (!bytecomp::transport::backend_usable(GetParam(), &reason)) GTEST_SKIP() << reason;
  }
  std::string endpoint() const {
    return (GetParam() == "rdma" ? "rdma://" : "tcp://") + std::string("127.0.0.1:0");
  }
  void write(const std::string& name, const std::string& text) { std::ofstream(dir_ / name) << text; }
  std::string cluster(const std::string& coordinator) const {
    std::string s = "version: 1\ncluster:\n  coordinator: 0\n  partition_bytes: 256KiB\n  servers:\n"
                    "    - {id: 0, address: \"" + coordinator + "\"}\n  daemons:\n";
    for (uint32_t n = 0; n < n_; ++n) s += "    - {id: " + std::to_string(100 + n) + "}\n";
    s += "  timeouts: {admission_ms: 10000, request_ms: 10000, setup_ms: 5000}\n"
         "transport: {backend: " + GetParam() + ", heartbeat_interval_ms: 100, peer_timeout_ms: " +
         std::to_string(peer_timeout_ms_) + ", io_threads: 1}\n";
    return s;
  }
  // Called once dir_ exists, before the daemons start: what to append to
  // each daemon's configuration (a test writes its own files there first).
  virtual std::string daemon_extra() { return ""; }
  // One server, `n` daemons named `tag`0.. with a peer endpoint and ring
  // chunks of `chunk_bytes`.
  void start_nodes(const std::string& tag, uint32_t n, uint64_t chunk_bytes) {
    n_ = n;
    dir_ = fs::temp_directory_path() / ("bcd-" + tag + "-" + std::to_string(::getpid()) + "-" +
                                        std::to_string(counter_++));
    fs::create_directories(dir_);
    write("server-cluster.yaml", cluster(endpoint()));
    write("server.yaml", "version: 1\nserver: {node_id: 0, cluster_file: server-cluster.yaml, "
                         "engine_threads: 1}\ntransport: {backend: " + GetParam() +
                             ", heartbeat_interval_ms: 100, peer_timeout_ms: " +
                             std::to_string(peer_timeout_ms_) + ", io_threads: 1}\n");
    const std::string ready = (dir_ / "ready").string();
    server_ = std::make_unique<Process>(
        std::vector<std::string>{build_root() + "/server/bytecomp-server", "--config",
                                 (dir_ / "server.yaml").string(), "--ready-file", ready},
        dir_ / "server.log");
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
    while (!fs::exists(ready) || read_file(ready).find('\n') == std::string::npos) {
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << server_->output();
      ASSERT_FALSE(server_->wait(std::chrono::milliseconds(0)).has_value()) << server_->output();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::string a = read_file(ready);
    a.erase(a.find_last_not_of('\n') + 1);
    write("cluster.yaml", cluster(a));
    const std::string extra = daemon_extra();
    std::string nodes;
    for (uint32_t k = 0; k < n; ++k) nodes += (k ? ", " : "") + std::to_string(100 + k);
    for (uint32_t k = 0; k < n; ++k) {
      nodes_.push_back(std::make_unique<DaemonEnv>(tag + std::to_string(k)));
      nodes_[k]->write_config("internode:\n  cluster_file: " + (dir_ / "cluster.yaml").string() +
                              "\n  node_id: " + std::to_string(100 + k) + "\n  nodes: [" + nodes +
                              "]\n  peer_listen: " + endpoint() +
                              "\n  ring_chunk_bytes: " + std::to_string(chunk_bytes) + "\n" +
                              extra);
      nodes_[k]->start();
    }
  }
  void TearDown() override {
    nodes_.clear();
    if (server_) {
      server_->signal(SIGTERM);
      (void)server_->wait(std::chrono::seconds(10));
      server_.reset();
    }
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  static inline int counter_ = 0;
  uint32_t n_ = 0;
  int peer_timeout_ms_ = 3000;
  fs::path dir_;
  std::unique_ptr<Process> server_;
  std::vector<std::unique_ptr<DaemonEnv>> nodes_;
};

}  // namespace bctest
