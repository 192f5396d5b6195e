// The online planner library (planner/online.h) and `bytecomp-plan explain`.
#include "planner/online.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "common/config.h"
#include "common/error.h"
#include "planner/cli/cli.h"
#include "planner/chains.h"
#include "planner/model.h"
#include "planner/strategy/plan.h"

namespace bytecomp::planner::online {
namespace {

constexpr double kMelem = 1048576.0;

NodeProfile resnet18() {
  const std::string path = planner_data_dir() + "/profiles/online/resnet18.yaml";
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  std::stringstream ss;
  ss << in.rdbuf();
  return NodeProfile::parse(ss.str(), path);
}

AutoConfig two_nodes(std::vector<std::string> compressors) {
  AutoConfig c;
  c.compressors = std::move(compressors);
  c.nodes = 2;
  c.servers = 2;
  return c;
}

const TensorChoice& choice(const Decision& d, const std::string& name) {
  for (const TensorChoice& t : d.tensors)
    if (t.name == name) return t;
  ADD_FAILURE() << "no tensor " << name;
  return d.tensors.front();
}

bool compressed(const Decision& d, const std::string& name) {
  return d.strategy.resolve(name, choice(d, name).bytes).compressed();
}

const Alternative& alternative(const Decision& d, const std::string& name) {
  for (const Alternative& a : d.alternatives)
    if (a.name == name) return a;
  ADD_FAILURE() << "no alternative " << name;
  return d.alternatives.front();
}

// ---------------------------------------------------------------- fits

TEST(OnlineFit, LeastSquaresByHand) {
  // (1, 2), (2, 3), (4, 7): mean x 7/3, mean y 4; Sxx = 42/9, Sxy = 8, so
  // b = 12/7 us per element and a = 4 - 12/7 * 7/3 = 0.
  const LinearFit f = fit_linear({{1, 2}, {2, 3}, {4, 7}});
  EXPECT_EQ(f.samples, 3u);
  EXPECT_NEAR(f.a_us, 0.0, 1e-9);
  EXPECT_NEAR(f.b_us_per_melem, 12.0 / 7.0 * kMelem, 1e-6);
  // Exact line: 10 us + 20 us per Melem.
  const LinearFit g = fit_linear({{0, 10}, {kMelem, 30}, {2 * kMelem, 50}});
  EXPECT_NEAR(g.a_us, 10, 1e-9);
  EXPECT_NEAR(g.b_us_per_melem, 20, 1e-9);
  EXPECT_NEAR(g.at(kMelem / 2), 20, 1e-9);
}

TEST(OnlineFit, OneDistinctSizeGivesTheMean) {
  const LinearFit f = fit_linear({{5, 1}, {5, 3}, {5, 8}});
  EXPECT_DOUBLE_EQ(f.a_us, 4);
  EXPECT_DOUBLE_EQ(f.b_us_per_melem, 0);
  const LinearFit e = fit_linear({});
  EXPECT_EQ(e.samples, 0u);
  EXPECT_EQ(e.at(1000), 0);
  // A negative intercept never makes a negative cost.
  const LinearFit n{-50, 1, 2};
  EXPECT_EQ(n.at(10), 0);
}

// ---------------------------------------------------------------- merge

TEST(OnlineMerge, SlowestNodeWins) {
  NodeProfile a = resnet18(), b = resnet18();
  b.node_rank = 1;
  b.tensors[3].ready_us += 5000;
  a.tensors[7].ready_us += 7000;
  b.iteration_us = a.iteration_us + 100;
  a.link_gbps = 0.1;
  b.link_gbps = 0.05;
  b.link_latency_us = 900;
  b.reduce.b_us_per_melem = 999;
  a.reduce.a_us = 77;
  b.compressors[1].compress.a_us = 123;
  b.pool_threads = 1;
  const NodeProfile m = merge({a, b});
  EXPECT_EQ(m.tensors[3].ready_us, b.tensors[3].ready_us);
  EXPECT_EQ(m.tensors[7].ready_us, a.tensors[7].ready_us);
  EXPECT_EQ(m.iteration_us, b.iteration_us);
  EXPECT_EQ(m.link_gbps, 0.05);
  EXPECT_EQ(m.link_latency_us, 900);
  EXPECT_EQ(m.reduce.a_us, 77);
  EXPECT_EQ(m.reduce.b_us_per_melem, 999);
  EXPECT_EQ(m.compressors[1].compress.a_us, 123);
  EXPECT_EQ(m.pool_threads, 1u);
  // An unknown link (0) does not count as the narrowest.
  NodeProfile c = b;
  c.link_gbps = 0;
  EXPECT_EQ(merge({a, c}).link_gbps, 0.1);
}

TEST(OnlineMerge, MismatchesAreRefused) {
  const NodeProfile a = resnet18();
  auto refused = [&](NodeProfile b, const std::string& what) {
    b.node_rank = 3;
    try {
      merge({a, b});
      ADD_FAILURE() << "merged despite: " << what;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("node 3"), std::string::npos) << e.what();
    }
  };
  NodeProfile b = a;
  b.tensors[5].name = "other";
  refused(b, "'other'");
  b = a;
  b.tensors[5].elements += 1;
  refused(b, "tensor 5");
  b = a;
  b.tensors.pop_back();
  refused(b, "61 tensors");
  b = a;
  b.compressors[2].spec = "topk:0.05";
  refused(b, "topk:0.05");
  b = a;
  b.compressors.pop_back();
  refused(b, "measured compressors");
  b = a;
  b.current_strategy_yaml = "version: 1\n";
  refused(b, "different strategy");
  EXPECT_THROW(merge({}), Error);
}

// ---------------------------------------------------------------- YAML

TEST(OnlineMerge, NodesOnOneHostAreCounted) {
  NodeProfile a = resnet18(), b = resnet18(), c = resnet18();
  b.node_rank = 1;
  c.node_rank = 2;
  a.host = b.host = "boot-1";
  c.host = "boot-2";
  a.train_cpu_us = 300e3;
  b.train_cpu_us = 350e3;
  a.host_cpu_us = 2.1e6;
  b.host_cpu_us = 1.9e6;
  const NodeProfile m = merge({a, b, c});
  EXPECT_EQ(m.nodes_on_host, 2u);
  EXPECT_EQ(m.train_cpu_us, 350e3);
  EXPECT_EQ(m.host_cpu_us, 2.1e6);  // the busiest host
  // Unknown hosts are hosts of their own.
  a.host = b.host = c.host = "";
  EXPECT_EQ(merge({a, b, c}).nodes_on_host, 1u);
}

TEST(OnlineHostShare, ComputeIsStretchedToTheHostsCpuDemand) {
  NodeProfile p = resnet18();
  double last = 0;
  for (const TensorMeasure& t : p.tensors) last = std::max(last, t.ready_us);
  p.cpu_cores = 2;
  p.local_ranks = 1;
  p.pool_threads = 1;
  // Unknown CPU time: nothing changes.
  EXPECT_EQ(host_share(p, true).compute_stretch, 1.0);
  // Four nodes on two cores, each rank busy for 0.8 of the window's
  // compute: a compute-bound iteration takes 4 x 0.8 / 2 = 1.6 of it.
  p.nodes_on_host = 4;
  p.train_cpu_us = 0.8 * last;
  HostShare s = host_share(p, true);
  EXPECT_NEAR(s.compute_stretch, 1.6, 1e-12);
  EXPECT_NEAR(s.compute_bound_us, 1.6 * last, 1e-6);
  EXPECT_TRUE(s.pool_shares_compute);
  EXPECT_NEAR(s.pool_cost_scale, 2.0, 1e-12);
  // One node on 8 cores: spare cores, no stretch, the pool runs beside.
  p.nodes_on_host = 1;
  p.cpu_cores = 8;
  s = host_share(p, true);
  EXPECT_EQ(s.compute_stretch, 1.0);
  EXPECT_FALSE(s.pool_shares_compute);
  // The stretch is bounded.
  p.nodes_on_host = 64;
  p.cpu_cores = 2;
  EXPECT_EQ(host_share(p, true).compute_stretch, 4.0);
  // And the model uses it: the same window on a shared host predicts a
  // slower compute-bound (compressed) iteration, not a slower fp32 one
  // (calibrated to the window).
  NodeProfile q = resnet18();
  q.cpu_cores = 2;
  const Decision alone = decide(q, two_nodes({"efsignsgd"}));
  q.nodes_on_host = 2;
  q.train_cpu_us = 1.5 * last;
  const Decision shared = decide(q, two_nodes({"efsignsgd"}));
  EXPECT_NEAR(alternative(shared, "fp32").predicted_us, alternative(alone, "fp32").predicted_us,
              1e-3 * alternative(alone, "fp32").predicted_us);
  EXPECT_GT(alternative(shared, "all:efsignsgd").predicted_us,
            1.2 * alternative(alone, "all:efsignsgd").predicted_us);
  EXPECT_EQ(shared.strategy.meta.at("nodes_on_host"), "2");
}

// Other work on the host (the lead's builds beside an emulated cluster, or
// any other tenant) takes cores from the job: the host's CPU time in the
// window less the job's own processes' is the other work, in cores, and it
// competes for the cores as that many more processes. Where it ran, the
// window's ready times shrink towards the job's CPU bound only by the
// part of their contention that was the job's own comm stack.
TEST(OnlineHostShare, OtherWorkOnTheHostTakesItsShareOfTheCores) {
  NodeProfile p = resnet18();
  double last = 0;
  for (const TensorMeasure& t : p.tensors) last = std::max(last, t.ready_us);
  const double T = p.iteration_us;
  p.cpu_cores = 2;
  p.local_ranks = 1;
  p.pool_threads = 1;
  p.nodes_on_host = 4;
  // Each rank computed on a core of its own in the window (its CPU time
  // is its compute span).
  p.train_cpu_us = last;
  p.daemon_cpu_us = 0.1 * last;
  // The job's own CPU on the host: 4 x (rank + daemon + colocated server,
  // counted at the daemon's).
  auto own = [&] { return 4 * (p.train_cpu_us + 2 * p.daemon_cpu_us); };
  // Nothing else ran: as without the host's time (4 x 1 / 2).
  p.host_cpu_us = own();
  HostShare s = host_share(p, true);
  EXPECT_EQ(s.other_cores, 0.0);
  EXPECT_EQ(s.compute_floor, 0.0);
  EXPECT_NEAR(s.compute_stretch, 2.0, 1e-12);
  EXPECT_NEAR(s.pool_cost_scale, 2.0, 1e-12);
  // One core's worth of other work: the 4 ranks keep 4/5 of the 2 cores,
  // so the compute-bound backward pass takes 4 / 1.6 = 2.5 of the
  // window's, and a pool microsecond holds it 4 / 1.6 = 2.5.
  p.host_cpu_us = own() + 1.0 * T;
  s = host_share(p, true);
  EXPECT_NEAR(s.other_cores, 1.0, 1e-9);
  EXPECT_NEAR(s.compute_stretch, 2.5, 1e-9);
  EXPECT_NEAR(s.compute_bound_us, 2.5 * last, 1e-3);
  EXPECT_NEAR(s.pool_cost_scale, 2.5, 1e-9);
  EXPECT_TRUE(s.pool_shares_compute);
  // Dedicated servers: the daemons' CPU is the job's only comm stack, so
  // more of the host's time is other work.
  EXPECT_NEAR(host_share(p, false).other_cores, 1.0 + 4 * p.daemon_cpu_us / T, 1e-9);
  // A host the other work saturates (1.5 cores of it) beside the job's
  // comm stack (half a core: 4 daemons and 4 servers): a rank's CPU time
  // is a quarter of its compute span. The CPU bound is 4 x 0.25 / (2 x 4
  // / 5.5) = 0.6875 of the span, but only the comm stack's part of the
  // contention goes with another strategy: the span shrinks no further
  // than 1.5 / (1.5 + 0.5) = 0.75 (without the host's time it shrank to
  // 4 x 0.25 / 2 = 0.5).
  p.train_cpu_us = 0.25 * last;
  p.daemon_cpu_us = 0.5 * T / 8;
  p.host_cpu_us = own() + 1.5 * T;
  s = host_share(p, true);
  EXPECT_NEAR(s.other_cores, 1.5, 1e-9);
  EXPECT_NEAR(s.compute_floor, 0.75, 1e-9);
  EXPECT_NEAR(s.compute_bound_us, 0.6875 * last, 1e-3);
  EXPECT_NEAR(s.compute_stretch, 0.75, 1e-9);
  EXPECT_NEAR(s.pool_cost_scale, 2.75, 1e-9);
  p.host_cpu_us = 0;
  EXPECT_NEAR(host_share(p, true).compute_stretch, 0.5, 1e-12);
  p.train_cpu_us = last;
  p.daemon_cpu_us = 0.1 * last;
  // Ticks round: a host time below the job's own is no other work; and
  // other work never exceeds the host's cores.
  p.host_cpu_us = 0.9 * own();
  EXPECT_EQ(host_share(p, true).other_cores, 0.0);
  p.host_cpu_us = own() + 10 * T;
  EXPECT_EQ(host_share(p, true).other_cores, 2.0);
  // Unknown training CPU: the job's own share is unknown, nothing is
  // derived.
  p.train_cpu_us = 0;
  EXPECT_EQ(host_share(p, true).other_cores, 0.0);
  // One node on 8 cores beside 2 cores of other work: cores to spare,
  // nothing changes.
  p.train_cpu_us = last;
  p.nodes_on_host = 1;
  p.cpu_cores = 8;
  p.host_cpu_us = (p.train_cpu_us + 2 * p.daemon_cpu_us) + 2.0 * T;
  s = host_share(p, true);
  EXPECT_NEAR(s.other_cores, 2.0, 1e-9);
  EXPECT_EQ(s.compute_stretch, 1.0);
  EXPECT_FALSE(s.pool_shares_compute);

  // The model: the same window with other work on the host predicts a
  // slower compute-bound (compressed) iteration, the window's own strategy
  // unchanged (calibrated to it).
  NodeProfile q = resnet18();
  q.cpu_cores = 2;
  q.local_ranks = 1;
  q.nodes_on_host = 2;
  q.train_cpu_us = 1.5 * last;
  q.daemon_cpu_us = 0.05 * last;
  q.host_cpu_us = 2 * (q.train_cpu_us + 2 * q.daemon_cpu_us);
  const Decision alone = decide(q, two_nodes({"efsignsgd"}));
  q.host_cpu_us += 1.0 * q.iteration_us;
  const Decision shared = decide(q, two_nodes({"efsignsgd"}));
  EXPECT_EQ(alone.strategy.meta.at("other_cores"), "0");
  EXPECT_EQ(shared.strategy.meta.at("other_cores"), "1");
  EXPECT_NE(shared.strategy.meta.at("compute_floor"), "0");
  EXPECT_NEAR(alternative(shared, "fp32").predicted_us, alternative(alone, "fp32").predicted_us,
              1e-3 * alternative(alone, "fp32").predicted_us);
  EXPECT_GT(alternative(shared, "all:efsignsgd").predicted_us,
            1.2 * alternative(alone, "all:efsignsgd").predicted_us);
}

// Profiles written before the host's CPU time was measured read as
// unknown: no other work, the prediction they always gave.
TEST(OnlineYaml, ProfilesWithoutHostCpuTimeStillParse) {
  NodeProfile p = resnet18();
  p.cpu_cores = 2;
  p.nodes_on_host = 2;
  p.train_cpu_us = 400e3;
  p.daemon_cpu_us = 30e3;
  p.host = "boot-1";
  std::string text = p.to_yaml();
  const size_t at = text.find("host_cpu_us:");
  ASSERT_NE(at, std::string::npos);
  text.erase(at, text.find('\n', at) + 1 - at);
  ASSERT_EQ(text.find("host_cpu_us"), std::string::npos);
  const NodeProfile old = NodeProfile::parse(text, "old.yaml");
  EXPECT_EQ(old.host_cpu_us, 0.0);
  EXPECT_EQ(old.train_cpu_us, 400e3);
  EXPECT_EQ(host_share(old, true).other_cores, 0.0);
  EXPECT_EQ(decide(old, two_nodes({"efsignsgd"})).predicted_us,
            decide(p, two_nodes({"efsignsgd"})).predicted_us);
  // The checked-in example profile predates every CPU field.
  EXPECT_EQ(resnet18().host_cpu_us, 0.0);
}

TEST(OnlineYaml, ProfileRoundTrip) {
  NodeProfile p = resnet18();
  p.link_gbps = 0.123456789;
  p.current_strategy_yaml = "version: 1\ndefault: {compressor: none}\n";
  p.train_cpu_us = 123456.5;
  p.host_cpu_us = 987654.25;
  p.host = "8d0c3f5e-boot";
  p.nodes_on_host = 3;
  const std::string text = p.to_yaml();
  const NodeProfile q = NodeProfile::parse(text, "again.yaml");
  EXPECT_EQ(q.to_yaml(), text);
  EXPECT_EQ(q.link_gbps, p.link_gbps);
  EXPECT_EQ(q.current_strategy_yaml, p.current_strategy_yaml);
  EXPECT_EQ(q.train_cpu_us, p.train_cpu_us);
  EXPECT_EQ(q.host_cpu_us, p.host_cpu_us);
  EXPECT_EQ(q.host, p.host);
  EXPECT_EQ(q.nodes_on_host, 3u);
  ASSERT_EQ(q.tensors.size(), 62u);
  EXPECT_EQ(q.tensors[0].name, "conv1.weight");
  EXPECT_EQ(q.tensors[0].ready_us, p.tensors[0].ready_us);
  EXPECT_EQ(q.compressors[2].spec, "topk:0.01");
  EXPECT_EQ(q.compressors[2].compress.b_us_per_melem, 6000);
}

std::string parse_error(const std::string& text) {
  try {
    NodeProfile::parse(text, "node.yaml");
  } catch (const config::ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(OnlineYaml, ProfileErrorsAreLocated) {
  const std::string head = "version: 1\niteration_us: 1000\n";
  std::string e = parse_error(head + "tensors:\n  - {name: a, elements: 0, ready_us: 1}\n");
  EXPECT_NE(e.find("node.yaml:4:"), std::string::npos) << e;
  EXPECT_NE(e.find("elements"), std::string::npos) << e;
  e = parse_error(head + "tensors:\n  - {name: a, elements: 4, ready_us: 1}\n"
                         "compressors:\n  - {spec: \"nosuch\"}\n");
  EXPECT_NE(e.find("node.yaml:6:"), std::string::npos) << e;
  EXPECT_NE(e.find("nosuch"), std::string::npos) << e;
  e = parse_error(head + "tensors:\n  - {name: a, elements: 4, ready_us: 1, colour: red}\n");
  EXPECT_NE(e.find("colour"), std::string::npos) << e;
  e = parse_error("version: 1\ntensors: []\niteration_us: 0\n");
  EXPECT_NE(e.find("iteration_us"), std::string::npos) << e;
  e = parse_error(head + "tensors:\n  - {name: a, elements: 4, ready_us: 1}\n"
                         "  - {name: a, elements: 4, ready_us: 2}\n");
  EXPECT_NE(e.find("twice"), std::string::npos) << e;
  e = parse_error("version: 2\niteration_us: 1\ntensors: []\n");
  EXPECT_NE(e.find("version"), std::string::npos) << e;
}

// The CUDA compressors a training process measured (docs/gpu.md §4): its
// points are fitted as the CPU's are, ride in the profile, and read back.
TEST(OnlineYaml, GpuReportIsFittedAndRidesInTheProfile) {
  const strategy::GpuReport g = strategy::parse_gpu_report(
      "version: 1\nnote: measured on a test device\ncompressors:\n"
      "  - spec: efsignsgd\n    points:\n"
      "      - {n: 1048576, compress_us: 30, decompress_us: 12, bytes: 131088}\n"
      "      - {n: 4194304, compress_us: 90, decompress_us: 36, bytes: 524304}\n",
      "report");
  EXPECT_EQ(g.note, "measured on a test device");
  ASSERT_EQ(g.compressors.size(), 1u);
  const auto& c = g.compressors[0];
  EXPECT_NEAR(c.compress.a_us, 10.0, 1e-9);  // 30 = a + b, 90 = a + 4b
  EXPECT_NEAR(c.compress.b_us_per_melem, 20.0, 1e-9);
  EXPECT_NEAR(c.decompress.at(2 * 1048576.0), 20.0, 1e-9);  // 4 + 8 * 2
  EXPECT_NEAR(c.bytes_per_element, 0.125, 1e-12);
  EXPECT_NEAR(c.fixed_bytes, 16.0, 1e-6);

  NodeProfile p = resnet18();
  const std::string plain = p.to_yaml();
  EXPECT_EQ(plain.find("gpu_"), std::string::npos);  // unreported: files as before
  p.gpu_note = g.note;
  p.gpu_compressors = g.compressors;
  const std::string text = p.to_yaml();
  const NodeProfile q = NodeProfile::parse(text, "again.yaml");
  EXPECT_EQ(q.to_yaml(), text);
  EXPECT_EQ(q.gpu_note, g.note);
  ASSERT_EQ(q.gpu_compressors.size(), 1u);
  EXPECT_EQ(q.gpu_compressors[0].spec, "efsignsgd");
  p.gpu_compressors.clear();
  p.gpu_note = "skipped: no CUDA device is visible";
  EXPECT_EQ(NodeProfile::parse(p.to_yaml(), "skip.yaml").gpu_note, p.gpu_note);

  auto error = [](const std::string& text) {
    try {
      strategy::parse_gpu_report(text, "report");
    } catch (const config::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error("version: 1\nnote: \"\"\n").find("note"), std::string::npos);
  EXPECT_NE(error("version: 1\nnote: x\ncompressors:\n  - {spec: nosuch, points: []}\n")
                .find("nosuch"),
            std::string::npos);
  EXPECT_NE(error("version: 1\nnote: x\ncompressors:\n  - {spec: fp16, points: []}\n")
                .find("no measurement"),
            std::string::npos);
  EXPECT_NE(error("version: 1\nnote: x\ncompressors:\n  - spec: fp16\n    points:\n"
                  "      - {n: 0, compress_us: 1, decompress_us: 1, bytes: 1}\n")
                .find("report:"),
            std::string::npos);
}

TEST(OnlineYaml, DecisionRoundTripAndErrors) {
  const Decision d = decide(resnet18(), two_nodes({"efsignsgd"}));
  const std::string text = d.to_yaml();
  const Decision back = Decision::parse(text, "plan.yaml");
  EXPECT_EQ(back.to_yaml(), text);
  EXPECT_EQ(back.predicted_us, d.predicted_us);
  EXPECT_EQ(back.strategy.to_yaml(), d.strategy.to_yaml());
  EXPECT_EQ(back.timeline_json, d.timeline_json);
  ASSERT_EQ(back.alternatives.size(), d.alternatives.size());
  EXPECT_EQ(back.alternatives[2].strategy_yaml, d.alternatives[2].strategy_yaml);
  EXPECT_EQ(back.explain(), d.explain());

  auto error = [](const std::string& t) {
    try {
      Decision::parse(t, "plan.yaml");
    } catch (const config::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  std::string e = error("version: 1\npredicted_us: fast\nstrategy: \"\"\ntensors: []\n");
  EXPECT_NE(e.find("plan.yaml:2:"), std::string::npos) << e;
  EXPECT_NE(e.find("predicted_us"), std::string::npos) << e;
  e = error("version: 1\npredicted_us: 5\ntensors: []\n");
  EXPECT_NE(e.find("strategy"), std::string::npos) << e;
  e = error("version: 1\npredicted_us: 5\ntensors: []\nstrategy: |\n  version: 1\n  "
            "default: {compressor: zzz}\n");
  EXPECT_NE(e.find("plan.yaml: strategy"), std::string::npos) << e;
  EXPECT_NE(e.find("zzz"), std::string::npos) << e;
}

// ---------------------------------------------------------------- decide

// The coordinator's contract: CPU runtime, placement unchanged (sharded),
// pieces unchanged (an auto job starts at 1 and the runtime refuses a
// change of a tensor's pieces, docs/gpu.md §4).
void expect_executable(const NodeProfile& p, const Decision& d) {
  std::vector<TensorDecl> decl;
  for (const TensorMeasure& t : p.tensors) decl.push_back({t.name, 4 * t.elements});
  EXPECT_NO_THROW(d.strategy.check_cpu_runtime(decl));
  ASSERT_EQ(d.strategy.entries().size(), p.tensors.size());
  for (const Entry& e : d.strategy.entries()) {
    EXPECT_EQ(strategy::plan_for_option(e.option, e.tensor).placement,
              strategy::Placement::kSharded)
        << e.tensor << ": " << e.option.describe();
    EXPECT_EQ(cpu_runtime_unsupported(e.option), "") << e.tensor;
    EXPECT_EQ(e.option.pieces, 1) << e.tensor << ": " << e.option.describe();
  }
  for (const Alternative& a : d.alternatives) {
    const Strategy s = Strategy::parse(a.strategy_yaml, a.name);
    EXPECT_NO_THROW(s.check_cpu_runtime(decl)) << a.name;
    // Per tensor: an alternative is a default and rules, not entries.
    for (const TensorMeasure& t : p.tensors)
      EXPECT_EQ(strategy::plan_for_option(s.resolve(t.name, 4 * t.elements), t.name).placement,
                strategy::Placement::kSharded)
          << a.name << " " << t.name;
    for (const TensorMeasure& t : p.tensors)
      EXPECT_EQ(s.resolve(t.name, 4 * t.elements).pieces, 1) << a.name << " " << t.name;
  }
}

TEST(OnlineDecide, SlowLinkCompressesBigTensorsNotTinyOnes) {
  const NodeProfile p = resnet18();
  const Decision d = decide(p, two_nodes({"efsignsgd"}));
  expect_executable(p, d);
  // The big tensors ready late (layers 1-3: the link has no slack left
  // for them) are compressed; what is ready early may go uncompressed in
  // the link's idle time, and nothing of 1000 elements or fewer pays.
  uint64_t total = 0, squeezed = 0;
  for (const TensorMeasure& t : p.tensors) {
    total += t.elements;
    if (compressed(d, t.name)) {
      squeezed += t.elements;
      EXPECT_EQ(d.strategy.resolve(t.name, 4 * t.elements).compressor, "efsignsgd") << t.name;
    }
    const bool late = t.name.rfind("layer1", 0) == 0 || t.name.rfind("layer2", 0) == 0 ||
                      t.name.rfind("layer3", 0) == 0;
    if (late && t.elements >= 100000) {
      EXPECT_TRUE(compressed(d, t.name)) << t.name;
    }
    if (t.elements <= 1000) {
      EXPECT_FALSE(compressed(d, t.name)) << t.name;
    }
  }
  EXPECT_GT(squeezed, total / 2);
  // Per-tensor choice beats (or ties) every hand strategy, and compression
  // is far ahead of fp32 on this link.
  for (const Alternative& a : d.alternatives)
    EXPECT_LE(d.predicted_us, a.predicted_us * (1 + 2e-3)) << a.name;
  EXPECT_LT(d.predicted_us, 0.5 * alternative(d, "fp32").predicted_us);
  EXPECT_GT(d.decision_ms, 0);
  EXPECT_NE(d.timeline_json.find("\"traceEvents\""), std::string::npos);
  EXPECT_NE(d.timeline_json.find("layer4.1.conv2.weight"), std::string::npos);
}

// The node profiles of planner/bench/online_bench.cc: a planner profile
// (backward order, GPU gaps) as a CPU job, ready times 10x the GPU's, the
// declaration order the reverse of the backward order, ResNet-18's costs.
NodeProfile bench_profile(const std::string& model) {
  if (model == "resnet18") return resnet18();
  const Profile pr = Profile::load_file(planner_data_dir() + "/profiles/" + model + ".yaml");
  NodeProfile n = resnet18();
  n.tensors.clear();
  double t = 10 * pr.forward_or_default_us();
  for (const TensorProfile& tp : pr.tensors) {
    t += 10 * tp.gap_us;
    n.tensors.push_back({tp.name, tp.elements, t});
  }
  std::reverse(n.tensors.begin(), n.tensors.end());
  n.iteration_us = 1.5 * t;
  return n;
}

// online_bench's nine cases: each model at 0.1, 1 and 10 Gbit/s, 4 nodes,
// efsignsgd and topk:0.01 accepted.
template <typename F>
void for_bench_cases(F&& f) {
  for (const std::string model : {"resnet18", "bert_base", "lstm"}) {
    for (const double gbps : {0.1, 1.0, 10.0}) {
      NodeProfile p = bench_profile(model);
      p.link_gbps = gbps;
      AutoConfig cfg;
      cfg.compressors = {"efsignsgd", "topk:0.01"};
      cfg.nodes = cfg.servers = 4;
      SCOPED_TRACE(model + " at " + std::to_string(gbps) + " Gbit/s");
      f(p, cfg, gbps);
    }
  }
}

TEST(OnlineDecide, ShortcutsDecideAsTheReference) {
  // The simulator's shortcuts (cutoff bounds, remembered answers, shifted
  // rests) must leave every decision as the reference search makes it,
  // simulating every candidate to its end.
  for_bench_cases([](const NodeProfile& p, const AutoConfig& cfg, double gbps) {
      const Decision fast = decide(p, cfg);
      const Decision ref = detail::decide_reference(p, cfg);
      expect_executable(p, fast);
      expect_executable(p, ref);
      EXPECT_LE(fast.predicted_us, ref.predicted_us * (1 + 1e-9));
      ASSERT_EQ(fast.tensors.size(), ref.tensors.size());
      for (size_t k = 0; k < fast.tensors.size(); ++k)
        EXPECT_EQ(fast.tensors[k].option, ref.tensors[k].option) << fast.tensors[k].name;
      ASSERT_EQ(fast.alternatives.size(), ref.alternatives.size());
      for (size_t k = 0; k < fast.alternatives.size(); ++k)
        EXPECT_EQ(fast.alternatives[k].predicted_us, ref.alternatives[k].predicted_us);
      // Not a trivial case: something is compressed at the slow link.
      if (gbps < 0.5) {
        size_t n = 0;
        for (const Entry& e : fast.strategy.entries()) n += e.option.compressed();
        EXPECT_GT(n, 0u);
      }
  });
}

TEST(OnlineDecide, NoSingleTensorChangeWouldSaveMuch) {
  // The search tries runs of a group's members from either end, not each
  // member: on the benchmark's cases no single tensor's change may still
  // save more than 0.2% of the predicted iteration (twice the search's own
  // resolution, 0.1%; without the runs a single change would save up to
  // 0.4%).
  // On ideal links (push/pull reaching the whole link, as before the ring
  // model) that bound holds; on the fitted push/pull link model (1/1.42 of
  // the link at 4 nodes) BERT-base at 1 Gbit/s leaves 0.48%, so the bound
  // there is 0.5%.
  for_bench_cases([](const NodeProfile& p, AutoConfig cfg, double) {
    EXPECT_LT(detail::best_single_move_gain(p, cfg), 0.005);
    cfg.ps_overhead = cfg.ps_fanin_overhead = 0;
    cfg.ring_link_share = 1;
    EXPECT_LT(detail::best_single_move_gain(p, cfg), 0.002);
  });
}

TEST(OnlineDecide, AGainBelowTheBarKeepsEveryTensorUncompressed) {
  const NodeProfile p = resnet18();
  AutoConfig c = two_nodes({"efsignsgd"});
  c.min_gain = 0;
  const Decision low = decide(p, c);
  const double fp32 = alternative(low, "fp32").predicted_us;
  const double gain = (fp32 - low.predicted_us) / p.iteration_us;
  ASSERT_GT(gain, 0.1);
  EXPECT_EQ(low.strategy.meta.count("kept_uncompressed"), 0u);
  // The same profile with a bar above the predicted gain: nothing compressed,
  // and the record says why.
  c.min_gain = std::min(0.9, gain + 0.05);
  const Decision high = decide(p, c);
  for (const TensorMeasure& t : p.tensors) EXPECT_FALSE(compressed(high, t.name)) << t.name;
  EXPECT_NEAR(high.predicted_us, fp32, 1e-6 * fp32);
  ASSERT_EQ(high.strategy.meta.count("kept_uncompressed"), 1u);
  EXPECT_NE(high.strategy.meta.at("kept_uncompressed").find("below the bar"), std::string::npos);
}

TEST(OnlineDecide, FastLinkCompressesNothing) {
  NodeProfile p = resnet18();
  p.link_gbps = 100;
  p.link_latency_us = 30;
  p.iteration_us = p.tensors.front().ready_us + 20000;  // conv1 is ready last
  const Decision d = decide(p, two_nodes({"efsignsgd", "topk:0.01"}));
  expect_executable(p, d);
  for (const TensorMeasure& t : p.tensors) EXPECT_FALSE(compressed(d, t.name)) << t.name;
  EXPECT_NEAR(d.predicted_us, p.iteration_us, 1e-6 * p.iteration_us);
}

// ---------------------------------------------------------------- guards

TEST(OnlineGuards, ReasonPerTensor) {
  const strategy::AccuracyGuards g = strategy::AutoSpec{}.guards;
  const std::vector<TensorMeasure> t{{"enc.weight", 1 << 20, 0},
                                     {"enc.bias", 1 << 20, 0},
                                     {"enc.norm.weight", 1 << 20, 0},
                                     {"small.weight", 1000, 0},
                                     {"head.weight", 1 << 20, 0},
                                     {"head.bias", 10, 0}};
  EXPECT_EQ(guard_reason(g, t, 0), "");
  EXPECT_EQ(guard_reason(g, t, 1), "guard: name matches '*bias'");
  EXPECT_EQ(guard_reason(g, t, 2), "guard: name matches '*norm*'");
  EXPECT_EQ(guard_reason(g, t, 3), "guard: 4000 B < min_bytes 262144 B");
  EXPECT_EQ(guard_reason(g, t, 4), "guard: output layer 'head'");
  // Off, every tensor is the planner's.
  for (size_t i = 0; i < t.size(); ++i)
    EXPECT_EQ(guard_reason(strategy::AccuracyGuards::off(), t, i), "") << i;
}

TEST(OnlineGuards, DefaultGuardsKeepBiasesNormsSmallAndOutputLayerUncompressed) {
  const NodeProfile p = resnet18();
  AutoConfig cfg = two_nodes({"efsignsgd"});
  // Without guards the planner compresses tensors the guards keep (the
  // guards must change something for this test to mean anything).
  const Decision bare = decide(p, cfg);
  ASSERT_TRUE(compressed(bare, "conv1.weight"));
  cfg.guards = strategy::AutoSpec{}.guards;
  const Decision d = decide(p, cfg);
  expect_executable(p, d);
  EXPECT_EQ(choice(d, "fc.bias").guard, "guard: name matches '*bias'");
  EXPECT_EQ(choice(d, "layer4.1.bn1.weight").guard, "guard: name matches '*bn*'");
  EXPECT_EQ(choice(d, "fc.weight").guard, "guard: output layer 'fc'");
  EXPECT_EQ(choice(d, "conv1.weight").guard, "guard: 37632 B < min_bytes 262144 B");
  for (const TensorChoice& t : d.tensors) {
    if (t.guard.empty()) continue;
    EXPECT_FALSE(compressed(d, t.name)) << t.name << ": " << t.guard;
    EXPECT_EQ(t.option.rfind("none", 0), 0u) << t.name;
  }
  EXPECT_TRUE(choice(d, "layer4.1.conv2.weight").guard.empty());
  EXPECT_TRUE(compressed(d, "layer4.1.conv2.weight"));
  // The hand strategies honour the guards too.
  const Strategy all = Strategy::parse(alternative(d, "all:efsignsgd").strategy_yaml, "all");
  EXPECT_FALSE(all.resolve("fc.weight", 4 * 512000).compressed());
  EXPECT_FALSE(all.resolve("conv1.weight", 4 * 9408).compressed());
  EXPECT_TRUE(all.resolve("layer4.1.conv2.weight", 4 * 2359296).compressed());
  // The record keeps the reason, and the table prints it.
  const Decision back = Decision::parse(d.to_yaml(), "plan.yaml");
  EXPECT_EQ(choice(back, "fc.bias").guard, "guard: name matches '*bias'");
  const std::string text = d.explain();
  EXPECT_NE(text.find("(guard: output layer 'fc')"), std::string::npos) << text;
  EXPECT_NE(text.find("(guard: 37632 B < min_bytes 262144 B)"), std::string::npos) << text;
}

// ---------------------------------------------------------------- hysteresis

TEST(OnlineHysteresis, ARePlanKeepsTheRunningStrategyUnlessTheNewOneClearsTheBar) {
  NodeProfile p = resnet18();
  AutoConfig cfg = two_nodes({"efsignsgd"});
  cfg.min_gain = 0;
  const Decision first = decide(p, cfg);
  // The window ran the size-threshold hand strategy (compressed, and not
  // what the search picks).
  const std::string running = alternative(first, "threshold:efsignsgd").strategy_yaml;
  p.current_strategy_yaml = running;
  // ... and measured what the model predicted for it (a calibration misfit
  // would raise the bar on its own).
  p.iteration_us = alternative(first, "threshold:efsignsgd").predicted_us;
  ASSERT_LT(first.predicted_us, 0.95 * p.iteration_us);
  const Strategy cur = Strategy::parse(running, "running");
  const Decision free = decide(p, cfg);  // no bar: any faster plan is taken
  ASSERT_EQ(free.kept_current, "");
  bool differs = false;
  for (const TensorChoice& t : free.tensors)
    differs = differs || free.strategy.resolve(t.name, t.bytes).compressed() !=
                             cur.resolve(t.name, t.bytes).compressed();
  ASSERT_TRUE(differs) << "the search must pick a different plan for this test to mean anything";
  // With a bar the new plan does not clear against the running one: kept.
  cfg.min_gain = 0.8;
  const Decision held = decide(p, cfg);
  EXPECT_NE(held.kept_current, "");
  for (const TensorChoice& t : held.tensors)
    EXPECT_EQ(held.strategy.resolve(t.name, t.bytes).compressed(),
              cur.resolve(t.name, t.bytes).compressed())
        << t.name;
  EXPECT_NE(held.explain().find("hysteresis: "), std::string::npos);
  EXPECT_EQ(Decision::parse(held.to_yaml(), "plan.yaml").kept_current, held.kept_current);
}

TEST(OnlineDecide, ExcludedTensorsStayUncompressed) {
  const NodeProfile p = resnet18();
  AutoConfig cfg = two_nodes({"efsignsgd"});
  cfg.exclude = {"conv1.*", "fc.*"};
  const Decision d = decide(p, cfg);
  expect_executable(p, d);
  for (const char* n : {"conv1.weight", "fc.weight", "fc.bias"}) {
    EXPECT_FALSE(compressed(d, n)) << n;
    EXPECT_TRUE(choice(d, n).excluded) << n;
  }
  EXPECT_FALSE(choice(d, "layer4.1.conv2.weight").excluded);
  EXPECT_TRUE(compressed(d, "layer4.1.conv2.weight"));
  // Without the exclusion conv1.weight (ready last) is compressed.
  EXPECT_TRUE(compressed(decide(p, two_nodes({"efsignsgd"})), "conv1.weight"));
  // The hand strategies honour the exclusion too.
  const Strategy all = Strategy::parse(alternative(d, "all:efsignsgd").strategy_yaml, "all");
  EXPECT_FALSE(all.resolve("fc.weight", 4 * 512000).compressed());
  EXPECT_TRUE(all.resolve("layer4.1.conv2.weight", 4).compressed());
}

TEST(OnlineDecide, CalibrationReproducesTheWindow) {
  // Uncompressed window, probe slower than what the model needs, faster,
  // and no probe: the fp32 alternative (the window's strategy) predicts the
  // measured time in every case.
  for (double probe : {0.1, 0.02, 0.0}) {
    for (double measured : {3.0e6, 4.2e6, 9.0e6}) {
      NodeProfile p = resnet18();
      p.link_gbps = probe;
      p.iteration_us = measured;
      const Decision d = decide(p, two_nodes({"efsignsgd"}));
      EXPECT_NEAR(alternative(d, "fp32").predicted_us, measured, 1e-6 * measured)
          << "probe " << probe << " measured " << measured;
      EXPECT_EQ(d.measured_us, measured);
      EXPECT_NE(d.strategy.meta.at("calibration.link_source"), "");
      const double link = std::stod(d.strategy.meta.at("calibration.link_gbps"));
      if (probe > 0) {
        EXPECT_GE(link, probe / 4 * (1 - 1e-9));
        EXPECT_LE(link, probe * 4 * (1 + 1e-9));
      }
      for (const Alternative& a : d.alternatives) EXPECT_GT(a.predicted_us, 0) << a.name;
      EXPECT_GT(d.predicted_us, 0);
    }
  }
  // No probe: the link rate comes from the window's time alone, and a
  // slower window means a slower link.
  NodeProfile p = resnet18();
  p.link_gbps = 0;
  p.iteration_us = 4.2e6;
  const double r1 = std::stod(decide(p, two_nodes({})).strategy.meta.at("calibration.link_gbps"));
  p.iteration_us = 8.4e6;
  const double r2 = std::stod(decide(p, two_nodes({})).strategy.meta.at("calibration.link_gbps"));
  EXPECT_LT(r2, r1);
  EXPECT_NEAR(r1 / r2, 2.0, 0.3);  // the window is almost all link time

  // A compressed window: the strategy that ran is what predicts the
  // measured time (here every tensor under efsignsgd).
  NodeProfile c = resnet18();
  const Decision first = decide(c, two_nodes({"efsignsgd"}));
  c.current_strategy_yaml = alternative(first, "all:efsignsgd").strategy_yaml;
  c.iteration_us = 900000;
  const Decision again = decide(c, two_nodes({"efsignsgd"}));
  EXPECT_NEAR(alternative(again, "all:efsignsgd").predicted_us, 900000, 1e-6 * 900000);
}

TEST(OnlineDecide, AWindowOutsideTheCandidatesStillCalibrates) {
  // The window ran options the planner would not emit (a ps_single tensor)
  // and fp16 on the daemons' ring (allreduce): they calibrate; the ring's
  // tensors stay on the ring (a running job cannot move them), the others
  // take sharded candidates.
  NodeProfile p = resnet18();
  p.current_strategy_yaml =
      "version: 1\ndefault: {compressor: fp16, inter: allreduce}\n"
      "rules:\n  - match: \"fc.*\"\n    option: {compressor: none, inter: reduce_broadcast}\n";
  p.iteration_us = 2.5e6;
  const Decision d = decide(p, two_nodes({"efsignsgd"}));
  std::vector<TensorDecl> decl;
  for (const TensorMeasure& t : p.tensors) decl.push_back({t.name, 4 * t.elements});
  EXPECT_NO_THROW(d.strategy.check_cpu_runtime(decl));
  for (const TensorMeasure& t : p.tensors) {
    const Option& o = d.strategy.resolve(t.name, 4 * t.elements);
    const strategy::Placement pl = strategy::plan_for_option(o, t.name).placement;
    // fc.* ran on one server: kept as it ran (the plan below keeps the
    // running strategy) or sharded.
    if (t.name.rfind("fc.", 0) == 0)
      EXPECT_NE(pl, strategy::Placement::kRing) << t.name << ": " << o.describe();
    else
      EXPECT_EQ(pl, strategy::Placement::kRing) << t.name << ": " << o.describe();
  }
  EXPECT_GT(d.predicted_us, 0);
  EXPECT_LE(d.predicted_us, p.iteration_us * (1 + 1e-6));
  NodeProfile q = p;
  q.current_strategy_yaml = "version: 1\ndefault: {compressor: efsignsgd, inter: alltoall_allgather}\n";
  q.compressors.erase(q.compressors.begin() + 1);  // efsignsgd not measured
  EXPECT_THROW(decide(q, two_nodes({})), Error);
}

TEST(OnlineDecide, ConcurrentCallsAgree) {
  const NodeProfile p = resnet18();
  const AutoConfig cfg = two_nodes({"efsignsgd", "topk:0.01"});
  const std::string serial = decide(p, cfg).strategy.to_yaml();
  std::string a, b;
  std::thread t1([&] { a = decide(p, cfg).strategy.to_yaml(); });
  std::thread t2([&] { b = decide(p, cfg).strategy.to_yaml(); });
  t1.join();
  t2.join();
  // decision_ms differs between runs; everything else is deterministic.
  auto strip = [](std::string s) {
    const size_t i = s.find("decision_ms");
    return i == std::string::npos ? s : s.erase(i, s.find('\n', i) - i);
  };
  EXPECT_EQ(strip(a), strip(serial));
  EXPECT_EQ(strip(b), strip(serial));
}

TEST(OnlineDecide, DedicatedServersUseBothDirectionsOfTheLink) {
  NodeProfile p = resnet18();
  AutoConfig colo = two_nodes({"efsignsgd"});
  AutoConfig dedi = colo;
  dedi.colocated_servers = false;
  const Decision c = decide(p, colo), d = decide(p, dedi);
  expect_executable(p, d);
  // Colocated: pull answers share the send direction with the pushes.
  EXPECT_EQ(c.timeline_json.find("\"tid\":4,\"name\":\"layer"), std::string::npos);
  EXPECT_NE(d.timeline_json.find("\"tid\":4,\"name\":\"layer"), std::string::npos);
  EXPECT_EQ(d.strategy.meta.at("servers"), "2 dedicated");
}

TEST(OnlineDecide, Fp16OnlyByDefault) {
  const NodeProfile p = resnet18();
  const Decision d = decide(p, two_nodes({}));
  expect_executable(p, d);
  std::set<std::string> names;
  for (const Alternative& a : d.alternatives) names.insert(a.name);
  EXPECT_EQ(names, (std::set<std::string>{"fp32", "fp16"}));
  int fp16 = 0;
  for (const Entry& e : d.strategy.entries()) {
    EXPECT_TRUE(e.option.compressor == "none" || e.option.compressor == "fp16") << e.tensor;
    fp16 += e.option.compressor == "fp16";
  }
  EXPECT_GT(fp16, 10);  // on 0.1 Gbit/s halving the bytes pays
  EXPECT_TRUE(compressed(d, "layer4.1.conv2.weight"));
  EXPECT_FALSE(compressed(d, "bn1.bias"));
}

TEST(OnlineDecide, SeveralCompressorsMixAndAlternativesAreListed) {
  const NodeProfile p = resnet18();
  const Decision d = decide(p, two_nodes({"efsignsgd", "topk:0.01"}));
  expect_executable(p, d);
  std::vector<std::string> names;
  for (const Alternative& a : d.alternatives) names.push_back(a.name);
  EXPECT_EQ(names, (std::vector<std::string>{"fp32", "fp16", "all:efsignsgd",
                                             "threshold:efsignsgd", "all:topk:0.01",
                                             "threshold:topk:0.01"}));
  for (const Alternative& a : d.alternatives)
    EXPECT_LE(d.predicted_us, a.predicted_us * (1 + 2e-3)) << a.name;
  // Naming a compressor twice (or fp16 among them) adds nothing.
  const Decision twice = decide(p, two_nodes({"efsignsgd", "fp16", "efsignsgd"}));
  EXPECT_EQ(twice.alternatives.size(), 4u);
  const std::string table = d.explain();
  EXPECT_NE(table.find("layer4.1.conv2.weight"), std::string::npos) << table;
  EXPECT_NE(table.find("threshold:topk:0.01"), std::string::npos) << table;
  EXPECT_NE(table.find("measured"), std::string::npos) << table;
}

TEST(OnlineDecide, BadInputIsNamed) {
  const NodeProfile p = resnet18();
  auto message = [](const NodeProfile& prof, const AutoConfig& cfg) {
    try {
      decide(prof, cfg);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(p, two_nodes({"nosuch"})).find("nosuch"), std::string::npos);
  EXPECT_NE(message(p, two_nodes({"randomk:0.01"})).find("no measurement"), std::string::npos);
  NodeProfile empty = p;
  empty.tensors.clear();
  EXPECT_NE(message(empty, two_nodes({})).find("no tensors"), std::string::npos);
  NodeProfile no_fp16 = p;
  no_fp16.compressors.erase(no_fp16.compressors.begin());
  EXPECT_NE(message(no_fp16, two_nodes({})).find("fp16"), std::string::npos);
  NodeProfile bad_cur = p;
  bad_cur.current_strategy_yaml = "version: 1\ndefault: {compressor: qsgd}\n";
  EXPECT_NE(message(bad_cur, two_nodes({})).find("qsgd"), std::string::npos);
  NodeProfile zero = p;
  zero.iteration_us = 0;
  EXPECT_NE(message(zero, two_nodes({})).find("iteration_us"), std::string::npos);
}

TEST(OnlineDecide, ShardedOptionsMapToTheServers) {
  for (const char* spec : {"none", "fp16", "efsignsgd", "topk:0.01", "randomk:0.01", "dgc:0.01"}) {
    const Option o = sharded_option(spec);
    EXPECT_EQ(strategy::plan_for_option(o, spec).placement, strategy::Placement::kSharded)
        << spec;
    EXPECT_EQ(cpu_runtime_unsupported(o), "") << spec;
  }
  EXPECT_THROW(sharded_option("nosuch"), Error);
}

TEST(OnlineDecide, NeverTheRingARunningJobCannotMoveTo) {
  // An auto job that warmed up sharded over the servers cannot move a
  // tensor to the daemons' ring (Placement::kRing, inter: allreduce with
  // none/fp16/bf16): the coordinator refuses placement changes. With fixed
  // placement (the coordinator's AutoConfig) no option decide() emits runs
  // on the ring, though the model prefers it (OnlineRing tests).
  for (const uint32_t nodes : {2u, 4u}) {
    for (const double gbps : {0.1, 1.0, 10.0, 100.0}) {
      for (const std::vector<std::string>& comps :
           {std::vector<std::string>{}, std::vector<std::string>{"efsignsgd"}}) {
        NodeProfile p = resnet18();
        p.link_gbps = gbps;
        AutoConfig cfg = two_nodes(comps);
        cfg.nodes = cfg.servers = nodes;
        SCOPED_TRACE(std::to_string(nodes) + " nodes at " + std::to_string(gbps) + " Gbit/s, " +
                     std::to_string(comps.size()) + " accepted compressors");
        const Decision d = decide(p, cfg);
        std::vector<Strategy> all{d.strategy};
        for (const Alternative& a : d.alternatives)
          all.push_back(Strategy::parse(a.strategy_yaml, a.name));
        // Resolved per tensor: a parsed alternative has rules, not entries.
        for (const Strategy& s : all)
          for (const TensorMeasure& t : p.tensors) {
            const Option& o = s.resolve(t.name, 4 * t.elements);
            EXPECT_EQ(runtime_inter_mode(o), "ps") << t.name << ": " << o.describe();
          }
      }
    }
  }
}

// ---------------------------------------------------------------- ring

// The ring's timeline (Cluster::ring_us, model.h): 2(M-1) steps of one
// segment, a per-hop latency when a segment is one chunk.
TEST(RingModel, BandwidthTermIsTwoNMinusOneOverNAndLatencyGrowsWithNodes) {
  Cluster c;
  c.inter = Link{1.0, 200};  // 125 bytes per us
  c.ring_link_share = 1.0;
  c.ring_chunk_bytes = 1 << 20;
  const double B = c.inter.bytes_per_us();
  // Large: every segment is many chunks, the link never waits for a hop.
  const double big = 4096.0 * (1 << 20);
  for (int M : {2, 3, 4, 8, 16, 64, 256}) {
    c.machines = M;
    EXPECT_NEAR(c.ring_us(big), 2.0 * (M - 1) / M * big / B, 1e-6 * big / B) << M;
  }
  // Small: a segment is one chunk, each of the 2(M-1) steps pays the hop.
  const double small = 4096;
  for (int M : {2, 4, 16, 256}) {
    c.machines = M;
    EXPECT_NEAR(c.ring_us(small), 2.0 * (M - 1) * (small / M / B + 200), 1e-9) << M;
  }
  // Monotone in the node count at every size, and the share scales the
  // bandwidth term only.
  for (double bytes : {4.0, 4096.0, 65536.0, 1048576.0, 4194304.0, 67108864.0}) {
    double prev = 0;
    for (int M = 2; M <= 256; ++M) {
      c.machines = M;
      const double t = c.ring_us(bytes);
      EXPECT_GE(t, prev - 1e-9) << bytes << " B on " << M << " nodes";
      prev = t;
    }
  }
  c.machines = 1;
  EXPECT_EQ(c.ring_us(big), 0.0);
  c.machines = 4;
  c.inter.latency_us = 0;
  c.ring_link_share = 0.5;
  EXPECT_NEAR(c.ring_us(big), 2.0 * 3 / 4 * big / (B * 0.5), 1e-6 * big / B);
}

TEST(RingModel, ClusterFileCarriesTheMeasuredShares) {
  const Cluster c = Cluster::parse(
      "version: 1\nmachines: 4\ncpu_cores: 2\ninter: {gbps: 1, latency_us: 200}\n"
      "cpu_nodes: {pool_threads: 1, reduce: {a_us: 0, b_us_per_melem: 0}}\n"
      "ring: {chunk_bytes: 256KiB, hop_us: 150, link_share: 0.91}\n"
      "push_pull: {overhead: 0.16, fanin_overhead: 0.26}\n",
      "c.yaml");
  EXPECT_EQ(c.ring_chunk_bytes, 256u << 10);
  EXPECT_EQ(c.ring_hop_us, 150);
  EXPECT_EQ(c.ring_link_share, 0.91);
  EXPECT_NEAR(c.ps_link_share(), 1 / 1.42, 1e-12);
  const Cluster ideal = Cluster::parse(
      "version: 1\nmachines: 4\ncpu_cores: 2\ninter: {gbps: 1, latency_us: 200}\n"
      "cpu_nodes: {pool_threads: 1, reduce: {a_us: 0, b_us_per_melem: 0}}\n",
      "ideal.yaml");
  EXPECT_EQ(ideal.ps_link_share(), 1.0);
  EXPECT_EQ(ideal.ring_link_share, 1.0);
  try {
    Cluster::parse("version: 1\nmachines: 2\ngpus_per_machine: 1\nring: {chunk_bytes: 2MiB}\n",
                   "bad.yaml");
    ADD_FAILURE();
  } catch (const config::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("chunk_bytes"), std::string::npos) << e.what();
  }
}

TEST(RingModel, PushPullShareFallsWithFanIn) {
  Cluster c;
  c.ps_overhead = 0.24;
  c.ps_fanin_overhead = 0.3;
  c.machines = 2;
  EXPECT_NEAR(c.ps_link_share(), 1 / 1.24, 1e-12);
  c.machines = 4;
  EXPECT_NEAR(c.ps_link_share(), 1 / 1.54, 1e-12);
  double prev = 1;
  for (int M = 2; M <= 256; M *= 2) {
    c.machines = M;
    EXPECT_LT(c.ps_link_share(), prev);
    prev = c.ps_link_share();
  }
  Cluster ideal;
  ideal.machines = 64;
  EXPECT_EQ(ideal.ps_link_share(), 1.0);  // the paper's testbeds: unchanged
}

// The CPU-node chain of a ring option: the ring on the link (fp16: half
// the bytes), its CPU beside it; push/pull's two steps otherwise.
TEST(RingModel, CpuNodeChainRunsTheRingForAllreduce) {
  Profile prof;
  prof.forward_us = 0;
  prof.tensors = {{"w", 1 << 20, 0}};
  Cluster c;
  c.cpu_nodes = true;
  c.machines = 4;
  c.servers = 4;
  c.inter = Link{1.0, 200};
  c.partition_bytes = 4 << 20;
  c.ring_link_share = 0.95;
  c.ps_overhead = 0.24;
  c.ps_fanin_overhead = 0.3;
  CostTable costs;
  CompressorCost fp16;
  fp16.name = "fp16";
  fp16.bytes_per_element = 2;
  fp16.cpu = DeviceCost{{1, 100, 0}, {1, 100, 0}};
  costs.compressors["fp16"] = fp16;
  Problem p(prof, c, costs,
            {Option{}, ring_option("none"), ring_option("fp16"), sharded_option("fp16")});
  auto link_us = [&](int opt) {
    double t = 0;
    for (const Op& op : p.chain(1 << 20, opt))
      if (!op.fork() && op.resource == Resource::kInter) t += op.duration_us;
    return t;
  };
  EXPECT_NEAR(link_us(1), c.ring_us(4.0 * (1 << 20)), 1e-9);
  EXPECT_NEAR(link_us(2), c.ring_us(2.0 * (1 << 20)), 1e-9);
  EXPECT_NEAR(link_us(0), 2 * c.ps_step_us(4.0 * (1 << 20), 0.75), 1e-9);
  // 4 MiB on 4 nodes: the ring's 0.95 share beats push/pull's 1/1.54.
  EXPECT_LT(link_us(1), link_us(0));
  EXPECT_LT(link_us(2), link_us(3));
  EXPECT_TRUE(on_ring(ring_option("bf16")));
  EXPECT_FALSE(on_ring(sharded_option("fp16")));
  EXPECT_THROW(ring_option("efsignsgd"), Error);
}

// A uniform profile: 40 tensors of `elements`, ready 1 ms apart after a
// 10 ms forward pass, uncompressed in the window.
NodeProfile flat_profile(uint64_t elements, double gbps, double latency_us) {
  NodeProfile p = resnet18();
  p.tensors.clear();
  for (int t = 0; t < 40; ++t)
    p.tensors.push_back({"layer" + std::to_string(t) + ".weight", elements, 10000.0 + 1000.0 * t});
  p.link_gbps = gbps;
  p.link_latency_us = latency_us;
  p.iteration_us = 60000;
  p.current_strategy_yaml.clear();
  p.train_cpu_us = 0;
  p.daemon_cpu_us = 0;
  return p;
}

int ring_tensors(const Decision& d) {
  int n = 0;
  for (const TensorChoice& t : d.tensors)
    n += strategy::plan_for_option(d.strategy.resolve(t.name, t.bytes), t.name).placement ==
         strategy::Placement::kRing;
  return n;
}

TEST(OnlineRing, FreePlacementPutsLargeTensorsOnTheRingWhenTheModelSaysSo) {
  for (const uint32_t nodes : {2u, 4u}) {
    SCOPED_TRACE(std::to_string(nodes) + " nodes");
    // 4 MiB tensors on a saturated 1 Gbit/s link: the ring's measured share
    // (AutoConfig::kRingLinkShare) against push/pull's (1/1.16 at 2 nodes,
    // 1/1.42 at 4).
    NodeProfile p = flat_profile(1 << 20, 1.0, 200);
    p.iteration_us = 60000 + 40 * 2.0 * (nodes - 1) / nodes * 4 * (1 << 20) / 125.0;
    AutoConfig cfg = two_nodes({});
    cfg.nodes = cfg.servers = nodes;
    cfg.placement = AutoConfig::Placement::kFree;
    Decision d = decide(p, cfg);
    EXPECT_EQ(ring_tensors(d), 40) << d.explain();
    // Uncompressed on the ring beats uncompressed push/pull; fp16 (always
    // a candidate) halves the ring's bytes and is taken too.
    // (2 nodes: 0.91 of the link against 1/1.16 = 0.86, about 6%.)
    EXPECT_LT(alternative(d, "ring").predicted_us, 0.97 * alternative(d, "fp32").predicted_us);
    EXPECT_LE(d.predicted_us, alternative(d, "ring").predicted_us);
    EXPECT_EQ(d.strategy.meta.at("ring_tensors"), "40");
    // Not otherwise: a ring that reaches less of the link than push/pull.
    cfg.ring_link_share = 0.3;
    d = decide(p, cfg);
    EXPECT_EQ(ring_tensors(d), 0) << d.explain();
    // Fixed placement (a running job that warmed up on the servers): never.
    cfg.ring_link_share = AutoConfig::kRingLinkShare;
    cfg.placement = AutoConfig::Placement::kFixed;
    d = decide(p, cfg);
    EXPECT_EQ(ring_tensors(d), 0);
  }
}

TEST(OnlineRing, SmallTensorsStayOnTheServersWhereTheHopsCostMore) {
  // 4 KiB tensors on 4 nodes with 2 ms per hop: the ring's 6 hops against
  // push/pull's 2 round trips, on an idle link.
  NodeProfile p = flat_profile(1024, 1.0, 2000);
  AutoConfig cfg = two_nodes({});
  cfg.nodes = cfg.servers = 4;
  cfg.placement = AutoConfig::Placement::kFree;
  const Decision d = decide(p, cfg);
  EXPECT_EQ(ring_tensors(d), 0) << d.explain();
  EXPECT_GT(alternative(d, "ring").predicted_us, alternative(d, "fp32").predicted_us);
}

TEST(OnlineRing, ARunningJobKeepsItsRingTensorsOnTheRing) {
  // The window ran the first 20 tensors on the ring (a job that started
  // so): with fixed placement they stay there (none or fp16 on the ring),
  // the others stay on the servers (where efsignsgd may compress them).
  NodeProfile p = flat_profile(1 << 20, 0.1, 200);
  Strategy cur;
  cur.set_default(Option{});
  for (int t = 0; t < 20; ++t) cur.add_entry({p.tensors[t].name, ring_option("none")});
  p.current_strategy_yaml = cur.to_yaml();
  p.iteration_us = 8e6;
  AutoConfig cfg = two_nodes({"efsignsgd"});
  const Decision d = decide(p, cfg);
  for (int t = 0; t < 40; ++t) {
    const Option& o = d.strategy.resolve(p.tensors[t].name, 4 * p.tensors[t].elements);
    EXPECT_EQ(on_ring(o), t < 20) << p.tensors[t].name << ": " << o.describe();
  }
  // At 0.1 Gbit/s compression pays: the servers' tensors take efsignsgd,
  // the ring's fp16 (what the ring carries).
  EXPECT_EQ(d.strategy.resolve(p.tensors[30].name, 4 << 20).compressor, "efsignsgd")
      << d.explain();
  EXPECT_EQ(d.strategy.resolve(p.tensors[5].name, 4 << 20).compressor, "fp16") << d.explain();
  // The hand alternatives keep them on the ring too.
  for (const Alternative& a : d.alternatives) {
    const Strategy s = Strategy::parse(a.strategy_yaml, a.name);
    for (int t = 0; t < 40; ++t)
      EXPECT_EQ(on_ring(s.resolve(p.tensors[t].name, 4 << 20)), t < 20) << a.name;
  }
}

// Sets the window's iteration to what the model predicts for its strategy
// at a quarter of the probe (calibration's lower bound): a window the
// model explains, with no residual or scale to hide a gain behind.
void measured_as_modelled(NodeProfile& p, const AutoConfig& cfg) {
  AutoConfig fixed = cfg;
  fixed.placement = AutoConfig::Placement::kFixed;
  p.iteration_us = 1e10;
  const Decision d = decide(p, fixed);
  p.iteration_us = std::stod(d.strategy.meta.at("calibration.model_us"));
}

// A window that ran every tensor as `option` (the strategy the job ran).
std::string all_as(const NodeProfile& p, const Option& option) {
  Strategy s;
  s.set_default(Option{});
  for (const TensorMeasure& t : p.tensors) s.add_entry({t.name, option});
  return s.to_yaml();
}

int moved_tensors(const Decision& d, const NodeProfile& window) {
  const Strategy ran = Strategy::parse(
      window.current_strategy_yaml.empty() ? "version: 1\n" : window.current_strategy_yaml, "ran");
  int n = 0;
  for (const TensorMeasure& t : window.tensors)
    n += on_ring(ran.resolve(t.name, 4 * t.elements)) !=
         on_ring(d.strategy.resolve(t.name, 4 * t.elements));
  return n;
}

// Issue 25 item 2: the coordinator's setting for a running job with a ring
// (AutoConfig::Placement::kMove). The window measured every tensor on the
// servers; the ring's cost is the model's. A move pays only when the model
// has the ring faster than the measured push/pull by the min_gain bar.
TEST(OnlineRing, ARunningJobMovesTensorsToTheRingOnlyWhenThatClearsTheBar) {
  for (const uint32_t nodes : {2u, 4u}) {
    SCOPED_TRACE(std::to_string(nodes) + " nodes");
    // 40 x 4 MiB on a saturated 1 Gbit/s link, uncompressed on the servers
    // (exclude: nothing is compressed, so only the placement can change).
    NodeProfile p = flat_profile(1 << 20, 1.0, 200);
    const double ps_frac = 2.0 * (nodes - 1) / nodes;
    p.iteration_us = 10000 + 40 * ps_frac * 4 * (1 << 20) / 125.0 / (nodes == 2 ? 0.862 : 0.704);
    AutoConfig cfg = two_nodes({});
    cfg.nodes = cfg.servers = nodes;
    cfg.exclude = {"*"};
    cfg.placement = AutoConfig::Placement::kMove;
    const Decision d = decide(p, cfg);
    const double ring_us = alternative(d, "ring").predicted_us;
    const double fp32_us = alternative(d, "fp32").predicted_us;
    EXPECT_NEAR(fp32_us, p.iteration_us, 1e-3 * p.iteration_us);  // the measured one
    if (nodes == 2) {
      // The ring's 0.91 of the link against push/pull's 0.86: about 5%
      // faster by the model, below the 10% bar: kept on the servers (and
      // the decision says why).
      EXPECT_LT(ring_us, fp32_us);
      EXPECT_GT(ring_us, 0.9 * fp32_us);
      EXPECT_EQ(ring_tensors(d), 0) << d.explain();
      EXPECT_NE(d.strategy.meta.at("placement_moves").find("every tensor kept where it ran"),
                std::string::npos)
          << d.explain();
      EXPECT_NE(d.explain().find("placement: moving 40 tensor(s)"), std::string::npos)
          << d.explain();
      // A lower bar lets it move; free placement (a plan before the first
      // round) has none.
      AutoConfig low = cfg;
      low.min_gain = 0.02;
      EXPECT_EQ(ring_tensors(decide(p, low)), 40);
      AutoConfig free = cfg;
      free.placement = AutoConfig::Placement::kFree;
      EXPECT_EQ(ring_tensors(decide(p, free)), 40);
    } else {
      // 4 nodes: 0.91 against 1/1.42 of the link, about 25% faster: moved.
      EXPECT_LT(ring_us, 0.85 * fp32_us);
      EXPECT_EQ(ring_tensors(d), 40) << d.explain();
      EXPECT_NE(d.strategy.meta.at("placement_moves").find(": moved"), std::string::npos);
      EXPECT_NEAR(d.predicted_us, ring_us, 1e-3 * ring_us);
      // The next re-plan measures the ring as predicted: nothing moves back
      // (the servers' push/pull is now the model's estimate, and slower).
      NodeProfile after = p;
      after.current_strategy_yaml = d.strategy.to_yaml();
      after.iteration_us = d.predicted_us;
      const Decision again = decide(after, cfg);
      EXPECT_EQ(moved_tensors(again, after), 0) << again.explain();
      EXPECT_EQ(ring_tensors(again), 40);
    }
    // A job without a ring (kFixed, the coordinator's setting there): never.
    cfg.placement = AutoConfig::Placement::kFixed;
    EXPECT_EQ(ring_tensors(decide(p, cfg)), 0);
  }
}

TEST(OnlineRing, ARunningJobMovesRingTensorsToTheServersOnlyWhenThatClearsTheBar) {
  // The reverse: the window ran 40 x 16 KiB on the ring of 4 nodes with
  // 400 us hops, where the ring's 6 hops per partition cost more than
  // push/pull's 2 round trips (docs/planner.md: 64 KiB on 4 nodes at 1
  // Gbit/s measured 0.43x push/pull's speed).
  NodeProfile p = flat_profile(4096, 10.0, 400);
  p.current_strategy_yaml = all_as(p, ring_option("none"));
  AutoConfig cfg = two_nodes({});
  cfg.nodes = cfg.servers = 4;
  cfg.exclude = {"*"};
  cfg.placement = AutoConfig::Placement::kMove;
  measured_as_modelled(p, cfg);
  const Decision d = decide(p, cfg);
  const double fp32_us = alternative(d, "fp32").predicted_us;  // every tensor on the servers
  const double ring_us = alternative(d, "ring").predicted_us;
  EXPECT_NEAR(ring_us, p.iteration_us, 1e-3 * p.iteration_us);
  ASSERT_LT(fp32_us, 0.9 * ring_us) << d.explain();
  EXPECT_EQ(ring_tensors(d), 0) << d.explain();
  EXPECT_EQ(moved_tensors(d, p), 40);
  // With a bar above the model's gain the ring keeps them.
  AutoConfig high = cfg;
  high.min_gain = 1.0 - fp32_us / ring_us + 0.05;
  const Decision kept = decide(p, high);
  EXPECT_EQ(ring_tensors(kept), 40) << kept.explain();
  EXPECT_NE(kept.strategy.meta.at("placement_moves").find("kept"), std::string::npos);
}

TEST(OnlineRing, HysteresisCoversMoves) {
  // The window ran fp16 on the servers, 2 nodes, a saturated 1 Gbit/s
  // link: the ring's fp16 is about 5% faster by the model, below the bar.
  // The running strategy is kept, placement and all, with free placement
  // too (before, a plan that moved a tensor skipped the hysteresis there).
  NodeProfile p = flat_profile(1 << 20, 1.0, 200);
  p.current_strategy_yaml = all_as(p, sharded_option("fp16"));
  AutoConfig cfg = two_nodes({});
  measured_as_modelled(p, cfg);
  cfg.placement = AutoConfig::Placement::kFree;
  const Decision free = decide(p, cfg);
  EXPECT_EQ(moved_tensors(free, p), 0) << free.explain();
  EXPECT_NE(free.kept_current, "") << free.explain();
  EXPECT_EQ(free.strategy.resolve(p.tensors[30].name, 4 << 20).compressor, "fp16");
  cfg.placement = AutoConfig::Placement::kMove;
  const Decision move = decide(p, cfg);
  EXPECT_EQ(moved_tensors(move, p), 0) << move.explain();
  EXPECT_EQ(move.strategy.resolve(p.tensors[30].name, 4 << 20).compressor, "fp16");
  // Where the ring is faster by the bar (4 nodes), the move is taken.
  p.current_strategy_yaml = all_as(p, sharded_option("fp16"));
  cfg.nodes = cfg.servers = 4;
  measured_as_modelled(p, cfg);
  const Decision four = decide(p, cfg);
  EXPECT_EQ(moved_tensors(four, p), 40) << four.explain();
  EXPECT_EQ(four.kept_current, "");
}

// The comm stack's CPU per byte is measured on the path the window ran and
// charged as each path pays it: the ring the daemon's own, push/pull with
// colocated servers twice that (the server's share). Before, the ring
// paid the server's share too.
TEST(OnlineRing, TheRingPaysTheDaemonsOwnCommCpu) {
  for (const bool ring_window : {false, true}) {
    SCOPED_TRACE(ring_window ? "window on the ring" : "window on the servers");
    NodeProfile p = flat_profile(1 << 20, 1.0, 200);
    p.daemon_cpu_us = 50000;
    if (ring_window) p.current_strategy_yaml = all_as(p, ring_option("none"));
    AutoConfig cfg = two_nodes({});
    cfg.servers = 1;  // push/pull keeps every byte on node 0's server: only the ring's count
    if (!ring_window) cfg.servers = 2;
    measured_as_modelled(p, cfg);
    const Decision d = decide(p, cfg);
    double pool = 0;
    for (const TensorMeasure& t : p.tensors) pool += p.reduce.at(static_cast<double>(t.elements));
    // 2 nodes: the ring sends and receives half of 4 MiB per tensor; push/pull
    // over 2 colocated servers the remote half, both ways: the same bytes.
    const double bytes = 40 * 2 * 0.5 * 4.0 * (1 << 20);
    const double own_ns = (p.daemon_cpu_us - pool) / bytes * 1e3;
    EXPECT_NEAR(std::stod(d.strategy.meta.at("ring_comm_cpu_ns_per_byte")), own_ns,
                1e-3 * own_ns);
    EXPECT_NEAR(std::stod(d.strategy.meta.at("comm_cpu_ns_per_byte")), 2 * own_ns,
                2e-3 * own_ns);
  }
}

TEST(OnlineRing, ARunningJobWithATensorItCannotMoveGetsNoPlan) {
  // ps_single (or allgather) cannot become ps or ring mid-job: the
  // coordinator would refuse the change, so the planner refuses to plan.
  NodeProfile p = flat_profile(1 << 20, 1.0, 200);
  p.current_strategy_yaml =
      "version: 1\nrules:\n  - match: \"layer3.*\"\n"
      "    option: {compressor: none, inter: reduce_broadcast}\n";
  AutoConfig cfg = two_nodes({});
  cfg.placement = AutoConfig::Placement::kMove;
  try {
    decide(p, cfg);
    ADD_FAILURE() << "planned";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'layer3.weight'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("ps_single"), std::string::npos) << e.what();
  }
  cfg.placement = AutoConfig::Placement::kFixed;
  EXPECT_NO_THROW(decide(p, cfg));
}

TEST(OnlineRing, ScaleCliPredictsBothSchemesPerClusterSize) {
  std::ostringstream out, err;
  ASSERT_EQ(run_cli({"scale", "--nodes", "2,4,16,256", "--gbps", "1", "--json"}, out, err), 0)
      << err.str();
  // One row per size; the ring's time grows with the nodes (latency term)
  // and stays at least the link's 2(N-1)/N bound; push/pull's too.
  const std::string j = out.str();
  std::vector<double> ring, ps, link;
  for (size_t at = 0; (at = j.find("\"ps_ms\": ", at)) != std::string::npos; ++at) {
    ps.push_back(std::stod(j.substr(at + 9)));
    const size_t r = j.find("\"ring_ms\": ", at), l = j.find("\"link_ms\": ", at);
    ring.push_back(std::stod(j.substr(r + 11)));
    link.push_back(std::stod(j.substr(l + 11)));
  }
  ASSERT_EQ(ring.size(), 4u) << j;
  for (size_t k = 0; k < 4; ++k) {
    EXPECT_GE(ring[k], link[k]) << k;
    EXPECT_GE(ps[k], link[k]) << k;
    if (k > 0) {
      EXPECT_GT(ring[k], ring[k - 1]) << k;
      EXPECT_GT(ps[k], ps[k - 1]) << k;
    }
  }
  // 8 x 4 MiB over 2 nodes at 1 Gbit/s: 2 x 16 MiB / 125 MB/s.
  EXPECT_NEAR(link[0], 268.435, 1e-3);
  std::ostringstream o2, e2;
  EXPECT_EQ(run_cli({"scale", "--nodes", "1"}, o2, e2), 1);
  EXPECT_NE(e2.str().find("--nodes"), std::string::npos) << e2.str();
  EXPECT_EQ(run_cli({"scale", "--tensor-bytes", "6"}, o2, e2), 1);
  EXPECT_NE(e2.str().find("multiple of 4"), std::string::npos) << e2.str();
}

// ---------------------------------------------------------------- CLI

class ExplainCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("online_explain_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name) << text;
  }
  int run(std::string& out, std::string& err) {
    std::ostringstream o, e;
    const int rc = run_cli({"explain", dir_.string()}, o, e);
    out = o.str();
    err = e.str();
    return rc;
  }
  std::filesystem::path dir_;
};

TEST_F(ExplainCli, PrintsTableAndMeasured) {
  const Decision d = decide(resnet18(), two_nodes({"efsignsgd"}));
  write("plan.yaml", d.to_yaml());
  std::string out, err;
  ASSERT_EQ(run(out, err), 0) << err;
  EXPECT_NE(out.find("layer3.0.downsample.0.weight"), std::string::npos) << out;
  EXPECT_NE(out.find("efsignsgd"), std::string::npos) << out;
  EXPECT_NE(out.find("all:efsignsgd"), std::string::npos) << out;
  EXPECT_NE(out.find("not yet"), std::string::npos) << out;

  write("measured.yaml", "version: 1\niteration_us: " + std::to_string(d.predicted_us * 1.1) +
                             "\niterations: 30\n");
  ASSERT_EQ(run(out, err), 0) << err;
  EXPECT_NE(out.find("median of 30 iterations"), std::string::npos) << out;
  EXPECT_NE(out.find("+10.0%"), std::string::npos) << out;
}

TEST_F(ExplainCli, DecideWritesTheRunDirectory) {
  const std::string profile = planner_data_dir() + "/profiles/online/resnet18.yaml";
  std::ostringstream o, e;
  ASSERT_EQ(run_cli({"decide", profile, profile, "--compressors", "efsignsgd,topk:0.01",
                     "--exclude", "conv1.*,fc.*", "--out", dir_.string()},
                    o, e),
            0)
      << e.str();
  EXPECT_NE(o.str().find("conv1.weight"), std::string::npos) << o.str();
  EXPECT_NE(o.str().find("(excluded)"), std::string::npos) << o.str();
  for (const char* f : {"plan.yaml", "strategy.yaml", "timeline.json"})
    EXPECT_TRUE(std::filesystem::exists(dir_ / f)) << f;
  // The strategy file is what the daemons load.
  std::ifstream in(dir_ / "strategy.yaml");
  std::stringstream ss;
  ss << in.rdbuf();
  const Strategy s = Strategy::parse(ss.str(), "strategy.yaml");
  EXPECT_FALSE(s.resolve("fc.weight", 4 * 512000).compressed());
  EXPECT_TRUE(s.resolve("layer3.1.conv2.weight", 4 * 589824).compressed());
  std::string out, err;
  ASSERT_EQ(run(out, err), 0) << err;
  EXPECT_EQ(out.rfind(o.str(), 0), 0u) << "explain repeats decide's table";

  std::ostringstream o2, e2;
  EXPECT_EQ(run_cli({"decide", profile, "--nodes", "two", "--out", dir_.string()}, o2, e2), 1);
  EXPECT_NE(e2.str().find("--nodes"), std::string::npos) << e2.str();
  std::ostringstream o3, e3;
  EXPECT_EQ(run_cli({"decide", profile, "--compressors", "zip", "--out", dir_.string()}, o3, e3),
            1);
  EXPECT_NE(e3.str().find("zip"), std::string::npos) << e3.str();
  std::ostringstream o5, e5;
  EXPECT_EQ(run_cli({"decide", profile, "--placement", "sideways", "--out", dir_.string()}, o5, e5),
            1);
  EXPECT_NE(e5.str().find("accepted: fixed, move, free"), std::string::npos) << e5.str();
  std::ostringstream o6, e6;
  EXPECT_EQ(run_cli({"decide", profile, "--placement", "move", "--out", dir_.string()}, o6, e6), 0)
      << e6.str();
  std::ostringstream o4, e4;
  EXPECT_EQ(run_cli({"decide", profile}, o4, e4), 1);
  EXPECT_NE(e4.str().find("--out"), std::string::npos) << e4.str();
}

TEST_F(ExplainCli, ErrorsNameTheFile) {
  std::string out, err;
  EXPECT_EQ(run(out, err), 1);
  EXPECT_NE(err.find("plan.yaml"), std::string::npos) << err;
  write("plan.yaml", "version: 1\npredicted_us: [1]\nstrategy: \"\"\ntensors: []\n");
  EXPECT_EQ(run(out, err), 1);
  EXPECT_NE(err.find("plan.yaml:2:"), std::string::npos) << err;
  write("plan.yaml", decide(resnet18(), two_nodes({})).to_yaml());
  write("measured.yaml", "version: 1\niteration_us: -4\niterations: 3\n");
  EXPECT_EQ(run(out, err), 1);
  EXPECT_NE(err.find("measured.yaml:2:"), std::string::npos) << err;
  write("measured.yaml", "version: 1\niteration_us: 4\n");
  EXPECT_EQ(run(out, err), 1);
  EXPECT_NE(err.find("iterations"), std::string::npos) << err;
  std::ostringstream o, e;
  EXPECT_EQ(run_cli({"explain"}, o, e), 1);
  EXPECT_NE(e.str().find("RUN_DIR"), std::string::npos);
}

}  // namespace
}  // namespace bytecomp::planner::online
