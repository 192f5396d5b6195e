#include "planner/strategy/plan.h"

#include <algorithm>
#include <sstream>

#include "common/error.h"
#include "compress/catalogue.h"

namespace bytecomp::strategy {

std::string_view to_string(Placement p) noexcept {
  switch (p) {
    case Placement::kSharded: return "ps";
    case Placement::kSingle: return "ps_single";
    case Placement::kPeer: return "allgather";
    case Placement::kRing: return "ring";
  }
  return "?";
}
std::string_view to_string(SumMode m) noexcept {
  return m == SumMode::kDense ? "dense" : "compressed";
}
std::string_view to_string(PullFormat f) noexcept {
  switch (f) {
    case PullFormat::kFp32: return "fp32";
    case PullFormat::kFp16: return "fp16";
    case PullFormat::kCompressed: return "compressed";
  }
  return "?";
}

const compress::CompressorSpec& TensorPlan::spec() const {
  static const compress::CompressorSpec kNone;
  return compressor ? compressor->spec() : kNone;
}

std::string TensorPlan::describe() const {
  std::ostringstream os;
  if (option) os << option->describe() << " -> ";
  os << to_string(placement) << " push="
     << (compressed_push() ? compress::to_string(spec()) : std::string("fp32"))
     << " sum=" << to_string(sum) << " pull=" << to_string(pull);
  if (server_error_feedback) os << " server_ef";
  return os.str();
}

namespace {

// Why an option cannot run; the callers prefix the tensor (and the file).
struct Refused {
  std::string why;
};

bool has_param(const std::string& compressor, std::string_view param) {
  const compress::CatalogueEntry* e = compress::find_compressor(compressor);
  return e != nullptr && e->has_param(param);
}

bool builtin_feedback(const std::string& compressor) {
  const compress::CatalogueEntry* e = compress::find_compressor(compressor);
  return e != nullptr && e->builtin_feedback;
}

std::string additive_names() {
  std::string s;
  for (const auto& e : compress::catalogue())
    if (e.additive) s += (s.empty() ? "" : ", ") + std::string(e.name);
  return s;
}

TensorPlan map_option(const strategy::Option& o, Scope scope) {
  using strategy::Collective;
  TensorPlan plan;
  plan.option = std::make_shared<const strategy::Option>(o);
  switch (o.inter) {
    case Collective::kAllgather: plan.placement = Placement::kPeer; break;
    // The daemons' ring carries fp32, fp16 and bf16; any other additive
    // compressor under allreduce is summed compressed by the servers.
    case Collective::kAllreduce:
      plan.placement = !o.compressed() || o.compressor == "fp16" || o.compressor == "bf16"
                           ? Placement::kRing
                           : Placement::kSharded;
      break;
    case Collective::kReduceBroadcast:
    case Collective::kGatherBroadcast: plan.placement = Placement::kSingle; break;
    default: plan.placement = Placement::kSharded; break;
  }
  if (!o.compressed()) return plan;
  // No server touches a peer or ring tensor: the daemons run its compressor
  // by themselves, so the cluster's plan carries it with the node's rules.
  if (between_daemons(plan.placement)) scope = Scope::kNode;

  const bool reducing = strategy::is_reducing(o.inter);
  compress::CompressorSpec spec{o.compressor, o.params};
  if (scope == Scope::kNode) {
    if (spec.params.count("ef") != 0)
      throw Refused{"set error feedback with the option's error_feedback key, not params.ef"};
    if (has_param(spec.name, "ef")) {
      spec.params["ef"] = o.error_feedback ? "true" : "false";
    } else if (o.error_feedback && !builtin_feedback(spec.name)) {
      throw Refused{"compressor '" + spec.name + "' has no error feedback (error_feedback: false)"};
    }
  } else if (!reducing && has_param(o.compressor, "ef")) {
    spec.params["ef"] = o.error_feedback ? "true" : "false";
  }
  try {
    plan.compressor = compress::make_compressor(spec);
  } catch (const Error& e) {
    throw Refused{e.what()};
  }
  if (reducing) {
    if (!plan.compressor->additive())
      throw Refused{"compressor '" + o.compressor +
                    "' is not additive, so the servers cannot sum it compressed under '" +
                    strategy::to_string(o.inter) +
                    "' (accepted: " + additive_names() +
                    "; or use alltoall_allgather / gather_broadcast)"};
    plan.sum = SumMode::kCompressed;
    plan.pull = PullFormat::kCompressed;
    return plan;
  }
  plan.sum = SumMode::kDense;
  // The servers answer fp16 as raw words (no wire header).
  if (o.compressor == "fp16") {
    plan.pull = PullFormat::kFp16;
  } else {
    plan.pull = PullFormat::kCompressed;
    // The server's residual: as asked, and always where error feedback is
    // part of the algorithm (as it is on the nodes).
    plan.server_error_feedback = o.error_feedback || builtin_feedback(o.compressor);
  }
  return plan;
}

}  // namespace

TensorPlan plan_for_option(const strategy::Option& option, std::string_view tensor, Scope scope) {
  try {
    return map_option(option, scope);
  } catch (const Refused& r) {
    throw Error(ErrorCode::kInvalidArgument, "tensor '" + std::string(tensor) + "': " + r.why);
  }
}

std::vector<TensorPlan> make_plans(const strategy::Strategy& strategy, const std::string& source,
                                   std::span<const PlanTensor> tensors) {
  std::vector<strategy::TensorDecl> decls;
  decls.reserve(tensors.size());
  for (const auto& t : tensors) decls.push_back({t.name, t.bytes()});
  try {
    strategy.check_cpu_runtime(decls);
  } catch (const Error& e) {
    throw Error(ErrorCode::kInvalidArgument, "strategy " + source + ": " + e.what());
  }
  std::vector<TensorPlan> plans;
  plans.reserve(tensors.size());
  for (const auto& t : tensors) {
    const strategy::Option& o = strategy.resolve(t.name, t.bytes());
    auto fail = [&](const std::string& why) {
      throw Error(ErrorCode::kInvalidArgument, "strategy " + source + ": tensor '" + t.name +
                                                   "' resolves to [" + o.describe() + "]: " + why);
    };
    if (o.compressed() && t.dtype != DType::kFloat32)
      fail("the CPU compressors take float32 tensors, this one is " +
           std::string(dtype_name(t.dtype)) +
           " (use compressor: none for it)");
    try {
      plans.push_back(map_option(o, Scope::kNode));
    } catch (const Refused& r) {
      fail(r.why);
    }
  }
  return plans;
}

int plan_pieces(const TensorPlan& plan) { return plan.option ? plan.option->pieces : 1; }

uint64_t tensor_partition_bytes(const TensorPlan& plan, uint64_t partition_bytes) {
  const int q = plan_pieces(plan);
  if (q <= 1) return partition_bytes;
  const uint64_t slice = partition_bytes / static_cast<uint64_t>(q) / kSliceAlignBytes * kSliceAlignBytes;
  return std::max(slice, kSliceAlignBytes);
}

std::string layout_change(std::span<const PlanTensor> tensors, const std::vector<TensorPlan>& from,
                          const std::vector<TensorPlan>& to) {
  for (size_t t = 0; t < std::min({tensors.size(), from.size(), to.size()}); ++t) {
    const int a = plan_pieces(from[t]);
    const int b = plan_pieces(to[t]);
    if (a != b)
      return "tensor '" + tensors[t].name + "' would change pieces from " + std::to_string(a) +
             " to " + std::to_string(b) +
             " (its partitions are cut by pieces and fixed for the job: a pieces change needs a "
             "new job)";
  }
  return {};
}

bool placement_switchable(Placement from, Placement to) {
  auto movable = [](Placement p) { return p == Placement::kRing || p == Placement::kSharded; };
  return from == to || (movable(from) && movable(to));
}

std::string placement_change(std::span<const PlanTensor> tensors,
                             const std::vector<TensorPlan>& from,
                             const std::vector<TensorPlan>& to) {
  for (size_t t = 0; t < std::min({tensors.size(), from.size(), to.size()}); ++t) {
    const Placement a = from[t].placement;
    const Placement b = to[t].placement;
    if (placement_switchable(a, b)) continue;
    return "tensor '" + tensors[t].name + "' would move from " + std::string(to_string(a)) +
           " to " + std::string(to_string(b)) +
           " (only moves between ring and ps apply mid-job: a placement change to or from "
           "ps_single or allgather needs a new job)";
  }
  return {};
}

std::vector<TensorPlan> uncompressed_plans(size_t n) { return std::vector<TensorPlan>(n); }

uint64_t push_bytes_bound(const TensorPlan& plan, uint64_t count) {
  if (!plan.compressed_push()) return count * 4;
  return plan.compressor->max_compressed_bytes(count);
}

uint64_t pull_bytes_bound(const TensorPlan& plan, uint64_t count) {
  switch (plan.pull) {
    case PullFormat::kFp32: return count * 4;
    case PullFormat::kFp16: return count * 2;
    case PullFormat::kCompressed:
      return plan.compressor ? plan.compressor->max_compressed_bytes(count) : count * 4;
  }
  return count * 4;
}

}  // namespace bytecomp::strategy
