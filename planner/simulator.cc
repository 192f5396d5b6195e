#include "planner/simulator.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <sstream>

#include "common/error.h"

namespace bytecomp::planner {

const char* to_string(Resource r) {
  switch (r) {
    case Resource::kGpu: return "gpu";
    case Resource::kCpu: return "cpu";
    case Resource::kIntra: return "intra";
    case Resource::kInter: return "inter";
  }
  return "?";
}

namespace {

double param_or(const std::map<std::string, std::string>& p, const char* k, double def) {
  auto it = p.find(k);
  if (it == p.end()) return def;
  try {
    return std::stod(it->second);
  } catch (const std::exception&) {
    return def;
  }
}

bool has_device(const CompressorCost& c, Device d) {
  return d == Device::kCuda ? c.gpu.has_value() : c.cpu.has_value();
}

}  // namespace

Problem::Problem(Profile profile, Cluster cluster, CostTable costs, CompressorSpec spec,
                 Constraints constraints)
    : profile_(std::move(profile)),
      cluster_(std::move(cluster)),
      costs_(std::move(costs)),
      spec_(std::move(spec)),
      constraints_(constraints) {
  if (!costs_.find(spec_.name))
    throw Error(ErrorCode::kInvalidArgument,
                "the cost table '" + costs_.name + "' has no figures for compressor '" +
                    spec_.name + "'");
  // The table was measured at its own ratio; the wire size follows the
  // requested one (compression time is dominated by the O(n) pass).
  CompressorCost& cc = costs_.compressors[spec_.name];
  const double want = param_or(spec_.params, "ratio", -1);
  const double have = param_or(cc.params, "ratio", -1);
  if (want > 0 && have > 0) cc.bytes_per_element *= want / have;
  for (const auto& [k, v] : spec_.params) cc.params[k] = v;
  spec_.params = cc.params;
  if (cluster_.cpu_cores == 0) constraints_.allow_cpu = false;
  for (Option& o : enumerate_options(spec_, constraints_, cc.error_feedback)) {
    if (o.compressed()) {
      const CompressorCost* c = costs_.find(o.compressor);
      if (!c || !has_device(*c, o.comp_device) || !has_device(*c, o.decomp_device)) continue;
    }
    options_.push_back(std::move(o));
  }
  if (options_.empty())
    throw Error(ErrorCode::kInvalidArgument, "no option satisfies the constraints");
  tree_options_ = static_cast<int>(options_.size());
  pieced_.assign(options_.size(), 0);
  const uint64_t part_elems = cluster_.partition_bytes / 4;
  for (int i = 0; i < tensors(); ++i) {
    chunk_begin_.push_back(static_cast<int>(chunks_.size()));
    uint64_t left = profile_.tensors[i].elements;
    while (left > 0) {
      const uint64_t take = part_elems == 0 ? left : std::min(left, part_elems);
      chunks_.push_back({i, take});
      left -= take;
    }
  }
  chunk_begin_.push_back(static_cast<int>(chunks_.size()));
  std::map<uint64_t, int> ids;
  for (const Chunk& c : chunks_) {
    auto [it, fresh] = ids.emplace(c.elements, static_cast<int>(ids.size()));
    chunk_size_id_.push_back(it->second);
  }
  by_size_.assign(ids.size(), std::vector<std::vector<Op>>(options_.size()));

}

int Problem::find_option(const Option& o) const {
  for (size_t i = 0; i < options_.size(); ++i)
    if (options_[i] == o) return static_cast<int>(i);
  return -1;
}

int Problem::split_option(int base, double share) {
  Option o = options_[base];
  if (!(share > 0.0 && share < 1.0) || !o.compressed() || o.cpu_share > 0.0) return -1;
  if (o.comp_device == Device::kCpu && o.decomp_device == Device::kCpu) return -1;
  const CompressorCost* c = costs_.find(o.compressor);
  if (!constraints_.allow_cpu || constraints_.cpu_runtime_only || !c || !c->cpu) return -1;
  o.cpu_share = share;
  if (int idx = find_option(o); idx >= 0) return idx;
  pieced_.push_back(o.pieces > 1);
  options_.push_back(std::move(o));
  for (auto& v : by_size_) v.emplace_back();
  return static_cast<int>(options_.size()) - 1;
}

int Problem::pieces_option(int base, int pieces) {
  Option o = options_[base];
  if (constraints_.cpu_runtime_only) return -1;
  if (std::find(std::begin(Option::kAllowedPieces), std::end(Option::kAllowedPieces), pieces) ==
      std::end(Option::kAllowedPieces))
    return -1;
  if (o.pieces == pieces) return base;
  o.pieces = pieces;
  if (int idx = find_option(o); idx >= 0) return idx;
  pieced_.push_back(o.pieces > 1);
  options_.push_back(std::move(o));
  for (auto& v : by_size_) v.emplace_back();
  return static_cast<int>(options_.size()) - 1;
}

namespace {

constexpr size_t kMaxSlices = 8;
static_assert(std::size(Option::kAllowedPieces) > 0 &&
              Option::kAllowedPieces[std::size(Option::kAllowedPieces) - 1] <= kMaxSlices);

// Places a chain's operations from `ready` and returns the end of the last
// one. place(resource, t, duration) returns the start it got; emit(op,
// start, end) reports it. Groups (split by forks) are placed one after the
// other; the slices of a group are interleaved: the next operation placed
// is the one whose input is ready first (ties: the earlier slice).
template <class Place, class Emit>
double run_chain(const std::vector<Op>& ops, double ready, Place&& place, Emit&& emit) {
  double done = ready;
  const size_t n = ops.size();
  size_t g = 0;
  while (g < n) {
    size_t ge = g, slices = 1;
    while (ge < n && !(ops[ge].fork() && !ops[ge].slice())) {
      if (ops[ge].slice()) ++slices;
      ++ge;
    }
    if (slices == 1) {
      double t = ready;
      for (size_t k = g; k < ge; ++k) {
        const Op& op = ops[k];
        if (op.duration_us <= 0) continue;
        const double s = place(op.resource, t, op.duration_us);
        t = s + op.duration_us;
        emit(op, s, t);
      }
      done = std::max(done, t);
    } else {
      if (slices > kMaxSlices)
        throw Error(ErrorCode::kInternal, "a chain group has more slices than allowed");
      size_t pos[kMaxSlices], end[kMaxSlices];
      double t[kMaxSlices];
      size_t m = 0;
      pos[0] = g;
      for (size_t k = g; k < ge; ++k)
        if (ops[k].slice()) {
          end[m++] = k;
          pos[m] = k + 1;
        }
      end[m++] = ge;
      for (size_t i = 0; i < m; ++i) t[i] = ready;
      for (;;) {
        size_t best = m;
        for (size_t i = 0; i < m; ++i) {
          while (pos[i] < end[i] && ops[pos[i]].duration_us <= 0) ++pos[i];
          if (pos[i] < end[i] && (best == m || t[i] < t[best])) best = i;
        }
        if (best == m) break;
        const Op& op = ops[pos[best]++];
        const double s = place(op.resource, t[best], op.duration_us);
        t[best] = s + op.duration_us;
        emit(op, s, t[best]);
      }
      for (size_t i = 0; i < m; ++i) done = std::max(done, t[i]);
    }
    g = ge + 1;
  }
  return done;
}

}  // namespace

double chain_latency(const std::vector<Op>& ops) {
  {
    // Without slices (the common case, on the planner's hot path): the
    // longest sequence.
    double longest = 0, t = 0;
    bool sliced = false;
    for (const Op& op : ops) {
      if (op.fork()) {
        if ((sliced = op.slice())) break;
        t = 0;
        continue;
      }
      t += op.duration_us;
      longest = std::max(longest, t);
    }
    if (!sliced) return longest;
  }
  // Slices contend with each other: schedule them on idle resources as the
  // evaluator does (first fit into idle gaps, else after the last end).
  struct Local {
    std::vector<std::pair<double, double>> gaps;
    double last_end = 0;
  } res[kResources];
  auto place = [&](Resource r, double ready, double dur) {
    Local& l = res[static_cast<int>(r)];
    for (size_t k = 0; k < l.gaps.size(); ++k) {
      auto [gs, ge] = l.gaps[k];
      const double s = std::max(gs, ready);
      if (s + dur > ge + 1e-9) continue;
      l.gaps.erase(l.gaps.begin() + static_cast<long>(k));
      if (s + dur < ge - 1e-9) l.gaps.insert(l.gaps.begin() + static_cast<long>(k), {s + dur, ge});
      if (s > gs + 1e-9) l.gaps.insert(l.gaps.begin() + static_cast<long>(k), {gs, s});
      return s;
    }
    const double s = std::max(ready, l.last_end);
    if (s > l.last_end + 1e-9) l.gaps.push_back({l.last_end, s});
    l.last_end = s + dur;
    return s;
  };
  return run_chain(ops, 0.0, place, [](const Op&, double, double) {});
}

Problem Problem::zero_cost_copy() const {
  CostTable t = costs_;
  for (auto& [name, c] : t.compressors) {
    for (auto* d : {&c.gpu, &c.cpu})
      if (*d) **d = DeviceCost{};
  }
  Cluster cl = cluster_;
  cl.host_copy_gbps = 0;
  Problem p(profile_, cl, t, spec_, constraints_);
  return p;
}

const std::vector<Op>& Problem::chain(uint64_t elements, int opt) {
  auto& v = cache_[elements];
  if (v.size() < options_.size()) v.resize(options_.size());
  auto& c = v[opt];
  if (c.empty()) {
    c = build_chain(elements, options_[opt]);
    if (c.empty()) c.push_back({Resource::kInter, 0.0, "noop"});
  }
  return c;
}

std::vector<Op> Problem::build_chain(uint64_t elements, const Option& o) const {
  std::vector<Op> ops;
  ops.reserve(12);
  build_chain_into(elements, o, ops);
  return ops;
}

void Problem::chain_into(uint64_t elements, int opt, std::vector<Op>& out) const {
  out.clear();
  build_chain_into(elements, options_[opt], out);
}

void Problem::build_composite(uint64_t elements, const Option& o, std::vector<Op>& ops) const {
  if (o.cpu_share == 0.0) {
    // Pipelining: `pieces` slices, each the option's whole chain from the
    // tensor's ready time with its own fixed costs. The simulator
    // interleaves them (run_chain), so slice 1's compression takes the GPU
    // while slice 0 is on the links.
    Option one = o;
    one.pieces = 1;
    const auto q = static_cast<uint64_t>(o.pieces);
    for (uint64_t s = 0; s < q; ++s) {
      const uint64_t x = elements / q + (s < elements % q ? 1 : 0);
      if (x == 0) continue;
      if (s > 0) ops.push_back({Resource::kCpu, kSliceMark, "slice"});
      build_chain_into(x, one, ops);
    }
    return;
  }
  {
    // The CPU part and the GPU part are separate messages: two chains from
    // the same ready time, each with its own latencies. The CPU part goes
    // first (the runtime hands its partitions out first): its chain is the
    // longer one, and the parts share the links in this order. With pieces,
    // each part is cut into that many slices.
    const auto cpu_elems = static_cast<uint64_t>(std::llround(o.cpu_share * elements));
    Option gpu = o, cpu = o;
    gpu.cpu_share = cpu.cpu_share = 0.0;
    cpu.comp_device = cpu.decomp_device = Device::kCpu;
    if (cpu_elems > 0) build_chain_into(cpu_elems, cpu, ops);
    if (cpu_elems < elements) {
      if (!ops.empty()) ops.push_back({Resource::kCpu, kForkMark, "fork"});
      build_chain_into(elements - cpu_elems, gpu, ops);
    }
  }
}

void Problem::build_chain_into(uint64_t elements, const Option& o, std::vector<Op>& ops) const {
  if (o.cpu_share > 0.0 || o.pieces > 1) {
    build_composite(elements, o, ops);
    return;
  }
  const double n = static_cast<double>(elements);
  const double S = 4.0 * n;
  const int k = cluster_.gpus_per_machine, M = cluster_.machines;
  const double Bi = cluster_.intra.bytes_per_us(), ai = cluster_.intra.latency_us;
  const double Be = cluster_.inter.bytes_per_us(), ae = cluster_.inter.latency_us;
  const CompressorCost* cc = o.compressed() ? costs_.find(o.compressor) : nullptr;
  const double cores = std::max(1, cluster_.cpu_cores);
  const double copy_bpu = cluster_.host_copy_gbps * 1e3 / 8.0;
  auto wire = [&](double x) { return cc ? cc->wire_bytes(x) : 4.0 * x; };
  auto add = [&](Resource r, double d, const char* what) {
    if (d > 0) ops.push_back({r, d, what});
  };
  // (De)compression of `pieces` pieces of x elements on each of `par` GPUs'
  // data; on the CPU the machine's pool does all of it.
  //
  // CPU (de)compression moves raw data between the GPUs and the host (the
  // copies queue with the pool's work): the gradient goes in before the
  // first compression and the result comes out after the last
  // decompression, at its full size (pieces that are different shards come
  // out side by side). A decompress-sum-recompress in the middle of a chain
  // (remix) works on data that came over a link and leaves over one: raw
  // data crosses only when its two operations sit on different devices.
  // Compressed bytes crossing are small and not counted.
  auto copy = [&](double elems, int par) {
    return copy_bpu > 0 ? par * 4.0 * elems / copy_bpu : 0.0;
  };
  auto comp = [&](double x, int par, bool raw_on_gpu = true) {
    if (o.comp_device == Device::kCuda) {
      add(Resource::kGpu, cc->gpu->compress.at(x), "compress");
    } else {
      add(Resource::kCpu, par * cc->cpu->compress.at(x) / cores + (raw_on_gpu ? copy(x, par) : 0.0),
          "compress");
    }
  };
  // On the GPU the pieces one collective delivers are decoded by one batched
  // kernel (paper's V100 table: the decode cost of the "compress inter-node
  // only" option, which decodes all M gathered pieces, is that of one shard,
  // and "intra+inter" costs about three such stages, one per decoding stage,
  // not one per piece): the fixed cost is paid once per stage, the linear
  // part grows with all the elements decoded. A CPU core decodes piece by
  // piece, as compress_bench measures it.
  // `out`: elements per holder that go to the GPU afterwards (0: none).
  auto decomp = [&](double x, double pieces, int par, double out) {
    if (o.decomp_device == Device::kCuda) {
      add(Resource::kGpu, cc->gpu->decompress.at(pieces * x), "decompress");
    } else {
      add(Resource::kCpu, par * pieces * cc->cpu->decompress.at(x) / cores + copy(out, par),
          "decompress");
    }
  };
  // Decompress `pieces` pieces of x, sum, recompress the sum (y elements).
  auto remix = [&](double x, double pieces, double y, int par) {
    const bool cpu_dec = o.decomp_device == Device::kCpu;
    const bool cpu_comp = o.comp_device == Device::kCpu;
    decomp(x, pieces, par, cpu_dec && !cpu_comp ? y : 0.0);
    comp(y, par, !cpu_dec);
  };
  // Ring / tree step costs for P participants on a port of B bytes/us.
  auto steps = [](int P) { return static_cast<double>(std::max(0, P - 1)); };
  auto frac = [](int P) { return P <= 1 ? 0.0 : static_cast<double>(P - 1) / P; };

  if (o.scheme == Scheme::kFlat) {
    const int N = k * M;
    if (N <= 1) {
      if (cc) {
        comp(n, 1);
        decomp(n, 1, 1, n);
      }
      return;
    }
    const double c = wire(n);
    const double bytes = cc ? c : S;
    if (cc) comp(n, 1);
    switch (o.inter) {
      case Collective::kAllreduce:
        add(Resource::kInter, 2 * steps(N) * ae + 2 * frac(N) * bytes / Be, "allreduce");
        break;
      case Collective::kReduceScatterAllgather:
        add(Resource::kInter, steps(N) * ae + frac(N) * bytes / Be, "reduce_scatter");
        add(Resource::kInter, steps(N) * ae + frac(N) * bytes / Be, "allgather");
        break;
      case Collective::kReduceBroadcast:
        add(Resource::kInter, steps(N) * ae + bytes / Be, "reduce");
        add(Resource::kInter, steps(N) * ae + bytes / Be, "broadcast");
        break;
      case Collective::kAllgather:
        add(Resource::kInter, steps(N) * ae + steps(N) * c / Be, "allgather");
        decomp(n, N, 1, n);
        return;
      case Collective::kAlltoallAllgather: {
        const double shard = n / N;
        add(Resource::kInter, steps(N) * ae + k * frac(M) * c / Be, "alltoall");
        remix(shard, N, shard, 1);
        add(Resource::kInter, steps(N) * ae + steps(N) * wire(shard) / Be, "allgather");
        decomp(shard, N, 1, n);
        return;
      }
      case Collective::kGatherBroadcast:
        add(Resource::kInter, steps(N) * ae + (N - k) * c / Be, "gather");
        remix(n, N, n, 1);
        add(Resource::kInter, steps(N) * ae + c / Be, "broadcast");
        decomp(n, 1, 1, n);
        return;
    }
    if (cc) decomp(n, 1, 1, n);
    return;
  }

  // Hierarchical: intra step 1, inter phase, intra step 2.
  const bool scatter = o.intra == Collective::kReduceScatterAllgather ||
                       o.intra == Collective::kAlltoallAllgather;
  const bool s1 = cc && o.compress_before == Stage::kIntra;
  const bool s3 = cc && o.decompress_after == Stage::kIntra;
  const int par = scatter ? k : 1;           // GPUs holding data for the inter phase
  const double m = scatter ? n / k : n;       // elements per holder
  if (s1) comp(n, k);
  if (k > 1) {
    const double bytes = s1 ? wire(n) : S;
    if (is_reducing(o.intra)) {
      add(Resource::kIntra,
          scatter ? steps(k) * ai + frac(k) * bytes / Bi : steps(k) * ai + bytes / Bi,
          scatter ? "intra_reduce_scatter" : "intra_reduce");
    } else if (scatter) {  // alltoall of compressed data
      add(Resource::kIntra, steps(k) * ai + frac(k) * bytes / Bi, "intra_alltoall");
      remix(m, k, m, par);
    } else {  // gather
      add(Resource::kIntra, steps(k) * ai + steps(k) * bytes / Bi, "intra_gather");
      remix(n, k, n, 1);
    }
  }
  if (cc && !s1) comp(m, par);
  // Inter phase: `par` holders share the NIC.
  const double Bp = Be / par;
  bool raw_after_inter = !cc;
  if (M > 1) {
    const double bytes = cc ? wire(m) : 4.0 * m;
    const bool ps_sharded = o.inter == Collective::kReduceScatterAllgather ||
                            o.inter == Collective::kAlltoallAllgather;
    const bool ps_single = o.inter == Collective::kReduceBroadcast ||
                           o.inter == Collective::kGatherBroadcast;
    double B1 = Bp, B2 = Bp;
    if (cluster_.dedicated_servers && (ps_sharded || ps_single)) {
      const double servers = ps_single ? 1.0 : cluster_.servers;
      const double server_bpu = cluster_.server_gbps * 1e3 / 8.0;
      B1 = B2 = std::min(Bp, servers * server_bpu / (M * par));
    }
    // The PS-shaped collectives run as push/pull (DESIGN.md section 3): every
    // node sends all its shards at once and the servers answer at once, so
    // each of push and pull costs one latency, not the M-1 of a ring.
    const double ps_lat = ae;
    switch (o.inter) {
      case Collective::kAllreduce:
        add(Resource::kInter, 2 * steps(M) * ae + 2 * frac(M) * bytes / Bp, "allreduce");
        break;
      case Collective::kReduceScatterAllgather:
        add(Resource::kInter, ps_lat + frac(M) * bytes / B1, "reduce_scatter");
        add(Resource::kInter, ps_lat + frac(M) * bytes / B2, "allgather");
        break;
      case Collective::kReduceBroadcast:
        add(Resource::kInter, ps_lat + bytes / B1, "reduce");
        add(Resource::kInter, ps_lat + bytes / B2, "broadcast");
        break;
      case Collective::kAllgather:
        add(Resource::kInter, steps(M) * ae + steps(M) * bytes / Bp, "allgather");
        if (s3) {
          remix(m, M, m, par);  // the gathered sum travels compressed
        } else {
          decomp(m, M, par, m);
          raw_after_inter = true;
        }
        break;
      case Collective::kAlltoallAllgather: {
        const double shard = m / M;
        add(Resource::kInter, ps_lat + frac(M) * bytes / B1, "alltoall");
        remix(shard, M, shard, par);
        add(Resource::kInter, ps_lat + steps(M) * wire(shard) / B2, "allgather");
        if (!s3) {
          decomp(shard, M, par, m);
          raw_after_inter = true;
        }
        break;
      }
      case Collective::kGatherBroadcast:
        add(Resource::kInter, ps_lat + steps(M) * bytes / B1, "gather");
        remix(m, M, m, par);
        add(Resource::kInter, ps_lat + bytes / B2, "broadcast");
        if (!s3) {
          decomp(m, 1, par, m);
          raw_after_inter = true;
        }
        break;
    }
  }
  if (cc && !s3 && !raw_after_inter) decomp(m, 1, par, m);
  if (k > 1) {
    const double bytes = s3 ? wire(n) : S;
    add(Resource::kIntra,
        scatter ? steps(k) * ai + frac(k) * bytes / Bi : steps(k) * ai + bytes / Bi,
        scatter ? "intra_allgather" : "intra_broadcast");
  }
  if (s3) decomp(n / par, par, k, n);
  return;
}

// ---------------------------------------------------------------- evaluator

Evaluator::Evaluator(Problem& p) : p_(p) {
  const int n = p_.tensors();
  compute_end_.assign(n, 0);
  prefix_done_.assign(n + 1, 0);
  log_.reserve(16 * p_.chunks().size() + 64);
  snap_.resize(n);
  base_compute_end_.assign(n, 0);
  base_drained_.assign(n + 1, 0);
  base_suffix_end_.assign(n + 1, 0);
  base_inter_work_.assign(n + 1, 0);
  base_done_.assign(n, 0);
  base_inter_.assign(n, 0);
  base_info_from_ = 0;  // nothing known yet: boundaries >= 0 need a refresh
  for (auto& r : res_) r.gaps.reserve(4 * p_.chunks().size() + 16);
}

double Evaluator::lower_bound() {
  if (lower_bound_ >= 0) return lower_bound_;
  // Backward without contention, then the cheapest chain of the last tensor
  // with every resource free.
  const int last = p_.tensors() - 1;
  double tail = std::numeric_limits<double>::infinity();
  for (size_t o = 0; o < p_.options().size(); ++o) {
    double t = 0;
    for (int c = p_.first_chunk(last); c < p_.first_chunk(last + 1); ++c) {
      t = std::max(t, chain_latency(p_.chain(p_.chunks()[c].elements, static_cast<int>(o))));
    }
    tail = std::min(tail, t);
  }
  lower_bound_ = p_.forward_us() + p_.profile().backward_us() + tail;
  return lower_bound_;
}

void Evaluator::rollback(int tensor) {
  if (tensor >= prefix_) return;
  while (!log_.empty() && log_.back().tensor >= tensor) {
    const Undo u = log_.back();
    log_.pop_back();
    ResourceState& r = res_[u.resource];
    switch (u.kind) {
      case UndoKind::kSet: r.gaps[u.index] = u.old; break;
      case UndoKind::kInserted: r.gaps.erase(r.gaps.begin() + u.index); break;
      case UndoKind::kErased: r.gaps.insert(r.gaps.begin() + u.index, u.old); break;
    }
  }
  // Appends never move existing gaps, so after the backfills are undone the
  // tail is restored by truncation.
  const Snapshot& sn = snap_[tensor];
  for (int r = 0; r < kResources; ++r) {
    res_[r].gaps.resize(sn.gaps[r]);
    res_[r].last_end = sn.last_end[r];
  }
  prefix_ = tensor;
}

double Evaluator::place(Resource res, double ready, double dur, int tensor) {
  const uint8_t ri = static_cast<uint8_t>(res);
  ResourceState& r = res_[ri];
  constexpr double kTiny = 1e-9;
  if (ready < r.last_end && !r.gaps.empty()) {
    // Earliest idle gap that holds the operation (first come, first served
    // with backfilling).
    auto it = std::upper_bound(r.gaps.begin(), r.gaps.end(), ready,
                               [](double t, const Gap& g) { return t < g.end; });
    for (; it != r.gaps.end(); ++it) {
      const Gap g = *it;
      const double s = std::max(g.start, ready);
      if (s + dur > g.end + kTiny) continue;
      const int k = static_cast<int>(it - r.gaps.begin());
      const bool left = s > g.start + kTiny, right = s + dur < g.end - kTiny;
      if (left && right) {
        log_.push_back({tensor, ri, UndoKind::kSet, k, g});
        r.gaps[k] = {g.start, s};
        r.gaps.insert(r.gaps.begin() + k + 1, Gap{s + dur, g.end});
        log_.push_back({tensor, ri, UndoKind::kInserted, k + 1, {}});
      } else if (left) {
        log_.push_back({tensor, ri, UndoKind::kSet, k, g});
        r.gaps[k] = {g.start, s};
      } else if (right) {
        log_.push_back({tensor, ri, UndoKind::kSet, k, g});
        r.gaps[k] = {s + dur, g.end};
      } else {
        log_.push_back({tensor, ri, UndoKind::kErased, k, g});
        r.gaps.erase(r.gaps.begin() + k);
      }
      return s;
    }
  }
  const double t = std::max(ready, r.last_end);
  if (t > r.last_end + kTiny) r.gaps.push_back({r.last_end, t});
  r.last_end = t + dur;
  return t;
}

double Evaluator::run_compute(double start, double gap) const {
  // Backward computation yields the GPU to compression kernels: it only
  // advances in the GPU's idle gaps and after its last kernel.
  const ResourceState& r = res_[static_cast<int>(Resource::kGpu)];
  double t = start, left = gap;
  if (t >= r.last_end) return t + left;
  auto it = std::upper_bound(r.gaps.begin(), r.gaps.end(), t,
                             [](double x, const Gap& g) { return x < g.end; });
  for (; it != r.gaps.end(); ++it) {
    if (it->start > t) t = it->start;  // busy until this gap
    const double avail = it->end - t;
    if (left <= avail) return t + left;
    left -= avail;
    t = it->end;
  }
  return std::max(t, r.last_end) + left;
}

double Evaluator::simulate_slices(int i, int opt, double ready, Timeline* tl) {
  const std::string* name = tl ? &p_.profile().tensors[i].name : nullptr;
  auto put = [&](Resource r, double t, double dur) { return place(r, t, dur, i); };
  auto emit = [&](const Op& op, double s, double e) {
    if (tl) tl->events.push_back({*name, op.what, op.resource, false, s, e});
  };
  double done = ready;
  for (int c = p_.first_chunk(i); c < p_.first_chunk(i + 1); ++c)
    done = std::max(done, run_chain(p_.chunk_chain(c, opt), ready, put, emit));
  return done;
}

double Evaluator::simulate_tensor(int i, int opt, Timeline* tl) {
  Snapshot& sn = snap_[i];
  for (int r = 0; r < kResources; ++r) {
    sn.last_end[r] = res_[r].last_end;
    sn.gaps[r] = static_cast<uint32_t>(res_[r].gaps.size());
  }
  const double prev = i == 0 ? 0.0 : compute_end_[i - 1];
  const double ready = run_compute(prev, p_.profile().tensors[i].gap_us);
  compute_end_[i] = ready;
  const std::string* name = tl ? &p_.profile().tensors[i].name : nullptr;
  if (tl) tl->events.push_back({*name, "backward", Resource::kGpu, true, prev, ready});
  double done = ready;
  if (p_.pieced(opt)) {
    done = simulate_slices(i, opt, ready, tl);
  } else {
    // No slices (the hot path): sequences placed one after the other.
    for (int c = p_.first_chunk(i); c < p_.first_chunk(i + 1); ++c) {
      double t = ready;
      for (const Op& op : p_.chunk_chain(c, opt)) {
        if (op.fork()) {
          done = std::max(done, t);
          t = ready;
          continue;
        }
        if (op.duration_us <= 0) continue;
        const double s = place(op.resource, t, op.duration_us, i);
        t = s + op.duration_us;
        if (tl) tl->events.push_back({*name, op.what, op.resource, false, s, t});
      }
      done = std::max(done, t);
    }
  }
  prefix_done_[i + 1] = std::max(prefix_done_[i], done);
  prefix_ = i + 1;
  return done;
}

double Evaluator::evaluate(const Assignment& a, Timeline* tl) {
  rollback(0);
  base_value_ = -1;  // the state no longer matches the base
  ++simulations_;
  const int n = p_.tensors();
  for (int i = 0; i < n; ++i) simulate_tensor(i, a[i], tl);
  const double bwd = compute_end_[n - 1];
  const double end = std::max(bwd, prefix_done_[n]);
  const double f = p_.forward_us() + end;
  if (tl) {
    tl->iteration_us = f;
    tl->backward_end_us = bwd;
    tl->comm_end_us = prefix_done_[n];
  }
  // The state holds `a`; if it is the base, keep it as the base's state.
  if (a == base_) base_value_ = f; else rollback(0);
  return f;
}

void Evaluator::set_base(const Assignment& a) {
  base_ = a;
  rollback(0);
  base_value_ = -1;
  base_info_from_ = 0;
}

double Evaluator::base_value() {
  if (base_value_ < 0) {
    rollback(0);
    const Assignment copy = base_;
    evaluate(copy);
  }
  return base_value_;
}

bool Evaluator::drained(int j) const {
  constexpr double kTiny = 1e-9;
  const double start = j == 0 ? 0.0 : compute_end_[j - 1];
  if (res_[static_cast<int>(Resource::kGpu)].last_end > start + kTiny) return false;
  const double ready = start + p_.profile().tensors[j].gap_us;
  for (int r = 1; r < kResources; ++r)
    if (res_[r].last_end > ready + kTiny) return false;
  return true;
}

void Evaluator::refresh_base_info(int from) {
  const int n = p_.tensors();
  for (int i = from; i < n; ++i) {
    base_drained_[i] = drained(i);
    base_done_[i] = simulate_tensor(i, base_[i], nullptr);
    base_compute_end_[i] = compute_end_[i];
    double w = 0;
    for (int c = p_.first_chunk(i); c < p_.first_chunk(i + 1); ++c)
      for (const Op& op : p_.chunk_chain(c, base_[i]))
        if (op.resource == Resource::kInter) w += op.duration_us;
    base_inter_[i] = w;
  }
  // Suffix aggregates change at every boundary, not only from `from` on.
  base_drained_[n] = 0;
  double tail = compute_end_[n - 1], work = 0;
  base_suffix_end_[n] = tail;
  base_inter_work_[n] = 0;
  for (int i = n - 1; i >= 0; --i) {
    tail = std::max(tail, base_done_[i]);
    work += base_inter_[i];
    base_suffix_end_[i] = tail;
    base_inter_work_[i] = work;
  }
  base_value_ = p_.forward_us() + std::max(prefix_done_[n], compute_end_[n - 1]);
  base_info_from_ = n + 1;
}

double Evaluator::run_suffix(int from, const std::pair<int, int>* ch, size_t nch,
                             double cutoff) {
  const int n = p_.tensors();
  // The base's drain points beyond `from` must be known.
  if (base_info_from_ <= n) {
    const int start = base_info_from_;
    if (prefix_ > start) rollback(start);
    while (prefix_ < start) simulate_tensor(prefix_, base_[prefix_], nullptr);
    refresh_base_info(start);
  }
  // Bring the prefix to `from` using the base.
  if (prefix_ > from) rollback(from);
  while (prefix_ < from) simulate_tensor(prefix_, base_[prefix_], nullptr);
  ++simulations_;
  const double fwd = p_.forward_us();
  size_t next = 0;
  for (int i = from; i < n; ++i) {
    int opt = base_[i];
    if (next < nch && ch[next].first == i) opt = ch[next++].second;
    simulate_tensor(i, opt, nullptr);
    if (fwd + prefix_done_[i + 1] >= cutoff) {
      rollback(from);
      return std::numeric_limits<double>::infinity();
    }
    const int j = i + 1;
    if (next == nch && j < n && std::isfinite(cutoff)) {
      // The base's remaining inter-node work can only use idle gaps after
      // tensor j's gradient is ready, or time after the link's last end.
      const ResourceState& r = res_[static_cast<int>(Resource::kInter)];
      const double ready = compute_end_[i];
      double idle = 0;
      auto it = std::upper_bound(r.gaps.begin(), r.gaps.end(), ready,
                                 [](double t, const Gap& g) { return t < g.end; });
      int scanned = 0;
      for (; it != r.gaps.end() && scanned < 64; ++it, ++scanned)
        idle += it->end - std::max(it->start, ready);
      if (it == r.gaps.end() &&
          fwd + std::max(r.last_end, ready) + base_inter_work_[j] - idle >= cutoff) {
        rollback(from);
        return std::numeric_limits<double>::infinity();
      }
    }
    if (next == nch && j < n && base_drained_[j] && drained(j)) {
      // Both timelines are idle when tensor j starts: the rest is the
      // base's, shifted by the difference in backward progress.
      const double shift = compute_end_[i] - base_compute_end_[i];
      const double f = fwd + std::max(prefix_done_[j], base_suffix_end_[j] + shift);
      rollback(from);
      return f;
    }
  }
  const double f = fwd + std::max(compute_end_[n - 1], prefix_done_[n]);
  rollback(from);
  return f;
}

double Evaluator::try_option(int i, int opt, double cutoff) {
  std::pair<int, int> c{i, opt};
  return run_suffix(i, &c, 1, cutoff);
}

double Evaluator::try_changes(const std::vector<std::pair<int, int>>& changes, double cutoff) {
  if (changes.empty()) return base_value();
  return run_suffix(changes.front().first, changes.data(), changes.size(), cutoff);
}

void Evaluator::commit(int i, int opt) {
  base_[i] = opt;
  rollback(i);
  base_value_ = -1;
  // Boundaries <= i keep their drain facts; later ones must be refreshed.
  base_info_from_ = std::min(base_info_from_, i);
}

// ---------------------------------------------------------------- trace

namespace {
std::string json_escape(const std::string& s) {
  std::string out;
  for (char ch : s) {
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", ch);
          out += buf;
        } else {
          out += ch;
        }
    }
  }
  return out;
}
}  // namespace

std::string Timeline::chrome_trace_json() const {
  std::ostringstream os;
  os.precision(12);
  os << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  const char* tracks[] = {"GPU compression", "CPU compression pool", "intra-node link",
                          "inter-node link"};
  bool first = true;
  auto sep = [&] {
    if (!first) os << ",\n";
    first = false;
  };
  sep();
  os << R"({"ph":"M","pid":0,"tid":9,"name":"thread_name","args":{"name":"GPU backward"}})";
  for (int r = 0; r < kResources; ++r) {
    sep();
    os << R"({"ph":"M","pid":0,"tid":)" << r << R"(,"name":"thread_name","args":{"name":")"
       << tracks[r] << "\"}}";
  }
  for (const TraceEvent& e : events) {
    sep();
    os << R"({"ph":"X","pid":0,"tid":)" << (e.compute ? 9 : static_cast<int>(e.resource))
       << R"(,"name":")" << json_escape(e.name) << R"(","cat":")" << json_escape(e.what)
       << R"(","ts":)" << e.start_us << R"(,"dur":)" << (e.end_us - e.start_us)
       << R"(,"args":{"op":")" << json_escape(e.what) << "\"}}";
  }
  os << "],\"otherData\":{\"iteration_us\":" << iteration_us
     << ",\"backward_end_us\":" << backward_end_us << ",\"comm_end_us\":" << comm_end_us
     << "}}\n";
  return os.str();
}

}  // namespace bytecomp::planner
