// The decision tree of a tensor (paper section 4.2): enumeration of every
// valid option under pruning rules and user constraints.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "planner/model.h"
#include "planner/strategy/strategy.h"

namespace bytecomp::planner {

struct Constraints {
  bool allow_gpu = true;         // GPU compression/decompression
  bool allow_cpu = true;         // CPU compression/decompression
  bool allow_flat = true;
  bool allow_hierarchical = true;
  bool include_fp16 = true;      // the cheap cast as an extra compressor
  // At most this many compression operations per tensor (counting the
  // recompression a gathering collective implies); 0 = no limit.
  int max_compressions = 0;
  // Only options the CPU runtime (bytecompd) executes (docs/strategy-format.md).
  bool cpu_runtime_only = false;
};

// The three pruning rules (docs/planner.md explains them); each can be turned
// off to count the unpruned tree.
struct PruneRules {
  bool flat_single_phase = true;       // R1
  bool divisible_intra = true;         // R2
  bool uncompressed_collapse = true;   // R3
};

// Number of compression operations an option implies (0 for none).
int compression_ops(const Option& o);

// Every option for the given compressor (plus none, plus fp16 if asked),
// pruned by all three rules and filtered by the constraints. Params and
// error feedback of compressed options come from the spec / cost table.
std::vector<Option> enumerate_options(const CompressorSpec& compressor,
                                      const Constraints& c,
                                      bool error_feedback = true);

struct OptionCount {
  uint64_t total = 0;
  uint64_t uncompressed = 0;
  uint64_t flat = 0;
  uint64_t hierarchical = 0;
};
// Counts the tree for the compressors {none, [fp16], spec.name} with the given
// rules switched on or off (the pruned count equals enumerate_options().size()).
OptionCount count_options(const CompressorSpec& compressor, const Constraints& c,
                          const PruneRules& rules);

}  // namespace bytecomp::planner
