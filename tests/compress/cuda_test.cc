// The CUDA compressors against the CPU library (suite compress-cuda; skips
// without a GPU). Deterministic compressors must produce the same bytes and
// residuals; qsgd/terngrad the same statistics; buffers travel both ways.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "common/gpu.h"
#include "compress/cuda/cuda.h"
#include "testutil.h"

namespace {

namespace bc = bytecomp::compress;
using bytecomp::Error;
using bytecomp::ErrorCode;

void ck(cudaError_t e) { ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e); }

struct Dev {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Dev(size_t b) : bytes(b) {
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(b, 8)), cudaSuccess);
  }
  ~Dev() { cudaFree(p); }
  float* f() const { return static_cast<float*>(p); }
  std::byte* b() const { return static_cast<std::byte*>(p); }
};

class CudaCompress : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!bc::cuda::built()) GTEST_SKIP() << "built without CUDA";
    if (bytecomp::gpu::device_count() == 0) GTEST_SKIP() << "no CUDA device: " << bytecomp::gpu::describe();
    ck(cudaStreamCreate(&stream_));
  }
  void TearDown() override {
    if (stream_) cudaStreamDestroy(stream_);
  }

  Dev upload(const std::vector<float>& x) {
    Dev d(x.size() * 4);
    cudaMemcpy(d.p, x.data(), x.size() * 4, cudaMemcpyHostToDevice);
    return d;
  }
  Dev upload(const std::vector<std::byte>& x) {
    Dev d(x.size());
    cudaMemcpy(d.p, x.data(), x.size(), cudaMemcpyHostToDevice);
    return d;
  }
  std::vector<float> download(const Dev& d, size_t n) {
    std::vector<float> v(n);
    cudaStreamSynchronize(stream_);
    cudaMemcpy(v.data(), d.p, n * 4, cudaMemcpyDeviceToHost);
    return v;
  }
  std::vector<std::byte> gpu_compress(const bc::Compressor& c, bc::TensorState& st, const Dev& x, size_t n,
                                      const bc::CompressContext& ctx) {
    Dev out(c.max_compressed_bytes(n));
    size_t len = c.compress({x.p, n, bc::DType::kFloat32, bc::Device::kCuda, stream_},
                            {out.b(), out.bytes}, st, ctx);
    EXPECT_LE(len, out.bytes);
    std::vector<std::byte> h(len);
    cudaStreamSynchronize(stream_);
    cudaMemcpy(h.data(), out.p, len, cudaMemcpyDeviceToHost);
    return h;
  }
  std::vector<float> gpu_decompress(const bc::Compressor& c, const std::vector<std::byte>& buf, size_t n,
                                    bool accumulate = false, float init = 7.0f) {
    Dev in = upload(buf);
    Dev out = upload(std::vector<float>(n, init));
    c.decompress({in.b(), buf.size()}, {out.p, n, bc::DType::kFloat32, bc::Device::kCuda, stream_},
                 accumulate, {});
    return download(out, n);
  }
  bc::TensorView view(const Dev& d, size_t n) { return {d.p, n, bc::DType::kFloat32, bc::Device::kCuda, stream_}; }

  cudaStream_t stream_ = nullptr;
};

std::unique_ptr<bc::Compressor> gpu(const std::string& spec) {
  return bc::make_compressor(bc::parse_compressor_spec(spec), bc::Device::kCuda);
}
std::unique_ptr<bc::Compressor> cpu(const std::string& spec) {
  return bc::make_compressor(bc::parse_compressor_spec(spec));
}

const size_t kSizes[] = {1, 63, 64, 65, 1000, 70001, (1 << 20) + 3};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), 4 * a.size()) == 0;
}

TEST_F(CudaCompress, DeterministicCompressorsAreBitIdenticalToCpu) {
  for (const char* spec : {"fp16", "bf16", "fp16:ef=true", "bf16:ef=true,ef_beta=0.5", "randomk:0.01",
                           "randomk:0.05,ef=false", "topk:0.01", "topk:0.1,ef=false", "dgc:0.01",
                           "dgc:0.05,warmup_iters=2", "signsgd", "signsgd:ef=true", "signum"})
    for (size_t n : kSizes) {
      SCOPED_TRACE(std::string(spec) + " n=" + std::to_string(n));
      auto c = cpu(spec), g = gpu(spec);
      auto cs = c->make_state(n), gs = g->make_state(n);
      for (uint64_t it = 0; it < 4; ++it) {
        auto x = bctest::gaussian(n, static_cast<uint32_t>(n + it));
        for (size_t i = 0; i < n; i += 5) x[i] = 0.25f;  // ties for topk
        bc::CompressContext ctx{.iteration = it, .shared_seed = 99, .private_seed = 5};
        auto want = bctest::compress(*c, *cs, x, ctx);
        Dev dx = upload(x);
        auto got = gpu_compress(*g, *gs, dx, n, ctx);
        ASSERT_EQ(got.size(), want.size()) << "iteration " << it;
        ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size())) << "iteration " << it;
        if (cs->has_residual()) {
          ASSERT_TRUE(gs->has_residual());
          std::vector<float> rc(n), rg(n);
          cs->copy_residual(rc);
          gs->copy_residual(rg);
          ASSERT_TRUE(same_bits(rc, rg)) << "residual, iteration " << it;
        }
      }
    }
}

TEST_F(CudaCompress, ScaledSignsMatchCpuWithinRounding) {
  for (const char* spec : {"efsignsgd", "onebit"})
    for (size_t n : kSizes) {
      SCOPED_TRACE(std::string(spec) + " n=" + std::to_string(n));
      auto c = cpu(spec), g = gpu(spec);
      auto cs = c->make_state(n), gs = g->make_state(n);
      auto x = bctest::gaussian(n, 17);
      auto want = bctest::compress(*c, *cs, x);
      Dev dx = upload(x);
      auto got = gpu_compress(*g, *gs, dx, n, {});
      ASSERT_EQ(got.size(), want.size());
      size_t pl = std::string(spec) == "onebit" ? 8 : 8;  // params padded to 8
      EXPECT_EQ(0, std::memcmp(got.data() + 32 + pl, want.data() + 32 + pl, got.size() - 32 - pl)) << "signs";
      for (size_t off = 32; off < 32 + (std::string(spec) == "onebit" ? 8u : 4u); off += 4) {
        float a, b;
        std::memcpy(&a, want.data() + off, 4);
        std::memcpy(&b, got.data() + off, 4);
        EXPECT_NEAR(a, b, 1e-5 * std::fabs(a) + 1e-30) << "scale at " << off;
      }
      std::vector<float> rc(n), rg(n);
      cs->copy_residual(rc);
      gs->copy_residual(rg);
      for (size_t i = 0; i < n; ++i) ASSERT_NEAR(rc[i], rg[i], 1e-4) << i;
    }
}

TEST_F(CudaCompress, QuantisersAgreeWithCpuAndAreUnbiased) {
  for (const char* spec : {"qsgd:16", "qsgd:levels=3,ef=true", "qsgd:127", "terngrad", "terngrad:ef=true"}) {
    SCOPED_TRACE(spec);
    size_t n = 70001;
    auto c = cpu(spec), g = gpu(spec);
    auto cs = c->make_state(n), gs = g->make_state(n);
    auto x = bctest::gaussian(n, 3);
    bc::CompressContext ctx{.iteration = 2, .private_seed = 11};
    auto want = bctest::compress(*c, *cs, x, ctx);
    Dev dx = upload(x);
    auto got = gpu_compress(*g, *gs, dx, n, ctx);
    ASSERT_EQ(got.size(), want.size());
    // Same seeds and (to rounding) the same norm/scale: nearly every code agrees.
    auto dc = bctest::decompress(*c, want, n), dg = bctest::decompress(*c, got, n);
    size_t differ = 0;
    for (size_t i = 0; i < n; ++i) differ += std::fabs(dc[i] - dg[i]) > 1e-3f * (std::fabs(dc[i]) + 1e-3f);
    EXPECT_LT(differ, n / 1000) << "elements decoded differently";
  }
  for (const char* spec : {"qsgd:4", "terngrad"}) {
    SCOPED_TRACE(std::string(spec) + " unbiasedness");
    size_t n = 4096;
    const int kSeeds = 400;
    auto g = gpu(spec);
    auto gs = g->make_state(n);
    auto x = bctest::gaussian(n, 8);
    Dev dx = upload(x);
    Dev sum = upload(std::vector<float>(n, 0.0f));
    Dev buf(g->max_compressed_bytes(n));
    float unit_max = 0;
    for (int s = 0; s < kSeeds; ++s) {
      size_t len = g->compress({dx.p, n, bc::DType::kFloat32, bc::Device::kCuda, stream_}, {buf.b(), buf.bytes},
                               *gs, {.iteration = 1, .private_seed = static_cast<uint64_t>(s)});
      g->decompress({buf.b(), len}, view(sum, n), true, {});
      if (s == 0) {
        std::vector<std::byte> h(len);
        cudaStreamSynchronize(stream_);
        cudaMemcpy(h.data(), buf.p, len, cudaMemcpyDeviceToHost);
        float p0;
        std::memcpy(&p0, h.data() + (std::string(spec) == "terngrad" ? 32 : 40), 4);
        unit_max = std::string(spec) == "terngrad" ? p0 : p0 / 4.0f;
      }
    }
    auto mean = download(sum, n);
    double sd = unit_max / 2.0 / std::sqrt(static_cast<double>(kSeeds));
    for (size_t i = 0; i < n; ++i) {
      if (std::fabs(x[i]) > unit_max && std::string(spec) == "terngrad") continue;  // clipped: biased by design
      ASSERT_NEAR(mean[i] / kSeeds, x[i], 6 * sd + 1e-6) << i;
    }
  }
}

TEST_F(CudaCompress, WireCompatibleBothWays) {
  for (const auto& spec : bctest::all_specs()) {
    for (size_t n : {size_t{1}, size_t{1000}, size_t{70001}}) {
      SCOPED_TRACE(spec + " n=" + std::to_string(n));
      auto c = cpu(spec), g = gpu(spec);
      auto x = bctest::gaussian(n, 21);
      bc::CompressContext ctx{.iteration = 1, .shared_seed = 4, .private_seed = 6};
      // CPU -> GPU, set and accumulate.
      auto cs = c->make_state(n);
      auto cb = bctest::compress(*c, *cs, x, ctx);
      auto want = bctest::decompress(*c, cb, n);
      EXPECT_TRUE(same_bits(gpu_decompress(*g, cb, n), want));
      auto acc = gpu_decompress(*g, cb, n, true, 1.5f);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(acc[i], 1.5f + want[i]) << i;
      // GPU -> CPU.
      auto gs = g->make_state(n);
      Dev dx = upload(x);
      auto gb = gpu_compress(*g, *gs, dx, n, ctx);
      EXPECT_NO_THROW(bc::inspect(gb));
      EXPECT_TRUE(same_bits(bctest::decompress(*c, gb, n), gpu_decompress(*g, gb, n)));
    }
  }
}

TEST_F(CudaCompress, SignMajorityVoteMatchesCpu) {
  size_t n = 1000;
  auto c = cpu("signsgd"), g = gpu("signsgd");
  std::vector<std::vector<std::byte>> bufs;
  for (uint32_t w = 0; w < 5; ++w) {
    auto st = c->make_state(n);
    bufs.push_back(bctest::compress(*c, *st, bctest::gaussian(n, w)));
  }
  std::vector<float> sum_c(n, 0.0f);
  for (auto& b : bufs) c->decompress(b, bc::TensorView::cpu(sum_c.data(), n), true, {});
  Dev sum = upload(std::vector<float>(n, 0.0f));
  for (auto& b : bufs) {
    Dev d = upload(b);
    g->decompress({d.b(), b.size()}, view(sum, n), true, {});
    cudaStreamSynchronize(stream_);
  }
  auto sum_g = download(sum, n);
  EXPECT_TRUE(same_bits(sum_c, sum_g));
  auto st = g->make_state(n);
  auto vote_g = gpu_compress(*g, *st, sum, n, {});
  auto cst = c->make_state(n);
  EXPECT_EQ(vote_g, bctest::compress(*c, *cst, sum_c));
}

TEST_F(CudaCompress, BadBuffersAndCallsAreRejected) {
  size_t n = 1000;
  auto x = bctest::gaussian(n, 1);
  for (const char* spec : {"topk:0.01", "qsgd", "fp16", "randomk:0.01", "onebit"}) {
    SCOPED_TRACE(spec);
    auto c = cpu(spec), g = gpu(spec);
    auto st = c->make_state(n);
    auto good = bctest::compress(*c, *st, x);
    Dev out = upload(std::vector<float>(n, 3.0f));
    auto expect_bad = [&](std::vector<std::byte> b, const char* what) {
      Dev d = upload(b);
      try {
        g->decompress({d.b(), b.size()}, view(out, n), false, {});
        ADD_FAILURE() << what << ": accepted";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kMalformed) << what << ": " << e.what();
      }
      auto o = download(out, n);
      for (float f : o) ASSERT_EQ(f, 3.0f) << what << ": output touched";
    };
    expect_bad({good.begin(), good.begin() + 16}, "truncated header");
    expect_bad({good.begin(), good.end() - 8}, "truncated payload");
    auto flip = good;
    flip[17] ^= std::byte{1};
    expect_bad(flip, "count bit flip");
    auto wrong = bctest::compress(*cpu("bf16"), *cpu("bf16")->make_state(n), x);
    if (std::string(spec) != "bf16") expect_bad(wrong, "other algorithm");
    if (std::string(spec) == "topk:0.01") {
      auto forged = good;
      uint32_t bad_idx = static_cast<uint32_t>(n);
      std::memcpy(forged.data() + 40, &bad_idx, 4);  // payload: not covered by the checksum
      expect_bad(forged, "index out of range");
      auto order = good;
      std::memcpy(order.data() + 44, order.data() + 40, 4);
      expect_bad(order, "indices not increasing");
    }
    // Host memory on the CUDA path, CPU tensors to a CUDA compressor.
    std::vector<std::byte> host(good);
    EXPECT_THROW(g->decompress(host, view(out, n), false, {}), Error);
    auto gs = g->make_state(n);
    std::vector<std::byte> hb(g->max_compressed_bytes(n));
    EXPECT_THROW(g->compress(bc::ConstTensorView::cpu(x.data(), n), hb, *gs, {}), Error);
    Dev dx = upload(x);
    Dev small(8);
    EXPECT_THROW(g->compress({dx.p, n, bc::DType::kFloat32, bc::Device::kCuda, stream_}, {small.b(), 8}, *gs, {}),
                 Error);
    EXPECT_THROW(g->compress({dx.p, n, bc::DType::kFloat32, bc::Device::kCuda, stream_},
                             {small.b(), g->max_compressed_bytes(n)}, *c->make_state(n), {}),
                 Error);
  }
}

TEST_F(CudaCompress, NoLeaksAndNoSteadyStateAllocations) {
  auto before = bc::cuda::alloc_stats();
  {
    size_t n = 100003;
    auto x = bctest::gaussian(n, 2);
    Dev dx = upload(x);
    for (const auto& spec : bctest::all_specs()) {
      SCOPED_TRACE(spec);
      auto g = gpu(spec);
      auto st = g->make_state(n);
      Dev buf(g->max_compressed_bytes(n));
      Dev out(n * 4);
      uint64_t after_first = 0;
      for (uint64_t it = 0; it < 5; ++it) {
        size_t len = g->compress({dx.p, n, bc::DType::kFloat32, bc::Device::kCuda, stream_}, {buf.b(), buf.bytes},
                                 *st, {.iteration = it});
        g->decompress({buf.b(), len}, view(out, n), it % 2 == 1, {});
        if (it == 0) after_first = bc::cuda::alloc_stats().device_allocs + bc::cuda::alloc_stats().host_allocs;
      }
      auto now = bc::cuda::alloc_stats();
      EXPECT_EQ(now.device_allocs + now.host_allocs, after_first) << "allocations after the first call";
    }
  }
  auto after = bc::cuda::alloc_stats();
  EXPECT_EQ(after.device_allocs - before.device_allocs, after.device_frees - before.device_frees);
  EXPECT_EQ(after.host_allocs - before.host_allocs, after.host_frees - before.host_frees);
  EXPECT_EQ(after.device_bytes_live, before.device_bytes_live);
  EXPECT_EQ(after.host_bytes_live, before.host_bytes_live);
}

}  // namespace

// Every test skips without a GPU; exit 77 then, so meson reports the suite as
// skipped rather than passed.
int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int rc = RUN_ALL_TESTS();
  bool skipped = !bc::cuda::built() || bytecomp::gpu::device_count() == 0;
  return rc == 0 && skipped ? 77 : rc;
}
