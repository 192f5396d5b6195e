// A coordinator restarted (systemd's Restart=always) faster than the other
// servers' peer_timeout: nobody saw it lost, yet it knows nothing of the
// jobs the other servers still hold, nor of their registration
// (docs/reliability.md, "Elastic restarts").
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstring>
#include <future>
#include <mutex>
#include <set>
#include <thread>

#include "server/ps_client.h"
#include "tests/server/server_fixture.h"

using namespace bytecomp;
using namespace bytecomp::server;
using namespace std::chrono_literals;
namespace td = bytecomp::server::testing;
using td::kPartitionBytes;

namespace {

class CoordinatorRestart : public td::ServerFixture {
 protected:
  // Both nodes join `spec`, each retrying on its own (bounded) while it is
  // refused, as every node's ranks do (bytecomp.torch's init()); a null
  // pair and `last` the last refusal when they never get admitted.
  std::pair<std::shared_ptr<PsJob>, std::shared_ptr<PsJob>> join_until(
      PsClient& a, PsClient& b, const JobSpec& spec, std::chrono::seconds bound,
      std::string& last) {
    const auto until = std::chrono::steady_clock::now() + bound;
    std::mutex mu;
    auto one = [&](PsClient& c) -> std::shared_ptr<PsJob> {
      while (std::chrono::steady_clock::now() < until) {
        try {
          return c.join(spec);
        } catch (const Error& e) {
          {
            std::lock_guard lk(mu);
            last = e.what();
          }
          std::this_thread::sleep_for(100ms);
        }
      }
      return nullptr;
    };
    auto fa = std::async(std::launch::async, [&] { return one(a); });
    auto jb = one(b);
    auto ja = fa.get();
    if (!ja || !jb) return {};
    return {ja, jb};
  }

  // One exact iteration of a job over both servers: every partition of 'w'
  // pushed by both nodes (1 and 2), pulled by node a (3 everywhere).
  void expect_exact_sum(PsJob& a, PsJob& b, uint64_t elements) {
    const auto parts = a.info().assignment.partitions;
    std::set<NodeId> servers;
    for (const Partition& p : parts) {
      servers.insert(p.server);
      for (auto [j, v] : {std::pair{&a, 1.0f}, std::pair{&b, 2.0f}}) {
        std::vector<float> d(p.count, v);
        std::promise<Status> pushed;
        j->push(p.key, 0, transport::Buffer::copy_of(d.data(), d.size() * 4),
                [&](const Status& s) { pushed.set_value(s); });
        const Status st = pushed.get_future().get();
        ASSERT_TRUE(st.ok()) << st.to_string();
      }
      std::promise<std::pair<Status, transport::Buffer>> pulled;
      a.pull(p.key, 0, [&](const Status& s, transport::Buffer r) { pulled.set_value({s, r}); });
      auto [st, sum] = pulled.get_future().get();
      ASSERT_TRUE(st.ok()) << st.to_string();
      ASSERT_EQ(sum.size(), p.count * 4);
      std::vector<float> got(p.count);
      std::memcpy(got.data(), sum.data(), sum.size());
      for (float x : got) ASSERT_EQ(x, 3.0f);
    }
    uint64_t n = 0;
    for (const Partition& p : parts) n += p.count;
    EXPECT_EQ(n, elements);
    EXPECT_EQ(servers.size(), 2u) << "the job should span both servers";
  }
};

TEST_P(CoordinatorRestart, WithinPeerTimeoutTheOtherServerForgetsItsJobsAndRegistersAgain) {
  start_server(5000, /*servers=*/2);
  auto a = client(100), b = client(101);
  JobSpec spec;
  spec.name = "elastic";
  spec.nodes = {100, 101};
  constexpr uint64_t kElements = 4 * kPartitionBytes / 4;  // 4 partitions
  spec.tensors = {{"w", kElements, compress::DType::kFloat32}};
  auto [ja, jb] = join_both(*a, *b, spec);
  ASSERT_TRUE(ja && jb);
  std::set<uint32_t> old_uids{ja->info().uid};
  expect_exact_sum(*ja, *jb, kElements);
  EXPECT_EQ(stats(1).jobs, 1u);

  // SIGKILL and an immediate restart on the same address: well within
  // peer_timeout (1000 ms), so no peer declares it lost.
  server_->kill(SIGKILL);
  ASSERT_TRUE(server_->wait(5s));
  std::filesystem::remove(dir_ + "/ready0");
  const auto t0 = std::chrono::steady_clock::now();
  server_ = launch_server(0, "cluster.yaml", dir_ + "/ready0");
  ASSERT_EQ(wait_ready(*server_, dir_ + "/ready0"), address_);

  // Server 1 drops the old coordinator's job (its memory with it) ...
  ServerStats s1;
  auto until = std::chrono::steady_clock::now() + 5s;
  do {
    s1 = stats(1);
    if (s1.jobs == 0 && s1.job_bytes == 0) break;
    std::this_thread::sleep_for(50ms);
  } while (std::chrono::steady_clock::now() < until);
  EXPECT_EQ(s1.jobs, 0u) << "server 1 still holds the old coordinator's job";
  EXPECT_EQ(s1.job_bytes, 0u);
  // ... and a job of the same name is admitted over both servers (the new
  // coordinator waits for every server's hello), with new uids, exactly.
  std::string last;
  auto [na, nb] = join_until(*a, *b, spec, 10s, last);
  ASSERT_TRUE(na && nb) << "no job admitted after the coordinator's restart: " << last;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 8s);
  EXPECT_EQ(old_uids.count(na->info().uid), 0u) << "the restarted coordinator reused uid "
                                                << na->info().uid;
  expect_exact_sum(*na, *nb, kElements);
  na->leave();
  nb->leave();
  const std::string log1 = server1_->err();
  EXPECT_NE(log1.find("coordinator 0 restarted"), std::string::npos) << log1;
}

// A daemon restarted faster than peer_timeout: node 100 left the job
// cleanly (its ranks exited after an error), node 101's daemon died without
// a word and came back at once, so nobody saw it lost. Its registration of
// the same name ends the old job instead of being refused "already running"
// until the old job ends, which it never would.
TEST_P(CoordinatorRestart, ANodeWhoseDaemonRestartedEndsItsStaleJobByRegisteringAgain) {
  start_server(5000);
  auto a = client(100);
  auto b = client(101);
  JobSpec spec;
  spec.name = "elastic.ctl";
  spec.nodes = {100, 101};
  spec.tensors = {{"w", 1000, compress::DType::kFloat32}};
  auto [ja, jb] = join_both(*a, *b, spec);
  ASSERT_TRUE(ja && jb);
  const uint32_t old_uid = ja->info().uid;
  ASSERT_TRUE(ja->leave().ok());
  b->close();  // no leave, no abort: the daemon died
  b.reset();
  auto b2 = client(101);  // restarted at once, same node id
  const auto t0 = std::chrono::steady_clock::now();
  std::string last;
  auto [na, nb] = join_until(*a, *b2, spec, 10s, last);
  ASSERT_TRUE(na && nb) << "no job admitted after node 101's restart: " << last;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  EXPECT_NE(na->info().uid, old_uid);
  std::vector<float> d(1000, 1.0f);
  for (PsJob* j : {na.get(), nb.get()}) {
    std::promise<Status> pushed;
    j->push(partition_key(0, 0), 0, transport::Buffer::copy_of(d.data(), d.size() * 4),
            [&](const Status& st) { pushed.set_value(st); });
    EXPECT_TRUE(pushed.get_future().get().ok());
  }
  std::promise<std::pair<Status, transport::Buffer>> pulled;
  na->pull(partition_key(0, 0), 0,
           [&](const Status& st, transport::Buffer r) { pulled.set_value({st, r}); });
  auto [st, sum] = pulled.get_future().get();
  ASSERT_TRUE(st.ok()) << st.to_string();
  float first = 0;
  std::memcpy(&first, sum.data(), 4);
  EXPECT_EQ(first, 2.0f);
  na->leave();
  nb->leave();
  const std::string log = server_->err();
  EXPECT_NE(log.find("node 101 registered job 'elastic.ctl' again while a member of its running "
                     "job (uid " + std::to_string(old_uid) + ")"),
            std::string::npos)
      << log;
}

}  // namespace

INSTANTIATE_TEST_SUITE_P(Backends, CoordinatorRestart,
                         ::testing::ValuesIn(bytecomp::transport::available_backends()),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });
