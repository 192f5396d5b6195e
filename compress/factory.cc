// Compressor registry: names, parameters (validated from text), the factory,
// and the CLI / YAML spec parsers.
#include <charconv>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "common/config.h"
#include "compress/cuda/cuda.h"
#include "compress/internal.h"

namespace bytecomp::compress {
namespace {

using detail::Base;

enum class Kind { kRatio, kUnit, kInt, kBool };

struct ParamDef {
  const char* name;
  Kind kind;
  double lo, hi;  // kInt: inclusive range; kUnit: [lo, hi]
  const char* def;
  const char* help;
  bool positional;
};

using Builder = std::unique_ptr<Base> (*)(CompressorSpec, const detail::Values&);

struct Def {
  const char* name;
  const char* help;
  std::vector<ParamDef> params;
  bool additive;
  bool deterministic;
  Builder build;
};

const ParamDef kRatio{"ratio", Kind::kRatio, 0, 1, "0.01", "fraction of elements sent", true};
const ParamDef kEfOn{"ef", Kind::kBool, 0, 1, "true", "wrap in error feedback", false};
const ParamDef kEfOff{"ef", Kind::kBool, 0, 1, "false", "wrap in error feedback", false};
const ParamDef kEfBeta{"ef_beta", Kind::kUnit, 0, 1, "1",
                       "scale applied to the residual before it is added back", false};

std::unique_ptr<Base> with_ef(CompressorSpec s, std::unique_ptr<Base> inner, const detail::Values& v) {
  if (v["ef"] != 0) return detail::make_feedback(std::move(s), std::move(inner), v["ef_beta"]);
  return inner;
}

const std::vector<Def>& defs() {
  static const std::vector<Def> d = {
      {"fp16", "cast to IEEE half precision (round to nearest even)", {kEfOff, kEfBeta}, true, true,
       [](CompressorSpec s, const detail::Values& v) { return with_ef(s, detail::make_fp16(s), v); }},
      {"bf16", "cast to bfloat16 (round to nearest even)", {kEfOff, kEfBeta}, true, true,
       [](CompressorSpec s, const detail::Values& v) { return with_ef(s, detail::make_bf16(s), v); }},
      {"randomk", "k random elements, indices from a seed shared by all workers (none sent)",
       {kRatio, kEfOn, kEfBeta}, true, true,
       [](CompressorSpec s, const detail::Values& v) {
         return with_ef(s, detail::make_randomk(s, v["ratio"]), v);
       }},
      {"topk", "exactly the k largest magnitudes (ties: lower index first)",
       {kRatio, kEfOn, kEfBeta}, false, true,
       [](CompressorSpec s, const detail::Values& v) {
         return with_ef(s, detail::make_topk(s, v["ratio"]), v);
       }},
      {"dgc", "Deep Gradient Compression: sampled threshold, momentum correction and masking",
       {kRatio,
        {"momentum", Kind::kUnit, 0, 0.999, "0.9", "momentum of the correction", false},
        {"sample_ratio", Kind::kRatio, 0, 1, "0.01", "fraction sampled to estimate the threshold", false},
        {"warmup_iters", Kind::kInt, 0, 1e12, "0",
         "iterations per warm-up stage (ratios 0.25, 0.0625, 0.015625, 0.004 then ratio); 0: none", false},
        {"refine", Kind::kInt, 0, 8, "2", "threshold refinement passes when too few are selected", false}},
       false, false,
       [](CompressorSpec s, const detail::Values& v) {
         return detail::make_dgc(s, v["ratio"], v["momentum"], v["sample_ratio"],
                                 static_cast<uint64_t>(v["warmup_iters"]),
                                 static_cast<unsigned>(v["refine"]));
       }},
      {"signsgd", "sign of each element (majority vote: decompress-sum, then compress again)",
       {kEfOff, kEfBeta}, false, true,
       [](CompressorSpec s, const detail::Values& v) { return with_ef(s, detail::make_signsgd(s), v); }},
      {"signum", "sign of the momentum", {{"momentum", Kind::kUnit, 0, 0.999, "0.9", "momentum", true}},
       false, true,
       [](CompressorSpec s, const detail::Values& v) { return detail::make_signum(s, v["momentum"]); }},
      {"efsignsgd", "scaled sign (mean magnitude) with error feedback", {kEfBeta}, false, true,
       [](CompressorSpec s, const detail::Values& v) {
         return detail::make_feedback(s, detail::make_scaledsign(s), v["ef_beta"]);
       }},
      {"onebit", "1-bit SGD: sign plus the means of the positive and negative parts, error feedback",
       {kEfBeta}, false, true,
       [](CompressorSpec s, const detail::Values& v) {
         return detail::make_feedback(s, detail::make_onebit(s), v["ef_beta"]);
       }},
      {"qsgd", "stochastic rounding to s levels of the L2 norm, bit-packed",
       {{"levels", Kind::kInt, 1, 127, "16", "quantisation levels s", true}, kEfOff, kEfBeta}, false,
       true,
       [](CompressorSpec s, const detail::Values& v) {
         return with_ef(s, detail::make_qsgd(s, static_cast<unsigned>(v["levels"])), v);
       }},
      {"terngrad", "stochastic ternary {-s,0,s} after 2.5-sigma clipping, 2 bits per element",
       {kEfOff, kEfBeta}, false, true,
       [](CompressorSpec s, const detail::Values& v) { return with_ef(s, detail::make_terngrad(s), v); }},
  };
  return d;
}

std::string accepted_of(const ParamDef& p) {
  char buf[64];
  switch (p.kind) {
    case Kind::kRatio:
      std::snprintf(buf, sizeof buf, "a number with 0 < x <= %g", p.hi);
      return buf;
    case Kind::kUnit:
      std::snprintf(buf, sizeof buf, "a number with %g <= x <= %g", p.lo, p.hi);
      return buf;
    case Kind::kInt:
      std::snprintf(buf, sizeof buf, "an integer %.0f..%.0f", p.lo, p.hi);
      return buf;
    case Kind::kBool:
      return "true|false";
  }
  return {};
}

std::string names_list() {
  std::string s;
  for (const auto& d : defs()) s += (s.empty() ? "" : ", ") + std::string(d.name);
  return s;
}

std::string params_list(const Def& d) {
  std::string s;
  for (const auto& p : d.params) s += (s.empty() ? "" : ", ") + std::string(p.name);
  return s.empty() ? "none" : s;
}

const Def* find(std::string_view name) {
  for (const auto& d : defs())
    if (name == d.name) return &d;
  return nullptr;
}

const ParamDef* find_param(const Def& d, std::string_view name) {
  for (const auto& p : d.params)
    if (name == p.name) return &p;
  return nullptr;
}

// Parses and checks one value; empty optional-like result via `problem`.
bool parse_value(const ParamDef& p, const std::string& text, double& out, std::string& problem) {
  if (p.kind == Kind::kBool) {
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
    case Kind::kRatio: ok = v > 0 && v <= p.hi; break;
    case Kind::kUnit: ok = v >= p.lo && v <= p.hi; break;
    case Kind::kInt: ok = v == std::floor(v) && v >= p.lo && v <= p.hi; break;
    case Kind::kBool: break;
  }
  if (!ok) {
    problem = "'" + text + "' is out of range";
    return false;
  }
  out = v;
  return true;
}

std::string canonical(const ParamDef& p, double v) {
  if (p.kind == Kind::kBool) return v != 0 ? "true" : "false";
  char buf[64];
  std::snprintf(buf, sizeof buf, p.kind == Kind::kInt ? "%.0f" : "%.9g", v);
  return buf;
}

[[noreturn]] void bad(const std::string& msg) { throw Error(ErrorCode::kInvalidArgument, msg); }

// Checks a spec; fills `values` with every parameter (defaults included).
const Def& validate(const CompressorSpec& spec, detail::Values& values) {
  const Def* d = find(spec.name);
  if (d == nullptr)
    bad("unknown compressor '" + spec.name + "' (accepted: " + names_list() + ")");
  for (const auto& [k, text] : spec.params) {
    const ParamDef* p = find_param(*d, k);
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
    parse_value(p, p.def, v, problem);
    values.v[p.name] = v;
  }
  return *d;
}

}  // namespace

CompressorSpec parse_compressor_spec(std::string_view text) {
  CompressorSpec spec;
  size_t colon = text.find(':');
  spec.name = std::string(text.substr(0, colon));
  const Def* d = find(spec.name);
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
  detail::Values v;
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
  const Def* d = find(spec.name);
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
    for (const auto& d : defs()) {
      CompressorInfo ci;
      ci.name = d.name;
      ci.help = d.help;
      ci.additive = d.additive;
      ci.deterministic_size = d.deterministic;
      for (const auto& p : d.params)
        ci.params.push_back({p.name, accepted_of(p), p.def, p.help, p.positional});
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

std::unique_ptr<Compressor> make_compressor(const CompressorSpec& spec) {
  detail::Values v;
  const Def& d = validate(spec, v);
  CompressorSpec canon;
  canon.name = d.name;
  for (const auto& p : d.params) canon.params[p.name] = canonical(p, v[p.name]);
  return d.build(std::move(canon), v);
}

// --- device dispatch (issue 15: CUDA compressors) ---
std::unique_ptr<Compressor> make_compressor(const CompressorSpec& spec, Device device) {
  if (device == Device::kCpu) return make_compressor(spec);
  detail::Values v;
  const Def& d = validate(spec, v);
  CompressorSpec canon;
  canon.name = d.name;
  for (const auto& p : d.params) canon.params[p.name] = canonical(p, v[p.name]);
  return cuda::make_compressor(canon, v);
}

}  // namespace bytecomp::compress
