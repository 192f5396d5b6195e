// CUDA kernels of every compressor, writing and reading the CPU library's
// wire format (compress/internal.h); per-element logic from compress/hd.h.
// One translation unit on purpose: nvcc time on the build machines.
//
// Kernel families:
//  * element-wise (casts, randomk gather/scatter, decoders): grid-stride;
//  * packers (sign family, qsgd, terngrad): one thread per element over the
//    range padded to 64, one __ballot_sync per warp and bit plane, lane 0
//    writes the 32-bit half of the plane word (hd::plane_half) -- no atomics,
//    no shared words, the padding bits come out zero;
//  * statistics (norms, means): a fixed grid of at most kStatBlocks blocks
//    writes one partial per block, a one-block finalizer adds them in order
//    (deterministic on every GPU) and writes params, header and the lazy
//    residual scalars -- all on the device, so nothing waits for the host;
//  * radix select (topk, dgc): three histogram passes over the keys that
//    match the digits chosen so far, a one-block select after each, then
//    per-tile counts, a one-block scan of the tiles and an in-order write of
//    the picks (ties: lower index first, as the CPU library).
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

namespace bytecomp::compress::cuda {
namespace {

using detail::Algo;
using detail::kHeaderBytes;
using detail::malformed;
using detail::pad8;

// --- allocation accounting -------------------------------------------------------

std::atomic<uint64_t> g_dev_allocs{0}, g_dev_frees{0}, g_host_allocs{0}, g_host_frees{0};
std::atomic<int64_t> g_dev_live{0}, g_host_live{0};

[[noreturn]] void fail(cudaError_t e, const std::string& what) {
  cudaGetLastError();  // clear a sticky launch error for the next caller
  ErrorCode code = e == cudaErrorMemoryAllocation ? ErrorCode::kResourceExhausted
                                                  : ErrorCode::kUnavailable;
  throw Error(code, "cuda compressor: " + what + ": " + cudaGetErrorString(e));
}
void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(e, what);
}
void ck_launch(const char* what) { ck(cudaGetLastError(), what); }

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
int device_of(const void* p, const std::string& what) {
  cudaPointerAttributes a{};
  cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw Error(ErrorCode::kInvalidArgument,
                what + " is not a CUDA pointer (" + cudaGetErrorString(e) + ")");
  }
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
    throw Error(ErrorCode::kInvalidArgument,
                what + " is host memory; the cuda compressors take device memory "
                       "(copy it to the GPU, or use the cpu compressor)");
  return a.device;
}

// --- launch shapes ----------------------------------------------------------------

constexpr int kThreads = 256;
constexpr int kStatBlocks = 1024;  // fixed: partial sums add up the same on every GPU
constexpr uint32_t kTile = 4096;   // radix write tiles: 16 rounds of kThreads
constexpr uint32_t kRounds = kTile / kThreads;

unsigned grid_for(uint64_t n, unsigned cap = 1u << 16) {
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
__device__ double block_sum(double v, double* sh) {
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
__device__ float block_max(float v, float* sh) {
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
__device__ uint32_t block_exclusive(uint32_t v, uint32_t* sh, uint32_t* total) {
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

__global__ void k_header(uint8_t* out, HeaderArgs a) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  uint64_t payload = a.payload_len;
  if (a.k_dev != nullptr) {
    uint64_t k = *a.k_dev;
    hd::put_le(a.params, k, 8);
    payload = 8 * k;
  }
  hd::write_header(out, a.algo, a.count, a.params_in_place ? out + 32 : a.params, a.params_len,
                   a.params_padded, payload);
}

void launch_header(std::byte* out, const HeaderArgs& a, cudaStream_t s) {
  k_header<<<1, 32, 0, s>>>(reinterpret_cast<uint8_t*>(out), a);
  ck_launch("header kernel");
}

HeaderArgs header_args(Algo algo, uint64_t count, uint32_t plen, uint64_t payload_len) {
  HeaderArgs a{};
  a.algo = static_cast<uint8_t>(algo);
  a.count = count;
  a.params_len = plen;
  a.params_padded = static_cast<uint32_t>(pad8(plen));
  a.payload_len = payload_len;
  return a;
}

// --- casts -------------------------------------------------------------------------

template <bool BF>
__device__ __forceinline__ uint16_t to_half(float f) {
  return BF ? hd::fp32_to_bf16_bits(f) : hd::fp32_to_fp16_bits(f);
}
template <bool BF>
__device__ __forceinline__ float from_half(uint16_t h) {
  return BF ? hd::bf16_bits_to_fp32(h) : hd::fp16_bits_to_fp32(h);
}

// EF: p = g + beta r; h = cast(p); r = p - uncast(h) (the CPU wrapper's
// generic update, fused).
template <bool BF, bool EF>
__global__ void k_cast(const float* __restrict g, float* __restrict r, float beta,
                       uint16_t* __restrict out, uint64_t n) {
  for (uint64_t i = gtid(); i < n; i += gstride()) {
    float p = g[i];
    if (EF) p = g[i] + beta * r[i];
    uint16_t h = to_half<BF>(p);
    out[i] = h;
    if (EF) r[i] = p - from_half<BF>(h);
  }
}

template <bool BF>
__global__ void k_uncast(const uint16_t* __restrict h, float* __restrict out, uint64_t n, bool add) {
  for (uint64_t i = gtid(); i < n; i += gstride()) {
    float v = from_half<BF>(h[i]);
    out[i] = add ? out[i] + v : v;
  }
}

// --- randomk -------------------------------------------------------------------------

__global__ void k_add_scaled(const float* __restrict g, float* __restrict r, float beta, uint64_t n) {
  for (uint64_t i = gtid(); i < n; i += gstride()) r[i] = g[i] + beta * r[i];
}

// vals[i] = src[index(i)]; with `zero` the pick is cleared there (the EF
// residual keeps what was not sent).
__global__ void k_randomk_gather(const float* src, float* zero, float* __restrict vals, uint64_t seed,
                                 uint64_t n, uint64_t k) {
  for (uint64_t i = gtid(); i < k; i += gstride()) {
    uint64_t j = hd::randomk_index(seed, i, n, k);
    vals[i] = src[j];
    if (zero != nullptr) zero[j] = 0.0f;
  }
}

// Indices are distinct: no two threads touch the same element.
__global__ void k_randomk_scatter(const float* __restrict vals, float* __restrict out, uint64_t seed,
                                  uint64_t n, uint64_t k, bool add) {
  for (uint64_t i = gtid(); i < k; i += gstride()) {
    uint64_t j = hd::randomk_index(seed, i, n, k);
    out[j] = add ? out[j] + vals[i] : vals[i];
  }
}

// --- sign family ---------------------------------------------------------------------

enum class SignVar : int { kSign = 0, kSignum = 1, kScaled = 2, kOneBit = 3 };

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

template <SignVar V, bool EF>
__global__ void k_sign(const float* __restrict g, float* __restrict st, float beta, float momentum,
                       const Lazy* lazy, uint32_t* __restrict words, SignPartial* part, uint64_t n) {
  __shared__ double sh[kThreads];
  double a = 0, b = 0;
  unsigned long long c = 0;
  uint64_t padded = padded64(n);
  Lazy lz = EF ? *lazy : Lazy{0, 0, 0};
  for (uint64_t i = gtid(); i < padded; i += gstride()) {
    float v = 0.0f;
    bool in = i < n;
    if (in) {
      if (EF) {
        float r = st[i];
        if (lz.lazy) r = r - (hd::sign_bit(r) ? lz.neg : lz.pos);
        v = g[i] + beta * r;
        st[i] = v;
      } else if (V == SignVar::kSignum) {
        v = momentum * st[i] + (1.0f - momentum) * g[i];
        st[i] = v;
      } else {
        v = g[i];
      }
      if (V == SignVar::kScaled) a += fabsf(v);
      if (V == SignVar::kOneBit) {
        if (hd::sign_bit(v)) b += v, ++c;
        else a += v;
      }
    }
    uint32_t ballot = __ballot_sync(0xffffffffu, in && hd::sign_bit(v));
    if ((threadIdx.x & 31) == 0) words[i / 32] = ballot;
  }
  if (V == SignVar::kScaled || V == SignVar::kOneBit) {
    double ta = block_sum(a, sh), tb = block_sum(b, sh), tc = block_sum(static_cast<double>(c), sh);
    if (threadIdx.x == 0) part[blockIdx.x] = {ta, tb, static_cast<unsigned long long>(tc)};
  }
}

// Sums the partials in block order, writes params (at out + 32), header and
// the lazy residual scalars.
template <SignVar V>
__global__ void k_sign_finish(const SignPartial* part, int parts, uint64_t n, uint8_t* out,
                              HeaderArgs h, Lazy* lazy) {
  if (threadIdx.x != 0) return;
  double a = 0, b = 0;
  unsigned long long c = 0;
  if (V == SignVar::kScaled || V == SignVar::kOneBit)
    for (int i = 0; i < parts; ++i) a += part[i].a, b += part[i].b, c += part[i].c;
  float pos = 1.0f, neg = -1.0f;
  if (V == SignVar::kScaled) {
    pos = n ? static_cast<float>(a / static_cast<double>(n)) : 0.0f;
    neg = -pos;
    hd::put_le(out + 32, hd::f2u(pos), 4);
  } else if (V == SignVar::kOneBit) {
    uint64_t pos_cnt = n - c;
    pos = pos_cnt ? static_cast<float>(a / static_cast<double>(pos_cnt)) : 0.0f;
    neg = c ? static_cast<float>(b / static_cast<double>(c)) : 0.0f;
    hd::put_le(out + 32, hd::f2u(pos), 4);
    hd::put_le(out + 36, hd::f2u(neg), 4);
  }
  if (lazy != nullptr) *lazy = {1, pos, neg};
  hd::write_header(out, h.algo, h.count, out + 32, h.params_len, h.params_padded, h.payload_len);
}

__global__ void k_unsign(const uint64_t* __restrict words, float pos, float neg, float* __restrict out,
                         uint64_t n, bool add) {
  for (uint64_t i = gtid(); i < n; i += gstride()) {
    float v = (words[i / 64] >> (i % 64)) & 1u ? neg : pos;
    out[i] = add ? out[i] + v : v;
  }
}

// Dense residual of a lazy state (copy_residual).
__global__ void k_settle(const float* __restrict r, const Lazy* lazy, float* __restrict out, uint64_t n) {
  Lazy lz = *lazy;
  for (uint64_t i = gtid(); i < n; i += gstride())
    out[i] = lz.lazy ? r[i] - (hd::sign_bit(r[i]) ? lz.neg : lz.pos) : r[i];
}

// --- qsgd / terngrad --------------------------------------------------------------------

struct QuantPartial {
  double sum, sumsq;
  float maxabs;
};
// Device scalars the code pass reads: scale, inv (terngrad), unit (EF).
struct QuantScal {
  float scale, inv, unit;
};

template <bool EF>
__global__ void k_moments(const float* __restrict g, float* __restrict r, float beta, uint64_t n,
                          QuantPartial* part) {
  __shared__ double sh[kThreads];
  __shared__ float shf[kThreads];
  float s = 0, q = 0, m = 0;
  for (uint64_t i = gtid(); i < n; i += gstride()) {
    float v = g[i];
    if (EF) {
      v = g[i] + beta * r[i];
      r[i] = v;
    }
    s += v;
    q += v * v;
    m = fmaxf(m, fabsf(v));
  }
  double ts = block_sum(s, sh), tq = block_sum(q, sh);
  float tm = block_max(m, shf);
  if (threadIdx.x == 0) part[blockIdx.x] = {ts, tq, tm};
}

__global__ void k_quant_finish(const QuantPartial* part, int parts, uint64_t n, bool tern,
                               uint32_t levels, uint32_t bits, uint8_t* out, HeaderArgs h,
                               QuantScal* scal) {
  if (threadIdx.x != 0) return;
  double sum = 0, sumsq = 0;
  float maxabs = 0;
  for (int i = 0; i < parts; ++i) {
    sum += part[i].sum;
    sumsq += part[i].sumsq;
    maxabs = fmaxf(maxabs, part[i].maxabs);
  }
  if (!tern) {
    float norm = static_cast<float>(sqrt(sumsq));
    float scale = norm > 0 ? static_cast<float>(levels) / norm : 0.0f;
    *scal = {scale, 0.0f, norm / static_cast<float>(levels)};
    hd::put_le(out + 32, levels, 4);
    hd::put_le(out + 36, bits, 4);
    hd::put_le(out + 40, hd::f2u(norm), 4);
  } else {
    double mean = n ? sum / static_cast<double>(n) : 0.0;
    double var = n ? fmax(0.0, sumsq / static_cast<double>(n) - mean * mean) : 0.0;
    float clip = static_cast<float>(2.5 * sqrt(var));
    float scale = clip > 0 ? fminf(maxabs, clip) : maxabs;
    float inv = scale > 0 ? 1.0f / scale : 0.0f;
    *scal = {scale, inv, scale};
    hd::put_le(out + 32, hd::f2u(scale), 4);
  }
  hd::write_header(out, h.algo, h.count, out + 32, h.params_len, h.params_padded, h.payload_len);
}

// Codes of x (the input, or p in r with EF), packed by ballots; with EF r
// becomes p - decoded.
template <bool TERN, bool EF>
__global__ void k_codes(const float* x, float* r, uint64_t n, uint64_t private_seed, uint64_t iteration,
                        uint32_t levels, uint32_t bits, const QuantScal* scal,
                        uint32_t* __restrict halves) {
  QuantScal sc = *scal;
  uint64_t padded = padded64(n);
  uint32_t lmask = (1u << (bits - 1)) - 1, shift = bits - 1;
  for (uint64_t i = gtid(); i < padded; i += gstride()) {
    uint32_t code = 0;
    if (i < n) {
      uint64_t first = i / hd::kSeedChunk * hd::kSeedChunk;
      uint32_t seed = hd::quant_chunk_seed(private_seed, iteration, TERN ? hd::kTernSalt : hd::kQsgdSalt,
                                           first);
      float u = hd::uniform01(hd::hash32(seed, static_cast<uint32_t>(i)));
      float v = x[i];
      code = TERN ? hd::tern_code(v, u, sc.scale, sc.inv) : hd::qsgd_code(v, u, sc.scale, levels, shift);
      if (EF) r[i] = v - hd::code_value(code, lmask, shift, sc.unit);
    }
    for (uint32_t j = 0; j < bits; ++j) {
      uint32_t ballot = __ballot_sync(0xffffffffu, (code >> j) & 1u);
      if ((threadIdx.x & 31) == 0) halves[hd::plane_half(i, bits, j)] = ballot;
    }
  }
}

__global__ void k_uncode(const uint64_t* __restrict words, uint64_t n, uint32_t bits, float unit,
                         float* __restrict out, bool add) {
  uint32_t lmask = (1u << (bits - 1)) - 1, shift = bits - 1;
  for (uint64_t i = gtid(); i < n; i += gstride()) {
    float v = hd::code_value(hd::plane_code(words, i, bits), lmask, shift, unit);
    out[i] = add ? out[i] + v : v;
  }
}

// --- radix select -----------------------------------------------------------------------

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

// Histogram of digit `pass` of the keys matching the prefix. With EF (first
// pass of topk), p = g + beta r is formed into r on the way.
template <bool EF>
__global__ void k_hist(const float* src, const float* g, float beta, uint64_t n, int pass,
                       const Select* sel, uint32_t* __restrict hist, Gate gate) {
  __shared__ uint32_t h[hd::kRadixMaxBuckets];
  if (gate.closed()) return;
  uint32_t nb = hd::radix_buckets(pass);
  for (uint32_t b = threadIdx.x; b < nb; b += blockDim.x) h[b] = 0;
  __syncthreads();
  uint32_t prefix = sel->prefix;
  float* rw = const_cast<float*>(src);
  for (uint64_t i = gtid(); i < n; i += gstride()) {
    float v = src[i];
    if (EF) {
      v = g[i] + beta * v;
      rw[i] = v;
    }
    uint32_t key = hd::abs_key(v);
    if (hd::radix_prefix_matches(key, prefix, pass)) atomicAdd(&h[hd::radix_digit(key, pass)], 1u);
  }
  __syncthreads();
  for (uint32_t b = threadIdx.x; b < nb; b += blockDim.x)
    if (h[b]) atomicAdd(&hist[b], h[b]);
}

// One block of 1024 threads; thread t tests buckets nb-1-2t and nb-2-2t
// (walking from the top), the winner extends the prefix. Clears the
// histogram for the next use.
__global__ void k_select(uint32_t* hist, int pass, Select* sel, Gate gate) {
  __shared__ uint32_t sh[32];
  if (gate.closed()) return;
  uint32_t nb = hd::radix_buckets(pass);
  uint32_t t = threadIdx.x;
  uint32_t b_hi = nb - 1 - 2 * t, b_lo = nb - 2 - 2 * t;
  bool own = 2 * t + 1 < nb;
  uint32_t c_hi = own ? hist[b_hi] : 0, c_lo = own ? hist[b_lo] : 0;
  // Exclusive scan over 1024 threads of c_hi + c_lo.
  uint32_t v = c_hi + c_lo, x = v;
  unsigned lane = t & 31, warp = t >> 5;
  for (int o = 1; o < 32; o <<= 1) {
    uint32_t y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= static_cast<unsigned>(o)) x += y;
  }
  if (lane == 31) sh[warp] = x;
  __syncthreads();
  if (warp == 0) {
    uint32_t w = sh[lane];
    for (int o = 1; o < 32; o <<= 1) {
      uint32_t y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= static_cast<unsigned>(o)) w += y;
    }
    sh[lane] = w;
  }
  __syncthreads();
  uint32_t above = (warp ? sh[warp - 1] : 0) + x - v;
  uint32_t need = sel->need, prefix = sel->prefix;
  __syncthreads();
  if (own) {
    uint32_t s = hd::radix_shift(pass);
    if (hd::bucket_holds_rank<uint32_t>(above, c_hi, need)) {
      sel->prefix = prefix | (b_hi << s);
      sel->need = need - above;
    } else if (hd::bucket_holds_rank<uint32_t>(above + c_hi, c_lo, need)) {
      sel->prefix = prefix | (b_lo << s);
      sel->need = need - above - c_hi;
    }
    hist[b_hi] = 0;
    hist[b_lo] = 0;
  }
}

// Per tile: keys above the threshold and keys equal to it.
__global__ void k_tile_count(const float* __restrict v, uint64_t n, const Select* sel,
                             uint32_t* __restrict gt, uint32_t* __restrict eq, Gate gate) {
  __shared__ uint32_t sh[32];
  if (gate.closed()) return;
  uint32_t T = sel->prefix;
  uint64_t base = static_cast<uint64_t>(blockIdx.x) * kTile;
  uint32_t a = 0, e = 0;
  for (uint32_t r = 0; r < kRounds; ++r) {
    uint64_t i = base + r * kThreads + threadIdx.x;
    if (i < n) {
      uint32_t key = hd::abs_key(v[i]);
      a += key > T;
      e += key == T;
    }
  }
  uint32_t ta, te;
  block_exclusive(a, sh, &ta);
  block_exclusive(e, sh, &te);
  if (threadIdx.x == 0) gt[blockIdx.x] = ta, eq[blockIdx.x] = te;
}

// One block: eq_before[t] = equal keys in earlier tiles; picks per tile =
// gt + the equal keys still needed; off[t] = picks before tile t.
__global__ void k_tile_scan(const uint32_t* gt, const uint32_t* eq, uint32_t tiles, Select* sel,
                            uint32_t* off, uint32_t* eq_before, Gate gate) {
  __shared__ uint32_t sh[32];
  if (gate.closed()) return;
  uint32_t need = sel->need;
  uint32_t carry_eq = 0, carry_off = 0;
  for (uint32_t b = 0; b < tiles; b += kThreads) {
    uint32_t t = b + threadIdx.x;
    uint32_t e = t < tiles ? eq[t] : 0, tot_e;
    uint32_t eb = carry_eq + block_exclusive(e, sh, &tot_e);
    uint32_t take = 0;
    if (t < tiles) {
      uint32_t room = need == kAll ? e : (need > eb ? need - eb : 0);
      take = gt[t] + (e < room ? e : room);
      eq_before[t] = eb;
    }
    uint32_t tot_o;
    uint32_t o = carry_off + block_exclusive(take, sh, &tot_o);
    if (t < tiles) off[t] = o;
    carry_eq += tot_e;
    carry_off += tot_o;
  }
  if (threadIdx.x == 0) sel->total = carry_off;
}

// Writes the picks of each tile in index order: indices at out_idx, values
// at out_idx + total (the sparse payload), clearing them in z1/z2.
__global__ void k_tile_write(const float* v, uint64_t n, const Select* sel, const uint32_t* off,
                             const uint32_t* eq_before, uint32_t* out_idx, float* z1, float* z2) {
  __shared__ uint32_t sh[32];
  uint32_t T = sel->prefix, need = sel->need, total = sel->total;
  float* out_val = reinterpret_cast<float*>(out_idx + total);
  uint64_t base = static_cast<uint64_t>(blockIdx.x) * kTile;
  uint32_t pos = off[blockIdx.x], eqs = eq_before[blockIdx.x];
  for (uint32_t r = 0; r < kRounds; ++r) {
    uint64_t i = base + r * kThreads + threadIdx.x;
    uint32_t key = 0;
    float x = 0;
    if (i < n) {
      x = v[i];
      key = hd::abs_key(x);
    }
    bool is_eq = i < n && key == T, is_gt = i < n && key > T;
    uint32_t eq_tot;
    uint32_t eq_rank = eqs + block_exclusive(is_eq ? 1u : 0u, sh, &eq_tot);
    bool pick = is_gt || (is_eq && (need == kAll || eq_rank < need));
    uint32_t pick_tot;
    uint32_t p = pos + block_exclusive(pick ? 1u : 0u, sh, &pick_tot);
    if (pick) {
      out_idx[p] = static_cast<uint32_t>(i);
      out_val[p] = x;
      if (z1 != nullptr) z1[i] = 0.0f;
      if (z2 != nullptr) z2[i] = 0.0f;
    }
    pos += pick_tot;
    eqs += eq_tot;
  }
}

__global__ void k_select_init(Select* sel, uint32_t need) {
  if (threadIdx.x == 0) *sel = {0, need, 0, 0};
}

// --- dgc ----------------------------------------------------------------------------------

__global__ void k_dgc_update(const float* __restrict g, float* __restrict u, float* __restrict v,
                             float m, uint64_t n, uint64_t stride, float* __restrict sample) {
  for (uint64_t i = gtid(); i < n; i += gstride()) {
    float ui = m * u[i] + g[i];
    u[i] = ui;
    float vi = v[i] + ui;
    v[i] = vi;
    if (i % stride == 0) sample[i / stride] = fabsf(vi);
  }
}

enum Phase : uint32_t { kRefine = 1, kCount = 2, kTakeAll = 3, kTrim = 4 };

struct DgcCtl {
  uint32_t phase;
  float thr;
  double rank;
};

__global__ void k_dgc_init(DgcCtl* c, Select* ss, double rank, uint64_t s) {
  if (threadIdx.x != 0) return;
  c->phase = kRefine;
  c->thr = 0.0f;
  c->rank = rank;
  double r = fmin(fmax(ceil(rank), 1.0), static_cast<double>(s));
  *ss = {0, static_cast<uint32_t>(r), 0, 0};
}

// After a sample select: the threshold (the first, or the lower of the new
// sample rank and half the old one), then count.
__global__ void k_dgc_threshold(DgcCtl* c, const Select* ss, Select* sv, bool first) {
  if (threadIdx.x != 0 || c->phase != kRefine) return;
  float next = hd::u2f(ss->prefix);
  c->thr = first ? next : (next < c->thr ? next : c->thr * 0.5f);
  *sv = {hd::abs_key(c->thr), kAll, 0, 0};
  c->phase = kCount;
}

// The CPU library's decision after a collect (sparse.cc, Dgc::select).
__global__ void k_dgc_decide(DgcCtl* c, Select* ss, Select* sv, uint32_t attempt, uint32_t refine,
                             uint64_t k, uint64_t s) {
  if (threadIdx.x != 0 || c->phase != kCount) return;
  uint64_t got = sv->total;
  if (got * 10 > k * 13) {
    c->phase = kTrim;
    *sv = {0, static_cast<uint32_t>(k), 0, 0};
  } else if (got * 10 >= k * 7 || attempt >= refine || c->thr <= 0.0f) {
    c->phase = kTakeAll;
  } else {
    c->rank *= static_cast<double>(k) / static_cast<double>(got > 1 ? got : 1);
    double r = fmin(fmax(ceil(c->rank), 1.0), static_cast<double>(s));
    *ss = {0, static_cast<uint32_t>(r), 0, 0};
    c->phase = kRefine;
  }
}

// --- sparse decode ---------------------------------------------------------------------------

// Checks the index list of a sparse buffer of `size` bytes before anything
// is decoded: *bad gets the lowest failing position (or stays ~0). Reads only
// inside the buffer whatever its header says; the host rejects bad headers.
__global__ void k_check_sparse(const uint8_t* buf, uint64_t size, unsigned long long* bad) {
  if (size < 40) return;
  uint32_t plen = *reinterpret_cast<const uint32_t*>(buf + 8);
  uint64_t count = *reinterpret_cast<const uint64_t*>(buf + 16);
  uint64_t k = *reinterpret_cast<const uint64_t*>(buf + 32);
  if (plen != 8 || k > (size - 40) / 8 || 40 + 8 * k != size) return;
  const uint32_t* idx = reinterpret_cast<const uint32_t*>(buf + 40);
  for (uint64_t j = gtid(); j < k; j += gstride())
    if (idx[j] >= count || (j > 0 && idx[j] <= idx[j - 1])) atomicMin(bad, static_cast<unsigned long long>(j));
}

__global__ void k_sparse_scatter(const uint32_t* __restrict idx, const float* __restrict val,
                                 uint64_t k, float* __restrict out) {
  for (uint64_t j = gtid(); j < k; j += gstride()) out[idx[j]] += val[j];
}

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
  void copy_residual(std::span<float> out) const override {
    if (!has_residual()) TensorState::copy_residual(out);
    if (out.size() != n_)
      throw Error(ErrorCode::kInvalidArgument, "copy_residual: out has " + std::to_string(out.size()) +
                                                   " elements, state has " + std::to_string(n_));
    if (n_ == 0) return;
    DeviceGuard dg(device_);
    ck(cudaDeviceSynchronize(), "copy_residual");  // the last compress() may be on any stream
    const DevBuf& src = v.bytes() ? v : r;
    if (lazy.bytes()) {
      DevBuf tmp(n_ * sizeof(float));
      k_settle<<<grid_for(n_), kThreads>>>(src.as<float>(), lazy.as<Lazy>(), tmp.as<float>(), n_);
      ck_launch("settle");
      ck(cudaMemcpy(out.data(), tmp.as<void>(), n_ * sizeof(float), cudaMemcpyDeviceToHost), "copy_residual");
    } else {
      ck(cudaMemcpy(out.data(), src.as<void>(), n_ * sizeof(float), cudaMemcpyDeviceToHost), "copy_residual");
    }
  }

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
                  const CompressContext& ctx) const override {
    check_view("compress", in.device, in.dtype);
    auto* st = dynamic_cast<CudaState*>(&state);
    if (st == nullptr || st->owner_ != name())
      throw Error(ErrorCode::kInvalidArgument,
                  "compress: the state passed was not made by cuda compressor '" + name() +
                      "' (use its make_state())");
    size_t n = in.count;
    if (st->count() != n)
      throw Error(ErrorCode::kInvalidArgument, "compress: state was made for " +
                                                   std::to_string(st->count()) + " elements, tensor has " +
                                                   std::to_string(n));
    size_t need = max_compressed_bytes(n);
    if (out.size() < need)
      throw Error(ErrorCode::kInvalidArgument,
                  "compress: output buffer of " + std::to_string(out.size()) + " bytes, '" + name() +
                      "' needs max_compressed_bytes(" + std::to_string(n) + ") = " + std::to_string(need));
    if (reinterpret_cast<uintptr_t>(out.data()) % 8 != 0)
      throw Error(ErrorCode::kInvalidArgument, "compress: output buffer must be 8-byte aligned");
    if (n > 0 && in.data == nullptr) throw Error(ErrorCode::kInvalidArgument, "compress: null input");
    if (n > 0 && reinterpret_cast<uintptr_t>(in.data) % 4 != 0)
      throw Error(ErrorCode::kInvalidArgument, "compress: input must be 4-byte aligned");
    int dev = device_of(out.data(), "compress: output buffer");
    if (n > 0 && device_of(in.data, "compress: input tensor") != dev)
      throw Error(ErrorCode::kInvalidArgument, "compress: input and output are on different GPUs");
    if (dev != st->device_)
      throw Error(ErrorCode::kInvalidArgument, "compress: the state lives on GPU " +
                                                   std::to_string(st->device_) + ", the buffers on GPU " +
                                                   std::to_string(dev));
    DeviceGuard dg(dev);
    return encode(static_cast<const float*>(in.data), n, out.data(), *st, ctx,
                  static_cast<cudaStream_t>(in.stream));
  }

  void decompress(std::span<const std::byte> in, TensorView out, bool accumulate,
                  const CompressContext&) const override {
    check_view("decompress", out.device, out.dtype);
    if (out.data == nullptr && out.count != 0)
      throw Error(ErrorCode::kInvalidArgument, "decompress: null output");
    if (in.empty()) malformed("0 bytes is shorter than the 32-byte header");
    if (reinterpret_cast<uintptr_t>(in.data()) % 8 != 0)
      throw Error(ErrorCode::kInvalidArgument,
                  "decompress: a device buffer must be 8-byte aligned (as compress() writes it)");
    int dev = device_of(in.data(), "decompress: compressed buffer");
    if (out.count > 0 && device_of(out.data, "decompress: output tensor") != dev)
      throw Error(ErrorCode::kInvalidArgument, "decompress: buffer and output are on different GPUs");
    DeviceGuard dg(dev);
    auto s = static_cast<cudaStream_t>(out.stream);
    std::unique_ptr<Scratch> sc = take_scratch();
    struct Back {  // returns the scratch even when validation throws
      const CudaCompressor* c;
      std::unique_ptr<Scratch>& s;
      ~Back() { c->give_scratch(std::move(s)); }
    } back{this, sc};
    bool sparse = algo_ == Algo::kTopK || algo_ == Algo::kDgc;
    auto* bad_host = reinterpret_cast<unsigned long long*>(sc->host.as<std::byte>() + detail::kMaxHeadBytes);
    if (sparse) {
      ck(cudaMemsetAsync(sc->bad.as<void>(), 0xff, 8, s), "decompress");
      k_check_sparse<<<grid_for(in.size() / 8, 4096), kThreads, 0, s>>>(
          reinterpret_cast<const uint8_t*>(in.data()), in.size(), sc->bad.as<unsigned long long>());
      ck_launch("index check");
      ck(cudaMemcpyAsync(bad_host, sc->bad.as<void>(), 8, cudaMemcpyDeviceToHost, s), "decompress");
    }
    size_t head = std::min(in.size(), detail::kMaxHeadBytes);
    ck(cudaMemcpyAsync(sc->host.as<void>(), in.data(), head, cudaMemcpyDeviceToHost, s), "decompress");
    ck(cudaStreamSynchronize(s), "decompress: reading the header");
    detail::Parsed p = detail::parse_wire_head({sc->host.as<std::byte>(), head}, in.size());
    if (p.algo != algo_)
      malformed(std::string("buffer holds '") + detail::algo_name(p.algo) +
                "' data, this compressor decodes '" + detail::algo_name(algo_) + "'");
    if (p.count != out.count)
      malformed("buffer holds " + std::to_string(p.count) + " elements, output has " +
                std::to_string(out.count));
    const std::byte* payload = in.data() + kHeaderBytes + p.params.size();
    decode(p, payload, sparse ? *bad_host : ~0ull, static_cast<float*>(out.data), accumulate, s);
  }

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
                cudaStream_t s) const {
    auto* o8 = reinterpret_cast<uint8_t*>(out);
    switch (algo_) {
      case Algo::kFp16:
      case Algo::kBf16: {
        auto* h = reinterpret_cast<uint16_t*>(out + kHeaderBytes);
        bool bf = algo_ == Algo::kBf16;
        float* r = st.r.as<float>();
        if (n) {
          if (bf && ef_) k_cast<true, true><<<grid_for(n), kThreads, 0, s>>>(x, r, beta_, h, n);
          else if (bf) k_cast<true, false><<<grid_for(n), kThreads, 0, s>>>(x, r, beta_, h, n);
          else if (ef_) k_cast<false, true><<<grid_for(n), kThreads, 0, s>>>(x, r, beta_, h, n);
          else k_cast<false, false><<<grid_for(n), kThreads, 0, s>>>(x, r, beta_, h, n);
          ck_launch("cast kernel");
        }
        launch_header(out, header_args(algo_, n, 0, 2 * n), s);
        return kHeaderBytes + 2 * n;
      }
      case Algo::kRandomK: {
        uint64_t seed = hd::randomk_seed(ctx.shared_seed, ctx.iteration), k = hd::sparse_k(n, ratio_);
        auto* vals = reinterpret_cast<float*>(out + kHeaderBytes + 16);
        if (n) {
          const float* src = x;
          if (ef_) {
            k_add_scaled<<<grid_for(n), kThreads, 0, s>>>(x, st.r.as<float>(), beta_, n);
            ck_launch("randomk ef");
            src = st.r.as<float>();
          }
          k_randomk_gather<<<grid_for(k), kThreads, 0, s>>>(src, ef_ ? st.r.as<float>() : nullptr, vals,
                                                            seed, n, k);
          ck_launch("randomk gather");
        }
        HeaderArgs h = header_args(algo_, n, 16, 4 * k);
        hd::put_le(h.params, seed, 8);
        hd::put_le(h.params + 8, k, 8);
        launch_header(out, h, s);
        return kHeaderBytes + 16 + 4 * k;
      }
      case Algo::kSignSgd:
      case Algo::kSignum:
      case Algo::kEfSignSgd:
      case Algo::kOneBit: {
        uint32_t pb = algo_ == Algo::kEfSignSgd ? 4 : algo_ == Algo::kOneBit ? 8 : 0;
        auto* words = reinterpret_cast<uint32_t*>(out + kHeaderBytes + pad8(pb));
        float* stv = ef_ ? st.r.as<float>() : st.m.as<float>();
        Lazy* lz = st.lazy.as<Lazy>();
        auto* part = st.part.as<SignPartial>();
        unsigned grid = grid_for(padded64(n), kStatBlocks);
        if (n) {
#define BC_SIGN(V, E) k_sign<V, E><<<grid, kThreads, 0, s>>>(x, stv, beta_, momentum_, lz, words, part, n)
          switch (algo_) {
            case Algo::kSignSgd:
              if (ef_) BC_SIGN(SignVar::kSign, true);
              else BC_SIGN(SignVar::kSign, false);
              break;
            case Algo::kSignum: BC_SIGN(SignVar::kSignum, false); break;
            case Algo::kEfSignSgd: BC_SIGN(SignVar::kScaled, true); break;
            default: BC_SIGN(SignVar::kOneBit, true); break;
          }
#undef BC_SIGN
          ck_launch("sign kernel");
        }
        uint64_t payload = (n + 63) / 64 * 8;
        HeaderArgs h = header_args(algo_, n, pb, payload);
        int parts = n ? static_cast<int>(grid) : 0;
        Lazy* lzw = ef_ ? lz : nullptr;
        if (algo_ == Algo::kEfSignSgd) k_sign_finish<SignVar::kScaled><<<1, 32, 0, s>>>(part, parts, n, o8, h, lzw);
        else if (algo_ == Algo::kOneBit) k_sign_finish<SignVar::kOneBit><<<1, 32, 0, s>>>(part, parts, n, o8, h, lzw);
        else k_sign_finish<SignVar::kSign><<<1, 32, 0, s>>>(part, parts, n, o8, h, lzw);
        ck_launch("sign finish");
        return kHeaderBytes + pad8(pb) + payload;
      }
      case Algo::kQsgd:
      case Algo::kTernGrad: {
        bool tern = algo_ == Algo::kTernGrad;
        uint32_t bits = tern ? 2 : bits_, plen = tern ? 4 : 12;
        uint64_t payload = hd::plane_words(n, bits) * 8;
        auto* halves = reinterpret_cast<uint32_t*>(out + kHeaderBytes + pad8(plen));
        auto* part = st.part.as<QuantPartial>();
        auto* scal = st.scal.as<QuantScal>();
        float* r = st.r.as<float>();
        unsigned sgrid = grid_for(n, kStatBlocks);
        if (n) {
          if (ef_) k_moments<true><<<sgrid, kThreads, 0, s>>>(x, r, beta_, n, part);
          else k_moments<false><<<sgrid, kThreads, 0, s>>>(x, r, beta_, n, part);
          ck_launch("moments kernel");
        }
        k_quant_finish<<<1, 32, 0, s>>>(part, n ? static_cast<int>(sgrid) : 0, n, tern, levels_, bits, o8,
                                        header_args(algo_, n, plen, payload), scal);
        ck_launch("quant finish");
        if (n) {
          const float* src = ef_ ? r : x;
          unsigned cgrid = grid_for(padded64(n));
#define BC_CODES(T, E) \
  k_codes<T, E><<<cgrid, kThreads, 0, s>>>(src, r, n, ctx.private_seed, ctx.iteration, levels_, bits, scal, halves)
          if (tern && ef_) BC_CODES(true, true);
          else if (tern) BC_CODES(true, false);
          else if (ef_) BC_CODES(false, true);
          else BC_CODES(false, false);
#undef BC_CODES
          ck_launch("codes kernel");
        }
        return kHeaderBytes + pad8(plen) + payload;
      }
      case Algo::kTopK: return encode_topk(x, n, out, st, s);
      case Algo::kDgc: return encode_dgc(x, n, out, st, ctx, s);
    }
    throw Error(ErrorCode::kInternal, "cuda compressor: unknown algorithm");
  }

  // Three histogram passes and selects over v[0, n) for sel's need; the
  // first pass forms p = g + beta r into v when g is given.
  void radix(const float* v, const float* g, uint64_t n, CudaState& st, Select* sel, Gate gate,
             cudaStream_t s) const {
    for (int pass = 0; pass < hd::kRadixPasses; ++pass) {
      if (pass == 0 && g != nullptr)
        k_hist<true><<<grid_for(n, 2048), kThreads, 0, s>>>(v, g, beta_, n, pass, sel, st.hist.as<uint32_t>(), gate);
      else
        k_hist<false><<<grid_for(n, 2048), kThreads, 0, s>>>(v, g, beta_, n, pass, sel, st.hist.as<uint32_t>(), gate);
      ck_launch("radix histogram");
      k_select<<<1, 1024, 0, s>>>(st.hist.as<uint32_t>(), pass, sel, gate);
      ck_launch("radix select");
    }
  }

  void tile_counts(const float* v, uint64_t n, CudaState& st, Select* sel, Gate gate, cudaStream_t s) const {
    uint32_t t = static_cast<uint32_t>(tiles(n));
    uint32_t* tl = st.tiles.as<uint32_t>();
    k_tile_count<<<t, kThreads, 0, s>>>(v, n, sel, tl, tl + t, gate);
    ck_launch("tile count");
    k_tile_scan<<<1, kThreads, 0, s>>>(tl, tl + t, t, sel, tl + 2 * t, tl + 3 * t, gate);
    ck_launch("tile scan");
  }

  void tile_write(const float* v, uint64_t n, CudaState& st, Select* sel, std::byte* out, float* z1,
                  float* z2, cudaStream_t s) const {
    uint32_t t = static_cast<uint32_t>(tiles(n));
    uint32_t* tl = st.tiles.as<uint32_t>();
    k_tile_write<<<t, kThreads, 0, s>>>(v, n, sel, tl + 2 * t, tl + 3 * t,
                                        reinterpret_cast<uint32_t*>(out + kHeaderBytes + 8), z1, z2);
    ck_launch("tile write");
  }

  size_t encode_topk(const float* x, size_t n, std::byte* out, CudaState& st, cudaStream_t s) const {
    uint64_t k = hd::sparse_k(n, ratio_);
    if (n) {
      auto* sel = st.sel.as<Select>();
      const float* v = ef_ ? st.r.as<float>() : x;
      k_select_init<<<1, 32, 0, s>>>(sel, static_cast<uint32_t>(k));
      ck_launch("select init");
      radix(v, ef_ ? x : nullptr, n, st, sel, Gate{nullptr, 0}, s);
      tile_counts(v, n, st, sel, Gate{nullptr, 0}, s);
      tile_write(v, n, st, sel, out, ef_ ? st.r.as<float>() : nullptr, nullptr, s);
    }
    HeaderArgs h = header_args(algo_, n, 8, 8 * k);
    hd::put_le(h.params, k, 8);
    launch_header(out, h, s);
    return kHeaderBytes + 8 + 8 * k;
  }

  size_t encode_dgc(const float* g, size_t n, std::byte* out, CudaState& st, const CompressContext& ctx,
                    cudaStream_t s) const {
    uint64_t k = hd::sparse_k(n, hd::dgc_ratio_at(ratio_, warmup_, ctx.iteration));
    if (n == 0) {
      HeaderArgs h = header_args(algo_, 0, 8, 0);
      launch_header(out, h, s);
      return kHeaderBytes + 8;
    }
    float* u = st.u.as<float>();
    float* v = st.v.as<float>();
    float* sample = st.sample.as<float>();
    uint64_t ns = (n + stride_ - 1) / stride_;
    auto* ctl = st.ctl.as<DgcCtl>();
    auto* ss = st.sel_sample.as<Select>();
    auto* sv = st.sel.as<Select>();
    const uint32_t* phase = &ctl->phase;
    k_dgc_update<<<grid_for(n), kThreads, 0, s>>>(g, u, v, momentum_, n, stride_, sample);
    ck_launch("dgc update");
    double rank = static_cast<double>(ns) * static_cast<double>(k) / static_cast<double>(n);
    k_dgc_init<<<1, 32, 0, s>>>(ctl, ss, rank, ns);
    ck_launch("dgc init");
    for (uint32_t attempt = 0; attempt <= refine_; ++attempt) {
      radix(sample, nullptr, ns, st, ss, Gate{phase, kRefine}, s);
      k_dgc_threshold<<<1, 32, 0, s>>>(ctl, ss, sv, attempt == 0);
      ck_launch("dgc threshold");
      tile_counts(v, n, st, sv, Gate{phase, kCount}, s);
      k_dgc_decide<<<1, 32, 0, s>>>(ctl, ss, sv, attempt, refine_, k, ns);
      ck_launch("dgc decide");
    }
    radix(v, nullptr, n, st, sv, Gate{phase, kTrim}, s);
    tile_counts(v, n, st, sv, Gate{phase, kTrim}, s);
    tile_write(v, n, st, sv, out, v, u, s);
    HeaderArgs h = header_args(algo_, n, 8, 0);
    h.k_dev = &sv->total;
    launch_header(out, h, s);
    // The one host read of the call: how many were picked.
    auto* host = st.count_host->as<Select>();
    ck(cudaMemcpyAsync(host, sv, sizeof(Select), cudaMemcpyDeviceToHost, s), "dgc count");
    ck(cudaStreamSynchronize(s), "dgc count");
    return kHeaderBytes + 8 + 8 * static_cast<uint64_t>(host->total);
  }

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
              bool add, cudaStream_t s) const {
    uint64_t n = p.count;
    std::string elems = std::to_string(n) + " elements";
    switch (algo_) {
      case Algo::kFp16:
      case Algo::kBf16: {
        expect_params(p, 0);
        expect_payload(p, 2 * n, elems);
        if (!n) return;
        auto* h = reinterpret_cast<const uint16_t*>(payload);
        if (algo_ == Algo::kBf16) k_uncast<true><<<grid_for(n), kThreads, 0, s>>>(h, out, n, add);
        else k_uncast<false><<<grid_for(n), kThreads, 0, s>>>(h, out, n, add);
        ck_launch("uncast kernel");
        return;
      }
      case Algo::kRandomK: {
        expect_params(p, 16);
        uint64_t seed = param<uint64_t>(p, 0), k = param<uint64_t>(p, 8);
        if (k > n || (k == 0 && n != 0))
          malformed("randomk k = " + std::to_string(k) + " for " + elems + " (accepted: 1..count)");
        expect_payload(p, 4 * k, "k = " + std::to_string(k));
        if (!n) return;
        if (!add) ck(cudaMemsetAsync(out, 0, n * sizeof(float), s), "randomk decode");
        k_randomk_scatter<<<grid_for(k), kThreads, 0, s>>>(reinterpret_cast<const float*>(payload), out, seed,
                                                           n, k, add);
        ck_launch("randomk scatter");
        return;
      }
      case Algo::kTopK:
      case Algo::kDgc: {
        const char* a = detail::algo_name(algo_);
        expect_params(p, 8);
        uint64_t k = param<uint64_t>(p, 0);
        if (k > n) malformed(std::string(a) + " sends " + std::to_string(k) + " elements of " + std::to_string(n));
        expect_payload(p, 8 * k, "k = " + std::to_string(k));
        if (bad != ~0ull)
          malformed(std::string(a) + " index #" + std::to_string(bad) +
                    " is out of range or not above the previous index");
        if (!n) return;
        if (!add) ck(cudaMemsetAsync(out, 0, n * sizeof(float), s), "sparse decode");
        if (k) {
          auto* idx = reinterpret_cast<const uint32_t*>(payload);
          k_sparse_scatter<<<grid_for(k), kThreads, 0, s>>>(idx, reinterpret_cast<const float*>(idx + k), k, out);
          ck_launch("sparse scatter");
        }
        return;
      }
      case Algo::kSignSgd:
      case Algo::kSignum:
      case Algo::kEfSignSgd:
      case Algo::kOneBit: {
        size_t pb = algo_ == Algo::kEfSignSgd ? 4 : algo_ == Algo::kOneBit ? 8 : 0;
        expect_params(p, pb);
        float pos = 1.0f, neg = -1.0f;
        if (algo_ == Algo::kEfSignSgd) pos = param<float>(p, 0), neg = -pos;
        if (algo_ == Algo::kOneBit) pos = param<float>(p, 0), neg = param<float>(p, 4);
        expect_payload(p, (n + 63) / 64 * 8, elems);
        if (!n) return;
        k_unsign<<<grid_for(n), kThreads, 0, s>>>(reinterpret_cast<const uint64_t*>(payload), pos, neg, out, n, add);
        ck_launch("unsign kernel");
        return;
      }
      case Algo::kQsgd:
      case Algo::kTernGrad: {
        uint32_t bits = 2;
        float unit;
        if (algo_ == Algo::kQsgd) {
          expect_params(p, 12);
          uint32_t levels = param<uint32_t>(p, 0);
          bits = param<uint32_t>(p, 4);
          if (levels < 1 || levels > 127 || bits != 1 + static_cast<uint32_t>(std::bit_width(levels)))
            malformed("qsgd levels " + std::to_string(levels) + " with " + std::to_string(bits) +
                      " bits per element (accepted: levels 1..127, bits = 1 + bit width of levels)");
          unit = param<float>(p, 8) / static_cast<float>(levels);
        } else {
          expect_params(p, 4);
          unit = param<float>(p, 0);
        }
        expect_payload(p, hd::plane_words(n, bits) * 8, elems);
        if (!n) return;
        k_uncode<<<grid_for(n), kThreads, 0, s>>>(reinterpret_cast<const uint64_t*>(payload), n, bits, unit, out,
                                                  add);
        ck_launch("uncode kernel");
        return;
      }
    }
  }

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

const char* const kNames[] = {"fp16",   "bf16",      "randomk", "topk", "dgc",     "signsgd",
                              "signum", "efsignsgd", "onebit",  "qsgd", "terngrad"};

}  // namespace

bool built() noexcept { return true; }

bool supported(std::string_view name) noexcept {
  for (const char* n : kNames)
    if (name == n) return true;
  return false;
}

std::unique_ptr<Compressor> make_compressor(const CompressorSpec& canonical, const ParamValues& values) {
  if (!supported(canonical.name))
    throw Error(ErrorCode::kInvalidArgument, "compressor '" + canonical.name + "' has no CUDA kernels");
  return std::make_unique<CudaCompressor>(canonical, values);
}

AllocStats alloc_stats() noexcept {
  return {g_dev_allocs.load(), g_dev_frees.load(), g_host_allocs.load(), g_host_frees.load(),
          g_dev_live.load(), g_host_live.load()};
}

}  // namespace bytecomp::compress::cuda
