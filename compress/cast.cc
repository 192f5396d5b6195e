// fp16 / bf16 casts: additive (sums can be taken on the 16-bit payloads).
#include "compress/internal.h"
#include "compress/reduce.h"

namespace bytecomp::compress::detail {
namespace {

class Cast final : public Base {
 public:
  Cast(CompressorSpec s, Algo a) : Base(std::move(s), a), bf16_(a == Algo::kBf16) {}

  size_t max_compressed_bytes(size_t n) const override { return kHeaderBytes + 2 * n; }
  bool additive() const override { return true; }
  bool deterministic_size() const override { return true; }

  size_t encode(const float* x, size_t n, std::byte* out, TensorState&,
                const CompressContext& ctx) const override {
    auto* h = reinterpret_cast<uint16_t*>(out + kHeaderBytes);
    if (bf16_) fp32_to_bf16(h, x, n, ctx.pool);
    else fp32_to_fp16(h, x, n, ctx.pool);
    return write_wire({out, kHeaderBytes + 2 * n}, algo(), n, {}, 2 * n);
  }

  void check(const Parsed& p) const {
    ParamReader(p.params, 0, algo_name(algo()));
    if (p.payload.size() != 2 * p.count)
      malformed(std::string(algo_name(algo())) + " payload is " + std::to_string(p.payload.size()) +
                " bytes for " + std::to_string(p.count) + " elements (expected " +
                std::to_string(2 * p.count) + ")");
  }

  void decode(const Parsed& p, float* out, Mode mode, ThreadPool* pool) const override {
    check(p);
    const auto* h = reinterpret_cast<const uint16_t*>(p.payload.data());
    size_t n = p.count;
    switch (mode) {
      case Mode::kSet:
        if (bf16_) bf16_to_fp32(out, h, n, pool);
        else fp16_to_fp32(out, h, n, pool);
        break;
      case Mode::kAdd:
        if (bf16_) accumulate_bf16(out, h, n, pool);
        else accumulate_fp16(out, h, n, pool);
        break;
      case Mode::kSub:  // only the error-feedback wrapper subtracts
        for (size_t i = 0; i < n; ++i)
          out[i] -= bf16_ ? bf16_to_fp32(h[i]) : fp16_to_fp32(h[i]);
        break;
    }
  }

  size_t aggregate(std::span<const std::span<const std::byte>> inputs, std::span<std::byte> out,
                   const CompressContext& ctx) const override {
    if (inputs.empty()) throw Error(ErrorCode::kInvalidArgument, "aggregate: no inputs");
    std::vector<std::vector<std::byte>> copies;
    std::vector<const uint16_t*> srcs;
    size_t n = 0;
    for (size_t i = 0; i < inputs.size(); ++i) {
      std::span<const std::byte> in = inputs[i];
      if (reinterpret_cast<uintptr_t>(in.data()) % 8 != 0) {
        copies.emplace_back(in.begin(), in.end());
        in = copies.back();
      }
      Parsed p = i == 0 ? parse_wire(in) : parse_own(in, n);
      if (i == 0) {
        if (p.algo != algo()) p = parse_own(in, p.count);  // reports the mismatch
        n = p.count;
      }
      check(p);
      srcs.push_back(reinterpret_cast<const uint16_t*>(p.payload.data()));
    }
    if (out.size() < max_compressed_bytes(n) || reinterpret_cast<uintptr_t>(out.data()) % 8 != 0)
      throw Error(ErrorCode::kInvalidArgument,
                  "aggregate: output must be 8-byte aligned and hold max_compressed_bytes(" +
                      std::to_string(n) + ") = " + std::to_string(max_compressed_bytes(n)) + " bytes");
    auto* dst = reinterpret_cast<uint16_t*>(out.data() + kHeaderBytes);
    if (bf16_) sum_bf16(dst, srcs, n, ctx.pool);
    else sum_fp16(dst, srcs, n, ctx.pool);
    return write_wire(out, algo(), n, {}, 2 * n);
  }

 private:
  bool bf16_;
};

}  // namespace

std::unique_ptr<Base> make_fp16(CompressorSpec s) { return std::make_unique<Cast>(std::move(s), Algo::kFp16); }
std::unique_ptr<Base> make_bf16(CompressorSpec s) { return std::make_unique<Cast>(std::move(s), Algo::kBf16); }

}  // namespace bytecomp::compress::detail
