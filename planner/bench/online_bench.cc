// Decision time of the online planner (issue 13: <= 10 ms inside the
// coordinator) on synthetic node profiles: ResNet-18 (its 62 parameter
// tensors, planner/profiles/online/resnet18.yaml), a 12-layer Transformer
// (BERT-base's 199 tensors, planner/profiles/bert_base.yaml) and an LSTM LM
// (planner/profiles/lstm.yaml), 4 nodes with colocated servers, efsignsgd
// and topk:0.01 accepted, at 0.1, 1 and 10 Gbit/s.
//
//   online_bench [--benchmark_filter=...]   (BYTECOMP_PLANNER_DATA: the
//   folder holding profiles/, default the source tree's planner/)
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "planner/model.h"
#include "planner/online.h"

#ifndef BYTECOMP_PLANNER_DATADIR
#define BYTECOMP_PLANNER_DATADIR "planner"
#endif

namespace {

using namespace bytecomp::planner;

std::string data_dir() {
  const char* env = std::getenv("BYTECOMP_PLANNER_DATA");
  return env && *env ? env : BYTECOMP_PLANNER_DATADIR;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot read");
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

online::NodeProfile resnet18() {
  const std::string path = data_dir() + "/profiles/online/resnet18.yaml";
  return online::NodeProfile::parse(slurp(path), path);
}

// A node profile from a planner profile (backward order, GPU gaps): the
// declaration order is the reverse of the backward order, ready times are
// the GPU ones slowed down 10x (CPU training), the costs ResNet-18's.
online::NodeProfile from_profile(const std::string& name) {
  const Profile p = Profile::load_file(data_dir() + "/profiles/" + name + ".yaml");
  online::NodeProfile n = resnet18();
  n.tensors.clear();
  double t = 10 * p.forward_or_default_us();
  for (const TensorProfile& tp : p.tensors) {
    t += 10 * tp.gap_us;
    n.tensors.push_back({tp.name, tp.elements, t});
  }
  std::reverse(n.tensors.begin(), n.tensors.end());
  n.iteration_us = 1.5 * t;
  return n;
}

void run(benchmark::State& state, const online::NodeProfile& base) {
  online::NodeProfile p = base;
  p.link_gbps = static_cast<double>(state.range(0)) / 10.0;
  online::AutoConfig cfg;
  cfg.compressors = {"efsignsgd", "topk:0.01"};
  cfg.nodes = cfg.servers = 4;
  double ms = 0, predicted_ms = 0;
  size_t compressed = 0;
  for (auto _ : state) {
    const online::Decision d = online::decide(p, cfg);
    ms = d.decision_ms;
    predicted_ms = d.predicted_us / 1e3;
    compressed = 0;
    for (const auto& e : d.strategy.entries()) compressed += e.option.compressed();
    benchmark::DoNotOptimize(d.predicted_us);
  }
  state.counters["decision_ms"] = ms;
  // The decision's predicted iteration: what a faster search must not lose.
  state.counters["predicted_ms"] = predicted_ms;
  state.counters["tensors"] = static_cast<double>(p.tensors.size());
  state.counters["compressed"] = static_cast<double>(compressed);
}

void BM_Decide_ResNet18(benchmark::State& s) {
  static const online::NodeProfile p = resnet18();
  run(s, p);
}
void BM_Decide_Transformer(benchmark::State& s) {
  static const online::NodeProfile p = from_profile("bert_base");
  run(s, p);
}
void BM_Decide_LSTM(benchmark::State& s) {
  static const online::NodeProfile p = from_profile("lstm");
  run(s, p);
}

// Argument: link rate in tenths of a Gbit/s.
BENCHMARK(BM_Decide_ResNet18)->Arg(1)->Arg(10)->Arg(100)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Decide_Transformer)->Arg(1)->Arg(10)->Arg(100)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Decide_LSTM)->Arg(1)->Arg(10)->Arg(100)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
