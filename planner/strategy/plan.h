// From a strategy option to what the runtime executes for one tensor: the one
// plan type the daemon (every path) and the parameter servers use, and the one
// mapping that produces it.
//
// The mapping (docs/server.md has the table):
//   inter allgather                       -> kPeer (not on any server)
//   inter allreduce with compressor none, fp16 or bf16
//                                         -> kRing (ring allreduce between the
//                                            daemons, not on any server)
//   compressor none                       -> dense sum, pull fp32
//   additive compressor (fp16, bf16, randomk) under a reducing inter
//   collective (reduce_scatter_allgather, reduce_broadcast)
//                                         -> compressed-domain sum, pull compressed
//   fp16 under alltoall_allgather / gather_broadcast
//                                         -> dense sum, pull fp16 (raw words)
//   any other compressor under alltoall_allgather / gather_broadcast
//                                         -> dense sum, pull recompressed, with
//                                            server EF = option.error_feedback,
//                                            or always for built-in feedback
//                                            (dgc, efsignsgd, onebit)
// inter reduce_broadcast / gather_broadcast place the tensor on one server
// (ps_single); the others shard it over every server (ps).
//
// Error feedback ("ef" of compressors that have it) depends on the scope:
//   Scope::kCluster (servers and the nodes' push path, plan_job): ef is the
//     option's error_feedback under a gathering inter collective; under a
//     reducing one the servers sum the pushes compressed and ef stays at the
//     compressor's own default (randomk: on). A peer or ring tensor (no
//     server handles it) gets its compressor with the kNode rules below.
//   Scope::kNode (a daemon running the option by itself: one-node jobs, peer
//     allgather; make_plans): ef is always the option's error_feedback;
//     params.ef is refused, and error_feedback on a compressor without it
//     (unless its feedback is built in: efsignsgd, onebit) is refused.
//
// Thread-safety: TensorPlan is an immutable value once built (its compressor
// is thread-safe and shared); the functions are pure.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/types.h"
#include "compress/compressor.h"
#include "planner/strategy/strategy.h"

namespace bytecomp::strategy {

// How the parameter servers handle one tensor.
enum class Placement : uint8_t {
  kSharded = 0,  // "ps": partitions spread over every server
  kSingle = 1,   // "ps_single": every partition on one server
  kPeer = 2,     // "allgather" between daemons: not on any server
  kRing = 3,     // "ring": allreduce between daemons, not on any server
};
// True for placements no parameter server handles.
inline bool between_daemons(Placement p) { return p == Placement::kPeer || p == Placement::kRing; }
enum class SumMode : uint8_t {
  kDense = 0,       // fp32 sum; pushes decompressed-and-accumulated into it
  kCompressed = 1,  // additive compressor: pushes summed compressed (aggregate())
};
// Format of a pull answer (planner/strategy/answer.h encodes and decodes it).
enum class PullFormat : uint8_t {
  kFp32 = 0,        // the fp32 sum, raw little-endian floats
  kFp16 = 1,        // the sum as raw fp16 words (count * 2 bytes)
  kCompressed = 2,  // the sum compressed with the tensor's compressor
};
std::string_view to_string(Placement p) noexcept;
std::string_view to_string(SumMode m) noexcept;
std::string_view to_string(PullFormat f) noexcept;

enum class Scope : uint8_t { kCluster, kNode };

// Copying a plan (once per partition on the PS and peer paths) costs two
// reference counts and allocates nothing: what it owns is shared.
struct TensorPlan {
  Placement placement = Placement::kSharded;
  SumMode sum = SumMode::kDense;
  PullFormat pull = PullFormat::kFp32;
  // Server-side error feedback when pull == kCompressed and sum == kDense.
  bool server_error_feedback = false;
  // The compressor every node runs on the tensor; null = uncompressed
  // (pushes are raw fp32, count * 4 bytes).
  std::shared_ptr<const compress::Compressor> compressor;
  // The strategy option the plan was made from (null in a default plan).
  std::shared_ptr<const strategy::Option> option;

  bool compressed_push() const { return compressor != nullptr; }
  // Canonical spec of `compressor` (every parameter filled in); empty name
  // when uncompressed.
  const compress::CompressorSpec& spec() const;
  // "<option> -> ps push=... sum=... pull=..." (the option part when known).
  std::string describe() const;
  // Equal when they put the same bytes on the wire (placement, spec, sum,
  // pull, server EF); which objects are shared does not matter. Plans
  // sharing one compressor compare without calling into it.
  bool operator==(const TensorPlan& o) const {
    return placement == o.placement && sum == o.sum && pull == o.pull &&
           server_error_feedback == o.server_error_feedback &&
           (compressor == o.compressor || spec() == o.spec());
  }
};

// The mapping above. Throws Error(kInvalidArgument) "tensor '<name>': <why>"
// for options it cannot run (a non-additive compressor under a reducing
// collective, bad compressor parameters, and the kNode refusals).
TensorPlan plan_for_option(const strategy::Option& option, std::string_view tensor,
                           Scope scope = Scope::kCluster);

// One declared tensor of a job: the one description the daemon, the PS
// protocol (server::TensorSpec), the engine (daemon::TensorSpec) and the
// plan mapping share. The compressors take float32 only.
struct PlanTensor {
  std::string name;
  uint64_t count = 0;  // elements
  DType dtype = DType::kFloat32;

  uint64_t bytes() const { return count * dtype_size(dtype); }
  bool operator==(const PlanTensor&) const = default;
};

// Scope::kNode plans for a daemon's job: checks the strategy against the
// tensors (Strategy::check_cpu_runtime) and fails with one message naming
// `source` (the strategy file), the tensor and the reason: an entry for an
// undeclared tensor, an option the CPU runtime cannot execute, a compressor
// on a tensor that is not float32, bad compressor parameters, or error
// feedback asked of a compressor that has none. Throws Error(kInvalidArgument).
std::vector<TensorPlan> make_plans(const strategy::Strategy& strategy, const std::string& source,
                                   std::span<const PlanTensor> tensors);

// Plans without a strategy: every tensor uncompressed.
std::vector<TensorPlan> uncompressed_plans(size_t n);

// Option::pieces executed: the partition size of one tensor. The job's
// partition size (the cluster's, or a one-node daemon's) is cut into the
// option's `pieces` slices, each rounded down to a multiple of
// kSliceAlignBytes (whole elements of every dtype, and the 64-byte alignment
// the daemon's scheduler and the clients' compressed payload layout keep),
// never below kSliceAlignBytes. pieces 1 (or a plan without an option):
// partition_bytes unchanged. A tensor of b bytes then runs as
// partition_count(b, tensor_partition_bytes(...)) partitions, each the
// option's whole chain with its own key, seed and state. This is the one
// function every party derives the layout with: assign_partitions (the
// coordinator, every server and node compare its digest), the daemon's paths
// and scheduler, and the shared-memory header clients read (TensorSlot).
// Because it depends on the plan, a strategy change that changes a tensor's
// pieces changes its layout: refused (the coordinator, and the daemon for a
// one-node job), like a move to or from ps_single or allgather.
inline constexpr uint64_t kSliceAlignBytes = 64;
int plan_pieces(const TensorPlan& plan);
uint64_t tensor_partition_bytes(const TensorPlan& plan, uint64_t partition_bytes);
// Partitions of `bytes` bytes cut every `part` bytes: at least 1 (a tensor
// of 0 bytes still runs one, as the scheduler does).
inline uint64_t partition_count(uint64_t bytes, uint64_t part) {
  return bytes == 0 || part == 0 ? 1 : (bytes + part - 1) / part;
}
// Empty when `to` keeps every tensor's partition layout of `from` (same
// pieces); else "tensor '<name>' would change pieces from a to b (...)".
std::string layout_change(std::span<const PlanTensor> tensors, const std::vector<TensorPlan>& from,
                          const std::vector<TensorPlan>& to);

// Placements a running job may move a tensor between at one iteration: the
// daemons' ring (kRing) and sharded push/pull (kSharded). Every server holds
// partitions for both (assign_partitions gives ring tensors theirs, after
// every other tensor's), and the daemons pick the path per round from the
// plan in force, so the move needs no new layout. ps_single (one server for
// the whole tensor) and allgather (between daemons, no server state) keep
// their placement for the job.
bool placement_switchable(Placement from, Placement to);
// Empty when `to` keeps every tensor's placement of `from` or moves it only
// as placement_switchable allows; else "tensor '<name>' would move from a to
// b (...: a placement change needs a new job)".
std::string placement_change(std::span<const PlanTensor> tensors,
                             const std::vector<TensorPlan>& from,
                             const std::vector<TensorPlan>& to);

// Bytes a push / a pull answer of `count` elements may have under `plan`
// (exact for raw formats, an upper bound for compressed ones).
uint64_t push_bytes_bound(const TensorPlan& plan, uint64_t count);
uint64_t pull_bytes_bound(const TensorPlan& plan, uint64_t count);

}  // namespace bytecomp::strategy
