// Tensor fusion (issue 25 part 3): small gradients of a multi-node job are
// fused in ready order into buckets, and a bucket is one unit everywhere a
// tensor is: it has a tensor id (after the declared tensors), a plan,
// partitions on the servers (equal shards over every server) or a ring, one
// round per iteration in the daemons.
//
// The layout is a pure function of (declared tensors, their plans at the
// job's first iteration, FusionConfig): the coordinator, every server and
// every node compute it themselves, and the assignment digest they compare
// (server/job.h) covers the buckets' partitions. The FusionConfig comes from
// the daemons' configuration in each node's registration (the coordinator
// refuses nodes that differ) and is handed to everyone in the admission.
//
// Which tensors fuse: a tensor's plan must be one whose result does not
// depend on where the tensor's elements sit in a partition, so that fusing
// cannot change the sum: uncompressed, or fp16/bf16 without error feedback
// (elementwise casts, no state), placed on the servers sharded over all of
// them ("ps") or on the daemons' ring ("ring"), its compression on the CPU
// (the client never compresses it itself). Only tensors with identical plans
// share a bucket. Compressed tensors (every other compressor), ps_single and
// allgather tensors are never fused, nor tensors named "bytecomp.*"
// (bytecomp.torch's control job pushes one alone and only broadcasts the
// others: a bucket of them would never fill), nor tensors whose option has
// pieces > 1 (strategy::tensor_partition_bytes: their partitions are cut
// smaller on purpose, each its own chain; a bucket is cut into equal shards
// instead, so a fused member's pieces would silently mean nothing).
//
// Order: DDP's. Backward produces gradients in reverse declaration order, so
// buckets are filled from the last declared tensor to the first; per plan
// class, the first bucket holds at most first_bucket_bytes (it becomes ready
// early, so the network starts early), later ones at most bucket_cap_bytes.
// A tensor larger than the bucket it would start stays alone (unfused); a
// bucket that would hold one tensor is not made.
//
// Thread-safety: plain values and pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "planner/strategy/plan.h"

namespace bytecomp::server {

struct FusionConfig {
  bool enabled = false;
  uint64_t first_bucket_bytes = 1ull << 20;
  uint64_t bucket_cap_bytes = 25ull << 20;
  bool operator==(const FusionConfig&) const = default;
  // "enabled, first bucket 1048576 B, cap 26214400 B" / "disabled".
  std::string describe() const;
};

struct Bucket {
  std::vector<uint32_t> members;  // declared tensor ids, in ready order
  std::vector<uint64_t> offsets;  // each member's first element in the bucket
  uint64_t count = 0;             // elements (float32)
};

// The job's units: what the servers, the coordinator and the daemons' paths
// run. Unit u < declared is declared tensor u (members of buckets keep their
// ids, and their partitions on the servers serve broadcasts only); unit
// declared + b is bucket b.
struct JobUnits {
  size_t declared = 0;
  std::vector<strategy::PlanTensor> tensors;  // declared, then one per bucket
  std::vector<strategy::TensorPlan> plans;    // the same, per unit
  std::vector<Bucket> buckets;
  std::vector<int32_t> bucket_of;  // per declared tensor: its bucket, or -1

  bool fused(uint32_t tensor) const {
    return tensor < bucket_of.size() && bucket_of[tensor] >= 0;
  }
  bool is_bucket(uint32_t unit) const { return unit >= declared && unit < tensors.size(); }
  const Bucket& bucket(uint32_t unit) const { return buckets.at(unit - declared); }
};

// True when a tensor with `plan` may be fused (see above).
bool fusable(const strategy::TensorPlan& plan);

// The layout. `plans` are the declared tensors' plans (plan_job). Disabled
// fusion yields the declared tensors alone. Throws Error(kInvalidArgument)
// when plans and tensors differ in number.
JobUnits fuse_job(const std::vector<strategy::PlanTensor>& tensors,
                  const std::vector<strategy::TensorPlan>& plans, const FusionConfig& config);

// The unit plans of a later strategy on the job's fixed layout: each bucket
// takes its members' plan, which must still be identical and fusable;
// otherwise Error(kInvalidArgument) naming the bucket, the member and both
// plans (the coordinator refuses such a change: the layout is the job's).
std::vector<strategy::TensorPlan> unit_plans(const JobUnits& units,
                                             const std::vector<strategy::TensorPlan>& plans);

// Elements per partition of unit `unit` on the servers: a sharded bucket is
// cut into equal shards, k per server, each at most partition_bytes and a
// multiple of 16 elements (64 bytes, the daemons' partition granularity),
// k up to 4 while shards stay >= 64 KiB (so pushes and pulls pipeline); 0
// for everything else (partition_bytes / 4).
uint64_t shard_elements(const JobUnits& units, uint32_t unit, size_t servers,
                        uint64_t partition_bytes);
// Per unit, for assign_partitions.
std::vector<uint64_t> shard_elements(const JobUnits& units, size_t servers,
                                     uint64_t partition_bytes);

// A unit's partition size in bytes, the one rule every party cuts by
// (assign_partitions, the daemons' paths, scheduler and shared-memory
// header): a sharded bucket's equal shards (shard_elems > 0, from
// shard_elements), else its plan's (strategy::tensor_partition_bytes: the
// option's pieces; a bucket's members never have pieces > 1).
inline uint64_t unit_partition_bytes(const strategy::TensorPlan& plan, uint64_t shard_elems,
                                     uint64_t partition_bytes) {
  return shard_elems > 0 ? shard_elems * 4
                         : strategy::tensor_partition_bytes(plan, partition_bytes);
}
// Per unit of `units` (units.plans: the job's first plans).
std::vector<uint64_t> unit_partition_bytes(const JobUnits& units, size_t servers,
                                           uint64_t partition_bytes);

}  // namespace bytecomp::server
