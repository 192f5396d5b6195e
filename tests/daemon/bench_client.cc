// bc_bench: one rank of scripts/bench-daemon. Rank 0 prints the figures.
//
//   bc_bench SOCKET JOB RANK SIZE big|small ITERATIONS
//   big:   one 64 MiB float32 tensor; prints the median push_pull round trip
//          and, measured in the same process, the median of one 64 MiB memcpy.
//   small: one 4-byte tensor; prints the median round trip in microseconds.
//   model: 64 tensors of 4 MiB (a 256 MiB model), all pushed, then all
//          waited; prints the median iteration time and the goodput (model
//          bytes per second). Optional last argument NODE/NODES.
//          model:K: K tensors of 4 MiB instead (1..1024; scripts/bench-ring
//          uses smaller models on slow emulated links); model:K:BYTES: K
//          tensors of BYTES bytes each (4..1 GiB, a multiple of 4; bench-ring
//          --tensor-bytes, the planner's per-size check); model:K:BYTES:GAP_US:
//          a pause of GAP_US microseconds after each push (a backward pass
//          producing the gradients over time, last layer first). Also prints
//          the median time until the first tensor (pushed last, needed first
//          by the next forward pass) is summed: first_layer_ms.
#include <bytecomp/bytecomp.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7 && argc != 8) {
    std::fprintf(stderr,
                 "usage: bc_bench SOCKET JOB RANK SIZE big|small|model[:K[:BYTES]] ITERATIONS "
                 "[R/N]\n");
    return 2;
  }
  uint32_t node_rank = 0, num_nodes = 1;
  if (argc == 8) std::sscanf(argv[7], "%u/%u", &node_rank, &num_nodes);
  std::string mode = argv[5];
  // list:PATH: one tensor per line of PATH, its element count (a real
  // model's sizes, e.g. ResNet-18's 62 tensors), else as model:K.
  std::vector<uint64_t> listed;
  if (mode.rfind("list:", 0) == 0) {
    std::ifstream in(mode.substr(5));
    uint64_t n = 0;
    while (in >> n) listed.push_back(n);
    if (listed.empty() || listed.size() > 4096) {
      std::fprintf(stderr, "bc_bench: %s: expected 1..4096 element counts, one per line\n",
                   argv[5]);
      return 2;
    }
    mode = "model:" + std::to_string(listed.size());
  }
  if (mode == "model" || mode.rfind("model:", 0) == 0) {
    const int tensors = mode == "model" ? 64 : std::atoi(mode.c_str() + 6);
    // model:K:BYTES: K tensors of BYTES each (many small ones: tensor fusion).
    const size_t colon = mode.find(':', 6);
    const long long tensor_bytes =
        colon == std::string::npos ? (4ll << 20) : std::atoll(mode.c_str() + colon + 1);
    const size_t colon2 = colon == std::string::npos ? colon : mode.find(':', colon + 1);
    const long long gap_us = colon2 == std::string::npos ? 0 : std::atoll(mode.c_str() + colon2 + 1);
    if (tensors < 1 || tensors > 4096 || tensor_bytes < 4 || tensor_bytes > (1ll << 30) ||
        tensor_bytes % 4 != 0 || gap_us < 0 || gap_us > 10000000) {
      std::fprintf(stderr,
                   "bc_bench: %s: expected model:K[:BYTES[:GAP_US]] with K in 1..4096, BYTES a "
                   "multiple of 4 in 4..1 GiB and GAP_US in 0..10000000\n",
                   argv[5]);
      return 2;
    }
    try {
      bytecomp::Client c({.job_id = argv[2], .local_rank = static_cast<uint32_t>(std::atoi(argv[3])),
                          .local_size = static_cast<uint32_t>(std::atoi(argv[4])),
                          .node_rank = node_rank, .num_nodes = num_nodes,
                          .socket_path = argv[1], .connect_timeout_ms = 30000});
      const int kTensors = tensors;
      const uint64_t kCount = static_cast<uint64_t>(tensor_bytes) / 4;
      std::vector<uint32_t> ids;
      uint64_t total = 0;
      for (int t = 0; t < kTensors; ++t) {
        const uint64_t n = listed.empty() ? kCount : listed[static_cast<size_t>(t)];
        ids.push_back(c.declare("layer" + std::to_string(t), n, BYTECOMP_FLOAT32));
        total += n * 4;
      }
      c.start(60000);
      for (uint32_t id : ids) {
        std::span<float> g = c.buffer<float>(id);
        std::fill(g.begin(), g.end(), 0.0f);
      }
      const int iters = std::atoi(argv[6]);
      std::vector<double> secs, first;
      for (int it = 0; it < iters + 1; ++it) {
        const auto t0 = Clock::now();
        std::vector<bytecomp::Operation> ops;
        for (size_t k = ids.size(); k-- > 0;) {
          ops.push_back(c.push_pull(ids[k], static_cast<uint64_t>(it)));
          if (gap_us > 0 && k > 0) std::this_thread::sleep_for(std::chrono::microseconds(gap_us));
        }
        ops.back().wait(120000);  // the first tensor's
        const auto t1 = Clock::now();
        for (size_t k = 0; k + 1 < ops.size(); ++k) ops[k].wait(120000);
        if (it > 0) {
          secs.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
          first.push_back(std::chrono::duration<double>(t1 - t0).count());
        }
      }
      const double m = median(secs);
      if (std::atoi(argv[3]) == 0 && node_rank == 0) {
        std::printf("model_iteration_ms %.2f goodput_bytes_per_s %.4g first_layer_ms %.2f\n",
                    1e3 * m, static_cast<double>(total) / m, 1e3 * median(first));
      }
      c.close();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return 1;
    }
    return 0;
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
      // The quartiles and tails after the median (scripts/bench-daemon reads
      // field 2 only): a bimodal run shows in p25 vs p75.
      std::vector<double> v = rtt;
      std::sort(v.begin(), v.end());
      auto q = [&](double f) { return v.empty() ? 0 : 1e6 * v[static_cast<size_t>(f * (v.size() - 1))]; };
      std::printf("small_rtt_us %.2f p10 %.2f p25 %.2f p75 %.2f p90 %.2f\n", 1e6 * median(rtt),
                  q(0.10), q(0.25), q(0.75), q(0.90));
    }
    c.close();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %u: %s\n", rank, e.what());
    return 1;
  }
  return 0;
}
