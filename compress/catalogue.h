// The compressor catalogue: every compressor, declared once. The factory
// (make_compressor, the spec parsers, list_compressors), the planner (names,
// additive set, wire sizes), the strategy checker and the daemon read it from
// here; docs/adding-a-compressor.md says how to add one.
//
// Each entry declares its name, parameters (with accepted ranges and
// defaults), whether it is additive, whether error feedback is built in,
// whether its size depends only on n, its wire-size model, the devices it
// runs on, how to build it for a node and how a server recompresses a sum
// with it.
//
// Thread-safety: the catalogue is immutable (built on first use).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/types.h"
#include "compress/compressor.h"

namespace bytecomp::compress {

enum class ParamKind : uint8_t {
  kRatio,  // lo < x <= hi (lo = 0)
  kUnit,   // lo <= x <= hi
  kInt,    // integer, lo <= x <= hi
  kBool,   // true|false (also 1/0, yes/no, on/off)
};

struct ParamDef {
  const char* name;
  ParamKind kind;
  double lo, hi;
  const char* default_value;  // text form
  const char* help;
  bool positional;  // the CLI form may give it without a key ("topk:0.01")
  // The wire-size model reads it (the planner keeps it in its cost tables).
  bool sizes_wire = false;
};

// Parameter values by name, every parameter present (defaults filled in).
struct ParamValues {
  std::map<std::string, double> v;
  double operator[](const std::string& k) const { return v.at(k); }
};

struct CatalogueEntry {
  const char* name;
  const char* help;
  std::vector<ParamDef> params;
  // Compressed payloads of one tensor and iteration sum without decompressing
  // (Compressor::aggregate): the servers and reducing collectives may add them.
  bool additive;
  // Error feedback is part of the algorithm (it has no "ef" parameter, and
  // error_feedback: true in a strategy is what it does anyway).
  bool builtin_feedback;
  // The compressed size depends only on n (not on the values).
  bool deterministic_size;
  // Devices it has kernels for (cuda: compress/cuda/, present in builds with
  // CUDA; cuda::built() says whether this one has them).
  bool cpu = true;
  bool cuda = false;
  // Wire-size model: bytes compress() emits for n elements at `p`, header
  // included: exact when deterministic_size, else an upper bound.
  uint64_t (*wire_bytes)(uint64_t n, const ParamValues& p);
  // The model's slope, bytes per element for large n (the planner's cost
  // model; for variable sizes the expected one, not the bound).
  double (*bytes_per_element)(const ParamValues& p);
  // Builds it from the canonical spec and its validated values.
  std::unique_ptr<Compressor> (*build)(CompressorSpec spec, const ParamValues& p);
  // Builds what a parameter server recompresses the sum of the nodes'
  // pushes with (make_sum_recompressor): the same wire format, none of the
  // nodes' state (momentum: the nodes applied it), and a residual of its own
  // exactly when `error_feedback`.
  std::unique_ptr<Compressor> (*build_for_sum)(CompressorSpec spec, const ParamValues& p,
                                               bool error_feedback);

  bool supports(bytecomp::Device d) const { return d == bytecomp::Device::kCuda ? cuda : cpu; }
  bool has_param(std::string_view param) const;
  const ParamDef* find_param(std::string_view param) const;
};

// Every compressor, in a stable order (the order of list_compressors()).
const std::vector<CatalogueEntry>& catalogue();
// nullptr for an unknown name.
const CatalogueEntry* find_compressor(std::string_view name);
// Names joined by `sep`, in catalogue order (for "accepted: ..." messages).
std::string compressor_names(std::string_view sep);

// Checks `spec` against its entry (names, values, ranges) and returns the
// values with defaults filled in. Throws Error(kInvalidArgument) naming the
// unknown compressor or parameter, or the bad value, with what is accepted.
ParamValues param_values(const CompressorSpec& spec);

// Wire bytes of `n` elements and bytes per element under `spec` (validated
// as by param_values()).
uint64_t wire_bytes(const CompressorSpec& spec, uint64_t n);
double bytes_per_element(const CompressorSpec& spec);

}  // namespace bytecomp::compress
