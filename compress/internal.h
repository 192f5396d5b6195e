// Internal to compress/: the wire header codec, the common base of the CPU
// compressors, per-tensor state types and the shared kernels. Not installed;
// callers use compressor.h.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "compress/catalogue.h"
#include "compress/compressor.h"
#include "compress/hd.h"

namespace bytecomp::compress::detail {

static_assert(std::endian::native == std::endian::little,
              "the wire format is little-endian; add byte swapping for this host");

// Algorithm ids on the wire. Never renumber: add new ones at the end.
enum class Algo : uint8_t {
  kFp16 = 1, kBf16 = 2, kRandomK = 3, kTopK = 4, kDgc = 5, kSignSgd = 6,
  kSignum = 7, kEfSignSgd = 8, kOneBit = 9, kQsgd = 10, kTernGrad = 11,
};
const char* algo_name(Algo a) noexcept;  // nullptr for unknown ids

// Wire layout (version 1), all little-endian:
//   0  u32 magic "BCZP"      4  u8 version (1)   5 u8 algorithm
//   6  u8  dtype (decoded)   7  u8 flags (0)     8 u32 params_len (multiple of 8)
//   12 u32 CRC-32 of bytes [0, 32 + params_len) with this field zeroed
//   16 u64 element count     24 u64 payload_len
//   32 params (algorithm-specific, zero-padded to params_len)
//   32 + params_len: payload (payload_len bytes), then nothing.
// The checksum covers header and parameters (a flipped bit there would
// misdirect decoding); the payload is bulk data the transport protects, and
// every decoder still bounds-checks what it reads from it.
constexpr uint32_t kMagic = 0x505A4342u;  // "BCZP"
constexpr uint8_t kVersion = 1;
constexpr size_t kHeaderBytes = 32;
// Counts above this are rejected (guards every size computation from overflow).
constexpr uint64_t kMaxCount = uint64_t{1} << 40;

constexpr size_t pad8(size_t n) { return (n + 7) & ~size_t{7}; }

struct Parsed {
  Algo algo{};
  DType dtype = DType::kFloat32;
  uint64_t count = 0;
  std::span<const std::byte> params;   // params_len bytes (padded)
  std::span<const std::byte> payload;  // exactly payload_len bytes
  uint64_t payload_len = 0;
};

// Checks magic, version, algorithm id, flags, lengths (no overflow, nothing
// missing, nothing trailing) and the checksum. Throws Error(kMalformed).
Parsed parse_wire(std::span<const std::byte> in);
// The same checks from the buffer's first min(total_size, kMaxHeadBytes)
// bytes and its total size, for buffers whose payload the host cannot read
// (device memory): payload stays empty, payload_len is set.
constexpr size_t kMaxHeadBytes = kHeaderBytes + 256;
Parsed parse_wire_head(std::span<const std::byte> head, uint64_t total_size);
// Writes the header and params; payload must already be at
// out[kHeaderBytes + pad8(params.size())]. Returns the total length.
size_t write_wire(std::span<std::byte> out, Algo algo, uint64_t count,
                  std::span<const std::byte> params, uint64_t payload_len);

[[noreturn]] void malformed(const std::string& what);

// Little-endian scalar access at any alignment.
template <class T>
inline T load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
template <class T>
inline void store(std::byte* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

// Fixed-size parameter block builder/reader.
class ParamWriter {
 public:
  template <class T>
  ParamWriter& put(T v) {
    size_t o = bytes_.size();
    bytes_.resize(o + sizeof(T));
    std::memcpy(bytes_.data() + o, &v, sizeof(T));
    return *this;
  }
  std::span<const std::byte> bytes() const { return bytes_; }

 private:
  std::vector<std::byte> bytes_;
};

class ParamReader {
 public:
  ParamReader(std::span<const std::byte> p, size_t expected, const char* algo);
  template <class T>
  T get() {
    T v;
    std::memcpy(&v, p_.data() + off_, sizeof(T));
    off_ += sizeof(T);
    return v;
  }

 private:
  std::span<const std::byte> p_;
  size_t off_ = 0;
};

// How a decoder combines with the output.
enum class Mode { kSet, kAdd, kSub };

// --- work splitting ----------------------------------------------------------

// Fixed-size chunks (independent of the pool size) keep results bit-identical
// whatever the number of threads. A multiple of 64 so bit-packed blocks never
// straddle chunks.
constexpr size_t kChunk = 1 << 16;
inline size_t num_chunks(size_t n) { return (n + kChunk - 1) / kChunk; }

// Runs f(chunk_index, begin, end) for every chunk, over the pool when given.
void for_chunks(ThreadPool* pool, size_t n, const std::function<void(size_t, size_t, size_t)>& f);

// --- randomness ---------------------------------------------------------------

using hd::hash32;      // counter-based 32-bit hash (compress/hd.h)
using hd::splitmix64;
using hd::uniform01;

// --- states ---------------------------------------------------------------------

class EmptyState final : public TensorState {
 public:
  explicit EmptyState(size_t n) : n_(n) {}
  size_t count() const override { return n_; }
  void reset() override {}

 private:
  size_t n_;
};

// One or two float vectors (momentum; DGC's u and v).
class VectorState : public TensorState {
 public:
  VectorState(size_t n, int vectors, bool residual_is_last, Algo owner)
      : owner(owner), n_(n), residual_(residual_is_last) {
    for (int i = 0; i < vectors; ++i) v_.emplace_back(n, 0.0f);
  }
  size_t count() const override { return n_; }
  void reset() override {
    for (auto& v : v_) std::fill(v.begin(), v.end(), 0.0f);
  }
  bool has_residual() const override { return residual_; }
  void copy_residual(std::span<float> out) const override;
  float* data(int i) { return v_[static_cast<size_t>(i)].data(); }

  const Algo owner;  // the kind of compressor that made it

 private:
  size_t n_;
  bool residual_;
  std::vector<std::vector<float>> v_;
};

// Error-feedback residual. The sign compressors settle their residual update
// lazily: they leave p (= input + residual) in `r` and record that the true
// residual is r[i] - (signbit(r[i]) ? neg : pos); the next compress() applies
// that in the same pass that reads r anyway, saving a pass over memory.
struct Residual {
  std::vector<float> r;
  bool lazy = false;
  float pos = 0.0f, neg = 0.0f;
};

class FeedbackState final : public TensorState {
 public:
  FeedbackState(size_t n, std::unique_ptr<TensorState> inner) : inner_(std::move(inner)) {
    res.r.assign(n, 0.0f);
  }
  size_t count() const override { return res.r.size(); }
  void reset() override {
    std::fill(res.r.begin(), res.r.end(), 0.0f);
    res.lazy = false;
    inner_->reset();
  }
  bool has_residual() const override { return true; }
  void copy_residual(std::span<float> out) const override;
  TensorState& inner() { return *inner_; }

  Residual res;

 private:
  std::unique_ptr<TensorState> inner_;
};

// --- base -------------------------------------------------------------------------

// Common checks around the raw fp32 CPU encoders/decoders.
class Base : public Compressor {
 public:
  Base(CompressorSpec spec, Algo algo) : spec_(std::move(spec)), algo_(algo) {}
  const CompressorSpec& spec() const override { return spec_; }
  Algo algo() const { return algo_; }

  std::unique_ptr<TensorState> make_state(size_t n) const override;
  size_t compress(ConstTensorView in, std::span<std::byte> out, TensorState& state,
                  const CompressContext& ctx) const override;
  void decompress(std::span<const std::byte> in, TensorView out, bool accumulate,
                  const CompressContext& ctx) const override;

  // Raw interface (CPU, fp32, sizes checked by the caller).
  virtual std::unique_ptr<TensorState> new_state(size_t n) const {
    return std::make_unique<EmptyState>(n);
  }
  // Writes the whole buffer (header included) into out (>= max bytes).
  virtual size_t encode(const float* x, size_t n, std::byte* out, TensorState& st,
                        const CompressContext& ctx) const = 0;
  // Validates everything about `p` beyond the generic header checks, without
  // touching out, then decodes.
  virtual void decode(const Parsed& p, float* out, Mode mode, ThreadPool* pool) const = 0;
  // decode() for Mode::kSet when the caller says the output is not read
  // again soon (CompressContext::output_not_reread); the default is decode().
  virtual void decode_not_reread(const Parsed& p, float* out, ThreadPool* pool) const {
    decode(p, out, Mode::kSet, pool);
  }
  // Error feedback: compresses g + beta * residual and leaves the new residual
  // in res. The generic version decodes its own output to form the residual;
  // compressors override it to fuse everything into their single pass.
  virtual size_t encode_ef(const float* g, size_t n, float beta, Residual& res,
                           TensorState& st, std::byte* out, const CompressContext& ctx) const;

  // Same-tensor check shared by decompress() and aggregate().
  Parsed parse_own(std::span<const std::byte> in, size_t expected_count) const;

  // Servers' decompress-sum-recompress (Compressor::sum_compress): the
  // compressors that fuse it (fused_sum()) check every input with
  // check_parsed() and then run encode_sum(); the others take the generic
  // decode-into-scratch path.
  size_t sum_compress(std::span<const std::span<const std::byte>> inputs, size_t n,
                      float* scratch, std::span<std::byte> out, TensorState& state,
                      const CompressContext& ctx) const override;
  bool fuses_sum_compress() const override { return fused_sum(); }
  void check(std::span<const std::byte> in, size_t n) const override;
  virtual bool fused_sum() const { return false; }
  // Everything decode() checks about `p` beyond the generic header checks,
  // without writing anything. The default decodes into a temporary buffer.
  virtual void check_parsed(const Parsed& p) const;
  // Raw fused sum-and-compress of checked inputs (only where fused_sum();
  // the defaults throw Error(kInternal)); encode_sum_ef is its error-feedback
  // form, as encode_ef is encode's.
  virtual size_t encode_sum(std::span<const Parsed> in, size_t n, std::byte* out, TensorState& st,
                            const CompressContext& ctx) const;
  virtual size_t encode_sum_ef(std::span<const Parsed> in, size_t n, float beta, Residual& res,
                               TensorState& st, std::byte* out, const CompressContext& ctx) const;

 private:
  CompressorSpec spec_;
  Algo algo_;
};

// Dense helpers (vectorised, fp32).
void apply_lazy(const float* g, float beta, Residual& res, size_t b, size_t e);  // r = g + beta*true_r
// The same for r[b, e) with that range's g at g_block[0, e - b) (a sub-block
// summed in L1); the same kernel on the same length, so the same results.
void apply_lazy_block(const float* g_block, float beta, Residual& res, size_t b, size_t e);
void add_scaled(const float* g, float beta, float* r, size_t b, size_t e);      // r = g + beta*r

// Bit-plane packing: 64-element blocks; block i occupies `bits` u64 words, word
// j holding bit j of the codes of the block's 64 elements (element e at bit
// e). A partial last block is zero-padded.
inline size_t plane_words(size_t n, unsigned bits) { return (n + 63) / 64 * bits; }
void pack_planes(const uint8_t* codes, size_t len, unsigned bits, std::byte* words);
void unpack_planes(const std::byte* words, size_t len, unsigned bits, uint8_t* codes);
// Sign bitmap (bits == 1) of x[0, len), len <= 64 per call block-aligned.
void pack_signs(const float* x, size_t len, std::byte* words);
// out = combine(out, bit ? neg : pos) over len elements.
void unpack_signs(const std::byte* words, size_t len, float pos, float neg, float* out, Mode m);
// unpack_signs(kSet) with non-temporal stores where the CPU and out's
// alignment allow (AVX-512, 64 bytes), plain stores otherwise; same values.
void unpack_signs_stream(const std::byte* words, size_t len, float pos, float neg, float* out);

// Appends to out the indices i in [b, e) whose |v[i]| bit pattern (sign
// cleared) is >= tkey, in order; returns how many. out must have room for e - b.
size_t collect_at_least(const float* v, size_t b, size_t e, uint32_t tkey, uint32_t* out);

// Parameter values for factories (validated text -> number).
using Values = ParamValues;

// Elements a sparsifier keeps of n at `ratio` (round to nearest, at least 1).
inline size_t k_of(size_t n, double ratio) { return hd::sparse_k(n, ratio); }
// Bytes of a topk/dgc buffer carrying k (index, value) pairs.
inline size_t sparse_bytes(size_t k) { return kHeaderBytes + 8 + 8 * k; }
// The most pairs DGC sends for n elements (its threshold is estimated from a
// sample, so it may keep up to 30% more than k).
inline size_t dgc_max_k(size_t n, double ratio, bool warmup) {
  return hd::dgc_max_k(n, ratio, warmup ? 1 : 0);
}

// Constructors of the concrete compressors (defined next to each).
std::unique_ptr<Base> make_fp16(CompressorSpec s);
std::unique_ptr<Base> make_bf16(CompressorSpec s);
std::unique_ptr<Base> make_randomk(CompressorSpec s, double ratio);
std::unique_ptr<Base> make_topk(CompressorSpec s, double ratio);
std::unique_ptr<Base> make_dgc(CompressorSpec s, double ratio, double momentum,
                               double sample_ratio, uint64_t warmup_iters, unsigned refine);
// DGC's selection on a server's sum: no momentum; with `residual` what it
// does not send is accumulated for the next round (its error feedback).
std::unique_ptr<Base> make_dgc_for_sum(CompressorSpec s, double ratio, double sample_ratio,
                                       uint64_t warmup_iters, unsigned refine, bool residual);
std::unique_ptr<Base> make_signsgd(CompressorSpec s);
std::unique_ptr<Base> make_signum(CompressorSpec s, double momentum);
// signum's wire format carrying the sign of the value itself (a server's
// sum: the majority vote of the nodes' signs, no momentum of its own).
std::unique_ptr<Base> make_signum_for_sum(CompressorSpec s);
std::unique_ptr<Base> make_scaledsign(CompressorSpec s);  // efsignsgd's core
std::unique_ptr<Base> make_onebit(CompressorSpec s);
std::unique_ptr<Base> make_qsgd(CompressorSpec s, unsigned levels);
std::unique_ptr<Base> make_terngrad(CompressorSpec s);
std::unique_ptr<Base> make_feedback(CompressorSpec s, std::unique_ptr<Base> inner, double beta);

}  // namespace bytecomp::compress::detail

namespace bytecomp::compress::detail {
template <class S>
S& state_as(TensorState& st, const std::string& name) {
  auto* s = dynamic_cast<S*>(&st);
  bool same = s != nullptr;
  if constexpr (std::is_same_v<S, VectorState>) {
    const char* owner = same ? algo_name(s->owner) : nullptr;
    same = same && owner != nullptr && name.rfind(owner, 0) == 0;
  }
  if (!same)
    throw Error(ErrorCode::kInvalidArgument,
                "compress: the state passed was not made by compressor '" + name +
                    "' (use its make_state())");
  return *s;
}
}  // namespace bytecomp::compress::detail
