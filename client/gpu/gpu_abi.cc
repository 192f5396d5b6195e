// libbytecomp_gpu: the C ABI of client/include/bytecomp/bytecomp_gpu.h over
// the CUDA compressors (compress/cuda/). Built with or without CUDA: without
// it, create() reports BYTECOMP_ERR_UNSUPPORTED with the reason, so callers
// and host tests take the same path everywhere.
#include <exception>
#include <memory>
#include <string>

#include "bytecomp/bytecomp_gpu.h"
#include "common/error.h"
#include "common/gpu.h"
#include "compress/compressor.h"
#include "compress/cuda/cuda.h"
#include "planner/strategy/partition.h"

namespace {

thread_local std::string g_last_error;

bytecomp_status fail(bytecomp_status s, std::string msg) {
  g_last_error = std::move(msg);
  return s;
}

bytecomp_status from_error(const bytecomp::Error& e) {
  using bytecomp::ErrorCode;
  switch (e.code()) {
    case ErrorCode::kInvalidArgument: return fail(BYTECOMP_ERR_INVALID_ARGUMENT, e.what());
    case ErrorCode::kMalformed: return fail(BYTECOMP_ERR_PROTOCOL, e.what());
    case ErrorCode::kResourceExhausted: return fail(BYTECOMP_ERR_RESOURCE_EXHAUSTED, e.what());
    case ErrorCode::kUnavailable: return fail(BYTECOMP_ERR_UNAVAILABLE, e.what());
    default: return fail(BYTECOMP_ERR_INTERNAL, e.what());
  }
}

template <class F>
bytecomp_status guarded(F&& f) {
  try {
    g_last_error.clear();
    return f();
  } catch (const bytecomp::Error& e) {
    return from_error(e);
  } catch (const std::exception& e) {
    return fail(BYTECOMP_ERR_INTERNAL, e.what());
  }
}

}  // namespace

namespace bytecomp::client_gpu {
// For nccl_group.cc: the same thread's last error.
bytecomp_status set_error(bytecomp_status s, std::string msg) { return fail(s, std::move(msg)); }
}  // namespace bytecomp::client_gpu

struct bytecomp_gpu_compressor {
  std::unique_ptr<bytecomp::compress::Compressor> impl;
  std::unique_ptr<bytecomp::compress::TensorState> state;
  uint64_t count = 0;
  // kCuda; kCpu for bytecomp_gpu_compressor_create_host (the host stand-in).
  bytecomp::Device device = bytecomp::Device::kCuda;
};

extern "C" {

int bytecomp_gpu_built(int* out_devices) {
  if (out_devices) *out_devices = bytecomp::gpu::device_count();
  return bytecomp::compress::cuda::built() ? 1 : 0;
}

int bytecomp_gpu_supported(const char* name) {
  return name && bytecomp::compress::cuda::supported(name) ? 1 : 0;
}

bytecomp_status bytecomp_gpu_compressor_create(const char* spec, uint64_t count,
                                               bytecomp_gpu_compressor** out) {
  return guarded([&]() -> bytecomp_status {
    if (!spec || !out) return fail(BYTECOMP_ERR_INVALID_ARGUMENT, "bytecomp_gpu_compressor_create: null argument");
    *out = nullptr;
    if (count == 0) return fail(BYTECOMP_ERR_INVALID_ARGUMENT, "bytecomp_gpu_compressor_create: count is 0");
    auto parsed = bytecomp::compress::parse_compressor_spec(spec);
    if (!bytecomp::compress::cuda::built())
      return fail(BYTECOMP_ERR_UNSUPPORTED,
                  "compressor '" + std::string(spec) +
                      "' on the GPU: this libbytecomp_gpu was built without CUDA (configure with "
                      "-Dcuda=enabled)");
    if (!bytecomp::compress::cuda::supported(parsed.name))
      return fail(BYTECOMP_ERR_UNSUPPORTED,
                  "compressor '" + parsed.name + "' has no CUDA kernels in this build");
    if (bytecomp::gpu::device_count() == 0)
      return fail(BYTECOMP_ERR_UNSUPPORTED,
                  "compressor '" + std::string(spec) + "' on the GPU: no CUDA device (" +
                      bytecomp::gpu::describe() + ")");
    auto c = std::make_unique<bytecomp_gpu_compressor>();
    c->impl = bytecomp::compress::make_compressor(parsed, bytecomp::Device::kCuda);
    c->state = c->impl->make_state(count);
    c->count = count;
    *out = c.release();
    return BYTECOMP_OK;
  });
}

bytecomp_status bytecomp_gpu_compressor_create_host(const char* spec, uint64_t count,
                                                    bytecomp_gpu_compressor** out) {
  return guarded([&]() -> bytecomp_status {
    if (!spec || !out)
      return fail(BYTECOMP_ERR_INVALID_ARGUMENT, "bytecomp_gpu_compressor_create_host: null argument");
    *out = nullptr;
    if (count == 0)
      return fail(BYTECOMP_ERR_INVALID_ARGUMENT, "bytecomp_gpu_compressor_create_host: count is 0");
    auto parsed = bytecomp::compress::parse_compressor_spec(spec);
    auto c = std::make_unique<bytecomp_gpu_compressor>();
    c->impl = bytecomp::compress::make_compressor(parsed, bytecomp::Device::kCpu);
    c->state = c->impl->make_state(count);
    c->count = count;
    c->device = bytecomp::Device::kCpu;
    *out = c.release();
    return BYTECOMP_OK;
  });
}

uint64_t bytecomp_gpu_partition_seed(const char* job, uint32_t tensor_id, uint32_t partition) {
  return bytecomp::strategy::partition_seed(job ? job : "",
                                            bytecomp::strategy::partition_key(tensor_id, partition));
}

bytecomp_status bytecomp_gpu_max_compressed_bytes(bytecomp_gpu_compressor* c, uint64_t* out_bytes) {
  if (!c || !out_bytes) return fail(BYTECOMP_ERR_INVALID_ARGUMENT, "bytecomp_gpu_max_compressed_bytes: null argument");
  *out_bytes = c->impl->max_compressed_bytes(c->count);
  return BYTECOMP_OK;
}

bytecomp_status bytecomp_gpu_compress(bytecomp_gpu_compressor* c, const float* device_in,
                                      void* device_out, uint64_t out_capacity, uint64_t iteration,
                                      uint64_t shared_seed, void* stream, uint64_t* out_bytes) {
  return guarded([&]() -> bytecomp_status {
    if (!c || !device_in || !device_out || !out_bytes)
      return fail(BYTECOMP_ERR_INVALID_ARGUMENT, "bytecomp_gpu_compress: null argument");
    const uint64_t need = c->impl->max_compressed_bytes(c->count);
    if (out_capacity < need)
      return fail(BYTECOMP_ERR_INVALID_ARGUMENT,
                  "bytecomp_gpu_compress: output holds " + std::to_string(out_capacity) +
                      " bytes, " + c->impl->name() + " of " + std::to_string(c->count) +
                      " elements needs up to " + std::to_string(need));
    bytecomp::compress::ConstTensorView in(device_in, c->count, bytecomp::DType::kFloat32,
                                           c->device,
                                           c->device == bytecomp::Device::kCuda ? stream : nullptr);
    bytecomp::compress::CompressContext ctx;
    ctx.iteration = iteration;
    ctx.shared_seed = shared_seed;
    *out_bytes = c->impl->compress(
        in, {static_cast<std::byte*>(device_out), static_cast<size_t>(out_capacity)}, *c->state, ctx);
    return BYTECOMP_OK;
  });
}

bytecomp_status bytecomp_gpu_decompress(bytecomp_gpu_compressor* c, const void* device_in,
                                        uint64_t in_bytes, float* device_out, int accumulate,
                                        uint64_t iteration, uint64_t shared_seed, void* stream) {
  return guarded([&]() -> bytecomp_status {
    if (!c || !device_in || !device_out)
      return fail(BYTECOMP_ERR_INVALID_ARGUMENT, "bytecomp_gpu_decompress: null argument");
    bytecomp::compress::TensorView out{device_out, static_cast<size_t>(c->count),
                                       bytecomp::DType::kFloat32, c->device,
                                       c->device == bytecomp::Device::kCuda ? stream : nullptr};
    bytecomp::compress::CompressContext ctx;
    ctx.iteration = iteration;
    ctx.shared_seed = shared_seed;
    c->impl->decompress({static_cast<const std::byte*>(device_in), static_cast<size_t>(in_bytes)},
                        out, accumulate != 0, ctx);
    return BYTECOMP_OK;
  });
}

void bytecomp_gpu_compressor_destroy(bytecomp_gpu_compressor* c) { delete c; }

const char* bytecomp_gpu_last_error(void) { return g_last_error.c_str(); }

}  // extern "C"
