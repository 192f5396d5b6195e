#include "daemon/plan.h"

#include <algorithm>

#include "common/error.h"

namespace bytecomp::daemon {

std::string TensorPlan::describe() const { return option.describe(); }

namespace {

bool has_param(const std::string& compressor, const std::string& param) {
  for (const auto& info : compress::list_compressors()) {
    if (info.name != compressor) continue;
    return std::any_of(info.params.begin(), info.params.end(),
                       [&](const compress::ParamInfo& p) { return p.name == param; });
  }
  return false;
}

bool builtin_feedback(const std::string& compressor) {
  return compressor == "efsignsgd" || compressor == "onebit";
}

}  // namespace

std::vector<TensorPlan> make_plans(const planner::Strategy& strategy, const std::string& source,
                                   const std::vector<TensorSpec>& tensors) {
  std::vector<planner::TensorDecl> decls;
  for (const auto& t : tensors) decls.push_back({t.name, t.bytes});
  try {
    strategy.check_cpu_runtime(decls);
  } catch (const Error& e) {
    throw Error(ErrorCode::kInvalidArgument, "strategy " + source + ": " + e.what());
  }
  std::vector<TensorPlan> plans;
  plans.reserve(tensors.size());
  for (const auto& t : tensors) {
    TensorPlan p;
    p.option = strategy.resolve(t.name, t.bytes);
    if (p.option.compressed()) {
      auto fail = [&](const std::string& why) {
        throw Error(ErrorCode::kInvalidArgument,
                    "strategy " + source + ": tensor '" + t.name + "' resolves to [" +
                        p.option.describe() + "]: " + why);
      };
      if (t.dtype != ipc::DType::kFloat32) {
        fail(std::string("the CPU compressors take float32 tensors, this one is ") +
             ipc::dtype_name(t.dtype) + " (use compressor: none for it)");
      }
      compress::CompressorSpec spec{p.option.compressor, {p.option.params.begin(),
                                                          p.option.params.end()}};
      if (spec.params.count("ef") != 0) {
        fail("set error feedback with the option's error_feedback key, not params.ef");
      }
      if (has_param(spec.name, "ef")) {
        spec.params["ef"] = p.option.error_feedback ? "true" : "false";
      } else if (p.option.error_feedback && !builtin_feedback(spec.name)) {
        fail("compressor '" + spec.name + "' has no error feedback (error_feedback: false)");
      }
      try {
        p.compressor = compress::make_compressor(spec);
      } catch (const Error& e) {
        fail(e.what());
      }
    }
    plans.push_back(std::move(p));
  }
  return plans;
}

std::vector<TensorPlan> uncompressed_plans(size_t n) { return std::vector<TensorPlan>(n); }

}  // namespace bytecomp::daemon
