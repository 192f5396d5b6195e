#include "planner/options.h"

namespace bytecomp::planner {

namespace {

constexpr Collective kAllCollectives[] = {
    Collective::kAllreduce,  Collective::kReduceScatterAllgather, Collective::kReduceBroadcast,
    Collective::kAllgather,  Collective::kAlltoallAllgather,      Collective::kGatherBroadcast};
constexpr Device kDevices[] = {Device::kCuda, Device::kCpu};
constexpr Stage kStages[] = {Stage::kIntra, Stage::kInter};

bool fits(Collective c, bool compressed, bool additive) {
  if (!compressed) return is_reducing(c);
  return additive || !is_reducing(c);
}

// Walks the whole tree; `visit(option, valid_under_rules)` sees every leaf
// that is valid data-wise, including those the rules would prune (flagged).
template <class Visit>
void walk(const std::string& comp, const std::map<std::string, std::string>& params,
          bool ef, const PruneRules& rules, Visit&& visit) {
  const bool compressed = comp != "none";
  const bool additive = is_additive_compressor(comp);
  for (Scheme scheme : {Scheme::kFlat, Scheme::kHierarchical}) {
    for (Collective intra : kAllCollectives) {
      if (scheme == Scheme::kFlat && intra != Collective::kReduceBroadcast) continue;
      for (Collective inter : kAllCollectives) {
        for (Stage cb : kStages) {
          for (Stage da : kStages) {
            for (Device cd : kDevices) {
              for (Device dd : kDevices) {
                Option o;
                o.compressor = comp;
                o.params = compressed ? params : std::map<std::string, std::string>{};
                o.error_feedback = compressed && ef;
                o.scheme = scheme;
                o.intra = intra;
                o.inter = inter;
                o.compress_before = cb;
                o.decompress_after = da;
                o.comp_device = cd;
                o.decomp_device = dd;
                // Data validity (not a pruning rule): each step's data must
                // fit its collective.
                if (!fits(inter, compressed, additive)) continue;
                bool pruned = false;
                if (scheme == Scheme::kHierarchical) {
                  const bool s1 = compressed && cb == Stage::kIntra;
                  if (!fits(intra, s1, additive)) continue;
                  if (!is_divisible(intra)) pruned |= rules.divisible_intra;
                }
                if (scheme == Scheme::kFlat && (cb != Stage::kInter || da != Stage::kInter))
                  pruned |= rules.flat_single_phase;
                if (!compressed && (cb != Stage::kInter || da != Stage::kInter ||
                                    cd != Device::kCpu || dd != Device::kCpu))
                  pruned |= rules.uncompressed_collapse;
                visit(o, pruned);
              }
            }
          }
        }
      }
    }
  }
}

bool allowed(const Option& o, const Constraints& c) {
  if (o.scheme == Scheme::kFlat && !c.allow_flat) return false;
  if (o.scheme == Scheme::kHierarchical && !c.allow_hierarchical) return false;
  if (o.compressed()) {
    const bool gpu = o.comp_device == Device::kCuda || o.decomp_device == Device::kCuda;
    const bool cpu = o.comp_device == Device::kCpu || o.decomp_device == Device::kCpu;
    if (gpu && !c.allow_gpu) return false;
    if (cpu && !c.allow_cpu) return false;
  }
  if (c.max_compressions > 0 && compression_ops(o) > c.max_compressions) return false;
  if (c.cpu_runtime_only && !cpu_runtime_unsupported(o).empty()) return false;
  return true;
}

std::vector<std::string> compressor_list(const CompressorSpec& spec, const Constraints& c) {
  std::vector<std::string> out = {"none"};
  if (c.include_fp16 && spec.name != "fp16") out.push_back("fp16");
  out.push_back(spec.name);
  return out;
}

}  // namespace

int compression_ops(const Option& o) {
  if (!o.compressed()) return 0;
  const bool additive = is_additive_compressor(o.compressor);
  int n = 1;
  auto regathers = [&](Collective c) {
    return !additive && (c == Collective::kAlltoallAllgather || c == Collective::kGatherBroadcast);
  };
  if (o.scheme == Scheme::kHierarchical && o.compress_before == Stage::kIntra &&
      regathers(o.intra))
    ++n;
  if (regathers(o.inter)) ++n;
  // An allgather's receivers hold a sum that must be compressed again to
  // travel compressed through the last intra-node step.
  if (o.scheme == Scheme::kHierarchical && o.decompress_after == Stage::kIntra && !additive &&
      o.inter == Collective::kAllgather)
    ++n;
  return n;
}

std::vector<Option> enumerate_options(const CompressorSpec& spec, const Constraints& c,
                                      bool ef) {
  std::vector<Option> out;
  for (const std::string& comp : compressor_list(spec, c)) {
    walk(comp, comp == spec.name ? spec.params : std::map<std::string, std::string>{},
         ef && comp != "fp16", PruneRules{}, [&](const Option& o, bool pruned) {
           if (!pruned && allowed(o, c)) out.push_back(o);
         });
  }
  return out;
}

OptionCount count_options(const CompressorSpec& spec, const Constraints& c,
                          const PruneRules& rules) {
  OptionCount n;
  for (const std::string& comp : compressor_list(spec, c)) {
    walk(comp, spec.params, true, rules, [&](const Option& o, bool pruned) {
      if (pruned) return;
      // Constraints apply to what the rules keep; options outside the
      // strategy format (pruned ones) are only counted.
      if (o.problem().empty() && !allowed(o, c)) return;
      ++n.total;
      if (!o.compressed()) ++n.uncompressed;
      if (o.scheme == Scheme::kFlat) ++n.flat; else ++n.hierarchical;
    });
  }
  return n;
}

}  // namespace bytecomp::planner
