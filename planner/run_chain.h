// Internal to the planner: the placement of one chain's operations, shared by
// chain_latency() (idle resources) and the Evaluator (its resource state), so
// that both schedule a chain's groups and slices the same way.
#pragma once

#include <algorithm>
#include <cstddef>
#include <iterator>
#include <vector>

#include "common/error.h"
#include "planner/chains.h"

namespace bytecomp::planner::detail {

constexpr size_t kMaxSlices = 8;
static_assert(std::size(Option::kAllowedPieces) > 0 &&
              Option::kAllowedPieces[std::size(Option::kAllowedPieces) - 1] <= kMaxSlices);

// Places a chain's operations from `ready` and returns the end of the last
// one. place(resource, t, duration) returns the start it got; emit(op,
// start, end) reports it. Groups (split by forks) are placed one after the
// other; the slices of a group are interleaved: the next operation placed
// is the one whose input is ready first (ties: the earlier slice).
template <class Place, class Emit>
inline double run_chain(const std::vector<Op>& ops, double ready, Place&& place, Emit&& emit) {
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


}  // namespace bytecomp::planner::detail
