// The span histograms of PhaseLog (daemon/engine_phases.h) and what the
// control plane renders from the records (daemon/ctl.h): bucket placement,
// skipped and out-of-order stamps, the latest whole iteration's time, the
// trace answer and the Prometheus histogram. The real jobs' side is in
// tests/ops/test_ctl.py.
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <string>
#include <vector>

#include "daemon/ctl.h"
#include "daemon/engine_phases.h"

using namespace bytecomp::daemon;

namespace {

constexpr uint64_t kMs = 1'000'000;

// One round of (tensor, partition, iteration) with phase i stamped at
// base + steps[0] + ... + steps[i-1] (steps: kSpanCount durations).
void round(PhaseLog& log, uint32_t t, uint32_t p, uint64_t it, uint64_t base,
           const std::array<uint64_t, kSpanCount>& steps) {
  uint64_t at = base;
  log.begin(t, p, it, at, at + steps[0]);
  at += steps[0];
  for (size_t i = 1; i < kSpanCount; ++i) {
    at += steps[i];
    log.stamp(t, p, it, static_cast<Phase>(i + 1), at);
  }
  log.end(t, p, it);
}

size_t bucket_of(uint64_t ns) {
  size_t b = 0;
  while (b < kBucketBoundsNs.size() && ns > kBucketBoundsNs[b]) ++b;
  return b;
}

}  // namespace

TEST(PhaseStats, EveryPublishedRoundLandsInItsBuckets) {
  PhaseLog log;
  log.setup({2, 1}, true);
  const std::array<uint64_t, kSpanCount> steps{1 * kMs, 2 * kMs, 3 * kMs, 30 * kMs,
                                               0,       7 * kMs, 200 * kMs, 20'000 * kMs};
  // More iterations than the records keep: the histograms count them all.
  const uint64_t iterations = 3 * PhaseLog::kIterations;
  for (uint64_t it = 0; it < iterations; ++it) {
    for (uint32_t p = 0; p < 2; ++p) round(log, 0, p, it, 1000 * kMs * (it + 1), steps);
    round(log, 1, 0, it, 1000 * kMs * (it + 1), steps);
  }
  const PhaseStats s = log.stats();
  EXPECT_EQ(s.records, 3 * iterations);
  for (size_t i = 0; i < kSpanCount; ++i) {
    EXPECT_EQ(s.count[i], 3 * iterations) << span_name(i);
    EXPECT_EQ(s.sum_ns[i], 3 * iterations * steps[i]) << span_name(i);
    for (size_t b = 0; b < kBuckets; ++b) {
      EXPECT_EQ(s.buckets[i][b], b == bucket_of(steps[i]) ? 3 * iterations : 0)
          << span_name(i) << " bucket " << b;
    }
  }
  // 20 s is above every bound: the +Inf bucket.
  EXPECT_EQ(bucket_of(steps[7]), kBuckets - 1);
  // The records hold the last kIterations only.
  EXPECT_EQ(log.snapshot().size(), 3 * PhaseLog::kIterations);
}

TEST(PhaseStats, UnstampedPhasesAreSkippedAndReorderedOnesCountZero) {
  PhaseLog log;
  log.setup({1}, true);
  log.begin(0, 0, 0, 10 * kMs, 11 * kMs);
  log.stamp(0, 0, 0, Phase::kStart, 12 * kMs);
  log.stamp(0, 0, 0, Phase::kReduced, 13 * kMs);
  // kCompressed never stamped: compress and send have no duration.
  log.stamp(0, 0, 0, Phase::kSent, 14 * kMs);
  log.stamp(0, 0, 0, Phase::kArrived, 13 * kMs + kMs / 2);  // before kSent
  log.stamp(0, 0, 0, Phase::kDecompressed, 16 * kMs);
  log.stamp(0, 0, 0, Phase::kCopiedOut, 17 * kMs);
  log.end(0, 0, 0);
  const PhaseStats s = log.stats();
  const std::array<uint64_t, kSpanCount> want_count{1, 1, 1, 0, 0, 1, 1, 1};
  const std::array<uint64_t, kSpanCount> want_sum{kMs, kMs, kMs, 0, 0, 0, 2 * kMs + kMs / 2, kMs};
  for (size_t i = 0; i < kSpanCount; ++i) {
    EXPECT_EQ(s.count[i], want_count[i]) << span_name(i);
    EXPECT_EQ(s.sum_ns[i], want_sum[i]) << span_name(i);
  }
}

TEST(PhaseStats, DisabledOrNotSetUpIsEmpty) {
  PhaseLog before;
  EXPECT_EQ(before.stats().records, 0u);
  EXPECT_TRUE(before.partitions().empty());
  PhaseLog off;
  off.setup({4}, false);
  off.begin(0, 0, 0, 1, 2);
  off.end(0, 0, 0);
  EXPECT_EQ(off.stats().records, 0u);
  EXPECT_TRUE(off.partitions().empty());
}

TEST(LastIterationSeconds, TheLatestWholeIterationFromFirstSubmissionToLastCopyOut) {
  PhaseLog log;
  log.setup({2, 1}, true);
  const std::array<uint64_t, kSpanCount> steps{kMs, kMs, kMs, kMs, kMs, kMs, kMs, kMs};
  for (uint64_t it = 0; it < 3; ++it) {
    round(log, 0, 0, it, 100 * kMs * it, steps);
    round(log, 0, 1, it, 100 * kMs * it + 5 * kMs, steps);  // ends last: +5 ms
    round(log, 1, 0, it, 100 * kMs * it + kMs, steps);
  }
  // Iteration 3 is partly there: the latest whole one is 2.
  round(log, 0, 0, 3, 300 * kMs, steps);
  const auto s = last_iteration_seconds(log.snapshot());
  ASSERT_TRUE(s.has_value());
  EXPECT_DOUBLE_EQ(*s, (5.0 + 8.0) / 1000.0);
  EXPECT_FALSE(last_iteration_seconds({}).has_value());
}

TEST(TraceJson, ParsesAndNamesTensorsPartitionsAndPhases) {
  PhaseLog log;
  log.setup({2}, true);
  const std::array<uint64_t, kSpanCount> steps{1, 2, 3, 4, 5, 6, 7, 8};
  round(log, 0, 1, 4, 1000, steps);
  const std::string text = trace_json("job \"q\"", {"layer.0/w"}, log.partitions(),
                                      log.snapshot(), 5000);
  const YAML::Node j = YAML::Load(text);
  EXPECT_EQ(j["job"].as<std::string>(), "job \"q\"");
  EXPECT_EQ(j["now_ns"].as<uint64_t>(), 5000u);
  ASSERT_EQ(j["phases"].size(), kPhaseCount);
  EXPECT_EQ(j["phases"][8].as<std::string>(), "copied_out");
  ASSERT_EQ(j["spans"].size(), kSpanCount);
  EXPECT_EQ(j["spans"][5].as<std::string>(), "wire");
  EXPECT_EQ(j["tensors"][0]["name"].as<std::string>(), "layer.0/w");
  EXPECT_EQ(j["tensors"][0]["partitions"].as<uint32_t>(), 2u);
  ASSERT_EQ(j["records"].size(), 1u);
  const YAML::Node r = j["records"][0];
  EXPECT_EQ(r[0].as<uint32_t>(), 0u);
  EXPECT_EQ(r[1].as<uint32_t>(), 1u);
  EXPECT_EQ(r[2].as<uint64_t>(), 4u);
  EXPECT_EQ(r[3][0].as<uint64_t>(), 1000u);
  EXPECT_EQ(r[3][8].as<uint64_t>(), 1000u + 36u);
}

TEST(MetricsText, PhaseHistogramIsCumulativeWithInfEqualToCount) {
  DaemonView v;
  JobView j;
  j.id = "h";
  j.state = "running";
  PhaseStats st;
  st.buckets[2][0] = 3;   // reduce: 3 at or below 10 us
  st.buckets[2][6] = 2;   //         2 in (500 us, 1 ms]
  st.buckets[2][kBuckets - 1] = 1;  // 1 above 10 s
  st.count[2] = 6;
  st.sum_ns[2] = 12'000'000'000ull;
  st.records = 6;
  j.phase_stats = st;
  v.jobs.push_back(j);
  const std::string t = metrics_text(v);
  auto has = [&](const std::string& line) {
    EXPECT_NE(t.find(line + "\n"), std::string::npos) << line << "\n" << t;
  };
  has("# TYPE bytecomp_job_phase_seconds histogram");
  const std::string l = "bytecomp_job=\"h\",uid=\"0\",phase=\"reduce\"";
  has("bytecomp_job_phase_seconds_bucket{" + l + ",le=\"1e-05\"} 3");
  has("bytecomp_job_phase_seconds_bucket{" + l + ",le=\"0.0005\"} 3");
  has("bytecomp_job_phase_seconds_bucket{" + l + ",le=\"0.001\"} 5");
  has("bytecomp_job_phase_seconds_bucket{" + l + ",le=\"10\"} 5");
  has("bytecomp_job_phase_seconds_bucket{" + l + ",le=\"+Inf\"} 6");
  has("bytecomp_job_phase_seconds_sum{" + l + "} 12");
  has("bytecomp_job_phase_seconds_count{" + l + "} 6");
  has("bytecomp_job_rounds_total{bytecomp_job=\"h\",uid=\"0\"} 6");
  // Without engine gauges (a forming job) there is no gauge sample.
  EXPECT_EQ(t.find("bytecomp_job_queued_partitions{"), std::string::npos);
}
