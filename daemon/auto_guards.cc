// The auto tuner's guards over a running job (daemon/auto_tuner.h): the
// re-plan trigger (lasting drift, a bound per window) and the loss guard.
// Pure: no I/O, driven by the tuner thread and by unit tests.
#include "daemon/auto_tuner.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "planner/strategy/strategy.h"

namespace bytecomp::daemon {

using Clock = std::chrono::steady_clock;
using strategy::CompressorMeasure;
using strategy::LinearFit;
using strategy::NodeProfile;

void ReplanTrigger::set_prediction(double predicted_us, uint64_t iteration) {
  predicted_us_ = predicted_us;
  since_ = iteration;
  streak_ = 0;
  settling_.clear();
  // After a re-plan the reference is measured (see the class comment).
  reference_us_ = replanned_ ? 0.0 : predicted_us;
}

std::optional<std::string> ReplanTrigger::observe(uint64_t iteration, double measured_us) {
  if (predicted_us_ <= 0 || iteration < since_) return std::nullopt;
  if (reference_us_ <= 0) {
    settling_.push_back(measured_us);
    if (settling_.size() < std::max<size_t>({min_interval_, needed_, 1})) return std::nullopt;
    reference_us_ = median(settling_);
    return std::nullopt;
  }
  const double d = std::abs(measured_us - reference_us_) / reference_us_;
  if (d <= drift_) {
    streak_ = 0;
    held_back_.clear();  // the streak it held back is over
    return std::nullopt;
  }
  if (streak_ == 0) drifted_.clear();
  ++streak_;
  drifted_.push_back(measured_us);
  if (streak_ < needed_ || iteration < since_ + min_interval_) return std::nullopt;
  while (!fired_.empty() && fired_.front() + per_ <= iteration) fired_.pop_front();
  if (fired_.size() >= max_replans_) {
    // Held back, not dropped: the streak goes on and fires once the oldest
    // re-plan leaves the window (a link that really changed still gets one).
    held_back_ = "measured " + std::to_string(median(drifted_) / 1000.0) + " ms against " +
                 std::to_string(reference_us_ / 1000.0) + " ms; " +
                 std::to_string(fired_.size()) + " re-plans in the last " + std::to_string(per_) +
                 " iterations (replan.max " + std::to_string(max_replans_) + " per " +
                 std::to_string(per_) + "): the next one waits until iteration " +
                 std::to_string(fired_.front() + per_);
    return std::nullopt;
  }
  held_back_.clear();
  fired_.push_back(iteration);
  std::ostringstream o;
  o.precision(4);
  o << "measured " << median(drifted_) / 1000.0 << " ms per iteration over the last " << streak_
    << " iterations against " << reference_us_ / 1000.0 << " ms "
    << (replanned_ ? "measured after the last re-plan" : "predicted") << " (drift "
    << 100.0 * std::abs(median(drifted_) - reference_us_) / reference_us_ << "% > "
    << 100.0 * drift_ << "%)";
  replanned_ = true;
  predicted_us_ = 0;
  reference_us_ = 0;
  streak_ = 0;
  return o.str();
}

namespace {
constexpr const char* kRollbackWriter = "bytecompd loss guard";
}

std::string rollback_yaml(uint32_t node_rank, const std::string& why,
                          const std::string& start_yaml) {
  strategy::Strategy s = strategy::Strategy::parse(
      start_yaml.empty() ? std::string("version: 1\ndefault: {compressor: none}\n") : start_yaml,
      "loss guard rollback");
  s.meta.clear();
  s.meta["written_by"] = kRollbackWriter;
  s.meta["node"] = std::to_string(node_rank);
  s.meta["reason"] = why;
  return s.to_yaml();
}

std::optional<Rollback> rollback_of(const std::string& yaml) {
  if (yaml.find(kRollbackWriter) == std::string::npos) return std::nullopt;  // the common case
  try {
    const strategy::Strategy s = strategy::Strategy::parse(yaml, "job strategy");
    const auto w = s.meta.find("written_by"), n = s.meta.find("node"), r = s.meta.find("reason");
    if (w == s.meta.end() || w->second != kRollbackWriter || n == s.meta.end()) return std::nullopt;
    return Rollback{static_cast<uint32_t>(std::stoul(n->second)),
                    r == s.meta.end() ? std::string() : r->second};
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

void LossGuard::report(uint64_t iteration, double loss) {
  if (!std::isfinite(loss)) {
    // Before the switch the uncompressed job diverged on its own: not the
    // guard's to judge.
    if (switched_ && iteration > switch_) non_finite_ = true;
    return;
  }
  std::deque<double>& into = switched_ && iteration > switch_ ? after_ : before_;
  into.push_back(loss);
  while (into.size() > window_) into.pop_front();
}

void LossGuard::compressed_from(uint64_t iteration) {
  if (switched_) return;
  switched_ = true;
  switch_ = iteration;
}

double LossGuard::baseline() const {
  return before_.size() < kMinBaseline ? 0.0 : median(std::vector<double>(before_.begin(), before_.end()));
}

std::optional<std::string> LossGuard::check() {
  if (!switched_ || fired_) return std::nullopt;
  std::ostringstream o;
  o.precision(4);
  if (non_finite_) {
    fired_ = true;
    o << "a training process reported a non-finite loss after the switch at iteration "
      << switch_;
    return o.str();
  }
  if (before_.size() < kMinBaseline || after_.size() < window_) return std::nullopt;
  const double base = baseline(), now = median(std::vector<double>(after_.begin(), after_.end()));
  if (!(now > base + tolerance_ * std::abs(base))) return std::nullopt;
  fired_ = true;
  o << "the median loss of the last " << after_.size() << " reports after the switch at iteration "
    << switch_ << " is " << now << ", above the uncompressed warm-up's " << base << " by "
    << 100.0 * (now - base) / std::max(1e-12, std::abs(base)) << "% (loss_guard.tolerance "
    << 100.0 * tolerance_ << "%)";
  return o.str();
}

}  // namespace bytecomp::daemon
