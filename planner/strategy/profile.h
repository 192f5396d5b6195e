// What a node measured during a window of iterations: the contract between
// the daemon that measures it (daemon/auto_tuner.h) and the online planner
// that decides from it (planner/online.h, in the coordinator), sent as YAML
// in kAutoProfile beside the AutoSpec (auto_spec.h). It lives in the
// strategy library, not in the planner, so that the daemon links the
// contract without the planner's model and searches (issue 24).
//
// Units: microseconds (_us), elements are fp32 elements, bytes are bytes,
// link rates gigabits per second.
//
// Thread-safety: plain values and pure functions.
#pragma once

#include <yaml-cpp/emitter.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace bytecomp::strategy {

// cost(n) = a_us + b_us_per_melem * n / 2^20 microseconds, never below 0.
struct LinearFit {
  double a_us = 0;
  double b_us_per_melem = 0;
  uint32_t samples = 0;  // points the fit was made from
  double at(double elements) const;
};

// Least squares of (elements, microseconds) points. With fewer than two
// distinct x values: a = mean of the times, b = 0. Empty: all zero. Never
// negative: a negative slope gives a = mean, b = 0; a negative intercept the
// least-squares line through the origin.
LinearFit fit_linear(const std::vector<std::pair<double, double>>& points);

struct TensorMeasure {
  std::string name;
  uint64_t elements = 0;  // fp32 elements
  // Median over the window of the time since iteration start at which every
  // local rank had submitted this gradient (push arrival at the daemon).
  double ready_us = 0;
};

struct CompressorMeasure {
  std::string spec;  // as the user wrote it: "efsignsgd", "topk:0.01"
  // One compress / decompress call of n elements on one pool thread of this
  // node.
  LinearFit compress, decompress;
  // Measured wire size: fixed_bytes + bytes_per_element * n.
  double bytes_per_element = 4, fixed_bytes = 0;
};

struct NodeProfile {
  uint32_t node_rank = 0, local_ranks = 1, pool_threads = 1, cpu_cores = 1;
  uint64_t first_iteration = 0, iterations = 0;  // the measured window
  double iteration_us = 0;                       // median measured iteration time
  std::vector<TensorMeasure> tensors;            // the job's declaration order (NOT ready order)
  LinearFit reduce;                              // intra-node sum of one partition, this node
  std::vector<CompressorMeasure> compressors;
  double link_gbps = 0, link_latency_us = 0;     // node<->servers probe; 0 = unknown
  std::string current_strategy_yaml;             // what ran during the window ("" = uncompressed)
  // CPU time (user + system) one local rank's process spent per iteration
  // of the window (mean over the ranks); 0 = unknown.
  double train_cpu_us = 0;
  // CPU time the daemon's process spent per iteration of the window (its
  // engine, pool and transport threads); 0 = unknown.
  double daemon_cpu_us = 0;
  // CPU time the whole host spent per iteration of the window, all cores
  // and every process (/proc/stat: user, nice, system, irq, softirq,
  // steal): the job's training processes, daemons and servers on this host
  // and whatever else runs there; 0 = unknown (profiles before it was
  // measured read as unknown).
  double host_cpu_us = 0;
  // The host's identity (its boot id): nodes with the same one share its
  // cores (an emulated cluster, or several daemons on one machine); "" =
  // unknown, counted as a host of its own.
  std::string host;
  // Set by the planner's merge() (planner/online.h): the most nodes of the
  // job on one host (1 for profiles that were not merged).
  uint32_t nodes_on_host = 1;
  // The CUDA compressors as this node's training process measured them on
  // its GPU through libbytecomp_gpu (bytecomp.torch, docs/gpu.md §4): one
  // call of n elements on the device (compress, decompress), the payload
  // size. Reported to the daemon (`gpu_profile`, parse_gpu_report below).
  // Written only when reported; the online planner does not use them yet
  // (its runtime constraints keep every option on the CPU pool).
  std::vector<CompressorMeasure> gpu_compressors;
  // "" = no report; else what the report said ("measured on <device>",
  // "skipped: <why>").
  std::string gpu_note;

  // Versioned YAML (version: 1): the keys are the field names, except
  // current_strategy (for current_strategy_yaml, a string); fits are
  // {a_us, b_us_per_melem, samples}; tensors and compressors are lists of
  // mappings (planner/profiles/online/resnet18.yaml is an example).
  // parse(to_yaml()) gives back an equal profile.
  std::string to_yaml() const;
  // Throws config::ConfigError located at file:line:col with the key path
  // for malformed or out-of-range items (`name` stands for the file).
  static NodeProfile parse(std::string_view text, std::string name);
};

// What a training process measured of the CUDA compressors (the daemon's
// `gpu_profile JOB TEXT` request, bytecomp/gpu_profile.py):
//   version: 1
//   note: "measured on NVIDIA H200"     # or "skipped: <why>"
//   compressors:
//     - spec: efsignsgd
//       points: [{n: 1048576, compress_us: 21.0, decompress_us: 9.5, bytes: 131084}, ...]
// Each compressor's points are fitted (fit_linear) as measure_compressor()
// does the CPU's. Throws config::ConfigError naming the key for a malformed
// report (`name` stands for the file).
struct GpuReport {
  std::string note;
  std::vector<CompressorMeasure> compressors;
};
GpuReport parse_gpu_report(std::string_view text, std::string name);

// Writes `text` (a strategy file, a Chrome trace) as the value of `key` in
// the emitter's open mapping: a literal block where that keeps it exact and
// readable (one trailing newline, no tab, no leading space), double-quoted
// otherwise. The profile's current_strategy and the planner's decision
// record (planner/online.h Decision::to_yaml) embed their texts this way.
void emit_text(YAML::Emitter& out, const char* key, const std::string& text);

}  // namespace bytecomp::strategy
