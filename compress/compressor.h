// Gradient compressors (issue 3): the interface the daemon and the parameter
// server call, the factory, and the spec that names a compressor and its
// parameters.
//
// Shape of a call (the daemon keeps one TensorState per tensor, the server one
// per partition):
//
//   auto c = make_compressor(parse_compressor_spec("topk:0.01"));
//   auto state = c->make_state(n);
//   std::vector<std::byte> buf(c->max_compressed_bytes(n));
//   size_t len = c->compress(ConstTensorView::cpu(grad, n), buf, *state,
//                            {.iteration = it, .shared_seed = tensor_key, .pool = &pool});
//   // ... send buf[0, len) ...
//   c->decompress({buf.data(), len}, TensorView::cpu(sum, n), /*accumulate=*/true, {.pool = &pool});
//
// compress() writes into a caller-provided buffer that must be 8-byte aligned;
// decompress() accepts any alignment (misaligned input is copied first).
//
// Every buffer is self-describing (compress/internal.h and docs/compress.md
// document the layout):
// decompress() needs no side information, checks every length, count and index
// before touching memory, and throws Error(kMalformed) naming what was wrong.
//
// Devices: TensorView carries a device and a stream so CUDA kernels can be added
// later behind the same calls. The CPU implementations accept Device::kCpu and
// DType::kFloat32 tensors and throw Error(kInvalidArgument) otherwise.
//
// Thread-safety: a Compressor is immutable after construction; any number of
// threads may call it at once, as long as each call uses a different
// TensorState (a TensorState is neither thread-safe nor thread-bound). Work is
// spread over CompressContext::pool when one is given.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/types.h"

namespace bytecomp {
class ThreadPool;
namespace config {
class Reader;
}
}  // namespace bytecomp

namespace bytecomp::compress {

// Element types and devices: the shared vocabulary (common/types.h). The
// compressed buffer format writes a DType's value as its dtype code (float32
// 0, float16 1, bfloat16 2; pinned in base.cc).
using DType = bytecomp::DType;
using Device = bytecomp::Device;
using bytecomp::dtype_size;
using bytecomp::to_string;

// A borrowed tensor: `count` elements of `dtype` at `data` on `device`.
// `stream` is the device stream work is ordered on (cudaStream_t for CUDA;
// ignored on the CPU).
struct TensorView {
  void* data = nullptr;
  size_t count = 0;
  DType dtype = DType::kFloat32;
  Device device = Device::kCpu;
  void* stream = nullptr;

  static TensorView cpu(float* p, size_t n) { return {p, n, DType::kFloat32, Device::kCpu, nullptr}; }
};

struct ConstTensorView {
  const void* data = nullptr;
  size_t count = 0;
  DType dtype = DType::kFloat32;
  Device device = Device::kCpu;
  void* stream = nullptr;

  ConstTensorView() = default;
  ConstTensorView(const void* d, size_t n, DType t = DType::kFloat32,
                  Device dev = Device::kCpu, void* s = nullptr)
      : data(d), count(n), dtype(t), device(dev), stream(s) {}
  ConstTensorView(const TensorView& v)  // NOLINT: implicit by design
      : data(v.data), count(v.count), dtype(v.dtype), device(v.device), stream(v.stream) {}
  static ConstTensorView cpu(const float* p, size_t n) { return {p, n}; }
};

// Per-call inputs besides the tensors.
struct CompressContext {
  // Training iteration. With shared_seed it fixes randomk's indices: every
  // worker compressing the same tensor at the same iteration picks the same
  // indices, so their payloads add up without sending indices. DGC's warm-up
  // schedule also reads it.
  uint64_t iteration = 0;
  // Same on all workers for one tensor (e.g. a hash of the tensor's name).
  uint64_t shared_seed = 0;
  // Different per worker: private randomness (qsgd/terngrad stochastic
  // rounding) must not be correlated across workers.
  uint64_t private_seed = 0;
  // Optional; work is split over it when given. Not owned.
  ThreadPool* pool = nullptr;
  // decompress() without accumulate: nothing reads the output again soon
  // (the daemon's pulled answers, decoded straight into the client's
  // tensor), so large outputs may be written past the cache (the sign
  // family: non-temporal stores from 2^18 elements). Same values.
  bool output_not_reread = false;
};

// Per-tensor state a caller keeps between iterations (error-feedback residual,
// momentum). Created by Compressor::make_state() for a fixed element count and
// only usable with compressors of the same spec.
// Thread-safety: neither thread-safe nor thread-bound.
class TensorState {
 public:
  virtual ~TensorState() = default;
  virtual size_t count() const = 0;
  // Forgets all history (residuals and momenta back to zero).
  virtual void reset() = 0;
  // Whether this state carries an error-feedback residual.
  virtual bool has_residual() const { return false; }
  // Copies the current residual (what the next compress() will add to its
  // input) into `out` (out.size() == count()). Throws when !has_residual().
  virtual void copy_residual(std::span<float> out) const;
};

// A compressor's name and parameters, e.g. {"topk", {{"ratio", "0.01"}}}.
// Parameter values are kept as text; make_compressor() validates them.
struct CompressorSpec {
  std::string name;
  std::map<std::string, std::string> params;

  bool operator==(const CompressorSpec&) const = default;
};

// "name", "name:primary", "name:key=value,key=value", "name:primary,key=value",
// e.g. "topk:0.01", "qsgd:levels=16", "dgc:0.001,momentum=0.9". The primary
// value is the compressor's first parameter (ratio, levels, ...). Checks names
// and parameters like make_compressor(); throws Error(kInvalidArgument)
// listing what is accepted.
CompressorSpec parse_compressor_spec(std::string_view text);
// From a YAML mapping: `{name: topk, ratio: 0.01, ef: true}`. Validates every
// key and calls r.finish(); errors are ConfigError with file, line and the
// accepted names/parameters.
CompressorSpec parse_compressor_spec(config::Reader& r);
// Canonical text form, accepted by parse_compressor_spec().
std::string to_string(const CompressorSpec& spec);

struct ParamInfo {
  std::string name;
  std::string accepted;       // e.g. "0 < x <= 1", "1..127", "true|false"
  std::string default_value;  // text form
  std::string help;
  // Whether the CLI form may give it without a key ("topk:0.01").
  bool positional = false;
};

struct CompressorInfo {
  std::string name;
  std::string help;
  std::vector<ParamInfo> params;
  bool additive = false;
  bool deterministic_size = true;
};

// Every compressor name with its parameters, in a stable order.
const std::vector<CompressorInfo>& list_compressors();
// Multi-line human-readable form of list_compressors() (for --help texts).
std::string describe_compressors();

class Compressor {
 public:
  virtual ~Compressor() = default;

  // Canonical spec with every parameter filled in (defaults included).
  virtual const CompressorSpec& spec() const = 0;
  const std::string& name() const { return spec().name; }

  // Upper bound of compress()'s output for `n` elements, header included.
  virtual size_t max_compressed_bytes(size_t n) const = 0;
  // True when compressed payloads of the same tensor and iteration can be
  // summed without decompressing (aggregate() works): fp16, bf16, randomk.
  virtual bool additive() const = 0;
  // True when the compressed size depends only on n (not on the values).
  virtual bool deterministic_size() const = 0;

  // State for one tensor of `n` elements (always non-null; stateless
  // compressors return an empty state).
  virtual std::unique_ptr<TensorState> make_state(size_t n) const = 0;

  // Compresses `in` (n = in.count elements) into `out`, which must hold at
  // least max_compressed_bytes(n) bytes. Updates `state` (residual, momentum).
  // Returns the number of bytes written.
  virtual size_t compress(ConstTensorView in, std::span<std::byte> out,
                          TensorState& state, const CompressContext& ctx) const = 0;

  // Decodes `in` into `out`; with `accumulate` adds to out's contents
  // (decompress-and-sum), otherwise overwrites all of out. The buffer must
  // have been produced by a compressor of the same name for out.count
  // elements; anything else throws Error(kMalformed) and leaves `out`
  // untouched.
  virtual void decompress(std::span<const std::byte> in, TensorView out,
                          bool accumulate, const CompressContext& ctx) const = 0;

  // Sums several compressed buffers of the same tensor and iteration into one
  // compressed buffer (out: max_compressed_bytes(n) bytes) without a dense
  // intermediate, for additive() compressors; returns bytes written. Throws
  // Error(kInvalidArgument) for non-additive compressors and kMalformed for
  // inputs that do not match each other.
  virtual size_t aggregate(std::span<const std::span<const std::byte>> inputs,
                           std::span<std::byte> out, const CompressContext& ctx) const;

  // A parameter server's decompress-sum-recompress in one call (CPU): decodes
  // every buffer of `inputs` (compress() outputs of this compressor's name for
  // `n` elements), sums them in float32 in the order given and compresses the
  // sum into `out` with `state`, as compress() would; returns bytes written.
  // Output and state are bit-identical to decompress(inputs[0]) into an
  // n-element buffer, decompress(inputs[i], accumulate) for each next input,
  // then compress() of that buffer, which is what the generic version does in
  // `scratch` (n floats). Where fuses_sum_compress() it instead decodes, sums
  // and recompresses a few thousand elements at a time in L1 and never
  // touches `scratch` (null is fine there). Every input is checked before
  // `state` changes: a bad one throws Error(kMalformed); no inputs, or `out`
  // / `state` that compress() would refuse, throw Error(kInvalidArgument).
  virtual size_t sum_compress(std::span<const std::span<const std::byte>> inputs, size_t n,
                              float* scratch, std::span<std::byte> out, TensorState& state,
                              const CompressContext& ctx) const;
  // Whether sum_compress() is fused (no dense sum in memory): the sign family.
  virtual bool fuses_sum_compress() const { return false; }
  // Checks `in` as decompress() into `n` elements would, without writing
  // anything; throws Error(kMalformed) naming what is wrong. The fused
  // compressors check without decoding; the generic version decodes into a
  // temporary buffer.
  virtual void check(std::span<const std::byte> in, size_t n) const;
};

// Builds a compressor; throws Error(kInvalidArgument) naming the unknown
// compressor or parameter, or the bad value, with what is accepted.
std::unique_ptr<Compressor> make_compressor(const CompressorSpec& spec);
// What a parameter server recompresses the sum of the nodes' pushes of
// `spec` with (docs/compress.md, "At the server"): its buffers decode with
// `spec`'s compressor (same name and wire format; spec() is `spec`'s
// canonical form), it keeps none of the nodes' per-tensor state (DGC's and
// signum's momentum: the nodes applied it to their own gradients already;
// applying it again to the sum compounds it), and its state carries a
// residual of its own exactly when `error_feedback` (whatever `spec`'s "ef"
// says: that is the nodes' setting). Throws like make_compressor().
std::unique_ptr<Compressor> make_sum_recompressor(const CompressorSpec& spec, bool error_feedback);
// The implementation for tensors on `device`: the CPU library, or the CUDA
// kernels (compress/cuda/cuda.h; same wire format). Throws
// Error(kInvalidArgument) for a device this build has no kernels for.
std::unique_ptr<Compressor> make_compressor(const CompressorSpec& spec, Device device);

// What a compressed buffer says about itself (after full header validation).
struct WireInfo {
  std::string algorithm;   // compressor name
  size_t count = 0;        // decoded element count
  DType dtype = DType::kFloat32;
  size_t payload_bytes = 0;
  size_t total_bytes = 0;
};
// Validates the header (magic, version, algorithm, lengths, checksum); throws
// Error(kMalformed) otherwise.
WireInfo inspect(std::span<const std::byte> in);

}  // namespace bytecomp::compress
