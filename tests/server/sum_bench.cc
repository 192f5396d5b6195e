// The server's summation step (compress::sum_into over one 4 MiB partition,
// as an engine thread runs it) against memcpy of the same bytes: the
// baseline of scripts/bench-server's "sum_vs_memcpy" figure. Both read one
// buffer and write one (sum_into also reads dst: 3 streams vs 2).
#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

#include "compress/reduce.h"

namespace {

constexpr size_t kFloats = (4u << 20) / 4;

void BM_Memcpy(benchmark::State& state) {
  std::vector<float> a(kFloats, 1.0f), b(kFloats, 2.0f);
  for (auto _ : state) {
    std::memcpy(a.data(), b.data(), kFloats * 4);
    benchmark::DoNotOptimize(a.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kFloats * 4));
}
BENCHMARK(BM_Memcpy)->Unit(benchmark::kMicrosecond);

void BM_SumInto(benchmark::State& state) {
  std::vector<float> a(kFloats, 1.0f), b(kFloats, 2.0f);
  for (auto _ : state) {
    bytecomp::compress::sum_into(a.data(), b.data(), kFloats);
    benchmark::DoNotOptimize(a.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kFloats * 4));
}
BENCHMARK(BM_SumInto)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
