// Planner tests: hand-computed timelines, the decision tree, the algorithms
// against the exact solver and the baselines, and input errors.
#include <gtest/gtest.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "common/config.h"
#include "common/error.h"
#include "planner/cli/cli.h"
#include "planner/search.h"

using bytecomp::Error;
using bytecomp::config::ConfigError;
using namespace bytecomp::planner;

namespace {

std::string data(const std::string& rel) { return planner_data_dir() + "/" + rel; }

// Two machines with one GPU each: no intra-node steps, an 8 Gb/s link
// (1000 bytes/us) with 10 us per step, so every figure below is by hand.
Cluster tiny_cluster(int cores = 1) {
  return Cluster::parse("version: 1\nname: tiny\nmachines: 2\ngpus_per_machine: 1\n"
                        "inter: {gbps: 8, latency_us: 10}\nintra: {gbps: 8, latency_us: 10}\n"
                        "cpu_cores: " + std::to_string(cores) + "\n",
                        "tiny.yaml");
}

Profile two_tensors(double gap_a, double gap_b) {
  std::ostringstream os;
  os << "version: 1\nmodel: two\nforward_us: 0\ntensors:\n"
     << "  - {name: a, elements: 1000, gap_us: " << gap_a << "}\n"
     << "  - {name: b, elements: 1000, gap_us: " << gap_b << "}\n";
  return Profile::parse(os.str(), "two.yaml");
}

// onebit: 1/8 byte per element; GPU compress 20 us, decompress 10 us per
// batched kernel (all pieces of one collective); CPU compress 30 us,
// decompress 5 us per piece (one core).
CostTable tiny_costs() {
  return CostTable::parse(R"(version: 1
name: tiny
compressors:
  - name: onebit
    bytes_per_element: 0.125
    gpu: {compress: {a_us: 20}, decompress: {a_us: 10}}
    cpu: {compress: {a_us: 30}, decompress: {a_us: 5}}
)", "tiny-costs.yaml");
}

Option fp32() {
  Option o;
  o.intra = Collective::kReduceScatterAllgather;
  return o;
}

Option onebit_flat_allgather(Device d) {
  Option o;
  o.compressor = "onebit";
  o.error_feedback = false;
  o.scheme = Scheme::kFlat;
  o.inter = Collective::kAllgather;
  o.comp_device = o.decomp_device = d;
  return o;
}

int index_of(const Problem& p, Option o) {
  // Params/error feedback as the problem enumerates them.
  for (const Option& x : p.options())
    if (x.compressor == o.compressor) {
      o.params = x.params;
      o.error_feedback = x.error_feedback;
      break;
    }
  int i = p.find_option(o);
  EXPECT_GE(i, 0) << o.describe();
  return i;
}

const TraceEvent* find_event(const Timeline& tl, const std::string& tensor,
                             const std::string& what) {
  for (const TraceEvent& e : tl.events)
    if (e.name == tensor && e.what == what) return &e;
  return nullptr;
}

}  // namespace

TEST(Simulator, OverlapWithBackward) {
  // a ready at 100: reduce_scatter 10 + 2000/1000 = 12 us, allgather 12 us.
  Problem p(two_tensors(100, 50), tiny_cluster(), tiny_costs(), CompressorSpec::parse("onebit"));
  Evaluator ev(p);
  const int f = index_of(p, fp32());
  Timeline tl;
  EXPECT_DOUBLE_EQ(ev.evaluate({f, f}, &tl), 174.0);  // b: ready 150, +24
  EXPECT_DOUBLE_EQ(tl.backward_end_us, 150.0);
  EXPECT_DOUBLE_EQ(find_event(tl, "a", "allgather")->end_us, 124.0);
}

TEST(Simulator, BubbleWhenCommunicationQueues) {
  // b is ready at 5 while a occupies the link until 24: b waits (a bubble
  // after the backward pass ends at 5).
  Problem p(two_tensors(0, 5), tiny_cluster(), tiny_costs(), CompressorSpec::parse("onebit"));
  Evaluator ev(p);
  const int f = index_of(p, fp32());
  Timeline tl;
  EXPECT_DOUBLE_EQ(ev.evaluate({f, f}, &tl), 48.0);
  EXPECT_DOUBLE_EQ(find_event(tl, "b", "reduce_scatter")->start_us, 24.0);
}

TEST(Simulator, GpuCompressionDelaysBackward) {
  // a (ready 100): compress on GPU [100,120], allgather 10 + 125/1000 us,
  // decompress its 2 pieces in one kernel [130.125,140.125]. b's 50 us of
  // backward only runs while the GPU is free: [120,130.125] and
  // [140.125,180]. Then FP32: +24.
  Problem p(two_tensors(100, 50), tiny_cluster(), tiny_costs(), CompressorSpec::parse("onebit"));
  Evaluator ev(p);
  Timeline tl;
  const double f = ev.evaluate(
      {index_of(p, onebit_flat_allgather(Device::kCuda)), index_of(p, fp32())}, &tl);
  EXPECT_NEAR(tl.backward_end_us, 180.0, 1e-9);
  EXPECT_NEAR(f, 204.0, 1e-9);
  EXPECT_NEAR(find_event(tl, "a", "decompress")->start_us, 130.125, 1e-9);
}

TEST(Simulator, HostCopiesOnlyWhereRawDataCrosses) {
  // The tiny cluster with GPU<->host copies at 8 Gb/s (1000 bytes/us). a
  // (1000 elements, ready 100) with CPU onebit and a PS alltoall+allgather
  // between the two machines: compress 30 + copy in 4000 bytes 4 =
  // [100,134]; alltoall 10 + 1/2 x 125/1000 [134,144.0625]; the server's
  // decompress (2 pieces x 5) and recompress (30) work on host data, no
  // copies: [144.0625,184.0625]; allgather 10 + 62.5/1000
  // [184.0625,194.125]; decompress 2 x 5 and copy the whole result out
  // (4000 bytes, not one shard's 2000) [194.125,208.125].
  Cluster cl = Cluster::parse("version: 1\nname: tiny\nmachines: 2\ngpus_per_machine: 1\n"
                              "inter: {gbps: 8, latency_us: 10}\nintra: {gbps: 8, latency_us: 10}\n"
                              "cpu_cores: 1\nhost_copy_gbps: 8\n",
                              "tiny.yaml");
  Problem p(two_tensors(100, 50), cl, tiny_costs(), CompressorSpec::parse("onebit"));
  Option o;
  o.compressor = "onebit";
  o.intra = Collective::kReduceScatterAllgather;
  o.inter = Collective::kAlltoallAllgather;
  Evaluator ev(p);
  Timeline tl;
  EXPECT_NEAR(ev.evaluate({index_of(p, o), index_of(p, fp32())}, &tl), 208.125, 1e-9);
  std::vector<std::pair<double, double>> cpu;
  for (const TraceEvent& e : tl.events)
    if (e.name == "a" && e.resource == Resource::kCpu) cpu.push_back({e.start_us, e.end_us});
  using Span = std::vector<std::pair<double, double>>;
  EXPECT_EQ(cpu, (Span{{100, 134}, {144.0625, 154.0625}, {154.0625, 184.0625},
                       {194.125, 208.125}}));
  // Mixed devices: a GPU decompress feeding a CPU recompress copies the
  // shard's sum in (500 elements: 2 us): 30 + 2.
  o.decomp_device = Device::kCuda;
  Timeline t2;
  ev.evaluate({index_of(p, o), index_of(p, fp32())}, &t2);
  std::vector<double> cpu_durations;
  for (const TraceEvent& e : t2.events)
    if (e.name == "a" && e.resource == Resource::kCpu) cpu_durations.push_back(e.end_us - e.start_us);
  EXPECT_EQ(cpu_durations, (std::vector<double>{34, 32}));
}

TEST(Simulator, CpuShareRunsTwoChainsFromTheReadyTime) {
  // a (1000 elements, ready 100) with half its elements on the CPU pool
  // (one core, host copies free) and half on the GPU; onebit costs do not
  // depend on the size. CPU part first: compress [100,130], allgather 10 +
  // 62.5/1000 us [130,140.0625], decompress 2 pieces x 5 [140.0625,150.0625].
  // GPU part from the same ready time: compress [100,120]; its allgather
  // does not fit the idle link before 130, so [140.0625,150.125]; decompress
  // [150.125,160.125]. b's 50 us of backward run in the GPU's idle time:
  // [120,150.125] and [160.125,180]; then FP32 +24.
  Problem p(two_tensors(100, 50), tiny_cluster(), tiny_costs(), CompressorSpec::parse("onebit"));
  Evaluator ev(p);
  const int gpu = index_of(p, onebit_flat_allgather(Device::kCuda));
  const int split = p.split_option(gpu, 0.5);
  ASSERT_GE(split, p.tree_options());
  EXPECT_EQ(p.options()[split].cpu_share, 0.5);
  EXPECT_EQ(p.split_option(gpu, 0.5), split);  // added once
  EXPECT_EQ(p.split_option(index_of(p, fp32()), 0.5), -1);
  EXPECT_EQ(p.split_option(index_of(p, onebit_flat_allgather(Device::kCpu)), 0.5), -1);
  Timeline tl;
  EXPECT_NEAR(ev.evaluate({split, index_of(p, fp32())}, &tl), 204.0, 1e-9);
  EXPECT_NEAR(tl.backward_end_us, 180.0, 1e-9);
  std::vector<std::pair<double, double>> cpu, gpu_ops, link;
  for (const TraceEvent& e : tl.events) {
    if (e.name != "a" || e.compute) continue;
    auto& v = e.resource == Resource::kCpu ? cpu : e.resource == Resource::kGpu ? gpu_ops : link;
    v.push_back({e.start_us, e.end_us});
  }
  using Span = std::vector<std::pair<double, double>>;
  EXPECT_EQ(cpu, (Span{{100, 130}, {140.0625, 150.0625}}));
  EXPECT_EQ(gpu_ops, (Span{{100, 120}, {150.125, 160.125}}));
  EXPECT_EQ(link, (Span{{130, 140.0625}, {140.0625, 150.125}}));
  // The incremental evaluator agrees.
  ev.set_base({gpu, index_of(p, fp32())});
  EXPECT_NEAR(ev.try_option(0, split), 204.0, 1e-9);
  // Without CPU cost figures (or with the CPU forbidden) there is no split.
  Constraints no_cpu;
  no_cpu.allow_cpu = false;
  Problem q(two_tensors(100, 50), tiny_cluster(), tiny_costs(), CompressorSpec::parse("onebit"),
            no_cpu);
  EXPECT_EQ(q.split_option(index_of(q, onebit_flat_allgather(Device::kCuda)), 0.5), -1);
}

namespace {

// One tensor of `elements` ready at 100 us; onebit with costs linear in the
// size (GPU only, so no CPU option exists): compress 10 + 200 us per 2^20
// elements, decompress 10 + 40 us per 2^20 (one batched kernel).
Problem one_linear_tensor(uint64_t elements) {
  std::ostringstream os;
  os << "version: 1\nmodel: one\nforward_us: 0\ntensors:\n"
     << "  - {name: a, elements: " << elements << ", gap_us: 100}\n";
  const CostTable costs = CostTable::parse(R"(version: 1
name: linear
compressors:
  - name: onebit
    bytes_per_element: 0.125
    gpu: {compress: {a_us: 10, b_us_per_melem: 200}, decompress: {a_us: 10, b_us_per_melem: 40}}
)", "linear-costs.yaml");
  return Problem(Profile::parse(os.str(), "one.yaml"), tiny_cluster(), costs,
                 CompressorSpec::parse("onebit"));
}

}  // namespace

TEST(Simulator, PiecesPipelineCompressionWithCommunication) {
  // a: 2^20 elements ready at 100, GPU onebit, flat allgather between the
  // two machines (1000 bytes/us, 10 us per step).
  // Whole: compress 10 + 200 = 210 [100,310]; allgather 10 + 131072/1000
  // [310,451.072]; decompress both pieces of 2^20 in one kernel 10 + 80
  // [451.072,541.072].
  // Two pieces of 2^19: compress 110 each, allgather 10 + 65.536, decompress
  // 2 x 2^19 = 50. Slice 0 compress [100,210]; slice 1's compress is ready
  // at 100 and the GPU is free at 210: [210,320], while slice 0's allgather
  // uses the link [210,285.536]; slice 0's decompress is ready at 285.536,
  // the GPU at 320: [320,370]; slice 1's allgather [320,395.536] and
  // decompress [395.536,445.536]. F = 445.536 (forward 0).
  Problem p = one_linear_tensor(1 << 20);
  Evaluator ev(p);
  const int whole = index_of(p, onebit_flat_allgather(Device::kCuda));
  const int two = p.pieces_option(whole, 2);
  ASSERT_GE(two, p.tree_options());
  EXPECT_EQ(p.options()[two].pieces, 2);
  EXPECT_EQ(p.pieces_option(whole, 2), two);    // added once
  EXPECT_EQ(p.pieces_option(two, 1), whole);    // and back
  EXPECT_EQ(p.pieces_option(whole, 3), -1);
  EXPECT_NEAR(ev.evaluate({whole}), 541.072, 1e-9);
  Timeline tl;
  EXPECT_NEAR(ev.evaluate({two}, &tl), 445.536, 1e-9);
  std::vector<std::pair<double, double>> gpu, link;
  for (const TraceEvent& e : tl.events) {
    if (e.compute) continue;
    (e.resource == Resource::kGpu ? gpu : link).push_back({e.start_us, e.end_us});
  }
  auto near = [](const std::vector<std::pair<double, double>>& got,
                 const std::vector<std::pair<double, double>>& want) {
    if (got.size() != want.size()) return false;
    for (size_t k = 0; k < got.size(); ++k)
      if (std::abs(got[k].first - want[k].first) > 1e-9 ||
          std::abs(got[k].second - want[k].second) > 1e-9)
        return false;
    return true;
  };
  EXPECT_TRUE(near(gpu, {{100, 210}, {210, 320}, {320, 370}, {395.536, 445.536}}));
  EXPECT_TRUE(near(link, {{210, 285.536}, {320, 395.536}}));
  // The chain's latency on idle resources schedules the slices the same way.
  EXPECT_NEAR(chain_latency(p.chain(1 << 20, two)), 345.536, 1e-9);
  // The incremental evaluator agrees.
  ev.set_base({whole});
  EXPECT_NEAR(ev.try_option(0, two), 445.536, 1e-9);
  // Eight pieces pay the fixed costs eight times: compress 8 x (10 + 25)
  // = 280 us of GPU time instead of 210.
  const int eight = p.pieces_option(whole, 8);
  double gpu_time = 0;
  for (const Op& op : p.chain(1 << 20, eight))
    if (!op.fork() && op.resource == Resource::kGpu && std::string(op.what) == "compress")
      gpu_time += op.duration_us;
  EXPECT_NEAR(gpu_time, 280.0, 1e-9);
  // The CPU-runtime search has no pieces (the daemon pipelines by its own
  // partitions).
  Constraints cpu_only;
  cpu_only.cpu_runtime_only = true;
  Problem q(two_tensors(100, 50), tiny_cluster(), tiny_costs(), CompressorSpec::parse("onebit"),
            cpu_only);
  EXPECT_EQ(q.pieces_option(0, 2), -1);
  // It splits compression only, as the CPU runtime executes it (the
  // client's GPU and the daemon's pool, docs/gpu.md §4): an option
  // compressed on the GPU and decompressed by the daemon splits, and the
  // split passes the runtime's check; nothing else does.
  int splits = 0, gpu_cpu = 0;
  for (int i = 0; i < q.tree_options(); ++i) {
    const Option o = q.options()[i];
    const int s = q.split_option(i, 0.25);
    if (o.compressed() && o.comp_device == Device::kCuda && o.decomp_device == Device::kCpu) {
      ++gpu_cpu;
      ASSERT_GE(s, 0) << o.describe();
      EXPECT_EQ(cpu_runtime_unsupported(q.options()[s]), "") << q.options()[s].describe();
      ++splits;
    } else {
      EXPECT_EQ(s, -1) << o.describe();
    }
  }
  EXPECT_GT(gpu_cpu, 0);
  EXPECT_EQ(splits, gpu_cpu);
}

TEST(Search, PicksPiecesOnlyWhenTheyShortenTheIteration) {
  PlanOptions no_pieces;
  no_pieces.pieces_tensors = 0;
  // A large last tensor: its compression and allgather run in series after
  // the backward pass, and two or more slices overlap them.
  {
    Problem p = one_linear_tensor(1 << 20);
    PlanStats st;
    const Assignment a = plan(p, {}, &st);
    Evaluator ev(p);
    const double f = ev.evaluate(a), unpiped = ev.evaluate(plan(p, no_pieces));
    EXPECT_GT(p.options()[a[0]].pieces, 1) << p.options()[a[0]].describe();
    EXPECT_EQ(st.pieced_tensors, 1);
    EXPECT_LT(f, unpiped - 50.0);
  }
  // A small one: fixed costs dominate, every slice would pay them again.
  {
    Problem p = one_linear_tensor(1000);
    PlanStats st;
    const Assignment a = plan(p, {}, &st);
    Evaluator ev(p);
    EXPECT_EQ(p.options()[a[0]].pieces, 1) << p.options()[a[0]].describe();
    EXPECT_EQ(st.pieced_tensors, 0);
    EXPECT_NEAR(ev.evaluate(a), ev.evaluate(plan(p, no_pieces)), 1e-9);
  }
  // Random instances: every tensor cut into pieces makes the plan shorter
  // than the same plan with that tensor in one piece, and the plan is never
  // longer than the planner's without pipelining.
  const CostTable costs = CostTable::load_file(data("profiles/paper-results.yaml"));
  std::mt19937 rng(11);
  int pieced = 0;
  for (int k = 0; k < 30; ++k) {
    Problem p = random_small_problem(rng, costs);
    const Assignment a = plan(p);
    Evaluator ev(p);
    const double f = ev.evaluate(a);
    EXPECT_LE(f, ev.evaluate(plan(p, no_pieces)) + 1e-6);
    for (int i = 0; i < p.tensors(); ++i) {
      if (p.options()[a[i]].pieces == 1) continue;
      ++pieced;
      Assignment one = a;
      one[i] = p.pieces_option(a[i], 1);
      EXPECT_LT(f, ev.evaluate(one) - 1e-6);
    }
  }
  EXPECT_GT(pieced, 0);
}

TEST(Simulator, PsCollectivesPayOneLatencyPerStep) {
  // 4 machines of 1 GPU, 1000 bytes/us, 10 us latency, one tensor of 4000
  // bytes ready at 0. The runtime's reduce-scatter/allgather is a PS push and
  // pull (DESIGN.md section 3): all shards go at once, one latency each:
  // 2 x (10 + 3/4 x 4) = 26. A peer ring allreduce pays M-1 latencies per
  // half: 2 x 3 x 10 + 2 x 3/4 x 4 = 66.
  Cluster c = Cluster::parse("version: 1\nname: four\nmachines: 4\ngpus_per_machine: 1\n"
                             "inter: {gbps: 8, latency_us: 10}\nintra: {gbps: 8, latency_us: 10}\n"
                             "cpu_cores: 1\n", "four.yaml");
  Profile one = Profile::parse(
      "version: 1\nmodel: one\nforward_us: 0\ntensors:\n  - {name: a, elements: 1000, gap_us: 0}\n",
      "one.yaml");
  Problem p(one, c, tiny_costs(), CompressorSpec::parse("onebit"));
  Evaluator ev(p);
  EXPECT_DOUBLE_EQ(ev.evaluate({index_of(p, fp32())}), 26.0);
  Option ring = fp32();
  ring.inter = Collective::kAllreduce;
  EXPECT_DOUBLE_EQ(ev.evaluate({index_of(p, ring)}), 66.0);
}

TEST(Simulator, GpuDecodesTheGatheredPiecesInOneKernel) {
  // The paper's V100 table gives one decode cost for the whole "compress
  // inter-node only" option, which decodes all gathered pieces: the fixed
  // cost a is paid once per collective, the linear part b grows with every
  // element decoded. Here a = 10 us, b = 1 us per element, 2 pieces of 1000:
  // GPU 10 + 2000 (not 2 x 1010); the CPU (a = 50) decodes piece by piece:
  // 2 x 1050.
  CostTable costs = CostTable::parse(R"(version: 1
name: linear
compressors:
  - name: onebit
    bytes_per_element: 0.125
    gpu: {compress: {a_us: 20}, decompress: {a_us: 10, b_us_per_melem: 1048576}}
    cpu: {compress: {a_us: 30}, decompress: {a_us: 50, b_us_per_melem: 1048576}}
)", "linear-costs.yaml");
  Problem p(two_tensors(100, 50), tiny_cluster(1), costs, CompressorSpec::parse("onebit"));
  for (Device d : {Device::kCuda, Device::kCpu}) {
    Evaluator ev(p);
    Timeline tl;
    const int o = index_of(p, onebit_flat_allgather(d));
    ev.evaluate({o, o}, &tl);
    const TraceEvent* e = find_event(tl, "a", "decompress");
    ASSERT_NE(e, nullptr);
    EXPECT_NEAR(e->end_us - e->start_us, d == Device::kCuda ? 2010.0 : 2100.0, 1e-6);
  }
}

TEST(Simulator, CpuCompressionQueuesOnTheCores) {
  // One core: a compresses [0,30], allgathers [30,40.125], decompresses two
  // pieces [40.125,50.125]. b's compression (ready 5, 30 us) does not fit in
  // the 10.125 us hole and waits until 50.125.
  Problem p(two_tensors(0, 5), tiny_cluster(1), tiny_costs(), CompressorSpec::parse("onebit"));
  Evaluator ev(p);
  const int c = index_of(p, onebit_flat_allgather(Device::kCpu));
  Timeline tl;
  ev.evaluate({c, c}, &tl);
  EXPECT_DOUBLE_EQ(find_event(tl, "b", "compress")->start_us, 50.125);
  // Two cores halve each job: a [0,15], [15,25.125], [25.125,30.125]; b's
  // 15 us job does not fit the 10.125 us hole either: 30.125.
  Problem p2(two_tensors(0, 5), tiny_cluster(2), tiny_costs(), CompressorSpec::parse("onebit"));
  Evaluator ev2(p2);
  const int c2 = index_of(p2, onebit_flat_allgather(Device::kCpu));
  Timeline tl2;
  ev2.evaluate({c2, c2}, &tl2);
  EXPECT_DOUBLE_EQ(find_event(tl2, "b", "compress")->start_us, 30.125);
}

TEST(Simulator, ChromeTraceIsValidJson) {
  Problem p(two_tensors(100, 50), tiny_cluster(), tiny_costs(), CompressorSpec::parse("onebit"));
  Evaluator ev(p);
  Timeline tl;
  ev.evaluate({index_of(p, onebit_flat_allgather(Device::kCuda)), index_of(p, fp32())}, &tl);
  YAML::Node j = YAML::Load(tl.chrome_trace_json());
  ASSERT_TRUE(j["traceEvents"].IsSequence());
  int complete = 0;
  for (const auto& e : j["traceEvents"])
    if (e["ph"].as<std::string>() == "X") ++complete;
  EXPECT_EQ(complete, static_cast<int>(tl.events.size()));
  EXPECT_NEAR(j["otherData"]["iteration_us"].as<double>(), 204.0, 1e-6);
}

TEST(Simulator, IncrementalEqualsFullSimulation) {
  Problem p(Profile::load_file(data("profiles/lstm.yaml")), Cluster::load_file(data("clusters/pcie.yaml")),
            CostTable::load_file(data("profiles/paper-results.yaml")), CompressorSpec::parse("efsignsgd"));
  Evaluator ev(p), ref(p);
  ev.set_base(baseline(p, Baseline::kFp32));
  std::mt19937 rng(7);
  for (int step = 0; step < 300; ++step) {
    const int i = rng() % p.tensors();
    int o = rng() % p.tree_options();
    // A third of the edits use pipelined variants (interleaved slices).
    if (rng() % 3 == 0) o = p.pieces_option(o, Option::kAllowedPieces[1 + rng() % 3]);
    ASSERT_GE(o, 0);
    Assignment b = ev.base();
    b[i] = o;
    const double truth = ref.evaluate(b);
    const double base = ev.base_value();
    ASSERT_NEAR(ev.try_option(i, o), truth, 1e-6) << step;
    const double cut = ev.try_option(i, o, base);
    if (truth < base) ASSERT_NEAR(cut, truth, 1e-6) << step;
    else ASSERT_TRUE(cut >= base) << step;
    if (rng() % 3 == 0) ev.commit(i, o);
  }
}

// try_option() with a cutoff first (the bound ends the run), then asked
// again (remembered until a commit), then without a cutoff; every answer
// must agree with a full simulation and with the evaluator whose shortcuts
// are off. Returns the shortcut evaluator's counters.
struct ShortcutCounts {
  int cut_off = 0;
  uint64_t remembered = 0, plain_remembered = 0, shifted = 0;
};
ShortcutCounts check_shortcuts(Problem& p, const Assignment& start, int options, unsigned seed) {
  Evaluator ev(p), plain(p), ref(p);
  plain.set_shortcuts(false);
  ev.set_base(start);
  plain.set_base(ev.base());
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> around(0.97, 1.03);
  ShortcutCounts n;
  int answered = 0;
  for (int step = 0; step < 200; ++step) {
    const int i = rng() % p.tensors();
    const int o = rng() % options;
    Assignment b = ev.base();
    b[i] = o;
    const double truth = ref.evaluate(b);
    const double cutoff = truth * around(rng);
    for (int again = 0; again < 2; ++again) {
      const double v = ev.try_option(i, o, cutoff);
      const double w = plain.try_option(i, o, cutoff);
      if (truth < cutoff) {
        EXPECT_NEAR(v, truth, 1e-6) << step;
        EXPECT_NEAR(w, truth, 1e-6) << step;
      } else {
        EXPECT_TRUE(v >= cutoff) << step;
        EXPECT_TRUE(w >= cutoff) << step;
        n.cut_off += std::isinf(v);
      }
    }
    EXPECT_NEAR(ev.try_option(i, o), truth, 1e-6) << step;
    ++answered;
    if (rng() % 4 == 0) {
      ev.commit(i, o);
      plain.commit(i, o);
    }
  }
  EXPECT_EQ(answered, 200);
  n.remembered = ev.remembered();
  n.plain_remembered = plain.remembered();
  n.shifted = ev.shifted();
  return n;
}

TEST(Simulator, CutoffsAndRememberedAnswersAgreeWithFullSimulation) {
  Problem p(Profile::load_file(data("profiles/bert_base.yaml")),
            Cluster::load_file(data("clusters/pcie.yaml")),
            CostTable::load_file(data("profiles/paper-results.yaml")), CompressorSpec::parse("efsignsgd"));
  const ShortcutCounts n = check_shortcuts(p, baseline(p, Baseline::kFp32), p.tree_options(), 11);
  EXPECT_GT(n.cut_off, 0);             // the bounds did end runs
  EXPECT_GE(n.remembered, 200u);       // every second ask was remembered
  EXPECT_EQ(n.plain_remembered, 0u);
}

TEST(Simulator, ShiftedRestsAgreeWithFullSimulationOnCpuNodes) {
  // What the online planner simulates: CPU nodes whose pool shares the
  // training's cores, colocated servers, 4 MiB partitions. A change whose
  // effect has passed leaves the rest of the timeline the base's shifted
  // (Evaluator::shifted()); at 1 Gbit/s that is most of the answers.
  Cluster c = Cluster::parse(
      "version: 1\nmachines: 4\ncpu_cores: 2\ninter: {gbps: 1, latency_us: 200}\n"
      "cpu_nodes: {pool_threads: 2, reduce: {a_us: 6, b_us_per_melem: 400}}\n"
      "partition_bytes: 4MiB\n",
      "cpu.yaml");
  c.pool_shares_compute = true;
  c.pool_cost_scale = 2;
  c.comm_cpu_us_per_byte = 1e-3;
  for (const char* spec : {"efsignsgd", "dgc:0.01"}) {
    SCOPED_TRACE(spec);
    Problem p(Profile::load_file(data("profiles/bert_base.yaml")), c,
              CostTable::load_file(data("profiles/paper-results.yaml")), CompressorSpec::parse(spec));
    Assignment start = baseline(p, Baseline::kFp32);
    ASSERT_FALSE(start.empty());
    const ShortcutCounts n = check_shortcuts(p, start, p.tree_options(), 5);
    EXPECT_GT(n.cut_off, 0);
    EXPECT_GT(n.shifted, 20u);
  }
}

TEST(Options, CountsAndPruningRules) {
  Constraints c;
  c.include_fp16 = false;
  const CompressorSpec dgc = CompressorSpec::parse("dgc:0.01");
  // Uncompressed: flat 3 collectives + hierarchical 2 divisible intra x 3
  // inter = 9. DGC flat: 3 gathering collectives x 4 device pairs = 12.
  // Hierarchical: (2 raw intra + 2 compressed intra) x 3 inter x 2
  // decompression places x 4 device pairs = 96. Total 117.
  const OptionCount all = count_options(dgc, c, {});
  EXPECT_EQ(all.total, 117u);
  EXPECT_EQ(all.uncompressed, 9u);
  EXPECT_EQ(all.flat, 15u);
  EXPECT_EQ(enumerate_options(dgc, c).size(), all.total);
  const OptionCount none = count_options(dgc, c, {false, false, false});
  const OptionCount r1 = count_options(dgc, c, {true, false, false});
  const OptionCount r2 = count_options(dgc, c, {true, true, false});
  EXPECT_GT(none.total, r1.total);
  EXPECT_GT(r1.total, r2.total);
  EXPECT_GT(r2.total, all.total);
  // R1 removes the 3 extra placements of every flat option: 3 x 4 for none
  // (before R3) and 3 x 12 for dgc.
  EXPECT_EQ(none.total - r1.total, 3u * (3 * 4 + 12));
  // Every enumerated option is a valid strategy option.
  for (const Option& o : enumerate_options(CompressorSpec::parse("randomk:0.01"), Constraints{}))
    EXPECT_EQ(o.problem(), "") << o.describe();
}

TEST(Options, UserConstraints) {
  const CompressorSpec spec = CompressorSpec::parse("topk:0.01");
  Constraints nogpu;
  nogpu.allow_gpu = false;
  for (const Option& o : enumerate_options(spec, nogpu))
    EXPECT_TRUE(!o.compressed() || (o.comp_device == Device::kCpu && o.decomp_device == Device::kCpu));
  Constraints once;
  once.max_compressions = 1;
  auto v = enumerate_options(spec, once);
  EXPECT_LT(v.size(), enumerate_options(spec, Constraints{}).size());
  for (const Option& o : v) EXPECT_LE(compression_ops(o), 1) << o.describe();
  Constraints cpu;
  cpu.cpu_runtime_only = true;
  auto rt = enumerate_options(spec, cpu);
  ASSERT_FALSE(rt.empty());
  for (const Option& o : rt) EXPECT_NE(runtime_inter_mode(o), "") << o.describe();
}

Problem random_instance(std::mt19937& rng, const CostTable& costs) {
  return random_small_problem(rng, costs, 3);
}

TEST(Search, HeuristicVersusExactAndBaselines) {
  const CostTable costs = CostTable::load_file(data("profiles/paper-results.yaml"));
  std::mt19937 rng(42);
  for (int k = 0; k < 8; ++k) {
    Problem p = random_instance(rng, costs);
    double best = 0;
    Assignment ex = exact(p, &best);
    ASSERT_FALSE(ex.empty());
    Evaluator ev(p);
    // The exact solver searches what the planner does before pipelining
    // (Option::pieces, its last step, which only shortens the plan).
    PlanOptions no_pieces;
    no_pieces.pieces_tensors = 0;
    const double unpiped = ev.evaluate(plan(p, no_pieces));
    const double ours = ev.evaluate(plan(p));
    EXPECT_NEAR(ev.evaluate(ex), best, 1e-6);
    EXPECT_LE(best, unpiped + 1e-6);
    EXPECT_LE(ours, unpiped + 1e-6);
    for (Baseline b : kBaselines) {
      Assignment a = baseline(p, b);
      if (a.empty()) continue;
      const double fb = ev.evaluate(a);
      EXPECT_LE(ours, fb + 1e-6) << to_string(b);
      EXPECT_LE(best, fb + 1e-6) << to_string(b);
    }
  }
}

TEST(Search, BranchAndBoundEqualsBruteForce) {
  const CostTable costs = CostTable::load_file(data("profiles/paper-results.yaml"));
  std::mt19937 rng(5);
  for (int k = 0; k < 3; ++k) {
    Problem full = random_instance(rng, costs);
    // Two of the three tensors keep the brute force at 117^2 simulations.
    Profile prof = full.profile();
    prof.tensors.pop_back();
    Problem p(prof, full.cluster(), full.costs(), full.compressor(), full.constraints());
    double best = 0;
    ASSERT_FALSE(exact(p, &best).empty());
    Evaluator ev(p);
    // The exact solver searches the decision tree; its incumbent is the
    // planner's plan without pipelining, which may split a tensor between
    // CPU and GPU (Option::cpu_share, outside the tree).
    const int n = p.tree_options();
    PlanOptions no_pieces;
    no_pieces.pieces_tensors = 0;
    double brute = ev.evaluate(plan(p, no_pieces));
    for (int a = 0; a < n; ++a)
      for (int b = 0; b < n; ++b) brute = std::min(brute, ev.evaluate({a, b}));
    EXPECT_NEAR(brute, best, 1e-6);
  }
}

TEST(Search, PaperWorkloadsBeatEveryBaselineAndRespectTheUpperBound) {
  const CostTable costs = CostTable::load_file(data("profiles/paper-results.yaml"));
  for (auto [model, cluster, comp] : {std::tuple{"vgg16", "pcie", "randomk:0.01"},
                                      std::tuple{"lstm", "pcie", "efsignsgd"},
                                      std::tuple{"gpt2", "nvlink", "efsignsgd"}}) {
    Problem p(Profile::load_file(data(std::string("profiles/") + model + ".yaml")),
              Cluster::load_file(data(std::string("clusters/") + cluster + ".yaml")), costs,
              CompressorSpec::parse(comp));
    PlanStats st;
    Assignment a = plan(p, {}, &st);
    Evaluator ev(p);
    const double ours = ev.evaluate(a);
    for (Baseline b : kBaselines) {
      Assignment ba = baseline(p, b);
      ASSERT_FALSE(ba.empty());
      EXPECT_LE(ours, ev.evaluate(ba) + 1e-6) << model << " " << to_string(b);
    }
    EXPECT_GE(ours, ev.lower_bound() - 1e-6);
    // LSTM's last gradient (the 50M-element embedding) is ready when the
    // backward pass ends, so its shortest chain is exposed whatever the
    // plan: without pipelining the plan meets that bound over the decision
    // tree, and its gap to the Upper Bound is the cost of compressing that
    // tensor (docs/planner.md). Pipelining that chain (Option::pieces)
    // shortens the plan below the tree's bound.
    if (std::string(model) == "lstm") {
      Problem q(p.profile(), p.cluster(), costs, CompressorSpec::parse(comp));
      Evaluator evq(q);
      const double tree_bound = evq.lower_bound();  // before any pieces option exists
      PlanOptions no_pieces;
      no_pieces.pieces_tensors = 0;
      const double unpiped = evq.evaluate(plan(q, no_pieces));
      EXPECT_NEAR(unpiped, tree_bound, 1e-6);
      EXPECT_LT(ours, unpiped - 1000.0);
      EXPECT_GE(st.pieced_tensors, 1);
    }
    EXPECT_LE(upper_bound_us(p), ours + 1e-6) << model;
    EXPECT_GT(st.simulations, 0u);
  }
}

TEST(Search, RefinementSplitsALargeTensorBetweenCpuAndGpu) {
  // UGATIT + DGC (docs/planner.md): the two 1 GiB FC weights' GPU
  // compression stretches the backward pass; moving all of one to the CPU
  // pool finishes too late, a share of it does not.
  const CostTable costs = CostTable::load_file(data("profiles/paper-results.yaml"));
  Problem p(Profile::load_file(data("profiles/ugatit.yaml")),
            Cluster::load_file(data("clusters/nvlink.yaml")), costs,
            CompressorSpec::parse("dgc:0.01"));
  PlanStats st;
  Assignment a = plan(p, {}, &st);
  EXPECT_GE(st.split_tensors, 1);
  Evaluator ev(p);
  const double f = ev.evaluate(a);
  int split = 0;
  for (int i = 0; i < p.tensors(); ++i) {
    Option o = p.options()[a[i]];
    if (o.cpu_share == 0.0) continue;
    ++split;
    EXPECT_GT(o.cpu_share, 0.0);
    EXPECT_LT(o.cpu_share, 1.0);
    // Neither the unsplit option nor moving the whole tensor to the CPU
    // does as well.
    Assignment whole = a, cpu = a;
    o.cpu_share = 0.0;
    whole[i] = p.find_option(o);
    o.comp_device = o.decomp_device = Device::kCpu;
    cpu[i] = p.find_option(o);
    ASSERT_GE(whole[i], 0);
    ASSERT_GE(cpu[i], 0);
    EXPECT_LT(f, ev.evaluate(whole) - 1000.0) << p.profile().tensors[i].name;
    EXPECT_LT(f, ev.evaluate(cpu) - 1000.0) << p.profile().tensors[i].name;
  }
  EXPECT_GE(split, 1);
  // The strategy carries the split and the CPU runtime refuses it by name.
  const Strategy s = Strategy::parse(to_strategy(p, a).to_yaml(), "ugatit.yaml");
  std::vector<TensorDecl> decl;
  for (const auto& t : p.profile().tensors) decl.push_back({t.name, 4 * t.elements});
  EXPECT_NO_THROW(s.check(decl));
  // The split tensors first: the daemon's check names the first tensor it
  // cannot run.
  std::vector<TensorDecl> split_decl;
  for (const Entry& e : s.entries())
    if (e.option.cpu_share > 0.0) split_decl.push_back({e.tensor, 1u << 30});
  ASSERT_FALSE(split_decl.empty());
  for (const Entry& e : s.entries())
    if (e.option.cpu_share == 0.0) split_decl.push_back({e.tensor, 4});
  try {
    s.check_cpu_runtime(split_decl);
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("cpu_share"), std::string::npos) << e.what();
  }
}

TEST(Inputs, ProfileErrors) {
  auto err = [](const std::string& text) {
    try {
      Profile::parse(text, "p.yaml");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(err("version: 1\nmodel: m\n").find("tensors"), std::string::npos);
  EXPECT_NE(err("version: 1\nmodel: m\ntensors: []\n").find("at least one"), std::string::npos);
  std::string e = err("version: 1\nmodel: m\ntensors:\n  - {name: a, elements: 0, gap_us: 1}\n");
  EXPECT_NE(e.find("p.yaml:4"), std::string::npos) << e;
  EXPECT_NE(e.find("tensors[0].elements"), std::string::npos) << e;
  e = err("version: 1\nmodel: m\ntensors:\n  - {name: a, elements: 4, gap_us: -1}\n");
  EXPECT_NE(e.find("gap_us"), std::string::npos) << e;
  e = err("version: 1\nmodel: m\ntensors:\n  - {name: a, elements: 4}\n");
  EXPECT_NE(e.find("gap_us"), std::string::npos) << e;
  EXPECT_NO_THROW(Profile::load_file(data("profiles/resnet101.yaml")));
  EXPECT_EQ(Profile::load_file(data("profiles/resnet101.yaml")).tensors.size(), 314u);
}

TEST(Inputs, ClusterErrors) {
  auto err = [](const std::string& text) {
    try {
      Cluster::parse(text, "c.yaml");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(err("version: 1\ngpus_per_machine: 8\n").find("machines"), std::string::npos);
  EXPECT_NE(err("version: 1\nmachines: 0\ngpus_per_machine: 8\n").find("out of range"),
            std::string::npos);
  EXPECT_NE(err("version: 1\nmachines: 2\ngpus_per_machine: 8\ninter: {gbps: 0}\n").find("inter.gbps"),
            std::string::npos);
  EXPECT_NE(err("version: 1\nmachines: 2\ngpus_per_machine: 8\nservers: {placement: dedicated}\n")
                .find("count"),
            std::string::npos);
  EXPECT_NE(err("version: 1\nmachines: 2\ngpus_per_machine: 8\nservers: {placement: cloud}\n")
                .find("colocated"),
            std::string::npos);
  EXPECT_NE(err("version: 1\nmachines: 2\ngpus_per_machine: 8\nnics: 2\n").find("unknown key 'nics'"),
            std::string::npos);
}

TEST(Inputs, CostTablesAndConverter) {
  const CostTable v100 = CostTable::load_file(data("profiles/paper-results.yaml"));
  ASSERT_NE(v100.find("randomk"), nullptr);
  ASSERT_NE(v100.find("fp16"), nullptr);
  // randomk: total 88 us, decode 34 us per 2^20-element shard.
  EXPECT_DOUBLE_EQ(v100.find("randomk")->gpu->compress.at(1 << 20), 54.0);
  EXPECT_DOUBLE_EQ(v100.find("randomk")->gpu->decompress.at(1 << 21), 68.0);
  EXPECT_DOUBLE_EQ(v100.find("randomk")->gpu->decompress.at(10), 34.0);
  EXPECT_DOUBLE_EQ(v100.find("randomk")->bytes_per_element, 0.08);
  // Round trip through the costs format.
  const CostTable back = CostTable::parse(v100.to_yaml(), "back.yaml");
  EXPECT_DOUBLE_EQ(back.find("dgc")->gpu->compress.at(3 << 20), v100.find("dgc")->gpu->compress.at(3 << 20));
  // Google Benchmark JSON: 1 ms at 2^20 and 21 ms at 2^20 * 21 elements ->
  // b = 1 ms per 2^20 elements, a = 0; threads:2 ignored; medians preferred.
  const char* json = R"({"context": {}, "benchmarks": [
    {"name": "BM_Compress/topk/1048576", "run_type": "iteration", "real_time": 1000000, "time_unit": "ns"},
    {"name": "BM_Compress/topk/22020096", "run_type": "iteration", "real_time": 21000, "time_unit": "us"},
    {"name": "BM_Compress/topk/22020096/threads:2", "run_type": "iteration", "real_time": 1, "time_unit": "us"},
    {"name": "BM_Decompress/topk/1048576_median", "run_name": "BM_Decompress/topk/1048576", "run_type": "aggregate", "aggregate_name": "median", "real_time": 110, "time_unit": "us"},
    {"name": "BM_Decompress/topk/1048576_mean", "run_name": "BM_Decompress/topk/1048576", "run_type": "aggregate", "aggregate_name": "mean", "real_time": 999, "time_unit": "us"},
    {"name": "BM_Memcpy/1048576", "run_type": "iteration", "real_time": 50, "time_unit": "us"}
  ]})";
  const CostTable t = CostTable::from_compress_bench_json(json, "bench.json");
  ASSERT_NE(t.find("topk"), nullptr);
  EXPECT_NEAR(t.find("topk")->cpu->compress.b_us_per_melem, 1000.0, 1e-9);
  EXPECT_NEAR(t.find("topk")->cpu->compress.a_us, 0.0, 1e-9);
  EXPECT_NEAR(t.find("topk")->cpu->decompress.at(1 << 20), 110.0, 1e-9);
  EXPECT_DOUBLE_EQ(t.find("topk")->bytes_per_element, 0.08);
  EXPECT_FALSE(t.find("topk")->gpu.has_value());
  auto err = [](auto fn) {
    try {
      fn();
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(err([] { CostTable::from_compress_bench_json("{not json", "b.json"); }).find("b.json"),
            std::string::npos);
  EXPECT_NE(err([] { CostTable::from_compress_bench_json("{}", "b.json"); }).find("benchmarks"),
            std::string::npos);
  EXPECT_NE(err([] {
              CostTable::from_compress_bench_json(
                  R"({"benchmarks":[{"name":"BM_Compress/topk/1024","real_time":5,"time_unit":"us"}]})",
                  "b.json");
            }).find("no BM_Decompress"),
            std::string::npos);
  EXPECT_NE(err([] { CostTable::parse("version: 1\ncompressors:\n  - {name: zip}\n", "c.yaml"); })
                .find("compressors[0].name"),
            std::string::npos);
  EXPECT_NE(err([] { CostTable::parse("version: 1\ncompressors:\n  - {name: topk}\n", "c.yaml"); })
                .find("gpu and/or cpu"),
            std::string::npos);
}

TEST(Inputs, CompressorSpec) {
  EXPECT_EQ(CompressorSpec::parse("randomk:0.01").params.at("ratio"), "0.01");
  EXPECT_EQ(CompressorSpec::parse("qsgd:16").params.at("levels"), "16");
  EXPECT_EQ(CompressorSpec::parse("dgc:ratio=0.05,momentum=0.9").params.at("momentum"), "0.9");
  EXPECT_THROW(CompressorSpec::parse("zip"), Error);
  EXPECT_THROW(CompressorSpec::parse("none"), Error);
  EXPECT_THROW(CompressorSpec::parse("randomk:2"), Error);
  EXPECT_THROW(CompressorSpec::parse("randomk:ratio="), Error);
  // A table without the compressor is refused with its name.
  try {
    Problem p(two_tensors(1, 1), tiny_cluster(), tiny_costs(), CompressorSpec::parse("topk:0.01"));
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("topk"), std::string::npos);
  }
}

TEST(Cli, PlansWritesAStrategyTheDaemonAcceptsAndATrace) {
  const std::string dir = std::filesystem::temp_directory_path() /
                          ("bc_plan_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::ostringstream out, err;
  const std::vector<std::string> args = {
      "--profile", data("profiles/vgg16.yaml"), "--cluster", data("clusters/pcie.yaml"),
      "--compressor", "randomk:0.01", "--runtime", "cpu", "--out", dir + "/s.yaml",
      "--trace", dir + "/t.json", "--json"};
  ASSERT_EQ(run_cli(args, out, err), 0) << err.str();
  YAML::Node j = YAML::Load(out.str());
  EXPECT_EQ(j["tensors"].as<int>(), 32);
  EXPECT_GT(j["speedup_over_fp32"]["ours"].as<double>(), 1.0);
  Strategy s = Strategy::load_file(dir + "/s.yaml");
  std::vector<TensorDecl> decl;
  for (const auto& t : Profile::load_file(data("profiles/vgg16.yaml")).tensors)
    decl.push_back({t.name, 4 * t.elements});
  EXPECT_NO_THROW(s.check_cpu_runtime(decl));
  EXPECT_TRUE(YAML::LoadFile(dir + "/t.json")["traceEvents"].IsSequence());
  std::filesystem::remove_all(dir);
}

TEST(Cli, PlansForCpuNodesWithoutGpuTerms) {
  const std::string dir = std::filesystem::temp_directory_path() /
                          ("bc_plan_cpu_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  {
    std::ofstream c(dir + "/cpu.yaml");
    c << "version: 1\nmachines: 4\ncpu_cores: 2\ninter: {gbps: 0.1, latency_us: 200}\n"
         "cpu_nodes: {pool_threads: 2, reduce: {a_us: 6, b_us_per_melem: 400}}\n"
         "partition_bytes: 4MiB\n";
  }
  const Cluster cl = Cluster::load_file(dir + "/cpu.yaml");
  EXPECT_TRUE(cl.cpu_nodes);
  EXPECT_EQ(cl.pool_threads, 2);
  EXPECT_EQ(cl.reduce.b_us_per_melem, 400);
  std::ostringstream out, err;
  ASSERT_EQ(run_cli({"--profile", data("profiles/lstm.yaml"), "--cluster", dir + "/cpu.yaml",
                     "--compressor", "randomk:0.01", "--out", dir + "/s.yaml", "--json"},
                    out, err),
            0)
      << err.str();
  YAML::Node j = YAML::Load(out.str());
  EXPECT_GT(j["speedup_over_fp32"]["ours"].as<double>(), 1.0);  // 0.1 Gbit/s: compression pays
  Strategy s = Strategy::load_file(dir + "/s.yaml");
  std::vector<TensorDecl> decl;
  for (const auto& t : Profile::load_file(data("profiles/lstm.yaml")).tensors)
    decl.push_back({t.name, 4 * t.elements});
  EXPECT_NO_THROW(s.check_cpu_runtime(decl));
  // GPU terms in a CPU-node cluster are refused, located.
  try {
    Cluster::parse("version: 1\nmachines: 2\ngpus_per_machine: 1\ncpu_nodes: {}\n", "c.yaml");
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("c.yaml:3:"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cpu_nodes"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(Cli, ErrorsNameWhatIsWrong) {
  auto run = [](std::vector<std::string> args) {
    std::ostringstream out, err;
    const int rc = run_cli(args, out, err);
    return std::pair{rc, err.str()};
  };
  auto [rc, e] = run({"--cluster", "c.yaml", "--compressor", "topk"});
  EXPECT_EQ(rc, 1);
  EXPECT_NE(e.find("--profile"), std::string::npos);
  std::tie(rc, e) = run({"--profile", "/nonexistent.yaml", "--cluster", "c", "--compressor", "topk"});
  EXPECT_NE(e.find("/nonexistent.yaml"), std::string::npos);
  std::tie(rc, e) = run({"--bogus"});
  EXPECT_NE(e.find("--bogus"), std::string::npos);
  std::tie(rc, e) = run({"count", "--compressor", "dgc:0.01", "--runtime", "gpu"});
  EXPECT_NE(e.find("accepted: any, cpu"), std::string::npos);
  std::tie(rc, e) = run({});
  EXPECT_EQ(rc, 2);
  std::ostringstream out, err;
  EXPECT_EQ(run_cli({"count", "--compressor", "dgc:0.01", "--no-fp16", "--json"}, out, err), 0);
  EXPECT_EQ(YAML::Load(out.str())["pruned"].as<int>(), 117);
}

TEST(Cli, PaperAndConverter) {
  std::ostringstream out, err;
  ASSERT_EQ(run_cli({"paper", "--json"}, out, err), 0) << err.str();
  YAML::Node j = YAML::Load(out.str());
  ASSERT_EQ(j["workloads"].size(), 6u);
  for (const auto& w : j["workloads"]) {
    const double ours = w["predicted"]["espresso"].as<double>();
    EXPECT_GT(w["published"]["espresso"].as<double>(), 1.0);
    for (const char* b : {"byteps_compress", "hitopkcomm", "hipress"})
      EXPECT_GE(ours + 1e-9, w["predicted"][b].as<double>()) << w["workload"].as<std::string>();
    EXPECT_LE(ours, w["predicted"]["upper_bound"].as<double>() + 1e-9);
  }
  const std::string dir = std::filesystem::temp_directory_path() /
                          ("bc_conv_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir + "/b.json");
    f << R"({"benchmarks":[
      {"name":"BM_Compress/qsgd/1048576","real_time":2000,"time_unit":"us"},
      {"name":"BM_Compress/qsgd/25000000","real_time":47684,"time_unit":"us"},
      {"name":"BM_Decompress/qsgd/1048576","real_time":1000,"time_unit":"us"},
      {"name":"BM_Decompress/qsgd/25000000","real_time":23842,"time_unit":"us"}]})";
  }
  std::ostringstream o2, e2;
  ASSERT_EQ(run_cli({"convert-bench", dir + "/b.json", "--out", dir + "/c.yaml"}, o2, e2), 0)
      << e2.str();
  const CostTable t = CostTable::load_file(dir + "/c.yaml");
  ASSERT_NE(t.find("qsgd"), nullptr);
  EXPECT_NEAR(t.find("qsgd")->cpu->compress.at(25000000), 47684, 1.0);
  // s=16: 33 signed levels need 6 bits per element.
  EXPECT_NEAR(t.find("qsgd")->bytes_per_element, 6.0 / 8.0, 1e-12);
  // The converted table plans (CPU only).
  std::ostringstream o3, e3;
  EXPECT_EQ(run_cli({"--profile", data("profiles/lstm.yaml"), "--cluster", data("clusters/pcie.yaml"),
                     "--compressor", "qsgd:16", "--costs", dir + "/c.yaml", "--json"},
                    o3, e3),
            0)
      << e3.str();
  EXPECT_GT(YAML::Load(o3.str())["speedup_over_fp32"]["ours"].as<double>(), 0.0);
  std::filesystem::remove_all(dir);
}
