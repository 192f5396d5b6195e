// Error feedback as a wrapper: the residual (what compression dropped so far)
// is added to the next input, so nothing is lost, only delayed.
#include "compress/internal.h"

namespace bytecomp::compress::detail {
namespace {

class Feedback final : public Base {
 public:
  Feedback(CompressorSpec s, std::unique_ptr<Base> inner, float beta)
      : Base(std::move(s), inner->algo()), inner_(std::move(inner)), beta_(beta) {}

  size_t max_compressed_bytes(size_t n) const override { return inner_->max_compressed_bytes(n); }
  bool additive() const override { return inner_->additive(); }
  bool deterministic_size() const override { return inner_->deterministic_size(); }

  std::unique_ptr<TensorState> new_state(size_t n) const override {
    return std::make_unique<FeedbackState>(n, inner_->new_state(n));
  }

  size_t encode(const float* x, size_t n, std::byte* out, TensorState& st,
                const CompressContext& ctx) const override {
    auto& fs = state_as<FeedbackState>(st, name());
    return inner_->encode_ef(x, n, beta_, fs.res, fs.inner(), out, ctx);
  }

  void decode(const Parsed& p, float* out, Mode mode, ThreadPool* pool) const override {
    inner_->decode(p, out, mode, pool);
  }

  void decode_not_reread(const Parsed& p, float* out, ThreadPool* pool) const override {
    inner_->decode_not_reread(p, out, pool);
  }
  bool fused_sum() const override { return inner_->fused_sum(); }
  void check_parsed(const Parsed& p) const override { inner_->check_parsed(p); }
  size_t encode_sum(std::span<const Parsed> in, size_t n, std::byte* out, TensorState& st,
                    const CompressContext& ctx) const override {
    auto& fs = state_as<FeedbackState>(st, name());
    return inner_->encode_sum_ef(in, n, beta_, fs.res, fs.inner(), out, ctx);
  }

  size_t aggregate(std::span<const std::span<const std::byte>> inputs, std::span<std::byte> out,
                   const CompressContext& ctx) const override {
    return inner_->aggregate(inputs, out, ctx);
  }

 private:
  std::unique_ptr<Base> inner_;
  float beta_;
};

}  // namespace

std::unique_ptr<Base> make_feedback(CompressorSpec s, std::unique_ptr<Base> inner, double beta) {
  return std::make_unique<Feedback>(std::move(s), std::move(inner), static_cast<float>(beta));
}

}  // namespace bytecomp::compress::detail
