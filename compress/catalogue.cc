// The catalogue's entries. A new compressor is one entry here plus its
// kernels (docs/adding-a-compressor.md).
#include "compress/catalogue.h"

#include "compress/internal.h"

namespace bytecomp::compress {
namespace {

using detail::Base;
using detail::kHeaderBytes;
using detail::pad8;
using detail::plane_words;

const ParamDef kRatio{"ratio", ParamKind::kRatio, 0, 1, "0.01", "fraction of elements sent", true,
                      true};
const ParamDef kEfOn{"ef", ParamKind::kBool, 0, 1, "true", "wrap in error feedback", false};
const ParamDef kEfOff{"ef", ParamKind::kBool, 0, 1, "false", "wrap in error feedback", false};
const ParamDef kEfBeta{"ef_beta", ParamKind::kUnit, 0, 1, "1",
                       "scale applied to the residual before it is added back", false};

std::unique_ptr<Compressor> with_ef(CompressorSpec s, std::unique_ptr<Base> inner,
                                    const ParamValues& v) {
  if (v["ef"] != 0) return detail::make_feedback(std::move(s), std::move(inner), v["ef_beta"]);
  return inner;
}
// A server's recompressor: error feedback by the server's own setting, not
// by the nodes' "ef"; ef_beta as the nodes have it where there is one.
std::unique_ptr<Compressor> with_server_ef(CompressorSpec s, std::unique_ptr<Base> inner,
                                           const ParamValues& v, bool ef) {
  if (!ef) return inner;
  const double beta = v.v.count("ef_beta") ? v["ef_beta"] : 1.0;
  return detail::make_feedback(std::move(s), std::move(inner), beta);
}

// Wire-size models (compress/internal.h has the layout: a 32-byte header,
// parameters padded to 8 bytes, the payload).
uint64_t half_bytes(uint64_t n, const ParamValues&) { return kHeaderBytes + 2 * n; }
double half_slope(const ParamValues&) { return 2; }
// randomk: seed and k as parameters; values only (the indices follow from the seed).
uint64_t randomk_bytes(uint64_t n, const ParamValues& p) {
  return kHeaderBytes + 16 + 4 * detail::k_of(n, p["ratio"]);
}
double randomk_slope(const ParamValues& p) { return 4.0 * p["ratio"]; }
// topk, dgc: k as parameter; u32 indices and f32 values.
uint64_t topk_bytes(uint64_t n, const ParamValues& p) {
  return detail::sparse_bytes(detail::k_of(n, p["ratio"]));
}
uint64_t dgc_bytes(uint64_t n, const ParamValues& p) {
  return detail::sparse_bytes(detail::dgc_max_k(n, p["ratio"], p["warmup_iters"] != 0));
}
double sparse_slope(const ParamValues& p) { return 8.0 * p["ratio"]; }
// The sign family: one bit per element in 64-bit words, after its scalars.
template <size_t kParams>
uint64_t sign_bytes(uint64_t n, const ParamValues&) {
  return kHeaderBytes + pad8(kParams) + (n + 63) / 64 * 8;
}
double sign_slope(const ParamValues&) { return 1.0 / 8.0; }
// qsgd: levels, bits, norm; 1 + bit_width(levels) bit planes.
unsigned qsgd_bits(const ParamValues& p) {
  return 1 + std::bit_width(static_cast<unsigned>(p["levels"]));
}
uint64_t qsgd_bytes(uint64_t n, const ParamValues& p) {
  return kHeaderBytes + pad8(12) + plane_words(n, qsgd_bits(p)) * 8;
}
double qsgd_slope(const ParamValues& p) { return qsgd_bits(p) / 8.0; }
// terngrad: the scale; two bit planes.
uint64_t terngrad_bytes(uint64_t n, const ParamValues&) {
  return kHeaderBytes + 8 + plane_words(n, 2) * 8;
}
double terngrad_slope(const ParamValues&) { return 2.0 / 8.0; }

}  // namespace

bool CatalogueEntry::has_param(std::string_view param) const {
  return find_param(param) != nullptr;
}

const ParamDef* CatalogueEntry::find_param(std::string_view param) const {
  for (const auto& p : params)
    if (param == p.name) return &p;
  return nullptr;
}

const std::vector<CatalogueEntry>& catalogue() {
  //  name, help, params, additive, builtin_feedback, deterministic_size,
  //  cpu, cuda, wire_bytes, bytes_per_element, build, build_for_sum
  //  (dgc's builtin_feedback: its local accumulation v is what error
  //  feedback keeps, the residual of what was not sent)
  static const std::vector<CatalogueEntry> c = {
      {"fp16", "cast to IEEE half precision (round to nearest even)", {kEfOff, kEfBeta}, true,
       false, true, true, true, half_bytes, half_slope,
       [](CompressorSpec s, const ParamValues& v) { return with_ef(s, detail::make_fp16(s), v); },
       [](CompressorSpec s, const ParamValues& v, bool ef) {
         return with_server_ef(s, detail::make_fp16(s), v, ef);
       }},
      {"bf16", "cast to bfloat16 (round to nearest even)", {kEfOff, kEfBeta}, true, false, true,
       true, true, half_bytes, half_slope,
       [](CompressorSpec s, const ParamValues& v) { return with_ef(s, detail::make_bf16(s), v); },
       [](CompressorSpec s, const ParamValues& v, bool ef) {
         return with_server_ef(s, detail::make_bf16(s), v, ef);
       }},
      {"randomk", "k random elements, indices from a seed shared by all workers (none sent)",
       {kRatio, kEfOn, kEfBeta}, true, false, true, true, true, randomk_bytes, randomk_slope,
       [](CompressorSpec s, const ParamValues& v) {
         return with_ef(s, detail::make_randomk(s, v["ratio"]), v);
       },
       [](CompressorSpec s, const ParamValues& v, bool ef) {
         return with_server_ef(s, detail::make_randomk(s, v["ratio"]), v, ef);
       }},
      {"topk", "exactly the k largest magnitudes (ties: lower index first)",
       {kRatio, kEfOn, kEfBeta}, false, false, true, true, true, topk_bytes, sparse_slope,
       [](CompressorSpec s, const ParamValues& v) {
         return with_ef(s, detail::make_topk(s, v["ratio"]), v);
       },
       [](CompressorSpec s, const ParamValues& v, bool ef) {
         return with_server_ef(s, detail::make_topk(s, v["ratio"]), v, ef);
       }},
      {"dgc", "Deep Gradient Compression: sampled threshold, momentum correction and masking",
       {kRatio,
        {"momentum", ParamKind::kUnit, 0, 0.999, "0.9", "momentum of the correction", false},
        {"sample_ratio", ParamKind::kRatio, 0, 1, "0.01",
         "fraction sampled to estimate the threshold", false},
        {"warmup_iters", ParamKind::kInt, 0, 1e12, "0",
         "iterations per warm-up stage (ratios 0.25, 0.0625, 0.015625, 0.004 then ratio); 0: none",
         false, true},
        {"refine", ParamKind::kInt, 0, 8, "2",
         "threshold refinement passes when too few are selected", false}},
       false, true, false, true, true, dgc_bytes, sparse_slope,
       [](CompressorSpec s, const ParamValues& v) -> std::unique_ptr<Compressor> {
         return detail::make_dgc(s, v["ratio"], v["momentum"], v["sample_ratio"],
                                 static_cast<uint64_t>(v["warmup_iters"]),
                                 static_cast<unsigned>(v["refine"]));
       },
       [](CompressorSpec s, const ParamValues& v, bool ef) -> std::unique_ptr<Compressor> {
         return detail::make_dgc_for_sum(s, v["ratio"], v["sample_ratio"],
                                         static_cast<uint64_t>(v["warmup_iters"]),
                                         static_cast<unsigned>(v["refine"]), ef);
       }},
      {"signsgd", "sign of each element (majority vote: decompress-sum, then compress again)",
       {kEfOff, kEfBeta}, false, false, true, true, true, sign_bytes<0>, sign_slope,
       [](CompressorSpec s, const ParamValues& v) { return with_ef(s, detail::make_signsgd(s), v); },
       [](CompressorSpec s, const ParamValues& v, bool ef) {
         return with_server_ef(s, detail::make_signsgd(s), v, ef);
       }},
      {"signum", "sign of the momentum",
       {{"momentum", ParamKind::kUnit, 0, 0.999, "0.9", "momentum", true}}, false, false, true,
       true, true, sign_bytes<0>, sign_slope,
       [](CompressorSpec s, const ParamValues& v) -> std::unique_ptr<Compressor> {
         return detail::make_signum(s, v["momentum"]);
       },
       [](CompressorSpec s, const ParamValues& v, bool ef) {
         return with_server_ef(s, detail::make_signum_for_sum(s), v, ef);
       }},
      {"efsignsgd", "scaled sign (mean magnitude) with error feedback", {kEfBeta}, false, true,
       true, true, true, sign_bytes<4>, sign_slope,
       [](CompressorSpec s, const ParamValues& v) -> std::unique_ptr<Compressor> {
         return detail::make_feedback(s, detail::make_scaledsign(s), v["ef_beta"]);
       },
       [](CompressorSpec s, const ParamValues& v, bool ef) {
         return with_server_ef(s, detail::make_scaledsign(s), v, ef);
       }},
      {"onebit", "1-bit SGD: sign plus the means of the positive and negative parts, error feedback",
       {kEfBeta}, false, true, true, true, true, sign_bytes<8>, sign_slope,
       [](CompressorSpec s, const ParamValues& v) -> std::unique_ptr<Compressor> {
         return detail::make_feedback(s, detail::make_onebit(s), v["ef_beta"]);
       },
       [](CompressorSpec s, const ParamValues& v, bool ef) {
         return with_server_ef(s, detail::make_onebit(s), v, ef);
       }},
      {"qsgd", "stochastic rounding to s levels of the L2 norm, bit-packed",
       {{"levels", ParamKind::kInt, 1, 127, "16", "quantisation levels s", true, true}, kEfOff,
        kEfBeta},
       false, false, true, true, true, qsgd_bytes, qsgd_slope,
       [](CompressorSpec s, const ParamValues& v) {
         return with_ef(s, detail::make_qsgd(s, static_cast<unsigned>(v["levels"])), v);
       },
       [](CompressorSpec s, const ParamValues& v, bool ef) {
         return with_server_ef(s, detail::make_qsgd(s, static_cast<unsigned>(v["levels"])), v, ef);
       }},
      {"terngrad", "stochastic ternary {-s,0,s} after 2.5-sigma clipping, 2 bits per element",
       {kEfOff, kEfBeta}, false, false, true, true, true, terngrad_bytes, terngrad_slope,
       [](CompressorSpec s, const ParamValues& v) { return with_ef(s, detail::make_terngrad(s), v); },
       [](CompressorSpec s, const ParamValues& v, bool ef) {
         return with_server_ef(s, detail::make_terngrad(s), v, ef);
       }},
  };
  return c;
}

const CatalogueEntry* find_compressor(std::string_view name) {
  for (const auto& e : catalogue())
    if (name == e.name) return &e;
  return nullptr;
}

std::string compressor_names(std::string_view sep) {
  std::string s;
  for (const auto& e : catalogue()) {
    if (!s.empty()) s += sep;
    s += e.name;
  }
  return s;
}

uint64_t wire_bytes(const CompressorSpec& spec, uint64_t n) {
  ParamValues v = param_values(spec);
  return find_compressor(spec.name)->wire_bytes(n, v);
}

double bytes_per_element(const CompressorSpec& spec) {
  ParamValues v = param_values(spec);
  return find_compressor(spec.name)->bytes_per_element(v);
}

}  // namespace bytecomp::compress
