// bc_worker: one framework process of a test job. Declares tensors, runs
// iterations of push_pull over all of them and checks every element of every
// result against the exact sum over the local ranks.
//
//   bc_worker SOCKET JOB RANK SIZE ITERATIONS SPEC [--threads] [--stall]
//   SPEC: comma-separated dtype:count, e.g. f32:1,f64:3,i32:1000,f32:16777216
//   --threads  one thread per tensor (exercises client thread-safety)
//   --stall    start, then never push (the other ranks wait on it)
//   --node R/N this is node R of N (values and sums over all N * SIZE ranks)
//   --strategy FILE  the job's strategy (bytecomp_set_strategy with FILE's text)
//   --linger MS  sleep MS before waiting for the last iteration's results (so
//              peers finish and close first while this rank has results unread)
//
// Prints "running" after the first verified iteration, and on failure the
// status name and message. Exit: 0 ok, 1 usage, 2 wrong result, 10+status
// for an API error.
#include <bytecomp/bytecomp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

struct T {
  bytecomp_dtype dtype;
  uint64_t count;
  uint32_t id = 0;
  void* buf = nullptr;
};

// Values are small integers so float sums are exact.
double value(uint32_t rank, uint64_t iter, uint64_t i) {
  return static_cast<double>(((i * 7 + iter) % 2048) * (rank + 1));
}
double expected(uint32_t size, uint64_t iter, uint64_t i) {
  return static_cast<double>(((i * 7 + iter) % 2048) * (size * (size + 1) / 2));
}

template <class V>
void fill(void* p, uint64_t n, uint32_t rank, uint64_t iter) {
  V* v = static_cast<V*>(p);
  for (uint64_t i = 0; i < n; ++i) v[i] = static_cast<V>(value(rank, iter, i));
}
template <class V>
bool verify(const void* p, uint64_t n, uint32_t size, uint64_t iter, uint64_t* bad) {
  const V* v = static_cast<const V*>(p);
  for (uint64_t i = 0; i < n; ++i) {
    if (v[i] != static_cast<V>(expected(size, iter, i))) {
      *bad = i;
      return false;
    }
  }
  return true;
}

void do_fill(const T& t, uint32_t rank, uint64_t iter) {
  switch (t.dtype) {
    case BYTECOMP_FLOAT32: return fill<float>(t.buf, t.count, rank, iter);
    case BYTECOMP_FLOAT64: return fill<double>(t.buf, t.count, rank, iter);
    case BYTECOMP_INT32: return fill<int32_t>(t.buf, t.count, rank, iter);
    case BYTECOMP_INT64: return fill<int64_t>(t.buf, t.count, rank, iter);
  }
}
bool do_verify(const T& t, uint32_t size, uint64_t iter, uint64_t* bad) {
  switch (t.dtype) {
    case BYTECOMP_FLOAT32: return verify<float>(t.buf, t.count, size, iter, bad);
    case BYTECOMP_FLOAT64: return verify<double>(t.buf, t.count, size, iter, bad);
    case BYTECOMP_INT32: return verify<int32_t>(t.buf, t.count, size, iter, bad);
    case BYTECOMP_INT64: return verify<int64_t>(t.buf, t.count, size, iter, bad);
  }
  return false;
}

[[noreturn]] void die(bytecomp_status s, const char* what) {
  std::printf("error %s %s: %s\n", bytecomp_status_name(s), what, bytecomp_last_error());
  std::fflush(stdout);
  std::exit(10 + s);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 7) {
    std::fprintf(stderr, "usage: bc_worker SOCKET JOB RANK SIZE ITERATIONS SPEC [--threads]\n");
    return 1;
  }
  const char* socket = argv[1];
  const char* job = argv[2];
  const uint32_t rank = static_cast<uint32_t>(std::atoi(argv[3]));
  const uint32_t size = static_cast<uint32_t>(std::atoi(argv[4]));
  const uint64_t iters = std::strtoull(argv[5], nullptr, 10);
  bool threads = false;
  bool stall = false;
  uint32_t node_rank = 0, num_nodes = 1;
  int linger_ms = 0;
  std::string strategy_file;
  for (int i = 7; i < argc; ++i) {
    threads |= std::strcmp(argv[i], "--threads") == 0;
    stall |= std::strcmp(argv[i], "--stall") == 0;
    if (std::strcmp(argv[i], "--node") == 0 && i + 1 < argc) {
      std::sscanf(argv[++i], "%u/%u", &node_rank, &num_nodes);
    }
    if (std::strcmp(argv[i], "--strategy") == 0 && i + 1 < argc) strategy_file = argv[++i];
    if (std::strcmp(argv[i], "--linger") == 0 && i + 1 < argc) linger_ms = std::atoi(argv[++i]);
  }
  // Values and expected sums over every rank of every node.
  const uint32_t grank = node_rank * size + rank;
  const uint32_t gsize = num_nodes * size;
  std::vector<T> ts;
  std::string spec = argv[6];
  size_t at = 0;
  while (at < spec.size()) {
    size_t end = spec.find(',', at);
    if (end == std::string::npos) end = spec.size();
    const std::string item = spec.substr(at, end - at);
    const std::string ty = item.substr(0, item.find(':'));
    const uint64_t n = std::strtoull(item.substr(item.find(':') + 1).c_str(), nullptr, 10);
    const bytecomp_dtype dt = ty == "f64" ? BYTECOMP_FLOAT64
                              : ty == "i32" ? BYTECOMP_INT32
                              : ty == "i64" ? BYTECOMP_INT64
                                            : BYTECOMP_FLOAT32;
    ts.push_back({dt, n});
    at = end + 1;
  }

  bytecomp_connect_options o;
  bytecomp_connect_options_init(&o);
  o.socket_path = socket;
  o.job_id = job;
  o.local_rank = rank;
  o.local_size = size;
  o.node_rank = node_rank;
  o.num_nodes = num_nodes;
  o.connect_timeout_ms = 20000;
  bytecomp_client* c = nullptr;
  bytecomp_status s = bytecomp_connect(&o, &c);
  if (s != BYTECOMP_OK) die(s, "connect");
  for (size_t k = 0; k < ts.size(); ++k) {
    const std::string name = "t" + std::to_string(k);
    s = bytecomp_declare_tensor(c, name.c_str(), ts[k].count, ts[k].dtype, BYTECOMP_DEVICE_CPU, 0,
                                &ts[k].id);
    if (s != BYTECOMP_OK) die(s, "declare");
  }
  if (!strategy_file.empty()) {
    std::ifstream in(strategy_file);
    std::stringstream text;
    text << in.rdbuf();
    s = bytecomp_set_strategy(c, text.str().c_str(), strategy_file.c_str());
    if (s != BYTECOMP_OK) die(s, "set_strategy");
  }
  if ((s = bytecomp_start(c, 30000)) != BYTECOMP_OK) die(s, "start");
  for (auto& t : ts) {
    uint64_t bytes = 0;
    if ((s = bytecomp_tensor_buffer(c, t.id, &t.buf, &bytes)) != BYTECOMP_OK) die(s, "buffer");
    if (bytes != t.count * bytecomp_dtype_size(t.dtype)) die(BYTECOMP_ERR_INTERNAL, "buffer size");
  }

  if (stall) {
    // Starts, then never pushes: the other ranks wait on it.
    std::printf("stalling\n");
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }

  auto one_tensor = [&](const T& t, uint64_t it) -> int {
    do_fill(t, grank, it);
    bytecomp_handle h = 0;
    bytecomp_status st = bytecomp_push_pull(c, t.id, it, &h);
    if (st != BYTECOMP_OK) die(st, "push_pull");
    if ((st = bytecomp_wait(c, h, 20000)) != BYTECOMP_OK) die(st, "wait");
    uint64_t bad = 0;
    if (!do_verify(t, gsize, it, &bad)) {
      std::printf("wrong result: tensor %u iteration %llu element %llu\n", t.id,
                  static_cast<unsigned long long>(it), static_cast<unsigned long long>(bad));
      std::fflush(stdout);
      std::exit(2);
    }
    return 0;
  };

  for (uint64_t it = 0; it < iters; ++it) {
    if (threads) {
      std::vector<std::thread> th;
      for (const auto& t : ts) th.emplace_back([&, it] { one_tensor(t, it); });
      for (auto& x : th) x.join();
    } else {
      // All tensors in flight at once, in backward order (last declared
      // first), then waited: what a framework's backward pass does.
      std::vector<bytecomp_handle> hs(ts.size());
      for (size_t k = ts.size(); k-- > 0;) {
        do_fill(ts[k], grank, it);
        if ((s = bytecomp_push_pull(c, ts[k].id, it, &hs[k])) != BYTECOMP_OK) die(s, "push_pull");
      }
      if (it + 1 == iters && linger_ms > 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(linger_ms));
      }
      for (size_t k = 0; k < ts.size(); ++k) {
        if ((s = bytecomp_wait(c, hs[k], 20000)) != BYTECOMP_OK) die(s, "wait");
        uint64_t bad = 0;
        if (!do_verify(ts[k], gsize, it, &bad)) {
          std::printf("wrong result: tensor %zu iteration %llu element %llu\n", k,
                      static_cast<unsigned long long>(it), static_cast<unsigned long long>(bad));
          return 2;
        }
      }
    }
    if (it == 0) {
      std::printf("running\n");
      std::fflush(stdout);
    }
  }
  s = bytecomp_close(c);
  if (s != BYTECOMP_OK) die(s, "close");
  std::printf("ok\n");
  return 0;
}
