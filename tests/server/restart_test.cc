// A coordinator restarted (systemd's Restart=always) faster than the other
// servers' peer_timeout: nobody saw it lost, yet it knows nothing of the
// jobs the other servers still hold, nor of their registration
// (docs/reliability.md, "Elastic restarts").
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstring>
#include <future>
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
  // Both nodes join `spec`, retried (bounded) while it is refused; nullptr
  // pair and `last` the last refusal when it never gets admitted.
  std::pair<std::shared_ptr<PsJob>, std::shared_ptr<PsJob>> join_until(
      PsClient& a, PsClient& b, const JobSpec& spec, std::chrono::seconds bound,
      std::string& last) {
    auto until = std::chrono::steady_clock::now() + bound;
    while (std::chrono::steady_clock::now() < until) {
      try {
        auto fa = std::async(std::launch::async, [&] { return a.join(spec); });
        std::shared_ptr<PsJob> jb;
        std::string why;
        try {
          jb = b.join(spec);
        } catch (const Error& e) {
          why = e.what();
        }
        auto ja = fa.get();
        if (!why.empty()) throw Error(ErrorCode::kUnavailable, why);
        return {ja, jb};
      } catch (const Error& e) {
        last = e.what();
        std::this_thread::sleep_for(200ms);
      }
    }
    return {};
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

}  // namespace

INSTANTIATE_TEST_SUITE_P(Backends, CoordinatorRestart,
                         ::testing::ValuesIn(bytecomp::transport::available_backends()),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });
