// From the planner's strategy (planner/strategy.h) to what the engine runs
// for each tensor of a job: the resolved option and, for compressed tensors,
// the compressor built by compress/'s factory.
//
// make_plans() checks the strategy against the job's tensors and fails with
// one message naming the strategy file, the tensor and the reason: an entry
// for an undeclared tensor, an option the CPU runtime cannot execute, a
// compressor on a tensor that is not float32, bad compressor parameters, or
// error feedback asked of a compressor that has none.
//
// The option's error_feedback decides error feedback (it is passed to the
// factory as the "ef" parameter where the compressor has one).
//
// Thread-safety: TensorPlan is immutable; Compressor is thread-safe.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "compress/compressor.h"
#include "daemon/engine_types.h"
#include "planner/strategy.h"

namespace bytecomp::daemon {

struct TensorPlan {
  planner::Option option;
  std::shared_ptr<const compress::Compressor> compressor;  // null: uncompressed
  std::string describe() const;
};

// Throws Error(kInvalidArgument) naming `source` (the strategy file).
std::vector<TensorPlan> make_plans(const planner::Strategy& strategy, const std::string& source,
                                   const std::vector<TensorSpec>& tensors);

// Plans without a strategy: every tensor uncompressed.
std::vector<TensorPlan> uncompressed_plans(size_t n);

}  // namespace bytecomp::daemon
