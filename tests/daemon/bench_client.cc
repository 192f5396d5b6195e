// bc_bench: one rank of scripts/bench-daemon. Rank 0 prints the figures.
//
//   bc_bench SOCKET JOB RANK SIZE big|small ITERATIONS
//   big:   one 64 MiB float32 tensor; prints the median push_pull round trip
//          and, measured in the same process, the median of one 64 MiB memcpy.
//   small: one 4-byte tensor; prints the median round trip in microseconds.
#include <bytecomp/bytecomp.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: bc_bench SOCKET JOB RANK SIZE big|small ITERATIONS\n");
    return 2;
  }
  const uint32_t rank = static_cast<uint32_t>(std::atoi(argv[3]));
  const uint32_t size = static_cast<uint32_t>(std::atoi(argv[4]));
  const bool big = std::string(argv[5]) == "big";
  const int iters = std::atoi(argv[6]);
  const uint64_t n = big ? (64ull << 20) / 4 : 1;
  try {
    bytecomp::Client c({.job_id = argv[2], .local_rank = rank, .local_size = size,
                        .socket_path = argv[1]});
    const uint32_t t = c.declare("t", n, BYTECOMP_FLOAT32);
    c.start();
    std::span<float> g = c.buffer<float>(t);
    // Zeros stay zeros (and finite) however often they are summed, so no
    // rank has to refill between round trips; correctness is the tests' job.
    std::fill(g.begin(), g.end(), 0.0f);
    std::vector<double> rtt;
    for (int it = 0; it < iters + 3; ++it) {
      const auto t0 = Clock::now();
      c.push_pull(t, static_cast<uint64_t>(it)).wait(60000);
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (it >= 3) rtt.push_back(s);  // warm-up excluded
      if (g[0] != 0.0f) {
        std::fprintf(stderr, "wrong sum %f\n", g[0]);
        return 1;
      }
    }
    if (rank == 0 && big) {
      std::vector<char> a(n * 4, 1), b(n * 4, 0);
      std::vector<double> mc;
      for (int i = 0; i < iters + 3; ++i) {
        a[static_cast<size_t>(i)] = static_cast<char>(i);
        const auto t0 = Clock::now();
        std::memcpy(b.data(), a.data(), a.size());
        const double s = std::chrono::duration<double>(Clock::now() - t0).count();
        if (b[static_cast<size_t>(i)] != static_cast<char>(i)) return 1;
        if (i >= 3) mc.push_back(s);
      }
      std::printf("big_rtt_ms %.3f memcpy_ms %.3f\n", 1e3 * median(rtt), 1e3 * median(mc));
    } else if (rank == 0) {
      std::printf("small_rtt_us %.2f\n", 1e6 * median(rtt));
    }
    c.close();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %u: %s\n", rank, e.what());
    return 1;
  }
  return 0;
}
