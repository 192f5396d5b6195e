// What a job is, as the parameter server and its clients (bytecompd) both see
// it: the declaration every node sends, its per-tensor plans (from the
// strategy library) and the partition assignment.
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
#include "planner/strategy/partition.h"
#include "server/fusion.h"
#include "planner/strategy/plan.h"
#include "transport/transport.h"

namespace bytecomp::server {

using transport::NodeId;

// One declared tensor (the strategy library's description). The PS sums
// fp32 gradients only: dtype must be kFloat32 (half-precision traffic is
// expressed as an fp16/bf16 compressor).
using TensorSpec = strategy::PlanTensor;

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
  // Tensor fusion (server/fusion.h), from the daemon's configuration; every
  // node of a job must send the same (an auto job sends it disabled).
  FusionConfig fusion;
  // Strategy auto: this node's settings (strategy::AutoSpec::to_yaml), with
  // strategy_yaml empty; empty otherwise. The coordinator picks the job's
  // start placement from them at admission, where the inputs (every node's
  // peer endpoint, the cluster's partition_bytes) are the same for all.
  std::string auto_spec_yaml;
};

// The per-tensor plan and the option -> plan mapping live in the strategy
// library (planner/strategy/plan.h); plan_job() applies it to a declaration.
using strategy::Placement;
using strategy::PullFormat;
using strategy::SumMode;
using strategy::TensorPlan;
using strategy::plan_for_option;
using strategy::pull_bytes_bound;
using strategy::push_bytes_bound;
using strategy::partition_key;
using strategy::partition_seed;

// The servers' and the coordinator's name for strategy::plans_for in
// Scope::kCluster: resolves every tensor's option in `strategy_yaml` (empty =
// default Strategy) and maps it. Throws Error(kInvalidArgument) /
// config::ConfigError naming the tensor or YAML location.
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

struct Assignment {
  std::vector<Partition> partitions;            // ordered by key
  std::vector<std::vector<uint32_t>> by_tensor; // tensor -> indices into partitions
  uint64_t digest = 0;                          // over everything above

  const Partition* find(uint64_t key) const;
};

// The pure assignment function. Tensors are cut into partitions of at most
// unit_partition_bytes(plan, shard_elems[t], partition_bytes) (server/fusion.h;
// fp32 bytes: a fused bucket's equal shards, else the job's partition size
// cut into the option's `pieces`; the last one may be shorter), so the digest
// covers every tensor's pieces and every bucket's shards. Placement kPeer
// tensors (allgather between daemons) get none. Balancing (greedy, largest
// first, ties by key): each kSharded partition goes to the server with the
// fewest assigned bytes, each kSingle tensor as a whole to the least-loaded
// server; then within a server each partition goes to its least-loaded
// engine thread. kRing tensors (the daemons' ring) get partitions too, as
// kSharded ones, so that a strategy change may move them to ps at one
// iteration (strategy::placement_switchable): they are placed after every
// other partition, on servers and then on engines, so the other tensors'
// places are exactly those of the same job without them (a tensor moving
// between ring and ps moves nobody else). Servers are
// taken in the given order; ties go to the earlier one. Throws
// Error(kInvalidArgument) for an empty server list (when any partition
// exists), partition_bytes < 4, or plans.size() != tensors.size().
// shard_elems (server/fusion.h's shard_elements, may be empty): per tensor, a
// partition size in elements for fused buckets (0: the plan's); such a
// kSharded tensor's partitions are placed first, round-robin from the least
// loaded server, so every server holds an equal share of it.
Assignment assign_partitions(const std::vector<TensorSpec>& tensors,
                             const std::vector<TensorPlan>& plans,
                             const std::vector<ServerInfo>& servers,
                             uint64_t partition_bytes,
                             const std::vector<uint64_t>& shard_elems = {});

}  // namespace bytecomp::server
