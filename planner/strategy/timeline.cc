#include "planner/strategy/timeline.h"

#include <utility>

namespace bytecomp::strategy {

std::vector<TensorPlan> plans_for(Scope scope, std::span<const PlanTensor> tensors,
                                  std::string_view yaml, const std::string& source) {
  strategy::Strategy strategy;
  if (!yaml.empty()) strategy = strategy::Strategy::parse(yaml, source);
  if (scope == Scope::kNode) return make_plans(strategy, source, tensors);
  std::vector<TensorPlan> plans;
  plans.reserve(tensors.size());
  for (const PlanTensor& t : tensors) {
    if (t.dtype != DType::kFloat32)
      throw Error(ErrorCode::kInvalidArgument,
                  "tensor '" + t.name + "': dtype " + std::string(dtype_name(t.dtype)) +
                      " is not summed by the servers (accepted: float32; express half "
                      "precision as an fp16/bf16 compressor)");
    plans.push_back(plan_for_option(strategy.resolve(t.name, t.bytes()), t.name, scope));
  }
  return plans;
}

Timeline::Timeline(uint64_t start_iteration, std::vector<TensorPlan> plans, std::string yaml)
    : tensors_(plans.size()) {
  by_first_[start_iteration] =
      Entry{start_iteration, std::make_shared<const std::vector<TensorPlan>>(std::move(plans)),
            std::make_shared<const std::string>(std::move(yaml))};
}

Timeline::Entry Timeline::at(uint64_t iteration, std::atomic<int64_t>* frozen) const {
  std::lock_guard lk(mu_);
  auto it = by_first_.upper_bound(iteration);
  if (it != by_first_.begin()) --it;
  if (frozen != nullptr) frozen->store(static_cast<int64_t>(iteration));
  return it->second;
}

TensorPlan Timeline::plan(uint32_t tensor, uint64_t iteration,
                          std::atomic<int64_t>* frozen) const {
  if (tensor >= tensors_)
    throw Error(ErrorCode::kInvalidArgument,
                "tensor index " + std::to_string(tensor) + " out of range (the job has " +
                    std::to_string(tensors_) + " tensors)");
  return (*at(iteration, frozen).plans)[tensor];
}

Timeline::Entry Timeline::latest() const {
  std::lock_guard lk(mu_);
  return std::prev(by_first_.end())->second;
}

bool Timeline::off_servers(uint32_t tensor, uint64_t from, uint64_t to) const {
  if (tensor >= tensors_) return false;
  if (from >= to) return true;
  std::lock_guard lk(mu_);
  // The entry in force at `from`, then every entry starting before `to`.
  auto it = by_first_.upper_bound(from);
  if (it != by_first_.begin()) --it;
  for (; it != by_first_.end() && (it == by_first_.begin() || it->first < to); ++it)
    if (!between_daemons((*it->second.plans)[tensor].placement)) return false;
  return true;
}

Status Timeline::add(uint64_t iteration, std::vector<TensorPlan> plans, std::string yaml,
                     const std::function<Status()>& admissible, bool* added) {
  if (added != nullptr) *added = false;
  if (plans.size() != tensors_)
    return Status(ErrorCode::kInternal, "strategy change at iteration " +
                                            std::to_string(iteration) + " has " +
                                            std::to_string(plans.size()) + " plans for " +
                                            std::to_string(tensors_) + " tensors");
  std::lock_guard lk(mu_);
  if (by_first_.count(iteration) != 0) return Status::Ok();
  if (admissible) {
    Status s = admissible();
    if (!s.ok()) return s;
  }
  by_first_[iteration] =
      Entry{iteration, std::make_shared<const std::vector<TensorPlan>>(std::move(plans)),
            std::make_shared<const std::string>(std::move(yaml))};
  if (added != nullptr) *added = true;
  return Status::Ok();
}

void Timeline::cancel(uint64_t iteration) {
  std::lock_guard lk(mu_);
  if (by_first_.size() > 1 && by_first_.begin()->first != iteration) by_first_.erase(iteration);
}

}  // namespace bytecomp::strategy
