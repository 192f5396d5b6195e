#include "planner/strategy/auto_spec.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace bytecomp::strategy {
namespace {

TEST(AutoSpec, AStrategyFileIsNotAnAutoDocument) {
  EXPECT_FALSE(AutoSpec::parse_job_text("version: 1\ndefault: {compressor: none}\n", "s.yaml"));
  EXPECT_FALSE(AutoSpec::parse_job_text("not: [yaml", "s.yaml"));
}

TEST(AutoSpec, ReadsEveryKeyAndRoundTrips) {
  auto a = AutoSpec::parse_job_text(
      "version: 1\nmode: auto\ncompressors: [efsignsgd, \"topk:0.01\"]\nexclude: [\"conv1.*\"]\n"
      "min_compress_bytes: 64KiB\nwarmup_iterations: 7\nskip_iterations: 0\n"
      "plan_timeout_ms: 300\ncolocated_servers: false\n"
      "replan: {drift: 0.5, iterations: 2, min_interval: 9, max: 3, per: 400}\n"
      "guard: {min_bytes: 1MiB, names: [\"*.b\"], output_layer: false}\n"
      "loss_guard: {enabled: false, window: 7, tolerance: 0.5}\n",
      "job");
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->compressors, (std::vector<std::string>{"efsignsgd", "topk:0.01"}));
  EXPECT_EQ(a->exclude, std::vector<std::string>{"conv1.*"});
  EXPECT_EQ(a->min_compress_bytes, 65536u);
  EXPECT_EQ(a->warmup_iterations, 7u);
  EXPECT_EQ(a->skip_iterations, 0u);
  EXPECT_EQ(a->plan_timeout_ms, 300u);
  EXPECT_FALSE(a->colocated_servers);
  EXPECT_DOUBLE_EQ(a->replan_drift, 0.5);
  EXPECT_EQ(a->replan_iterations, 2u);
  EXPECT_EQ(a->replan_min_interval, 9u);
  EXPECT_EQ(a->replan_max, 3u);
  EXPECT_EQ(a->replan_per, 400u);
  EXPECT_EQ(a->guards.min_bytes, 1u << 20);
  EXPECT_EQ(a->guards.names, std::vector<std::string>{"*.b"});
  EXPECT_FALSE(a->guards.output_layer);
  EXPECT_FALSE(a->loss_guard);
  EXPECT_EQ(a->loss_window, 7u);
  EXPECT_DOUBLE_EQ(a->loss_tolerance, 0.5);
  auto b = AutoSpec::parse_job_text(a->to_yaml(), "again");
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(*a, *b);
  auto d = AutoSpec::parse_job_text("version: 1\nmode: auto\n", "defaults");
  ASSERT_TRUE(d.has_value());
  EXPECT_TRUE(d->compressors.empty());  // fp16 only
  EXPECT_EQ(*d, AutoSpec{});
}

TEST(AutoSpec, BadValuesNameTheKey) {
  auto msg = [](const std::string& text) {
    try {
      (void)AutoSpec::parse_job_text(text, "job.yaml");
    } catch (const config::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_NE(msg("version: 1\nmode: auto\ncompressors: [nosuch]\n").find("compressors"),
            std::string::npos);
  EXPECT_NE(msg("version: 1\nmode: auto\ncompressors: [nosuch]\n").find("nosuch"), std::string::npos);
  EXPECT_NE(msg("version: 1\nmode: auto\ncompressors: [\"topk:7\"]\n").find("topk:7"),
            std::string::npos);
  EXPECT_NE(msg("version: 1\nmode: planned\n").find("mode"), std::string::npos);
  EXPECT_NE(msg("version: 1\nmode: auto\nwarmup_iterations: 0\n").find("warmup_iterations"),
            std::string::npos);
  EXPECT_NE(msg("version: 1\nmode: auto\nreplan: {drift: 0.1, often: 3}\n").find("often"),
            std::string::npos);
  EXPECT_NE(msg("version: 1\nmode: auto\nbogus: 1\n").find("bogus"), std::string::npos);
  EXPECT_NE(msg("mode: auto\n").find("version"), std::string::npos);
  // The guards', the loss guard's and the re-plan bound's keys.
  const std::string where = msg("version: 1\nmode: auto\nguard: {min_bytes: -3}\n");
  EXPECT_NE(where.find("job.yaml"), std::string::npos) << where;
  EXPECT_NE(where.find("min_bytes"), std::string::npos) << where;
  EXPECT_NE(msg("version: 1\nmode: auto\nguard: {names: [\"\"]}\n").find("fnmatch globs"),
            std::string::npos);
  EXPECT_NE(msg("version: 1\nmode: auto\nguard: {output: true}\n").find("output"),
            std::string::npos);
  EXPECT_NE(msg("version: 1\nmode: auto\nguard: {output_layer: maybe}\n").find("output_layer"),
            std::string::npos);
  const std::string w = msg("version: 1\nmode: auto\nloss_guard: {window: 1}\n");
  EXPECT_NE(w.find("window"), std::string::npos) << w;
  EXPECT_NE(w.find("2"), std::string::npos) << w;  // the accepted range
  EXPECT_NE(msg("version: 1\nmode: auto\nloss_guard: {tolerance: -1}\n").find("tolerance"),
            std::string::npos);
  EXPECT_NE(msg("version: 1\nmode: auto\nreplan: {max: 0}\n").find("max"), std::string::npos);
  EXPECT_NE(msg("version: 1\nmode: auto\nreplan: {per: 0}\n").find("per"), std::string::npos);
}

TEST(AutoSpec, GuardsAreOnByDefault) {
  const AutoSpec d;
  EXPECT_EQ(d.guards.min_bytes, 256u << 10);
  EXPECT_TRUE(d.guards.output_layer);
  EXPECT_NE(std::find(d.guards.names.begin(), d.guards.names.end(), "*bias"), d.guards.names.end());
  EXPECT_TRUE(d.loss_guard);
  // Written off, they read back off.
  auto off = AutoSpec::parse_job_text(
      "version: 1\nmode: auto\nguard: {min_bytes: 0, names: [], output_layer: false}\n", "j");
  ASSERT_TRUE(off.has_value());
  EXPECT_EQ(off->guards, AccuracyGuards::off());
}

}  // namespace
}  // namespace bytecomp::strategy
