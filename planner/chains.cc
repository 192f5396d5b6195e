#include "planner/chains.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <sstream>

#include "common/error.h"
#include "planner/run_chain.h"

namespace bytecomp::planner {

const char* to_string(Resource r) {
  switch (r) {
    case Resource::kGpu: return "gpu";
    case Resource::kCpu: return "cpu";
    case Resource::kIntra: return "intra";
    case Resource::kInter: return "inter";
    case Resource::kInterIn: return "inter_in";
  }
  return "?";
}

bool on_ring(const Option& o) {
  return o.inter == Collective::kAllreduce &&
         (!o.compressed() || o.compressor == "fp16" || o.compressor == "bf16");
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
  if (cluster_.cpu_nodes) {
    // CPU-only nodes run the CPU runtime: nothing else can execute there.
    constraints_.allow_gpu = false;
    constraints_.cpu_runtime_only = true;
  }
  for (Option& o : enumerate_options(spec_, constraints_, cc.error_feedback)) {
    if (o.compressed()) {
      const CompressorCost* c = costs_.find(o.compressor);
      if (!c || !has_device(*c, o.comp_device) || !has_device(*c, o.decomp_device)) continue;
    }
    options_.push_back(std::move(o));
  }
  if (options_.empty())
    throw Error(ErrorCode::kInvalidArgument, "no option satisfies the constraints");
  cut_chunks();
}

Problem::Problem(Profile profile, Cluster cluster, CostTable costs, std::vector<Option> options)
    : profile_(std::move(profile)),
      cluster_(std::move(cluster)),
      costs_(std::move(costs)),
      options_(std::move(options)) {
  constraints_.allow_gpu = false;
  constraints_.cpu_runtime_only = true;
  explicit_options_ = true;
  if (options_.empty()) throw Error(ErrorCode::kInvalidArgument, "an empty option set");
  for (const Option& o : options_) {
    if (!o.compressed()) continue;
    const CompressorCost* c = costs_.find(o.compressor);
    if (!c || !c->cpu)
      throw Error(ErrorCode::kInvalidArgument,
                  "the cost table '" + costs_.name + "' has no CPU figures for compressor '" +
                      o.compressor + "' (option [" + o.describe() + "])");
    if (o.comp_device != Device::kCpu || o.decomp_device != Device::kCpu)
      throw Error(ErrorCode::kInvalidArgument,
                  "option [" + o.describe() + "]: an explicit option set runs on the CPU only");
    if (spec_.name.empty()) spec_ = CompressorSpec{o.compressor, o.params};
  }
  if (spec_.name.empty()) spec_.name = "none";
  cut_chunks();
}

void Problem::cut_chunks() {
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
  if (!constraints_.allow_cpu || !c || !c->cpu) return -1;
  o.cpu_share = share;
  // The CPU runtime executes a split of compression only (comp_device gpu,
  // decomp_device cpu: the client's GPU and the daemon's pool, docs/gpu.md
  // §4).
  if (constraints_.cpu_runtime_only && !cpu_runtime_unsupported(o).empty()) return -1;
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
  return detail::run_chain(ops, 0.0, place, [](const Op&, double, double) {});
}

Problem Problem::zero_cost_copy() const {
  CostTable t = costs_;
  for (auto& [name, c] : t.compressors) {
    for (auto* d : {&c.gpu, &c.cpu})
      if (*d) **d = DeviceCost{};
  }
  Cluster cl = cluster_;
  cl.host_copy_gbps = 0;
  if (explicit_options_) {
    return Problem(profile_, cl, t,
                   std::vector<Option>(options_.begin(), options_.begin() + tree_options_));
  }
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
  if (cluster_.cpu_nodes) {
    build_cpu_node_chain(elements, o, ops);
    return;
  }
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
    // each of push and pull costs one latency, not the M-1 of a ring; their
    // flows reach ps_link_share() of the link, the ring's ring_link_share
    // (both 1 unless the cluster says otherwise, Cluster in model.h).
    const double ps_lat = ae;
    if (ps_sharded || ps_single) {
      B1 *= cluster_.ps_link_share();
      B2 *= cluster_.ps_link_share();
    }
    const double ring_hop = cluster_.ring_hop_us > 0 ? cluster_.ring_hop_us : ae;
    switch (o.inter) {
      case Collective::kAllreduce:
        add(Resource::kInter,
            2 * steps(M) * ring_hop + 2 * frac(M) * bytes / (Bp * cluster_.ring_link_share),
            "allreduce");
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

void Problem::build_cpu_node_chain(uint64_t elements, const Option& o,
                                   std::vector<Op>& ops) const {
  // The CPU runtime pipelines by its partitions (the chunks). It executes
  // Option::pieces (smaller partitions, docs/gpu.md §4), but the CPU-runtime
  // search never proposes them (pieces_option), so this chain does not
  // model them; cpu_share needs a GPU. Placement (ps vs ps_single) only
  // moves which server holds a partition: the node's traffic is the same.
  const double n = static_cast<double>(elements);
  const double pool = std::max(1, cluster_.pool_threads);
  const CompressorCost* cc = o.compressed() ? costs_.find(o.compressor) : nullptr;
  const Resource cpu = cluster_.pool_shares_compute ? Resource::kGpu : Resource::kCpu;
  const double scale = cluster_.pool_shares_compute ? cluster_.pool_cost_scale : 1.0;
  auto add = [&](Resource r, double d, const char* what) {
    if (r == Resource::kCpu) d *= scale;
    if (d > 0) ops.push_back({r == Resource::kCpu ? cpu : r, d, what});
  };
  add(Resource::kCpu, cluster_.reduce.at(n) / pool, "reduce");
  const int M = std::max(1, cluster_.machines);
  if (on_ring(o)) {
    // The daemons' ring (docs/daemon.md): no server; every node sends and
    // receives 2(M-1)/M of the partition's wire bytes (fp16/bf16: 2 per
    // element) on one flow per direction, in 2(M-1) steps
    // (Cluster::ring_us). Its CPU runs beside the link, chunk by chunk, so
    // it is a sequence of its own from the partition's ready time: the comm
    // stack's per-byte cost on those bytes (copies, sockets, the fp32 add
    // of each hop) and, for fp16/bf16, one conversion of the node's sum,
    // one per hop of the segment that is added and re-rounded, and the
    // final decode (measured fp16 fits: compress ~ fp32 -> fp16,
    // decompress ~ fp16 -> fp32).
    if (M <= 1) return;
    const double bytes = (cc ? 2.0 : 4.0) * n;
    const double frac = static_cast<double>(M - 1) / M;
    add(Resource::kInter, cluster_.ring_us(bytes), "ring_allreduce");
    double cpu_us = cluster_.ring_comm_cpu_us_per_byte * 2 * frac * bytes;
    if (cc) {
      const double seg = n / M;
      cpu_us += (cc->cpu->compress.at(n) + (M - 1) * (cc->cpu->compress.at(seg) +
                                                      cc->cpu->decompress.at(seg)) +
                 cc->cpu->decompress.at(n)) / pool;
    }
    if (cpu_us > 0) {
      ops.push_back({Resource::kCpu, kForkMark, "fork"});
      add(Resource::kCpu, cpu_us, "ring_cpu");
    }
    return;
  }
  if (cc) add(Resource::kCpu, cc->cpu->compress.at(n) / pool, "compress");
  const int servers = cluster_.servers > 0 ? cluster_.servers : M;
  // A colocated server keeps its 1/servers share of every node's pushes on
  // the node; on one machine nothing leaves it.
  double remote = 1.0;
  if (!cluster_.dedicated_servers) remote = M == 1 ? 0.0 : 1.0 - 1.0 / servers;
  const double bytes = cc ? cc->wire_bytes(n) : 4.0 * n;  // push and pull alike
  // The comm stack's CPU for this partition's push and pull (docs/planner.md).
  add(Resource::kCpu, cluster_.comm_cpu_us_per_byte * 2 * remote * bytes, "comm_cpu");
  add(Resource::kInter, cluster_.ps_step_us(bytes, remote), "push");
  if (cc && !is_additive_compressor(o.compressor) && !cluster_.dedicated_servers) {
    // The partition's server decompresses every node's push and recompresses
    // the sum; colocated, that work shares this node's cores (on average a
    // 1/servers share of every partition's).
    add(Resource::kCpu,
        (M * cc->cpu->decompress.at(n) + cc->cpu->compress.at(n)) / servers / pool,
        "server_remix");
  }
  // Colocated, the NIC's send direction also carries this node's server's
  // answers to the other nodes (and the receive direction their pushes): in
  // a symmetric job each direction carries push + pull, so both share one
  // resource. Dedicated servers leave each direction one of them.
  add(cluster_.dedicated_servers ? Resource::kInterIn : Resource::kInter,
      cluster_.ps_step_us(bytes, remote), "pull");
  if (cc) add(Resource::kCpu, cc->cpu->decompress.at(n) / pool, "decompress");
}

}  // namespace bytecomp::planner
