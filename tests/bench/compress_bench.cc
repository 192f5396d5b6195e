// compress_bench: compress / decompress throughput of every compressor at its
// typical setting, against memcpy of the same size measured in the same run.
//
//   BM_Memcpy/<n>                       n fp32 elements copied
//   BM_Compress/<name>/<n>[/threads:2]  error-feedback/momentum update included
//   BM_Decompress/<name>/<n>[/threads:2] dense fp32 output (overwrite)
//   BM_DecompressNotReread/efsignsgd/<n>  the same, with
//       CompressContext::output_not_reread (the daemon's pulled answers)
//
// bytes_per_second is always n * 4 (the fp32 input size). Google Benchmark
// reports both wall ("real_time") and the benchmarking thread's CPU time; with
// /threads:2 the pool's second thread is not in the CPU time, so compare wall
// times there. (UseRealTime() is not set: it would append "/real_time" to the
// names the scripts match on.) Compare with --benchmark_format=json; see
// scripts/bench-compress-vs-torch and docs/compress.md.
#include <benchmark/benchmark.h>

#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "common/thread_pool.h"
#include "compress/compressor.h"

namespace bc = bytecomp::compress;

namespace {

const std::vector<std::pair<std::string, std::string>> kCompressors = {
    {"fp16", "fp16"},
    {"bf16", "bf16"},
    {"randomk", "randomk:0.01"},  // with error feedback (default)
    {"topk", "topk:0.01"},        // exact, with error feedback (default)
    {"dgc", "dgc:0.01"},
    {"signsgd", "signsgd"},
    {"signum", "signum"},
    {"efsignsgd", "efsignsgd"},
    {"onebit", "onebit"},
    {"qsgd", "qsgd:16"},
    {"terngrad", "terngrad"},
};

const std::vector<size_t> kSizes = {size_t{1} << 20, 25000000};

// Inputs are generated once per size (gradient-like: normal values).
const std::vector<float>& input(size_t n) {
  static std::map<size_t, std::vector<float>> cache;
  auto it = cache.find(n);
  if (it != cache.end()) return it->second;
  std::vector<float> v(n);
  std::mt19937 g(12345);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (auto& x : v) x = d(g);
  return cache.emplace(n, std::move(v)).first->second;
}

// Page-aligned, pre-faulted buffer.
struct Buffer {
  explicit Buffer(size_t bytes) : size(bytes) {
    p = static_cast<std::byte*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096));
    std::memset(p, 0, bytes);
  }
  ~Buffer() { std::free(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  std::byte* p;
  size_t size;
};

void BM_Memcpy(benchmark::State& state, size_t n, size_t threads) {
  const auto& in = input(n);
  Buffer dst(n * 4);
  // The /threads:2 variant splits the copy over the pool like the kernels do,
  // so it shows how much a second core can add at all when memory-bound.
  bytecomp::ThreadPool pool(threads - 1);
  for (auto _ : state) {
    if (threads == 1) {
      std::memcpy(dst.p, in.data(), n * 4);
    } else {
      pool.parallel_for(n, 1 << 16, [&](size_t b, size_t e) {
        std::memcpy(dst.p + b * 4, in.data() + b, (e - b) * 4);
      });
    }
    benchmark::DoNotOptimize(dst.p);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * 4));
}

void BM_Compress(benchmark::State& state, std::string spec, size_t n, size_t threads) {
  auto c = bc::make_compressor(bc::parse_compressor_spec(spec));
  const auto& in = input(n);
  auto st = c->make_state(n);
  Buffer out(c->max_compressed_bytes(n));
  bytecomp::ThreadPool pool(threads - 1);
  bc::CompressContext ctx{.iteration = 0, .shared_seed = 1, .private_seed = 2, .pool = &pool};
  size_t len = c->compress(bc::ConstTensorView::cpu(in.data(), n), {out.p, out.size}, *st, ctx);
  for (auto _ : state) {
    ++ctx.iteration;
    len = c->compress(bc::ConstTensorView::cpu(in.data(), n), {out.p, out.size}, *st, ctx);
    benchmark::DoNotOptimize(len);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * 4));
  state.counters["compressed_bytes"] = static_cast<double>(len);
  state.counters["ratio"] = static_cast<double>(n * 4) / static_cast<double>(len);
}

void BM_Decompress(benchmark::State& state, std::string spec, size_t n, size_t threads,
                   bool not_reread = false) {
  auto c = bc::make_compressor(bc::parse_compressor_spec(spec));
  const auto& in = input(n);
  auto st = c->make_state(n);
  Buffer buf(c->max_compressed_bytes(n));
  size_t len = c->compress(bc::ConstTensorView::cpu(in.data(), n), {buf.p, buf.size}, *st,
                           {.shared_seed = 1, .private_seed = 2});
  Buffer out(n * 4);
  bytecomp::ThreadPool pool(threads - 1);
  bc::CompressContext ctx{.pool = &pool};
  ctx.output_not_reread = not_reread;
  auto view = bc::TensorView::cpu(reinterpret_cast<float*>(out.p), n);
  for (auto _ : state) {
    c->decompress({buf.p, len}, view, false, ctx);
    benchmark::DoNotOptimize(out.p);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * 4));
}

void register_all() {
  for (size_t n : kSizes) {
    std::string ns = std::to_string(n);
    for (size_t threads : {1, 2}) {
      std::string suffix = threads > 1 ? "/threads:" + std::to_string(threads) : "";
      benchmark::RegisterBenchmark(("BM_Memcpy/" + ns + suffix).c_str(), BM_Memcpy, n, threads)
          ->Unit(benchmark::kMillisecond);
      for (const auto& [name, spec] : kCompressors) {
        benchmark::RegisterBenchmark(("BM_Compress/" + name + "/" + ns + suffix).c_str(),
                                     BM_Compress, spec, n, threads)
            ->Unit(benchmark::kMillisecond);
        benchmark::RegisterBenchmark(("BM_Decompress/" + name + "/" + ns + suffix).c_str(),
                                     BM_Decompress, spec, n, threads, false)
            ->Unit(benchmark::kMillisecond);
      }
      if (threads == 1)
        benchmark::RegisterBenchmark(("BM_DecompressNotReread/efsignsgd/" + ns).c_str(),
                                     BM_Decompress, "efsignsgd", n, threads, true)
            ->Unit(benchmark::kMillisecond);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
