#include "planner/strategy/answer.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/error.h"
#include "compress/reduce.h"

namespace bytecomp::strategy {

size_t encode_answer(PullFormat f, const float* sum, size_t n, std::span<std::byte> out,
                     const compress::Compressor* c, compress::TensorState* state,
                     const compress::CompressContext& ctx) {
  switch (f) {
    case PullFormat::kFp32:
      if (out.size() < n * 4)
        throw Error(ErrorCode::kInvalidArgument, "encode_answer: fp32 answer needs " +
                                                     std::to_string(n * 4) + " bytes");
      std::memcpy(out.data(), sum, n * 4);
      return n * 4;
    case PullFormat::kFp16:
      if (out.size() < n * 2)
        throw Error(ErrorCode::kInvalidArgument, "encode_answer: fp16 answer needs " +
                                                     std::to_string(n * 2) + " bytes");
      compress::fp32_to_fp16(reinterpret_cast<uint16_t*>(out.data()), sum, n);
      return n * 2;
    case PullFormat::kCompressed:
      if (c == nullptr || state == nullptr)
        throw Error(ErrorCode::kInternal, "encode_answer: compressed answer without a compressor");
      return c->compress(compress::ConstTensorView::cpu(sum, n), out, *state, ctx);
  }
  throw Error(ErrorCode::kInternal, "encode_answer: unknown pull format");
}

void decode_answer(PullFormat f, std::span<const std::byte> in, float* out, size_t n,
                   const compress::Compressor* c, const compress::CompressContext& ctx) {
  switch (f) {
    case PullFormat::kFp32:
      if (in.size() != n * 4) throw Error(ErrorCode::kMalformed, "fp32 answer size");
      std::memcpy(out, in.data(), n * 4);
      return;
    case PullFormat::kFp16: {
      if (in.size() != n * 2) throw Error(ErrorCode::kMalformed, "fp16 answer size");
      // The answer's bytes need not be 2-byte aligned.
      std::vector<uint16_t> words(n);
      std::memcpy(words.data(), in.data(), n * 2);
      compress::fp16_to_fp32(out, words.data(), n);
      return;
    }
    case PullFormat::kCompressed: {
      if (c == nullptr) throw Error(ErrorCode::kInternal, "no compressor");
      // The answer lands in the tensor the client reads after the whole
      // step's pulls, not now.
      compress::CompressContext c2 = ctx;
      c2.output_not_reread = true;
      c->decompress(in, compress::TensorView::cpu(out, n), false, c2);
      return;
    }
  }
  throw Error(ErrorCode::kInternal, "decode_answer: unknown pull format");
}

}  // namespace bytecomp::strategy
