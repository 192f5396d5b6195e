// libbytecomp_gpu's C ABI (issue 27): argument checks and the clean refusal
// without CUDA or a GPU run everywhere; on a GPU, buffers compressed through
// the ABI decompress with the CPU library (and the other way round) to the
// same values: the wire format is shared, so mixed GPU/CPU placements
// interoperate.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "bytecomp/bytecomp_gpu.h"
#include "bytecomp_build_config.h"
#include "compress/compressor.h"

#if BYTECOMP_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace {

TEST(GpuAbi, NullAndBadArgumentsAreRefused) {
  bytecomp_gpu_compressor* c = nullptr;
  EXPECT_EQ(bytecomp_gpu_compressor_create(nullptr, 10, &c), BYTECOMP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bytecomp_gpu_compressor_create("fp16", 10, nullptr), BYTECOMP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bytecomp_gpu_compressor_create("fp16", 0, &c), BYTECOMP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bytecomp_gpu_compressor_create("nosuch", 10, &c), BYTECOMP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(bytecomp_gpu_last_error()).find("nosuch"), std::string::npos)
      << bytecomp_gpu_last_error();
  EXPECT_EQ(bytecomp_gpu_compressor_create("topk:2", 10, &c), BYTECOMP_ERR_INVALID_ARGUMENT);
  uint64_t n = 0;
  EXPECT_EQ(bytecomp_gpu_max_compressed_bytes(nullptr, &n), BYTECOMP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bytecomp_gpu_compress(nullptr, nullptr, nullptr, 0, 0, 0, nullptr, &n),
            BYTECOMP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bytecomp_gpu_decompress(nullptr, nullptr, 0, nullptr, 0, 0, 0, nullptr),
            BYTECOMP_ERR_INVALID_ARGUMENT);
  bytecomp_gpu_compressor_destroy(nullptr);
}

TEST(GpuAbi, BuildAndSupportAreReported) {
  int devices = -1;
  const int built = bytecomp_gpu_built(&devices);
  EXPECT_EQ(built, BYTECOMP_HAVE_CUDA ? 1 : 0);
  EXPECT_GE(devices, 0);
  EXPECT_EQ(bytecomp_gpu_supported("efsignsgd"), built);
  EXPECT_EQ(bytecomp_gpu_supported("topk"), built);
  EXPECT_EQ(bytecomp_gpu_supported("nosuch"), 0);
  EXPECT_EQ(bytecomp_gpu_supported(nullptr), 0);
}

TEST(GpuAbi, WithoutAGpuCreateSaysWhy) {
  int devices = 0;
  const int built = bytecomp_gpu_built(&devices);
  if (built && devices > 0) return;  // a GPU is present: the device cases run instead
  bytecomp_gpu_compressor* c = reinterpret_cast<bytecomp_gpu_compressor*>(1);
  EXPECT_EQ(bytecomp_gpu_compressor_create("efsignsgd", 1000, &c), BYTECOMP_ERR_UNSUPPORTED);
  EXPECT_EQ(c, nullptr);
  const std::string msg = bytecomp_gpu_last_error();
  EXPECT_NE(msg.find(built ? "no CUDA device" : "built without CUDA"), std::string::npos) << msg;
}

TEST(GpuAbiNccl, ArgumentsAndAbsenceAreReported) {
  EXPECT_EQ(bytecomp_gpu_nccl_built(), BYTECOMP_HAVE_NCCL);
  bytecomp_gpu_nccl* c = reinterpret_cast<bytecomp_gpu_nccl*>(1);
  uint8_t id[BYTECOMP_GPU_NCCL_ID_BYTES] = {};
  const bytecomp_status bad = bytecomp_gpu_nccl_create(id, 2, 5, 0, 100, &c);
  EXPECT_EQ(bad, BYTECOMP_HAVE_NCCL ? BYTECOMP_ERR_INVALID_ARGUMENT : BYTECOMP_ERR_UNSUPPORTED);
  EXPECT_EQ(c, nullptr);
  EXPECT_NE(bytecomp_gpu_nccl_sum(nullptr, nullptr, 4, 0, nullptr), BYTECOMP_OK);
  EXPECT_NE(bytecomp_gpu_nccl_wait(nullptr, nullptr, 1), BYTECOMP_OK);
  bytecomp_gpu_nccl_abort(nullptr);
  bytecomp_gpu_nccl_destroy(nullptr);
  int devices = 0;
  bytecomp_gpu_built(&devices);
  if (BYTECOMP_HAVE_NCCL && devices == 0) {
    c = reinterpret_cast<bytecomp_gpu_nccl*>(1);
    EXPECT_EQ(bytecomp_gpu_nccl_create(id, 1, 0, 0, 100, &c), BYTECOMP_ERR_UNSUPPORTED);
    EXPECT_EQ(c, nullptr);
    EXPECT_NE(std::string(bytecomp_gpu_last_error()).find("not present"), std::string::npos)
        << bytecomp_gpu_last_error();
  }
}

#if BYTECOMP_HAVE_NCCL
// On a GPU: a one-rank communicator sums in place, then abort makes every
// later call fail instead of hanging.
TEST(GpuAbiNccl, OneRankSumThenAbort) {
  int devices = 0;
  if (!bytecomp_gpu_built(&devices) || devices == 0)
    GTEST_SKIP() << "no CUDA device (run scripts/gpu-check on a GPU machine)";
  uint8_t id[BYTECOMP_GPU_NCCL_ID_BYTES];
  ASSERT_EQ(bytecomp_gpu_nccl_unique_id(id), BYTECOMP_OK) << bytecomp_gpu_last_error();
  bytecomp_gpu_nccl* c = nullptr;
  ASSERT_EQ(bytecomp_gpu_nccl_create(id, 1, 0, 0, 20000, &c), BYTECOMP_OK) << bytecomp_gpu_last_error();
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 64 * sizeof(float)), cudaSuccess);
  std::vector<float> h(64, 1.5f);
  ASSERT_EQ(cudaMemcpy(d, h.data(), 64 * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(bytecomp_gpu_nccl_sum(c, d, 64, 0, nullptr), BYTECOMP_OK) << bytecomp_gpu_last_error();
  ASSERT_EQ(bytecomp_gpu_nccl_wait(c, nullptr, 20000), BYTECOMP_OK) << bytecomp_gpu_last_error();
  ASSERT_EQ(cudaMemcpy(h.data(), d, 64 * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(h[63], 1.5f);
  bytecomp_gpu_nccl_abort(c);
  EXPECT_EQ(bytecomp_gpu_nccl_sum(c, d, 64, 0, nullptr), BYTECOMP_ERR_ABORTED);
  bytecomp_gpu_nccl_destroy(c);
  cudaFree(d);
}
#endif

#if BYTECOMP_HAVE_CUDA
class GpuAbiDevice : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    int devices = 0;
    if (!bytecomp_gpu_built(&devices) || devices == 0)
      GTEST_SKIP() << "no CUDA device (run scripts/gpu-check on a GPU machine)";
  }
};

std::vector<float> ramp(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = std::sin(0.37f * static_cast<float>(i)) * (1 + i % 7);
  return v;
}

// GPU compress -> host bytes -> CPU decompress equals GPU compress -> GPU
// decompress; CPU compress -> GPU decompress equals CPU decompress.
TEST_P(GpuAbiDevice, WireFormatIsSharedWithTheCpuLibrary) {
  namespace bcc = bytecomp::compress;
  const size_t n = 100003;
  const auto x = ramp(n);
  bytecomp_gpu_compressor* g = nullptr;
  ASSERT_EQ(bytecomp_gpu_compressor_create(GetParam(), n, &g), BYTECOMP_OK) << bytecomp_gpu_last_error();
  uint64_t cap = 0;
  ASSERT_EQ(bytecomp_gpu_max_compressed_bytes(g, &cap), BYTECOMP_OK);
  float *din = nullptr, *dout = nullptr;
  void* dbuf = nullptr;
  ASSERT_EQ(cudaMalloc(&din, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dout, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dbuf, cap), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(din, x.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
  uint64_t len = 0;
  ASSERT_EQ(bytecomp_gpu_compress(g, din, dbuf, cap, 3, 42, nullptr, &len), BYTECOMP_OK)
      << bytecomp_gpu_last_error();
  std::vector<std::byte> wire(len);
  ASSERT_EQ(cudaMemcpy(wire.data(), dbuf, len, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(bytecomp_gpu_decompress(g, dbuf, len, dout, 0, 3, 42, nullptr), BYTECOMP_OK)
      << bytecomp_gpu_last_error();
  std::vector<float> gpu_dec(n), cpu_dec(n);
  ASSERT_EQ(cudaMemcpy(gpu_dec.data(), dout, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  auto cpu = bcc::make_compressor(bcc::parse_compressor_spec(GetParam()));
  bcc::CompressContext ctx;
  ctx.iteration = 3;
  ctx.shared_seed = 42;
  cpu->decompress(wire, bcc::TensorView::cpu(cpu_dec.data(), n), false, ctx);
  EXPECT_EQ(std::memcmp(gpu_dec.data(), cpu_dec.data(), n * 4), 0) << GetParam();
  // And a CPU-compressed buffer through the GPU.
  std::vector<std::byte> cbuf(cpu->max_compressed_bytes(n));
  auto st = cpu->make_state(n);
  const size_t clen = cpu->compress(bcc::ConstTensorView::cpu(x.data(), n), cbuf, *st, ctx);
  ASSERT_LE(clen, cap);
  ASSERT_EQ(cudaMemcpy(dbuf, cbuf.data(), clen, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(bytecomp_gpu_decompress(g, dbuf, clen, dout, 0, 3, 42, nullptr), BYTECOMP_OK)
      << bytecomp_gpu_last_error();
  cpu->decompress({cbuf.data(), clen}, bcc::TensorView::cpu(cpu_dec.data(), n), false, ctx);
  ASSERT_EQ(cudaMemcpy(gpu_dec.data(), dout, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(std::memcmp(gpu_dec.data(), cpu_dec.data(), n * 4), 0) << GetParam();
  // A malformed buffer is refused before anything is written.
  std::vector<std::byte> bad(wire);
  bad[0] = std::byte{0x7f};
  ASSERT_EQ(cudaMemcpy(dbuf, bad.data(), bad.size(), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(bytecomp_gpu_decompress(g, dbuf, bad.size(), dout, 0, 3, 42, nullptr),
            BYTECOMP_ERR_PROTOCOL);
  cudaFree(din);
  cudaFree(dout);
  cudaFree(dbuf);
  bytecomp_gpu_compressor_destroy(g);
}

INSTANTIATE_TEST_SUITE_P(Compressors, GpuAbiDevice,
                         ::testing::Values("fp16", "bf16", "signsgd", "efsignsgd", "onebit",
                                           "topk:0.01", "randomk:0.01"));
#endif

}  // namespace
