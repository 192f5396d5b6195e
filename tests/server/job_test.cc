// Pure parts of the server library: strategy -> plan mapping, the partition
// assignment (balance, determinism, placements), the control codec, and the
// cluster/server configs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>

#include "common/config.h"
#include "server/cluster_config.h"
#include "server/job.h"
#include "server/protocol.h"
#include "server/ps_server.h"

using namespace bytecomp;
using namespace bytecomp::server;

namespace {

std::vector<ServerInfo> servers(int n, uint32_t engines) {
  std::vector<ServerInfo> s;
  for (int i = 0; i < n; ++i) s.push_back({static_cast<NodeId>(i), "tcp://127.0.0.1:1", engines});
  return s;
}

std::string strategy_text(const std::string& entries) {
  return "version: 1\nentries:\n" + entries;
}

}  // namespace

TEST(PlanTest, MapsOptionsToServerPlans) {
  std::vector<TensorSpec> t = {{"raw", 100}, {"half", 100}, {"halfdense", 100},
                               {"rk", 100},  {"topk", 100}, {"peer", 100},
                               {"single", 100}};
  auto plans = plan_job(
      t, strategy_text("  - {tensor: half, option: {compressor: fp16, inter: reduce_scatter_allgather}}\n"
                  "  - {tensor: halfdense, option: {compressor: fp16, inter: alltoall_allgather}}\n"
                  "  - {tensor: rk, option: {compressor: randomk, params: {ratio: '0.1'}, inter: allreduce}}\n"
                  "  - {tensor: topk, option: {compressor: topk, error_feedback: true, inter: alltoall_allgather}}\n"
                  "  - {tensor: peer, option: {compressor: topk, inter: allgather}}\n"
                  "  - {tensor: single, option: {compressor: none, inter: reduce_broadcast}}\n"));
  EXPECT_EQ(plans[0].placement, Placement::kSharded);
  EXPECT_FALSE(plans[0].compressed_push());
  EXPECT_EQ(plans[0].pull, PullFormat::kFp32);
  EXPECT_EQ(plans[1].sum, SumMode::kCompressed);
  EXPECT_EQ(plans[1].pull, PullFormat::kCompressed);
  EXPECT_EQ(plans[2].sum, SumMode::kDense);
  EXPECT_EQ(plans[2].pull, PullFormat::kFp16);
  EXPECT_EQ(plans[3].sum, SumMode::kCompressed);
  EXPECT_EQ(plans[3].spec().params.at("ratio"), "0.1");
  EXPECT_EQ(plans[4].sum, SumMode::kDense);
  EXPECT_EQ(plans[4].pull, PullFormat::kCompressed);
  EXPECT_TRUE(plans[4].server_error_feedback);
  EXPECT_EQ(plans[5].placement, Placement::kPeer);
  EXPECT_EQ(plans[6].placement, Placement::kSingle);
}

TEST(PlanTest, RefusesWhatTheServersCannotRun) {
  // The strategy loader already refuses it; plan_for_option checks on its own.
  EXPECT_THROW(plan_job({{"g", 10}}, strategy_text("  - {tensor: g, option: {compressor: topk, "
                                              "inter: reduce_scatter_allgather}}\n")),
               Error);
  planner::Option o;
  o.compressor = "topk";
  o.inter = planner::Collective::kReduceScatterAllgather;
  try {
    plan_for_option(o, "g");
    FAIL() << "accepted a non-additive compressor under a reducing collective";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'g'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("not additive"), std::string::npos) << e.what();
  }
  try {
    plan_job({{"h", 10, compress::DType::kFloat16}}, "");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'h'"), std::string::npos) << e.what();
  }
}

TEST(AssignmentTest, CutsTensorsAndBalancesBytes) {
  std::vector<TensorSpec> t;
  for (int i = 0; i < 20; ++i) t.push_back({"t" + std::to_string(i), uint64_t(1000 + 777 * i)});
  std::vector<TensorPlan> plans(t.size());
  const uint64_t pb = 4096;
  Assignment a = assign_partitions(t, plans, servers(3, 4), pb);
  // Every element covered exactly once, partitions no larger than pb.
  for (uint32_t i = 0; i < t.size(); ++i) {
    uint64_t next = 0;
    for (uint32_t idx : a.by_tensor[i]) {
      const Partition& p = a.partitions[idx];
      EXPECT_EQ(p.offset, next);
      EXPECT_LE(p.count * 4, pb);
      EXPECT_EQ(p.key, partition_key(i, p.index));
      EXPECT_EQ(a.find(p.key), &p);
      next += p.count;
    }
    EXPECT_EQ(next, t[i].count);
  }
  // Balance: greedy largest-first keeps every server within one partition
  // of the mean, and every engine of a server within one partition too.
  std::map<NodeId, uint64_t> per_server;
  std::map<std::pair<NodeId, uint32_t>, uint64_t> per_engine;
  uint64_t total = 0;
  for (const Partition& p : a.partitions) {
    per_server[p.server] += p.count * 4;
    per_engine[{p.server, p.engine}] += p.count * 4;
    total += p.count * 4;
    EXPECT_LT(p.engine, 4u);
  }
  ASSERT_EQ(per_server.size(), 3u);
  for (auto& [s, b] : per_server) EXPECT_LE(b, total / 3 + pb) << "server " << s;
  auto [mn, mx] = std::minmax_element(per_server.begin(), per_server.end(),
                                      [](auto& x, auto& y) { return x.second < y.second; });
  EXPECT_LE(mx->second - mn->second, pb);
  for (auto& [s, b] : per_server) {
    uint64_t lo = UINT64_MAX, hi = 0;
    for (uint32_t e = 0; e < 4; ++e) {
      lo = std::min(lo, per_engine[{s, e}]);
      hi = std::max(hi, per_engine[{s, e}]);
    }
    EXPECT_LE(hi - lo, pb) << "server " << s;
  }
  // Pure: same inputs, same result; different servers, different digest.
  EXPECT_EQ(assign_partitions(t, plans, servers(3, 4), pb).digest, a.digest);
  EXPECT_EQ(assign_partitions(t, plans, servers(3, 4), pb).partitions, a.partitions);
  EXPECT_NE(assign_partitions(t, plans, servers(2, 4), pb).digest, a.digest);
}

TEST(AssignmentTest, PlacementsSingleAndPeer) {
  std::vector<TensorSpec> t = {{"big", 1000000}, {"single", 50000}, {"peer", 50000}};
  std::vector<TensorPlan> plans(3);
  plans[1].placement = Placement::kSingle;
  plans[2].placement = Placement::kPeer;
  Assignment a = assign_partitions(t, plans, servers(4, 2), 4096);
  EXPECT_TRUE(a.by_tensor[2].empty());
  std::set<NodeId> single_servers;
  for (uint32_t idx : a.by_tensor[1]) single_servers.insert(a.partitions[idx].server);
  EXPECT_EQ(single_servers.size(), 1u);
  std::set<NodeId> big_servers;
  for (uint32_t idx : a.by_tensor[0]) big_servers.insert(a.partitions[idx].server);
  EXPECT_EQ(big_servers.size(), 4u);
  EXPECT_THROW(assign_partitions(t, plans, {}, 4096), Error);
  EXPECT_THROW(assign_partitions(t, plans, servers(1, 1), 2), Error);
}

// Ring tensors (the daemons' allreduce) get server partitions, so a strategy
// change may move them to ps at one iteration, placed after every other
// partition: the other tensors sit exactly where they sit in the same job
// whose ring tensors have none (here: the allgather placement, which gets
// none), on servers and on engines.
TEST(AssignmentTest, RingTensorsGetPartitionsAfterEveryOtherTensor) {
  const uint64_t pb = 4096;
  std::vector<TensorSpec> t = {{"big", 100000}, {"ring_a", 30001}, {"single", 9000},
                               {"small", 700},  {"ring_b", 5000}};
  std::vector<TensorPlan> plans(t.size());
  plans[1].placement = Placement::kRing;
  plans[2].placement = Placement::kSingle;
  plans[4].placement = Placement::kRing;
  std::vector<TensorPlan> without = plans;
  without[1].placement = Placement::kPeer;
  without[4].placement = Placement::kPeer;
  for (int nservers : {1, 2, 3}) {
    SCOPED_TRACE("servers " + std::to_string(nservers));
    const Assignment a = assign_partitions(t, plans, servers(nservers, 3), pb);
    const Assignment b = assign_partitions(t, without, servers(nservers, 3), pb);
    for (uint32_t r : {1u, 4u}) {
      ASSERT_EQ(a.by_tensor[r].size(), (t[r].count * 4 + pb - 1) / pb) << t[r].name;
      uint64_t next = 0;
      for (uint32_t idx : a.by_tensor[r]) {
        EXPECT_EQ(a.partitions[idx].offset, next);
        next += a.partitions[idx].count;
      }
      EXPECT_EQ(next, t[r].count);
      EXPECT_TRUE(b.by_tensor[r].empty());
    }
    for (uint32_t k : {0u, 2u, 3u}) {
      ASSERT_EQ(a.by_tensor[k].size(), b.by_tensor[k].size()) << t[k].name;
      for (size_t j = 0; j < a.by_tensor[k].size(); ++j)
        EXPECT_EQ(a.partitions[a.by_tensor[k][j]], b.partitions[b.by_tensor[k][j]])
            << t[k].name << " partition " << j;
    }
    EXPECT_NE(a.digest, b.digest);
  }
  // With two servers the ring partitions still spread over both.
  const Assignment two = assign_partitions(t, plans, servers(2, 1), pb);
  std::set<NodeId> ring_servers;
  for (uint32_t idx : two.by_tensor[1]) ring_servers.insert(two.partitions[idx].server);
  EXPECT_EQ(ring_servers.size(), 2u);
}

// Which strategy changes may move a tensor mid-job: between ring and ps
// only, named otherwise.
TEST(AssignmentTest, PlacementChangesBetweenRingAndPsOnly) {
  std::vector<TensorSpec> t = {{"w", 1000}, {"b", 10}};
  const auto ps = plan_job(t, "");
  const auto ring = plan_job(t, "version: 1\ndefault: {compressor: none, inter: allreduce}\n");
  const auto ring_fp16 = plan_job(t, "version: 1\ndefault: {compressor: fp16, inter: allreduce}\n");
  const auto single = plan_job(t, "version: 1\ndefault: {compressor: none, inter: reduce_broadcast}\n");
  const auto peer = plan_job(t, "version: 1\ndefault: {compressor: fp16, inter: allgather}\n");
  ASSERT_EQ(ring[0].placement, Placement::kRing);
  ASSERT_EQ(single[0].placement, Placement::kSingle);
  ASSERT_EQ(peer[0].placement, Placement::kPeer);
  EXPECT_EQ(strategy::placement_change(t, ps, ring), "");
  EXPECT_EQ(strategy::placement_change(t, ring, ps), "");
  EXPECT_EQ(strategy::placement_change(t, ring_fp16, ps), "");
  EXPECT_EQ(strategy::placement_change(t, peer, peer), "");
  for (const auto* to : {&single, &peer}) {
    const std::string why = strategy::placement_change(t, ring, *to);
    EXPECT_NE(why.find("tensor 'w' would move from ring to " +
                       std::string(strategy::to_string((*to)[0].placement))),
              std::string::npos)
        << why;
    EXPECT_NE(why.find("a placement change to or from ps_single or allgather needs a new job"),
              std::string::npos)
        << why;
  }
  EXPECT_NE(strategy::placement_change(t, single, ps).find("from ps_single to ps"),
            std::string::npos);
  EXPECT_NE(strategy::placement_change(t, peer, ring).find("from allgather to ring"),
            std::string::npos);
}

// Option::pieces executed: a tensor whose option has pieces q is cut at
// partition_bytes / q (whole 64-byte multiples), so it has q times the
// partitions of the same tensor without pieces (a length that is a
// multiple of partition_bytes), every element covered once, keys in order;
// the digest (what coordinator, servers and nodes compare) sees it.
TEST(AssignmentTest, PiecesCutEachTensorIntoItsOwnPartitions) {
  const uint64_t pb = 64 * 1024;
  // 3 full partitions of the job's size; 2.5; one not a multiple of 64.
  std::vector<TensorSpec> t = {{"p1", 3 * pb / 4}, {"p4", 3 * pb / 4}, {"p2", 5 * pb / 8},
                               {"p8", 10007}, {"single8", 3 * pb / 4}};
  const auto plans = plan_job(
      t, strategy_text("  - {tensor: p4, option: {compressor: none, pieces: 4}}\n"
                       "  - {tensor: p2, option: {compressor: efsignsgd, inter: alltoall_allgather, "
                       "pieces: 2}}\n"
                       "  - {tensor: p8, option: {compressor: none, pieces: 8}}\n"
                       "  - {tensor: single8, option: {compressor: none, inter: reduce_broadcast, "
                       "pieces: 8}}\n"));
  ASSERT_EQ(strategy::plan_pieces(plans[0]), 1);
  ASSERT_EQ(strategy::plan_pieces(plans[1]), 4);
  EXPECT_EQ(strategy::tensor_partition_bytes(plans[0], pb), pb);
  EXPECT_EQ(strategy::tensor_partition_bytes(plans[1], pb), pb / 4);
  EXPECT_EQ(strategy::tensor_partition_bytes(plans[2], pb), pb / 2);
  EXPECT_EQ(strategy::tensor_partition_bytes(plans[3], pb), pb / 8);
  // Rounded down to 64 bytes, never below.
  EXPECT_EQ(strategy::tensor_partition_bytes(plans[3], 4096 + 640), 576u);
  EXPECT_EQ(strategy::tensor_partition_bytes(plans[3], 256), 64u);
  const Assignment a = assign_partitions(t, plans, servers(2, 2), pb);
  const uint64_t want_parts[] = {3, 12, 5, (10007 * 4 + pb / 8 - 1) / (pb / 8), 24};
  for (uint32_t i = 0; i < t.size(); ++i) {
    SCOPED_TRACE(t[i].name);
    const uint64_t per = strategy::tensor_partition_bytes(plans[i], pb) / 4;
    ASSERT_EQ(a.by_tensor[i].size(), want_parts[i]);
    EXPECT_EQ(a.by_tensor[i].size(),
              strategy::partition_count(t[i].bytes(), strategy::tensor_partition_bytes(plans[i], pb)));
    uint64_t next = 0;
    uint32_t index = 0;
    for (uint32_t idx : a.by_tensor[i]) {
      const Partition& p = a.partitions[idx];
      EXPECT_EQ(p.index, index++);
      EXPECT_EQ(p.key, partition_key(i, p.index));
      EXPECT_EQ(p.offset, next);
      EXPECT_EQ(p.offset, uint64_t{p.index} * per);
      EXPECT_EQ(p.count, std::min(per, t[i].count - p.offset));
      next += p.count;
    }
    EXPECT_EQ(next, t[i].count);
  }
  // A single-server tensor keeps all its slices on one server.
  std::set<NodeId> single;
  for (uint32_t idx : a.by_tensor[4]) single.insert(a.partitions[idx].server);
  EXPECT_EQ(single.size(), 1u);
  // The digest covers pieces: the same job without them differs, and a
  // change of one tensor's count differs again.
  const auto flat = plan_job(t, "");
  EXPECT_NE(assign_partitions(t, flat, servers(2, 2), pb).digest, a.digest);
  auto other = plans;
  other[1] = plan_job({t[1]}, strategy_text("  - {tensor: p4, option: {compressor: none, "
                                            "pieces: 2}}\n"))[0];
  EXPECT_NE(assign_partitions(t, other, servers(2, 2), pb).digest, a.digest);
  EXPECT_EQ(assign_partitions(t, plans, servers(2, 2), pb).digest, a.digest);
  // The same tensors without pieces, each cut by the job's partition size.
  const Assignment f = assign_partitions(t, flat, servers(2, 2), pb);
  EXPECT_EQ(f.by_tensor[1].size(), 3u);
  EXPECT_EQ(f.by_tensor[4].size(), 3u);

  // A strategy change of a tensor's pieces is named (the coordinator and
  // a one-node daemon refuse it); other changes pass.
  const std::string why = strategy::layout_change(t, plans, other);
  EXPECT_NE(why.find("tensor 'p4'"), std::string::npos) << why;
  EXPECT_NE(why.find("from 4 to 2"), std::string::npos) << why;
  EXPECT_EQ(strategy::layout_change(t, plans, plans), "");
  auto recompressed = plans;
  recompressed[1] = plan_job({t[1]}, strategy_text("  - {tensor: p4, option: {compressor: fp16, "
                                                   "inter: alltoall_allgather, pieces: 4}}\n"))[0];
  EXPECT_EQ(strategy::layout_change(t, plans, recompressed), "");
}

TEST(ProtocolTest, AdmissionRoundTripAndTruncation) {
  proto::Admission a;
  a.name = "job";
  a.uid = 7;
  a.rank = 1;
  a.nodes = {100, 101};
  a.tensors = {{"w", 12}, {"b", 3}};
  a.deterministic = true;
  a.start_iteration = 5;
  a.partition_bytes = 4096;
  a.servers = servers(2, 3);
  a.strategy_yaml = "version: 1\n";
  a.digest = 99;
  a.peer_addresses = {"tcp://127.0.0.1:9300", ""};
  transport::Buffer b = proto::encode(a);
  proto::Admission d = proto::decode_admission(b.view());
  EXPECT_EQ(d.name, a.name);
  EXPECT_EQ(d.nodes, a.nodes);
  EXPECT_EQ(d.tensors, a.tensors);
  EXPECT_EQ(d.servers, a.servers);
  EXPECT_EQ(d.digest, a.digest);
  EXPECT_EQ(d.peer_addresses, a.peer_addresses);
  // Every truncation is refused with a message naming the field.
  for (size_t n = 0; n < b.size(); ++n) {
    try {
      proto::decode_admission(b.view().substr(0, n));
      FAIL() << "accepted a truncation to " << n << " bytes";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kMalformed);
    }
  }
  std::string extra(b.view());
  extra += "x";
  EXPECT_THROW(proto::decode_admission(extra), Error);
  std::string huge(b.view());
  huge[2] = huge[3] = huge[4] = huge[5] = '\xff';  // name length 4 GiB
  EXPECT_THROW(proto::decode_admission(huge), Error);
}

TEST(ConfigTest, ShippedExamplesLoad) {
  std::string root = std::getenv("BYTECOMP_SOURCE_ROOT") ? std::getenv("BYTECOMP_SOURCE_ROOT") : ".";
  ClusterConfig c = load_cluster_config(root + "/configs/cluster.yaml");
  EXPECT_FALSE(c.servers.empty());
  EXPECT_NE(c.server(c.coordinator), nullptr);
  ServerConfig s = ServerConfig::load(root + "/configs/server.yaml");
  EXPECT_EQ(s.node_id, c.coordinator);
  EXPECT_EQ(s.transport.listen.at(0), c.server(s.node_id)->address);
}

TEST(ConfigTest, ErrorsNameKeyAndAcceptedValues) {
  auto err = [](const std::string& text) -> std::string {
    try {
      config::Document d = config::Document::parse(text, "cluster.yaml");
      config::Reader r = d.root("");
      read_cluster_config(r);
      r.finish();
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_NE(err("version: 1\ncluster: {coordinator: 3, servers: [{id: 0, address: 'tcp://a:1'}]}\n")
                .find("coordinator"),
            std::string::npos);
  EXPECT_NE(err("version: 1\ncluster: {coordinator: 0, servers: [{id: 0, address: 'foo'}]}\n")
                .find("tcp://host:port"),
            std::string::npos);
  EXPECT_NE(err("version: 1\ncluster: {coordinator: 0, servers: [{id: 0, address: 'tcp://a:1'}], "
                "daemons: [{id: 0}]}\n")
                .find("used twice"),
            std::string::npos);
  EXPECT_NE(err("version: 1\ncluster: {coordinator: 0, partition_bytes: 1, servers: [{id: 0, "
                "address: 'tcp://a:1'}]}\n")
                .find("partition_bytes"),
            std::string::npos);
  EXPECT_NE(err("version: 1\ncluster: {coordinator: 0, servers: [{id: 0, address: 'tcp://a:1'}], "
                "bogus: 1}\n")
                .find("bogus"),
            std::string::npos);
  EXPECT_NE(err("version: 1\ncluster: {coordinator: 0, servers: [{id: 0, address: 'tcp://a:1'}]}\n"
                "transport: {peer_timeout_ms: -5}\n")
                .find("peer_timeout_ms"),
            std::string::npos);
}
