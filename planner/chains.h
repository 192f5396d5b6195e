// Cost models: each option of a tensor becomes a chain of operations, each on
// one resource of a (representative) machine: the GPU (compression kernels,
// which delay the backward computation), the CPU pool (compression on the
// spare cores, work divided over them), the intra-node link and the inter-node
// link. Communication costs follow the ring/tree analysis of Thakur et al. and
// NCCL's notes: latency per step plus bytes over bandwidth, PS traffic divided
// over servers. See docs/planner.md.
//
// Thread-safety: Problem is immutable after construction except for its
// chain cache and the split and pipelined options it adds on demand
// (split_option, pieces_option); not thread-safe: one Problem per thread.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "planner/model.h"
#include "planner/options.h"
#include "planner/strategy/strategy.h"

namespace bytecomp::planner {

// kInterIn: the receive direction of the inter-node link, used only by the
// CPU-node model (Cluster::cpu_nodes) with dedicated servers, where pushes
// and pull answers travel in opposite directions of a full-duplex NIC; every
// other model puts all inter-node traffic on kInter.
enum class Resource : uint8_t { kGpu = 0, kCpu = 1, kIntra = 2, kInter = 3, kInterIn = 4 };
constexpr int kResources = 5;
const char* to_string(Resource r);

// A chain is a sequence of operations, each starting when the previous one
// ends. A fork (duration < 0) ends one sequence and starts another from the
// chunk's ready time: an option with Option::cpu_share runs its CPU part and
// its GPU part as two such sequences (groups), placed one after the other.
// A slice marker (duration kSliceMark) starts another sequence of the same
// group: the slices of Option::pieces. The simulator interleaves the
// sequences of a group, always placing next the operation whose input is
// ready first (what a runtime's FIFO queue per resource does), so slice 1
// is compressed while slice 0 is on the wire.
constexpr double kForkMark = -1.0;
constexpr double kSliceMark = -2.0;
struct Op {
  Resource resource;
  double duration_us;
  const char* what;  // static string: "compress", "reduce_scatter", ...
  bool fork() const { return duration_us < 0; }
  bool slice() const { return duration_us < -1.5; }
};
// Time from the chain's start to its last operation's end on idle resources
// (the longest of its forked groups; a group of slices scheduled as the
// simulator does).
double chain_latency(const std::vector<Op>& ops);

// Whether option `o` runs on the daemons' ring (inter: allreduce with none,
// fp16 or bf16: strategy::Placement::kRing) in the CPU runtime; the CPU-node
// model then costs it as the ring, not as push/pull.
bool on_ring(const Option& o);

// One tensor partition (or the whole tensor) of the simulation.
struct Chunk {
  int tensor;            // index into the profile
  uint64_t elements;
};

class Problem {
 public:
  Problem(Profile profile, Cluster cluster, CostTable costs, CompressorSpec compressor,
          Constraints constraints = {});
  // A problem over an explicit option set (the online planner's: options of
  // several compressors, each looked up in `costs` by compressor name).
  // Every compressed option needs CPU figures in `costs`; throws
  // Error(kInvalidArgument) naming the option otherwise, or when `options`
  // is empty. compressor() is then the first compressed option's.
  Problem(Profile profile, Cluster cluster, CostTable costs, std::vector<Option> options);

  const Profile& profile() const { return profile_; }
  const Cluster& cluster() const { return cluster_; }
  const CostTable& costs() const { return costs_; }
  const CompressorSpec& compressor() const { return spec_; }
  const Constraints& constraints() const { return constraints_; }
  const std::vector<Option>& options() const { return options_; }
  const std::vector<Chunk>& chunks() const { return chunks_; }
  // chunk indices of tensor i: [first_chunk(i), first_chunk(i+1))
  int first_chunk(int tensor) const { return chunk_begin_[tensor]; }
  int tensors() const { return static_cast<int>(profile_.tensors.size()); }

  // The operation chain of option `opt` on `elements` elements (cached).
  const std::vector<Op>& chain(uint64_t elements, int opt);
  // The same for chunk `c` (no lookup by size: the hot path of F).
  const std::vector<Op>& chunk_chain(int c, int opt) {
    auto& v = by_size_[chunk_size_id_[c]][opt];
    if (v.empty()) v = chain(chunks_[c].elements, opt);
    return v;
  }
  // Builds the chain into `out` without caching it (cheap summaries).
  void chain_into(uint64_t elements, int opt, std::vector<Op>& out) const;
  // Option index of an option equal to `o`, or -1.
  int find_option(const Option& o) const;
  // The decision tree's options are indices [0, tree_options()); options
  // added later (split variants) follow them.
  int tree_options() const { return tree_options_; }
  // Index of option `base` with cpu_share = share (0 < share < 1), added to
  // the option set on first use; -1 when the split is not a valid option
  // (uncompressed, no GPU device, CPU forbidden or no CPU cost figures).
  int split_option(int base, double share);
  // Index of option `base` cut into `pieces` pipelined slices
  // (Option::pieces; 1 gives the unpipelined variant), added on first use;
  // -1 when `pieces` is not allowed or the search is restricted to the CPU
  // runtime (which pipelines by its own partitions).
  int pieces_option(int base, int pieces);
  // Whether option `opt` has pieces > 1 (a compact copy for the
  // simulator's hot path).
  bool pieced(int opt) const { return pieced_[opt] != 0; }
  // A copy where compression costs nothing and causes no contention (the
  // paper's Upper Bound setting).
  Problem zero_cost_copy() const;
  double forward_us() const { return profile_.forward_or_default_us(); }

 private:
  std::vector<Op> build_chain(uint64_t elements, const Option& o) const;
  void build_chain_into(uint64_t elements, const Option& o, std::vector<Op>& ops) const;
  // The chain of the CPU runtime on CPU-only nodes (Cluster::cpu_nodes).
  void build_cpu_node_chain(uint64_t elements, const Option& o, std::vector<Op>& ops) const;
  void cut_chunks();
  // Split (cpu_share) and pipelined (pieces) options: several sequences
  // (kept out of build_chain_into, the hot path of the search).
  [[gnu::noinline]] void build_composite(uint64_t elements, const Option& o,
                                         std::vector<Op>& ops) const;
  Profile profile_;
  Cluster cluster_;
  CostTable costs_;
  CompressorSpec spec_;
  Constraints constraints_;
  bool explicit_options_ = false;
  std::vector<Option> options_;
  int tree_options_ = 0;
  std::vector<uint8_t> pieced_;  // per option: pieces > 1
  std::vector<Chunk> chunks_;
  std::vector<int> chunk_begin_;
  std::map<uint64_t, std::vector<std::vector<Op>>> cache_;
  std::vector<int> chunk_size_id_;
  std::vector<std::vector<std::vector<Op>>> by_size_;
};

}  // namespace bytecomp::planner
