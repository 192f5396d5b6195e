#include "daemon/plan.h"

namespace bytecomp::daemon {

std::vector<TensorPlan> make_plans(const strategy::Strategy& strategy, const std::string& source,
                                   const std::vector<TensorSpec>& tensors) {
  return strategy::make_plans(strategy, source, tensors);
}

}  // namespace bytecomp::daemon
