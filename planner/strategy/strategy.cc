#include "planner/strategy/strategy.h"

#include <fnmatch.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iterator>
#include <fstream>
#include <sstream>

#include "common/config.h"
#include "common/error.h"
#include "compress/catalogue.h"
#include "common/record.h"

namespace bytecomp::strategy {

using config::ConfigError;
using config::Document;
using config::Reader;

namespace {

constexpr const char* kSchemeNames[] = {"flat", "hierarchical"};
constexpr const char* kCollectiveNames[] = {
    "allreduce", "reduce_scatter_allgather", "reduce_broadcast",
    "allgather", "alltoall_allgather",       "gather_broadcast"};
constexpr const char* kStageNames[] = {"intra", "inter"};

template <class E, size_t N>
std::optional<E> parse_enum(std::string_view s, const char* const (&names)[N]) {
  for (size_t i = 0; i < N; ++i)
    if (s == names[i]) return static_cast<E>(i);
  return std::nullopt;
}

}  // namespace

const char* device_name(Device d) { return d == Device::kCuda ? "gpu" : "cpu"; }
const char* to_string(Scheme s) { return kSchemeNames[static_cast<int>(s)]; }
const char* to_string(Collective c) { return kCollectiveNames[static_cast<int>(c)]; }
const char* to_string(Stage s) { return kStageNames[static_cast<int>(s)]; }
std::optional<Device> parse_device(std::string_view s) {
  if (s == "gpu") return Device::kCuda;
  if (s == "cpu") return Device::kCpu;
  return std::nullopt;
}
std::optional<Scheme> parse_scheme(std::string_view s) {
  return parse_enum<Scheme>(s, kSchemeNames);
}
std::optional<Collective> parse_collective(std::string_view s) {
  return parse_enum<Collective>(s, kCollectiveNames);
}
std::optional<Stage> parse_stage(std::string_view s) {
  return parse_enum<Stage>(s, kStageNames);
}

bool is_reducing(Collective c) {
  return c == Collective::kAllreduce || c == Collective::kReduceScatterAllgather ||
         c == Collective::kReduceBroadcast;
}
bool is_divisible(Collective c) {
  return c != Collective::kAllreduce && c != Collective::kAllgather;
}

const std::vector<std::string>& compressor_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n = {"none"};
    for (const auto& e : compress::catalogue()) n.emplace_back(e.name);
    return n;
  }();
  return names;
}

bool is_additive_compressor(std::string_view name) {
  const compress::CatalogueEntry* e = compress::find_compressor(name);
  return e != nullptr && e->additive;
}

std::string Option::problem() const {
  const auto& names = compressor_names();
  if (std::find(names.begin(), names.end(), compressor) == names.end())
    return "unknown compressor '" + compressor + "'";
  const bool comp = compressed();
  if (!comp && !params.empty()) return "compressor 'none' takes no params";
  if (!comp && error_feedback) return "compressor 'none' cannot use error_feedback";
  if (!(cpu_share >= 0.0 && cpu_share < 1.0))
    return "cpu_share must be at least 0 and below 1 (a share of 1 is comp_device and "
           "decomp_device 'cpu')";
  if (cpu_share > 0.0 && !comp)
    return "cpu_share splits compression between devices; compressor 'none' has none";
  if (cpu_share > 0.0 && comp_device == Device::kCpu && decomp_device == Device::kCpu)
    return "cpu_share needs comp_device or decomp_device 'gpu' (with both on the CPU there "
           "is nothing to split)";
  if (std::find(std::begin(kAllowedPieces), std::end(kAllowedPieces), pieces) ==
      std::end(kAllowedPieces))
    return "pieces must be 1, 2, 4 or 8 (the number of pipelined slices of the tensor), not " +
           std::to_string(pieces);
  const bool additive = is_additive_compressor(compressor);
  // Data on the wire during a step is compressed or raw; reducing
  // collectives need raw or additive data, gathering ones need compressed.
  auto fits = [&](Collective c, bool step_compressed) -> bool {
    if (!step_compressed) return is_reducing(c);
    return additive || !is_reducing(c);
  };
  if (scheme == Scheme::kFlat) {
    if (compress_before != Stage::kInter || decompress_after != Stage::kInter)
      return "a flat scheme has one phase: compress_before and decompress_after must be 'inter'";
    if (!fits(inter, comp))
      return std::string("collective '") + to_string(inter) + "' cannot carry " +
             (comp ? "data compressed by " + compressor : std::string("uncompressed data"));
    return {};
  }
  if (!is_divisible(intra) || intra == Collective::kAllreduce)
    return std::string("intra collective '") + to_string(intra) +
           "' is indivisible; a hierarchical scheme needs a two-step intra collective";
  const bool s1 = comp && compress_before == Stage::kIntra;
  if (!fits(intra, s1))
    return std::string("intra collective '") + to_string(intra) + "' cannot carry " +
           (s1 ? "data compressed by " + compressor : std::string("uncompressed data"));
  if (!fits(inter, comp))
    return std::string("inter collective '") + to_string(inter) + "' cannot carry " +
           (comp ? "data compressed by " + compressor : std::string("uncompressed data"));
  return {};
}

std::string Option::describe() const {
  std::ostringstream os;
  os << compressor;
  if (!params.empty()) {
    os << '{';
    bool first = true;
    for (const auto& [k, v] : params) {
      os << (first ? "" : ",") << k << '=' << v;
      first = false;
    }
    os << '}';
  }
  if (error_feedback) os << " ef";
  if (compressed()) os << ' ' << device_name(comp_device) << '/' << device_name(decomp_device);
  if (cpu_share > 0.0) os << " cpu_share=" << cpu_share;
  if (pieces > 1) os << " pieces=" << pieces;
  if (scheme == Scheme::kFlat) {
    os << " flat " << to_string(inter);
  } else {
    os << " hier intra=" << to_string(intra) << " inter=" << to_string(inter);
    if (compressed())
      os << " comp@" << to_string(compress_before) << " decomp@"
         << to_string(decompress_after);
  }
  return os.str();
}

std::string runtime_inter_mode(const Option& o) {
  if (!cpu_runtime_unsupported(o).empty()) return {};
  switch (o.inter) {
    case Collective::kAllreduce:
      // The daemons' ring carries fp32, fp16 and bf16 (plan.h's mapping).
      if (!o.compressed() || o.compressor == "fp16" || o.compressor == "bf16") return "ring";
      return "ps";
    case Collective::kReduceScatterAllgather:
    case Collective::kAlltoallAllgather:
      return "ps";
    case Collective::kReduceBroadcast:
    case Collective::kGatherBroadcast:
      return "ps_single";
    case Collective::kAllgather:
      return "allgather";
  }
  return {};
}

std::string cpu_runtime_unsupported(const Option& o) {
  if (std::string p = o.problem(); !p.empty()) return p;
  // cpu_share with comp_device gpu: the client compresses the trailing
  // partitions on its GPU, the daemon's pool the leading ones
  // (bytecomp_push_pull_split, docs/gpu.md §4). Decompression stays the
  // daemon's (decomp_device cpu, below), so there is no split to make there.
  if (o.cpu_share > 0.0 && o.comp_device != Device::kCuda)
    return "the CPU runtime splits compression only (cpu_share with comp_device 'gpu'); the "
           "daemon decompresses every partition";
  if (o.scheme != Scheme::kHierarchical)
    return "the CPU runtime always reduces within the node first: scheme must be 'hierarchical'";
  if (o.intra != Collective::kReduceBroadcast)
    return "the CPU runtime reduces over shared memory and copies back: intra must be "
           "'reduce_broadcast'";
  if (!o.compressed()) {
    if (o.inter == Collective::kAllgather || o.inter == Collective::kAlltoallAllgather ||
        o.inter == Collective::kGatherBroadcast)
      return "uncompressed tensors go through the servers: inter must be one of "
             "allreduce, reduce_scatter_allgather, reduce_broadcast";
    return {};
  }
  if (o.compress_before != Stage::kInter || o.decompress_after != Stage::kInter)
    return "the CPU runtime compresses after the intra-node reduce and decompresses before "
           "copying to clients: compress_before and decompress_after must be 'inter'";
  // comp_device: gpu runs in the training process (bytecomp.torch's GPU
  // placement pushes the compressed partitions, docs/gpu.md §2); a client
  // that pushes dense has the daemon compress on its CPU pool instead. The
  // aggregate is decoded by the daemon.
  if (o.decomp_device != Device::kCpu)
    return "GPU decompression is not available in the CPU runtime (the daemon decodes the "
           "aggregate): decomp_device must be 'cpu'";
  return {};
}

bool Rule::matches(std::string_view name, uint64_t bytes) const {
  if (bytes < min_bytes || bytes > max_bytes) return false;
  return fnmatch(match.c_str(), std::string(name).c_str(), 0) == 0;
}

namespace {

// yaml-cpp throws when a missing child is inspected; this returns an
// undefined-but-valid node instead.
YAML::Node child(const YAML::Node& n, const char* key) {
  if (!n.IsDefined() || !n.IsMap()) return YAML::Node();
  YAML::Node c = n[key];
  if (!c.IsDefined()) return YAML::Node();
  return c;
}

// Reader cannot enumerate the keys of a mapping, so the raw YAML tree of the
// same text tells which params keys exist; Reader then reads (and locates)
// each one.
Option read_option(Reader r, const YAML::Node& raw) {
  Option o;
  std::string text;
  r.get_enum("compressor", o.compressor, compressor_names());
  Reader pr = r.section("params");
  if (YAML::Node pn = child(raw, "params"); pn.IsMap()) {
    for (const auto& kv : pn) {
      const std::string key = kv.first.Scalar();
      std::string value;
      if (!kv.second.IsScalar()) pr.fail(key, "expected a scalar value", "number or string");
      pr.get(key, value);
      o.params[key] = value;
    }
  }
  pr.finish();
  r.get("error_feedback", o.error_feedback);
  text = device_name(o.comp_device);
  r.get_enum("comp_device", text, {"gpu", "cpu"});
  o.comp_device = *parse_device(text);
  text = device_name(o.decomp_device);
  r.get_enum("decomp_device", text, {"gpu", "cpu"});
  o.decomp_device = *parse_device(text);
  text = to_string(o.scheme);
  r.get_enum("scheme", text, {"flat", "hierarchical"});
  o.scheme = *parse_scheme(text);
  // Flat schemes have no intra phase; default placements follow the scheme.
  const std::initializer_list<std::string_view> collectives = {"allreduce",          "reduce_scatter_allgather",
                            "reduce_broadcast",   "allgather",
                            "alltoall_allgather", "gather_broadcast"};
  text = to_string(o.intra);
  r.get_enum("intra", text, collectives);
  o.intra = *parse_collective(text);
  text = to_string(o.inter);
  r.get_enum("inter", text, collectives);
  o.inter = *parse_collective(text);
  text = to_string(o.compress_before);
  r.get_enum("compress_before", text, {"intra", "inter"});
  o.compress_before = *parse_stage(text);
  text = to_string(o.decompress_after);
  r.get_enum("decompress_after", text, {"intra", "inter"});
  o.decompress_after = *parse_stage(text);
  // Checked with its message by problem() below (the range reads [0, 1)).
  r.get("cpu_share", o.cpu_share);
  // Range and message from problem() below.
  r.get("pieces", o.pieces);
  r.finish();
  if (std::string p = o.problem(); !p.empty()) r.fail("", p);
  return o;
}

void emit_option(YAML::Emitter& out, const Option& o) {
  out << YAML::BeginMap;
  out << YAML::Key << "compressor" << YAML::Value << o.compressor;
  if (!o.params.empty()) {
    out << YAML::Key << "params" << YAML::Value << YAML::Flow << YAML::BeginMap;
    for (const auto& [k, v] : o.params)
      out << YAML::Key << k << YAML::Value << YAML::DoubleQuoted << v;
    out << YAML::EndMap;
  }
  if (o.compressed()) {
    out << YAML::Key << "error_feedback" << YAML::Value << o.error_feedback;
    out << YAML::Key << "comp_device" << YAML::Value << device_name(o.comp_device);
    out << YAML::Key << "decomp_device" << YAML::Value << device_name(o.decomp_device);
  }
  out << YAML::Key << "scheme" << YAML::Value << to_string(o.scheme);
  if (o.scheme == Scheme::kHierarchical)
    out << YAML::Key << "intra" << YAML::Value << to_string(o.intra);
  out << YAML::Key << "inter" << YAML::Value << to_string(o.inter);
  if (o.compressed() && o.scheme == Scheme::kHierarchical) {
    out << YAML::Key << "compress_before" << YAML::Value << to_string(o.compress_before);
    out << YAML::Key << "decompress_after" << YAML::Value << to_string(o.decompress_after);
  }
  // Written only when set, so files without a split stay as they were.
  if (o.cpu_share > 0.0) out << YAML::Key << "cpu_share" << YAML::Value << o.cpu_share;
  if (o.pieces > 1) out << YAML::Key << "pieces" << YAML::Value << o.pieces;
  out << YAML::EndMap;
}

}  // namespace

Strategy Strategy::parse(std::string_view text, std::string name) {
  record_input("strategy", text.data(), text.size());
  Document doc = Document::parse(text, name);
  YAML::Node raw;
  try {
    raw = YAML::Load(std::string(text));
  } catch (const YAML::Exception&) {
    // Document::parse already reported syntax errors with their location.
  }
  Strategy s;
  Reader root = doc.root("");
  Reader meta = root.section("meta");
  if (YAML::Node mn = child(raw, "meta"); mn.IsMap()) {
    for (const auto& kv : mn) {
      std::string v;
      meta.get(kv.first.Scalar(), v);
      s.meta[kv.first.Scalar()] = v;
    }
  }
  meta.finish();
  {
    Reader d = root.section("default");
    s.default_ = read_option(d, child(raw, "default"));
  }
  auto raw_list = [&](const char* key, size_t i) -> YAML::Node {
    YAML::Node l = child(raw, key);
    if (!l.IsSequence() || i >= l.size()) return {};
    return l[i];
  };
  std::vector<Reader> entries = root.list("entries");
  for (size_t i = 0; i < entries.size(); ++i) {
    Reader& r = entries[i];
    Entry e;
    r.require("tensor").require("option").get("tensor", e.tensor);
    if (e.tensor.empty()) r.fail("tensor", "empty tensor name");
    YAML::Node rn = raw_list("entries", i);
    e.option = read_option(r.section("option"), child(rn, "option"));
    r.finish();
    if (s.index_.count(e.tensor))
      r.fail("tensor", "tensor '" + e.tensor + "' has two entries");
    s.add_entry(std::move(e));
  }
  std::vector<Reader> rules = root.list("rules");
  for (size_t i = 0; i < rules.size(); ++i) {
    Reader& r = rules[i];
    Rule rule;
    r.require("option").get("match", rule.match);
    if (rule.match.empty()) r.fail("match", "empty pattern", "a glob such as '*.bias'");
    r.get_bytes("min_bytes", rule.min_bytes).get_bytes("max_bytes", rule.max_bytes);
    if (rule.min_bytes > rule.max_bytes)
      r.fail("max_bytes", "max_bytes is below min_bytes");
    YAML::Node rn = raw_list("rules", i);
    rule.option = read_option(r.section("option"), child(rn, "option"));
    r.finish();
    s.rules_.push_back(std::move(rule));
  }
  root.finish();
  return s;
}

Strategy Strategy::load_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(path + ": cannot open strategy file");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse(ss.str(), path);
}

std::string Strategy::to_yaml() const {
  YAML::Emitter out;
  out << YAML::BeginMap;
  out << YAML::Key << "version" << YAML::Value << 1;
  if (!meta.empty()) {
    out << YAML::Key << "meta" << YAML::Value << YAML::BeginMap;
    for (const auto& [k, v] : meta) out << YAML::Key << k << YAML::Value << YAML::DoubleQuoted << v;
    out << YAML::EndMap;
  }
  out << YAML::Key << "default" << YAML::Value;
  emit_option(out, default_);
  if (!rules_.empty()) {
    out << YAML::Key << "rules" << YAML::Value << YAML::BeginSeq;
    for (const Rule& r : rules_) {
      out << YAML::BeginMap << YAML::Key << "match" << YAML::Value << YAML::DoubleQuoted
          << r.match;
      if (r.min_bytes != 0) out << YAML::Key << "min_bytes" << YAML::Value << r.min_bytes;
      if (r.max_bytes != UINT64_MAX) out << YAML::Key << "max_bytes" << YAML::Value << r.max_bytes;
      out << YAML::Key << "option" << YAML::Value;
      emit_option(out, r.option);
      out << YAML::EndMap;
    }
    out << YAML::EndSeq;
  }
  if (!entries_.empty()) {
    out << YAML::Key << "entries" << YAML::Value << YAML::BeginSeq;
    for (const Entry& e : entries_) {
      out << YAML::BeginMap << YAML::Key << "tensor" << YAML::Value << YAML::DoubleQuoted
          << e.tensor << YAML::Key << "option" << YAML::Value << YAML::Flow;
      emit_option(out, e.option);
      out << YAML::EndMap;
    }
    out << YAML::EndSeq;
  }
  out << YAML::EndMap;
  return std::string("# ByteComp per-tensor strategy (docs/strategy-format.md)\n") +
         out.c_str() + "\n";
}

void Strategy::save(const std::string& path) const {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw Error(ErrorCode::kUnavailable, "cannot write strategy file " + tmp);
    f << to_yaml();
    f.flush();
    if (!f) throw Error(ErrorCode::kUnavailable, "cannot write strategy file " + tmp);
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    throw Error(ErrorCode::kUnavailable, "cannot rename strategy file to " + path);
  }
}

void Strategy::add_entry(Entry e) {
  auto it = index_.find(e.tensor);
  if (it != index_.end()) {
    entries_[it->second] = std::move(e);
    return;
  }
  index_.emplace(e.tensor, entries_.size());
  entries_.push_back(std::move(e));
}

const Option& Strategy::resolve(std::string_view tensor, uint64_t bytes) const {
  auto it = index_.find(std::string(tensor));
  if (it != index_.end()) return entries_[it->second].option;
  for (const Rule& r : rules_)
    if (r.matches(tensor, bytes)) return r.option;
  return default_;
}

void Strategy::check(const std::vector<TensorDecl>& declared) const {
  std::unordered_map<std::string, uint64_t> names;
  for (const auto& d : declared) names.emplace(d.name, d.bytes);
  std::string unknown;
  size_t count = 0;
  for (const Entry& e : entries_) {
    if (names.count(e.tensor)) continue;
    if (count < 10) unknown += (count ? ", '" : "'") + e.tensor + "'";
    ++count;
  }
  if (count > 0)
    throw ConfigError("strategy: " + std::to_string(count) +
                      " entr" + (count == 1 ? "y names" : "ies name") +
                      " a tensor the job did not declare: " + unknown +
                      (count > 10 ? ", ..." : ""));
}

void Strategy::check_cpu_runtime(const std::vector<TensorDecl>& declared) const {
  check(declared);
  for (const auto& d : declared) {
    const Option& o = resolve(d.name, d.bytes);
    if (std::string why = cpu_runtime_unsupported(o); !why.empty())
      throw ConfigError("strategy: tensor '" + d.name + "' (" + std::to_string(d.bytes) +
                        " bytes) resolves to option [" + o.describe() +
                        "] which the CPU runtime cannot execute: " + why);
  }
}

}  // namespace bytecomp::strategy
