#include "daemon/counting_compressor.h"

namespace bytecomp::daemon {

size_t CountingCompressor::compress(compress::ConstTensorView in, std::span<std::byte> out,
                                    compress::TensorState& state,
                                    const compress::CompressContext& ctx) const {
  const size_t n = inner_->compress(in, out, state, ctx);
  counters_->compress_calls.fetch_add(1, std::memory_order_relaxed);
  counters_->input_bytes.fetch_add(in.count * compress::dtype_size(in.dtype),
                                   std::memory_order_relaxed);
  counters_->output_bytes.fetch_add(n, std::memory_order_relaxed);
  return n;
}

std::vector<TensorPlan> counting_plans(std::vector<TensorPlan> plans,
                                       const std::shared_ptr<JobByteCounters>& counters) {
  for (TensorPlan& p : plans) {
    if (p.compressor) {
      p.compressor = std::make_shared<const CountingCompressor>(std::move(p.compressor), counters);
    }
  }
  return plans;
}

}  // namespace bytecomp::daemon
