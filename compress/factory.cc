// The factory and the CLI / YAML spec parsers over the catalogue
// (compress/catalogue.h): names and parameters validated from text.
#include <charconv>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "common/config.h"
#include "compress/catalogue.h"
#include "compress/cuda/cuda.h"
#include "compress/internal.h"

namespace bytecomp::compress {
namespace {

std::string accepted_of(const ParamDef& p) {
  char buf[64];
  switch (p.kind) {
    case ParamKind::kRatio:
      std::snprintf(buf, sizeof buf, "a number with 0 < x <= %g", p.hi);
      return buf;
    case ParamKind::kUnit:
      std::snprintf(buf, sizeof buf, "a number with %g <= x <= %g", p.lo, p.hi);
      return buf;
    case ParamKind::kInt:
      std::snprintf(buf, sizeof buf, "an integer %.0f..%.0f", p.lo, p.hi);
      return buf;
    case ParamKind::kBool:
      return "true|false";
  }
  return {};
}

std::string names_list() { return compressor_names(", "); }

std::string params_list(const CatalogueEntry& d) {
  std::string s;
  for (const auto& p : d.params) s += (s.empty() ? "" : ", ") + std::string(p.name);
  return s.empty() ? "none" : s;
}

const CatalogueEntry* find(std::string_view name) { return find_compressor(name); }

// Parses and checks one value; empty optional-like result via `problem`.
bool parse_value(const ParamDef& p, const std::string& text, double& out, std::string& problem) {
  if (p.kind == ParamKind::kBool) {
    if (text == "true" || text == "1" || text == "yes" || text == "on") return out = 1, true;
    if (text == "false" || text == "0" || text == "no" || text == "off") return out = 0, true;
    problem = "'" + text + "' is not a boolean";
    return false;
  }
  double v = 0;
  const char* b = text.data();
  const char* e = b + text.size();
  auto [ptr, ec] = std::from_chars(b, e, v);
  if (ec != std::errc() || ptr != e || !std::isfinite(v)) {
    problem = "'" + text + "' is not a number";
    return false;
  }
  bool ok = true;
  switch (p.kind) {
    case ParamKind::kRatio: ok = v > 0 && v <= p.hi; break;
    case ParamKind::kUnit: ok = v >= p.lo && v <= p.hi; break;
    case ParamKind::kInt: ok = v == std::floor(v) && v >= p.lo && v <= p.hi; break;
    case ParamKind::kBool: break;
  }
  if (!ok) {
    problem = "'" + text + "' is out of range";
    return false;
  }
  out = v;
  return true;
}

std::string canonical(const ParamDef& p, double v) {
  if (p.kind == ParamKind::kBool) return v != 0 ? "true" : "false";
  char buf[64];
  std::snprintf(buf, sizeof buf, p.kind == ParamKind::kInt ? "%.0f" : "%.9g", v);
  return buf;
}

[[noreturn]] void bad(const std::string& msg) { throw Error(ErrorCode::kInvalidArgument, msg); }

// Checks a spec; fills `values` with every parameter (defaults included).
const CatalogueEntry& validate(const CompressorSpec& spec, ParamValues& values) {
  const CatalogueEntry* d = find(spec.name);
  if (d == nullptr)
    bad("unknown compressor '" + spec.name + "' (accepted: " + names_list() + ")");
  for (const auto& [k, text] : spec.params) {
    const ParamDef* p = d->find_param(k);
    if (p == nullptr)
      bad("compressor '" + spec.name + "': unknown parameter '" + k + "' (accepted: " +
          params_list(*d) + ")");
    std::string problem;
    double v;
    if (!parse_value(*p, text, v, problem))
      bad("compressor '" + spec.name + "': parameter '" + k + "': " + problem + " (accepted: " +
          accepted_of(*p) + ")");
    values.v[k] = v;
  }
  for (const auto& p : d->params) {
    if (values.v.count(p.name)) continue;
    double v;
    std::string problem;
    parse_value(p, p.default_value, v, problem);
    values.v[p.name] = v;
  }
  return *d;
}

}  // namespace

CompressorSpec parse_compressor_spec(std::string_view text) {
  CompressorSpec spec;
  size_t colon = text.find(':');
  spec.name = std::string(text.substr(0, colon));
  const CatalogueEntry* d = find(spec.name);
  if (d == nullptr)
    bad("compressor spec '" + std::string(text) + "': unknown compressor '" + spec.name +
        "' (accepted: " + names_list() + ")");
  if (colon != std::string_view::npos) {
    std::string_view rest = text.substr(colon + 1);
    bool first = true;
    while (true) {
      size_t comma = rest.find(',');
      std::string_view item = rest.substr(0, comma);
      size_t eq = item.find('=');
      std::string key, value;
      if (eq == std::string_view::npos) {
        if (!first || d->params.empty() || !d->params[0].positional)
          bad("compressor spec '" + std::string(text) + "': '" + std::string(item) +
              "' needs the form key=value (parameters of " + spec.name + ": " + params_list(*d) + ")");
        key = d->params[0].name;
        value = std::string(item);
      } else {
        key = std::string(item.substr(0, eq));
        value = std::string(item.substr(eq + 1));
      }
      if (key.empty() || value.empty())
        bad("compressor spec '" + std::string(text) + "': empty key or value in '" +
            std::string(item) + "'");
      if (spec.params.count(key))
        bad("compressor spec '" + std::string(text) + "': parameter '" + key + "' given twice");
      spec.params[key] = value;
      first = false;
      if (comma == std::string_view::npos) break;
      rest = rest.substr(comma + 1);
    }
  }
  ParamValues v;
  try {
    validate(spec, v);
  } catch (const Error& e) {
    bad("compressor spec '" + std::string(text) + "': " + e.what());
  }
  return spec;
}

CompressorSpec parse_compressor_spec(config::Reader& r) {
  CompressorSpec spec;
  r.require("name").get("name", spec.name);
  const CatalogueEntry* d = find(spec.name);
  if (d == nullptr) r.fail("name", "unknown compressor '" + spec.name + "'", names_list());
  for (const auto& p : d->params) {
    if (!r.has(p.name)) {
      std::string ignored;
      r.get(p.name, ignored);  // marks it as known for finish()
      continue;
    }
    std::string text;
    r.get(p.name, text);
    double v;
    std::string problem;
    if (!parse_value(p, text, v, problem)) r.fail(p.name, problem, accepted_of(p));
    spec.params[p.name] = text;
  }
  r.finish();
  return spec;
}

std::string to_string(const CompressorSpec& spec) {
  std::string s = spec.name;
  bool first = true;
  for (const auto& [k, v] : spec.params) {
    s += (first ? ":" : ",") + k + "=" + v;
    first = false;
  }
  return s;
}

const std::vector<CompressorInfo>& list_compressors() {
  static const std::vector<CompressorInfo> infos = [] {
    std::vector<CompressorInfo> out;
    for (const auto& d : catalogue()) {
      CompressorInfo ci;
      ci.name = d.name;
      ci.help = d.help;
      ci.additive = d.additive;
      ci.deterministic_size = d.deterministic_size;
      for (const auto& p : d.params)
        ci.params.push_back({p.name, accepted_of(p), p.default_value, p.help, p.positional});
      out.push_back(std::move(ci));
    }
    return out;
  }();
  return infos;
}

std::string describe_compressors() {
  std::ostringstream os;
  for (const auto& c : list_compressors()) {
    os << c.name << ": " << c.help << (c.additive ? " [additive]" : "")
       << (c.deterministic_size ? "" : " [variable size]") << "\n";
    for (const auto& p : c.params)
      os << "    " << p.name << (p.positional ? " (positional)" : "") << " = " << p.default_value
         << "  (" << p.accepted << ") " << p.help << "\n";
  }
  return os.str();
}

ParamValues param_values(const CompressorSpec& spec) {
  ParamValues v;
  validate(spec, v);
  return v;
}

std::unique_ptr<Compressor> make_compressor(const CompressorSpec& spec) {
  ParamValues v;
  const CatalogueEntry& d = validate(spec, v);
  CompressorSpec canon;
  canon.name = d.name;
  for (const auto& p : d.params) canon.params[p.name] = canonical(p, v[p.name]);
  return d.build(std::move(canon), v);
}

std::unique_ptr<Compressor> make_sum_recompressor(const CompressorSpec& spec, bool error_feedback) {
  ParamValues v;
  const CatalogueEntry& d = validate(spec, v);
  CompressorSpec canon;
  canon.name = d.name;
  for (const auto& p : d.params) canon.params[p.name] = canonical(p, v[p.name]);
  return d.build_for_sum(std::move(canon), v, error_feedback);
}

// --- device dispatch (issue 15: CUDA compressors) ---
std::unique_ptr<Compressor> make_compressor(const CompressorSpec& spec, Device device) {
  if (device == Device::kCpu) return make_compressor(spec);
  ParamValues v;
  const CatalogueEntry& d = validate(spec, v);
  if (!d.supports(device)) {
    throw Error(ErrorCode::kInvalidArgument,
                "compressor '" + std::string(d.name) + "' has no " + std::string(to_string(device)) + " kernels");
  }
  CompressorSpec canon;
  canon.name = d.name;
  for (const auto& p : d.params) canon.params[p.name] = canonical(p, v[p.name]);
  return cuda::make_compressor(canon, v);
}

}  // namespace bytecomp::compress
