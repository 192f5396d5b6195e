// CONTRACT COPY (lead's worktree only; replaced by the online branch's header at merge).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>
#include "planner/strategy/strategy.h"
namespace bytecomp::planner::online {
struct LinearFit { double a_us = 0; double b_us_per_melem = 0; uint32_t samples = 0;
                   double at(double elements) const; };
LinearFit fit_linear(const std::vector<std::pair<double, double>>& points);
struct TensorMeasure { std::string name; uint64_t elements = 0; double ready_us = 0; };
struct CompressorMeasure { std::string spec; LinearFit compress, decompress;
                           double bytes_per_element = 4, fixed_bytes = 0; };
struct NodeProfile {
  uint32_t node_rank = 0, local_ranks = 1, pool_threads = 1, cpu_cores = 1;
  uint64_t first_iteration = 0, iterations = 0;
  double iteration_us = 0;
  std::vector<TensorMeasure> tensors;
  LinearFit reduce;
  std::vector<CompressorMeasure> compressors;
  double link_gbps = 0, link_latency_us = 0;
  std::string current_strategy_yaml;
  std::string to_yaml() const;
  static NodeProfile parse(std::string_view text, std::string name);
};
NodeProfile merge(const std::vector<NodeProfile>& nodes);
struct AutoConfig {
  std::vector<std::string> compressors;
  std::vector<std::string> exclude;
  uint64_t min_compress_bytes = 1 << 20;
  uint32_t nodes = 1, servers = 1; bool colocated_servers = true;
  uint64_t partition_bytes = 4 << 20;
};
struct Alternative { std::string name; double predicted_us = 0; std::string strategy_yaml; };
struct TensorChoice { std::string name; uint64_t bytes = 0; std::string option; bool excluded = false; };
struct Decision {
  Strategy strategy;
  double predicted_us = 0, measured_us = 0, decision_ms = 0;
  std::vector<Alternative> alternatives;
  std::vector<TensorChoice> tensors;
  std::string timeline_json;
  std::string to_yaml() const;
  static Decision parse(std::string_view text, std::string name);
  std::string explain() const;
};
Decision decide(const NodeProfile& merged, const AutoConfig& cfg);
}  // namespace bytecomp::planner::online
