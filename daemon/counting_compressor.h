// Byte counts of a job's compression, kept by wrapping each compressor the
// daemon hands the engine (daemon/plan.h's TensorPlan), so the daemon learns
// bytes before and after compression without reaching into the engine.
//
// What it sees: every compress() call of a plan built by the daemon
// (single-node jobs, and each change of their strategy). Multi-node jobs
// build their compressors from the coordinator's plans inside the engine,
// whose ps and peer paths add to the same counters (PathContext::bytes).
//
// Thread-safety: JobByteCounters are atomics; CountingCompressor is as
// thread-safe as the compressor it wraps.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "compress/compressor.h"
#include "daemon/plan.h"

namespace bytecomp::daemon {

struct JobByteCounters {
  std::atomic<uint64_t> compress_calls{0};
  std::atomic<uint64_t> input_bytes{0};   // float32 bytes handed to compress()
  std::atomic<uint64_t> output_bytes{0};  // bytes it produced
  void add(uint64_t in, uint64_t out) {
    compress_calls.fetch_add(1, std::memory_order_relaxed);
    input_bytes.fetch_add(in, std::memory_order_relaxed);
    output_bytes.fetch_add(out, std::memory_order_relaxed);
  }
};

class CountingCompressor final : public compress::Compressor {
 public:
  CountingCompressor(std::shared_ptr<const compress::Compressor> inner,
                     std::shared_ptr<JobByteCounters> counters)
      : inner_(std::move(inner)), counters_(std::move(counters)) {}

  const compress::CompressorSpec& spec() const override { return inner_->spec(); }
  size_t max_compressed_bytes(size_t n) const override { return inner_->max_compressed_bytes(n); }
  bool additive() const override { return inner_->additive(); }
  bool deterministic_size() const override { return inner_->deterministic_size(); }
  std::unique_ptr<compress::TensorState> make_state(size_t n) const override {
    return inner_->make_state(n);
  }
  size_t compress(compress::ConstTensorView in, std::span<std::byte> out,
                  compress::TensorState& state,
                  const compress::CompressContext& ctx) const override;
  void decompress(std::span<const std::byte> in, compress::TensorView out, bool accumulate,
                  const compress::CompressContext& ctx) const override {
    inner_->decompress(in, out, accumulate, ctx);
  }
  size_t aggregate(std::span<const std::span<const std::byte>> inputs, std::span<std::byte> out,
                   const compress::CompressContext& ctx) const override {
    return inner_->aggregate(inputs, out, ctx);
  }

 private:
  std::shared_ptr<const compress::Compressor> inner_;
  std::shared_ptr<JobByteCounters> counters_;
};

// The same plans, each compressor wrapped to count into `counters`.
std::vector<TensorPlan> counting_plans(std::vector<TensorPlan> plans,
                                       const std::shared_ptr<JobByteCounters>& counters);

}  // namespace bytecomp::daemon
