#include "planner/strategy/profile.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <set>

#include "common/config.h"
#include "common/error.h"
#include "compress/compressor.h"

namespace bytecomp::strategy {

using config::Document;
using config::Range;
using config::Reader;

namespace {

constexpr double kMelem = 1048576.0;

void emit_fit(YAML::Emitter& out, const char* key, const LinearFit& f) {
  out << YAML::Key << key << YAML::Value << YAML::Flow << YAML::BeginMap << YAML::Key << "a_us"
      << YAML::Value << f.a_us << YAML::Key << "b_us_per_melem" << YAML::Value
      << f.b_us_per_melem << YAML::Key << "samples" << YAML::Value << f.samples
      << YAML::EndMap;
}

LinearFit read_fit(Reader& parent, const char* key) {
  LinearFit f;
  Reader r = parent.section(key);
  r.get("a_us", f.a_us, Range<double>{0, 1e12})
      .get("b_us_per_melem", f.b_us_per_melem, Range<double>{0, 1e12})
      .get("samples", f.samples);
  r.finish();
  return f;
}

void emit_measure(YAML::Emitter& out, const CompressorMeasure& c) {
  out << YAML::BeginMap << YAML::Key << "spec" << YAML::Value << YAML::DoubleQuoted << c.spec;
  emit_fit(out, "compress", c.compress);
  emit_fit(out, "decompress", c.decompress);
  out << YAML::Key << "bytes_per_element" << YAML::Value << c.bytes_per_element;
  out << YAML::Key << "fixed_bytes" << YAML::Value << c.fixed_bytes;
  out << YAML::EndMap;
}

CompressorMeasure read_measure(Reader& r) {
  CompressorMeasure c;
  r.require("spec");
  r.get("spec", c.spec);
  try {
    (void)compress::parse_compressor_spec(c.spec);
  } catch (const Error& e) {
    r.fail("spec", e.what());
  }
  c.compress = read_fit(r, "compress");
  c.decompress = read_fit(r, "decompress");
  r.get("bytes_per_element", c.bytes_per_element, Range<double>{0, 64})
      .get("fixed_bytes", c.fixed_bytes, Range<double>{0, 1e9});
  r.finish();
  return c;
}

}  // namespace

// ---------------------------------------------------------------- fits

double LinearFit::at(double elements) const {
  return std::max(0.0, a_us + b_us_per_melem * elements / kMelem);
}

LinearFit fit_linear(const std::vector<std::pair<double, double>>& points) {
  LinearFit f;
  f.samples = static_cast<uint32_t>(points.size());
  if (points.empty()) return f;
  const double n = static_cast<double>(points.size());
  double sx = 0, sy = 0;
  for (const auto& [x, y] : points) {
    sx += x;
    sy += y;
  }
  const double mx = sx / n, my = sy / n;
  double sxx = 0, sxy = 0;
  for (const auto& [x, y] : points) {
    sxx += (x - mx) * (x - mx);
    sxy += (x - mx) * (y - my);
  }
  // Fewer than two distinct x: no slope to fit. The threshold is relative
  // so that x values differing only by rounding count as one.
  if (!(sxx > 1e-12 * std::max(1.0, mx * mx) * n)) {
    f.a_us = my;
    return f;
  }
  const double b = sxy / sxx;  // microseconds per element
  // A cost is never negative: noisy timings (a loaded machine) can tilt the
  // free fit below zero, so fall back to the closest non-negative line.
  if (b < 0) {
    f.a_us = std::max(0.0, my);
    return f;
  }
  if (my - b * mx < 0) {
    double sxx0 = 0, sxy0 = 0;
    for (const auto& [x, y] : points) {
      sxx0 += x * x;
      sxy0 += x * y;
    }
    f.b_us_per_melem = std::max(0.0, sxy0 / sxx0) * kMelem;
    return f;
  }
  f.b_us_per_melem = b * kMelem;
  f.a_us = my - b * mx;
  return f;
}

// ---------------------------------------------------------------- profile

std::string NodeProfile::to_yaml() const {
  YAML::Emitter out;
  out.SetDoublePrecision(17);
  out << YAML::BeginMap;
  out << YAML::Key << "version" << YAML::Value << 1;
  out << YAML::Key << "node_rank" << YAML::Value << node_rank;
  out << YAML::Key << "local_ranks" << YAML::Value << local_ranks;
  out << YAML::Key << "pool_threads" << YAML::Value << pool_threads;
  out << YAML::Key << "cpu_cores" << YAML::Value << cpu_cores;
  out << YAML::Key << "first_iteration" << YAML::Value << first_iteration;
  out << YAML::Key << "iterations" << YAML::Value << iterations;
  out << YAML::Key << "iteration_us" << YAML::Value << iteration_us;
  out << YAML::Key << "link_gbps" << YAML::Value << link_gbps;
  out << YAML::Key << "link_latency_us" << YAML::Value << link_latency_us;
  emit_fit(out, "reduce", reduce);
  out << YAML::Key << "tensors" << YAML::Value << YAML::BeginSeq;
  for (const TensorMeasure& t : tensors) {
    out << YAML::Flow << YAML::BeginMap << YAML::Key << "name" << YAML::Value
        << YAML::DoubleQuoted << t.name << YAML::Key << "elements" << YAML::Value << t.elements
        << YAML::Key << "ready_us" << YAML::Value << t.ready_us << YAML::EndMap;
  }
  out << YAML::EndSeq;
  out << YAML::Key << "compressors" << YAML::Value << YAML::BeginSeq;
  for (const CompressorMeasure& c : compressors) emit_measure(out, c);
  out << YAML::EndSeq;
  emit_text(out, "current_strategy", current_strategy_yaml);
  out << YAML::Key << "train_cpu_us" << YAML::Value << train_cpu_us;
  out << YAML::Key << "daemon_cpu_us" << YAML::Value << daemon_cpu_us;
  out << YAML::Key << "host_cpu_us" << YAML::Value << host_cpu_us;
  out << YAML::Key << "host" << YAML::Value << YAML::DoubleQuoted << host;
  out << YAML::Key << "nodes_on_host" << YAML::Value << nodes_on_host;
  if (!gpu_note.empty() || !gpu_compressors.empty()) {
    out << YAML::Key << "gpu_note" << YAML::Value << YAML::DoubleQuoted << gpu_note;
    out << YAML::Key << "gpu_compressors" << YAML::Value << YAML::BeginSeq;
    for (const CompressorMeasure& c : gpu_compressors) emit_measure(out, c);
    out << YAML::EndSeq;
  }
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

NodeProfile NodeProfile::parse(std::string_view text, std::string name) {
  Document doc = Document::parse(text, std::move(name));
  Reader root = doc.root("");
  NodeProfile p;
  root.require("iteration_us").require("tensors");
  root.get("node_rank", p.node_rank)
      .get("local_ranks", p.local_ranks, Range<uint32_t>{1, 4096})
      .get("pool_threads", p.pool_threads, Range<uint32_t>{1, 4096})
      .get("cpu_cores", p.cpu_cores, Range<uint32_t>{1, 65536})
      .get("first_iteration", p.first_iteration)
      .get("iterations", p.iterations)
      .get("iteration_us", p.iteration_us, Range<double>{0, 1e12})
      .get("link_gbps", p.link_gbps, Range<double>{0, 1e6})
      .get("link_latency_us", p.link_latency_us, Range<double>{0, 1e9})
      .get("current_strategy", p.current_strategy_yaml)
      .get("train_cpu_us", p.train_cpu_us, Range<double>{0, 1e12})
      .get("daemon_cpu_us", p.daemon_cpu_us, Range<double>{0, 1e12})
      .get("host_cpu_us", p.host_cpu_us, Range<double>{0, 1e12})
      .get("host", p.host)
      .get("nodes_on_host", p.nodes_on_host, Range<uint32_t>{1, 65536});
  if (!(p.iteration_us > 0)) root.fail("iteration_us", "must be positive", "> 0");
  p.reduce = read_fit(root, "reduce");
  std::set<std::string> names;
  for (Reader& r : root.list("tensors")) {
    TensorMeasure t;
    r.require("name").require("elements").require("ready_us");
    r.get("name", t.name)
        .get("elements", t.elements, Range<uint64_t>{1, 1ull << 40})
        .get("ready_us", t.ready_us, Range<double>{0, 1e12});
    if (t.name.empty()) r.fail("name", "empty tensor name");
    if (!names.insert(t.name).second) r.fail("name", "tensor '" + t.name + "' is listed twice");
    r.finish();
    p.tensors.push_back(std::move(t));
  }
  if (p.tensors.empty()) root.fail("tensors", "a profile needs at least one tensor");
  for (Reader& r : root.list("compressors")) p.compressors.push_back(read_measure(r));
  root.get("gpu_note", p.gpu_note);
  for (Reader& r : root.list("gpu_compressors")) p.gpu_compressors.push_back(read_measure(r));
  root.finish();
  return p;
}

GpuReport parse_gpu_report(std::string_view text, std::string name) {
  Document doc = Document::parse(text, std::move(name));
  Reader root = doc.root("");
  GpuReport g;
  root.require("note");
  root.get("note", g.note);
  if (g.note.empty()) root.fail("note", "empty: say what was measured or why not");
  std::set<std::string> specs;
  for (Reader& r : root.list("compressors")) {
    CompressorMeasure c;
    r.require("spec").require("points");
    r.get("spec", c.spec);
    try {
      (void)compress::parse_compressor_spec(c.spec);
    } catch (const Error& e) {
      r.fail("spec", e.what());
    }
    if (!specs.insert(c.spec).second) r.fail("spec", "'" + c.spec + "' is listed twice");
    std::vector<std::pair<double, double>> cp, dp, wire;
    for (Reader& q : r.list("points")) {
      double n = 0, cu = 0, du = 0, bytes = 0;
      q.require("n").require("compress_us").require("decompress_us").require("bytes");
      q.get("n", n, Range<double>{1, 1e12})
          .get("compress_us", cu, Range<double>{0, 1e12})
          .get("decompress_us", du, Range<double>{0, 1e12})
          .get("bytes", bytes, Range<double>{0, 1e13});
      q.finish();
      cp.emplace_back(n, cu);
      dp.emplace_back(n, du);
      wire.emplace_back(n, bytes);
    }
    if (cp.empty()) r.fail("points", "no measurement");
    c.compress = fit_linear(cp);
    c.decompress = fit_linear(dp);
    const LinearFit w = fit_linear(wire);  // as measure_compressor(): bytes = a + b * n / 2^20
    c.bytes_per_element = std::min(64.0, std::max(0.0, w.b_us_per_melem / 1048576.0));
    c.fixed_bytes = std::min(1e9, std::max(0.0, w.a_us));
    r.finish();
    g.compressors.push_back(std::move(c));
  }
  root.finish();
  return g;
}

// ---------------------------------------------------------------- text

void emit_text(YAML::Emitter& out, const char* key, const std::string& text) {
  out << YAML::Key << key << YAML::Value;
  // A literal block keeps the text readable and exact when it ends with one
  // newline; anything else is quoted.
  const bool literal = !text.empty() && text.back() == '\n' &&
                       (text.size() < 2 || text[text.size() - 2] != '\n') &&
                       text.find('\t') == std::string::npos && text.front() != ' ';
  if (literal) out << YAML::Literal << text;
  else out << YAML::DoubleQuoted << text;
}

}  // namespace bytecomp::strategy
