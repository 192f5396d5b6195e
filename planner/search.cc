#include "planner/search.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <sstream>

#include <time.h>

#include "common/error.h"
#include "common/log.h"

namespace bytecomp::planner {

BC_LOG_CATEGORY(LogPlanner, "planner");

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

double thread_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

constexpr double kEps = 1e-6;

struct Summary {
  double r[kResources] = {0, 0, 0, 0};
  double latency = -1;  // -1: not computed
};

Summary summarize(Problem& p, int tensor, int opt) {
  Summary s;
  s.latency = 0;
  thread_local std::vector<Op> scratch;
  for (int c = p.first_chunk(tensor); c < p.first_chunk(tensor + 1); ++c) {
    p.chain_into(p.chunks()[c].elements, opt, scratch);
    for (const Op& op : scratch)
      if (!op.fork()) s.r[static_cast<int>(op.resource)] += op.duration_us;
    s.latency = std::max(s.latency, chain_latency(scratch));
  }
  return s;
}

// Near-equal costs count as equal: a microsecond (or half a percent) on a
// resource cannot decide an iteration of milliseconds, and treating them as
// distinct keeps hundreds of useless options alive for small tensors.
bool dominates(const Summary& a, const Summary& b) {
  auto le = [](double x, double y) { return x <= y + std::max(1.0, 0.005 * y); };
  for (int r = 0; r < kResources; ++r)
    if (!le(a.r[r], b.r[r])) return false;
  return le(a.latency, b.latency);
}

// Options of one tensor that are not dominated in (time on each resource,
// chain latency) by another option of the candidate set. Dominated options
// can only win through scheduling accidents; Algorithm 1 skips them.
std::vector<int> pareto(Problem& p, int tensor, const std::vector<int>& cands,
                        std::vector<Summary>* cache = nullptr) {
  std::vector<std::pair<Summary, int>> all;
  all.reserve(cands.size());
  for (int o : cands) {
    if (cache) {
      Summary& sm = (*cache)[o];
      if (sm.latency < 0) sm = summarize(p, tensor, o);
      all.push_back({sm, o});
    } else {
      all.push_back({summarize(p, tensor, o), o});
    }
  }
  std::sort(all.begin(), all.end(), [](const auto& x, const auto& y) {
    return x.first.latency < y.first.latency ||
           (x.first.latency == y.first.latency && x.second < y.second);
  });
  std::vector<std::pair<Summary, int>> kept;
  for (const auto& x : all) {
    bool dom = false;
    for (const auto& k : kept)
      if (dominates(k.first, x.first)) {
        dom = true;
        break;
      }
    if (!dom) kept.push_back(x);
  }
  std::vector<int> out;
  for (const auto& k : kept) out.push_back(k.second);
  return out;
}

Option template_option(const Problem& p) {
  for (const Option& o : p.options())
    if (o.compressor == p.compressor().name) return o;
  Option o;
  o.compressor = p.compressor().name;
  o.params = p.compressor().params;
  return o;
}

// Tensor order of Algorithm 1: size groups in descending order, closest to
// the output (earliest gradient) first within a group.
std::vector<int> size_order(const Problem& p) {
  std::vector<int> order(p.tensors());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return p.profile().tensors[a].elements > p.profile().tensors[b].elements;
  });
  return order;
}

// Per distinct size, the candidate lists (sizes share chains).
struct Candidates {
  std::vector<std::vector<int>> gpu;  // raw + GPU-only options, Pareto
  std::vector<std::vector<int>> all;  // every option, Pareto
};

Candidates candidates(Problem& p, int fp32_option, int max_gpu) {
  // Algorithm 1 decides GPU compression: its candidates are the GPU options
  // that are not dominated by each other nor by leaving the tensor as it is
  // (FP32); the choice among uncompressed collectives is left to the
  // refinement sweep (whose lists are built by all_candidates()).
  std::vector<int> gpu_set;
  if (fp32_option >= 0) gpu_set.push_back(fp32_option);
  for (int o = 0; o < p.tree_options(); ++o) {
    const Option& op = p.options()[o];
    if (op.compressed() && op.comp_device == Device::kCuda && op.decomp_device == Device::kCuda)
      gpu_set.push_back(o);
  }
  Candidates c;
  c.gpu.resize(p.tensors());
  std::map<uint64_t, int> seen;
  for (int i = 0; i < p.tensors(); ++i) {
    auto [it, fresh] = seen.emplace(p.profile().tensors[i].elements, i);
    if (!fresh) {
      c.gpu[i] = c.gpu[it->second];
      continue;
    }
    for (int o : pareto(p, i, gpu_set))
      if (o != fp32_option) c.gpu[i].push_back(o);
    if (max_gpu > 0 && static_cast<int>(c.gpu[i].size()) > max_gpu) {
      // Keep those that load the scarcest resources least: the links'
      // time plus the GPU time they take from the backward pass.
      std::vector<std::pair<double, int>> scored;
      for (int o : c.gpu[i]) {
        const Summary sm = summarize(p, i, o);
        scored.push_back({sm.r[static_cast<int>(Resource::kInter)] +
                              sm.r[static_cast<int>(Resource::kIntra)] +
                              sm.r[static_cast<int>(Resource::kGpu)],
                          o});
      }
      std::stable_sort(scored.begin(), scored.end());
      c.gpu[i].clear();
      for (int k = 0; k < max_gpu; ++k) c.gpu[i].push_back(scored[k].second);
    }
  }
  return c;
}

void all_candidates(Problem& p, Candidates& c) {
  if (!c.all.empty()) return;
  std::vector<int> all_set(p.tree_options());
  std::iota(all_set.begin(), all_set.end(), 0);
  c.all.resize(p.tensors());
  std::map<uint64_t, int> seen;
  for (int i = 0; i < p.tensors(); ++i) {
    auto [it, fresh] = seen.emplace(p.profile().tensors[i].elements, i);
    if (!fresh) {
      c.all[i] = c.all[it->second];
      continue;
    }
    c.all[i] = pareto(p, i, all_set);
    BC_LOG(LogPlanner(), kDebug) << "size " << p.profile().tensors[i].elements << ": "
                                 << c.gpu[i].size() << " GPU candidates, " << c.all[i].size()
                                 << " in all";
  }
}

// Tensor i takes its best option among `cands` if that shortens the
// iteration (f is updated); returns whether it changed.
bool take_best(Evaluator& ev, int i, const std::vector<int>& cands, double& f) {
  double best = f;
  int best_opt = -1;
  for (int o : cands) {
    if (o == ev.base()[i]) continue;
    const double v = ev.try_option(i, o, best - kEps);
    if (v < best - kEps) {
      best = v;
      best_opt = o;
    }
  }
  if (best_opt < 0) return false;
  ev.commit(i, best_opt);
  f = best;
  return true;
}

// One sweep over `order`: each tensor takes its best candidate.
bool sweep(Evaluator& ev, const std::vector<int>& order,
           const std::vector<std::vector<int>>& cands, double& f, double stop_at) {
  bool improved = false;
  for (int i : order) {
    if (f <= stop_at) break;
    improved |= take_best(ev, i, cands[i], f);
  }
  return improved;
}

// Moves every tensor of a size group to the same candidate option.
bool group_sweep(Problem& p, Evaluator& ev, const std::vector<std::vector<int>>& cands,
                 double& f, double stop_at) {
  std::map<uint64_t, std::vector<int>> groups;
  for (int i = 0; i < p.tensors(); ++i) groups[p.profile().tensors[i].elements].push_back(i);
  bool improved = false;
  for (auto it = groups.rbegin(); it != groups.rend(); ++it) {
    const std::vector<int>& members = it->second;
    if (members.size() < 2 || f <= stop_at) continue;
    double best = f;
    int best_opt = -1;
    for (int o : cands[members.front()]) {
      std::vector<std::pair<int, int>> changes;
      for (int i : members)
        if (ev.base()[i] != o) changes.push_back({i, o});
      if (changes.empty()) continue;
      const double v = ev.try_changes(changes, best - kEps);
      if (v < best - kEps) {
        best = v;
        best_opt = o;
      }
    }
    if (best_opt >= 0) {
      for (int i : members) ev.commit(i, best_opt);
      f = best;
      improved = true;
    }
  }
  return improved;
}

// Exchanges the options of two tensors (among the largest ones): greedy
// single moves cannot leave an optimum where two tensors hold each other's
// best option, e.g. which of them goes to the CPU pool.
bool swap_sweep(Problem& p, Evaluator& ev, const std::vector<int>& order, double& f,
                double stop_at) {
  constexpr size_t kLargest = 16;
  const size_t m = std::min(order.size(), kLargest);
  bool improved = false;
  for (size_t x = 0; x < m; ++x) {
    for (size_t y = x + 1; y < m; ++y) {
      if (f <= stop_at) return improved;
      int i = order[x], j = order[y];
      if (i > j) std::swap(i, j);
      const int oi = ev.base()[i], oj = ev.base()[j];
      if (oi == oj) continue;
      const double v = ev.try_changes({{i, oj}, {j, oi}}, f - kEps);
      if (v < f - kEps) {
        ev.commit(i, oj);
        ev.commit(j, oi);
        f = v;
        improved = true;
      }
    }
  }
  (void)p;
  return improved;
}

// Algorithm 2's grouped offloading; returns the number of groups.
int offload_pass(Problem& p, Evaluator& ev, double& f, int rounds, bool all_splits) {
  const int n = p.tensors();
  std::map<std::pair<uint64_t, int>, std::vector<int>> groups;
  for (int i = 0; i < n; ++i) {
    const Option& o = p.options()[ev.base()[i]];
    if (o.compressed() && o.cpu_share == 0.0 &&
        (o.comp_device == Device::kCuda || o.decomp_device == Device::kCuda))
      groups[{p.profile().tensors[i].elements, ev.base()[i]}].push_back(i);
  }
  std::vector<std::pair<std::pair<uint64_t, int>, std::vector<int>>> glist(groups.begin(),
                                                                           groups.end());
  std::stable_sort(glist.begin(), glist.end(),
                   [](const auto& a, const auto& b) { return a.first.first > b.first.first; });
  std::vector<std::pair<Device, Device>> splits = {{Device::kCpu, Device::kCpu},
                                                   {Device::kCuda, Device::kCpu}};
  if (all_splits) splits.push_back({Device::kCpu, Device::kCuda});
  for (int round = 0; round < rounds; ++round) {
    bool changed = false;
    for (const auto& [key, members] : glist) {
      std::vector<int> variants;
      for (auto [cd, dd] : splits) {
        Option v = p.options()[key.second];
        v.comp_device = cd;
        v.decomp_device = dd;
        if (int idx = p.find_option(v); idx >= 0) variants.push_back(idx);
      }
      for (int var : variants) {
        double best = f;
        size_t best_j = 0;
        std::vector<std::pair<int, int>> changes;
        for (size_t j = 1; j <= members.size(); ++j) {
          if (ev.base()[members[j - 1]] == var) continue;
          changes.push_back({members[j - 1], var});
          std::vector<std::pair<int, int>> sorted = changes;
          std::sort(sorted.begin(), sorted.end());
          const double v = ev.try_changes(sorted, best - kEps);
          if (v < best - kEps) {
            best = v;
            best_j = changes.size();
          }
        }
        for (size_t j = 0; j < best_j; ++j) ev.commit(changes[j].first, changes[j].second);
        if (best_j > 0) {
          f = best;
          changed = true;
        }
      }
    }
    if (!changed) break;
  }
  return static_cast<int>(glist.size());
}

// Partial offloading (our extension of Algorithm 2, which moves whole
// tensors): a large tensor whose GPU compression stretches the backward pass
// can move a share of its elements to the CPU pool (Option::cpu_share) where
// moving all of it would finish too late. The tensors with the most GPU
// compression time are tried, each over shares in steps of 1/16, refined
// around the best to 1/64. Returns the tensors split.
int split_pass(Problem& p, Evaluator& ev, double& f, size_t max_tensors) {
  std::vector<std::pair<double, int>> heavy;
  for (int i = 0; i < p.tensors(); ++i) {
    Option o = p.options()[ev.base()[i]];
    if (!o.compressed() || (o.comp_device == Device::kCpu && o.decomp_device == Device::kCpu))
      continue;
    o.cpu_share = 0.0;
    const int whole = p.find_option(o);
    if (whole < 0) continue;
    const double gpu = summarize(p, i, whole).r[static_cast<int>(Resource::kGpu)];
    if (gpu > 0) heavy.push_back({-gpu, i});
  }
  std::sort(heavy.begin(), heavy.end());
  if (heavy.size() > max_tensors) heavy.resize(max_tensors);
  int split = 0;
  for (const auto& entry : heavy) {
    // A plain local: clang 14 cannot capture a structured binding (below).
    const int i = entry.second;
    Option o = p.options()[ev.base()[i]];
    o.cpu_share = 0.0;
    const int whole = p.find_option(o);
    double best = f, best_share = -1;
    auto try_share = [&](double share) {
      const int opt = p.split_option(whole, share);
      if (opt < 0 || opt == ev.base()[i]) return false;
      const double v = ev.try_option(i, opt, best - kEps);
      if (v >= best - kEps) return false;
      best = v;
      best_share = share;
      return true;
    };
    // F falls while the CPU part finishes in time and rises once it is the
    // latest chain (GPU time moves to the CPU pool linearly in the share):
    // scan upwards from the smallest share while it improves, then refine.
    // A tensor no small share helps costs one simulation.
    for (int j = 1; j < 16 && try_share(j / 16.0); ++j) {
    }
    if (best_share < 0) continue;
    for (double step : {1.0 / 32, 1.0 / 64}) {
      const double c = best_share;
      try_share(c - step);
      try_share(c + step);
    }
    ev.commit(i, p.split_option(whole, best_share));
    f = best;
    ++split;
  }
  return split;
}

// Pipelining (Option::pieces): a tensor whose chain is long and exposed
// (typically the last large gradient, whose compression and communication
// run in series after the backward pass) gains when a slice is compressed
// while another is on the wire; each slice pays every operation's fixed
// cost again, so the count is chosen per tensor by simulation. The
// `max_tensors` tensors with the longest chains of their current option try
// every allowed count; repeated while it helps (a cut can expose another
// tensor's chain). Returns the tensors changed.
int pieces_pass(Problem& p, Evaluator& ev, double& f, size_t max_tensors) {
  if (max_tensors == 0) return 0;
  int changed = 0;
  for (int round = 0; round < 2; ++round) {
    std::vector<std::pair<double, int>> heavy;
    for (int i = 0; i < p.tensors(); ++i)
      heavy.push_back({-summarize(p, i, ev.base()[i]).latency, i});
    std::sort(heavy.begin(), heavy.end());
    if (heavy.size() > max_tensors) heavy.resize(max_tensors);
    bool improved = false;
    for (const auto& [neg_latency, i] : heavy) {
      const int cur = ev.base()[i];
      double best = f;
      int best_opt = -1;
      for (int q : Option::kAllowedPieces) {
        const int opt = p.pieces_option(cur, q);
        if (opt < 0 || opt == cur) continue;
        const double v = ev.try_option(i, opt, best - kEps);
        if (v < best - kEps) {
          best = v;
          best_opt = opt;
        }
      }
      if (best_opt < 0) continue;
      ev.commit(i, best_opt);
      f = best;
      ++changed;
      improved = true;
    }
    if (!improved) break;
  }
  return changed;
}

}  // namespace

Assignment plan(Problem& p, const PlanOptions& opts, PlanStats* stats) {
  const auto t0 = Clock::now();
  const double c0 = thread_cpu_ms();
  PlanStats st;
  const int n = p.tensors();
  Assignment start = baseline(p, Baseline::kFp32);
  Candidates cand = candidates(p, start.empty() ? -1 : start[0], opts.max_gpu_candidates);
  Evaluator ev(p);
  if (start.empty()) {
    // FP32's option is not allowed: start from each tensor's lowest-latency
    // candidate.
    start.resize(n);
    all_candidates(p, cand);
    for (int i = 0; i < n; ++i) start[i] = cand.all[i].front();
  }
  ev.set_base(start);
  double f = ev.base_value();
  // Algorithm 1 stops when no bubble is left: F equals the backward pass
  // plus the shortest tail the options it considers allow for the last
  // tensor (FP32 or a GPU candidate). The refinement, which may use any
  // option, stops at the same point.
  double tail = std::numeric_limits<double>::infinity();
  {
    const int last = n - 1;
    std::vector<int> tail_opts = cand.gpu[last];
    tail_opts.push_back(start[last]);
    for (int o : tail_opts) tail = std::min(tail, summarize(p, last, o).latency);
  }
  const double lb = p.forward_us() + p.profile().backward_us() + tail + kEps;
  const std::vector<int> order = size_order(p);

  // Algorithm 1: GPU compression with bubble elimination.
  for (int i : order) {
    if (f <= lb) break;  // no bubble left: nothing can be gained
    if (cand.gpu[i].empty()) continue;
    ++st.tensors_examined;
    take_best(ev, i, cand.gpu[i], f);
  }
  st.algorithm1_ms = ms_since(t0);

  // Algorithm 2: offload GPU compression to the CPU pool. Tensors of equal
  // size and option are interchangeable up to position, so per group the
  // choice is how many to offload (those closest to the output first, whose
  // CPU work overlaps most of the remaining backward pass). Here: both
  // operations or only the decompression (on the GPU it costs a piece per
  // sender), one round; the refinement repeats it with every device split.
  const auto t1 = Clock::now();
  st.offload_groups = offload_pass(p, ev, f, 1, false);
  st.algorithm2_ms = ms_since(t1);
  st.decision_ms = ms_since(t0);
  st.decision_cpu_ms = thread_cpu_ms() - c0;
  const Assignment unsplit = ev.base();
  const double f_unsplit = f;

  all_candidates(p, cand);
  // Refinement over the whole option set (the published code restricts
  // itself to a handful of options; we sweep all non-dominated ones): single
  // tensors, then whole size groups at once (a group often only pays off
  // when all its members move, e.g. to the CPU pool), and the partial
  // offloading of the heaviest GPU users (split_pass).
  auto refine = [&](double& fr, size_t splits) {
    for (int r = 0; r < opts.refine_rounds; ++r) {
      const double before = fr;
      offload_pass(p, ev, fr, 2, true);
      split_pass(p, ev, fr, splits);
      bool improved = fr < before - kEps;
      improved |= sweep(ev, order, cand.all, fr, lb);
      improved |= group_sweep(p, ev, cand.all, fr, lb);
      improved |= swap_sweep(p, ev, order, fr, lb);
      if (!improved) break;
    }
  };
  refine(f, opts.split_tensors);

  Assignment result = ev.base();
  auto splits_in = [&](const Assignment& a) {
    int n_split = 0;
    for (int o : a) n_split += p.options()[o].cpu_share > 0.0;
    return n_split;
  };
  if (splits_in(result) > 0) {
    // A split taken greedily can steer the sweeps into a worse local
    // optimum: refine Algorithm 2's unsplit result without splits as well,
    // then split that.
    ev.set_base(unsplit);
    double fu = f_unsplit;
    refine(fu, 0);
    split_pass(p, ev, fu, opts.split_tensors);
    if (fu < f - kEps) {
      f = fu;
      result = ev.base();
    }
  }
  if (opts.consider_baselines) {
    for (Baseline b : kBaselines) {
      Assignment a = baseline(p, b);
      if (a.empty()) continue;
      ev.set_base(a);
      double fb = ev.base_value();
      if (fb >= f - kEps) continue;
      for (int r = 0; r < opts.refine_rounds; ++r) {
        bool improved = sweep(ev, order, cand.all, fb, lb);
        improved |= group_sweep(p, ev, cand.all, fb, lb);
        improved |= swap_sweep(p, ev, order, fb, lb);
        if (!improved) break;
      }
      if (fb < f - kEps) {
        BC_LOG(LogPlanner(), kInfo) << "refined baseline " << to_string(b) << " beats the plan";
        f = fb;
        result = ev.base();
      }
    }
  }
  if (opts.pieces_tensors > 0) {
    // Pipelining last, on the final plan: it only commits improvements. A
    // cut can change which share of a split tensor fits best, so the split
    // pass runs again after it (also improvements only).
    ev.set_base(result);
    double fp = ev.base_value();
    if (pieces_pass(p, ev, fp, opts.pieces_tensors) > 0) {
      split_pass(p, ev, fp, opts.split_tensors);
      pieces_pass(p, ev, fp, opts.pieces_tensors);
    }
    if (fp < f - kEps) {
      f = fp;
      result = ev.base();
    }
  }
  st.split_tensors = splits_in(result);
  for (int o : result) st.pieced_tensors += p.options()[o].pieces > 1;
  st.total_ms = ms_since(t0);
  st.total_cpu_ms = thread_cpu_ms() - c0;
  st.simulations = ev.simulations();
  if (stats) *stats = st;
  return result;
}

const char* to_string(Baseline b) {
  switch (b) {
    case Baseline::kFp32: return "FP32";
    case Baseline::kBytePSCompress: return "BytePS-Compress";
    case Baseline::kHiPress: return "HiPress";
    case Baseline::kHiTopKComm: return "HiTopKComm";
  }
  return "?";
}

Assignment baseline(Problem& p, Baseline b, uint64_t min_compress_bytes) {
  Option raw;
  raw.compressor = "none";
  raw.scheme = Scheme::kHierarchical;
  raw.intra = Collective::kReduceScatterAllgather;
  raw.inter = Collective::kReduceScatterAllgather;
  Option c = template_option(p);
  c.scheme = Scheme::kHierarchical;
  c.compress_before = Stage::kInter;
  c.decompress_after = Stage::kInter;
  switch (b) {
    case Baseline::kFp32:
      break;
    case Baseline::kBytePSCompress:
      // Intra-node reduce to one GPU, CPU compression, PS with server-side
      // decompress-sum-recompress.
      c.intra = Collective::kReduceBroadcast;
      c.inter = Collective::kAlltoallAllgather;
      c.comp_device = c.decomp_device = Device::kCpu;
      break;
    case Baseline::kHiPress:
      c.intra = Collective::kReduceScatterAllgather;
      c.inter = Collective::kAllgather;
      c.comp_device = c.decomp_device = Device::kCuda;
      break;
    case Baseline::kHiTopKComm:
      c.intra = Collective::kAlltoallAllgather;
      c.inter = Collective::kAllgather;
      c.compress_before = Stage::kIntra;
      c.comp_device = c.decomp_device = Device::kCuda;
      break;
  }
  int raw_idx = p.find_option(raw);
  if (raw_idx < 0) {
    // E.g. the CPU runtime: its uncompressed path reduces to one buffer.
    raw.intra = Collective::kReduceBroadcast;
    raw_idx = p.find_option(raw);
  }
  const int c_idx = b == Baseline::kFp32 ? raw_idx : p.find_option(c);
  if (raw_idx < 0 || c_idx < 0) return {};
  Assignment a(p.tensors());
  for (int i = 0; i < p.tensors(); ++i) {
    const uint64_t bytes = 4 * p.profile().tensors[i].elements;
    const bool compress = b == Baseline::kHiTopKComm || bytes >= min_compress_bytes;
    a[i] = compress ? c_idx : raw_idx;
  }
  return a;
}

Assignment exact(Problem& p, double* best_value, uint64_t max_leaves) {
  const int n = p.tensors();
  // Incumbent from the planner makes the bound bite early.
  PlanOptions po;
  po.pieces_tensors = 0;
  Assignment best = plan(p, po);
  Evaluator ev(p);
  double best_f = ev.evaluate(best);
  // Options ordered by standalone latency per tensor: good leaves first.
  std::vector<std::vector<int>> order(n);
  for (int i = 0; i < n; ++i) {
    std::vector<std::pair<double, int>> v;
    // The decision tree only: split variants the planner added are reached
    // through the incumbent, not searched.
    for (int o = 0; o < p.tree_options(); ++o) {
      double lat = 0;
      for (int c = p.first_chunk(i); c < p.first_chunk(i + 1); ++c)
        lat = std::max(lat, chain_latency(p.chain(p.chunks()[c].elements, o)));
      v.push_back({lat, o});
    }
    std::stable_sort(v.begin(), v.end());
    for (auto& x : v) order[i].push_back(x.second);
  }
  std::vector<double> rest_gap(n + 1, 0);
  for (int i = n - 1; i >= 0; --i) rest_gap[i] = rest_gap[i + 1] + p.profile().tensors[i].gap_us;
  const double fwd = p.forward_us();
  ev.reset();
  Assignment cur(n, 0);
  uint64_t leaves = 0;
  bool gave_up = false;
  // Iterative DFS: idx[d] = position in order[d] being tried.
  std::vector<size_t> idx(n + 1, 0);
  int d = 0;
  while (d >= 0) {
    if (idx[d] >= order[d].size()) {
      idx[d] = 0;
      --d;
      if (d >= 0) {
        ev.pop_to(d);
        ++idx[d];
      }
      continue;
    }
    ev.pop_to(d);
    const int o = order[d][idx[d]];
    cur[d] = o;
    const double done = ev.push(o);
    const double bound = fwd + std::max(done, ev.compute_end(d) + rest_gap[d + 1]);
    if (bound >= best_f - kEps) {
      ++idx[d];
      continue;
    }
    if (d == n - 1) {
      ++leaves;
      const double f = fwd + std::max(done, ev.compute_end(d));
      if (f < best_f - kEps) {
        best_f = f;
        best = cur;
      }
      ++idx[d];
      if (leaves >= max_leaves) {
        gave_up = true;
        break;
      }
      continue;
    }
    ++d;
    idx[d] = 0;
  }
  if (gave_up) return {};
  if (best_value) *best_value = best_f;
  return best;
}

double upper_bound_us(const Problem& p) {
  Problem z = p.zero_cost_copy();
  Assignment a = plan(z);
  Evaluator ev(z);
  return ev.evaluate(a);
}

Problem random_small_problem(std::mt19937& rng, const CostTable& costs, int tensors) {
  std::uniform_real_distribution<double> u(0, 1);
  std::ostringstream prof;
  prof << "version: 1\nmodel: random\nforward_us: " << static_cast<int>(u(rng) * 2000)
       << "\ntensors:\n";
  for (int i = 0; i < tensors; ++i)
    prof << "  - {name: t" << i
         << ", elements: " << static_cast<uint64_t>(std::pow(10, 2 + 5 * u(rng)))
         << ", gap_us: " << static_cast<int>(u(rng) * 3000) << "}\n";
  std::ostringstream cl;
  cl << "version: 1\nname: random\nmachines: 2\ngpus_per_machine: 2\n"
     << "intra: {gbps: " << 50 + static_cast<int>(u(rng) * 500) << ", latency_us: 5}\n"
     << "inter: {gbps: " << 5 + static_cast<int>(u(rng) * 50) << ", latency_us: 20}\n"
     << "cpu_cores: " << 1 + static_cast<int>(u(rng) * 8) << "\n";
  const char* comps[] = {"randomk:0.01", "dgc:0.01", "efsignsgd"};
  Constraints c;
  c.include_fp16 = false;
  return Problem(Profile::parse(prof.str(), "random.yaml"), Cluster::parse(cl.str(), "random.yaml"),
                 costs, CompressorSpec::parse(comps[rng() % 3]), c);
}

Strategy to_strategy(const Problem& p, const Assignment& a) {
  Strategy s;
  // The default (tensors not in the plan) is uncompressed in the form every
  // runtime executes, the CPU daemon included (intra reduce, PS).
  Option raw;
  raw.compressor = "none";
  raw.intra = Collective::kReduceBroadcast;
  s.set_default(raw);
  for (int i = 0; i < p.tensors(); ++i)
    s.add_entry({p.profile().tensors[i].name, p.options()[a[i]]});
  s.meta["model"] = p.profile().model;
  s.meta["compressor"] = p.compressor().text();
  s.meta["cluster"] = p.cluster().name;
  return s;
}

}  // namespace bytecomp::planner
