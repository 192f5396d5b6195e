#include "planner/model.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "common/config.h"
#include "common/error.h"
#include "compress/catalogue.h"

namespace bytecomp::planner {

using config::ConfigError;
using config::Document;
using config::Range;
using config::Reader;

namespace {

constexpr double kMelem = 1048576.0;

std::string read_text(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(path + ": cannot open " + what);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

YAML::Node child(const YAML::Node& n, const char* key) {
  if (!n.IsDefined() || !n.IsMap()) return YAML::Node();
  YAML::Node c = n[key];
  if (!c.IsDefined()) return YAML::Node();
  return c;
}

// Reader cannot enumerate keys; the raw tree of the same text names them.
std::map<std::string, std::string> read_params(Reader& parent, const YAML::Node& raw) {
  std::map<std::string, std::string> out;
  Reader pr = parent.section("params");
  if (YAML::Node pn = child(raw, "params"); pn.IsMap()) {
    for (const auto& kv : pn) {
      std::string key = kv.first.Scalar(), value;
      if (!kv.second.IsScalar()) pr.fail(key, "expected a scalar value", "number or string");
      pr.get(key, value);
      out[key] = value;
    }
  }
  pr.finish();
  return out;
}

LinearCost read_linear(Reader r) {
  LinearCost c;
  r.get("a_us", c.a_us, Range<double>{0, 1e9})
      .get("b_us_per_melem", c.b_us_per_melem, Range<double>{0, 1e9})
      .get("floor_us", c.floor_us, Range<double>{0, 1e9});
  r.finish();
  return c;
}

std::optional<DeviceCost> read_device(Reader& parent, const char* key) {
  if (!parent.has(key)) {
    parent.section(key);  // mark seen
    return std::nullopt;
  }
  Reader r = parent.section(key);
  r.require("compress").require("decompress");
  DeviceCost d{read_linear(r.section("compress")), read_linear(r.section("decompress"))};
  r.finish();
  return d;
}

const std::vector<std::string>& catalogue_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const auto& e : compress::catalogue()) n.emplace_back(e.name);
    return n;
  }();
  return names;
}

double param_double(const std::map<std::string, std::string>& p, const char* key, double def) {
  auto it = p.find(key);
  if (it == p.end()) return def;
  try {
    return std::stod(it->second);
  } catch (const std::exception&) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string("parameter '") + key + "' is not a number: '" + it->second + "'");
  }
}

void emit_linear(YAML::Emitter& out, const char* key, const LinearCost& c) {
  out << YAML::Key << key << YAML::Value << YAML::Flow << YAML::BeginMap << YAML::Key
      << "a_us" << YAML::Value << c.a_us << YAML::Key << "b_us_per_melem" << YAML::Value
      << c.b_us_per_melem << YAML::Key << "floor_us" << YAML::Value << c.floor_us
      << YAML::EndMap;
}

}  // namespace

double Profile::backward_us() const {
  double t = 0;
  for (const auto& x : tensors) t += x.gap_us;
  return t;
}

double Profile::forward_or_default_us() const {
  return forward_us ? *forward_us : 0.5 * backward_us();
}

Profile Profile::parse(std::string_view text, std::string name) {
  Document doc = Document::parse(text, std::move(name));
  Reader root = doc.root("");
  Profile p;
  std::string ignored;
  root.require("model").require("tensors").get("model", p.model)
      .get("workload", ignored).get("device", ignored);
  if (root.has("forward_us")) {
    double f = 0;
    root.get("forward_us", f, Range<double>{0, 1e9});
    p.forward_us = f;
  }
  for (Reader& r : root.list("tensors")) {
    TensorProfile t;
    r.require("name").require("elements").require("gap_us");
    r.get("name", t.name).get("elements", t.elements, Range<uint64_t>{1, 1ull << 40})
        .get("gap_us", t.gap_us, Range<double>{0, 1e9});
    if (t.name.empty()) r.fail("name", "empty tensor name");
    r.finish();
    p.tensors.push_back(std::move(t));
  }
  if (p.tensors.empty()) root.fail("tensors", "a profile needs at least one tensor");
  root.finish();
  return p;
}

Profile Profile::load_file(const std::string& path) {
  return parse(read_text(path, "profile"), path);
}

Cluster Cluster::parse(std::string_view text, std::string name) {
  Document doc = Document::parse(text, std::move(name));
  Reader root = doc.root("");
  Cluster c;
  // CPU-only nodes (the CPU runtime) have no GPU terms at all.
  c.cpu_nodes = root.has("cpu_nodes");
  root.require("machines");
  if (!c.cpu_nodes) root.require("gpus_per_machine");
  if (c.cpu_nodes) {
    for (const char* gpu_only : {"gpus_per_machine", "intra", "host_copy_gbps"})
      if (root.has(gpu_only))
        root.fail(gpu_only, "a cluster of cpu_nodes has no GPUs and no intra-node link",
                  "remove the key, or the cpu_nodes section");
    Reader n = root.section("cpu_nodes");
    n.get("pool_threads", c.pool_threads, Range<int>{1, 4096});
    Reader r = n.section("reduce");
    r.get("a_us", c.reduce.a_us, Range<double>{0, 1e9})
        .get("b_us_per_melem", c.reduce.b_us_per_melem, Range<double>{0, 1e12});
    r.finish();
    n.finish();
  }
  root.get("name", c.name)
      .get("machines", c.machines, Range<int>{1, 100000})
      .get("gpus_per_machine", c.gpus_per_machine, Range<int>{1, 1024})
      .get("cpu_cores", c.cpu_cores, Range<int>{0, 4096})
      .get("host_copy_gbps", c.host_copy_gbps, Range<double>{0, 1e6})
      .get_bytes("partition_bytes", c.partition_bytes);
  for (const char* key : {"intra", "inter"}) {
    if (c.cpu_nodes && std::string(key) == "intra") continue;
    Reader l = root.section(key);
    Link& link = std::string(key) == "intra" ? c.intra : c.inter;
    l.get("gbps", link.gbps, Range<double>{0.001, 1e6})
        .get("latency_us", link.latency_us, Range<double>{0, 1e6});
    l.finish();
  }
  Reader s = root.section("servers");
  std::string placement = "colocated";
  s.get_enum("placement", placement, {"colocated", "dedicated"})
      .get("count", c.servers, Range<int>{0, 100000})
      .get("gbps", c.server_gbps, Range<double>{0.001, 1e6});
  c.dedicated_servers = placement == "dedicated";
  if (c.dedicated_servers && c.servers == 0)
    s.fail("count", "dedicated servers need a count", "1 or more");
  s.finish();
  if (c.partition_bytes != 0 && c.partition_bytes < 4096)
    root.fail("partition_bytes", "partitions below 4 KiB make no sense", "0 or >= 4KiB");
  // The ring and push/pull's measured link shares (model.h; the keys are
  // optional: without them the links are ideal).
  Reader ring = root.section("ring");
  ring.get_bytes("chunk_bytes", c.ring_chunk_bytes)
      .get("hop_us", c.ring_hop_us, Range<double>{0, 1e6})
      .get("link_share", c.ring_link_share, Range<double>{0.01, 1});
  if (c.ring_chunk_bytes < 64 || c.ring_chunk_bytes > (1u << 20))
    ring.fail("chunk_bytes", "the daemons' ring chunks are 64 B to 1 MiB", "64..1MiB");
  ring.finish();
  Reader ps = root.section("push_pull");
  ps.get("overhead", c.ps_overhead, Range<double>{0, 100})
      .get("fanin_overhead", c.ps_fanin_overhead, Range<double>{0, 100});
  ps.finish();
  root.finish();
  return c;
}

double Cluster::ps_link_share() const {
  const double M = std::max(2, machines);
  return 1.0 / (1.0 + ps_overhead + ps_fanin_overhead * std::log2(M / 2.0));
}

double Cluster::ring_us(double bytes) const {
  const int M = machines;
  if (M <= 1 || bytes <= 0) return 0;
  const double B = inter.bytes_per_us() * ring_link_share;
  const double hop = ring_hop_us > 0 ? ring_hop_us : inter.latency_us;
  const double seg = bytes / M;
  const double chunk = std::min(seg, static_cast<double>(ring_chunk_bytes));
  // Each of the 2(M-1) steps sends one segment; its first chunk can go
  // only once the previous step's first chunk arrived (a chunk's bytes plus
  // the hop), and with several chunks per segment the node keeps sending
  // the previous step's chunks meanwhile.
  return 2.0 * (M - 1) * std::max(seg / B, chunk / B + hop);
}

double Cluster::ps_step_us(double bytes, double remote) const {
  return inter.latency_us + remote * bytes / (inter.bytes_per_us() * ps_link_share());
}

Cluster Cluster::load_file(const std::string& path) {
  return parse(read_text(path, "cluster file"), path);
}

double LinearCost::at(double elements) const {
  return std::max(floor_us, a_us + b_us_per_melem * elements / kMelem);
}

const CompressorCost* CostTable::find(const std::string& n) const {
  auto it = compressors.find(n);
  return it == compressors.end() ? nullptr : &it->second;
}

CostTable CostTable::parse(std::string_view text, std::string name) {
  YAML::Node raw;
  try {
    raw = YAML::Load(std::string(text));
  } catch (const YAML::Exception&) {
  }
  if (child(raw, "gpu_compression_cost_us_v100").IsMap())
    return from_paper_results(text, name);
  Document doc = Document::parse(text, name);
  Reader root = doc.root("");
  CostTable t;
  root.get("name", t.name);
  std::vector<Reader> list = root.list("compressors");
  YAML::Node raw_list = child(raw, "compressors");
  for (size_t i = 0; i < list.size(); ++i) {
    Reader& r = list[i];
    CompressorCost c;
    r.require("name").get_enum("name", c.name, catalogue_names());
    c.params = read_params(r, raw_list.IsSequence() && i < raw_list.size() ? raw_list[i]
                                                                           : YAML::Node());
    c.bytes_per_element = default_bytes_per_element(c.name, c.params);
    r.get("error_feedback", c.error_feedback)
        .get("bytes_per_element", c.bytes_per_element, Range<double>{0, 8})
        .get("fixed_bytes", c.fixed_bytes, Range<double>{0, 1e9});
    c.gpu = read_device(r, "gpu");
    c.cpu = read_device(r, "cpu");
    if (!c.gpu && !c.cpu) r.fail("", "a compressor needs gpu and/or cpu costs");
    r.finish();
    if (t.compressors.count(c.name)) r.fail("name", "compressor '" + c.name + "' listed twice");
    t.compressors[c.name] = std::move(c);
  }
  root.finish();
  if (t.compressors.empty()) root.fail("compressors", "no compressor in the table");
  return t;
}

CostTable CostTable::load_file(const std::string& path) {
  return parse(read_text(path, "costs file"), path);
}

CostTable CostTable::from_paper_results(std::string_view text, std::string name) {
  Document doc = Document::parse(text, name);  // syntax errors with location
  doc.root("");                                 // version check
  YAML::Node root = YAML::Load(std::string(text));
  YAML::Node gpu = child(root, "gpu_compression_cost_us_v100");
  YAML::Node art = child(root, "artifact_cost_model");
  if (!gpu.IsMap() || !art.IsMap())
    throw ConfigError(name + ": expected sections gpu_compression_cost_us_v100 and "
                             "artifact_cost_model");
  auto num = [&](const YAML::Node& n, const std::string& what) -> double {
    try {
      return n.as<double>();
    } catch (const YAML::Exception&) {
      throw ConfigError(name + ": " + what + " is not a number");
    }
  };
  // The artifact assumed a fixed CPU compression throughput per worker (one
  // per GPU); a machine of 8 workers with 16 spare cores has two cores per
  // worker, so one core delivers half of it.
  const double cpu_gbps = num(child(art, "cpu_compression_gbps"), "cpu_compression_gbps");
  const double per_core = (kMelem * 4.0) / (cpu_gbps * 1e3 / 8.0) * 2.0;
  CostTable t;
  t.name = "v100-paper";
  auto add = [&](const std::string& comp, double total, double decode,
                 std::map<std::string, std::string> params, bool ef) {
    CompressorCost c;
    c.name = comp;
    c.params = std::move(params);
    c.error_feedback = ef;
    c.bytes_per_element = default_bytes_per_element(comp, c.params);
    // The paper's sparsified size counts values and indices: 2 x ratio x
    // bytes, also for randomk (whose indices this runtime does not send).
    if (const auto* e = compress::find_compressor(comp); e != nullptr && e->has_param("ratio"))
      c.bytes_per_element = 2.0 * param_double(c.params, "ratio", 0.01) * 4.0;
    const double enc = std::max(0.0, total - decode);
    c.gpu = DeviceCost{{0, enc, enc}, {0, decode, decode}};
    c.cpu = DeviceCost{{20, per_core, 0}, {20, per_core, 0}};
    t.compressors[comp] = std::move(c);
  };
  for (const auto& kv : gpu) {
    const std::string comp = kv.first.Scalar();
    YAML::Node total = child(kv.second, "total"), decode = child(kv.second, "decode");
    if (!total.IsSequence() || !decode.IsSequence() || total.size() < 3 || decode.size() < 3)
      throw ConfigError(name + ": gpu_compression_cost_us_v100." + comp +
                        " needs total and decode lists of 4 figures");
    if (comp == "randomk" || comp == "dgc")
      add(comp, num(total[2], comp), num(decode[2], comp), {{"ratio", "0.01"}}, true);
    else
      add(comp, num(total[2], comp), num(decode[2], comp), {}, true);
    if (!t.compressors.count("fp16"))
      add("fp16", num(total[1], "fp16"), num(decode[1], "fp16"), {}, false);
  }
  return t;
}

CostTable CostTable::from_compress_bench_json(std::string_view json, std::string name) {
  YAML::Node root;
  try {
    root = YAML::Load(std::string(json));  // JSON is YAML
  } catch (const YAML::Exception& e) {
    throw ConfigError(name + ":" + std::to_string(e.mark.line + 1) + ": not valid JSON: " +
                      e.msg);
  }
  YAML::Node list = child(root, "benchmarks");
  if (!list.IsSequence())
    throw ConfigError(name + ": no 'benchmarks' list (expected --benchmark_format=json output)");
  // (op, compressor) -> n -> time in microseconds
  std::map<std::pair<std::string, std::string>, std::map<double, double>> times;
  for (const auto& b : list) {
    std::string bname = child(b, "name").IsScalar() ? child(b, "name").Scalar() : "";
    if (YAML::Node rt = child(b, "run_type"); rt.IsScalar() && rt.Scalar() == "aggregate") {
      YAML::Node an = child(b, "aggregate_name");
      if (!an.IsScalar() || an.Scalar() != "median") continue;
      bname = child(b, "run_name").IsScalar() ? child(b, "run_name").Scalar() : bname;
    }
    std::vector<std::string> parts;
    std::stringstream ss(bname);
    for (std::string p; std::getline(ss, p, '/');) parts.push_back(p);
    if (parts.size() < 3) continue;
    if (parts[0] != "BM_Compress" && parts[0] != "BM_Decompress") continue;
    bool other_threads = false;
    for (size_t i = 3; i < parts.size(); ++i)
      if (parts[i].rfind("threads:", 0) == 0 && parts[i] != "threads:1") other_threads = true;
    if (other_threads) continue;
    double n = 0, t = 0;
    try {
      n = std::stod(parts[2]);
      t = child(b, "real_time").as<double>();
    } catch (const std::exception&) {
      throw ConfigError(name + ": benchmark '" + bname + "' has no usable size or real_time");
    }
    std::string unit = child(b, "time_unit").IsScalar() ? child(b, "time_unit").Scalar() : "ns";
    const double scale = unit == "ns" ? 1e-3 : unit == "us" ? 1.0 : unit == "ms" ? 1e3
                         : unit == "s" ? 1e6 : -1;
    if (scale < 0) throw ConfigError(name + ": benchmark '" + bname + "' has time_unit " + unit);
    if (n <= 0) throw ConfigError(name + ": benchmark '" + bname + "' has size " + parts[2]);
    // Medians win over single runs of the same name.
    times[{parts[0], parts[1]}][n] = t * scale;
  }
  auto fit = [](const std::map<double, double>& pts) {
    LinearCost c;
    if (pts.empty()) return c;
    auto lo = *pts.begin(), hi = *pts.rbegin();
    if (pts.size() == 1 || hi.first == lo.first) {
      c.b_us_per_melem = lo.second / lo.first * kMelem;
      return c;
    }
    const double b = std::max(0.0, (hi.second - lo.second) / (hi.first - lo.first));
    c.b_us_per_melem = b * kMelem;
    c.a_us = std::max(0.0, lo.second - b * lo.first);
    return c;
  };
  CostTable t;
  t.name = "compress_bench";
  for (const auto& [key, pts] : times) {
    if (key.first != "BM_Compress") continue;
    auto dit = times.find({"BM_Decompress", key.second});
    if (dit == times.end())
      throw ConfigError(name + ": BM_Compress/" + key.second + " has no BM_Decompress");
    CompressorCost c;
    c.name = key.second;
    const compress::CatalogueEntry* entry = compress::find_compressor(c.name);
    if (entry == nullptr) continue;
    // compress_bench runs each compressor at its defaults: the primary
    // parameter when it sizes the wire (ratio, levels) goes in the table.
    for (const compress::ParamDef& p : entry->params)
      if (p.positional && p.sizes_wire) c.params[p.name] = p.default_value;
    // It measures them with their error-feedback update where their default
    // state carries a residual.
    c.error_feedback = compress::make_compressor({c.name, {}})->make_state(1)->has_residual();
    c.bytes_per_element = default_bytes_per_element(c.name, c.params);
    c.cpu = DeviceCost{fit(pts), fit(dit->second)};
    t.compressors[c.name] = std::move(c);
  }
  if (t.compressors.empty())
    throw ConfigError(name + ": no BM_Compress/<name>/<n> benchmarks of a known compressor");
  return t;
}

std::string CostTable::to_yaml() const {
  YAML::Emitter out;
  out << YAML::BeginMap << YAML::Key << "version" << YAML::Value << 1;
  out << YAML::Key << "name" << YAML::Value << name;
  out << YAML::Key << "compressors" << YAML::Value << YAML::BeginSeq;
  for (const auto& [n, c] : compressors) {
    out << YAML::BeginMap << YAML::Key << "name" << YAML::Value << n;
    if (!c.params.empty()) {
      out << YAML::Key << "params" << YAML::Value << YAML::Flow << YAML::BeginMap;
      for (const auto& [k, v] : c.params) out << YAML::Key << k << YAML::Value << YAML::DoubleQuoted << v;
      out << YAML::EndMap;
    }
    out << YAML::Key << "error_feedback" << YAML::Value << c.error_feedback;
    out << YAML::Key << "bytes_per_element" << YAML::Value << c.bytes_per_element;
    out << YAML::Key << "fixed_bytes" << YAML::Value << c.fixed_bytes;
    for (auto [key, d] : {std::pair{"gpu", &c.gpu}, std::pair{"cpu", &c.cpu}}) {
      if (!*d) continue;
      out << YAML::Key << key << YAML::Value << YAML::BeginMap;
      emit_linear(out, "compress", (*d)->compress);
      emit_linear(out, "decompress", (*d)->decompress);
      out << YAML::EndMap;
    }
    out << YAML::EndMap;
  }
  out << YAML::EndSeq << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

double default_bytes_per_element(const std::string& c,
                                 const std::map<std::string, std::string>& p) {
  if (c == "none") return 4;
  const compress::CatalogueEntry* e = compress::find_compressor(c);
  if (e == nullptr) throw Error(ErrorCode::kInvalidArgument, "unknown compressor '" + c + "'");
  // Defaults, then the table's values of what sizes the wire (other keys are
  // the table's business, not validated here).
  compress::ParamValues v = compress::param_values({c, {}});
  for (const compress::ParamDef& d : e->params)
    if (d.sizes_wire) v.v[d.name] = param_double(p, d.name, v[d.name]);
  return e->bytes_per_element(v);
}

CompressorSpec CompressorSpec::parse(const std::string& text) {
  CompressorSpec s;
  const size_t colon = text.find(':');
  s.name = text.substr(0, colon);
  if (s.name.empty() || s.name == "none")
    throw Error(ErrorCode::kInvalidArgument,
                "--compressor '" + text + "': give a compressor name, e.g. randomk:0.01");
  const compress::CatalogueEntry* entry = compress::find_compressor(s.name);
  if (entry == nullptr)
    throw Error(ErrorCode::kInvalidArgument,
                "--compressor '" + text + "': unknown compressor '" + s.name +
                    "' (accepted: " + compress::compressor_names(" ") + ")");
  std::string primary = "ratio";
  for (const compress::ParamDef& p : entry->params)
    if (p.positional) primary = p.name;
  if (colon == std::string::npos) return s;
  std::stringstream ss(text.substr(colon + 1));
  for (std::string item; std::getline(ss, item, ',');) {
    const size_t eq = item.find('=');
    std::string key, value;
    if (eq == std::string::npos) {
      // A bare number is the compressor's main parameter.
      key = primary;
      value = item;
    } else {
      key = item.substr(0, eq);
      value = item.substr(eq + 1);
    }
    if (key.empty() || value.empty())
      throw Error(ErrorCode::kInvalidArgument, "--compressor '" + text + "': bad item '" + item + "'");
    s.params[key] = value;
  }
  if (auto it = s.params.find("ratio"); it != s.params.end()) {
    double r = param_double(s.params, "ratio", 0);
    if (!(r > 0 && r <= 1))
      throw Error(ErrorCode::kInvalidArgument,
                  "--compressor '" + text + "': ratio must be in (0, 1], got " + it->second);
  }
  return s;
}

std::string CompressorSpec::text() const {
  std::string out = name;
  char sep = ':';
  for (const auto& [k, v] : params) {
    out += sep + k + "=" + v;
    sep = ',';
  }
  return out;
}

}  // namespace bytecomp::planner
