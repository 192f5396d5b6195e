// bc_bcast_worker: one process of a test job that runs bytecomp_broadcast
// and bytecomp_barrier and checks every byte.
//
//   bc_bcast_worker SOCKET JOB LOCAL_RANK LOCAL_SIZE NODE NUM_NODES MODE ROOT SIZES DTYPES
//   MODE   ok        broadcast each size from ROOT over each tensor, then a
//                    barrier; every byte below the size must be the root's,
//                    every byte above it this rank's own
//          mismatch  as ok, but the ranks of the last node (one node: global
//                    rank 1) pass size + 4
//          die       every rank broadcasts from rank 0 once, then global rank
//                    ROOT exits (no BYE); the others broadcast again and
//                    must fail
//          late      as ok, but the ranks of the last node start 1.5 s after
//                    the others (the others' first chunks reach its daemon
//                    before it opened the job's broadcasts)
//          loop      as ok over the first tensor, again and again until a
//                    call fails; prints "running" after the first pass
//          rotate    as ok, but broadcast k comes from the node before the
//                    one of broadcast k - 1 (ROOT's node for the first; the
//                    local rank k mod LOCAL_SIZE): the last node of each
//                    round's chain is the next round's root, whose ranks go
//                    on at once
//   SIZES  comma-separated byte counts (0 allowed)
//   DTYPES comma-separated f32,f64,i32,i64: one tensor each, as large as the
//          largest size
//
// Prints "OK" when every broadcast matched, else the status name and the
// library's message. Exit: 0 ok, 1 usage, 2 wrong bytes, 10+status for an
// API error.
#include <bytecomp/bytecomp.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

namespace {

constexpr uint32_t kWaitMs = 20000;

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(item);
  return out;
}

// Bytes of every value, NaN payloads and negative zeros included: what
// the root sends is not a valid number of the dtype in general.
uint8_t root_byte(uint64_t it, uint64_t i) {
  return static_cast<uint8_t>((i * 131 + it * 17 + (i >> 8) * 7) & 0xFF);
}
uint8_t own_byte(uint32_t grank, uint64_t i) { return static_cast<uint8_t>(0xA0 + grank + i % 3); }

int api_error(bytecomp_status s, const char* what) {
  std::printf("%s: %s %s\n", what, bytecomp_status_name(s), bytecomp_last_error());
  std::fflush(stdout);
  return 10 + static_cast<int>(s);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 11) {
    std::fprintf(stderr, "usage: bc_bcast_worker SOCKET JOB LOCAL_RANK LOCAL_SIZE NODE NUM_NODES "
                         "MODE ROOT SIZES DTYPES\n");
    return 1;
  }
  const uint32_t local_rank = static_cast<uint32_t>(std::atoi(argv[3]));
  const uint32_t local_size = static_cast<uint32_t>(std::atoi(argv[4]));
  const uint32_t node = static_cast<uint32_t>(std::atoi(argv[5]));
  const uint32_t nodes = static_cast<uint32_t>(std::atoi(argv[6]));
  const std::string mode = argv[7];
  const uint32_t root = static_cast<uint32_t>(std::atoi(argv[8]));
  std::vector<uint64_t> sizes;
  for (const std::string& s : split(argv[9])) sizes.push_back(std::strtoull(s.c_str(), nullptr, 10));
  const uint32_t grank = node * local_size + local_rank;
  uint64_t largest = 4;
  for (uint64_t s : sizes) largest = std::max(largest, s + 4);

  bytecomp_connect_options o;
  bytecomp_connect_options_init(&o);
  o.socket_path = argv[1];
  o.job_id = argv[2];
  o.local_rank = local_rank;
  o.local_size = local_size;
  o.node_rank = node;
  o.num_nodes = nodes;
  bytecomp_client* c = nullptr;
  if (bytecomp_status s = bytecomp_connect(&o, &c); s != BYTECOMP_OK) return api_error(s, "connect");
  struct T {
    uint32_t id;
    uint32_t elem;
  };
  std::vector<T> tensors;
  for (const std::string& d : split(argv[10])) {
    const bytecomp_dtype dt = d == "f64" ? BYTECOMP_FLOAT64 : d == "i32" ? BYTECOMP_INT32
                              : d == "i64" ? BYTECOMP_INT64 : BYTECOMP_FLOAT32;
    const uint32_t elem = bytecomp_dtype_size(dt);
    uint32_t id = 0;
    const std::string name = "b." + d;
    if (bytecomp_status s = bytecomp_declare_tensor(c, name.c_str(), (largest + elem - 1) / elem, dt,
                                                    BYTECOMP_DEVICE_CPU, 0, &id);
        s != BYTECOMP_OK)
      return api_error(s, "declare");
    tensors.push_back({id, elem});
  }
  if (bytecomp_status s = bytecomp_start(c, 20000); s != BYTECOMP_OK) return api_error(s, "start");
  const uint32_t from0 = mode == "die" ? 0 : root;
  if (mode == "late" && node == nodes - 1) usleep(1500 * 1000);
  uint64_t it = 0;
  for (size_t ti = 0; ti < tensors.size(); ++ti) {
    const T& t = tensors[ti];
    void* buf = nullptr;
    uint64_t bytes = 0;
    if (bytecomp_status s = bytecomp_tensor_buffer(c, t.id, &buf, &bytes); s != BYTECOMP_OK)
      return api_error(s, "buffer");
    auto* b = static_cast<uint8_t*>(buf);
    for (uint64_t size : sizes) {
      const uint32_t root_node = root / local_size;
      const uint32_t from = mode == "rotate"
                                ? (root_node + nodes - static_cast<uint32_t>(it % nodes)) % nodes *
                                          local_size +
                                      static_cast<uint32_t>(it % local_size)
                                : from0;
      for (uint64_t i = 0; i < bytes; ++i) b[i] = grank == from ? root_byte(it, i) : own_byte(grank, i);
      const bool odd = nodes > 1 ? node == nodes - 1 : grank == 1;
      const uint64_t n = mode == "mismatch" && odd ? size + 4 : size;
      bytecomp_handle h = 0;
      if (bytecomp_status s = bytecomp_broadcast(c, t.id, it, from, n, 0x5eed + size, &h);
          s != BYTECOMP_OK)
        return api_error(s, "broadcast");
      if (bytecomp_status s = bytecomp_wait(c, h, kWaitMs); s != BYTECOMP_OK)
        return api_error(s, "wait");
      for (uint64_t i = 0; i < bytes; ++i) {
        const uint8_t want = i < size || grank == from ? root_byte(it, i) : own_byte(grank, i);
        if (b[i] != want) {
          std::printf("WRONG tensor %u size %llu byte %llu: %u, expected %u\n", t.id,
                      static_cast<unsigned long long>(size), static_cast<unsigned long long>(i),
                      b[i], want);
          return 2;
        }
      }
      ++it;
      if (mode == "die" && grank == root) {
        std::printf("dying\n");
        std::fflush(stdout);
        _exit(0);  // no BYE: the daemon sees the connection drop
      }
    }
    if (mode == "loop") {
      if (it == sizes.size()) {
        std::printf("running\n");
        std::fflush(stdout);
      }
      --ti;  // the same tensor again, until a call fails
      continue;
    }
    bytecomp_handle h = 0;
    if (bytecomp_status s = bytecomp_barrier(c, &h); s != BYTECOMP_OK) return api_error(s, "barrier");
    if (bytecomp_status s = bytecomp_wait(c, h, kWaitMs); s != BYTECOMP_OK)
      return api_error(s, "barrier wait");
  }
  std::printf("OK\n");
  std::fflush(stdout);
  if (bytecomp_status s = bytecomp_close(c); s != BYTECOMP_OK) return api_error(s, "close");
  return 0;
}
