#include "planner/evaluator.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "planner/run_chain.h"

namespace bytecomp::planner {

Evaluator::Evaluator(Problem& p) : p_(p) {
  const int n = p_.tensors();
  compute_end_.assign(n, 0);
  prefix_done_.assign(n + 1, 0);
  log_.reserve(16 * p_.chunks().size() + 64);
  snap_.resize(n);
  base_compute_end_.assign(n, 0);
  base_drained_.assign(n + 1, 0);
  base_suffix_end_.assign(n + 1, 0);
  base_work_.assign(n + 1, Work{});
  base_done_.assign(n, 0);
  base_tensor_work_.assign(n, Work{});
  rest_backward_.assign(n + 1, 0);
  pending_off_.assign(static_cast<size_t>(n) * kResources + 1, 0);
  pending_last_.assign(n, Work{});
  pending_kept_.assign(n, 0);
  pending_gaps_.reserve(static_cast<size_t>(n) * 4);
  for (int i = n - 1; i >= 0; --i)
    rest_backward_[i] = rest_backward_[i + 1] + p_.profile().tensors[i].gap_us;
  base_info_from_ = 0;  // nothing known yet: boundaries >= 0 need a refresh
  tried_.resize(n);
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
    done = std::max(done, detail::run_chain(p_.chunk_chain(c, opt), ready, put, emit));
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
  ++base_version_;
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
    record_pending(i);
    base_done_[i] = simulate_tensor(i, base_[i], nullptr);
    base_compute_end_[i] = compute_end_[i];
    Work w{};
    for (int c = p_.first_chunk(i); c < p_.first_chunk(i + 1); ++c)
      for (const Op& op : p_.chunk_chain(c, base_[i]))
        if (op.duration_us > 0) w[static_cast<int>(op.resource)] += op.duration_us;
    base_tensor_work_[i] = w;
  }
  // Suffix aggregates change at every boundary, not only from `from` on.
  base_drained_[n] = 0;
  double tail = compute_end_[n - 1];
  Work work{};
  base_suffix_end_[n] = tail;
  base_work_[n] = work;
  for (int i = n - 1; i >= 0; --i) {
    tail = std::max(tail, base_done_[i]);
    for (int r = 0; r < kResources; ++r) work[r] += base_tensor_work_[i][r];
    base_suffix_end_[i] = tail;
    base_work_[i] = work;
  }
  base_value_ = p_.forward_us() + std::max(prefix_done_[n], compute_end_[n - 1]);
  base_info_from_ = n + 1;
}

namespace {
// Pending state compares equal up to this (µs): a shift of time rounds.
constexpr double kShiftTolerance = 1e-6;
// Boundaries with more idle gaps pending on a resource are not recorded.
constexpr std::ptrdiff_t kPendingGapsKept = 16;
}  // namespace

void Evaluator::record_pending(int j) {
  const double ce = j == 0 ? 0.0 : compute_end_[j - 1];
  const size_t at = static_cast<size_t>(j) * kResources;
  const uint32_t start = pending_off_[at];
  pending_gaps_.resize(start);
  pending_kept_[j] = 1;
  for (int r = 0; r < kResources; ++r) {
    pending_off_[at + r] = static_cast<uint32_t>(pending_gaps_.size());
    const ResourceState& s = res_[r];
    auto it = std::upper_bound(s.gaps.begin(), s.gaps.end(), ce,
                               [](double t, const Gap& g) { return t < g.end; });
    if (s.gaps.end() - it > kPendingGapsKept) {
      // Much still pending: a shifted copy is unlikely, recording it costly.
      pending_kept_[j] = 0;
      pending_gaps_.resize(start);
      for (int q = 0; q <= kResources; ++q) pending_off_[at + q] = start;
      return;
    }
    for (; it != s.gaps.end(); ++it)
      pending_gaps_.push_back({std::max(it->start, ce) - ce, it->end - ce});
    pending_last_[j][r] = std::max(s.last_end, ce) - ce;
  }
  pending_off_[at + kResources] = static_cast<uint32_t>(pending_gaps_.size());
}

bool Evaluator::shifted_base(int j) const {
  if (!pending_kept_[j]) return false;
  const double ce = compute_end_[j - 1];
  const size_t at = static_cast<size_t>(j) * kResources;
  auto near = [](double a, double b) { return std::abs(a - b) <= kShiftTolerance; };
  for (int r = 0; r < kResources; ++r) {
    const ResourceState& s = res_[r];
    if (!near(std::max(s.last_end, ce) - ce, pending_last_[j][r])) return false;
    auto it = std::upper_bound(s.gaps.begin(), s.gaps.end(), ce,
                               [](double t, const Gap& g) { return t < g.end; });
    const uint32_t b = pending_off_[at + r], e = pending_off_[at + r + 1];
    if (static_cast<size_t>(s.gaps.end() - it) != e - b) return false;
    for (uint32_t k = b; k < e; ++k, ++it)
      if (!near(std::max(it->start, ce) - ce, pending_gaps_[k].start) ||
          !near(it->end - ce, pending_gaps_[k].end))
        return false;
  }
  return true;
}

bool Evaluator::cannot_beat(int j, double cutoff) const {
  // Every operation of tensors >= j starts once its gradient is ready, after
  // tensor j - 1's; so does the backward pass left, which runs on the GPU
  // resource in its idle time (no operation overlaps it). On each resource
  // that work fits at best into the idle gaps after that point and then
  // after the resource's last end: F >= forward + that finish.
  const double ready = compute_end_[j - 1];
  const double fwd = p_.forward_us();
  for (int ri = 0; ri < kResources; ++ri) {
    const double work =
        base_work_[j][ri] + (ri == static_cast<int>(Resource::kGpu) ? rest_backward_[j] : 0.0);
    if (work <= 0) continue;
    const ResourceState& r = res_[ri];
    // How much idle time may be usable before the bound no longer reaches
    // the cutoff; negative: not even with none (the common case, decided
    // without looking at the gaps).
    const double slack = fwd + std::max(r.last_end, ready) + work - cutoff;
    if (slack < 0) continue;
    // Latest gaps first: the largest are usually the latest (an operation
    // placed far ahead leaves one behind it), so a bound that fails is
    // known after a few.
    double idle = 0;
    bool fits = false;
    for (auto it = r.gaps.rbegin(); it != r.gaps.rend() && it->end > ready; ++it) {
      idle += it->end - std::max(it->start, ready);
      if (idle > slack) {
        fits = true;
        break;
      }
    }
    if (!fits) return true;
  }
  return false;
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
  if (!shortcuts_) cutoff = std::numeric_limits<double>::infinity();
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
    // Only once every change is in does the rest run the base's options.
    if (next < nch || j == n) continue;
    if (std::isfinite(cutoff) && cannot_beat(j, cutoff)) {
      rollback(from);
      return std::numeric_limits<double>::infinity();
    }
    bool same_rest = base_drained_[j] && drained(j);
    if (!same_rest && shortcuts_ && shifted_base(j)) {
      same_rest = true;
      ++shifted_;
    }
    if (same_rest) {
      // Both timelines are idle when tensor j starts (or what is pending is
      // the same): the rest is the base's, shifted by the difference in
      // backward progress.
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
  if (!shortcuts_) return run_suffix(i, &c, 1, cutoff);
  std::vector<Tried>& row = tried_[i];
  if (static_cast<size_t>(opt) >= row.size()) row.resize(p_.options().size());
  Tried& t = row[opt];
  // The answer depends on the base only; +inf holds for any lower cutoff.
  if (t.version == base_version_ && (std::isfinite(t.value) || cutoff <= t.cutoff)) {
    ++remembered_;
    return t.value;
  }
  const double v = run_suffix(i, &c, 1, cutoff);
  t = {base_version_, cutoff, v};
  return v;
}

double Evaluator::try_changes(const std::vector<std::pair<int, int>>& changes, double cutoff) {
  if (changes.empty()) return base_value();
  return run_suffix(changes.front().first, changes.data(), changes.size(), cutoff);
}

void Evaluator::commit(int i, int opt) {
  base_[i] = opt;
  ++base_version_;
  rollback(i);
  base_value_ = -1;
  // Boundaries <= i keep their drain facts; later ones must be refreshed.
  base_info_from_ = std::min(base_info_from_, i);
}

}  // namespace bytecomp::planner
