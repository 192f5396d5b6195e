// Small value types shared by the engine and the plan builder.
#pragma once

#include <cstdint>
#include <string>

#include "client/ipc/protocol.h"
#include "planner/strategy/plan.h"

namespace bytecomp::daemon {

// A job's tensor: the strategy library's one description (name, count,
// dtype; bytes()).
using TensorSpec = strategy::PlanTensor;

}  // namespace bytecomp::daemon
