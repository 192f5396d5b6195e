// Internals shared by the CUDA compressor translation units (issue 27
// split of compressors.cu): error checks, owning buffers, launch shapes,
// block reductions, the device-side state types, CudaState and the
// CudaCompressor class. compressors.cu holds the class's validation and
// dispatch, dense.cu the casts/randomk/sign/quant kernels and codecs,
// sparse.cu the radix-select (topk, dgc) kernels and codecs.
// Kernels stay private to their translation unit (anonymous namespaces);
// only host functions and __device__ inline helpers are shared here.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "compress/cuda/cuda.h"
#include "compress/hd.h"
#include "compress/internal.h"

namespace bytecomp::compress::cuda::impl {


using detail::Algo;
using detail::kHeaderBytes;
using detail::malformed;
using detail::pad8;
// --- allocation accounting (compressors.cu) ----------------------------------

extern std::atomic<uint64_t> g_dev_allocs, g_dev_frees, g_host_allocs, g_host_frees;
extern std::atomic<int64_t> g_dev_live, g_host_live;

[[noreturn]] void fail(cudaError_t e, const std::string& what);
inline void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(e, what);
}
inline void ck_launch(const char* what) { ck(cudaGetLastError(), what); }

// Owning device buffer (bytes), freed on destruction.
class DevBuf {
 public:
  DevBuf() = default;
  explicit DevBuf(size_t bytes) : bytes_(bytes) {
    if (bytes == 0) return;
    ck(cudaMalloc(&p_, bytes), ("allocating " + std::to_string(bytes) + " device bytes").c_str());
    ++g_dev_allocs;
    g_dev_live += static_cast<int64_t>(bytes);
    ck(cudaMemset(p_, 0, bytes), "clearing device memory");
  }
  DevBuf(DevBuf&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr; }
  DevBuf& operator=(DevBuf&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~DevBuf() {
    if (p_ == nullptr) return;
    cudaFree(p_);
    ++g_dev_frees;
    g_dev_live -= static_cast<int64_t>(bytes_);
  }
  template <class T>
  T* as() const { return static_cast<T*>(p_); }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

class PinnedBuf {
 public:
  explicit PinnedBuf(size_t bytes) : bytes_(bytes) {
    ck(cudaMallocHost(&p_, bytes), "allocating pinned host memory");
    ++g_host_allocs;
    g_host_live += static_cast<int64_t>(bytes);
  }
  PinnedBuf(const PinnedBuf&) = delete;
  PinnedBuf& operator=(const PinnedBuf&) = delete;
  ~PinnedBuf() {
    cudaFreeHost(p_);
    ++g_host_frees;
    g_host_live -= static_cast<int64_t>(bytes_);
  }
  template <class T>
  T* as() const { return static_cast<T*>(p_); }

 private:
  void* p_ = nullptr;
  size_t bytes_;
};

// Runs the call on the device that owns the tensor; restores the caller's.
class DeviceGuard {
 public:
  explicit DeviceGuard(int dev) {
    ck(cudaGetDevice(&prev_), "cudaGetDevice");
    if (dev != prev_) ck(cudaSetDevice(dev), "cudaSetDevice");
    set_ = dev != prev_;
  }
  ~DeviceGuard() {
    if (set_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0;
  bool set_ = false;
};

// The device owning `p`; throws kInvalidArgument for host memory.
int device_of(const void* p, const std::string& what);

// --- launch shapes ----------------------------------------------------------------

constexpr int kThreads = 256;
constexpr int kStatBlocks = 1024;  // fixed: partial sums add up the same on every GPU
constexpr uint32_t kTile = 4096;   // radix write tiles: 16 rounds of kThreads
constexpr uint32_t kRounds = kTile / kThreads;

inline unsigned grid_for(uint64_t n, unsigned cap = 1u << 16) {
  uint64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::max<uint64_t>(1, std::min<uint64_t>(b, cap)));
}
__host__ __device__ inline uint64_t padded64(uint64_t n) { return (n + 63) / 64 * 64; }

__device__ __forceinline__ uint64_t gtid() {
  return static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ uint64_t gstride() {
  return static_cast<uint64_t>(gridDim.x) * blockDim.x;
}

// Block-wide sum of doubles (blockDim.x == kThreads); result in thread 0.
__device__ inline double block_sum(double v, double* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
    __syncthreads();
  }
  double r = sh[0];
  __syncthreads();
  return r;
}
__device__ inline float block_max(float v, float* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) sh[threadIdx.x] = fmaxf(sh[threadIdx.x], sh[threadIdx.x + s]);
    __syncthreads();
  }
  float r = sh[0];
  __syncthreads();
  return r;
}

// Exclusive prefix of `v` over the block in thread order (blockDim.x ==
// kThreads); *total gets the block's sum.
__device__ inline uint32_t block_exclusive(uint32_t v, uint32_t* sh, uint32_t* total) {
  unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t x = v;
  for (int o = 1; o < 32; o <<= 1) {
    uint32_t y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= static_cast<unsigned>(o)) x += y;
  }
  if (lane == 31) sh[warp] = x;
  __syncthreads();
  if (warp == 0) {
    uint32_t w = lane < kThreads / 32 ? sh[lane] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      uint32_t y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= static_cast<unsigned>(o)) w += y;
    }
    if (lane < kThreads / 32) sh[lane] = w;  // inclusive warp prefixes
  }
  __syncthreads();
  uint32_t before = warp == 0 ? 0 : sh[warp - 1];
  *total = sh[kThreads / 32 - 1];
  __syncthreads();
  return before + x - v;
}

// --- header ----------------------------------------------------------------------

struct HeaderArgs {
  uint8_t algo;
  uint32_t params_len;     // bytes used
  uint32_t params_padded;  // multiple of 8
  uint64_t count;
  uint64_t payload_len;
  uint8_t params[24];      // when !params_in_place
  bool params_in_place;    // params already at out + 32 (written by a finalizer)
  const uint32_t* k_dev;   // sparse: k from the device; payload_len = 8 k
};

void launch_header(std::byte* out, const HeaderArgs& a, cudaStream_t s);

inline HeaderArgs header_args(Algo algo, uint64_t count, uint32_t plen, uint64_t payload_len) {
  HeaderArgs a{};
  a.algo = static_cast<uint8_t>(algo);
  a.count = count;
  a.params_len = plen;
  a.params_padded = static_cast<uint32_t>(pad8(plen));
  a.payload_len = payload_len;
  return a;
}

// --- device-side state types ------------------------------------------------

// Lazy residual scalars of a state (device): the sign family leaves p in r
// and records the decoded magnitudes, applied on the next call's read.
struct Lazy {
  int lazy;
  float pos, neg;
};

// Stats partial per block: [abs or pos sum, neg sum, neg count].
struct SignPartial {
  double a, b;
  unsigned long long c;
};

struct QuantPartial {
  double sum, sumsq;
  float maxabs;
};
// Device scalars the code pass reads: scale, inv (terngrad), unit (EF).
struct QuantScal {
  float scale, inv, unit;
};

// Control block of one selection (device). Kernels that take a gate run only
// while *gate == want, so dgc's data-dependent refinement is a fixed launch
// sequence without host round trips.
struct Select {
  uint32_t prefix;  // digits chosen so far; after the last pass, the threshold key
  uint32_t need;    // picks still wanted among keys equal to the prefix
  uint32_t total;   // picks of the last tile scan
  uint32_t pad;
};
constexpr uint32_t kAll = 0xffffffffu;  // need: every key equal to the threshold

struct Gate {
  const uint32_t* word;
  uint32_t want;
  __device__ bool closed() const { return word != nullptr && *word != want; }
};

enum Phase : uint32_t { kRefine = 1, kCount = 2, kTakeAll = 3, kTrim = 4 };

struct DgcCtl {
  uint32_t phase;
  float thr;
  double rank;
};

// --- state ------------------------------------------------------------------------------------

class CudaState final : public TensorState {
 public:
  CudaState(const std::string& owner, size_t n) : owner_(owner), n_(n) {
    ck(cudaGetDevice(&device_), "cudaGetDevice");
  }
  size_t count() const override { return n_; }
  void reset() override {
    DeviceGuard dg(device_);
    // Not a steady-state call: wait for the state's pending work on any stream.
    ck(cudaDeviceSynchronize(), "reset");
    for (DevBuf* b : {&r, &m, &u, &v, &lazy})
      if (b->bytes()) ck(cudaMemset(b->as<void>(), 0, b->bytes()), "reset");
    ck(cudaDeviceSynchronize(), "reset");
  }
  bool has_residual() const override { return r.bytes() > 0 || v.bytes() > 0; }
  void copy_residual(std::span<float> out) const override;  // dense.cu

  const std::string owner_;
  const size_t n_;
  int device_ = 0;
  DevBuf r, m, u, v;  // residual; signum momentum; dgc u and v
  DevBuf lazy;        // Lazy (sign family with EF)
  DevBuf part;        // SignPartial / QuantPartial [kStatBlocks]
  DevBuf scal;        // QuantScal
  DevBuf hist;        // 2048 u32 (cleared by every select)
  DevBuf sel, sel_sample, ctl;
  DevBuf tiles;       // gt, eq, off, eq_before: 4 x tiles u32
  DevBuf sample;      // dgc
  std::unique_ptr<PinnedBuf> count_host;  // dgc's pick count
};

// --- compressor ----------------------------------------------------------------------------

struct Scratch {
  PinnedBuf host{detail::kMaxHeadBytes + 16};
  DevBuf bad{8};
};

class CudaCompressor final : public Compressor {
 public:
  CudaCompressor(const CompressorSpec& spec, const ParamValues& v)
      : spec_(spec), cpu_(compress::make_compressor(spec)) {
    const std::string& nm = spec.name;
    algo_ = nm == "fp16" ? Algo::kFp16 : nm == "bf16" ? Algo::kBf16 : nm == "randomk" ? Algo::kRandomK
          : nm == "topk" ? Algo::kTopK : nm == "dgc" ? Algo::kDgc : nm == "signsgd" ? Algo::kSignSgd
          : nm == "signum" ? Algo::kSignum : nm == "efsignsgd" ? Algo::kEfSignSgd
          : nm == "onebit" ? Algo::kOneBit : nm == "qsgd" ? Algo::kQsgd : Algo::kTernGrad;
    auto get = [&](const char* k, double d) { return v.v.count(k) ? v[k] : d; };
    ef_ = algo_ == Algo::kEfSignSgd || algo_ == Algo::kOneBit || get("ef", 0) != 0;
    if (algo_ == Algo::kDgc) ef_ = false;
    beta_ = static_cast<float>(get("ef_beta", 1));
    ratio_ = get("ratio", 0.01);
    momentum_ = static_cast<float>(get("momentum", 0.9));
    stride_ = std::max<uint64_t>(1, static_cast<uint64_t>(std::llround(1.0 / get("sample_ratio", 0.01))));
    warmup_ = static_cast<uint64_t>(get("warmup_iters", 0));
    refine_ = static_cast<uint32_t>(get("refine", 2));
    levels_ = static_cast<uint32_t>(get("levels", 16));
    bits_ = algo_ == Algo::kQsgd ? 1 + static_cast<uint32_t>(std::bit_width(levels_)) : 2;
  }

  const CompressorSpec& spec() const override { return spec_; }
  size_t max_compressed_bytes(size_t n) const override { return cpu_->max_compressed_bytes(n); }
  bool additive() const override { return cpu_->additive(); }
  bool deterministic_size() const override { return cpu_->deterministic_size(); }

  std::unique_ptr<TensorState> make_state(size_t n) const override {
    if (n > detail::kMaxCount)
      throw Error(ErrorCode::kInvalidArgument, "make_state: " + std::to_string(n) +
                                                   " elements exceeds the limit " +
                                                   std::to_string(detail::kMaxCount));
    auto st = std::make_unique<CudaState>(name(), n);
    size_t f = n * sizeof(float);
    if (ef_) st->r = DevBuf(f);
    if (ef_ && sign()) st->lazy = DevBuf(sizeof(Lazy));
    if (algo_ == Algo::kSignum) st->m = DevBuf(f);
    if (algo_ == Algo::kEfSignSgd || algo_ == Algo::kOneBit) st->part = DevBuf(kStatBlocks * sizeof(SignPartial));
    if (algo_ == Algo::kQsgd || algo_ == Algo::kTernGrad) {
      st->part = DevBuf(kStatBlocks * sizeof(QuantPartial));
      st->scal = DevBuf(sizeof(QuantScal));
    }
    if (algo_ == Algo::kTopK || algo_ == Algo::kDgc) {
      if (n > 0xffffffffull)
        throw Error(ErrorCode::kInvalidArgument,
                    "make_state: '" + name() + "' sends 32-bit indices; " + std::to_string(n) +
                        " elements is too many (split the tensor into partitions)");
      st->hist = DevBuf(hd::kRadixMaxBuckets * sizeof(uint32_t));
      st->sel = DevBuf(sizeof(Select));
      st->tiles = DevBuf(4 * tiles(n) * sizeof(uint32_t));
    }
    if (algo_ == Algo::kDgc) {
      st->u = DevBuf(f);
      st->v = DevBuf(f);
      st->sel_sample = DevBuf(sizeof(Select));
      st->ctl = DevBuf(sizeof(DgcCtl));
      st->sample = DevBuf(std::max<uint64_t>(1, (n + stride_ - 1) / stride_) * sizeof(float));
      st->count_host = std::make_unique<PinnedBuf>(sizeof(Select));
    }
    return st;
  }

  size_t compress(ConstTensorView in, std::span<std::byte> out, TensorState& state,
                  const CompressContext& ctx) const override;

  void decompress(std::span<const std::byte> in, TensorView out, bool accumulate,
                  const CompressContext&) const override;

  size_t aggregate(std::span<const std::span<const std::byte>>, std::span<std::byte>,
                   const CompressContext&) const override {
    throw Error(ErrorCode::kInvalidArgument,
                "aggregate: the cuda '" + name() +
                    "' compressor does not sum compressed buffers; decompress each with "
                    "accumulate=true (or aggregate on the cpu)");
  }

  ~CudaCompressor() override = default;

 private:
  bool sign() const {
    return algo_ == Algo::kSignSgd || algo_ == Algo::kSignum || algo_ == Algo::kEfSignSgd ||
           algo_ == Algo::kOneBit;
  }
  static uint64_t tiles(uint64_t n) { return std::max<uint64_t>(1, (n + kTile - 1) / kTile); }

  void check_view(const char* what, Device dev, DType dt) const {
    if (dev != Device::kCuda)
      throw Error(ErrorCode::kInvalidArgument, std::string(what) + ": cuda compressor '" + name() +
                                                   "' got a " + std::string(to_string(dev)) +
                                                   " tensor (accepted: cuda)");
    if (dt != DType::kFloat32)
      throw Error(ErrorCode::kInvalidArgument, std::string(what) + ": compressor '" + name() +
                                                   "' takes float32 tensors, got " +
                                                   std::string(to_string(dt)));
  }

  std::unique_ptr<Scratch> take_scratch() const {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!free_.empty()) {
        auto s = std::move(free_.back());
        free_.pop_back();
        return s;
      }
    }
    return std::make_unique<Scratch>();
  }
  void give_scratch(std::unique_ptr<Scratch> s) const {
    if (!s) return;
    std::lock_guard<std::mutex> l(mu_);
    free_.push_back(std::move(s));
  }

  // --- encoders ---

  size_t encode(const float* x, size_t n, std::byte* out, CudaState& st, const CompressContext& ctx,
                cudaStream_t s) const;

  void radix(const float* v, const float* g, uint64_t n, CudaState& st, Select* sel, Gate gate,
             cudaStream_t s) const;
  void tile_counts(const float* v, uint64_t n, CudaState& st, Select* sel, Gate gate, cudaStream_t s) const;
  void tile_write(const float* v, uint64_t n, CudaState& st, Select* sel, std::byte* out, float* z1,
                  float* z2, cudaStream_t s) const;
  size_t encode_topk(const float* x, size_t n, std::byte* out, CudaState& st, cudaStream_t s) const;
  size_t encode_dgc(const float* g, size_t n, std::byte* out, CudaState& st, const CompressContext& ctx,
                    cudaStream_t s) const;
  void decode_sparse(const detail::Parsed& p, const std::byte* payload, unsigned long long bad,
                     float* out, bool add, cudaStream_t s) const;

  // --- decoders (after the header checks) ---

  void expect_params(const detail::Parsed& p, size_t bytes) const {
    if (p.params.size() != pad8(bytes))
      malformed(std::string(detail::algo_name(algo_)) + " parameters are " + std::to_string(p.params.size()) +
                " bytes (expected " + std::to_string(pad8(bytes)) + ")");
  }
  void expect_payload(const detail::Parsed& p, uint64_t want, const std::string& what) const {
    if (p.payload_len != want)
      malformed(std::string(detail::algo_name(algo_)) + " payload is " + std::to_string(p.payload_len) +
                " bytes for " + what + " (expected " + std::to_string(want) + ")");
  }
  template <class T>
  static T param(const detail::Parsed& p, size_t off) {
    T v;
    std::memcpy(&v, p.params.data() + off, sizeof v);
    return v;
  }

  void decode(const detail::Parsed& p, const std::byte* payload, unsigned long long bad, float* out,
              bool add, cudaStream_t s) const;

  CompressorSpec spec_;
  std::unique_ptr<Compressor> cpu_;  // sizes and flags: the same formulas as the CPU library
  Algo algo_{};
  bool ef_ = false;
  float beta_ = 1, momentum_ = 0.9f;
  double ratio_ = 0.01;
  uint64_t stride_ = 100, warmup_ = 0;
  uint32_t refine_ = 2, levels_ = 16, bits_ = 2;
  mutable std::mutex mu_;
  mutable std::vector<std::unique_ptr<Scratch>> free_;
};

// Launches the index check of a sparse buffer (sparse.cu).
void launch_check_sparse(const std::byte* in, size_t size, unsigned long long* bad, cudaStream_t s);

}  // namespace bytecomp::compress::cuda::impl
