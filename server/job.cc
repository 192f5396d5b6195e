#include "server/job.h"

#include <algorithm>
#include <numeric>
#include <sstream>

#include "planner/strategy/timeline.h"

namespace bytecomp::server {

std::vector<TensorPlan> plan_job(const std::vector<TensorSpec>& tensors,
                                 std::string_view strategy_yaml) {
  return strategy::plans_for(strategy::Scope::kCluster, tensors, strategy_yaml, "strategy");
}

const Partition* Assignment::find(uint64_t key) const {
  auto it = std::lower_bound(partitions.begin(), partitions.end(), key,
                             [](const Partition& p, uint64_t k) { return p.key < k; });
  if (it == partitions.end() || it->key != key) return nullptr;
  return &*it;
}

namespace {

size_t least_loaded(const std::vector<uint64_t>& load) {
  return static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
}

}  // namespace

Assignment assign_partitions(const std::vector<TensorSpec>& tensors,
                             const std::vector<TensorPlan>& plans,
                             const std::vector<ServerInfo>& servers,
                             uint64_t partition_bytes,
                             const std::vector<uint64_t>& shard_elems) {
  if (plans.size() != tensors.size())
    throw Error(ErrorCode::kInvalidArgument,
                "assign_partitions: " + std::to_string(plans.size()) + " plans for " +
                    std::to_string(tensors.size()) + " tensors");
  if (partition_bytes < 4)
    throw Error(ErrorCode::kInvalidArgument,
                "assign_partitions: partition_bytes " + std::to_string(partition_bytes) +
                    " is below one fp32 element");
  if (tensors.size() > 0xFFFFFFFFull)
    throw Error(ErrorCode::kInvalidArgument, "assign_partitions: too many tensors");

  Assignment a;
  a.by_tensor.resize(tensors.size());
  for (uint32_t t = 0; t < tensors.size(); ++t) {
    if (plans[t].placement == Placement::kPeer) continue;
    // The unit's partition size as the nodes cut it: a fused bucket's equal
    // shards, else the tensor's option's pieces (server/fusion.h).
    const uint64_t tper =
        unit_partition_bytes(plans[t], t < shard_elems.size() ? shard_elems[t] : 0,
                             partition_bytes) /
        4;
    uint64_t n = tensors[t].count;
    uint64_t parts = n == 0 ? 0 : (n + tper - 1) / tper;
    if (parts > 0xFFFFFFFFull)
      throw Error(ErrorCode::kInvalidArgument,
                  "assign_partitions: tensor '" + tensors[t].name + "' has too many partitions");
    for (uint64_t i = 0; i < parts; ++i) {
      Partition p;
      p.tensor = t;
      p.index = static_cast<uint32_t>(i);
      p.key = partition_key(t, p.index);
      p.offset = i * tper;
      p.count = std::min(tper, n - p.offset);
      a.partitions.push_back(p);
    }
  }
  if (!a.partitions.empty() && servers.empty())
    throw Error(ErrorCode::kInvalidArgument, "assign_partitions: no servers");

  // Units placed on a server: a sharded partition alone, a single-server
  // tensor with all its partitions. Largest first, ties by first key.
  struct Unit {
    uint64_t bytes = 0;
    uint64_t first_key = 0;
    std::vector<size_t> parts;
  };
  std::vector<Unit> units;
  // Ring tensors' partitions (server rounds for a later switch to ps): placed
  // after every other unit, on servers and engines, so the push/pull
  // tensors' places are those of a job without them and the ring ones take
  // what is least loaded after them.
  std::vector<Unit> ring_units;
  std::vector<uint64_t> server_load(servers.size(), 0);
  std::vector<std::vector<size_t>> on_server(servers.size());
  // Equal shards first: shard i of a bucket on server (s0 + i) mod S, s0 the
  // least loaded so far, so no server carries more than its share of any
  // bucket (the greedy placement below balances whole partitions only).
  std::vector<bool> sharded(tensors.size(), false);
  for (uint32_t t = 0; t < tensors.size() && t < shard_elems.size(); ++t)
    sharded[t] = shard_elems[t] > 0 && plans[t].placement != Placement::kPeer &&
                 plans[t].placement != Placement::kRing &&
                 plans[t].placement != Placement::kSingle;
  {
    size_t i = 0;
    while (i < a.partitions.size()) {
      const uint32_t t = a.partitions[i].tensor;
      if (!sharded[t]) {
        ++i;
        continue;
      }
      const size_t s0 = least_loaded(server_load);
      for (size_t k = 0; i < a.partitions.size() && a.partitions[i].tensor == t; ++i, ++k) {
        const size_t s = (s0 + k) % servers.size();
        server_load[s] += a.partitions[i].count * 4;
        a.partitions[i].server = servers[s].id;
        on_server[s].push_back(i);
      }
    }
  }
  {
    std::vector<int64_t> single_unit(tensors.size(), -1);
    for (size_t i = 0; i < a.partitions.size(); ++i) {
      const Partition& p = a.partitions[i];
      if (sharded[p.tensor]) continue;
      if (plans[p.tensor].placement == Placement::kRing) {
        ring_units.push_back({p.count * 4, p.key, {i}});
      } else if (plans[p.tensor].placement == Placement::kSingle) {
        if (single_unit[p.tensor] < 0) {
          single_unit[p.tensor] = static_cast<int64_t>(units.size());
          units.push_back({0, p.key, {}});
        }
        Unit& u = units[static_cast<size_t>(single_unit[p.tensor])];
        u.bytes += p.count * 4;
        u.parts.push_back(i);
      } else {
        units.push_back({p.count * 4, p.key, {i}});
      }
    }
  }
  auto by_size = [](const Unit& x, const Unit& y) {
    return x.bytes != y.bytes ? x.bytes > y.bytes : x.first_key < y.first_key;
  };
  std::stable_sort(units.begin(), units.end(), by_size);
  std::stable_sort(ring_units.begin(), ring_units.end(), by_size);
  std::vector<std::vector<size_t>> ring_on_server(servers.size());
  auto place = [&](const std::vector<Unit>& list, std::vector<std::vector<size_t>>& where) {
    for (const Unit& u : list) {
      size_t s = least_loaded(server_load);
      server_load[s] += u.bytes;
      for (size_t i : u.parts) {
        a.partitions[i].server = servers[s].id;
        where[s].push_back(i);
      }
    }
  };
  place(units, on_server);
  place(ring_units, ring_on_server);
  // Engines: largest partition first within each server, the ring tensors'
  // after the others (on the load those left).
  for (size_t s = 0; s < servers.size(); ++s) {
    std::vector<uint64_t> engine_load(std::max<uint32_t>(1, servers[s].engine_threads), 0);
    for (std::vector<size_t>* idx : {&on_server[s], &ring_on_server[s]}) {
      std::stable_sort(idx->begin(), idx->end(), [&](size_t x, size_t y) {
        const Partition& px = a.partitions[x];
        const Partition& py = a.partitions[y];
        return px.count != py.count ? px.count > py.count : px.key < py.key;
      });
      for (size_t i : *idx) {
        size_t e = least_loaded(engine_load);
        engine_load[e] += a.partitions[i].count * 4;
        a.partitions[i].engine = static_cast<uint32_t>(e);
      }
    }
  }
  // FNV-1a over the fields, so every party can compare assignments cheaply.
  strategy::Fnv1a d;
  for (size_t i = 0; i < a.partitions.size(); ++i) {
    const Partition& p = a.partitions[i];
    a.by_tensor[p.tensor].push_back(static_cast<uint32_t>(i));
    d.add(p.key);
    d.add(p.offset);
    d.add(p.count);
    d.add(p.server);
    d.add(p.engine);
  }
  a.digest = d.h;
  return a;
}

}  // namespace bytecomp::server
