// The broadcast chain's wire format and its receiver's checks
// (daemon/peer_broadcast.h), in process: PeerHubs on loopback, BcastJobs on
// them, and hand-made senders. Real daemons: tests/daemon/bcast_nodes_test.cc.
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstring>
#include <future>
#include <mutex>
#include <set>
#include <thread>

#include "daemon/peer_allgather.h"
#include "daemon/peer_broadcast.h"
#include "transport/transport.h"

namespace bd = bytecomp::daemon;
namespace bt = bytecomp::transport;
using namespace std::chrono_literals;

namespace {

bt::TransportConfig hub_config(bt::NodeId id, const std::string& backend) {
  bt::TransportConfig c;
  c.backend = backend;
  c.node_id = id;
  c.listen = {backend == "rdma" ? "rdma://127.0.0.1:0" : "tcp://127.0.0.1:0"};
  c.io_threads = 1;
  c.heartbeat_interval = 100ms;
  c.peer_timeout = 1000ms;
  return c;
}

struct Events {
  std::mutex mu;
  std::condition_variable cv;
  std::set<std::pair<uint32_t, uint64_t>> ready;
  std::vector<std::string> failures;
  bd::BcastJob::ReadyFn on_ready() {
    return [this](uint32_t t, uint64_t it) {
      std::lock_guard l(mu);
      ready.insert({t, it});
      cv.notify_all();
    };
  }
  bd::BcastJob::FailFn on_fail() {
    return [this](const bytecomp::Status& s) {
      std::lock_guard l(mu);
      failures.push_back(s.message());
      cv.notify_all();
    };
  }
  bool wait_ready(uint32_t t, uint64_t it) {
    std::unique_lock l(mu);
    return cv.wait_for(l, 10s, [&] { return ready.count({t, it}) > 0 || !failures.empty(); }) &&
           ready.count({t, it}) > 0;
  }
  bool wait_failed() {
    std::unique_lock l(mu);
    return cv.wait_for(l, 10s, [&] { return !failures.empty(); });
  }
};

bd::BcastJobSpec spec(uint32_t uid, uint32_t rank, std::vector<bt::NodeId> nodes,
                      std::vector<std::string> addresses) {
  bd::BcastJobSpec s;
  s.name = "bc" + std::to_string(uid);
  s.uid = uid;
  s.rank = rank;
  s.local_size = 1;
  s.nodes = std::move(nodes);
  s.addresses = std::move(addresses);
  s.tensor_names = {"w"};
  s.tensor_bytes = {5000};
  s.chunk_bytes = 1024;
  s.timeout = 10s;
  return s;
}

class BcastHubs : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string reason;
    if (!bt::backend_usable(GetParam(), &reason)) GTEST_SKIP() << reason;
  }
};

}  // namespace

TEST(BcastWire, HeaderRoundTripsAndEveryBadFieldIsNamed) {
  bd::BcastHeader h;
  h.kind = bd::BcastKind::kDone;
  h.sender_rank = 3;
  h.root = 7;
  h.chunk = 9;
  h.nbytes = 1'000'003;
  h.tag = 0x0123456789abcdefull;
  h.offset = 9216;
  h.data_bytes = 0;
  const bt::Buffer b = bd::encode_bcast_header(h);
  ASSERT_EQ(b.size(), bd::kBcastHeaderBytes);
  const bd::BcastHeader d = bd::decode_bcast_header(b.span());
  EXPECT_EQ(d.version, bd::kBcastVersion);
  EXPECT_EQ(d.kind, h.kind);
  EXPECT_EQ(d.sender_rank, h.sender_rank);
  EXPECT_EQ(d.root, h.root);
  EXPECT_EQ(d.chunk, h.chunk);
  EXPECT_EQ(d.nbytes, h.nbytes);
  EXPECT_EQ(d.tag, h.tag);
  EXPECT_EQ(d.offset, h.offset);
  EXPECT_EQ(d.data_bytes, h.data_bytes);
  auto refused = [](std::string bytes, const std::string& needle) {
    try {
      bd::decode_bcast_header(std::span(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()));
      ADD_FAILURE() << "accepted, expected: " << needle;
    } catch (const bytecomp::Error& e) {
      EXPECT_EQ(e.code(), bytecomp::ErrorCode::kMalformed);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const std::string good(b.view());
  refused(good.substr(0, 47), "header is 47 bytes");
  refused(good + "x", "header is 49 bytes");
  std::string v = good;
  v[0] = 2;
  refused(v, "broadcast protocol version 2");
  for (char k : {'\0', '\3', '\xff'}) {
    v = good;
    v[2] = k;
    refused(v, "broadcast message kind " + std::to_string(static_cast<unsigned char>(k)));
  }
  v = good;
  v[3] = 1;
  refused(v, "reserved byte");
}

TEST(BcastWire, TheChainRunsInRingOrderFromTheRootsNode) {
  const bd::BcastChain c{4, 2};
  EXPECT_EQ(c.position(2), 0u);
  EXPECT_EQ(c.position(1), 3u);
  EXPECT_EQ(c.downstream(2), 3u);
  EXPECT_EQ(c.downstream(3), 0u);
  EXPECT_EQ(c.upstream(0), 3u);
  EXPECT_EQ(c.upstream(3), 2u);
  EXPECT_TRUE(c.last(1));
  EXPECT_FALSE(c.last(0));
}

// A 2-node job on hub 200 (rank 0) and a hand-made rank 1 (node 201): every
// malformed message is refused with the reason, a stranger's do not disturb
// the job, a good chunk and report complete the round, and data for a job
// that never opens is refused once it waited park_timeout.
TEST_P(BcastHubs, MalformedMessagesAreRefusedWithTheReason) {
  Events ea;  // outlives the hub, whose threads run the job's callbacks
  bd::PeerHub a(hub_config(200, GetParam()), 300ms);
  auto x = bt::make_transport(hub_config(201, GetParam()));
  x->start();
  auto stranger = bt::make_transport(hub_config(209, GetParam()));
  stranger->start();
  const std::string xa = x->local_addresses().front();
  auto job = a.open_bcast(spec(80, 0, {200, 201}, {a.address(), xa}), ea.on_ready(), ea.on_fail());
  x->add_peer(200, a.address());
  stranger->add_peer(200, a.address());
  auto message = [](uint32_t uid, uint64_t it, std::vector<bt::Buffer> p) {
    bt::Message m;
    m.header.type = bd::kBcastData;
    m.header.aux = uid;
    m.header.key = 0;
    m.header.arg = it;
    m.payloads = std::move(p);
    return m;
  };
  auto send = [&](bt::Transport& from, uint32_t uid, uint64_t it, std::vector<bt::Buffer> p) {
    bt::Response r = from.call(200, message(uid, it, std::move(p)), 5000ms);
    EXPECT_TRUE(r.status.ok()) << r.status.to_string();
    std::string text;
    for (const auto& b : r.response.payloads) text.append(b.view());
    return std::make_pair(r.response.header.type, text);
  };
  // Root rank 1 (node 201) sends 3000 bytes to rank 0 in chunks of 1024.
  auto header = [](uint32_t chunk, uint64_t len) {
    bd::BcastHeader h;
    h.sender_rank = 1;
    h.root = 1;
    h.chunk = chunk;
    h.nbytes = 3000;
    h.tag = 0x5eed;
    h.offset = uint64_t{chunk} * 1024;
    h.data_bytes = len;
    return h;
  };
  auto data = [](uint64_t n, char c) { return bt::Buffer::copy_of(std::string(n, c)); };
  auto refused = [&](std::pair<uint16_t, std::string> r, const std::string& needle) {
    EXPECT_EQ(r.first, bd::kBcastError) << r.second;
    EXPECT_NE(r.second.find(needle), std::string::npos) << r.second;
  };
  refused(send(*stranger, 80, 0, {bd::encode_bcast_header(header(0, 1024)), data(1024, 'a')}),
          "not a peer of job 'bc80'");
  refused(send(*x, 80, 0, {data(1024, 'a')}), "payloads");
  refused(send(*x, 80, 0, {bt::Buffer::copy_of("short", 5), data(1024, 'a')}),
          "header is 5 bytes");
  {
    bd::BcastHeader h = header(0, 1024);
    h.data_bytes = 100;
    refused(send(*x, 80, 0, {bd::encode_bcast_header(h), data(1024, 'a')}),
            "header says 100 bytes");
  }
  {
    std::lock_guard l(ea.mu);
    EXPECT_TRUE(ea.failures.empty()) << "refusals before the sender check failed the job";
  }
  // Good chunks and the round's start in either order; this node is the
  // last of the chain: no report needed.
  std::vector<char> dst(5000, 'z');
  EXPECT_EQ(send(*x, 80, 0, {bd::encode_bcast_header(header(2, 952)), data(952, 'c')}).first,
            bd::kBcastOk);
  job->start(0, 0, bd::BcastCall{1, 3000, 0x5eed}, nullptr, {dst.data()}, nullptr);
  EXPECT_EQ(send(*x, 80, 0, {bd::encode_bcast_header(header(0, 1024)), data(1024, 'a')}).first,
            bd::kBcastOk);
  refused(send(*x, 80, 0, {bd::encode_bcast_header(header(0, 1024)), data(1024, 'a')}),
          "chunk 0 sent twice");
  ASSERT_TRUE(ea.wait_failed());
  EXPECT_NE(ea.failures.front().find("bad broadcast data from node 201 (rank 1)"),
            std::string::npos)
      << ea.failures.front();
  // Each bad field is named (the job failed already: the first one counts).
  refused(send(*x, 80, 0, {bd::encode_bcast_header(header(1, 1000)), data(1000, 'b')}),
          "chunk 1 at byte 1024 with 1000 bytes (a broadcast of 3000 bytes in chunks of 1024)");
  {
    bd::BcastHeader h = header(0, 0);
    h.nbytes = 6000;
    h.chunk = 9;
    refused(send(*x, 80, 0, {bd::encode_bcast_header(h), bt::Buffer()}),
            "6000 bytes, the tensor has 5000");
    h = header(0, 1024);
    h.sender_rank = 0;
    refused(send(*x, 80, 0, {bd::encode_bcast_header(h), data(1024, 'a')}), "claims rank 0");
    h = header(0, 1024);
    h.root = 0;
    refused(send(*x, 80, 0, {bd::encode_bcast_header(h), data(1024, 'a')}),
            "in which this node is the root");
    h = header(0, 1024);
    h.root = 2;
    refused(send(*x, 80, 0, {bd::encode_bcast_header(h), data(1024, 'a')}),
            "root rank 2 (the job has ranks 0..1)");
    h = header(0, 1024);
    h.tag = 1;
    refused(send(*x, 80, 0, {bd::encode_bcast_header(h), data(1024, 'a')}),
            "the ranks disagree on the broadcast of tensor 'w' (iteration 0)");
    h = header(0, 0);
    h.kind = bd::BcastKind::kDone;
    refused(send(*x, 80, 0, {bd::encode_bcast_header(h), bt::Buffer()}),
            "in which this node is the last");
  }
  // A node keeps the chunks of later rounds (at most M = 2 rounds open in a
  // job of 2 nodes; see the chain's tests below), refuses beyond that.
  EXPECT_EQ(send(*x, 80, 1, {bd::encode_bcast_header(header(0, 1024)), data(1024, 'a')}).first,
            bd::kBcastOk);
  refused(send(*x, 80, 2, {bd::encode_bcast_header(header(0, 1024)), data(1024, 'a')}),
          "sent iteration 2, this node has iterations 0 (running), 1 open (a job of 2 nodes "
          "has at most 2 rounds of a tensor open on a node");
  job->close();
  // A job that never opens here: parked, then refused after 300 ms by the
  // hub's tick (the daemon's run loop calls it), with no other traffic.
  // Without the tick it would wait unanswered until the call timed out.
  auto parked = std::async(std::launch::async, [&] {
    return send(*x, 81, 0, {bd::encode_bcast_header(header(0, 1024)), data(1024, 'a')});
  });
  for (int i = 0; i < 100 && parked.wait_for(50ms) != std::future_status::ready; ++i)
    a.tick(std::chrono::steady_clock::now());
  refused(parked.get(), "no job with uid 81 opened its broadcast on node 200 within 300 ms");
  // The same after the next message's arrival (which expires what waited).
  parked = std::async(std::launch::async, [&] {
    return send(*x, 81, 0, {bd::encode_bcast_header(header(0, 1024)), data(1024, 'a')});
  });
  std::this_thread::sleep_for(500ms);
  auto later = std::async(std::launch::async, [&] {
    return send(*x, 82, 0, {bd::encode_bcast_header(header(0, 1024)), data(1024, 'a')});
  });
  refused(parked.get(), "no job with uid 81 opened its broadcast on node 200 within 300 ms");
  // Opening job 82 (within its 300 ms) hands it the parked chunk, answered then.
  Events eb;
  auto job82 =
      a.open_bcast(spec(82, 0, {200, 201}, {a.address(), xa}), eb.on_ready(), eb.on_fail());
  EXPECT_EQ(later.get().first, bd::kBcastOk);
  job82->close();
  {
    // Data of a job that closed here is refused at once, naming the job
    // (not parked). A hub with the default park timeout (30 s), for which
    // it remembers the closed job.
    Events ec;
    bd::PeerHub b(hub_config(210, GetParam()));
    auto job83 =
        b.open_bcast(spec(83, 0, {210, 201}, {b.address(), xa}), ec.on_ready(), ec.on_fail());
    job83->close();
    x->add_peer(210, b.address());
    bt::Response r = x->call(
        210, message(83, 0, {bd::encode_bcast_header(header(0, 1024)), data(1024, 'a')}), 5000ms);
    ASSERT_TRUE(r.status.ok()) << r.status.to_string();
    std::string text;
    for (const auto& p : r.response.payloads) text.append(p.view());
    refused({r.response.header.type, text}, "job 'bc83' (uid 83) ended its broadcasts on node 210");
    EXPECT_EQ(r.response.header.aux, static_cast<uint32_t>(bytecomp::ErrorCode::kUnavailable));
  }
  x->shutdown();
  stranger->shutdown();
}

// Three hubs: 0, 1, 4000 and 5000 bytes from each node in turn (the chain
// wraps round), every byte on every node, the root's buffer untouched;
// then the middle node's hub goes away and the others fail naming it.
TEST_P(BcastHubs, ChainOfThreeHubsCarriesEveryByteAndALostNodeFailsTheOthers) {
  std::vector<std::unique_ptr<Events>> events;  // outlive the hubs
  std::vector<std::unique_ptr<bd::PeerHub>> hubs;
  std::vector<std::shared_ptr<bd::BcastJob>> jobs;
  std::vector<bt::NodeId> nodes;
  std::vector<std::string> addresses;
  for (uint32_t r = 0; r < 3; ++r) {
    hubs.push_back(std::make_unique<bd::PeerHub>(hub_config(300 + r, GetParam())));
    nodes.push_back(300 + r);
    addresses.push_back(hubs.back()->address());
  }
  std::vector<std::vector<char>> bufs(3, std::vector<char>(5000));
  for (uint32_t r = 0; r < 3; ++r) {
    events.push_back(std::make_unique<Events>());
    jobs.push_back(hubs[r]->open_bcast(spec(90, r, nodes, addresses), events[r]->on_ready(),
                                       events[r]->on_fail()));
  }
  uint64_t it = 0;
  for (uint32_t root = 0; root < 3; ++root) {
    for (uint64_t n : {0u, 1u, 4000u, 5000u}) {
      for (uint32_t r = 0; r < 3; ++r)
        for (size_t i = 0; i < 5000; ++i)
          bufs[r][i] = static_cast<char>(r == root ? (i * 7 + it) & 0xFF : 0xA0 + r);
      // Non-root nodes first: the root's chunks find them started or not.
      for (uint32_t k = 1; k <= 3; ++k) {
        const uint32_t r = (root + k) % 3;
        jobs[r]->start(0, it, bd::BcastCall{root, n, 77}, r == root ? bufs[r].data() : nullptr,
                       r == root ? std::vector<char*>{} : std::vector<char*>{bufs[r].data()},
                       nullptr);
      }
      for (uint32_t r = 0; r < 3; ++r) {
        ASSERT_TRUE(events[r]->wait_ready(0, it))
            << "root " << root << " n " << n << " node " << r << ": "
            << (events[r]->failures.empty() ? "" : events[r]->failures.front());
        size_t wrong = 0;
        for (size_t i = 0; i < 5000; ++i) {
          const char want = static_cast<char>(r == root || i < n ? (i * 7 + it) & 0xFF : 0xA0 + r);
          wrong += bufs[r][i] != want;
        }
        EXPECT_EQ(wrong, 0u) << "root " << root << " n " << n << " node " << r;
      }
      ++it;
    }
  }
  jobs[0]->start(0, it, bd::BcastCall{0, 5000, 77}, bufs[0].data(), {}, nullptr);
  const auto t0 = std::chrono::steady_clock::now();
  jobs[1]->close();
  hubs[1].reset();  // node 301 dies
  for (uint32_t r : {0u, 2u}) {
    ASSERT_TRUE(events[r]->wait_failed()) << r;
    std::lock_guard l(events[r]->mu);
    EXPECT_NE(events[r]->failures.front().find("node 301 (rank 1)"), std::string::npos)
        << events[r]->failures.front();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  for (auto& j : jobs) j->close();
}

// Consecutive rounds with different roots: a node gets chunks of later
// rounds while its own round is still open. Four hubs, node 1's ranks join
// nothing until the end: round 0 from node 0 (chain 0 1 2 3) finishes on
// nodes 3 and 2, whose ranks go on: round 1 from node 3 (3 0 1 2) and
// round 2 from node 2 (2 3 0 1). Node 0 then holds rounds 0 (running), 1
// and 2, node 1 rounds 0, 1 and 2 (not joined), node 3 rounds 1 and 2: at
// most M - 1 rounds ahead (docs/daemon.md). Once node 1's ranks join, every
// round completes with every byte.
TEST_P(BcastHubs, LaterRoundsFromOtherRootsWaitForTheNodesStillInAnEarlierOne) {
  constexpr uint32_t kNodes = 4, kRounds = 3;
  const uint32_t roots[kRounds] = {0, 3, 2};
  const uint64_t nbytes[kRounds] = {5000, 3000, 4097};
  std::vector<std::unique_ptr<Events>> events;  // outlive the hubs
  std::vector<std::unique_ptr<bd::PeerHub>> hubs;
  std::vector<std::shared_ptr<bd::BcastJob>> jobs;
  std::vector<bt::NodeId> nodes;
  std::vector<std::string> addresses;
  for (uint32_t r = 0; r < kNodes; ++r) {
    hubs.push_back(std::make_unique<bd::PeerHub>(hub_config(400 + r, GetParam())));
    nodes.push_back(400 + r);
    addresses.push_back(hubs.back()->address());
  }
  for (uint32_t r = 0; r < kNodes; ++r) {
    events.push_back(std::make_unique<Events>());
    jobs.push_back(hubs[r]->open_bcast(spec(91, r, nodes, addresses), events[r]->on_ready(),
                                       events[r]->on_fail()));
  }
  // bufs[node][round]; the root's holds the bytes, the others 0xA0 + node.
  auto want = [&](uint32_t r, uint64_t it, size_t i) {
    return static_cast<char>(r == roots[it] || i < nbytes[it] ? (i * 13 + it * 5) & 0xFF
                                                              : 0xA0 + r);
  };
  std::vector<std::vector<std::vector<char>>> bufs(
      kNodes, std::vector<std::vector<char>>(kRounds, std::vector<char>(5000)));
  for (uint32_t r = 0; r < kNodes; ++r)
    for (uint64_t it = 0; it < kRounds; ++it)
      for (size_t i = 0; i < 5000; ++i)
        bufs[r][it][i] = r == roots[it] ? want(r, it, i) : static_cast<char>(0xA0 + r);
  auto start = [&](uint32_t r, uint64_t it) {
    const bool root = r == roots[it];
    jobs[r]->start(0, it, bd::BcastCall{roots[it], nbytes[it], 5}, root ? bufs[r][it].data() : nullptr,
                   root ? std::vector<char*>{} : std::vector<char*>{bufs[r][it].data()}, nullptr);
  };
  auto ready = [&](uint32_t r, uint64_t it) {
    const bool ok = events[r]->wait_ready(0, it);
    std::lock_guard l(events[r]->mu);
    EXPECT_TRUE(ok) << "node " << r << " round " << it << ": "
                    << (events[r]->failures.empty() ? "timed out" : events[r]->failures.front());
    return ok;
  };
  auto not_ready = [&](uint32_t r, uint64_t it) {
    std::lock_guard l(events[r]->mu);
    EXPECT_TRUE(events[r]->failures.empty()) << "node " << r << ": " << events[r]->failures.front();
    EXPECT_EQ(events[r]->ready.count({0, it}), 0u) << "node " << r << " round " << it;
  };
  for (uint32_t r : {0u, 2u, 3u}) start(r, 0);
  ASSERT_TRUE(ready(3, 0));
  ASSERT_TRUE(ready(2, 0));
  for (uint32_t r : {3u, 2u}) start(r, 1);
  ASSERT_TRUE(ready(2, 1));  // the last of round 1's chain
  start(2, 2);
  // Round 2's chunks went 2 -> 3 -> 0 -> 1 (node 1 answers them unjoined);
  // the sends are answered once stored, so node 2 waits for the report only.
  {
    // Nothing can finish before node 1's ranks join.
    for (uint32_t r : {0u, 1u}) not_ready(r, 0);
    not_ready(3, 1);
    not_ready(2, 2);
  }
  start(1, 0);
  ASSERT_TRUE(ready(1, 0));
  ASSERT_TRUE(ready(0, 0));  // the root, last
  for (uint32_t r : {0u, 1u}) start(r, 1);
  for (uint32_t r : {1u, 0u, 3u}) ASSERT_TRUE(ready(r, 1));
  for (uint32_t r : {3u, 0u, 1u}) start(r, 2);
  for (uint32_t r : {1u, 0u, 3u, 2u}) ASSERT_TRUE(ready(r, 2));
  for (uint32_t r = 0; r < kNodes; ++r) {
    for (uint64_t it = 0; it < kRounds; ++it) {
      size_t wrong = 0;
      for (size_t i = 0; i < 5000; ++i) wrong += bufs[r][it][i] != want(r, it, i);
      EXPECT_EQ(wrong, 0u) << "node " << r << " round " << it;
    }
  }
  for (auto& j : jobs) j->close();
}

INSTANTIATE_TEST_SUITE_P(Backends, BcastHubs,
                         ::testing::ValuesIn(bytecomp::transport::available_backends()),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });
