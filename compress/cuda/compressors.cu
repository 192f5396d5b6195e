// CUDA kernels of every compressor, writing and reading the CPU library's
// wire format (compress/internal.h); per-element logic from compress/hd.h.
// Three translation units since issue 27 (this one: the class's validation
// and dispatch; dense.cu and sparse.cu: the kernel families), sharing
// compress/cuda/internal.cuh.
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
#include "compress/cuda/internal.cuh"

namespace bytecomp::compress::cuda::impl {

std::atomic<uint64_t> g_dev_allocs{0}, g_dev_frees{0}, g_host_allocs{0}, g_host_frees{0};
std::atomic<int64_t> g_dev_live{0}, g_host_live{0};

[[noreturn]] void fail(cudaError_t e, const std::string& what) {
  cudaGetLastError();  // clear a sticky launch error for the next caller
  ErrorCode code = e == cudaErrorMemoryAllocation ? ErrorCode::kResourceExhausted
                                                  : ErrorCode::kUnavailable;
  throw Error(code, "cuda compressor: " + what + ": " + cudaGetErrorString(e));
}

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

namespace {

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

}  // namespace

void launch_header(std::byte* out, const HeaderArgs& a, cudaStream_t s) {
  k_header<<<1, 32, 0, s>>>(reinterpret_cast<uint8_t*>(out), a);
  ck_launch("header kernel");
}

size_t CudaCompressor::compress(ConstTensorView in, std::span<std::byte> out, TensorState& state,
                                const CompressContext& ctx) const {
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

void CudaCompressor::decompress(std::span<const std::byte> in, TensorView out, bool accumulate,
                                const CompressContext&) const {
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
    launch_check_sparse(in.data(), in.size(), sc->bad.as<unsigned long long>(), s);
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

}  // namespace bytecomp::compress::cuda::impl

namespace bytecomp::compress::cuda {
namespace {

using impl::CudaCompressor;

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
  using namespace impl;
  return {g_dev_allocs.load(), g_dev_frees.load(), g_host_allocs.load(), g_host_frees.load(),
          g_dev_live.load(), g_host_live.load()};
}

}  // namespace bytecomp::compress::cuda
