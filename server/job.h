// What a job is, as the parameter server and its clients (bytecompd) both see
// it: the declaration every node sends, the per-tensor PS plan derived from
// the strategy, and the partition assignment.
//
// The assignment is a pure function of (declaration, strategy, server list,
// partition size): the coordinator, every server and every node compute it
// themselves and compare a digest, so nobody depends on a shipped table.
//
// Thread-safety: plain values and pure functions; safe to share const.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "compress/compressor.h"
#include "planner/strategy.h"
#include "transport/transport.h"

namespace bytecomp::server {

using transport::NodeId;

// One declared tensor. The PS sums fp32 gradients only: dtype must be
// kFloat32 (half-precision traffic is expressed as an fp16/bf16 compressor).
struct TensorSpec {
  std::string name;
  uint64_t count = 0;  // elements
  compress::DType dtype = compress::DType::kFloat32;
  bool operator==(const TensorSpec&) const = default;
};

// What a node declares when it registers a job. Every node of a job must
// declare the same name, nodes, tensors (names, counts, dtypes, order),
// deterministic and start_iteration; the coordinator names the first
// difference otherwise. strategy_yaml is taken from rank 0 (others may leave
// it empty).
struct JobSpec {
  std::string name;             // unique among the cluster's running jobs
  std::vector<NodeId> nodes;    // participating daemons, in rank order
  std::vector<TensorSpec> tensors;
  std::string strategy_yaml;    // planner format; empty = all tensors uncompressed, ps
  bool deterministic = false;   // sum in rank order (bitwise reproducible)
  uint64_t start_iteration = 0; // first iteration pushed
  // This node's endpoint for the other nodes' daemons (peer allgather);
  // empty when it has none. Per node, so never compared between nodes: the
  // coordinator hands every node the list at admission.
  std::string peer_address;
};

// How the parameter servers handle one tensor (derived from its strategy
// option by plan_for_option).
enum class Placement : uint8_t {
  kSharded = 0,  // "ps": partitions spread over every server
  kSingle = 1,   // "ps_single": every partition on one server
  kPeer = 2,     // "allgather" between daemons: not on any server
};
enum class SumMode : uint8_t {
  kDense = 0,       // fp32 sum; pushes decompressed-and-accumulated into it
  kCompressed = 1,  // additive compressor: pushes summed compressed (aggregate())
};
enum class PullFormat : uint8_t {
  kFp32 = 0,        // the fp32 sum, raw little-endian floats
  kFp16 = 1,        // the sum as raw fp16 words (count * 2 bytes)
  kCompressed = 2,  // the sum compressed with the tensor's compressor
};
std::string_view to_string(Placement p) noexcept;
std::string_view to_string(SumMode m) noexcept;
std::string_view to_string(PullFormat f) noexcept;

struct TensorPlan {
  Placement placement = Placement::kSharded;
  // Empty name = pushes are raw fp32 (count * 4 bytes). Otherwise every push
  // is one buffer produced by this compressor for the partition's elements.
  compress::CompressorSpec compressor;
  SumMode sum = SumMode::kDense;
  PullFormat pull = PullFormat::kFp32;
  // Server-side error feedback when pull == kCompressed and sum == kDense.
  bool server_error_feedback = false;

  bool compressed_push() const { return !compressor.name.empty(); }
  std::string describe() const;
  bool operator==(const TensorPlan&) const = default;
};

// The mapping from the planner's option (docs/server.md has the table):
//   inter allgather                       -> kPeer (not on any server)
//   compressor none                       -> dense sum, pull fp32
//   additive compressor (fp16, bf16, randomk) under a reducing inter
//   collective (reduce_scatter_allgather, reduce_broadcast)
//                                         -> compressed-domain sum, pull compressed
//   fp16 under alltoall_allgather / gather_broadcast
//                                         -> dense sum, pull fp16 (raw words)
//   any other compressor under alltoall_allgather / gather_broadcast
//                                         -> dense sum, pull recompressed, with
//                                            server EF = option.error_feedback
// inter reduce_broadcast / gather_broadcast place the tensor on one server
// (ps_single); the others shard it over every server (ps).
// Throws Error(kInvalidArgument) naming the tensor for options the PS cannot
// run (a non-additive compressor under a reducing collective).
TensorPlan plan_for_option(const planner::Option& option, std::string_view tensor);

// Resolves every tensor's option in `strategy_yaml` (empty = default
// Strategy) and maps it. Throws Error(kInvalidArgument) / config::ConfigError
// naming the tensor or YAML location.
std::vector<TensorPlan> plan_job(const std::vector<TensorSpec>& tensors,
                                 std::string_view strategy_yaml);

struct ServerInfo {
  NodeId id = 0;
  std::string address;       // as the server's clients reach it
  uint32_t engine_threads = 1;
  bool operator==(const ServerInfo&) const = default;
};

// One partition: a contiguous range of one tensor, owned by one engine
// thread of one server. key = (tensor << 32) | index: the wire key of its
// pushes and pulls.
struct Partition {
  uint64_t key = 0;
  uint32_t tensor = 0;
  uint32_t index = 0;   // within the tensor
  uint64_t offset = 0;  // first element
  uint64_t count = 0;   // elements
  NodeId server = 0;
  uint32_t engine = 0;
  bool operator==(const Partition&) const = default;
};

inline uint64_t partition_key(uint32_t tensor, uint32_t index) {
  return (uint64_t{tensor} << 32) | index;
}

struct Assignment {
  std::vector<Partition> partitions;            // ordered by key
  std::vector<std::vector<uint32_t>> by_tensor; // tensor -> indices into partitions
  uint64_t digest = 0;                          // over everything above

  const Partition* find(uint64_t key) const;
};

// The pure assignment function. Tensors are cut into partitions of at most
// partition_bytes (fp32 bytes; the last one may be shorter). Placement
// kPeer tensors get none. Balancing (greedy, largest first, ties by key):
// each kSharded partition goes to the server with the fewest assigned bytes,
// each kSingle tensor as a whole to the least-loaded server; then within a
// server each partition goes to its least-loaded engine thread. Servers are
// taken in the given order; ties go to the earlier one. Throws
// Error(kInvalidArgument) for an empty server list (when any partition
// exists), partition_bytes < 4, or plans.size() != tensors.size().
Assignment assign_partitions(const std::vector<TensorSpec>& tensors,
                             const std::vector<TensorPlan>& plans,
                             const std::vector<ServerInfo>& servers,
                             uint64_t partition_bytes);

// Seed shared by every node (and the servers) for one partition: the
// CompressContext::shared_seed of its compressions (randomk index selection).
uint64_t partition_seed(std::string_view job_name, uint64_t key);

// Bytes a push / a pull answer of `count` elements may have under `plan`
// (exact for raw formats, an upper bound for compressed ones).
uint64_t push_bytes_bound(const TensorPlan& plan, uint64_t count);
uint64_t pull_bytes_bound(const TensorPlan& plan, uint64_t count);

}  // namespace bytecomp::server
