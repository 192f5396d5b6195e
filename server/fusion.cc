#include "server/fusion.h"

#include <algorithm>

#include "common/error.h"

namespace bytecomp::server {

using strategy::Placement;
using strategy::TensorPlan;

std::string FusionConfig::describe() const {
  if (!enabled) return "disabled";
  return "enabled, first bucket " + std::to_string(first_bucket_bytes) + " B, cap " +
         std::to_string(bucket_cap_bytes) + " B";
}

bool fusable(const TensorPlan& plan) {
  if (plan.placement != Placement::kSharded && plan.placement != Placement::kRing) return false;
  if (plan.server_error_feedback) return false;
  // Pieces cut a tensor's partitions smaller; a bucket has equal shards.
  if (strategy::plan_pieces(plan) > 1) return false;
  if (plan.option) {
    const strategy::Option& o = *plan.option;
    // The client compresses GPU options itself, per tensor partition.
    if (o.comp_device != Device::kCpu || o.decomp_device != Device::kCpu) return false;
    if (o.cpu_share != 0.0 || o.error_feedback) return false;
  }
  if (!plan.compressed_push()) return true;
  const compress::CompressorSpec& spec = plan.spec();
  if (spec.name != "fp16" && spec.name != "bf16") return false;
  // A cast with feedback keeps a residual per partition: not elementwise.
  auto ef = spec.params.find("ef");
  return ef == spec.params.end() || ef->second == "0" || ef->second == "false";
}

JobUnits fuse_job(const std::vector<strategy::PlanTensor>& tensors,
                  const std::vector<TensorPlan>& plans, const FusionConfig& config) {
  if (plans.size() != tensors.size())
    throw Error(ErrorCode::kInvalidArgument,
                "fuse_job: " + std::to_string(plans.size()) + " plans for " +
                    std::to_string(tensors.size()) + " tensors");
  JobUnits u;
  u.declared = tensors.size();
  u.tensors = tensors;
  u.plans = plans;
  u.bucket_of.assign(tensors.size(), -1);
  if (!config.enabled) return u;

  // Open bucket per plan class (the class's representative plan, its bucket
  // being filled, and whether the class already closed its first bucket).
  struct Open {
    const TensorPlan* plan = nullptr;
    Bucket bucket;
    bool first_done = false;
  };
  std::vector<Open> open;
  std::vector<Bucket> made;
  auto close = [&](Open& o) {
    if (!o.bucket.members.empty()) o.first_done = true;
    if (o.bucket.members.size() >= 2) made.push_back(std::move(o.bucket));
    o.bucket = Bucket{};
  };
  for (size_t i = tensors.size(); i-- > 0;) {
    const auto t = static_cast<uint32_t>(i);
    if (!fusable(plans[t]) || tensors[t].dtype != DType::kFloat32 || tensors[t].count == 0)
      continue;
    // bytecomp.torch's own tensors (its control job's): pushed one at a
    // time or only broadcast, so a bucket of them would never fill.
    if (tensors[t].name.rfind("bytecomp.", 0) == 0) continue;
    auto it = std::find_if(open.begin(), open.end(),
                           [&](const Open& o) { return *o.plan == plans[t]; });
    if (it == open.end()) {
      open.push_back(Open{&plans[t], {}, false});
      it = open.end() - 1;
    }
    Open& o = *it;
    const uint64_t bytes = tensors[t].bytes();
    const uint64_t limit = o.first_done ? config.bucket_cap_bytes : config.first_bucket_bytes;
    if (!o.bucket.members.empty() && o.bucket.count * 4 + bytes > limit) {
      close(o);
    }
    const uint64_t fresh = o.first_done ? config.bucket_cap_bytes : config.first_bucket_bytes;
    if (o.bucket.members.empty() && bytes >= fresh) {
      // Larger than a whole bucket: alone (and the class's first bucket is
      // still to come only if it was never started: a large tensor does not
      // use it up).
      continue;
    }
    o.bucket.members.push_back(t);
    o.bucket.offsets.push_back(o.bucket.count);
    o.bucket.count += tensors[t].count;
  }
  for (Open& o : open) close(o);
  // Buckets in the order their last member becomes ready is what the
  // runtime cares about; ids only need to be deterministic: order by first
  // member (ready order), then by their second.
  std::stable_sort(made.begin(), made.end(), [](const Bucket& a, const Bucket& b) {
    return a.members.front() > b.members.front();
  });
  for (Bucket& b : made) {
    const auto id = static_cast<int32_t>(u.buckets.size());
    const uint32_t first = b.members.front();
    std::string name = "fused[";
    name += std::to_string(id) + "]:" + tensors[first].name + ".." + tensors[b.members.back()].name;
    u.tensors.push_back({name, b.count, DType::kFloat32});
    u.plans.push_back(plans[first]);
    for (uint32_t m : b.members) u.bucket_of[m] = id;
    u.buckets.push_back(std::move(b));
  }
  return u;
}

std::vector<TensorPlan> unit_plans(const JobUnits& units, const std::vector<TensorPlan>& plans) {
  if (plans.size() != units.declared)
    throw Error(ErrorCode::kInvalidArgument,
                "unit_plans: " + std::to_string(plans.size()) + " plans for " +
                    std::to_string(units.declared) + " tensors");
  std::vector<TensorPlan> out = plans;
  for (size_t b = 0; b < units.buckets.size(); ++b) {
    const Bucket& bucket = units.buckets[b];
    const std::string& bname = units.tensors[units.declared + b].name;
    const TensorPlan& first = plans[bucket.members.front()];
    for (uint32_t m : bucket.members) {
      const TensorPlan& p = plans[m];
      if (!fusable(p) || !(p == first) || p.placement != units.plans[units.declared + b].placement) {
        throw Error(ErrorCode::kInvalidArgument,
                    "tensor '" + units.tensors[m].name + "' is fused into bucket '" + bname +
                        "' (tensor fusion, fixed for the job), but the strategy gives it " +
                        p.describe() + (p == first ? std::string(" (not fusable)")
                                                   : ", and tensor '" +
                                                         units.tensors[bucket.members.front()].name +
                                                         "' of the same bucket " + first.describe()) +
                        "; a bucket's tensors must keep one fusable plan (uncompressed or "
                        "fp16/bf16 on the same path): change them together, or disable "
                        "fusion (fusion: {enabled: false} in bytecompd's configuration)");
      }
    }
    out.push_back(first);
  }
  return out;
}

uint64_t shard_elements(const JobUnits& units, uint32_t unit, size_t servers,
                        uint64_t partition_bytes) {
  if (!units.is_bucket(unit) || servers == 0) return 0;
  if (units.plans[unit].placement != Placement::kSharded) return 0;
  const uint64_t n = units.tensors[unit].count;
  const uint64_t per_max = std::max<uint64_t>(16, partition_bytes / 4 / 16 * 16);
  // k rounds of one shard per server, each shard at most partition_bytes,
  // and up to 4 while shards stay at least 64 KiB: a server's pull can
  // only start once every node pushed the shard, so one shard per server
  // leaves the links idle in turn (4 nodes at 100 Mbit/s: 0.87x of unfused
  // with one, see docs/daemon.md).
  constexpr uint64_t kMinShard = 16384;  // elements
  const uint64_t k = std::max<uint64_t>(
      {1, (n + servers * per_max - 1) / (servers * per_max),
       std::min<uint64_t>(4, n / (servers * kMinShard))});
  const uint64_t shards = k * servers;
  uint64_t per = (n + shards - 1) / shards;
  per = (per + 15) / 16 * 16;
  return std::min(per, per_max);
}

std::vector<uint64_t> shard_elements(const JobUnits& units, size_t servers,
                                     uint64_t partition_bytes) {
  std::vector<uint64_t> out(units.tensors.size(), 0);
  for (size_t u = units.declared; u < units.tensors.size(); ++u)
    out[u] = shard_elements(units, static_cast<uint32_t>(u), servers, partition_bytes);
  return out;
}

std::vector<uint64_t> unit_partition_bytes(const JobUnits& units, size_t servers,
                                           uint64_t partition_bytes) {
  if (units.plans.size() != units.tensors.size())
    throw Error(ErrorCode::kInvalidArgument,
                "unit_partition_bytes: " + std::to_string(units.plans.size()) + " plans for " +
                    std::to_string(units.tensors.size()) + " units");
  std::vector<uint64_t> out(units.tensors.size());
  for (size_t u = 0; u < units.tensors.size(); ++u)
    out[u] = unit_partition_bytes(
        units.plans[u], shard_elements(units, static_cast<uint32_t>(u), servers, partition_bytes),
        partition_bytes);
  return out;
}

}  // namespace bytecomp::server
