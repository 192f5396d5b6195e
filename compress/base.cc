// Wire header codec and the checks every compressor shares.
#include <boost/crc.hpp>

#include <cmath>

#include "compress/internal.h"
#include "compress/wire_prefix.h"
#include "compress/simd.h"

namespace bytecomp::compress {

// The compressed buffer format's dtype codes are the DType values of these
// three; a change here is a new wire version.
static_assert(static_cast<uint8_t>(DType::kFloat32) == 0 && static_cast<uint8_t>(DType::kFloat16) == 1 &&
                  static_cast<uint8_t>(DType::kBFloat16) == 2,
              "compressed buffers store DType values as their dtype codes");

void TensorState::copy_residual(std::span<float>) const {
  throw Error(ErrorCode::kInvalidArgument, "copy_residual: this compressor keeps no residual");
}

size_t Compressor::aggregate(std::span<const std::span<const std::byte>>, std::span<std::byte>,
                             const CompressContext&) const {
  throw Error(ErrorCode::kInvalidArgument,
              "aggregate: compressor '" + name() +
                  "' is not additive (additive: fp16, bf16, randomk); decompress and sum instead");
}

size_t Compressor::sum_compress(std::span<const std::span<const std::byte>> inputs, size_t n,
                                float* scratch, std::span<std::byte> out, TensorState& state,
                                const CompressContext& ctx) const {
  if (inputs.empty())
    throw Error(ErrorCode::kInvalidArgument, "sum_compress: no inputs to sum");
  if (scratch == nullptr && n != 0)
    throw Error(ErrorCode::kInvalidArgument,
                "sum_compress: compressor '" + name() + "' needs a scratch buffer of " +
                    std::to_string(n) + " floats");
  for (size_t i = 0; i < inputs.size(); ++i)
    decompress(inputs[i], TensorView::cpu(scratch, n), i > 0, ctx);
  return compress(ConstTensorView::cpu(scratch, n), out, state, ctx);
}

void Compressor::check(std::span<const std::byte> in, size_t n) const {
  std::vector<float> tmp(n);
  decompress(in, TensorView::cpu(tmp.data(), n), false, {});
}

WireInfo inspect(std::span<const std::byte> in) {
  detail::Parsed p = detail::parse_wire(in);
  WireInfo w;
  w.algorithm = detail::algo_name(p.algo);
  w.count = p.count;
  w.dtype = p.dtype;
  w.payload_bytes = p.payload.size();
  w.total_bytes = in.size();
  return w;
}

WireInfo inspect_prefix(std::span<const std::byte> in) {
  if (in.size() < detail::kHeaderBytes) {
    detail::malformed(std::to_string(in.size()) + " bytes is shorter than the " +
                      std::to_string(detail::kHeaderBytes) + "-byte header");
  }
  const uint64_t params_len = detail::load<uint32_t>(in.data() + 8);
  const uint64_t payload_len = detail::load<uint64_t>(in.data() + 24);
  const uint64_t room = in.size() - detail::kHeaderBytes;
  if (params_len > room || payload_len > room - params_len) {
    detail::malformed("header says " + std::to_string(params_len) + " parameter and " +
                      std::to_string(payload_len) + " payload bytes, only " +
                      std::to_string(room) + " bytes follow the header");
  }
  return inspect(in.first(detail::kHeaderBytes + params_len + payload_len));
}

namespace detail {

const char* algo_name(Algo a) noexcept {
  switch (a) {
    case Algo::kFp16: return "fp16";
    case Algo::kBf16: return "bf16";
    case Algo::kRandomK: return "randomk";
    case Algo::kTopK: return "topk";
    case Algo::kDgc: return "dgc";
    case Algo::kSignSgd: return "signsgd";
    case Algo::kSignum: return "signum";
    case Algo::kEfSignSgd: return "efsignsgd";
    case Algo::kOneBit: return "onebit";
    case Algo::kQsgd: return "qsgd";
    case Algo::kTernGrad: return "terngrad";
  }
  return nullptr;
}

void malformed(const std::string& what) {
  throw Error(ErrorCode::kMalformed, "compressed buffer rejected: " + what);
}

namespace {
uint32_t header_crc(std::span<const std::byte> hdr_and_params) {
  boost::crc_32_type crc;
  std::byte h[kHeaderBytes];
  std::memcpy(h, hdr_and_params.data(), kHeaderBytes);
  std::memset(h + 12, 0, 4);
  crc.process_bytes(h, kHeaderBytes);
  crc.process_bytes(hdr_and_params.data() + kHeaderBytes, hdr_and_params.size() - kHeaderBytes);
  return crc.checksum();
}
}  // namespace

Parsed parse_wire(std::span<const std::byte> in) {
  Parsed p = parse_wire_head(in.first(std::min(in.size(), kMaxHeadBytes)), in.size());
  p.payload = in.subspan(kHeaderBytes + p.params.size());
  return p;
}

Parsed parse_wire_head(std::span<const std::byte> in, uint64_t total_size) {
  if (total_size < kHeaderBytes || in.size() < std::min<uint64_t>(total_size, kMaxHeadBytes))
    malformed(std::to_string(total_size) + " bytes is shorter than the " +
              std::to_string(kHeaderBytes) + "-byte header");
  const std::byte* b = in.data();
  if (load<uint32_t>(b) != kMagic) malformed("bad magic (not a ByteComp compressed tensor)");
  uint8_t version = load<uint8_t>(b + 4);
  if (version != kVersion)
    malformed("wire version " + std::to_string(version) + " (this build reads version " +
              std::to_string(kVersion) + ")");
  uint8_t algo = load<uint8_t>(b + 5);
  if (algo_name(static_cast<Algo>(algo)) == nullptr)
    malformed("unknown algorithm id " + std::to_string(algo));
  uint8_t dtype = load<uint8_t>(b + 6);
  if (dtype != static_cast<uint8_t>(DType::kFloat32))
    malformed("dtype id " + std::to_string(dtype) + " (this build decodes float32 tensors only)");
  if (load<uint8_t>(b + 7) != 0) malformed("unknown flags " + std::to_string(load<uint8_t>(b + 7)));
  uint32_t params_len = load<uint32_t>(b + 8);
  uint64_t count = load<uint64_t>(b + 16);
  uint64_t payload_len = load<uint64_t>(b + 24);
  if (params_len % 8 != 0 || params_len > 256)
    malformed("params_len " + std::to_string(params_len) + " (accepted: multiple of 8, <= 256)");
  if (count > kMaxCount)
    malformed("element count " + std::to_string(count) + " exceeds " + std::to_string(kMaxCount));
  uint64_t avail = total_size - kHeaderBytes;
  if (params_len > avail)
    malformed("params_len " + std::to_string(params_len) + " but only " + std::to_string(avail) +
              " bytes follow the header");
  avail -= params_len;
  if (payload_len != avail)
    malformed("payload_len " + std::to_string(payload_len) + " but " + std::to_string(avail) +
              " bytes follow the parameters (" +
              (payload_len > avail ? "truncated" : "trailing bytes") + ")");
  uint32_t crc = header_crc(in.first(kHeaderBytes + params_len));
#ifndef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION  // let the fuzzer reach the decoders
  if (crc != load<uint32_t>(b + 12)) malformed("header checksum mismatch (corrupted header)");
#else
  (void)crc;
#endif
  Parsed p;
  p.algo = static_cast<Algo>(algo);
  p.dtype = DType::kFloat32;
  p.count = count;
  p.params = in.subspan(kHeaderBytes, params_len);
  p.payload_len = payload_len;
  return p;
}

size_t write_wire(std::span<std::byte> out, Algo algo, uint64_t count,
                  std::span<const std::byte> params, uint64_t payload_len) {
  size_t plen = pad8(params.size());
  std::byte* b = out.data();
  store<uint32_t>(b, kMagic);
  store<uint8_t>(b + 4, kVersion);
  store<uint8_t>(b + 5, static_cast<uint8_t>(algo));
  store<uint8_t>(b + 6, static_cast<uint8_t>(DType::kFloat32));
  store<uint8_t>(b + 7, 0);
  store<uint32_t>(b + 8, static_cast<uint32_t>(plen));
  store<uint32_t>(b + 12, 0);
  store<uint64_t>(b + 16, count);
  store<uint64_t>(b + 24, payload_len);
  std::memset(b + kHeaderBytes, 0, plen);
  if (!params.empty()) std::memcpy(b + kHeaderBytes, params.data(), params.size());
  store<uint32_t>(b + 12, header_crc(out.first(kHeaderBytes + plen)));
  return kHeaderBytes + plen + payload_len;
}

ParamReader::ParamReader(std::span<const std::byte> p, size_t expected, const char* algo)
    : p_(p) {
  if (p.size() != pad8(expected))
    malformed(std::string(algo) + " parameters are " + std::to_string(p.size()) +
              " bytes (expected " + std::to_string(pad8(expected)) + ")");
}

void for_chunks(ThreadPool* pool, size_t n, const std::function<void(size_t, size_t, size_t)>& f) {
  size_t chunks = num_chunks(n);
  auto body = [&](size_t cb, size_t ce) {
    for (size_t c = cb; c < ce; ++c) f(c, c * kChunk, std::min(n, (c + 1) * kChunk));
  };
  if (pool == nullptr || pool->concurrency() < 2 || chunks < 2) {
    body(0, chunks);
    return;
  }
  pool->parallel_for(chunks, 1, body);
}

namespace {
BC_CLONES void k_apply_lazy(const float* __restrict g, float beta, float* __restrict r,
                            float pos, float neg, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    float c = std::signbit(r[i]) ? neg : pos;
    r[i] = g[i] + beta * (r[i] - c);
  }
}
BC_CLONES void k_add_scaled(const float* __restrict g, float beta, float* __restrict r, size_t n) {
  for (size_t i = 0; i < n; ++i) r[i] = g[i] + beta * r[i];
}
}  // namespace

void apply_lazy(const float* g, float beta, Residual& res, size_t b, size_t e) {
  if (res.lazy) k_apply_lazy(g + b, beta, res.r.data() + b, res.pos, res.neg, e - b);
  else k_add_scaled(g + b, beta, res.r.data() + b, e - b);
}

void apply_lazy_block(const float* g_block, float beta, Residual& res, size_t b, size_t e) {
  if (res.lazy) k_apply_lazy(g_block, beta, res.r.data() + b, res.pos, res.neg, e - b);
  else k_add_scaled(g_block, beta, res.r.data() + b, e - b);
}

void add_scaled(const float* g, float beta, float* r, size_t b, size_t e) {
  k_add_scaled(g + b, beta, r + b, e - b);
}

void VectorState::copy_residual(std::span<float> out) const {
  if (!residual_) TensorState::copy_residual(out);
  if (out.size() != n_)
    throw Error(ErrorCode::kInvalidArgument, "copy_residual: out has " + std::to_string(out.size()) +
                                                 " elements, state has " + std::to_string(n_));
  std::memcpy(out.data(), v_.back().data(), n_ * sizeof(float));
}

void FeedbackState::copy_residual(std::span<float> out) const {
  if (out.size() != res.r.size())
    throw Error(ErrorCode::kInvalidArgument, "copy_residual: out has " + std::to_string(out.size()) +
                                                 " elements, state has " +
                                                 std::to_string(res.r.size()));
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = res.lazy ? res.r[i] - (std::signbit(res.r[i]) ? res.neg : res.pos) : res.r[i];
}

// --- Base ---------------------------------------------------------------------

std::unique_ptr<TensorState> Base::make_state(size_t n) const {
  if (n > kMaxCount)
    throw Error(ErrorCode::kInvalidArgument, "make_state: " + std::to_string(n) +
                                                 " elements exceeds the limit " +
                                                 std::to_string(kMaxCount));
  return new_state(n);
}

namespace {
void check_cpu_f32(const char* what, const std::string& name, Device dev, DType dt) {
  if (dev != Device::kCpu)
    throw Error(ErrorCode::kInvalidArgument,
                std::string(what) + ": compressor '" + name + "' has no kernels for device " +
                    std::string(to_string(dev)) + " yet (accepted: cpu)");
  if (dt != DType::kFloat32)
    throw Error(ErrorCode::kInvalidArgument, std::string(what) + ": compressor '" + name +
                                                 "' takes float32 tensors, got " +
                                                 std::string(to_string(dt)));
}
}  // namespace

namespace {
// What compress() and sum_compress() require of n, the output and the state.
void check_compress_args(const char* what, const Base& c, size_t n, std::span<std::byte> out,
                         const TensorState& state) {
  const std::string w = what;
  if (n > kMaxCount)
    throw Error(ErrorCode::kInvalidArgument, w + ": " + std::to_string(n) +
                                                 " elements exceeds the limit");
  size_t need = c.max_compressed_bytes(n);
  if (out.size() < need)
    throw Error(ErrorCode::kInvalidArgument,
                w + ": output buffer of " + std::to_string(out.size()) + " bytes, '" + c.name() +
                    "' needs max_compressed_bytes(" + std::to_string(n) +
                    ") = " + std::to_string(need));
  if (reinterpret_cast<uintptr_t>(out.data()) % 8 != 0)
    throw Error(ErrorCode::kInvalidArgument, w + ": output buffer must be 8-byte aligned");
  if (state.count() != n)
    throw Error(ErrorCode::kInvalidArgument,
                w + ": state was made for " + std::to_string(state.count()) +
                    " elements, tensor has " + std::to_string(n));
}
}  // namespace

size_t Base::compress(ConstTensorView in, std::span<std::byte> out, TensorState& state,
                      const CompressContext& ctx) const {
  check_cpu_f32("compress", name(), in.device, in.dtype);
  if (in.count > kMaxCount)
    throw Error(ErrorCode::kInvalidArgument, "compress: " + std::to_string(in.count) +
                                                 " elements exceeds the limit");
  if (in.data == nullptr && in.count != 0)
    throw Error(ErrorCode::kInvalidArgument, "compress: null input");
  check_compress_args("compress", *this, in.count, out, state);
  return encode(static_cast<const float*>(in.data), in.count, out.data(), state, ctx);
}

size_t Base::sum_compress(std::span<const std::span<const std::byte>> inputs, size_t n,
                          float* scratch, std::span<std::byte> out, TensorState& state,
                          const CompressContext& ctx) const {
  if (!fused_sum()) return Compressor::sum_compress(inputs, n, scratch, out, state, ctx);
  if (inputs.empty())
    throw Error(ErrorCode::kInvalidArgument, "sum_compress: no inputs to sum");
  check_compress_args("sum_compress", *this, n, out, state);
  // Every input is parsed and checked before anything is written.
  std::vector<std::vector<std::byte>> aligned;
  aligned.reserve(inputs.size());
  std::vector<Parsed> parsed;
  parsed.reserve(inputs.size());
  for (std::span<const std::byte> in : inputs) {
    if (reinterpret_cast<uintptr_t>(in.data()) % 8 != 0) {
      aligned.emplace_back(in.begin(), in.end());
      in = aligned.back();
    }
    parsed.push_back(parse_own(in, n));
    check_parsed(parsed.back());
  }
  return encode_sum(parsed, n, out.data(), state, ctx);
}

void Base::check(std::span<const std::byte> in, size_t n) const {
  std::vector<std::byte> aligned;
  if (reinterpret_cast<uintptr_t>(in.data()) % 8 != 0) {
    aligned.assign(in.begin(), in.end());
    in = aligned;
  }
  check_parsed(parse_own(in, n));
}

void Base::check_parsed(const Parsed& p) const {
  std::vector<float> tmp(p.count);
  decode(p, tmp.data(), Mode::kSet, nullptr);
}

size_t Base::encode_sum(std::span<const Parsed>, size_t, std::byte*, TensorState&,
                        const CompressContext&) const {
  throw Error(ErrorCode::kInternal, "encode_sum: compressor '" + name() + "' has no fused sum");
}

size_t Base::encode_sum_ef(std::span<const Parsed>, size_t, float, Residual&, TensorState&,
                           std::byte*, const CompressContext&) const {
  throw Error(ErrorCode::kInternal,
              "encode_sum_ef: compressor '" + name() + "' has no fused sum with error feedback");
}

Parsed Base::parse_own(std::span<const std::byte> in, size_t expected_count) const {
  Parsed p = parse_wire(in);
  if (p.algo != algo_)
    malformed(std::string("buffer holds '") + algo_name(p.algo) + "' data, this compressor decodes '" +
              algo_name(algo_) + "'");
  if (p.count != expected_count)
    malformed("buffer holds " + std::to_string(p.count) + " elements, output has " +
              std::to_string(expected_count));
  return p;
}

void Base::decompress(std::span<const std::byte> in, TensorView out, bool accumulate,
                      const CompressContext& ctx) const {
  check_cpu_f32("decompress", name(), out.device, out.dtype);
  if (out.data == nullptr && out.count != 0)
    throw Error(ErrorCode::kInvalidArgument, "decompress: null output");
  std::vector<std::byte> aligned;
  if (reinterpret_cast<uintptr_t>(in.data()) % 8 != 0) {
    aligned.assign(in.begin(), in.end());
    in = aligned;
  }
  Parsed p = parse_own(in, out.count);
  if (!accumulate && ctx.output_not_reread)
    decode_not_reread(p, static_cast<float*>(out.data), ctx.pool);
  else
    decode(p, static_cast<float*>(out.data), accumulate ? Mode::kAdd : Mode::kSet, ctx.pool);
}

size_t Base::encode_ef(const float* g, size_t n, float beta, Residual& res, TensorState& st,
                       std::byte* out, const CompressContext& ctx) const {
  // p = g + beta * r, held in r; then r = p - decode(encode(p)).
  for_chunks(ctx.pool, n, [&](size_t, size_t b, size_t e) { apply_lazy(g, beta, res, b, e); });
  res.lazy = false;
  size_t len = encode(res.r.data(), n, out, st, ctx);
  Parsed p = parse_wire({out, len});
  decode(p, res.r.data(), Mode::kSub, ctx.pool);
  return len;
}

}  // namespace detail
}  // namespace bytecomp::compress
