// Ring allreduce between daemons (inter: allreduce): the wire codec and the
// geometry, then 2-4 RingJobs on real hubs (real transports on loopback)
// reducing partitions of every awkward size in fp32, fp16 and bf16 against a
// reference that follows the ring's documented order bit for bit, and a
// hand-made sender whose malformed chunks are refused with a reason.
#include <gtest/gtest.h>

#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <set>

#include "compress/reduce.h"
#include "daemon/peer_allgather.h"
#include "daemon/ring_allreduce.h"
#include "transport/transport.h"

namespace bd = bytecomp::daemon;
namespace bt = bytecomp::transport;
namespace cz = bytecomp::compress;
using namespace std::chrono_literals;

namespace {

// --------------------------------------------------------------------------
// Codec and geometry

TEST(RingWire, HeaderRoundTripsAndEveryBadFieldIsNamed) {
  bd::RingHeader h;
  h.format = bd::RingFormat::kBf16;
  h.sender_rank = 3;
  h.step = 5;
  h.chunk = 7;
  h.partition_count = 1'000'003;
  h.offset = 250'000;
  h.count = 4096;
  h.plan_digest = 0x0123456789abcdefull;
  h.data_bytes = 8192;
  const bt::Buffer b = bd::encode_ring_header(h);
  ASSERT_EQ(b.size(), bd::kRingHeaderBytes);
  const bd::RingHeader d = bd::decode_ring_header(b.span());
  EXPECT_EQ(d.version, bd::kRingVersion);
  EXPECT_EQ(d.format, h.format);
  EXPECT_EQ(d.sender_rank, h.sender_rank);
  EXPECT_EQ(d.step, h.step);
  EXPECT_EQ(d.chunk, h.chunk);
  EXPECT_EQ(d.partition_count, h.partition_count);
  EXPECT_EQ(d.offset, h.offset);
  EXPECT_EQ(d.count, h.count);
  EXPECT_EQ(d.plan_digest, h.plan_digest);
  EXPECT_EQ(d.data_bytes, h.data_bytes);

  auto refused = [](std::string bytes, const std::string& needle) {
    try {
      bd::decode_ring_header(std::span(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()));
      ADD_FAILURE() << "accepted, expected: " << needle;
    } catch (const bytecomp::Error& e) {
      EXPECT_EQ(e.code(), bytecomp::ErrorCode::kMalformed);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const std::string good(b.view());
  refused(good.substr(0, 55), "header is 55 bytes");
  refused(good + "x", "header is 57 bytes");
  std::string v = good;
  v[0] = 2;
  refused(v, "ring protocol version 2");
  for (char f : {'\0', '\4', '\xff'}) {
    v = good;
    v[2] = f;
    refused(v, "ring data format " + std::to_string(static_cast<unsigned char>(f)));
  }
  v = good;
  v[3] = 1;
  refused(v, "reserved byte");
}

TEST(RingWire, GeometryCoversEverySegmentOnceAndOwnersAreTheLeftNeighbours) {
  for (uint32_t m : {2u, 3u, 4u, 7u}) {
    for (uint64_t n : {0ull, 1ull, 2ull, 5ull, 1000ull, 65537ull}) {
      for (uint64_t ce : {1ull, 3ull, 16ull, 262144ull}) {
        bd::RingGeometry g{m, ce};
        ASSERT_EQ(g.steps(), 2 * (m - 1));
        // Segments tile [0, n); chunks tile each segment.
        EXPECT_EQ(g.segment_begin(n, 0), 0u);
        EXPECT_EQ(g.segment_end(n, m - 1), n);
        for (uint32_t k = 0; k < m; ++k) {
          uint64_t at = g.segment_begin(n, k);
          for (uint64_t c = 0; c < g.chunks(n, k); ++c) {
            const auto [first, len] = g.chunk(n, k, c);
            EXPECT_EQ(first, at);
            EXPECT_GT(len, 0u);
            EXPECT_LE(len, ce);
            at += len;
          }
          EXPECT_EQ(at, g.segment_end(n, k));
        }
        // Each node sends every segment but one in reduce-scatter, and each
        // step's sender forwards what it received the step before.
        for (uint32_t s = 0; s < m; ++s) {
          std::set<uint32_t> rs;
          for (uint32_t st = 0; st < m - 1; ++st) rs.insert(g.segment_sent(s, st));
          EXPECT_EQ(rs.size(), m - 1);
          const uint32_t left = (s + m - 1) % m;
          for (uint32_t st = 1; st < g.steps(); ++st)
            EXPECT_EQ(g.segment_sent(s, st), g.segment_sent(left, st - 1)) << m << " " << s << " " << st;
          // Node s owns (finishes at step m - 2) segment s + 1 and sends it first in allgather.
          EXPECT_EQ(g.segment_sent(left, m - 2), (s + 1) % m);
          EXPECT_EQ(g.segment_sent(s, m - 1), (s + 1) % m);
        }
      }
    }
  }
}

// --------------------------------------------------------------------------
// Rings of hubs

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
  std::set<std::tuple<uint32_t, uint32_t, uint64_t>> ready;
  std::vector<std::string> failures;
  int acked = 0;
  bd::RingJob::ReadyFn on_ready() {
    return [this](uint32_t t, uint32_t i, uint64_t it) {
      std::lock_guard l(mu);
      ready.insert({t, i, it});
      cv.notify_all();
    };
  }
  bd::RingJob::FailFn on_fail() {
    return [this](const bytecomp::Status& s) {
      std::lock_guard l(mu);
      failures.push_back(s.message());
      cv.notify_all();
    };
  }
  bd::RingJob::AckedFn on_acked() {
    return [this] {
      std::lock_guard l(mu);
      ++acked;
      cv.notify_all();
    };
  }
  bool wait_ready(uint32_t t, uint32_t i, uint64_t it) {
    std::unique_lock l(mu);
    return cv.wait_for(l, 20s, [&] { return ready.count({t, i, it}) != 0 || !failures.empty(); }) &&
           ready.count({t, i, it}) != 0;
  }
  bool wait_failed() {
    std::unique_lock l(mu);
    return cv.wait_for(l, 10s, [&] { return !failures.empty(); });
  }
};

float h16(float v) { return cz::fp16_to_fp32(cz::fp32_to_fp16(v)); }
float hb16(float v) { return cz::bf16_to_fp32(cz::fp32_to_bf16(v)); }

// What the ring computes for element `i` of a partition of `n` from the
// node sums x[0..m): segment k (the one holding i) is summed from node k
// round to node k - 1, each hop adding its fp32 value to the incoming
// partial sum and rounding to the wire format when it sends; the owner's
// rounded result is everyone's.
float ring_reference(const bd::RingGeometry& g, uint64_t n, uint64_t i, bd::RingFormat f,
                     const std::vector<float>& x) {
  const uint32_t m = g.nodes;
  uint32_t k = 0;
  while (g.segment_end(n, k) <= i) ++k;
  auto wire = [f](float v) {
    return f == bd::RingFormat::kFp32 ? v : f == bd::RingFormat::kFp16 ? h16(v) : hb16(v);
  };
  float p = wire(x[k]);
  for (uint32_t j = 1; j < m; ++j) p = wire(p + x[(k + j) % m]);
  return m == 1 ? x[0] : p;
}

// Values of node `node` at iteration `it`: mixed magnitudes and signs, so
// that half-precision rounding matters.
std::vector<float> node_values(uint64_t n, uint32_t node, uint64_t it) {
  std::mt19937 rng(static_cast<uint32_t>(1000003 * node + 7919 * it + n));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = u(rng) * static_cast<float>(1 + (i % 7) * 13);
  return v;
}

// Destroyed jobs first, then hubs (their transports' threads joined: no
// callback runs after), then the events the callbacks write to.
struct Ring {
  std::vector<std::unique_ptr<Events>> events;
  std::vector<std::unique_ptr<bd::PeerHub>> hubs;
  std::vector<std::shared_ptr<bd::RingJob>> jobs;

  Ring(uint32_t m, const std::string& backend, uint32_t uid, std::vector<uint64_t> counts,
       uint64_t chunk_bytes, uint32_t window = 2) {
    std::vector<bt::NodeId> nodes;
    std::vector<std::string> addresses;
    for (uint32_t r = 0; r < m; ++r) {
      hubs.push_back(std::make_unique<bd::PeerHub>(hub_config(200 + r, backend)));
      nodes.push_back(200 + r);
      addresses.push_back(hubs.back()->address());
    }
    for (uint32_t r = 0; r < m; ++r) {
      bd::RingJobSpec s;
      s.name = "ring" + std::to_string(uid);
      s.uid = uid;
      s.rank = r;
      s.nodes = nodes;
      s.addresses = addresses;
      for (size_t t = 0; t < counts.size(); ++t) {
        s.tensor_names.push_back("t" + std::to_string(t));
        s.partitions.push_back(1);
      }
      s.partition_count = [counts](uint32_t t, uint32_t) { return counts.at(t); };
      s.chunk_bytes = chunk_bytes;
      s.window = window;
      s.timeout = 10s;
      events.push_back(std::make_unique<Events>());
      jobs.push_back(hubs[r]->open_ring(std::move(s), events[r]->on_ready(), events[r]->on_fail()));
    }
  }
};

class RingHubs : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string reason;
    if (!bt::backend_usable(GetParam(), &reason)) GTEST_SKIP() << reason;
  }
};

// Every format, 2-4 nodes, sizes 0, 1, odd, below and above one chunk, and
// (m - 1) and (m + 1) chunks per segment +- 1 element; nodes start their
// partitions in different orders. Every node's result is bit-identical to
// the reference; fp16 / bf16 stay within one rounding per hop of the exact
// sum and are, over all elements, at least as accurate as summing in half
// precision (every input rounded, then each addition rounded).
TEST_P(RingHubs, EverySizeAndFormatMatchesTheRingOrderBitForBit) {
  constexpr uint64_t kChunkBytes = 256;  // 64 elements: many chunks per segment
  constexpr uint64_t kCe = kChunkBytes / 4;
  uint32_t uid = 40;
  for (uint32_t m : {2u, 3u, 4u}) {
    std::vector<uint64_t> counts = {0, 1, 7, kCe * m - 1, kCe * m + 1, 1001};
    for (uint64_t per : {m - 1, m + 1}) {
      counts.push_back(per * kCe * m - 1);
      counts.push_back(per * kCe * m);
      counts.push_back(per * kCe * m + 1);
    }
    // The nodes' sums, reduced in place (declared before the ring: a job may
    // write into them until it is closed).
    std::vector<std::vector<std::vector<float>>> bufs(m, std::vector<std::vector<float>>(counts.size()));
    Ring ring(m, GetParam(), uid++, counts, kChunkBytes);
    bd::RingGeometry geo{m, kCe};
    const bd::RingFormat formats[] = {bd::RingFormat::kFp32, bd::RingFormat::kFp16,
                                      bd::RingFormat::kBf16};
    double err_ring = 0, err_half = 0;
    for (uint64_t it = 0; it < 3; ++it) {
      const bd::RingFormat f = formats[it];
      const uint64_t digest = 11 + it;
      // Node r starts its tensors in order rotated by r (the nodes' orders differ).
      for (uint32_t r = 0; r < m; ++r) {
        for (size_t j = 0; j < counts.size(); ++j) {
          const auto t = static_cast<uint32_t>((j + r * 3) % counts.size());
          bufs[r][t] = node_values(counts[t], r, it);
          ring.jobs[r]->start(t, 0, it, f, digest, bufs[r][t].data(), counts[t],
                              ring.events[r]->on_acked());
        }
      }
      for (uint32_t t = 0; t < counts.size(); ++t) {
        const uint64_t n = counts[t];
        std::vector<std::vector<float>> got;
        for (uint32_t r = 0; r < m; ++r) {
          ASSERT_TRUE(ring.events[r]->wait_ready(t, 0, it))
              << "m=" << m << " n=" << n << " it=" << it << " node " << r << ": "
              << (ring.events[r]->failures.empty() ? "" : ring.events[r]->failures.front());
          ring.jobs[r]->take(t, 0, it);
          got.push_back(bufs[r][t]);
          ASSERT_EQ(got.back().size(), n);
        }
        std::vector<std::vector<float>> x;
        for (uint32_t r = 0; r < m; ++r) x.push_back(node_values(n, r, it));
        size_t mismatches = 0, differ = 0;
        for (uint64_t i = 0; i < n; ++i) {
          std::vector<float> xi;
          double exact = 0, mag = 0;
          for (uint32_t r = 0; r < m; ++r) {
            xi.push_back(x[r][i]);
            exact += x[r][i];
            mag += std::fabs(x[r][i]);
          }
          const float expect = ring_reference(geo, n, i, f, xi);
          mismatches += std::memcmp(&got[0][i], &expect, 4) != 0;
          for (uint32_t r = 1; r < m; ++r) differ += std::memcmp(&got[0][i], &got[r][i], 4) != 0;
          if (f == bd::RingFormat::kFp16) {
            // One rounding per hop, each of at most half an fp16 ulp of a
            // partial sum no larger than sum |x| (plus fp32's own).
            const double half_ulp = std::ldexp(1.0, std::ilogb(std::max(mag, 1e-30)) - 11);
            EXPECT_LE(std::fabs(got[0][i] - exact), m * half_ulp + 1e-5 * mag)
                << "m=" << m << " n=" << n << " i=" << i;
            // Summing in fp16 (DDP's fp16 hook): inputs rounded, each addition rounded.
            uint32_t k = 0;
            while (geo.segment_end(n, k) <= i) ++k;
            float q = h16(xi[k]);
            for (uint32_t j = 1; j < m; ++j) q = h16(q + h16(xi[(k + j) % m]));
            err_ring += std::fabs(got[0][i] - exact);
            err_half += std::fabs(q - exact);
          }
        }
        EXPECT_EQ(mismatches, 0u) << "m=" << m << " n=" << n << " " << bd::to_string(f);
        EXPECT_EQ(differ, 0u) << "m=" << m << " n=" << n << " " << bd::to_string(f)
                              << ": nodes differ";
      }
    }
    EXPECT_GT(err_half, 0.0);
    EXPECT_LE(err_ring, err_half) << "m=" << m << ": the ring is less accurate than fp16 sums";
    for (uint32_t r = 0; r < m; ++r) {
      std::lock_guard l(ring.events[r]->mu);
      EXPECT_TRUE(ring.events[r]->failures.empty()) << ring.events[r]->failures.front();
      // Each start's own chunks were answered once.
      EXPECT_EQ(ring.events[r]->acked, static_cast<int>(3 * counts.size()));
    }
  }
}

// Nodes that disagree on a round's format fail, naming both sides; a node
// that goes away fails its neighbours' jobs naming it.
TEST_P(RingHubs, DisagreementAndALostNeighbourFailTheJobNamingTheCause) {
  {
    std::vector<float> x0(1000, 1.5f), x1(1000, 1.5f);  // outlive the ring
    Ring ring(2, GetParam(), 60, {1000}, 1024);
    ring.jobs[0]->start(0, 0, 0, bd::RingFormat::kFp32, 1, x0.data(), 1000);
    try {
      // Node 0's chunks may already be here: the start or the receipt fails.
      ring.jobs[1]->start(0, 0, 0, bd::RingFormat::kFp16, 2, x1.data(), 1000);
    } catch (const bytecomp::Error&) {
    }
    ASSERT_TRUE(ring.events[1]->wait_failed() || ring.events[0]->wait_failed());
    std::string why;
    for (auto& e : ring.events) {
      std::lock_guard l(e->mu);
      for (auto& f : e->failures) why += f + "\n";
    }
    EXPECT_NE(why.find("disagree on the tensor's strategy"), std::string::npos) << why;
  }
  {
    std::vector<float> x0(5000, 0.5f), x1(5000, 0.5f);  // outlive the ring
    Ring ring(3, GetParam(), 61, {5000}, 1024);
    ring.jobs[0]->start(0, 0, 0, bd::RingFormat::kFp32, 1, x0.data(), 5000);
    ring.jobs[1]->start(0, 0, 0, bd::RingFormat::kFp32, 1, x1.data(), 5000);
    const auto t0 = std::chrono::steady_clock::now();
    ring.jobs[2]->close();
    ring.hubs[2].reset();  // node 202 dies
    for (uint32_t r = 0; r < 2; ++r) {
      ASSERT_TRUE(ring.events[r]->wait_failed()) << r;
      std::lock_guard l(ring.events[r]->mu);
      EXPECT_NE(ring.events[r]->failures.front().find("node 202 (rank 2)"), std::string::npos)
          << ring.events[r]->failures.front();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  }
}

// A hand-made sender in a 2-node job with hub 200: every malformed chunk is
// refused with the reason; a stranger's messages do not disturb the job.
TEST_P(RingHubs, MalformedChunksAreRefusedWithTheReason) {
  Events ea;  // outlives the hub, whose threads run the job's callbacks
  bd::PeerHub a(hub_config(200, GetParam()));
  auto x = bt::make_transport(hub_config(201, GetParam()));
  x->start();
  auto stranger = bt::make_transport(hub_config(209, GetParam()));
  stranger->start();
  bd::RingJobSpec s;
  s.name = "junk";
  s.uid = 70;
  s.rank = 0;
  s.nodes = {200, 201};
  s.addresses = {a.address(), x->local_addresses().front()};
  s.tensor_names = {"w"};
  s.partitions = {1};
  s.partition_count = [](uint32_t, uint32_t) -> uint64_t { return 1000; };
  s.chunk_bytes = 1024;  // 256 elements; segments of 500: 2 chunks each
  s.timeout = 10s;
  auto job = a.open_ring(s, ea.on_ready(), ea.on_fail());
  x->add_peer(200, a.address());
  stranger->add_peer(200, a.address());
  auto send = [&](bt::Transport& from, uint32_t uid, uint64_t it, std::vector<bt::Buffer> p) {
    bt::Message m;
    m.header.type = bd::kRingData;
    m.header.aux = uid;
    m.header.key = 0;
    m.header.arg = it;
    m.payloads = std::move(p);
    bt::Response r = from.call(200, std::move(m), 5000ms);
    EXPECT_TRUE(r.status.ok()) << r.status.to_string();
    std::string text;
    for (const auto& b : r.response.payloads) text.append(b.view());
    return std::make_pair(r.response.header.type, text);
  };
  // Node 201 sends segment 1 at step 0: elements [500, 1000), chunks of 256.
  auto header = [](uint32_t step, uint32_t chunk, uint64_t offset, uint64_t count) {
    bd::RingHeader h;
    h.sender_rank = 1;
    h.step = step;
    h.chunk = chunk;
    h.partition_count = 1000;
    h.offset = offset;
    h.count = count;
    h.plan_digest = 5;
    h.data_bytes = count * 4;
    return h;
  };
  auto data = [](uint64_t n) { return bt::Buffer::copy_of(std::vector<float>(n, 1.0f).data(), n * 4); };
  auto refused = [&](std::pair<uint16_t, std::string> r, const std::string& needle) {
    EXPECT_EQ(r.first, bd::kRingError) << r.second;
    EXPECT_NE(r.second.find(needle), std::string::npos) << r.second;
  };
  refused(send(*stranger, 70, 0, {bd::encode_ring_header(header(0, 0, 500, 256)), data(256)}),
          "not a peer of job 'junk'");
  refused(send(*x, 71, 0, {bd::encode_ring_header(header(0, 0, 500, 256)), data(256)}),
          "no ring job with uid 71");
  refused(send(*x, 70, 0, {data(256)}), "payloads");
  refused(send(*x, 70, 0, {bt::Buffer::copy_of("short", 5), data(256)}), "header is 5 bytes");
  {
    bd::RingHeader h = header(0, 0, 500, 256);
    h.data_bytes = 100;
    refused(send(*x, 70, 0, {bd::encode_ring_header(h), data(256)}), "header says 100 bytes");
  }
  {
    std::lock_guard l(ea.mu);
    EXPECT_TRUE(ea.failures.empty()) << "refusals before the neighbour check failed the job";
  }
  // From the neighbour, each bad field is refused and fails the job (the
  // ring cannot complete without the chunk): the first one counts.
  refused(send(*x, 70, 0, {bd::encode_ring_header(header(0, 1, 500, 256)), data(256)}),
          "is elements [756, 1000), not [500, +256)");
  ASSERT_TRUE(ea.wait_failed());
  EXPECT_NE(ea.failures.front().find("bad ring data from node 201 (rank 1)"), std::string::npos)
      << ea.failures.front();
  refused(send(*x, 70, 0, {bd::encode_ring_header(header(2, 0, 500, 256)), data(256)}),
          "step 2 (a ring of 2 nodes has 2)");
  refused(send(*x, 70, 0, {bd::encode_ring_header(header(0, 2, 500, 256)), data(256)}),
          "chunk 2 of step 0 (segment 1 has 2)");
  {
    bd::RingHeader h = header(0, 0, 500, 256);
    h.partition_count = 999;
    refused(send(*x, 70, 0, {bd::encode_ring_header(h), data(256)}),
            "999 elements sent, the partition has 1000");
    h = header(0, 0, 500, 256);
    h.sender_rank = 0;
    refused(send(*x, 70, 0, {bd::encode_ring_header(h), data(256)}), "claims rank 0");
    h = header(0, 0, 500, 256);
    h.format = bd::RingFormat::kFp16;
    h.data_bytes = 1024;
    refused(send(*x, 70, 0, {bd::encode_ring_header(h), data(256)}), "1024 bytes of fp16 for 256");
  }
  EXPECT_EQ(send(*x, 70, 0, {bd::encode_ring_header(header(0, 0, 500, 256)), data(256)}).first,
            bd::kRingOk);
  refused(send(*x, 70, 0, {bd::encode_ring_header(header(0, 0, 500, 256)), data(256)}),
          "sent twice");
  EXPECT_EQ(send(*x, 70, 1, {bd::encode_ring_header(header(0, 0, 500, 256)), data(256)}).first,
            bd::kRingOk);
  refused(send(*x, 70, 2, {bd::encode_ring_header(header(0, 0, 500, 256)), data(256)}),
          "too far ahead");
  job->close();
  refused(send(*x, 70, 0, {bd::encode_ring_header(header(0, 1, 756, 244)), data(244)}),
          "no ring job with uid 70");
  x->shutdown();
  stranger->shutdown();
}

// The link's credit goes to the earliest tensor: node 0 (hub 200) queues
// 8 step-0 chunks of tensor 1, then 2 of tensor 0, with a window of 2; its
// neighbour (a hand-made rank 1) holds its answers, then gives them back
// one at a time. Tensor 0's chunks go out right after the 2 of tensor 1
// already on the link, not after all 8.
TEST_P(RingHubs, EarlierTensorsOvertakeTheQueuedChunksOfLaterOnes) {
  Events ea;  // outlives the hub
  bd::PeerHub a(hub_config(200, GetParam()));
  auto x = bt::make_transport(hub_config(201, GetParam()));
  std::mutex mu;
  std::condition_variable cv;
  std::vector<bt::Incoming> held;
  std::vector<std::pair<uint32_t, uint32_t>> order;  // (tensor, chunk) as they came
  x->set_handler(bd::kRingData, [&](bt::Incoming in) {
    const bd::RingHeader h = bd::decode_ring_header(in.message.payloads[0].span());
    std::lock_guard l(mu);
    order.emplace_back(static_cast<uint32_t>(in.message.header.key >> 32), h.chunk);
    held.push_back(std::move(in));
    cv.notify_all();
  });
  x->start();
  bd::RingJobSpec s;
  s.name = "credit";
  s.uid = 75;
  s.rank = 0;
  s.nodes = {200, 201};
  s.addresses = {a.address(), x->local_addresses().front()};
  s.tensor_names = {"first", "second"};
  s.partitions = {1, 1};
  // Segment 0 (node 0's step-0 segment) of 1024 and 4096 elements: 2 and 8
  // chunks of 256.
  s.partition_count = [](uint32_t t, uint32_t) -> uint64_t { return t == 0 ? 1024 : 4096; };
  s.chunk_bytes = 1024;
  s.window = 2;
  s.timeout = 10s;
  auto job = a.open_ring(s, ea.on_ready(), ea.on_fail());
  x->add_peer(200, a.address());
  std::vector<float> t0(1024, 1.0f), t1(4096, 2.0f);  // outlive the job
  auto wait_for = [&](size_t n) {
    std::unique_lock l(mu);
    return cv.wait_for(l, 10s, [&] { return order.size() >= n; });
  };
  job->start(1, 0, 0, bd::RingFormat::kFp32, 1, t1.data(), 4096);
  ASSERT_TRUE(wait_for(2));
  job->start(0, 0, 0, bd::RingFormat::kFp32, 1, t0.data(), 1024);
  for (size_t answered = 0; answered < 10; ++answered) {
    bt::Incoming in;
    {
      std::unique_lock l(mu);
      ASSERT_TRUE(cv.wait_for(l, 10s, [&] { return !held.empty(); })) << answered;
      in = std::move(held.front());
      held.erase(held.begin());
    }
    bt::Message ok;
    ok.header.type = bd::kRingOk;
    x->reply(in, std::move(ok), nullptr);
  }
  ASSERT_TRUE(wait_for(10));
  const std::vector<std::pair<uint32_t, uint32_t>> expect = {
      {1, 0}, {1, 1}, {0, 0}, {0, 1}, {1, 2}, {1, 3}, {1, 4}, {1, 5}, {1, 6}, {1, 7}};
  {
    std::lock_guard l(mu);
    EXPECT_EQ(order, expect);
    std::lock_guard le(ea.mu);
    EXPECT_TRUE(ea.failures.empty()) << ea.failures.front();
  }
  job->close();
  x->shutdown();
}

INSTANTIATE_TEST_SUITE_P(Backends, RingHubs,
                         ::testing::ValuesIn(bytecomp::transport::available_backends()),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
