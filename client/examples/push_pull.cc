// Example: the full client path with the C++ wrapper. It trains nothing: each
// rank fills a few "gradients" with known values, push_pulls them every
// iteration (all in flight at once, last layer first, as a backward pass
// would), and checks the sums the daemon wrote back.
//
//   bytecompd --config daemon.yaml &
//   bytecomp-example --socket /run/bytecomp/bytecompd.sock --ranks 2 --iterations 100
//
// --ranks N forks N local ranks of one job (a real framework would start one
// process per GPU, each with its own --rank). --node R/N makes this node R of
// N: run it once per node, each against that node's daemon (the daemons are
// configured with the parameter servers, see README.md).
#include <sys/wait.h>
#include <unistd.h>

#include <bytecomp/bytecomp.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct Args {
  std::string socket;
  std::string job = "example";
  uint32_t ranks = 2;
  uint64_t iterations = 100;
  uint32_t node = 0;
  uint32_t nodes = 1;
};

int run_rank(const Args& a, uint32_t rank) {
  try {
    bytecomp::Client client({.job_id = a.job, .local_rank = rank, .local_size = a.ranks,
                             .node_rank = a.node, .num_nodes = a.nodes, .socket_path = a.socket,
                             .connect_timeout_ms = 30000});
    // A toy model: declared in forward order (first layer first).
    const std::vector<std::pair<std::string, uint64_t>> layers = {
        {"conv1.weight", 9408}, {"conv1.bias", 64}, {"fc.weight", 2048 * 1000}, {"fc.bias", 1000}};
    std::vector<uint32_t> ids;
    for (const auto& [name, n] : layers) ids.push_back(client.declare(name, n, BYTECOMP_FLOAT32));
    client.start(60000);
    const auto t0 = std::chrono::steady_clock::now();
    for (uint64_t it = 0; it < a.iterations; ++it) {
      std::vector<bytecomp::Operation> ops(ids.size());
      for (size_t k = ids.size(); k-- > 0;) {  // backward: last layer first
        std::span<float> g = client.buffer<float>(ids[k]);
        const uint32_t global = a.node * a.ranks + rank;
        for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>((global + 1) * ((i + it) % 100));
        ops[k] = client.push_pull(ids[k], it);
      }
      const uint32_t all = a.ranks * a.nodes;
      const float ranks_sum = static_cast<float>(all * (all + 1) / 2);
      for (size_t k = 0; k < ids.size(); ++k) {
        ops[k].wait(30000);
        std::span<float> g = client.buffer<float>(ids[k]);
        for (size_t i = 0; i < g.size(); ++i) {
          if (g[i] != ranks_sum * static_cast<float>((i + it) % 100)) {
            std::fprintf(stderr, "rank %u: wrong sum in %s[%zu] at iteration %llu\n", rank,
                         layers[k].first.c_str(), i, static_cast<unsigned long long>(it));
            return 1;
          }
        }
      }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rank == 0) {
      std::printf("node %u: %llu iterations of %zu tensors over %u ranks on %u node(s): "
                  "%.2f ms/iteration, sums exact\n",
                  a.node, static_cast<unsigned long long>(a.iterations), ids.size(), a.ranks, a.nodes,
                  1000.0 * s / static_cast<double>(a.iterations));
    }
    client.close();
    return 0;
  } catch (const bytecomp::ClientError& e) {
    std::fprintf(stderr, "rank %u: %s\n", rank, e.what());
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--socket") a.socket = argv[i + 1];
    else if (k == "--job") a.job = argv[i + 1];
    else if (k == "--ranks") a.ranks = static_cast<uint32_t>(std::atoi(argv[i + 1]));
    else if (k == "--iterations") a.iterations = std::strtoull(argv[i + 1], nullptr, 10);
    else if (k == "--node") std::sscanf(argv[i + 1], "%u/%u", &a.node, &a.nodes);
    else {
      std::fprintf(stderr, "usage: bytecomp-example [--socket PATH] [--job ID] [--ranks N] "
                           "[--iterations K] [--node R/N]\n");
      return 2;
    }
  }
  std::vector<pid_t> kids;
  for (uint32_t r = 1; r < a.ranks; ++r) {
    const pid_t p = fork();
    if (p == 0) _exit(run_rank(a, r));
    kids.push_back(p);
  }
  int rc = run_rank(a, 0);
  for (pid_t p : kids) {
    int st = 0;
    waitpid(p, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) rc = 1;
  }
  return rc;
}
