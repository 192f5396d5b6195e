// The daemon's side of the strategy library (planner/strategy/plan.h): its
// job's tensors as make_plans() takes them. The plans are Scope::kNode
// strategy::TensorPlans (the option, and for compressed tensors the
// compressor built by compress/'s factory).
//
// Thread-safety: pure function.
#pragma once

#include <string>
#include <vector>

#include "daemon/engine_types.h"
#include "planner/strategy/plan.h"

namespace bytecomp::daemon {

using strategy::TensorPlan;
using strategy::uncompressed_plans;

// strategy::make_plans over the job's tensors. Throws Error(kInvalidArgument)
// naming `source` (the strategy file), the tensor and the reason.
std::vector<TensorPlan> make_plans(const strategy::Strategy& strategy, const std::string& source,
                                   const std::vector<TensorSpec>& tensors);

}  // namespace bytecomp::daemon
