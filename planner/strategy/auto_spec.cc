#include "planner/strategy/auto_spec.h"

#include <fnmatch.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>

#include <sstream>

#include "compress/compressor.h"
#include "planner/strategy/strategy.h"

namespace bytecomp::strategy {

AutoSpec AutoSpec::read(config::Reader& s) {
  AutoSpec a;
  s.get("compressors", a.compressors)
      .get("exclude", a.exclude)
      .get_bytes("min_compress_bytes", a.min_compress_bytes, config::Range<uint64_t>{0, 1ull << 40})
      .get("min_gain", a.min_gain, config::Range<double>{0.0, 0.9})
      .get("warmup_iterations", a.warmup_iterations, config::Range<uint32_t>{1, 1000})
      .get("skip_iterations", a.skip_iterations, config::Range<uint32_t>{0, 1000})
      .get("plan_timeout_ms", a.plan_timeout_ms, config::Range<uint32_t>{10, 600000})
      .get("colocated_servers", a.colocated_servers);
  for (const std::string& c : a.compressors) {
    try {
      const compress::CompressorSpec spec = compress::parse_compressor_spec(c);
      if (spec.name == "none")
        s.fail("compressors", "'none' is always a candidate", "compressor specs such as efsignsgd, topk:0.01");
      (void)compress::make_compressor(spec);
    } catch (const config::ConfigError&) {
      throw;
    } catch (const Error& e) {
      s.fail("compressors", "'" + c + "': " + e.what(),
             "compressor specs such as efsignsgd, topk:0.01, fp16 (bytecomp-plan compressors lists them)");
    }
  }
  for (const std::string& g : a.exclude)
    if (g.empty()) s.fail("exclude", "an empty pattern", "fnmatch globs of tensor names");
  config::Reader r = s.section("replan");
  r.get("drift", a.replan_drift, config::Range<double>{0.01, 10.0})
      .get("iterations", a.replan_iterations, config::Range<uint32_t>{1, 10000})
      .get("min_interval", a.replan_min_interval, config::Range<uint32_t>{1, 1000000})
      .get("max", a.replan_max, config::Range<uint32_t>{1, 1000})
      .get("per", a.replan_per, config::Range<uint32_t>{1, 100000000});
  r.finish();
  config::Reader g = s.section("guard");
  g.get_bytes("min_bytes", a.guards.min_bytes, config::Range<uint64_t>{0, 1ull << 40})
      .get("names", a.guards.names)
      .get("output_layer", a.guards.output_layer);
  for (const std::string& n : a.guards.names)
    if (n.empty())
      g.fail("names", "an empty pattern",
             "fnmatch globs of tensor names (guard: {names: []} turns the name guard off)");
  g.finish();
  config::Reader l = s.section("loss_guard");
  l.get("enabled", a.loss_guard)
      .get("window", a.loss_window, config::Range<uint32_t>{2, 100000})
      .get("tolerance", a.loss_tolerance, config::Range<double>{0.0, 100.0});
  l.finish();
  return a;
}

std::optional<AutoSpec> AutoSpec::parse_job_text(std::string_view text, std::string name) {
  // A strategy file has no `mode` key; look before the full (versioned) read
  // so that a strategy's own errors keep coming from its parser.
  YAML::Node probe;
  try {
    probe = YAML::Load(std::string(text));
  } catch (const YAML::Exception&) {
    return std::nullopt;  // the strategy parser reports the syntax error
  }
  if (!probe.IsMap() || !probe["mode"]) return std::nullopt;
  config::Document doc = config::Document::parse(text, std::move(name));
  config::Reader root = doc.root("");
  std::string mode;
  root.get_enum("mode", mode, {"auto"});
  AutoSpec a = read(root);
  root.finish();
  return a;
}

namespace {
std::string quoted_list(const std::vector<std::string>& v) {
  YAML::Emitter e;
  e << YAML::Flow << YAML::BeginSeq;
  for (const std::string& s : v) e << YAML::DoubleQuoted << s;
  e << YAML::EndSeq;
  return e.c_str();
}
}  // namespace

std::string AutoSpec::to_yaml() const {
  std::ostringstream o;
  o.precision(17);
  o << "version: 1\nmode: auto\n"
    << "compressors: " << quoted_list(compressors) << "\n"
    << "exclude: " << quoted_list(exclude) << "\n"
    << "min_compress_bytes: " << min_compress_bytes << "\n"
    << "min_gain: " << min_gain << "\n"
    << "warmup_iterations: " << warmup_iterations << "\n"
    << "skip_iterations: " << skip_iterations << "\n"
    << "plan_timeout_ms: " << plan_timeout_ms << "\n"
    << "colocated_servers: " << (colocated_servers ? "true" : "false") << "\n"
    << "replan: {drift: " << replan_drift << ", iterations: " << replan_iterations
    << ", min_interval: " << replan_min_interval << ", max: " << replan_max
    << ", per: " << replan_per << "}\n"
    << "guard: {min_bytes: " << guards.min_bytes << ", names: " << quoted_list(guards.names)
    << ", output_layer: " << (guards.output_layer ? "true" : "false") << "}\n"
    << "loss_guard: {enabled: " << (loss_guard ? "true" : "false") << ", window: " << loss_window
    << ", tolerance: " << loss_tolerance << "}\n";
  return o.str();
}

std::string guard_reason(const AccuracyGuards& guards, const std::vector<std::string>& names,
                         const std::vector<uint64_t>& elements, size_t index) {
  const std::string& name = names.at(index);
  for (const std::string& g : guards.names)
    if (fnmatch(g.c_str(), name.c_str(), 0) == 0) return "guard: name matches '" + g + "'";
  if (guards.output_layer && !names.empty()) {
    // The output layer: the module of the last-declared tensor (frameworks
    // declare parameters in definition order, the classifier last).
    auto module_of = [](const std::string& n) {
      const size_t dot = n.rfind('.');
      return dot == std::string::npos ? n : n.substr(0, dot);
    };
    const std::string last = module_of(names.back());
    if (module_of(name) == last) return "guard: output layer '" + last + "'";
  }
  const uint64_t bytes = 4 * elements.at(index);
  if (bytes < guards.min_bytes)
    return "guard: " + std::to_string(bytes) + " B < min_bytes " +
           std::to_string(guards.min_bytes) + " B";
  return "";
}

std::string start_strategy_yaml(const AutoSpec& spec, const std::vector<std::string>& names,
                                const std::vector<uint64_t>& elements, uint32_t nodes,
                                uint64_t partition_bytes) {
  if (nodes < 2 || names.size() != elements.size()) return "";
  Option ring;
  ring.inter = Collective::kAllreduce;
  Strategy s;
  s.set_default(Option{});
  size_t on_ring = 0;
  for (size_t t = 0; t < names.size(); ++t) {
    bool excluded = false;
    for (const std::string& g : spec.exclude)
      excluded = excluded || fnmatch(g.c_str(), names[t].c_str(), 0) == 0;
    const bool never_compressed =
        spec.compressors.empty() || excluded || !guard_reason(spec.guards, names, elements, t).empty();
    if (!never_compressed || elements[t] == 0) continue;
    // The smallest partition of the tensor decides (its last one).
    const uint64_t bytes = 4 * elements[t];
    const uint64_t part = partition_bytes == 0 ? bytes : std::min(bytes, partition_bytes);
    const uint64_t last = partition_bytes == 0 || bytes % partition_bytes == 0 || bytes < partition_bytes
                              ? part
                              : bytes % partition_bytes;
    if (nodes > 2 && std::min(part, last) < kRingStartMinBytes) continue;
    s.add_entry({names[t], ring});
    ++on_ring;
  }
  if (on_ring == 0) return "";
  s.meta["written_by"] = "bytecompd auto (start placement)";
  s.meta["ring_tensors"] = std::to_string(on_ring);
  return s.to_yaml();
}

}  // namespace bytecomp::strategy
