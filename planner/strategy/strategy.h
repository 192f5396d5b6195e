// Per-tensor compression strategy: the contract between the planner (which
// writes it) and the node daemon and servers (which execute it;
// planner/strategy/plan.h maps an option to what they run). See
// docs/strategy-format.md for the YAML format and for which options the CPU
// runtime can execute.
//
// A tensor's option follows the paper's decision tree (section 4.2): whether
// and how to compress, on which device, flat or hierarchical communication,
// the collective of each phase, and where compression and decompression sit
// along the phases.
//
// Stability: this header is linked by the daemon; changes are additive only.
//
// Thread-safety: all types are plain values; a const Strategy may be shared
// by any number of reader threads (resolve() does not mutate).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/types.h"

namespace bytecomp::strategy {

// The YAML text is "gpu" / "cpu" (device_name, parse_device).
using Device = bytecomp::Device;

enum class Scheme {
  kFlat,          // one collective over every worker of the job
  kHierarchical,  // intra-node step, inter-node collective, intra-node step
};

// A collective names both of its steps; the first step runs before the
// inter-node phase and the second after it when used as the intra-node
// collective of a hierarchical scheme.
enum class Collective {
  // On uncompressed (or additive-compressed) data.
  kAllreduce,               // indivisible
  kReduceScatterAllgather,  // divisible
  kReduceBroadcast,         // divisible
  // On compressed data; the receiver of a gather decompresses and sums.
  kAllgather,               // indivisible
  kAlltoallAllgather,       // divisible: decompress-sum-recompress between steps
  kGatherBroadcast,         // divisible: decompress-sum-recompress at the root
};

// Position of compression / decompression along a hierarchical scheme.
// compress_before: kIntra = before the first intra-node step,
//                  kInter = before the inter-node phase.
// decompress_after: kInter = right after the inter-node phase,
//                   kIntra = after the last intra-node step.
// In a flat scheme both are kInter (one phase).
enum class Stage { kIntra, kInter };

const char* device_name(Device d);  // "gpu" / "cpu"
const char* to_string(Scheme s);
const char* to_string(Collective c);
const char* to_string(Stage s);
std::optional<Device> parse_device(std::string_view s);
std::optional<Scheme> parse_scheme(std::string_view s);
std::optional<Collective> parse_collective(std::string_view s);
std::optional<Stage> parse_stage(std::string_view s);

// True for the collectives that reduce on the way (need additive data).
bool is_reducing(Collective c);
// True for the collectives made of two steps.
bool is_divisible(Collective c);

// "none" (uncompressed), then every compressor of the catalogue
// (compress/catalogue.h).
const std::vector<std::string>& compressor_names();
// Compressors whose compressed values can be summed without decompressing
// (fp16/bf16 casts; randomk with a shared seed): they may use reducing
// collectives while compressed.
bool is_additive_compressor(std::string_view name);

struct Option {
  std::string compressor = "none";
  // Flat scalars, validated by the compression library's factory.
  std::map<std::string, std::string> params;
  bool error_feedback = false;
  Device comp_device = Device::kCpu;
  Device decomp_device = Device::kCpu;
  Scheme scheme = Scheme::kHierarchical;
  Collective intra = Collective::kReduceBroadcast;        // hierarchical only
  Collective inter = Collective::kReduceScatterAllgather;  // flat: the one phase
  Stage compress_before = Stage::kInter;
  Stage decompress_after = Stage::kInter;
  // Share of the tensor's elements, in [0, 1), whose compression and
  // decompression run on the CPU pool instead of comp_device/decomp_device
  // (the runtime rounds it to whole partitions, the first ones in partition
  // order; the rest keep the option's devices). 0 = no split. Only for a
  // compressed option with at least one GPU device: it lets one large tensor
  // use spare CPU cores for part of its data while the GPU handles the rest.
  // (Added after version 1 shipped; absent from a file means 0.)
  double cpu_share = 0.0;
  // Pipelining: the tensor (each partition when the runtime partitions it)
  // is cut into this many equal slices, each running the option's whole
  // chain on its own, so that one slice is compressed while another is on
  // the wire. One of kAllowedPieces; 1 = one chain (no pipelining). Each
  // slice pays every operation's fixed cost, so more pieces trade fixed
  // overhead for overlap. With cpu_share, the CPU part and the rest are each
  // cut into `pieces` slices. The runtime executes it by cutting the job's
  // partition size: the tensor's partitions are partition_bytes / pieces
  // (rounded down to 64 bytes; strategy::tensor_partition_bytes), each with
  // its own key, seed and compressor state, fixed for the job (a strategy
  // change of a tensor's pieces is refused); cpu_share rounds to whole
  // partitions of that smaller size. (Added after version 1
  // shipped; absent from a file means 1.)
  int pieces = 1;
  static constexpr int kAllowedPieces[] = {1, 2, 4, 8};

  bool compressed() const { return compressor != "none"; }
  // Empty when consistent; otherwise the problem, in words.
  std::string problem() const;
  // One line, e.g. "randomk{ratio=0.01} ef gpu/gpu hier intra=reduce_broadcast
  // inter=allgather comp@inter decomp@inter".
  std::string describe() const;
  bool operator==(const Option& o) const = default;
};

// The inter-node transport the CPU runtime (bytecompd) uses for an option:
// "ps" (push/pull sharded over all servers), "ps_single" (one server),
// "allgather" (peer daemons) or "ring" (ring allreduce between the daemons:
// allreduce with compressor none, fp16 or bf16). Empty when the runtime
// cannot execute it.
std::string runtime_inter_mode(const Option& o);
// Empty when the CPU runtime can execute `o`; else why not (one sentence).
std::string cpu_runtime_unsupported(const Option& o);

struct Entry {
  std::string tensor;
  Option option;
};

// Glob on the tensor name (fnmatch(3), no flags) and a size window in bytes.
struct Rule {
  std::string match = "*";
  uint64_t min_bytes = 0;
  uint64_t max_bytes = UINT64_MAX;
  Option option;
  bool matches(std::string_view name, uint64_t bytes) const;
};

struct TensorDecl {
  std::string name;
  uint64_t bytes = 0;
};

class Strategy {
 public:
  // Throws config::ConfigError with file:line:col, key path and accepted
  // values for every malformed or inconsistent item.
  static Strategy load_file(const std::string& path);
  static Strategy parse(std::string_view text, std::string name);

  std::string to_yaml() const;
  // Writes atomically (temporary file + rename). Throws Error on I/O failure.
  void save(const std::string& path) const;

  // Exact entry, else first matching rule, else the default.
  const Option& resolve(std::string_view tensor, uint64_t bytes) const;

  // Throws config::ConfigError naming every exact entry whose tensor is not
  // declared (the job's tensor list), and every declared tensor whose
  // resolved option is inconsistent with its size (none today; kept for
  // additive checks).
  void check(const std::vector<TensorDecl>& declared) const;
  // Like check(), plus: every declared tensor's resolved option must be
  // executable by the CPU runtime; the message names tensor and reason.
  void check_cpu_runtime(const std::vector<TensorDecl>& declared) const;

  // Mutators keep the exact-entry index in sync; add_entry replaces an
  // existing entry of the same tensor.
  void add_entry(Entry e);
  void add_rule(Rule r) { rules_.push_back(std::move(r)); }
  void set_default(Option o) { default_ = std::move(o); }

  const std::vector<Entry>& entries() const { return entries_; }
  const std::vector<Rule>& rules() const { return rules_; }
  const Option& default_option() const { return default_; }

  // Free-form provenance written by the planner (model, compressor,
  // predicted iteration time...); not interpreted by the runtime.
  std::map<std::string, std::string> meta;

 private:
  std::vector<Entry> entries_;
  std::unordered_map<std::string, size_t> index_;
  std::vector<Rule> rules_;
  Option default_;
};

}  // namespace bytecomp::strategy

// The planner writes strategies: inside it the format's names read as its own.
namespace bytecomp::planner {
using strategy::Collective;
using strategy::Device;
using strategy::Entry;
using strategy::Option;
using strategy::Rule;
using strategy::Scheme;
using strategy::Stage;
using strategy::Strategy;
using strategy::TensorDecl;
using strategy::compressor_names;
using strategy::cpu_runtime_unsupported;
using strategy::device_name;
using strategy::is_additive_compressor;
using strategy::is_divisible;
using strategy::is_reducing;
using strategy::parse_collective;
using strategy::parse_device;
using strategy::parse_scheme;
using strategy::parse_stage;
using strategy::runtime_inter_mode;
using strategy::to_string;
}  // namespace bytecomp::planner
