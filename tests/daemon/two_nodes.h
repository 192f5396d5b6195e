// The two-node fixture of the inter-node tests: real bytecomp-server(s) on
// loopback (server 0 coordinates) and two bytecompd, each with its own
// socket, shm instance and peer endpoint (internode.peer_listen on an
// ephemeral loopback port). Parameterised by the transport backend every
// process of the cluster uses (servers, daemons' server and peer
// connections); a backend the machine cannot run skips with the reason.
#pragma once

#include <bytecomp/bytecomp.h>
#include <csignal>
#include <future>
#include <gtest/gtest.h>

#include "tests/daemon/harness.h"
#include "transport/transport.h"

namespace bctest {

class TwoNodes : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string reason;
    if (!bytecomp::transport::backend_usable(GetParam(), &reason)) GTEST_SKIP() << reason;
  }
  // A loopback endpoint on this test's backend (port 0: ephemeral).
  std::string endpoint(const std::string& host_port = "127.0.0.1:0") const {
    return (GetParam() == "rdma" ? "rdma://" : "tcp://") + host_port;
  }
  // `scheduler`: extra lines of the daemons' scheduler section.
  void start(int servers, const std::string& strategy_yaml = "", const std::string& scheduler = "") {
    dir_ = fs::temp_directory_path() / ("bcd-2n-" + std::to_string(::getpid()) + "-" +
                                        std::to_string(counter_++));
    fs::create_directories(dir_);
    // Servers on ephemeral ports; server 0 coordinates and reports its address.
    std::string addrs;
    for (int s = 0; s < servers; ++s) {
      write("server-cluster.yaml", cluster(endpoint(), servers, {}));
      const std::string ready = (dir_ / ("ready" + std::to_string(s))).string();
      if (s > 0) write("server-cluster.yaml", cluster(coordinator_, servers, {}));
      write("server" + std::to_string(s) + ".yaml",
            "version: 1\nserver: {node_id: " + std::to_string(s) +
                ", cluster_file: server-cluster.yaml, engine_threads: 1}\n"
                "transport: {backend: " + GetParam() + ", heartbeat_interval_ms: 100, "
                "peer_timeout_ms: " + std::to_string(peer_timeout_ms_) + ", io_threads: 1}\n");
      servers_.push_back(std::make_unique<Process>(
          std::vector<std::string>{build_root() + "/server/bytecomp-server", "--config",
                                   (dir_ / ("server" + std::to_string(s) + ".yaml")).string(),
                                   "--ready-file", ready},
          dir_ / ("server" + std::to_string(s) + ".log")));
      const auto deadline = std::chrono::steady_clock::now() + 15s;
      while (!fs::exists(ready) || read_file(ready).find('\n') == std::string::npos) {
        ASSERT_LT(std::chrono::steady_clock::now(), deadline) << servers_.back()->output();
        ASSERT_FALSE(servers_.back()->wait(0ms).has_value()) << servers_.back()->output();
        std::this_thread::sleep_for(10ms);
      }
      std::string a = read_file(ready);
      a.erase(a.find_last_not_of('\n') + 1);
      if (s == 0) coordinator_ = a;
    }
    write("cluster.yaml", cluster(coordinator_, servers, {}));
    std::string strategy = strategy_section_;
    if (!strategy_yaml.empty()) {
      write("strategy.yaml", strategy_yaml);
      strategy = "strategy:\n  file: " + (dir_ / "strategy.yaml").string() + "\n";
    }
    for (int n = 0; n < 2; ++n) {
      nodes_[n] = std::make_unique<DaemonEnv>("node" + std::to_string(n));
      nodes_[n]->write_config("internode:\n  cluster_file: " + (dir_ / "cluster.yaml").string() +
                              "\n  node_id: " + std::to_string(100 + n) +
                              "\n  nodes: [100, 101]\n" + internode_extra_ +
                              (peer_listen_ && (n == 0 || peer_listen_node1_)
                                   ? "  peer_listen: " + endpoint() + "\n" : "") +
                                  (n == 1 && !strategy_section_node1_.empty()
                                       ? strategy_section_node1_ : strategy),
                              n == 1 && !scheduler_node1_.empty() ? scheduler_node1_ : scheduler);
      nodes_[n]->start(daemon_env_);
    }
  }
  void TearDown() override {
    for (auto& n : nodes_) n.reset();
    for (auto& s : servers_) {
      s->signal(SIGTERM);
      (void)s->wait(10s);
    }
    servers_.clear();
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  void write(const std::string& name, const std::string& text) { std::ofstream(dir_ / name) << text; }
  // Runs fn(node, local_rank) for the four clients at once: three on their
  // own threads, node 0's rank 0 on this one (gtest assertions there end
  // the test body's part of it).
  template <class Fn>
  void on_every_rank(const Fn& fn) {
    std::vector<std::future<void>> others;
    for (uint32_t g = 1; g < 4; ++g)
      others.push_back(std::async(std::launch::async, [&fn, g] { fn(g / 2, g % 2); }));
    fn(0u, 0u);
    for (auto& f : others) f.get();
  }

  // Rewrites node 0's strategy file and reloads it (SIGHUP); waits for
  // node 0's `nth` announced change of the test ("applies on every node
  // from iteration N") and returns N, or -1 (a failure is added) when it
  // did not come within 10 s.
  int64_t switch_strategy(const std::string& yaml, size_t nth = 1) {
    write("strategy.yaml", yaml);
    nodes_[0]->daemon().signal(SIGHUP);
    return announced_change(nodes_[0]->daemon(), nth);
  }
  std::string cluster(const std::string& coordinator, int servers, const std::string&) {
    std::string s = "version: 1\ncluster:\n  coordinator: 0\n  partition_bytes: 256KiB\n  servers:\n";
    for (int i = 0; i < servers; ++i) {
      s += "    - {id: " + std::to_string(i) + ", address: \"" +
           (i == 0 ? coordinator : endpoint()) + "\"}\n";
    }
    s += "  daemons:\n    - {id: 100}\n    - {id: 101}\n"
         "  timeouts: {admission_ms: 10000, request_ms: 10000, setup_ms: 5000}\n"
         "transport: {backend: " + GetParam() + ", heartbeat_interval_ms: 100, peer_timeout_ms: " +
                std::to_string(peer_timeout_ms_) + ", io_threads: 1}\n";
    return s;
  }
  // Runs 2 x 2 workers; returns them after they were started.
  std::vector<std::unique_ptr<Process>> workers(const std::string& job, int iters,
                                                const std::string& spec) {
    std::vector<std::unique_ptr<Process>> w;
    for (int n = 0; n < 2; ++n) {
      for (int r = 0; r < 2; ++r) {
        w.push_back(nodes_[n]->worker(job, r, 2, iters, spec, {"--node", std::to_string(n) + "/2"}));
      }
    }
    return w;
  }

  // A client of `job` as local rank `rank` of `local_size` on emulated node `node` of 2;
  // nullptr (with a recorded failure) when the daemon refuses.
  bytecomp_client* connect_client(uint32_t node, uint32_t rank, const char* job,
                                  uint32_t local_size = 2) {
    bytecomp_connect_options o;
    bytecomp_connect_options_init(&o);
    o.socket_path = nodes_[node]->socket().c_str();
    o.job_id = job;
    o.local_rank = rank;
    o.local_size = local_size;
    o.node_rank = node;
    o.num_nodes = 2;
    bytecomp_client* c = nullptr;
    if (bytecomp_connect(&o, &c) != BYTECOMP_OK) {
      ADD_FAILURE() << "connect to node " << node << ": " << bytecomp_last_error();
      return nullptr;
    }
    return c;
  }

  static inline int counter_ = 0;
  bool peer_listen_ = true;  // give the daemons a peer endpoint
  bool peer_listen_node1_ = true;  // and node 1 too (when peer_listen_)
  std::string scheduler_node1_;  // node 1's scheduler lines, when they must differ
  // More lines of both daemons' internode section. Off by default: every
  // emulated node shares this host, so with local_shm on each daemon would
  // reach every server through shared memory and the suites would no longer
  // cover the network path a remote server takes (LocalShm turns it on).
  std::string internode_extra_ = "  local_shm: false\n";
  // The daemons' strategy section (e.g. mode: auto), when no strategy file.
  std::string strategy_section_;
  std::string strategy_section_node1_;  // node 1's, when it must differ
  std::vector<std::string> daemon_env_;  // the daemons' environment (e.g. BYTECOMP_LOG)
  // Heartbeat bound of every process of the cluster (servers and daemons,
  // their server and peer connections). 3 s: a daemon compressing on two
  // loaded cores (load 10+) has gone 1 s without a heartbeat, and a peer
  // declared lost fails the job. Tests that measure how fast a dead process
  // is detected set 1 s before start().
  int peer_timeout_ms_ = 3000;
  fs::path dir_;
  std::string coordinator_;
  std::vector<std::unique_ptr<Process>> servers_;
  std::unique_ptr<DaemonEnv> nodes_[2];
};

inline void expect_ok(Process& p) {
  auto st = p.wait(std::chrono::seconds(90));
  ASSERT_TRUE(st.has_value()) << "still running: " << p.output();
  EXPECT_EQ(*st, 0) << p.output();
}


}  // namespace bctest
