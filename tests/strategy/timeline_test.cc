// The job's strategy over time: the one type every holder reads.
#include "planner/strategy/timeline.h"

#include <gtest/gtest.h>

#include <thread>

namespace st = bytecomp::strategy;
using bytecomp::ErrorCode;
using bytecomp::Status;

namespace {

const std::string kFp16 =
    "version: 1\nentries:\n"
    "  - {tensor: g, option: {compressor: fp16, inter: reduce_scatter_allgather}}\n";

std::vector<st::PlanTensor> job() { return {{"g", 1000, bytecomp::DType::kFloat32}, {"h", 100, bytecomp::DType::kFloat32}}; }

std::vector<st::TensorPlan> cluster(const std::string& yaml) {
  auto t = job();
  return st::plans_for(st::Scope::kCluster, t, yaml, "test");
}

}  // namespace

TEST(Timeline, EachIterationReadsTheLastEntryAtOrBeforeIt) {
  st::Timeline tl(5, cluster(""));
  ASSERT_TRUE(tl.add(8, cluster(kFp16), kFp16).ok());
  EXPECT_EQ(tl.tensors(), 2u);
  // Before the start (never asked by a round) and up to 7: the start plans.
  for (uint64_t it : {0u, 5u, 7u}) {
    EXPECT_EQ(tl.at(it).first, 5u) << it;
    EXPECT_FALSE(tl.plan(0, it).compressed_push()) << it;
  }
  for (uint64_t it : {8u, 9u, 1000u}) {
    EXPECT_EQ(tl.at(it).first, 8u) << it;
    EXPECT_EQ(tl.plan(0, it).spec().name, "fp16") << it;
    EXPECT_FALSE(tl.plan(1, it).compressed_push()) << it;
    EXPECT_EQ(*tl.at(it).yaml, kFp16);
  }
  EXPECT_EQ(tl.latest().first, 8u);
  EXPECT_THROW(tl.plan(2, 8), bytecomp::Error);
}

TEST(Timeline, ReadersShareOneParsedPlanVector) {
  st::Timeline tl(0, cluster(""));
  ASSERT_TRUE(tl.add(3, cluster(kFp16), kFp16).ok());
  // Every reader of an entry gets the same vector: nothing is re-made per read.
  EXPECT_EQ(tl.at(3).plans.get(), tl.at(10).plans.get());
  EXPECT_NE(tl.at(2).plans.get(), tl.at(3).plans.get());
}

TEST(Timeline, DuplicateChangesAreKeptOnceAndCancelDropsOnlyChanges) {
  st::Timeline tl(0, cluster(""));
  bool added = false;
  ASSERT_TRUE(tl.add(4, cluster(kFp16), kFp16, {}, &added).ok());
  EXPECT_TRUE(added);
  // The same change announced again (the requester hears it twice).
  ASSERT_TRUE(tl.add(4, cluster(""), "", {}, &added).ok());
  EXPECT_FALSE(added);
  EXPECT_EQ(tl.plan(0, 4).spec().name, "fp16");
  tl.cancel(4);
  EXPECT_FALSE(tl.plan(0, 4).compressed_push());
  tl.cancel(0);  // the start entry stays
  EXPECT_EQ(tl.at(9).first, 0u);
}

TEST(Timeline, AFrozenReaderRefusesALateChangeAtomically) {
  st::Timeline tl(0, cluster(""));
  std::atomic<int64_t> frozen{-1};
  // A round fixes its plan for iteration 6: a change at 6 is late, at 7 not.
  (void)tl.plan(0, 6, &frozen);
  EXPECT_EQ(frozen.load(), 6);
  auto admit = [&](uint64_t it) {
    return [&frozen, it] {
      return frozen.load() >= static_cast<int64_t>(it)
                 ? Status(ErrorCode::kInvalidArgument, "late")
                 : Status::Ok();
    };
  };
  Status late = tl.add(6, cluster(kFp16), kFp16, admit(6));
  EXPECT_EQ(late.code(), ErrorCode::kInvalidArgument);
  EXPECT_FALSE(tl.plan(0, 6).compressed_push());
  EXPECT_TRUE(tl.add(7, cluster(kFp16), kFp16, admit(7)).ok());
  EXPECT_EQ(tl.plan(0, 7).spec().name, "fp16");
}

// A server's round may skip the iterations its tensor spent on the
// daemons' ring: off_servers says which spans those are.
TEST(Timeline, OffServersIsTrueOnlyForSpansWhollyOnTheRing) {
  const std::string ring =
      "version: 1\nentries:\n  - {tensor: g, option: {compressor: none, inter: allreduce}}\n";
  st::Timeline tl(2, cluster(ring));  // g ring from 2 (and before), h ps
  ASSERT_TRUE(tl.add(6, cluster(""), "").ok());  // g ps from 6
  ASSERT_TRUE(tl.add(9, cluster(ring), ring).ok());  // g ring again from 9
  EXPECT_TRUE(tl.off_servers(0, 0, 6));
  EXPECT_TRUE(tl.off_servers(0, 3, 5));
  EXPECT_TRUE(tl.off_servers(0, 4, 4));  // empty span
  EXPECT_FALSE(tl.off_servers(0, 0, 7));
  EXPECT_FALSE(tl.off_servers(0, 5, 7));
  EXPECT_FALSE(tl.off_servers(0, 6, 9));
  EXPECT_FALSE(tl.off_servers(0, 8, 10));
  EXPECT_TRUE(tl.off_servers(0, 9, 100));
  EXPECT_FALSE(tl.off_servers(1, 0, 1));  // h always on the servers
  EXPECT_TRUE(tl.off_servers(1, 3, 3));
  EXPECT_FALSE(tl.off_servers(2, 0, 1));  // no such tensor
}

TEST(Timeline, AChangeWithTheWrongTensorCountIsRefused) {
  st::Timeline tl(0, cluster(""));
  std::vector<st::TensorPlan> one(1);
  EXPECT_EQ(tl.add(3, one, "").code(), ErrorCode::kInternal);
  EXPECT_EQ(tl.latest().first, 0u);
}

TEST(Timeline, ConcurrentReadersAndOneWriterSeeWholeEntries) {
  st::Timeline tl(0, cluster(""));
  std::atomic<bool> stop{false};
  std::thread reader([&] {
    while (!stop.load()) {
      const st::Timeline::Entry e = tl.at(1000);
      ASSERT_EQ(e.plans->size(), 2u);
      ASSERT_EQ((*e.plans)[0].compressed_push(), e.first > 0);
    }
  });
  for (uint64_t it = 1; it <= 200; ++it) ASSERT_TRUE(tl.add(it, cluster(kFp16), kFp16).ok());
  stop.store(true);
  reader.join();
}

TEST(PlansFor, ClusterScopeRefusesNonFloatTensorsAndNamesTheTensor) {
  std::vector<st::PlanTensor> t{{"ids", 100, bytecomp::DType::kInt64}};
  try {
    (void)st::plans_for(st::Scope::kCluster, t, "", "test");
    FAIL() << "expected a refusal";
  } catch (const bytecomp::Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("tensor 'ids': dtype int64"), std::string::npos)
        << e.what();
  }
  // A node's own job may carry it uncompressed.
  EXPECT_EQ(st::plans_for(st::Scope::kNode, t, "", "test").size(), 1u);
}
