#include "daemon/plan.h"

namespace bytecomp::daemon {

std::vector<TensorPlan> make_plans(const planner::Strategy& strategy, const std::string& source,
                                   const std::vector<TensorSpec>& tensors) {
  std::vector<strategy::PlanTensor> in;
  in.reserve(tensors.size());
  for (const auto& t : tensors)
    in.push_back({t.name, t.bytes,
                  t.dtype == ipc::DType::kFloat32 ? std::string() : ipc::dtype_name(t.dtype)});
  return strategy::make_plans(strategy, source, in);
}

}  // namespace bytecomp::daemon
