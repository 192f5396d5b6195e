#include "planner/online.h"

#include <fnmatch.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <sstream>

#include "common/config.h"
#include "common/error.h"
#include "compress/catalogue.h"
#include "compress/compressor.h"
#include "planner/chains.h"
#include "planner/evaluator.h"
#include "planner/strategy/plan.h"

namespace bytecomp::planner::online {

using config::Document;
using config::Range;
using config::Reader;
using strategy::emit_text;

namespace {

// A change of strategy is kept only when it shortens the predicted
// iteration by more than the model's resolution: the fits and the
// calibration are not better than this, and a "gain" below it (a
// 64-element vector compressed on a saturated link) is noise that costs
// accuracy and server work for nothing.
constexpr double kMinGainFraction = 1e-3;
constexpr double kMinGainUs = 5.0;
// Bounds of the effective link rate calibration derives: without a probe,
// anything plausible; with one, within a factor of 4 of it (beyond that the
// probe is not what is wrong: something unmodelled is, and it goes into the
// residual or the scale).
constexpr double kMinLinkGbps = 1e-3, kMaxLinkGbps = 1e4;
constexpr double kProbeFactor = 4.0;
// The compute stretch of a shared host is a correction of the window's
// contention, not a new measurement: bounded.
constexpr double kMinStretch = 0.25, kMaxStretch = 4.0;
constexpr int kRefineRounds = 3;
constexpr double kCalibrationTolerance = 1e-4;

std::string canonical_spec(std::string_view text) {
  return compress::to_string(compress::parse_compressor_spec(text));
}

std::string fmt(double v, int prec = 6) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*g", prec, v);
  return buf;
}

std::string fmt_fixed(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
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

HostShare host_share(const NodeProfile& prof) {
  HostShare s;
  const double cores = std::max(1u, prof.cpu_cores);
  const double nodes = std::max(1u, prof.nodes_on_host);
  const double procs = nodes * std::max(1u, prof.local_ranks);
  s.pool_shares_compute = (prof.local_ranks + prof.pool_threads) * nodes > cores;
  s.pool_cost_scale = nodes / cores;
  double last = 0;
  for (const TensorMeasure& t : prof.tensors) last = std::max(last, t.ready_us);
  if (prof.train_cpu_us > 0 && procs >= cores && last > 0) {
    s.compute_bound_us = prof.train_cpu_us * procs / cores;
    s.compute_stretch = std::clamp(s.compute_bound_us / last, kMinStretch, kMaxStretch);
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

// Coordinate descent over the candidate options from `start`: first whole
// groups of equal-sized tensors (what Algorithm 2 moves together; a tensor
// of a size of its own is a group of one), largest first, then runs of a
// group's members from either end in ready order and single tensors of a
// size of their own, keeping only changes that beat the gain threshold. From a hand
// strategy (`cleanup`: uniform, so what it can improve on is whole groups)
// the group moves only, then tensors whose compression gains less than the
// resolution go back to none.
std::pair<Assignment, double> refine(Problem& p, const std::vector<std::vector<int>>& cands,
                                     const std::vector<int>& by_size, Assignment start,
                                     bool cleanup, bool shortcuts) {
  Evaluator ev(p);
  ev.set_shortcuts(shortcuts);
  ev.set_base(start);
  double best = ev.base_value();
  auto threshold = [&](double v) { return std::max(kMinGainUs, kMinGainFraction * v); };
  // What changing tensor i's option can gain at most: the work it takes
  // off the link and off the CPU (a change never speeds up the backward
  // pass). Tensors whose bound is below the threshold are not tried: most
  // of a Transformer's tensors are biases and norms.
  const int n = p.tensors();
  std::vector<double> bound(n, 0);
  {
    std::vector<Op> ops;
    for (int i = 0; i < n; ++i) {
      std::vector<std::pair<double, double>> work;  // (link, cpu) per candidate
      for (int o : cands[i]) {
        double link = 0, cpu = 0;
        for (int c = p.first_chunk(i); c < p.first_chunk(i + 1); ++c) {
          p.chain_into(p.chunks()[c].elements, o, ops);
          for (const Op& op : ops) {
            if (op.fork()) continue;
            (op.resource == Resource::kCpu ? cpu : link) += op.duration_us;
          }
        }
        work.push_back({link, cpu});
      }
      for (const auto& a : work)
        for (const auto& b : work)
          bound[i] = std::max(bound[i], std::max(0.0, a.first - b.first) +
                                            std::max(0.0, a.second - b.second));
    }
  }
  // Groups of equal element count among tensors that have a choice.
  std::map<uint64_t, std::vector<int>, std::greater<>> groups;
  for (int i : by_size)
    if (cands[i].size() > 1) groups[p.profile().tensors[i].elements].push_back(i);
  std::vector<std::pair<int, int>> changes;
  auto group_pass = [&] {
    bool moved = false;
    for (auto& [size, members] : groups) {
      std::sort(members.begin(), members.end());
      double group_bound = 0;
      for (int i : members) group_bound += bound[i];
      if (group_bound < threshold(best)) continue;
      // One move, one threshold: a group of small tensors that together
      // shorten a saturated link's queue pays even where each alone is
      // below the resolution. The group takes its best option.
      double need = best - threshold(best);
      int pick = -1;
      for (int o : cands[members.front()]) {
        changes.clear();
        for (int i : members)
          if (ev.base()[i] != o) changes.push_back({i, o});
        if (changes.empty()) continue;
        const double v = ev.try_changes(changes, need);
        if (v < need) {
          need = v;
          pick = o;
        }
      }
      if (pick >= 0) {
        for (int i : members)
          if (ev.base()[i] != pick) ev.commit(i, pick);
        best = need;
        moved = true;
      }
    }
    return moved;
  };
  // Tensor i takes its best other option if that beats the threshold.
  auto single = [&](int i) {
    if (cands[i].size() < 2 || bound[i] < threshold(best)) return false;
    int pick = -1;
    double need = best - threshold(best);
    for (int o : cands[i]) {
      if (o == ev.base()[i]) continue;
      const double v = ev.try_option(i, o, need);
      if (v < need) {
        need = v;
        pick = o;
      }
    }
    if (pick < 0) return false;
    // try_option's value below the cutoff is exact: no re-simulation.
    ev.commit(i, pick);
    best = need;
    return true;
  };
  // The members of a group (in ready order) differ only in when their
  // gradients are ready, and what choosing per tensor finds among them is
  // a run from one end: the earliest have the whole backward pass left to
  // hide a transfer in, the latest have none. Runs of 1, 2, 4, ... members
  // from either end try each other option, growing while they pay (two
  // misses in a row end a run); the best run is taken.
  // (Members too small to matter one by one move with their whole group
  // only: all members of a group have the same bound.)
  auto runs = [&](const std::vector<int>& members) {
    const size_t m = members.size();
    if (bound[members.front()] < threshold(best)) return false;
    double need = best - threshold(best);
    std::vector<std::pair<int, int>> pick;
    for (int o : cands[members.front()]) {
      for (int from_end = 0; from_end < 2; ++from_end) {
        auto member = [&](size_t q) { return members[from_end ? m - 1 - q : q]; };
        int misses = 0;
        for (size_t k = 1; k < m && misses < 2; k *= 2) {
          changes.clear();
          for (size_t q = 0; q < k; ++q)
            if (ev.base()[member(q)] != o) changes.push_back({member(q), o});
          if (changes.empty()) continue;
          std::sort(changes.begin(), changes.end());
          const double v = changes.size() == 1 ? ev.try_option(changes[0].first, o, need)
                                               : ev.try_changes(changes, need);
          if (v < need) {
            need = v;
            pick = changes;
            misses = 0;
          } else {
            ++misses;
          }
        }
      }
    }
    if (pick.empty()) return false;
    for (auto [i, o] : pick) ev.commit(i, o);
    best = need;
    return true;
  };
  // Round after round over the groups (at most kRefineRounds), until every
  // group has been tried against the current base without a change: a
  // group tried since the last change would only repeat its answers.
  std::vector<const std::vector<int>*> order;
  for (const auto& [size, members] : groups) order.push_back(&members);
  auto local_rounds = [&] {
    const size_t g = order.size();
    size_t quiet = 0;
    for (size_t step = 0; step < kRefineRounds * g && quiet < g; ++step) {
      const std::vector<int>& members = *order[step % g];
      const bool moved = members.size() == 1 ? single(members.front()) : runs(members);
      quiet = moved ? 0 : quiet + 1;
    }
  };
  group_pass();
  if (!cleanup) {
    local_rounds();
    // Local changes move the link's queue; a group that did not pay before
    // may pay now (and then the local moves once more).
    if (group_pass()) local_rounds();
  }
  // Uncompressed is preferred where compression gains less than the
  // resolution (smallest tensors first): together these reverts cost at
  // most one threshold, so what stays compressed is what pays.
  // (Only from a hand strategy: from nothing compressed, no tensor was
  // compressed for less than the threshold.) The first tensors that do not
  // fit the budget mean the rest will not either: it stops after a few.
  const double budget = best + threshold(best);
  int misses = 0;
  // Smallest groups first; a whole group of equal-sized tensors is tried at
  // once (most of a Transformer's are 110 vectors of one size), then its
  // members one by one.
  for (auto g = groups.rbegin(); cleanup && g != groups.rend() && misses < 8; ++g) {
    changes.clear();
    for (int i : g->second)
      if (ev.base()[i] != 0) changes.push_back({i, 0});
    if (changes.empty()) continue;
    if (changes.size() > 1) {
      const double v = ev.try_changes(changes, budget);
      if (v < budget) {
        for (auto [i, opt] : changes) ev.commit(i, opt);
        best = v;
        misses = 0;
        continue;
      }
    }
    for (auto [i, opt] : changes) {
      if (misses >= 8) break;
      const double v = ev.try_option(i, 0, budget);
      if (v < budget) {
        ev.commit(i, 0);
        best = v;
        misses = 0;
      } else {
        ++misses;
      }
    }
  }
  return {ev.base(), ev.base_value()};
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
  const HostShare share = host_share(prof);
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
        o.pieces = 1;
      }
      current[m.prob_of[d]] = option_index(m.options, o);
    }
  }

  // The comm stack's CPU per byte: the daemon's CPU in the window less the
  // pool work the model already has, over the bytes the node's NIC carried;
  // a colocated server doubles it (its share of every node's partitions is
  // as many bytes, received, summed and sent).
  if (prof.daemon_cpu_us > 0 && cfg.nodes > 1) {
    const double remote = cfg.colocated_servers ? 1.0 - 1.0 / std::max(1u, cfg.servers) : 1.0;
    double bytes = 0, pool = 0;
    for (int k = 0; k < n; ++k) {
      const Option& o = m.options[current[k]];
      const double e = static_cast<double>(m.profile.tensors[k].elements);
      const CompressorCost* cc = o.compressed() ? m.costs.find(o.compressor) : nullptr;
      bytes += 2 * remote * (cc ? cc->wire_bytes(e) : 4 * e);
      pool += m.cluster.reduce.at(e);
      if (cc) pool += cc->cpu->compress.at(e) + cc->cpu->decompress.at(e);
    }
    if (bytes > 0)
      m.cluster.comm_cpu_us_per_byte = std::max(0.0, prof.daemon_cpu_us - pool) / bytes *
                                       (cfg.colocated_servers ? 2.0 : 1.0);
  }
  const Calibration cal = calibrate(m, prof, current);
  Problem p = make_problem(m, cal.link_gbps);

  // Per tensor (problem order) its candidate option indices.
  std::vector<std::vector<int>> choice(n);
  std::vector<char> excl(n, 0);
  for (int k = 0; k < n; ++k) {
    excl[k] = excluded_name(cfg.exclude, p.profile().tensors[k].name);
    choice[k].push_back(0);
    if (!excl[k])
      for (size_t o = 1; o < m.candidates; ++o) choice[k].push_back(static_cast<int>(o));
  }
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
  auto hand = [&](const Option& o, uint64_t min_bytes) {
    Strategy s;
    s.set_default(min_bytes > 0 ? Option{} : o);
    for (const std::string& g : cfg.exclude) s.add_rule(Rule{g, 0, UINT64_MAX, Option{}});
    if (min_bytes > 0) s.add_rule(Rule{"*", min_bytes, UINT64_MAX, o});
    Assignment a(n, 0);
    for (int k = 0; k < n; ++k) {
      const TensorProfile& t = p.profile().tensors[k];
      const Option& r = s.resolve(t.name, 4 * t.elements);
      for (size_t c = 0; c < m.candidates; ++c)
        if (m.options[c] == r) a[k] = static_cast<int>(c);
    }
    return std::make_pair(std::move(s), std::move(a));
  };
  std::vector<std::pair<std::string, std::pair<Strategy, Assignment>>> alts;
  alts.push_back({"fp32", hand(Option{}, 0)});
  alts.push_back({"fp16", hand(m.options[1], 0)});
  for (const auto& [canon, written] : accepted) {
    int idx = 0;
    for (size_t o = 0; o < m.candidates; ++o)
      if (cands[o].spec == canon) idx = static_cast<int>(o);
    alts.push_back({"all:" + written, hand(m.options[idx], 0)});
    alts.push_back({"threshold:" + written, hand(m.options[idx], cfg.min_compress_bytes)});
  }
  const Assignment* best_alt = nullptr;
  double best_alt_us = std::numeric_limits<double>::infinity();
  for (auto& [name, sa] : alts) {
    const double v = ev.evaluate(sa.second);
    sa.first.meta["predicted_us"] = fmt(cal.apply(v), 9);
    sa.first.meta["alternative"] = name;
    d.alternatives.push_back({name, cal.apply(v), sa.first.to_yaml()});
    if (v < best_alt_us) {
      best_alt_us = v;
      best_alt = &sa.second;
    }
  }

  auto [plan_a, plan_v] = refine(p, choice, by_size, Assignment(n, 0), false, shortcuts);
  if (plan_v > best_alt_us + std::max(kMinGainUs, kMinGainFraction * best_alt_us)) {
    // Coordinate descent from nothing compressed can stall where only many
    // tensors changing together pay; the best hand strategy is the other
    // start. From there the tiny tensors keep what it gave them, so take it
    // only when it is genuinely better.
    auto [alt_a, alt_v] = refine(p, choice, by_size, *best_alt, true, shortcuts);
    if (alt_v < plan_v - std::max(kMinGainUs, kMinGainFraction * plan_v)) {
      plan_a = alt_a;
      plan_v = alt_v;
    }
  }

  if (best_move_gain) {
    // The tests' check of the search: every single tensor's every other
    // candidate, from the plan.
    Evaluator check(p);
    check.set_base(plan_a);
    const double f = check.base_value();
    double low = f;
    for (int k = 0; k < n; ++k)
      for (int o : choice[k])
        if (o != plan_a[k]) low = std::min(low, check.try_option(k, o));
    *best_move_gain = (f - low) / f;
  }

  // The bar a compressed plan must clear (AutoConfig::min_gain).
  // The calibration's misfit (what the link rate could not explain, as a
  // fraction of the iteration) raises it: a gain the model cannot resolve
  // is not worth the accuracy compression costs.
  const double T = std::max(1.0, prof.iteration_us);
  const double fp32_us = cal.apply(ev.evaluate(Assignment(n, 0)));
  const double misfit = std::max(cal.residual_us / T, 1.0 - cal.scale);
  const double bar_fraction = std::max(cfg.min_gain, misfit);
  const double gain = fp32_us - cal.apply(plan_v);
  std::string kept_uncompressed;
  if (plan_a != Assignment(n, 0) && gain < bar_fraction * T) {
    kept_uncompressed = "predicted gain " + fmt(100.0 * gain / T, 3) + "% is below the bar of " +
                        fmt(100.0 * bar_fraction, 3) + "%";
    plan_a = Assignment(n, 0);
  }
  Timeline tl;
  const double raw = ev.evaluate(plan_a, &tl);
  d.predicted_us = cal.apply(raw);
  d.timeline_json = tl.chrome_trace_json();
  d.strategy = strategy_of(prof, m, plan_a);

  // What the coordinator relies on: every emitted option runs on the CPU
  // runtime and keeps the tensor sharded.
  std::vector<TensorDecl> decl;
  for (const TensorMeasure& t : prof.tensors) decl.push_back({t.name, 4 * t.elements});
  d.strategy.check_cpu_runtime(decl);
  for (size_t o = 0; o < m.candidates; ++o)
    if (strategy::plan_for_option(m.options[o], "<candidate>").placement !=
        strategy::Placement::kSharded)
      throw Error(ErrorCode::kInternal, "online planner: a candidate option is not sharded");

  for (int dd = 0; dd < n; ++dd) {
    const int k = m.prob_of[dd];
    d.tensors.push_back({prof.tensors[dd].name, 4 * prof.tensors[dd].elements,
                         m.options[plan_a[k]].describe(), excl[k] != 0});
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
  meta["comm_cpu_ns_per_byte"] = fmt(m.cluster.comm_cpu_us_per_byte * 1e3, 4);
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

// ---------------------------------------------------------------- record

std::string Decision::to_yaml() const {
  YAML::Emitter out;
  out.SetDoublePrecision(17);
  out << YAML::BeginMap;
  out << YAML::Key << "version" << YAML::Value << 1;
  out << YAML::Key << "predicted_us" << YAML::Value << predicted_us;
  out << YAML::Key << "measured_us" << YAML::Value << measured_us;
  out << YAML::Key << "decision_ms" << YAML::Value << decision_ms;
  out << YAML::Key << "tensors" << YAML::Value << YAML::BeginSeq;
  for (const TensorChoice& t : tensors) {
    out << YAML::Flow << YAML::BeginMap << YAML::Key << "name" << YAML::Value
        << YAML::DoubleQuoted << t.name << YAML::Key << "bytes" << YAML::Value << t.bytes
        << YAML::Key << "option" << YAML::Value << YAML::DoubleQuoted << t.option << YAML::Key
        << "excluded" << YAML::Value << t.excluded << YAML::EndMap;
  }
  out << YAML::EndSeq;
  out << YAML::Key << "alternatives" << YAML::Value << YAML::BeginSeq;
  for (const Alternative& a : alternatives) {
    out << YAML::BeginMap << YAML::Key << "name" << YAML::Value << YAML::DoubleQuoted << a.name
        << YAML::Key << "predicted_us" << YAML::Value << a.predicted_us;
    emit_text(out, "strategy", a.strategy_yaml);
    out << YAML::EndMap;
  }
  out << YAML::EndSeq;
  emit_text(out, "strategy", strategy.to_yaml());
  emit_text(out, "timeline_json", timeline_json);
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

Decision Decision::parse(std::string_view text, std::string name) {
  Document doc = Document::parse(text, name);
  Reader root = doc.root("");
  Decision d;
  root.require("predicted_us").require("strategy").require("tensors");
  std::string strategy_text;
  root.get("predicted_us", d.predicted_us, Range<double>{0, 1e15})
      .get("measured_us", d.measured_us, Range<double>{0, 1e15})
      .get("decision_ms", d.decision_ms, Range<double>{0, 1e12})
      .get("strategy", strategy_text)
      .get("timeline_json", d.timeline_json);
  for (Reader& r : root.list("tensors")) {
    TensorChoice t;
    r.require("name").require("option");
    r.get("name", t.name).get("bytes", t.bytes).get("option", t.option).get("excluded", t.excluded);
    if (t.name.empty()) r.fail("name", "empty tensor name");
    r.finish();
    d.tensors.push_back(std::move(t));
  }
  for (Reader& r : root.list("alternatives")) {
    Alternative a;
    r.require("name").require("predicted_us");
    r.get("name", a.name)
        .get("predicted_us", a.predicted_us, Range<double>{0, 1e15})
        .get("strategy", a.strategy_yaml);
    if (!a.strategy_yaml.empty()) {
      try {
        (void)Strategy::parse(a.strategy_yaml, name + ": alternative '" + a.name + "' strategy");
      } catch (const std::exception& e) {
        r.fail("strategy", e.what());
      }
    }
    r.finish();
    d.alternatives.push_back(std::move(a));
  }
  root.finish();
  d.strategy = Strategy::parse(strategy_text, name + ": strategy");
  return d;
}

std::string Decision::explain() const {
  std::ostringstream os;
  size_t w = 6;
  for (const TensorChoice& t : tensors) w = std::max(w, t.name.size());
  int compressed = 0;
  uint64_t total = 0, squeezed = 0;
  for (const TensorChoice& t : tensors) {
    total += t.bytes;
    if (t.option.rfind("none", 0) != 0) {
      ++compressed;
      squeezed += t.bytes;
    }
  }
  os << "Decision: " << compressed << " of " << tensors.size() << " tensors compressed ("
     << fmt_fixed(total ? 100.0 * static_cast<double>(squeezed) / static_cast<double>(total) : 0, 1)
     << "% of the bytes)\n";
  auto meta_of = [&](const char* k) {
    auto it = strategy.meta.find(k);
    return it == strategy.meta.end() ? std::string() : it->second;
  };
  if (std::string link = meta_of("calibration.link_gbps"); !link.empty())
    os << "model: link " << link << " Gbit/s, " << meta_of("calibration.link_source")
       << "; residual " << meta_of("calibration.residual_us") << " us, scale "
       << meta_of("calibration.scale") << "\n";
  // The option's first word is the compressor and its parameters; the rest
  // (scheme, collectives) is the same sharded shape for every tensor and is
  // in plan.yaml.
  os << "\n" << "tensor" << std::string(w - 6 + 2, ' ') << "      bytes  choice\n";
  for (const TensorChoice& t : tensors) {
    const std::string b = std::to_string(t.bytes);
    std::string what = t.option.substr(0, t.option.find(' '));
    if (t.option.find(" ef ") != std::string::npos) what += " +ef";
    os << t.name << std::string(w - t.name.size() + 2, ' ')
       << std::string(b.size() < 11 ? 11 - b.size() : 0, ' ') << b << "  " << what
       << (t.excluded ? "  (excluded)" : "") << "\n";
  }
  os << "\npredicted iteration: " << fmt_fixed(predicted_us / 1e3, 2) << " ms\n";
  os << "measured before the decision: " << fmt_fixed(measured_us / 1e3, 2) << " ms\n";
  if (!alternatives.empty()) {
    os << "\nalternatives (predicted):\n";
    size_t aw = 4;
    for (const Alternative& a : alternatives) aw = std::max(aw, a.name.size());
    for (const Alternative& a : alternatives)
      os << "  " << a.name << std::string(aw - a.name.size() + 2, ' ')
         << fmt_fixed(a.predicted_us / 1e3, 2) << " ms\n";
  }
  return os.str();
}

}  // namespace bytecomp::planner::online