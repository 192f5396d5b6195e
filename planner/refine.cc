// The online planner's search (search.h refine_groups): coordinate descent
// over groups of equal-sized tensors, on the calibrated CPU-node model that
// planner/online.cc builds.
#include <algorithm>
#include <functional>
#include <map>
#include <utility>
#include <vector>

#include "planner/search.h"

namespace bytecomp::planner {

namespace {

constexpr int kRefineRounds = 3;

}  // namespace

std::pair<Assignment, double> refine_groups(Problem& p, const std::vector<std::vector<int>>& cands,
                                            const std::vector<int>& by_size, Assignment start,
                                            bool cleanup, bool shortcuts,
                                            const std::vector<int>& plain) {
  auto plain_of = [&](int o) { return plain.empty() ? 0 : plain[static_cast<size_t>(o)]; };
  Evaluator ev(p);
  ev.set_shortcuts(shortcuts);
  ev.set_base(start);
  double best = ev.base_value();
  auto threshold = [](double v) { return resolution_us(v); };
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
  // Groups of equal element count and candidate set among tensors that
  // have a choice (largest first).
  std::map<std::vector<int>, int> set_id;
  std::map<std::pair<uint64_t, int>, std::vector<int>, std::greater<>> groups;
  for (int i : by_size)
    if (cands[i].size() > 1) {
      const int id = set_id.emplace(cands[i], static_cast<int>(set_id.size())).first->second;
      groups[{p.profile().tensors[i].elements, id}].push_back(i);
    }
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
      if (ev.base()[i] != plain_of(ev.base()[i])) changes.push_back({i, plain_of(ev.base()[i])});
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
      const double v = ev.try_option(i, opt, budget);
      if (v < budget) {
        ev.commit(i, opt);
        best = v;
        misses = 0;
      } else {
        ++misses;
      }
    }
  }
  return {ev.base(), ev.base_value()};
}

}  // namespace bytecomp::planner
