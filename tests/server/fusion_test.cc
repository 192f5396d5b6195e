// Tensor fusion's layout (server/fusion.h) and the equal-shard assignment of
// a fused bucket (server/job.h): pure functions, checked value by value.
#include <gtest/gtest.h>

#include <map>
#include <numeric>

#include "server/fusion.h"
#include "server/job.h"
#include "server/protocol.h"

using namespace bytecomp;
using namespace bytecomp::server;

namespace {

std::vector<ServerInfo> servers(int n) {
  std::vector<ServerInfo> s;
  for (int i = 0; i < n; ++i) s.push_back({static_cast<NodeId>(i), "tcp://127.0.0.1:1", 2});
  return s;
}

FusionConfig on(uint64_t first, uint64_t cap) { return FusionConfig{true, first, cap}; }

// n tensors "t0".."t{n-1}" of the given element counts.
std::vector<TensorSpec> tensors(const std::vector<uint64_t>& counts) {
  std::vector<TensorSpec> t;
  for (size_t i = 0; i < counts.size(); ++i) t.push_back({"t" + std::to_string(i), counts[i]});
  return t;
}

}  // namespace

TEST(FusionTest, DisabledLeavesTheDeclaredTensorsAlone) {
  auto t = tensors({10, 20, 30});
  JobUnits u = fuse_job(t, plan_job(t, ""), FusionConfig{});
  EXPECT_EQ(u.tensors, t);
  EXPECT_TRUE(u.buckets.empty());
  EXPECT_EQ(u.bucket_of, (std::vector<int32_t>{-1, -1, -1}));
}

TEST(FusionTest, ReadyOrderFirstBucketSmallThenCap) {
  // 1 KiB each (256 floats): first bucket 4 KiB holds 4, later ones 8 KiB
  // hold 8; filled from the last declared tensor (backward's order).
  auto t = tensors(std::vector<uint64_t>(14, 256));
  JobUnits u = fuse_job(t, plan_job(t, ""), on(4096, 8192));
  ASSERT_GE(u.buckets.size(), 2u);
  EXPECT_EQ(u.buckets[0].members, (std::vector<uint32_t>{13, 12, 11, 10}));
  EXPECT_EQ(u.buckets[0].offsets, (std::vector<uint64_t>{0, 256, 512, 768}));
  EXPECT_EQ(u.buckets[0].count, 1024u);
  EXPECT_EQ(u.buckets[1].members, (std::vector<uint32_t>{9, 8, 7, 6, 5, 4, 3, 2}));
  // t1, t0 remain: a third bucket of two.
  ASSERT_EQ(u.buckets.size(), 3u);
  EXPECT_EQ(u.buckets[2].members, (std::vector<uint32_t>{1, 0}));
  EXPECT_EQ(u.tensors.size(), 17u);
  EXPECT_EQ(u.bucket_of[0], 2);
  EXPECT_EQ(u.bucket_of[13], 0);
  ASSERT_EQ(u.declared, 14u);
  EXPECT_EQ(u.tensors[14].count, 1024u);
  EXPECT_EQ(u.tensors[14].name, "fused[0]:t13..t10");
  EXPECT_TRUE(u.is_bucket(14));
  EXPECT_FALSE(u.is_bucket(13));
}

TEST(FusionTest, TwoLeftoverTensorsMakeABucketOneDoesNot) {
  auto t = tensors({256, 256, 256, 256, 256, 256});
  JobUnits u = fuse_job(t, plan_job(t, ""), on(4096, 4096));
  ASSERT_EQ(u.buckets.size(), 2u);
  EXPECT_EQ(u.buckets[0].members, (std::vector<uint32_t>{5, 4, 3, 2}));
  EXPECT_EQ(u.buckets[1].members, (std::vector<uint32_t>{1, 0}));
  auto t5 = tensors({256, 256, 256, 256, 256});
  JobUnits v = fuse_job(t5, plan_job(t5, ""), on(4096, 4096));
  ASSERT_EQ(v.buckets.size(), 1u);
  EXPECT_EQ(v.bucket_of[0], -1);  // alone: a bucket of one is not made
}

TEST(FusionTest, TensorsLargerThanTheBucketStayAlone) {
  // t4 (3 KiB) starts the 4 KiB first bucket; t3 (2 KiB) would overflow
  // it and starts the next (a first bucket of one tensor is not made); t1
  // (8 KiB, at the cap) closes {t3, t2} and stays alone; t0 is left alone.
  auto t = tensors({256, 2048, 256, 512, 768});
  JobUnits u = fuse_job(t, plan_job(t, ""), on(4096, 8192));
  ASSERT_EQ(u.buckets.size(), 1u);
  EXPECT_EQ(u.buckets[0].members, (std::vector<uint32_t>{3, 2}));
  EXPECT_EQ(u.bucket_of, (std::vector<int32_t>{-1, -1, 0, 0, -1}));
}

TEST(FusionTest, CompressedTensorsAreNeverFusedAndPlansDoNotMix) {
  auto t = tensors({256, 256, 256, 256, 256, 256, 256});
  const std::string yaml =
      "version: 1\nentries:\n"
      "  - {tensor: t0, option: {compressor: topk, params: {ratio: '0.1'}, inter: alltoall_allgather}}\n"
      "  - {tensor: t1, option: {compressor: fp16, inter: reduce_scatter_allgather}}\n"
      "  - {tensor: t2, option: {compressor: randomk, params: {ratio: '0.1'}, inter: allreduce}}\n"
      "  - {tensor: t3, option: {compressor: fp16, inter: reduce_scatter_allgather}}\n"
      "  - {tensor: t4, option: {compressor: none, inter: reduce_broadcast}}\n"
      "  - {tensor: t5, option: {compressor: none, inter: allreduce}}\n";
  auto plans = plan_job(t, yaml);
  JobUnits u = fuse_job(t, plans, on(1 << 20, 1 << 20));
  // t0 topk, t2 randomk (seeded per partition: not elementwise), t4
  // ps_single: alone. t1 + t3 (fp16 on the servers) fuse; t5 (ring) and t6
  // (ps, none) are alone in their classes.
  ASSERT_EQ(u.buckets.size(), 1u);
  EXPECT_EQ(u.buckets[0].members, (std::vector<uint32_t>{3, 1}));
  EXPECT_TRUE(u.plans[7] == plans[1]);
  for (uint32_t i : {0u, 2u, 4u, 5u, 6u}) EXPECT_EQ(u.bucket_of[i], -1) << i;

  // The same fp16 plan with error feedback (a residual per partition) or a
  // GPU device (the client compresses it itself) is not fusable.
  ASSERT_TRUE(fusable(plans[1]));
  for (int change = 0; change < 3; ++change) {
    strategy::TensorPlan p = plans[1];
    strategy::Option o = *p.option;
    if (change == 0) o.error_feedback = true;
    if (change == 1) o.comp_device = Device::kCuda;
    if (change == 2) o.cpu_share = 0.5;
    p.option = std::make_shared<const strategy::Option>(o);
    EXPECT_FALSE(fusable(p)) << change;
  }
}

// Pieces (strategy::tensor_partition_bytes) cut a tensor's partitions
// smaller; a bucket is cut into equal shards instead. A tensor whose option
// has pieces > 1 is therefore never fused (two of them with the same plan
// would otherwise share a bucket), keeps its own cut on the servers, and
// server::unit_partition_bytes is the cut assign_partitions makes for every
// unit: pieces for declared tensors, shards for buckets.
TEST(FusionTest, TensorsWithPiecesAreNeverFusedAndKeepTheirCut) {
  auto t = tensors({16384, 16384, 16384, 16384, 16384, 16384});
  const auto plans = plan_job(
      t, "version: 1\nentries:\n"
         "  - {tensor: t1, option: {compressor: none, pieces: 2}}\n"
         "  - {tensor: t3, option: {compressor: none, pieces: 2}}\n"
         "  - {tensor: t5, option: {compressor: none, pieces: 1}}\n");
  ASSERT_EQ(strategy::plan_pieces(plans[1]), 2);
  EXPECT_FALSE(fusable(plans[1]));
  EXPECT_TRUE(fusable(plans[5]));
  JobUnits u = fuse_job(t, plans, on(1 << 20, 1 << 20));
  ASSERT_EQ(u.buckets.size(), 1u);
  EXPECT_EQ(u.buckets[0].members, (std::vector<uint32_t>{5, 4, 2, 0}));
  EXPECT_EQ(u.bucket_of[1], -1);
  EXPECT_EQ(u.bucket_of[3], -1);
  const uint64_t pb = 64 << 10;  // t1 and t3 (64 KiB) in two 32 KiB pieces each
  const auto sv = servers(3);
  const std::vector<uint64_t> shards = shard_elements(u, sv.size(), pb);
  const std::vector<uint64_t> unit_pb = unit_partition_bytes(u, sv.size(), pb);
  ASSERT_EQ(unit_pb.size(), u.tensors.size());
  EXPECT_EQ(unit_pb[0], pb);
  EXPECT_EQ(unit_pb[1], pb / 2);
  EXPECT_EQ(unit_pb[3], pb / 2);
  EXPECT_EQ(unit_pb[6], shards[6] * 4);
  // 256 KiB over 3 servers: 2 rounds of shards, 6 of 10928 elements.
  EXPECT_EQ(unit_pb[6], 10928u * 4);
  const Assignment a = assign_partitions(u.tensors, u.plans, sv, pb, shards);
  for (uint32_t unit = 0; unit < u.tensors.size(); ++unit) {
    SCOPED_TRACE(u.tensors[unit].name);
    EXPECT_EQ(a.by_tensor[unit].size(),
              strategy::partition_count(u.tensors[unit].bytes(), unit_pb[unit]));
    for (uint32_t i : a.by_tensor[unit]) EXPECT_LE(a.partitions[i].count * 4, unit_pb[unit]);
  }
  EXPECT_EQ(a.by_tensor[1].size(), 2u);
  EXPECT_EQ(a.by_tensor[6].size(), 6u);
}

TEST(FusionTest, BytecompsOwnTensorsAreNeverFused) {
  // bytecomp.torch's control job: its control tensor is pushed alone.
  std::vector<TensorSpec> t = {{"bytecomp.control", 1024},
                               {"bytecomp.broadcast.0", 1024},
                               {"bytecomp.broadcast.1", 1024}};
  EXPECT_TRUE(fuse_job(t, plan_job(t, ""), on(64 << 20, 64 << 20)).buckets.empty());
}

TEST(FusionTest, RingTensorsFuseByFormat) {
  auto t = tensors({256, 256, 256, 256});
  auto plans = plan_job(t, "version: 1\ndefault: {compressor: none, inter: allreduce}\n"
                           "entries:\n  - {tensor: t1, option: {compressor: bf16, inter: allreduce}}\n"
                           "  - {tensor: t3, option: {compressor: bf16, inter: allreduce}}\n");
  JobUnits u = fuse_job(t, plans, on(1 << 20, 1 << 20));
  ASSERT_EQ(u.buckets.size(), 2u);
  EXPECT_EQ(u.buckets[0].members, (std::vector<uint32_t>{3, 1}));
  EXPECT_EQ(u.buckets[1].members, (std::vector<uint32_t>{2, 0}));
  EXPECT_EQ(u.plans[4].placement, Placement::kRing);
  EXPECT_EQ(u.plans[4].spec().name, "bf16");
  EXPECT_FALSE(u.plans[5].compressed_push());
}

TEST(FusionTest, LaterStrategyMustKeepABucketsPlanOrIsRefusedNamingIt) {
  auto t = tensors({256, 256, 256});
  JobUnits u = fuse_job(t, plan_job(t, ""), on(1 << 20, 1 << 20));
  ASSERT_EQ(u.buckets.size(), 1u);
  // All to fp16 together: fine, the bucket follows.
  auto all = unit_plans(u, plan_job(t, "version: 1\ndefault: {compressor: fp16, inter: "
                                       "alltoall_allgather}\n"));
  ASSERT_EQ(all.size(), 4u);
  EXPECT_EQ(all[3].spec().name, "fp16");
  // One member alone to fp16: refused, naming tensor and bucket.
  try {
    unit_plans(u, plan_job(t, "version: 1\nentries:\n  - {tensor: t1, option: {compressor: "
                              "fp16, inter: alltoall_allgather}}\n"));
    FAIL() << "not refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 't1' is fused into bucket 'fused[0]:t2..t0'"),
              std::string::npos)
        << e.what();
  }
  // A member moved to a compressor that cannot fuse: refused too.
  EXPECT_THROW(unit_plans(u, plan_job(t, "version: 1\ndefault: {compressor: topk, params: "
                                         "{ratio: '0.5'}, inter: alltoall_allgather}\n")),
               Error);
}

TEST(FusionTest, EqualShardsOverEveryServer) {
  // 30 small tensors and one large (78 % of the bytes, like digits'
  // fc2.weight); everything fuses within a 25 MiB cap.
  std::vector<uint64_t> counts(30, 1000);
  counts.push_back(106000);
  auto t = tensors(counts);
  auto plans = plan_job(t, "");
  JobUnits u = fuse_job(t, plans, on(1 << 20, 25 << 20));
  const uint64_t pb = 4 << 20;
  for (int ns : {1, 2, 3, 4}) {
    auto sv = servers(ns);
    std::vector<uint64_t> shards = shard_elements(u, sv.size(), pb);
    Assignment a = assign_partitions(u.tensors, u.plans, sv, pb, shards);
    std::map<NodeId, uint64_t> load;
    for (size_t b = 0; b < u.buckets.size(); ++b) {
      const auto unit = static_cast<uint32_t>(u.declared + b);
      uint64_t total = 0;
      std::map<NodeId, uint64_t> per;
      for (uint32_t i : a.by_tensor[unit]) {
        const Partition& p = a.partitions[i];
        EXPECT_EQ(p.offset, total);
        EXPECT_EQ(p.count % 16 == 0 || p.offset + p.count == u.tensors[unit].count, true);
        total += p.count;
        per[p.server] += p.count;
      }
      EXPECT_EQ(total, u.tensors[unit].count);
      // Every server holds at most its share, up to the rounding of each of
      // its (at most 4) shards to 16 elements.
      const uint64_t share = (u.tensors[unit].count + ns - 1) / ns;
      for (auto [s, n] : per) EXPECT_LE(n, share + 4 * 16) << ns << " servers, server " << s;
      if (u.tensors[unit].count >= static_cast<uint64_t>(16 * ns)) {
        EXPECT_EQ(per.size(), static_cast<size_t>(ns));
      }
    }
    // Deterministic: the same inputs give the same digest; another layout
    // (fusion off) gives another.
    EXPECT_EQ(a.digest, assign_partitions(u.tensors, u.plans, sv, pb, shards).digest);
    JobUnits off = fuse_job(t, plans, FusionConfig{});
    EXPECT_NE(a.digest, assign_partitions(off.tensors, off.plans, sv, pb).digest);
  }
  // Without fusion the large tensor lands whole on one server.
  JobUnits off = fuse_job(t, plans, FusionConfig{});
  Assignment a = assign_partitions(off.tensors, off.plans, servers(2), pb);
  EXPECT_EQ(a.by_tensor[30].size(), 1u);
}

TEST(FusionTest, ShardsRespectThePartitionSize) {
  // A 20 MiB bucket over 2 servers with 4 MiB partitions: at least 6
  // shards of <= 4 MiB; 4 per server to pipeline (8 of 2.5 MiB).
  auto t = tensors({2621440, 2621440});
  JobUnits u = fuse_job(t, plan_job(t, ""), on(40 << 20, 40 << 20));
  ASSERT_EQ(u.buckets.size(), 1u);
  const uint64_t per = shard_elements(u, 2, 2, 4 << 20);
  EXPECT_LE(per * 4, 4u << 20);
  EXPECT_EQ(per % 16, 0u);
  Assignment a = assign_partitions(u.tensors, u.plans, servers(2), 4 << 20,
                                   shard_elements(u, 2, 4 << 20));
  ASSERT_EQ(a.by_tensor[2].size(), 8u);
  std::map<NodeId, int> n;
  for (uint32_t i : a.by_tensor[2]) ++n[a.partitions[i].server];
  EXPECT_EQ(n[0], 4);
  EXPECT_EQ(n[1], 4);
  // A 1 MiB bucket over 4 servers: 4 shards of 64 KiB each per server; a
  // 256 KiB one: one 64 KiB shard per server.
  auto small = tensors({131072, 131072});
  JobUnits s = fuse_job(small, plan_job(small, ""), on(2 << 20, 2 << 20));
  EXPECT_EQ(shard_elements(s, 2, 4, 4 << 20), 16384u);
  auto tiny = tensors({32768, 32768});
  JobUnits ti = fuse_job(tiny, plan_job(tiny, ""), on(2 << 20, 2 << 20));
  EXPECT_EQ(shard_elements(ti, 2, 4, 4 << 20), 16384u);
}

TEST(FusionTest, ProtocolCarriesTheConfigAndRefusesNonsense) {
  proto::Admission adm;
  adm.name = "j";
  adm.nodes = {100};
  adm.fusion = on(4096, 8192);
  transport::Buffer e = proto::encode(adm);
  EXPECT_EQ(proto::decode_admission(e.view()).fusion, adm.fusion);
  adm.fusion = on(8192, 4096);  // first above cap
  transport::Buffer bad = proto::encode(adm);
  EXPECT_THROW(proto::decode_admission(bad.view()), Error);
}
