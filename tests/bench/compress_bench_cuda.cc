// CUDA compressor benchmarks (issue 15): GPU time from CUDA events on one
// stream, each figure also divided by a device-to-device cudaMemcpy of the
// same fp32 bytes measured in the same run (counter `x_memcpy`).
//
//   compress_bench_cuda [--benchmark_filter=...]   (n = 2^20 and 25,000,000)
//
// Without a GPU it says so and exits 0 without running anything.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "common/gpu.h"
#include "compress/compressor.h"

namespace {

namespace bc = bytecomp::compress;

struct Dev {
  void* p = nullptr;
  explicit Dev(size_t b) {
    if (cudaMalloc(&p, std::max<size_t>(b, 8)) != cudaSuccess) p = nullptr;
  }
  ~Dev() { cudaFree(p); }
};

cudaStream_t stream() {
  static cudaStream_t s = [] {
    cudaStream_t x;
    cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking);
    return x;
  }();
  return s;
}

// Median GPU milliseconds of `reps` runs of f() between two events.
template <class F>
double gpu_ms(const F& f, int reps = 7) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> t;
  for (int r = 0; r < reps; ++r) {
    cudaEventRecord(a, stream());
    f();
    cudaEventRecord(b, stream());
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct Input {
  size_t n;
  Dev x, y;
  explicit Input(size_t n) : n(n), x(4 * n), y(4 * n) {
    std::vector<float> h(n);
    std::mt19937 g(1);
    std::normal_distribution<float> d;
    for (auto& v : h) v = d(g);
    cudaMemcpy(x.p, h.data(), 4 * n, cudaMemcpyHostToDevice);
  }
};
Input& input(size_t n) {
  static std::vector<std::unique_ptr<Input>> all;
  for (auto& i : all)
    if (i->n == n) return *i;
  all.push_back(std::make_unique<Input>(n));
  return *all.back();
}

double memcpy_ms(size_t n) {
  Input& in = input(n);
  return gpu_ms([&] { cudaMemcpyAsync(in.y.p, in.x.p, 4 * n, cudaMemcpyDeviceToDevice, stream()); });
}

void BM_Memcpy(benchmark::State& state) {
  size_t n = static_cast<size_t>(state.range(0));
  Input& in = input(n);
  for (auto _ : state)
    state.SetIterationTime(gpu_ms([&] { cudaMemcpyAsync(in.y.p, in.x.p, 4 * n, cudaMemcpyDeviceToDevice, stream()); }, 1) / 1e3);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(8 * n));
}

void run(benchmark::State& state, const std::string& spec, bool decompress) {
  size_t n = static_cast<size_t>(state.range(0));
  Input& in = input(n);
  auto c = bc::make_compressor(bc::parse_compressor_spec(spec), bc::Device::kCuda);
  auto st = c->make_state(n);
  Dev buf(c->max_compressed_bytes(n));
  bc::ConstTensorView x{in.x.p, n, bc::DType::kFloat32, bc::Device::kCuda, stream()};
  bc::TensorView y{in.y.p, n, bc::DType::kFloat32, bc::Device::kCuda, stream()};
  uint64_t it = 0;
  size_t len = c->compress(x, {static_cast<std::byte*>(buf.p), c->max_compressed_bytes(n)}, *st,
                           {.iteration = it++});
  auto once = [&] {
    if (decompress)
      c->decompress({static_cast<std::byte*>(buf.p), len}, y, false, {});
    else
      len = c->compress(x, {static_cast<std::byte*>(buf.p), c->max_compressed_bytes(n)}, *st,
                        {.iteration = it++, .shared_seed = 3, .private_seed = 5});
  };
  double total = 0;
  for (auto _ : state) {
    double ms = gpu_ms(once, 1);
    total += ms;
    state.SetIterationTime(ms / 1e3);
  }
  double mc = memcpy_ms(n);
  state.counters["x_memcpy"] = total / static_cast<double>(state.iterations()) / mc;
  state.counters["memcpy_ms"] = mc;
  state.counters["bytes_out"] = static_cast<double>(len);
}

const char* const kSpecs[] = {"fp16", "bf16", "randomk:0.01", "topk:0.01", "dgc:0.001", "signsgd",
                              "signum", "efsignsgd", "onebit", "qsgd:16", "terngrad"};

void register_all() {
  for (int64_t n : {int64_t{1} << 20, int64_t{25000000}}) {
    benchmark::RegisterBenchmark("BM_Memcpy", BM_Memcpy)->Arg(n)->UseManualTime()->Unit(benchmark::kMicrosecond);
    for (const char* s : kSpecs) {
      std::string spec = s;
      std::string name = spec.substr(0, spec.find(':'));
      benchmark::RegisterBenchmark(("BM_Compress/" + name).c_str(),
                                   [spec](benchmark::State& st) { run(st, spec, false); })
          ->Arg(n)->UseManualTime()->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark(("BM_Decompress/" + name).c_str(),
                                   [spec](benchmark::State& st) { run(st, spec, true); })
          ->Arg(n)->UseManualTime()->Unit(benchmark::kMicrosecond);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (bytecomp::gpu::device_count() == 0) {
    std::fprintf(stderr, "compress_bench_cuda: no CUDA device (%s); nothing to measure\n",
                 bytecomp::gpu::describe().c_str());
    return 0;
  }
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
