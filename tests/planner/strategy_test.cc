#include "planner/strategy/strategy.h"
#include "planner/strategy/auto_spec.h"
#include "planner/strategy/plan.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <set>

#include "common/config.h"

using bytecomp::config::ConfigError;
using namespace bytecomp::planner;

namespace {

const char* kSample = R"(version: 1
meta: {model: bert_base}
default:
  compressor: none
  scheme: hierarchical
  intra: reduce_broadcast
  inter: reduce_scatter_allgather
rules:
  - match: "*.bias"
    option: {compressor: none, inter: reduce_broadcast}
  - match: "*"
    min_bytes: 1MiB
    option:
      compressor: topk
      params: {ratio: 0.01}
      error_feedback: true
      comp_device: cpu
      decomp_device: cpu
      inter: alltoall_allgather
entries:
  - tensor: fc.weight
    option: {compressor: fp16, inter: allreduce}
)";

std::string error_of(const std::string& text) {
  try {
    Strategy::parse(text, "s.yaml");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Strategy, ParsesAndResolvesExactThenRuleThenDefault) {
  Strategy s = Strategy::parse(kSample, "s.yaml");
  EXPECT_EQ(s.meta.at("model"), "bert_base");
  EXPECT_EQ(s.resolve("fc.weight", 1 << 30).compressor, "fp16");
  EXPECT_EQ(s.resolve("fc.weight", 1 << 30).inter, Collective::kAllreduce);
  // Rule order: a big bias matches the first rule.
  EXPECT_EQ(s.resolve("layer.bias", 8 << 20).inter, Collective::kReduceBroadcast);
  const Option& big = s.resolve("layer.weight", 2 << 20);
  EXPECT_EQ(big.compressor, "topk");
  EXPECT_EQ(big.params.at("ratio"), "0.01");
  EXPECT_TRUE(big.error_feedback);
  EXPECT_EQ(runtime_inter_mode(big), "ps");
  // Below min_bytes: default.
  EXPECT_EQ(s.resolve("layer.weight", 1000).compressor, "none");
  EXPECT_EQ(runtime_inter_mode(s.resolve("layer.weight", 1000)), "ps");
}

TEST(Strategy, SaveLoadRoundTrips) {
  Strategy s = Strategy::parse(kSample, "s.yaml");
  Option o;
  o.compressor = "dgc";
  o.params = {{"ratio", "0.01"}, {"momentum", "0.9"}};
  o.error_feedback = true;
  o.comp_device = Device::kCuda;
  o.decomp_device = Device::kCpu;
  o.scheme = Scheme::kHierarchical;
  o.intra = Collective::kAlltoallAllgather;
  o.inter = Collective::kAllgather;
  o.compress_before = Stage::kIntra;
  o.decompress_after = Stage::kIntra;
  ASSERT_EQ(o.problem(), "");
  s.add_entry({"tricky \"name\": x", o});
  Option flat;
  flat.compressor = "efsignsgd";
  flat.scheme = Scheme::kFlat;
  flat.inter = Collective::kGatherBroadcast;
  s.add_entry({"flat.t", flat});
  const std::string path = std::filesystem::temp_directory_path() /
                           ("bc_strategy_" + std::to_string(getpid()) + ".yaml");
  s.save(path);
  Strategy back = Strategy::load_file(path);
  std::filesystem::remove(path);
  ASSERT_EQ(back.entries().size(), s.entries().size());
  for (size_t i = 0; i < s.entries().size(); ++i) {
    EXPECT_EQ(back.entries()[i].tensor, s.entries()[i].tensor);
    EXPECT_EQ(back.entries()[i].option, s.entries()[i].option) << back.entries()[i].option.describe();
  }
  ASSERT_EQ(back.rules().size(), 2u);
  EXPECT_EQ(back.rules()[1].min_bytes, 1u << 20);
  EXPECT_EQ(back.rules()[1].option, s.rules()[1].option);
  EXPECT_EQ(back.default_option(), s.default_option());
  EXPECT_EQ(back.meta, s.meta);
  EXPECT_EQ(back.to_yaml(), s.to_yaml());
}

TEST(Strategy, ErrorsAreLocatedAndNamed) {
  EXPECT_NE(error_of("version: 2\n").find("version"), std::string::npos);
  std::string e = error_of("version: 1\ndefault: {compressor: zip}\n");
  EXPECT_NE(e.find("s.yaml:2"), std::string::npos) << e;
  EXPECT_NE(e.find("default.compressor"), std::string::npos) << e;
  EXPECT_NE(e.find("randomk"), std::string::npos) << e;  // accepted values listed
  e = error_of("version: 1\ndefault: {compressor: none, inter: allgather}\n");
  EXPECT_NE(e.find("cannot carry uncompressed"), std::string::npos) << e;
  e = error_of("version: 1\ndefault: {compressor: topk, inter: allreduce}\n");
  EXPECT_NE(e.find("cannot carry data compressed by topk"), std::string::npos) << e;
  // randomk with a shared seed is additive: allreduce is fine.
  EXPECT_EQ(error_of("version: 1\ndefault: {compressor: randomk, inter: allreduce}\n"), "");
  e = error_of("version: 1\ndefault: {compressor: none, params: {ratio: 1}}\n");
  EXPECT_NE(e.find("takes no params"), std::string::npos) << e;
  e = error_of("version: 1\ndefault: {compressor: topk, params: {ratio: [1]}, inter: allgather}\n");
  EXPECT_NE(e.find("params.ratio"), std::string::npos) << e;
  e = error_of("version: 1\ndefault: {compressor: topk, inter: allgather, scheme: flat, "
               "compress_before: intra}\n");
  EXPECT_NE(e.find("flat scheme has one phase"), std::string::npos) << e;
  e = error_of("version: 1\ndefault: {compressor: none, intra: allreduce}\n");
  EXPECT_NE(e.find("indivisible"), std::string::npos) << e;
  e = error_of("version: 1\ndefault: {compressor: none, colour: red}\n");
  EXPECT_NE(e.find("unknown key 'default.colour'"), std::string::npos) << e;
  e = error_of("version: 1\nentries:\n  - {tensor: a, option: {compressor: none}}\n"
               "  - {tensor: a, option: {compressor: none}}\n");
  EXPECT_NE(e.find("two entries"), std::string::npos) << e;
  EXPECT_NE(e.find("s.yaml:4"), std::string::npos) << e;
  e = error_of("version: 1\nentries:\n  - {tensor: a}\n");
  EXPECT_NE(e.find("option"), std::string::npos) << e;
  e = error_of("version: 1\nrules:\n  - {match: x, min_bytes: 10, max_bytes: 5, option: {}}\n");
  EXPECT_NE(e.find("max_bytes is below"), std::string::npos) << e;
  e = error_of("version: 1\nrules:\n  - {match: x, min_bytes: lots, option: {}}\n");
  EXPECT_NE(e.find("rules[0].min_bytes"), std::string::npos) << e;
  e = error_of("version: 1\nentries: [\n");
  EXPECT_NE(e.find("s.yaml"), std::string::npos) << e;
  try {
    Strategy::load_file("/nonexistent/strategy.yaml");
    ADD_FAILURE();
  } catch (const ConfigError& err) {
    EXPECT_NE(std::string(err.what()).find("/nonexistent/strategy.yaml"), std::string::npos);
  }
}

TEST(Strategy, CheckNamesUnknownTensors) {
  Strategy s = Strategy::parse(kSample, "s.yaml");
  EXPECT_NO_THROW(s.check({{"fc.weight", 400}, {"other", 4}}));
  try {
    s.check({{"other", 4}});
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'fc.weight'"), std::string::npos) << e.what();
  }
}

TEST(Strategy, CpuRuntimeRefusesWhatItCannotRun) {
  Strategy s = Strategy::parse(kSample, "s.yaml");
  EXPECT_NO_THROW(s.check_cpu_runtime({{"fc.weight", 400}, {"a.bias", 4}, {"w", 4 << 20}}));
  Option gpu;
  gpu.compressor = "randomk";
  gpu.comp_device = Device::kCuda;  // the client compresses (GPU placement)
  gpu.inter = Collective::kAllgather;
  s.add_entry({"g", gpu});
  EXPECT_NO_THROW(s.check_cpu_runtime({{"fc.weight", 400}, {"g", 4}}));
  gpu.decomp_device = Device::kCuda;  // nobody decodes on the GPU yet
  s.add_entry({"g", gpu});
  try {
    s.check_cpu_runtime({{"fc.weight", 400}, {"g", 4}});
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'g'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("GPU decompression"), std::string::npos) << e.what();
  }
  Option o;
  o.compressor = "onebit";
  o.inter = Collective::kGatherBroadcast;
  EXPECT_EQ(runtime_inter_mode(o), "ps_single");
  o.inter = Collective::kAllgather;
  EXPECT_EQ(runtime_inter_mode(o), "allgather");
  o.scheme = Scheme::kFlat;
  EXPECT_EQ(runtime_inter_mode(o), "");
  EXPECT_NE(cpu_runtime_unsupported(o).find("hierarchical"), std::string::npos);
}

TEST(Strategy, GlobRules) {
  Rule r;
  r.match = "bert.*.bias";
  r.min_bytes = 8;
  r.max_bytes = 16;
  EXPECT_TRUE(r.matches("bert.layer.0.bias", 8));
  EXPECT_FALSE(r.matches("bert.layer.0.bias", 17));
  EXPECT_FALSE(r.matches("bert.layer.0.weight", 8));
  EXPECT_FALSE(r.matches("gpt.bias", 8));
}

TEST(Strategy, CpuShareRoundTripsValidatesAndTheCpuRuntimeSplitsCompressionOnly) {
  // An older file (no cpu_share) reads as no split; a split is written and
  // read back exactly.
  Strategy s = Strategy::parse(kSample, "s.yaml");
  EXPECT_EQ(s.resolve("fc.weight", 400).cpu_share, 0.0);
  EXPECT_EQ(s.to_yaml().find("cpu_share"), std::string::npos);
  Option split;
  split.compressor = "dgc";
  split.params = {{"ratio", "0.01"}};
  split.error_feedback = true;
  split.comp_device = split.decomp_device = Device::kCuda;
  split.intra = Collective::kReduceScatterAllgather;
  split.inter = Collective::kAlltoallAllgather;
  split.cpu_share = 0.234375;
  ASSERT_EQ(split.problem(), "");
  s.add_entry({"fc.weight", split});
  const Strategy back = Strategy::parse(s.to_yaml(), "back.yaml");
  EXPECT_EQ(back.resolve("fc.weight", 400), split);
  EXPECT_NE(split.describe().find("cpu_share=0.234375"), std::string::npos) << split.describe();

  // Bad values name the key and the reason.
  const std::string base =
      "version: 1\ndefault: {compressor: dgc, params: {ratio: 0.01}, comp_device: gpu, "
      "decomp_device: gpu, inter: allgather, cpu_share: ";
  EXPECT_EQ(error_of(base + "0.5}\n"), "");
  EXPECT_NE(error_of(base + "1}\n").find("cpu_share must be at least 0 and below 1"),
            std::string::npos);
  EXPECT_NE(error_of(base + "-0.1}\n").find("cpu_share"), std::string::npos);
  EXPECT_NE(error_of(base + "half}\n").find("cpu_share"), std::string::npos);
  EXPECT_NE(error_of("version: 1\ndefault: {compressor: none, cpu_share: 0.5}\n")
                .find("compressor 'none' has none"),
            std::string::npos);
  EXPECT_NE(error_of("version: 1\ndefault: {compressor: dgc, comp_device: cpu, "
                     "decomp_device: cpu, inter: allgather, cpu_share: 0.5}\n")
                .find("needs comp_device or decomp_device 'gpu'"),
            std::string::npos);

  // The CPU runtime (the daemon's check) executes a split of compression
  // (comp_device gpu: the client's GPU and the daemon's pool, docs/gpu.md
  // §4); it refuses one of decompression, and a CPU-only share, by reason.
  Option cpu_split = split;
  cpu_split.intra = Collective::kReduceBroadcast;
  s.add_entry({"fc.weight", cpu_split});
  try {
    s.check_cpu_runtime({{"fc.weight", 400}});
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'fc.weight'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("decomp_device must be 'cpu'"), std::string::npos)
        << e.what();
  }
  cpu_split.decomp_device = Device::kCpu;
  EXPECT_EQ(cpu_runtime_unsupported(cpu_split), "");
  s.add_entry({"fc.weight", cpu_split});
  EXPECT_NO_THROW(s.check_cpu_runtime({{"fc.weight", 400}}));
  Option decomp_split = cpu_split;
  decomp_split.comp_device = Device::kCpu;
  decomp_split.decomp_device = Device::kCuda;
  EXPECT_NE(cpu_runtime_unsupported(decomp_split).find("splits compression only"),
            std::string::npos)
      << cpu_runtime_unsupported(decomp_split);
}

TEST(Strategy, PiecesRoundTripValidateAndTheCpuRuntimeAcceptsThem) {
  // An older file (no pieces) reads as one piece and is written as before.
  Strategy s = Strategy::parse(kSample, "s.yaml");
  EXPECT_EQ(s.resolve("fc.weight", 400).pieces, 1);
  EXPECT_EQ(s.to_yaml().find("pieces"), std::string::npos);
  Option piped;
  piped.compressor = "dgc";
  piped.params = {{"ratio", "0.01"}};
  piped.error_feedback = true;
  piped.comp_device = piped.decomp_device = Device::kCuda;
  piped.intra = Collective::kReduceScatterAllgather;
  piped.inter = Collective::kAlltoallAllgather;
  piped.pieces = 4;
  piped.cpu_share = 0.25;  // both: the CPU part and the rest each in 4 slices
  ASSERT_EQ(piped.problem(), "");
  s.add_entry({"fc.weight", piped});
  const std::string yaml = s.to_yaml();
  EXPECT_NE(yaml.find("pieces: 4"), std::string::npos) << yaml;
  const Strategy back = Strategy::parse(yaml, "back.yaml");
  EXPECT_EQ(back.resolve("fc.weight", 400), piped);
  EXPECT_NE(piped.describe().find("pieces=4"), std::string::npos) << piped.describe();

  // Bad values name the key and what is accepted.
  const std::string base = "version: 1\ndefault: {compressor: none, pieces: ";
  EXPECT_EQ(error_of(base + "8}\n"), "");
  EXPECT_EQ(error_of(base + "1}\n"), "");
  for (const char* bad : {"3", "0", "16", "-2"})
    EXPECT_NE(error_of(base + bad + "}\n").find("pieces must be 1, 2, 4 or 8"), std::string::npos)
        << bad << ": " << error_of(base + bad + "}\n");
  EXPECT_NE(error_of(base + "two}\n").find("pieces"), std::string::npos);
  EXPECT_NE(error_of(base + "2.5}\n").find("pieces"), std::string::npos);

  // The CPU runtime executes pieces (each tensor's partitions cut by it,
  // strategy::tensor_partition_bytes) on every option it executes, and
  // refuses an option it cannot execute for that option's reason.
  Option cpu;
  cpu.compressor = "topk";
  cpu.params = {{"ratio", "0.01"}};
  cpu.inter = Collective::kAlltoallAllgather;
  cpu.pieces = 8;
  EXPECT_EQ(cpu_runtime_unsupported(cpu), "");
  EXPECT_EQ(runtime_inter_mode(cpu), "ps");
  Strategy c = Strategy::parse(kSample, "c.yaml");
  c.add_entry({"fc.weight", cpu});
  EXPECT_NO_THROW(c.check_cpu_runtime({{"fc.weight", 400}}));
  piped.cpu_share = 0.0;
  piped.intra = Collective::kReduceBroadcast;
  c.add_entry({"fc.weight", piped});
  try {
    c.check_cpu_runtime({{"fc.weight", 400}});
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("GPU decompression"), std::string::npos) << e.what();
  }
}

// An auto job's start placement (strategy::start_strategy_yaml): the
// tensors auto can never compress beyond fp16 go on the ring where the
// model has it no slower whatever the link.
TEST(StartPlacement, NeverCompressedTensorsGoOnTheRingWhereItIsNeverSlower) {
  using bytecomp::strategy::AutoSpec;
  const std::vector<std::string> names{"conv.weight", "conv.bias", "big.weight", "fc.weight",
                                       "fc.bias"};
  const std::vector<uint64_t> elements{1 << 20, 64, 3 << 20, 1 << 18, 10};
  auto ring_set = [&](const std::string& yaml) {
    std::set<std::string> on;
    if (yaml.empty()) return on;
    const Strategy s = Strategy::parse(yaml, "start");
    for (size_t t = 0; t < names.size(); ++t) {
      const Option& o = s.resolve(names[t], 4 * elements[t]);
      EXPECT_FALSE(o.compressed()) << names[t];
      if (bytecomp::strategy::plan_for_option(o, names[t]).placement == bytecomp::strategy::Placement::kRing)
        on.insert(names[t]);
    }
    return on;
  };
  AutoSpec fp16_only;  // no compressors: fp16 is all auto may do, and the ring carries it
  EXPECT_EQ(ring_set(bytecomp::strategy::start_strategy_yaml(fp16_only, names, elements, 2, 4 << 20)),
            (std::set<std::string>{names.begin(), names.end()}));
  // More nodes: the ring's 2(N-1) hops make small partitions slower there.
  EXPECT_EQ(ring_set(bytecomp::strategy::start_strategy_yaml(fp16_only, names, elements, 4, 4 << 20)),
            (std::set<std::string>{"conv.weight", "big.weight", "fc.weight"}));
  // 12 MiB in 4 MiB partitions: each >= 1 MiB; 4 MiB in 3 MiB partitions
  // leaves a 1 MiB last one, 4 MiB in 3.5 MiB partitions a 0.5 MiB one.
  EXPECT_NE(bytecomp::strategy::start_strategy_yaml(fp16_only, {"w"}, {1 << 20}, 4, 3 << 20), "");
  EXPECT_EQ(bytecomp::strategy::start_strategy_yaml(fp16_only, {"w"}, {1 << 20}, 4, 7 << 19), "");
  // With a compressor accepted, only what the guards or exclude keep
  // uncompressed: biases (name), the output layer fc.*, small tensors.
  AutoSpec ef;
  ef.compressors = {"efsignsgd"};
  EXPECT_EQ(ring_set(bytecomp::strategy::start_strategy_yaml(ef, names, elements, 2, 4 << 20)),
            (std::set<std::string>{"conv.bias", "fc.weight", "fc.bias"}));
  ef.exclude = {"big.*"};
  EXPECT_EQ(ring_set(bytecomp::strategy::start_strategy_yaml(ef, names, elements, 2, 4 << 20)),
            (std::set<std::string>{"conv.bias", "big.weight", "fc.weight", "fc.bias"}));
  ef.guards = bytecomp::strategy::AccuracyGuards::off();
  ef.exclude.clear();
  EXPECT_EQ(bytecomp::strategy::start_strategy_yaml(ef, names, elements, 2, 4 << 20), "");
  EXPECT_EQ(bytecomp::strategy::start_strategy_yaml(fp16_only, names, elements, 1, 4 << 20), "");
}
