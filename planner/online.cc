#include "planner/online.h"

#include <fnmatch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <numeric>
#include <set>

#include "common/error.h"
#include "compress/catalogue.h"
#include "compress/compressor.h"
#include "planner/chains.h"
#include "planner/evaluator.h"
#include "planner/search.h"
#include "planner/strategy/plan.h"

namespace bytecomp::planner::online {

namespace {

// Bounds of the effective link rate calibration derives: without a probe,
// anything plausible; with one, within a factor of 4 of it (beyond that the
// probe is not what is wrong: something unmodelled is, and it goes into the
// residual or the scale).
constexpr double kMinLinkGbps = 1e-3, kMaxLinkGbps = 1e4;
constexpr double kProbeFactor = 4.0;
// The compute stretch of a shared host is a correction of the window's
// contention, not a new measurement: bounded.
constexpr double kMinStretch = 0.25, kMaxStretch = 4.0;
constexpr double kCalibrationTolerance = 1e-4;

std::string canonical_spec(std::string_view text) {
  return compress::to_string(compress::parse_compressor_spec(text));
}

std::string fmt(double v, int prec = 6) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*g", prec, v);
  return buf;
}

}  // namespace

// ---------------------------------------------------------------- merge

NodeProfile merge(const std::vector<NodeProfile>& nodes) {
  if (nodes.empty()) throw Error(ErrorCode::kInvalidArgument, "merge: no node profiles");
  NodeProfile m = nodes.front();
  m.node_rank = 0;
  auto fail = [](const NodeProfile& n, const std::string& what) {
    throw Error(ErrorCode::kInvalidArgument,
                "merge: node " + std::to_string(n.node_rank) + " differs from node " +
                    "profile 0: " + what);
  };
  auto slower = [](LinearFit& into, const LinearFit& f) {
    into.a_us = std::max(into.a_us, f.a_us);
    into.b_us_per_melem = std::max(into.b_us_per_melem, f.b_us_per_melem);
    into.samples = std::min(into.samples, f.samples);
  };
  const NodeProfile& first = nodes.front();
  for (size_t k = 1; k < nodes.size(); ++k) {
    const NodeProfile& n = nodes[k];
    if (n.tensors.size() != first.tensors.size())
      fail(n, std::to_string(n.tensors.size()) + " tensors against " +
                  std::to_string(first.tensors.size()));
    for (size_t i = 0; i < n.tensors.size(); ++i) {
      const TensorMeasure &a = first.tensors[i], &b = n.tensors[i];
      if (a.name != b.name || a.elements != b.elements)
        fail(n, "tensor " + std::to_string(i) + " is '" + b.name + "' (" +
                    std::to_string(b.elements) + " elements) against '" + a.name + "' (" +
                    std::to_string(a.elements) + " elements)");
      m.tensors[i].ready_us = std::max(m.tensors[i].ready_us, b.ready_us);
    }
    if (n.compressors.size() != first.compressors.size())
      fail(n, std::to_string(n.compressors.size()) + " measured compressors against " +
                  std::to_string(first.compressors.size()));
    for (size_t i = 0; i < n.compressors.size(); ++i) {
      const CompressorMeasure& b = n.compressors[i];
      CompressorMeasure& into = m.compressors[i];
      if (canonical_spec(b.spec) != canonical_spec(first.compressors[i].spec))
        fail(n, "compressor " + std::to_string(i) + " is '" + b.spec + "' against '" +
                    first.compressors[i].spec + "'");
      slower(into.compress, b.compress);
      slower(into.decompress, b.decompress);
      into.bytes_per_element = std::max(into.bytes_per_element, b.bytes_per_element);
      into.fixed_bytes = std::max(into.fixed_bytes, b.fixed_bytes);
    }
    if (n.current_strategy_yaml != first.current_strategy_yaml)
      fail(n, "it ran a different strategy during the window");
    m.local_ranks = std::max(m.local_ranks, n.local_ranks);
    m.pool_threads = std::min(m.pool_threads, n.pool_threads);
    m.cpu_cores = std::min(m.cpu_cores, n.cpu_cores);
    m.first_iteration = std::max(m.first_iteration, n.first_iteration);
    m.iterations = std::min(m.iterations, n.iterations);
    m.iteration_us = std::max(m.iteration_us, n.iteration_us);
    slower(m.reduce, n.reduce);
    if (n.link_gbps > 0 && (m.link_gbps <= 0 || n.link_gbps < m.link_gbps))
      m.link_gbps = n.link_gbps;
    m.link_latency_us = std::max(m.link_latency_us, n.link_latency_us);
    m.train_cpu_us = std::max(m.train_cpu_us, n.train_cpu_us);
    m.daemon_cpu_us = std::max(m.daemon_cpu_us, n.daemon_cpu_us);
    m.host_cpu_us = std::max(m.host_cpu_us, n.host_cpu_us);
  }
  std::map<std::string, uint32_t> per_host;
  m.nodes_on_host = 1;
  for (const NodeProfile& n : nodes)
    if (!n.host.empty()) m.nodes_on_host = std::max(m.nodes_on_host, ++per_host[n.host]);
  return m;
}

// ---------------------------------------------------------------- options

Option sharded_option(std::string_view spec_text) {
  Option o;  // hierarchical, reduce_broadcast, reduce_scatter_allgather, cpu/cpu
  const std::string_view trimmed = spec_text;
  if (trimmed == "none" || trimmed.empty()) return o;
  const compress::CompressorSpec spec = compress::parse_compressor_spec(trimmed);
  const compress::CatalogueEntry* e = compress::find_compressor(spec.name);
  if (!e) throw Error(ErrorCode::kInvalidArgument, "unknown compressor '" + spec.name + "'");
  o.compressor = spec.name;
  o.params = spec.params;
  o.compress_before = o.decompress_after = Stage::kInter;
  if (e->additive) {
    o.inter = Collective::kReduceScatterAllgather;
  } else {
    o.inter = Collective::kAlltoallAllgather;
    // The servers sum decompressed pushes and recompress: error feedback on
    // both sides is what keeps that unbiased over iterations.
    o.error_feedback = e->builtin_feedback || e->has_param("ef");
    o.params.erase("ef");
  }
  return o;
}

Option ring_option(std::string_view spec_text) {
  Option o;
  o.inter = Collective::kAllreduce;
  if (spec_text == "none" || spec_text.empty()) return o;
  const compress::CompressorSpec spec = compress::parse_compressor_spec(spec_text);
  if ((spec.name != "fp16" && spec.name != "bf16") || !spec.params.empty())
    throw Error(ErrorCode::kInvalidArgument,
                "the daemons' ring carries none, fp16 or bf16, not '" + std::string(spec_text) + "'");
  o.compressor = spec.name;
  o.compress_before = o.decompress_after = Stage::kInter;
  return o;
}

// ---------------------------------------------------------------- guards

std::string guard_reason(const strategy::AccuracyGuards& guards,
                         const std::vector<TensorMeasure>& tensors, size_t index) {
  std::vector<std::string> names;
  std::vector<uint64_t> elements;
  for (const TensorMeasure& t : tensors) {
    names.push_back(t.name);
    elements.push_back(t.elements);
  }
  return strategy::guard_reason(guards, names, elements, index);
}

// ---------------------------------------------------------------- decide

namespace {

struct Candidate {
  std::string spec;  // canonical; "none" for uncompressed
  Option option;
};

bool excluded_name(const std::vector<std::string>& globs, const std::string& name) {
  for (const std::string& g : globs)
    if (fnmatch(g.c_str(), name.c_str(), 0) == 0) return true;
  return false;
}

// A strategy rule's pattern (fnmatch) that matches exactly `name`.
std::string exact_glob(const std::string& name) {
  std::string g;
  for (char c : name) {
    if (c == '*' || c == '?' || c == '[' || c == ']' || c == '\\') g += '\\';
    g += c;
  }
  return g;
}

// What decide() works on: the problem in ready order, the mapping back to
// declaration order, the option set.
struct Model {
  Profile profile;                 // ready order
  std::vector<int> decl_of;        // problem index -> declaration index
  std::vector<int> prob_of;        // declaration index -> problem index
  Cluster cluster;
  CostTable costs;
  std::vector<Option> options;     // candidates first, then the current strategy's extras
  size_t candidates = 0;
};

Problem make_problem(const Model& m, double link_gbps) {
  Cluster c = m.cluster;
  c.inter.gbps = link_gbps;
  return Problem(m.profile, c, m.costs, m.options);
}

double predict(const Model& m, double link_gbps, const Assignment& a) {
  Problem p = make_problem(m, link_gbps);
  Evaluator ev(p);
  return ev.evaluate(a);
}

int option_index(std::vector<Option>& options, const Option& o) {
  for (size_t i = 0; i < options.size(); ++i)
    if (options[i] == o) return static_cast<int>(i);
  options.push_back(o);
  return static_cast<int>(options.size()) - 1;
}

Strategy strategy_of(const NodeProfile& prof, const Model& m, const Assignment& a) {
  Strategy s;
  s.set_default(Option{});
  for (size_t d = 0; d < prof.tensors.size(); ++d)
    s.add_entry({prof.tensors[d].name, m.options[a[m.prob_of[d]]]});
  return s;
}

struct Calibration {
  double link_gbps = 0;
  std::string link_source;
  // prediction = scale * model + residual_us: the model's shortfall is a
  // constant (unmodelled work of every iteration: the optimizer step, the
  // servers' own overheads); an over-prediction is scaled down instead, so
  // that no prediction can become negative.
  double residual_us = 0;
  double scale = 1;
  double apply(double model_us) const { return scale * model_us + residual_us; }
  double raw_prediction_us = 0;  // of the window's strategy at link_gbps
};

// Finds the link rate at which the window's strategy predicts the measured
// iteration time (F decreases with the rate), within [lo, hi]; what is
// left is the residual.
Calibration calibrate(const Model& m, const NodeProfile& prof, const Assignment& current);

}  // namespace

HostShare host_share(const NodeProfile& prof, bool colocated_servers) {
  HostShare s;
  const double cores = std::max(1u, prof.cpu_cores);
  const double nodes = std::max(1u, prof.nodes_on_host);
  const double procs = nodes * std::max(1u, prof.local_ranks);
  double last = 0;
  for (const TensorMeasure& t : prof.tensors) last = std::max(last, t.ready_us);
  // The job's comm stack on the host: its daemons, and its colocated
  // servers counted at their daemon's CPU (the model's own assumption for
  // the comm stack, below).
  const double comm_us = nodes * prof.daemon_cpu_us * (colocated_servers ? 2.0 : 1.0);
  // Other work: what the whole host ran during the window less the job's
  // own processes there.
  if (prof.host_cpu_us > 0 && prof.iteration_us > 0 && prof.train_cpu_us > 0) {
    const double own = procs * prof.train_cpu_us + comm_us;
    s.other_cores = std::clamp((prof.host_cpu_us - own) / prof.iteration_us, 0.0, cores);
  }
  // The scheduler shares the cores among what is runnable: the other work
  // counts as at least as many runnable threads as the cores it took, and
  // the job's processes keep procs / (procs + other_cores) of the cores
  // when they and the other work do not all fit.
  const double job_cores =
      procs + s.other_cores > cores ? cores * procs / (procs + s.other_cores) : cores;
  s.pool_shares_compute = (prof.local_ranks + prof.pool_threads) * nodes + s.other_cores > cores;
  s.pool_cost_scale = nodes / job_cores;
  if (prof.train_cpu_us > 0 && procs >= cores && last > 0) {
    s.compute_bound_us = prof.train_cpu_us * procs / job_cores;
    // The window's ready times ran beside two kinds of contention: the
    // job's own comm stack, which another strategy changes, and the other
    // work, which it does not (where the job computes less, the other work
    // takes the cores it leaves). They shrink towards the bound only by the
    // comm stack's part of the two.
    double floor = 0;
    if (s.other_cores > 0)
      floor = s.other_cores / (s.other_cores + comm_us / prof.iteration_us);
    s.compute_floor = floor;
    s.compute_stretch = std::clamp(std::max(s.compute_bound_us / last, floor), kMinStretch, kMaxStretch);
  }
  return s;
}

namespace {

Calibration calibrate(const Model& m, const NodeProfile& prof, const Assignment& current) {
  const double T = prof.iteration_us;
  Calibration c;
  double lo = kMinLinkGbps, hi = kMaxLinkGbps;
  if (prof.link_gbps > 0) {
    hi = prof.link_gbps * kProbeFactor;
    lo = prof.link_gbps / kProbeFactor;
  }
  const double f_hi = predict(m, hi, current);
  if (f_hi >= T) {
    c.link_gbps = hi;
    c.raw_prediction_us = f_hi;
    c.link_source = prof.link_gbps > 0 ? "4x the probe (the model over-predicts)"
                                       : "upper bound (the model over-predicts)";
  } else {
    const double f_lo = predict(m, lo, current);
    if (f_lo <= T) {
      c.link_gbps = lo;
      c.raw_prediction_us = f_lo;
      c.link_source = prof.link_gbps > 0
                          ? "a quarter of the probe (the rest of the gap is not the link)"
                          : "lower bound (the rest of the gap is not the link)";
    } else {
      // F is close to linear in the link's time per byte (1 / rate) where
      // the link matters: regula falsi (Illinois) on u = 1 / rate converges
      // in a few steps; the residual takes what the tolerance leaves.
      double ua = 1.0 / hi, ub = 1.0 / lo, fa = f_hi - T, fb = f_lo - T;  // fa < 0 < fb
      double u = ua, f = fa;
      int side = 0;
      for (int it = 0; it < 40; ++it) {
        u = (ua * fb - ub * fa) / (fb - fa);
        f = predict(m, 1.0 / u, current) - T;
        if (std::abs(f) <= kCalibrationTolerance * T) break;
        if (f < 0) {
          ua = u;
          fa = f;
          if (side == -1) fb /= 2;
          side = -1;
        } else {
          ub = u;
          fb = f;
          if (side == 1) fa /= 2;
          side = 1;
        }
      }
      c.link_gbps = 1.0 / u;
      c.raw_prediction_us = f + T;
      c.link_source = prof.link_gbps <= 0 ? "derived from iteration_us (no probe)"
                      : c.link_gbps < prof.link_gbps
                          ? "derived from iteration_us (the probe was optimistic)"
                          : "derived from iteration_us (the probe was pessimistic)";
    }
  }
  if (c.raw_prediction_us <= T) {
    c.residual_us = T - c.raw_prediction_us;
  } else {
    c.scale = T / c.raw_prediction_us;
  }
  return c;
}

// decide() and its reference: `shortcuts` off, every candidate the search
// tries is simulated to its end (Evaluator::set_shortcuts).
Decision decide_with(const NodeProfile& prof, const AutoConfig& cfg, bool shortcuts,
                     double* best_move_gain = nullptr) {
  const auto t0 = std::chrono::steady_clock::now();
  auto bad = [](const std::string& what) {
    throw Error(ErrorCode::kInvalidArgument, "online planner: " + what);
  };
  if (prof.tensors.empty()) bad("the profile has no tensors");
  if (!(prof.iteration_us > 0)) bad("the profile has no measured iteration time (iteration_us)");
  if (cfg.nodes == 0) bad("nodes must be at least 1");
  if (cfg.servers == 0) bad("servers must be at least 1");
  if (cfg.partition_bytes < 4096) bad("partition_bytes below 4 KiB");
  if (cfg.ring_chunk_bytes < 64 || cfg.ring_chunk_bytes > (1u << 20))
    bad("ring_chunk_bytes " + std::to_string(cfg.ring_chunk_bytes) + " is outside 64 B..1 MiB");
  if (!(cfg.ring_link_share > 0 && cfg.ring_link_share <= 1))
    bad("ring_link_share " + fmt(cfg.ring_link_share) + " is outside (0, 1]");
  if (!(cfg.ps_overhead >= 0) || !(cfg.ps_fanin_overhead >= 0) || !(cfg.ring_hop_rtts >= 0))
    bad("ps_overhead, ps_fanin_overhead and ring_hop_rtts must be at least 0");
  for (const TensorMeasure& t : prof.tensors)
    if (t.elements == 0) bad("tensor '" + t.name + "' has 0 elements");

  // Measured costs, by canonical spec and by compressor name (the cost
  // table, like the runtime's wire format, knows one figure set per name).
  Model m;
  m.costs.name = "measured on the nodes";
  std::map<std::string, const CompressorMeasure*> measured;
  for (const CompressorMeasure& c : prof.compressors) {
    std::string canon;
    try {
      canon = canonical_spec(c.spec);
    } catch (const Error& e) {
      bad("profile compressor '" + c.spec + "': " + e.what());
    }
    measured[canon] = &c;
  }
  auto add_costs = [&](const std::string& canon) {
    const CompressorMeasure* c = measured.at(canon);
    const compress::CompressorSpec spec = compress::parse_compressor_spec(canon);
    auto [it, fresh] = m.costs.compressors.try_emplace(spec.name);
    if (!fresh) {
      if (it->second.params == spec.params) return;
      bad("two accepted specs of compressor '" + spec.name +
          "' (the planner keeps one measurement per compressor)");
    }
    CompressorCost& cc = it->second;
    cc.name = spec.name;
    cc.params = spec.params;
    cc.bytes_per_element = c->bytes_per_element;
    cc.fixed_bytes = c->fixed_bytes;
    cc.cpu = DeviceCost{{c->compress.a_us, c->compress.b_us_per_melem, 0},
                        {c->decompress.a_us, c->decompress.b_us_per_melem, 0}};
  };

  // Candidates: none, fp16, then the accepted compressors.
  std::vector<Candidate> cands{{"none", Option{}}};
  std::vector<std::string> specs{"fp16"};
  for (const std::string& s : cfg.compressors) specs.push_back(s);
  std::set<std::string> seen{"none"};
  // canonical and as written, in the user's order, fp16 excluded
  std::vector<std::pair<std::string, std::string>> accepted;
  for (const std::string& s : specs) {
    std::string canon;
    try {
      canon = canonical_spec(s);
    } catch (const Error& e) {
      bad("compressor '" + s + "': " + e.what());
    }
    if (!seen.insert(canon).second) continue;  // named twice (or fp16 again)
    if (&s != &specs.front()) accepted.push_back({canon, s});
    if (!measured.count(canon))
      bad("the profile has no measurement of compressor '" + s + "'" +
          (canon == "fp16" ? " (fp16 is always a candidate: the nodes must measure it)" : ""));
    Option o = sharded_option(canon);
    const strategy::TensorPlan plan = strategy::plan_for_option(o, "<" + canon + ">");
    if (plan.placement != strategy::Placement::kSharded)
      bad("compressor '" + s + "' cannot run sharded over the servers");
    if (std::string why = cpu_runtime_unsupported(o); !why.empty())
      bad("compressor '" + s + "': " + why);
    add_costs(canon);
    cands.push_back({canon, std::move(o)});
  }
  for (const Candidate& c : cands) m.options.push_back(c.option);
  // The daemons' ring: uncompressed and fp16 (measured above), after the
  // sharded candidates.
  const int ring_none = static_cast<int>(m.options.size());
  m.options.push_back(ring_option("none"));
  const int ring_fp16 = static_cast<int>(m.options.size());
  m.options.push_back(ring_option("fp16"));
  m.candidates = m.options.size();

  // The problem in ready order: gaps between sorted ready times, forward =
  // the first one (the window measured them with its own contention).
  const int n = static_cast<int>(prof.tensors.size());
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return prof.tensors[a].ready_us < prof.tensors[b].ready_us;
  });
  m.decl_of = order;
  m.prob_of.assign(n, 0);
  m.profile.model = "online";
  const HostShare share = host_share(prof, cfg.colocated_servers);
  double prev = prof.tensors[order[0]].ready_us;
  m.profile.forward_us = prev * share.compute_stretch;
  for (int k = 0; k < n; ++k) {
    const TensorMeasure& t = prof.tensors[order[k]];
    m.prob_of[order[k]] = k;
    m.profile.tensors.push_back({t.name, t.elements, (t.ready_us - prev) * share.compute_stretch});
    prev = t.ready_us;
  }
  m.cluster.name = "cpu nodes (measured)";
  m.cluster.cpu_nodes = true;
  m.cluster.machines = static_cast<int>(cfg.nodes);
  m.cluster.gpus_per_machine = 1;
  m.cluster.cpu_cores = static_cast<int>(prof.cpu_cores);
  m.cluster.pool_threads = static_cast<int>(prof.pool_threads);
  m.cluster.pool_shares_compute = share.pool_shares_compute;
  m.cluster.pool_cost_scale = share.pool_cost_scale;
  m.cluster.servers = static_cast<int>(cfg.servers);
  m.cluster.dedicated_servers = !cfg.colocated_servers;
  m.cluster.partition_bytes = cfg.partition_bytes;
  m.cluster.reduce = {prof.reduce.a_us, prof.reduce.b_us_per_melem, 0};
  m.cluster.inter.latency_us = prof.link_latency_us;
  m.cluster.ring_chunk_bytes = cfg.ring_chunk_bytes;
  m.cluster.ring_hop_us = cfg.ring_hop_rtts * prof.link_latency_us;
  m.cluster.ring_link_share = cfg.ring_link_share;
  m.cluster.ps_overhead = cfg.ps_overhead;
  m.cluster.ps_fanin_overhead = cfg.ps_fanin_overhead;

  // The window's strategy as an assignment (its options join the set for
  // calibration only; the search never picks them).
  Assignment current(n, 0);
  if (!prof.current_strategy_yaml.empty()) {
    Strategy cur;
    try {
      cur = Strategy::parse(prof.current_strategy_yaml, "current strategy");
    } catch (const std::exception& e) {
      bad(std::string("the window's strategy does not parse: ") + e.what());
    }
    for (int d = 0; d < n; ++d) {
      const TensorMeasure& t = prof.tensors[d];
      Option o = cur.resolve(t.name, 4 * t.elements);
      if (o.compressed()) {
        if (!m.costs.find(o.compressor)) {
          std::string canon;
          for (const auto& [spec, c] : measured)
            if (compress::parse_compressor_spec(spec).name == o.compressor) canon = spec;
          if (canon.empty())
            bad("the window's strategy compresses tensor '" + t.name + "' with '" +
                o.compressor + "', which the profile has no measurement of");
          add_costs(canon);
        }
        o.comp_device = o.decomp_device = Device::kCpu;  // the CPU runtime ran it there
        o.cpu_share = 0;
        // An auto job runs pieces 1 throughout (it starts uncompressed and
        // every candidate below has pieces 1; the runtime refuses a change
        // of a tensor's pieces), so the plan never proposes a layout change.
        o.pieces = 1;
      }
      current[m.prob_of[d]] = option_index(m.options, o);
    }
  }

  // The comm stack's CPU per byte: the daemon's CPU in the window less the
  // pool work the model already has, over the bytes the node's NIC carried
  // on the path each tensor ran (push/pull: its remote share both ways;
  // the ring: 2(N-1)/N of its wire bytes). That is the daemon's own cost,
  // which the ring pays; push/pull with colocated servers pays it twice
  // (the server's share of every node's partitions is as many bytes,
  // received, summed and sent). Before, the ring was charged the server's
  // share too, and a window on the ring calibrated its measured time
  // against twice its CPU.
  if (prof.daemon_cpu_us > 0 && cfg.nodes > 1) {
    const double remote = cfg.colocated_servers ? 1.0 - 1.0 / std::max(1u, cfg.servers) : 1.0;
    const double frac = static_cast<double>(cfg.nodes - 1) / cfg.nodes;
    double bytes = 0, pool = 0;
    for (int k = 0; k < n; ++k) {
      const Option& o = m.options[current[k]];
      const double e = static_cast<double>(m.profile.tensors[k].elements);
      const CompressorCost* cc = o.compressed() ? m.costs.find(o.compressor) : nullptr;
      if (on_ring(o)) bytes += 2 * frac * (cc ? 2 * e : 4 * e);  // as build_cpu_node_chain
      else bytes += 2 * remote * (cc ? cc->wire_bytes(e) : 4 * e);
      pool += m.cluster.reduce.at(e);
      if (cc) pool += cc->cpu->compress.at(e) + cc->cpu->decompress.at(e);
    }
    if (bytes > 0) {
      const double own = std::max(0.0, prof.daemon_cpu_us - pool) / bytes;
      m.cluster.ring_comm_cpu_us_per_byte = own;
      m.cluster.comm_cpu_us_per_byte = own * (cfg.colocated_servers ? 2.0 : 1.0);
    }
  }
  const Calibration cal = calibrate(m, prof, current);
  Problem p = make_problem(m, cal.link_gbps);

  // Per tensor (problem order) its candidate option indices, the first
  // its uncompressed one. A tensor kept where the window ran it (fixed
  // placement, or the kMove plan that moves nothing) chooses among the
  // options of that placement: the ring's if it ran on the ring, else the
  // servers'; a free one among both.
  using PlacementMode = AutoConfig::Placement;
  const bool may_move = cfg.placement != PlacementMode::kFixed;
  std::vector<char> excl(n, 0), ring_tensor(n, 0);
  std::vector<std::string> guarded(n);
  const int sharded_end = ring_none;
  bool any_ring = false;
  std::vector<std::string> decl_names;
  std::vector<uint64_t> decl_elements;
  for (const TensorMeasure& t : prof.tensors) {
    decl_names.push_back(t.name);
    decl_elements.push_back(t.elements);
  }
  for (int k = 0; k < n; ++k) {
    excl[k] = excluded_name(cfg.exclude, p.profile().tensors[k].name);
    guarded[k] = strategy::guard_reason(cfg.guards, decl_names, decl_elements,
                                        static_cast<size_t>(m.decl_of[k]));
    ring_tensor[k] = on_ring(m.options[current[k]]);
    any_ring = any_ring || ring_tensor[k];
    if (cfg.placement == PlacementMode::kMove) {
      // The runtime moves a tensor mid-job only between the servers'
      // sharded placement and the ring (strategy::placement_change): a plan
      // for any other would be refused by the coordinator.
      const Option& o = m.options[current[k]];
      const strategy::Placement pl = strategy::plan_for_option(o, "<current>").placement;
      if (pl != strategy::Placement::kSharded && pl != strategy::Placement::kRing)
        bad("the window's strategy runs tensor '" + p.profile().tensors[k].name + "' on " +
            std::string(strategy::to_string(pl)) +
            ", which a running job cannot move to the servers' sharded placement or the ring");
    }
  }
  struct Choices {
    std::vector<std::vector<int>> choice, plain;  // per tensor; plain: uncompressed ones
    Assignment start;  // uncompressed where it is (kept), or on the servers (free)
  };
  auto choices_for = [&](bool free) {
    Choices c;
    c.choice.resize(n);
    c.plain.resize(n);
    c.start.assign(n, 0);
    for (int k = 0; k < n; ++k) {
      const bool lossy_ok = !excl[k] && guarded[k].empty();
      const bool servers = free || !ring_tensor[k];
      const bool ring = free || ring_tensor[k];
      if (servers) {
        c.choice[k].push_back(0);
        c.plain[k].push_back(0);
      }
      if (ring) {
        c.choice[k].push_back(ring_none);
        c.plain[k].push_back(ring_none);
      }
      if (lossy_ok && servers)
        for (int o = 1; o < sharded_end; ++o) c.choice[k].push_back(o);
      if (lossy_ok && ring) c.choice[k].push_back(ring_fp16);
      c.start[k] = c.choice[k].front();
    }
    return c;
  };
  // Per option, the uncompressed option of its placement (the search's
  // cleanup reverts to it).
  std::vector<int> plain(m.options.size(), 0);
  for (size_t o = 0; o < m.options.size(); ++o)
    plain[o] = on_ring(m.options[o]) ? ring_none : 0;
  auto compressed = [&](const Assignment& a) {
    for (int k = 0; k < n; ++k)
      if (m.options[a[k]].compressed()) return true;
    return false;
  };
  auto moves = [&](const Assignment& a) {
    int moved = 0;
    for (int k = 0; k < n; ++k) moved += on_ring(m.options[a[k]]) != static_cast<bool>(ring_tensor[k]);
    return moved;
  };
  std::vector<int> by_size(n);
  std::iota(by_size.begin(), by_size.end(), 0);
  std::stable_sort(by_size.begin(), by_size.end(), [&](int a, int b) {
    return p.profile().tensors[a].elements > p.profile().tensors[b].elements;
  });

  Decision d;
  d.measured_us = prof.iteration_us;
  Evaluator ev(p);
  // The hand strategies as a user would write them (exclusions first, then
  // the size window, then the default); their assignments come from
  // resolving them, so file and prediction cannot disagree.
  auto hand = [&](const Option& o, uint64_t min_bytes, bool free) {
    Strategy s;
    // Kept uncompressed in the option's own placement.
    const Option keep = on_ring(o) ? ring_option("none") : Option{};
    s.set_default(min_bytes > 0 ? keep : o);
    for (const std::string& g : cfg.exclude) s.add_rule(Rule{g, 0, UINT64_MAX, keep});
    for (int k = 0; k < n; ++k)
      if (!guarded[k].empty())
        s.add_rule(Rule{exact_glob(p.profile().tensors[k].name), 0, UINT64_MAX, keep});
    if (min_bytes > 0) s.add_rule(Rule{"*", min_bytes, UINT64_MAX, o});
    Assignment a(n, 0);
    for (int k = 0; k < n; ++k) {
      const TensorProfile& t = p.profile().tensors[k];
      const Option& r = s.resolve(t.name, 4 * t.elements);
      for (size_t c = 0; c < m.candidates; ++c)
        if (m.options[c] == r) a[k] = static_cast<int>(c);
    }
    // Kept placements: the window's ring tensors stay on the ring (there
    // the hand strategy's fp16 is the ring's, anything else the ring
    // uncompressed; exact entries, which come first), and the others on
    // the servers (where every hand option but "ring" puts them).
    if (!free && any_ring) {
      Strategy ringed;
      ringed.set_default(s.default_option());
      for (int k = 0; k < n; ++k)
        if (ring_tensor[k]) {
          const bool fp16 = m.options[a[k]].compressed() && m.options[a[k]].compressor == "fp16" &&
                            !excl[k] && guarded[k].empty();
          a[k] = fp16 ? ring_fp16 : ring_none;
          ringed.add_entry({p.profile().tensors[k].name, m.options[a[k]]});
        }
      for (const Rule& r : s.rules()) ringed.add_rule(r);
      s = std::move(ringed);
    }
    return std::make_pair(std::move(s), std::move(a));
  };
  using Alts = std::vector<std::pair<std::string, std::pair<Strategy, Assignment>>>;
  auto hand_alternatives = [&](bool free) {
    Alts alts;
    alts.push_back({"fp32", hand(Option{}, 0, free)});
    alts.push_back({"fp16", hand(m.options[1], 0, free)});
    // DDP's scheme: every tensor on the ring, uncompressed.
    if (free) alts.push_back({"ring", hand(m.options[ring_none], 0, free)});
    for (const auto& [canon, written] : accepted) {
      int idx = 0;
      for (size_t o = 0; o < cands.size(); ++o)
        if (cands[o].spec == canon) idx = static_cast<int>(o);
      alts.push_back({"all:" + written, hand(m.options[idx], 0, free)});
      alts.push_back({"threshold:" + written, hand(m.options[idx], cfg.min_compress_bytes, free)});
    }
    return alts;
  };
  // The bar a compressed plan must clear (AutoConfig::min_gain).
  // The calibration's misfit (what the link rate could not explain, as a
  // fraction of the iteration) raises it: a gain the model cannot resolve
  // is not worth the accuracy compression costs. A move between the ring
  // and the servers clears the same bar (kMove, below).
  const double T = std::max(1.0, prof.iteration_us);
  const double misfit = std::max(cal.residual_us / T, 1.0 - cal.scale);
  const double bar_fraction = std::max(cfg.min_gain, misfit);

  // One plan: the search, the min_gain bar against uncompressed, and the
  // hysteresis against the window's strategy; placements kept (free
  // false) or free. `alts` are its hand strategies (listed in the decision
  // when `listed`).
  struct Plan {
    Assignment a;
    std::string kept_uncompressed, kept_current;
  };
  auto plan_with = [&](bool free, Alts& alts, bool listed) {
    const Choices ch = choices_for(free);
    const Assignment* best_alt = nullptr;
    double best_alt_us = std::numeric_limits<double>::infinity();
    for (auto& [name, sa] : alts) {
      const double v = ev.evaluate(sa.second);
      if (listed) {
        sa.first.meta["predicted_us"] = fmt(cal.apply(v), 9);
        sa.first.meta["alternative"] = name;
        d.alternatives.push_back({name, cal.apply(v), sa.first.to_yaml()});
      }
      if (v < best_alt_us) {
        best_alt_us = v;
        best_alt = &sa.second;
      }
    }
    auto [plan_a, plan_v] = refine_groups(p, ch.choice, by_size, ch.start, false, shortcuts, plain);
    if (plan_v > best_alt_us + resolution_us(best_alt_us)) {
      // Coordinate descent from nothing compressed can stall where only many
      // tensors changing together pay; the best hand strategy is the other
      // start. From there the tiny tensors keep what it gave them, so take it
      // only when it is genuinely better.
      auto [alt_a, alt_v] = refine_groups(p, ch.choice, by_size, *best_alt, true, shortcuts, plain);
      if (alt_v < plan_v - resolution_us(plan_v)) {
        plan_a = alt_a;
        plan_v = alt_v;
      }
    }

    if (best_move_gain && listed) {
      // The tests' check of the search: every single tensor's every other
      // candidate, from the plan.
      Evaluator check(p);
      check.set_base(plan_a);
      const double f = check.base_value();
      double low = f;
      for (int k = 0; k < n; ++k)
        for (int o : ch.choice[k])
          if (o != plan_a[k]) low = std::min(low, check.try_option(k, o));
      *best_move_gain = (f - low) / f;
    }

    // "Uncompressed" is the best plan without compression: every tensor
    // where it is (kept placements), or on the servers or the ring,
    // whichever the model prefers (moving to the ring costs no accuracy,
    // so it needs no bar here; kMove's bar on moves is below).
    Assignment none = ch.start;
    if (free) {
      auto [u_a, u_v] = refine_groups(p, ch.plain, by_size, ch.start, false, shortcuts, plain);
      none = u_a;
      // The search from the uncompressed plan too: a compressed plan that
      // keeps the ring's tensors there may be found only from it.
      auto [r_a, r_v] = refine_groups(p, ch.choice, by_size, none, false, shortcuts, plain);
      if (r_v < plan_v - resolution_us(plan_v)) {
        plan_a = r_a;
        plan_v = r_v;
      }
    }
    Plan out;
    const double fp32_us = cal.apply(ev.evaluate(none));
    const double gain = fp32_us - cal.apply(plan_v);
    if (compressed(plan_a) && gain < bar_fraction * T) {
      out.kept_uncompressed = "predicted gain " + fmt(100.0 * gain / T, 3) +
                              "% is below the bar of " + fmt(100.0 * bar_fraction, 3) + "%";
      plan_a = none;
    } else if (!compressed(plan_a)) {
      plan_a = none;
    }
    // Hysteresis (a re-plan's window ran a compressed strategy): a different
    // compressed plan must be predicted faster than the strategy that runs
    // by the same bar, or a re-plan would flip between near-equal plans on
    // measurement noise; going back to uncompressed only needs to be no
    // slower (it is the accurate one). The running strategy is kept only
    // when it honours this decision's exclusions and guards.
    if (compressed(current) && plan_a != current) {
      bool honours = true;
      for (int k = 0; k < n; ++k)
        if ((excl[k] || !guarded[k].empty()) && m.options[current[k]].compressed()) honours = false;
      const double cur_us = cal.apply(ev.evaluate(current));
      const double new_us = cal.apply(ev.evaluate(plan_a));
      const bool plain_plan = !compressed(plan_a);
      const bool better = plain_plan ? new_us <= cur_us : new_us <= cur_us - bar_fraction * T;
      if (honours && !better) {
        out.kept_current = "the new plan (" + fmt(new_us / 1e3, 4) + " ms) is not " +
                           (plain_plan ? std::string("faster than")
                                       : "the bar of " + fmt(100.0 * bar_fraction, 3) +
                                             "% faster than") +
                           " the running strategy (" + fmt(cur_us / 1e3, 4) + " ms): kept";
        plan_a = current;
      }
    }
    out.a = std::move(plan_a);
    return out;
  };

  Plan chosen;
  std::string placement_note;
  if (cfg.placement == PlacementMode::kMove) {
    // Both plans: every tensor where the window ran it, and free. The free
    // one is taken only when it moves a tensor and is predicted faster than
    // the kept one by the bar: the window measured each tensor only on the
    // path it ran (its prediction is the measurement, by calibration), the
    // other path is the model's estimate (docs/planner.md "Ring allreduce
    // against push/pull": within 15% where it was checked), and a move on a
    // near-tie would move back at the next re-plan. The alternatives listed
    // are the free ones (they include "ring").
    Alts kept_alts = hand_alternatives(false), free_alts = hand_alternatives(true);
    Plan keep = plan_with(false, kept_alts, false);
    Plan move = plan_with(true, free_alts, true);
    const int moved = moves(move.a);
    if (moved == 0) {
      chosen = std::move(keep);
    } else {
      const double keep_us = cal.apply(ev.evaluate(keep.a));
      const double move_us = cal.apply(ev.evaluate(move.a));
      const std::string what = "moving " + std::to_string(moved) +
                               " tensor(s) between the servers and the ring predicted " +
                               fmt(move_us / 1e3, 4) + " ms against " + fmt(keep_us / 1e3, 4) +
                               " ms keeping every placement";
      if (move_us <= keep_us - bar_fraction * T) {
        placement_note = what + ": moved";
        chosen = std::move(move);
      } else {
        placement_note = what + ", not the bar of " + fmt(100.0 * bar_fraction, 3) +
                         "% faster: every tensor kept where it ran";
        chosen = std::move(keep);
      }
    }
  } else {
    const bool free = cfg.placement == PlacementMode::kFree;
    Alts alts = hand_alternatives(free);
    chosen = plan_with(free, alts, true);
  }
  Assignment plan_a = std::move(chosen.a);
  const std::string& kept_uncompressed = chosen.kept_uncompressed;
  d.kept_current = chosen.kept_current;
  Timeline tl;
  const double raw = ev.evaluate(plan_a, &tl);
  d.predicted_us = cal.apply(raw);
  d.timeline_json = tl.chrome_trace_json();
  d.strategy = strategy_of(prof, m, plan_a);

  // What the coordinator relies on: every emitted option runs on the CPU
  // runtime, on the servers (sharded) or on the ring, and with fixed
  // placement each tensor stays where the window ran it (with kMove a
  // moved tensor ran sharded or on the ring, checked above).
  std::vector<TensorDecl> decl;
  for (const TensorMeasure& t : prof.tensors) decl.push_back({t.name, 4 * t.elements});
  d.strategy.check_cpu_runtime(decl);
  for (int k = 0; k < n; ++k) {
    if (plan_a[k] == current[k]) continue;  // kept as the window ran it
    const strategy::Placement pl =
        strategy::plan_for_option(m.options[plan_a[k]], "<candidate>").placement;
    const bool ring = pl == strategy::Placement::kRing;
    if (pl != strategy::Placement::kSharded && !ring)
      throw Error(ErrorCode::kInternal, "online planner: an option neither sharded nor on the ring");
    if (ring != on_ring(m.options[plan_a[k]]) ||
        (!may_move && ring != static_cast<bool>(ring_tensor[k])))
      throw Error(ErrorCode::kInternal, "online planner: a tensor would change its placement");
  }

  for (int dd = 0; dd < n; ++dd) {
    const int k = m.prob_of[dd];
    d.tensors.push_back({prof.tensors[dd].name, 4 * prof.tensors[dd].elements,
                         m.options[plan_a[k]].describe(), excl[k] != 0, guarded[k]});
  }
  auto& meta = d.strategy.meta;
  meta["planner"] = "online (cpu nodes)";
  meta["pool_shares_compute"] =
      share.pool_shares_compute
          ? "yes ((local ranks + pool threads) x nodes on the host > cores): x" +
                fmt(share.pool_cost_scale, 4)
          : "no (spare cores)";
  meta["nodes_on_host"] = std::to_string(prof.nodes_on_host);
  meta["compute_stretch"] = fmt(share.compute_stretch, 4);
  meta["other_cores"] = fmt(share.other_cores, 4);
  meta["compute_floor"] = fmt(share.compute_floor, 4);
  meta["comm_cpu_ns_per_byte"] = fmt(m.cluster.comm_cpu_us_per_byte * 1e3, 4);
  meta["ring_comm_cpu_ns_per_byte"] = fmt(m.cluster.ring_comm_cpu_us_per_byte * 1e3, 4);
  meta["predicted_us"] = fmt(d.predicted_us, 9);
  meta["measured_us"] = fmt(d.measured_us, 9);
  meta["window"] = std::to_string(prof.first_iteration) + "+" + std::to_string(prof.iterations);
  meta["calibration.link_gbps"] = fmt(cal.link_gbps, 9);
  meta["calibration.link_source"] = cal.link_source;
  meta["calibration.probe_gbps"] = fmt(prof.link_gbps, 9);
  meta["calibration.residual_us"] = fmt(cal.residual_us, 9);
  meta["calibration.scale"] = fmt(cal.scale, 9);
  meta["calibration.model_us"] = fmt(cal.raw_prediction_us, 9);
  meta["min_gain_fraction"] = fmt(bar_fraction, 6);
  if (!kept_uncompressed.empty()) meta["kept_uncompressed"] = kept_uncompressed;
  if (!d.kept_current.empty()) meta["kept_current"] = d.kept_current;
  meta["placement"] =
      cfg.placement == PlacementMode::kFixed ? "fixed (every tensor keeps the window's)"
      : cfg.placement == PlacementMode::kMove
          ? "move (a running job with a ring: a move must clear the min_gain bar)"
          : "free (the job's first plan)";
  if (!placement_note.empty()) meta["placement_moves"] = placement_note;
  {
    int on = 0;
    for (int k = 0; k < n; ++k) on += on_ring(m.options[plan_a[k]]) ? 1 : 0;
    meta["ring_tensors"] = std::to_string(on);
  }
  meta["ring_model"] = "hop " + fmt(m.cluster.ring_hop_us, 4) + " us, link share " +
                       fmt(cfg.ring_link_share, 3) + ", chunks " +
                       std::to_string(cfg.ring_chunk_bytes) + " B; push/pull link share " +
                       fmt(m.cluster.ps_link_share(), 3);
  meta["nodes"] = std::to_string(cfg.nodes);
  meta["servers"] = std::to_string(cfg.servers) + (cfg.colocated_servers ? " colocated" : " dedicated");
  d.decision_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  meta["decision_ms"] = fmt(d.decision_ms, 6);
  return d;
}

}  // namespace

Decision decide(const NodeProfile& merged, const AutoConfig& cfg) {
  return decide_with(merged, cfg, true);
}

Decision detail::decide_reference(const NodeProfile& merged, const AutoConfig& cfg) {
  return decide_with(merged, cfg, false);
}

double detail::best_single_move_gain(const NodeProfile& merged, const AutoConfig& cfg) {
  double gain = 0;
  decide_with(merged, cfg, true, &gain);
  return gain;
}

}  // namespace bytecomp::planner::online
