// Two-process loopback benchmark of the transport (driven by
// scripts/bench-transport): one-way goodput of large messages and round-trip
// latency of small requests, against a transport_peer child process.
//
//   transport_bench [--backend zmq] [--endpoint tcp|ipc] [--size BYTES]
//                   [--messages N] [--rtt-iters N] [--runs N] [--io-threads N]
//                   [--rtt-peers default|inline|both]
// Prints one line per run and, last, one JSON line:
//   {"goodput_bytes_per_s": [...], "rtt_us_median": [...], ...}
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "common/log.h"
#include "tests/transport/peer_process.h"
#include "tests/transport/protocol.h"
#include "transport/transport.h"

using namespace bytecomp;
using namespace bytecomp::transport;
namespace tp = bytecomp::transport::testproto;
using Sec = std::chrono::duration<double>;

namespace {

// Reference point measured in the same run: 64-byte round trips over bare
// ZeroMQ (DEALER -> ROUTER echo in a forked child, blocking calls, no
// framing, no handler threads) — the floor this transport builds on.
double raw_zmq_rtt_median_us(uint64_t iters) {
  void* probe_ctx = zmq_ctx_new();
  void* probe = zmq_socket(probe_ctx, ZMQ_ROUTER);
  zmq_bind(probe, "tcp://127.0.0.1:*");
  char endpoint[256];
  size_t len = sizeof endpoint;
  zmq_getsockopt(probe, ZMQ_LAST_ENDPOINT, endpoint, &len);
  zmq_close(probe);
  zmq_ctx_term(probe_ctx);
  const uint64_t total = iters + 200;
  pid_t pid = fork();
  if (pid == 0) {
    void* c = zmq_ctx_new();
    void* s = zmq_socket(c, ZMQ_ROUTER);
    if (zmq_bind(s, endpoint) != 0) _exit(1);
    int ms = 10000;
    zmq_setsockopt(s, ZMQ_RCVTIMEO, &ms, sizeof ms);
    char id[256], buf[256];
    for (uint64_t i = 0; i < total; ++i) {
      int n = zmq_recv(s, id, sizeof id, 0);
      int m = zmq_recv(s, buf, sizeof buf, 0);
      if (n < 0 || m < 0) break;
      zmq_send(s, id, static_cast<size_t>(n), ZMQ_SNDMORE);
      zmq_send(s, buf, static_cast<size_t>(m), 0);
    }
    zmq_close(s);
    zmq_ctx_term(c);
    _exit(0);
  }
  void* c = zmq_ctx_new();
  void* s = zmq_socket(c, ZMQ_DEALER);
  int ms = 10000, zero = 0;
  zmq_setsockopt(s, ZMQ_RCVTIMEO, &ms, sizeof ms);
  zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
  zmq_connect(s, endpoint);
  char buf[64] = {};
  std::vector<double> us;
  for (uint64_t i = 0; i < total; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    zmq_send(s, buf, sizeof buf, 0);
    if (zmq_recv(s, buf, sizeof buf, 0) < 0) break;
    if (i >= 200)
      us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  zmq_close(s);
  zmq_ctx_term(c);
  waitpid(pid, nullptr, 0);
  if (us.empty()) return -1;
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string backend = "zmq", endpoint = "tcp";
  size_t size = 4u << 20;
  uint64_t messages = 500, rtt_iters = 5000;
  int runs = 3;
  int io_threads = 2;  // ZeroMQ I/O threads on both sides
  std::string rtt_peers = "both";  // default | inline | both
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--backend") backend = v;
    else if (k == "--endpoint") endpoint = v;
    else if (k == "--size") size = std::stoull(v);
    else if (k == "--messages") messages = std::stoull(v);
    else if (k == "--rtt-iters") rtt_iters = std::stoull(v);  // split over both peers
    else if (k == "--runs") runs = std::stoi(v);
    else if (k == "--io-threads") io_threads = std::stoi(v);
    else if (k == "--rtt-peers") rtt_peers = v;
    else {
      std::cerr << "transport_bench: unknown option " << k << "\n";
      return 2;
    }
  }
  char tmpl[] = "/tmp/bc-transport-bench-XXXXXX";
  if (!mkdtemp(tmpl)) return 1;
  std::string dir = tmpl;
  int rc = 0;
  try {
    bytecomp::log::configure_from_env();
    auto listen = [&](const std::string& name) {
      return endpoint == "ipc" ? "ipc://" + dir + "/" + name + ".sock" : std::string("tcp://127.0.0.1:0");
    };
    std::ofstream(dir + "/peer.yaml") << "version: 1\ntransport:\n  backend: " << backend
                                      << "\n  io_threads: " << io_threads
                                      << "\n  listen: [\"" << listen("peer") << "\"]\n";
    testing::PeerProcess peer(dir + "/peer.yaml", 1);
    // The same peer with inline_handlers (handlers on its I/O loop thread).
    std::ofstream(dir + "/peer-inline.yaml") << "version: 1\ntransport:\n  backend: " << backend
                                             << "\n  inline_handlers: true\n  io_threads: " << io_threads
                                             << "\n  listen: [\""
                                             << listen("peer-inline") << "\"]\n";
    testing::PeerProcess peer_inline(dir + "/peer-inline.yaml", 2);
    TransportConfig cfg;
    cfg.backend = backend;
    cfg.listen = {listen("bench")};
    cfg.node_id = 0;
    cfg.io_threads = io_threads;
    auto t = make_transport(cfg);
    t->add_peer(1, peer.address());
    t->add_peer(2, peer_inline.address());
    t->start();
    Buffer payload = Buffer::allocate(size);
    tp::fill_pattern(payload.mutable_data(), size, 1);
    Buffer small = Buffer::allocate(64);

    std::vector<double> goodput, rtt_median, rtt_p99, rtt_inline_median, rtt_inline_p99, raw_rtt;
    uint64_t seq = 0;
    for (int run = 0; run < runs; ++run) {
      // Goodput: stream, then one request that queues behind every message
      // (same ordered connection) and whose answer counts them.
      Response before = t->call(1, Message{{tp::kStats, 0, 0, 0, 0}, {}}, Millis{30000});
      before.status.throw_if_error();
      auto t0 = std::chrono::steady_clock::now();
      for (uint64_t i = 0; i < messages; ++i)
        t->send(1, Message{{tp::kSeq, 0, 0, 9, seq++}, {payload}}, nullptr);
      Response after = t->call(1, Message{{tp::kStats, 0, 0, 0, 0}, {}}, Millis{120000});
      after.status.throw_if_error();
      double secs = Sec(std::chrono::steady_clock::now() - t0).count();
      std::string text(after.response.payloads.at(0).view());
      if (text.find("errors=0") == std::string::npos)
        throw Error(ErrorCode::kInternal, "peer saw reordered messages: " + text);
      goodput.push_back(static_cast<double>(messages * size) / secs);

      // Round trips of 64-byte requests, one at a time: all to the default
      // peer (handler thread), then all to the inline_handlers peer. (Blocks
      // alternating between the two peers made the default peer's figures
      // some 40% worse than the same binary measuring it alone.)
      std::vector<double> us, us_inline;
      us.reserve(rtt_iters);
      us_inline.reserve(rtt_iters);
      for (NodeId p : {1u, 2u})
        for (int w = 0; w < 200; ++w) t->call(p, Message{{tp::kEcho, 0, 0, 0, 0}, {small}});
      for (uint64_t i = 0; i < rtt_iters; ++i) {
        NodeId p = rtt_peers == "default" ? 1 : rtt_peers == "inline" ? 2 : i < rtt_iters / 2 ? 1 : 2;
        auto s0 = std::chrono::steady_clock::now();
        Response r = t->call(p, Message{{tp::kEcho, 0, 0, 0, i}, {small}}, Millis{10000});
        double d = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - s0).count();
        r.status.throw_if_error();
        (p == 1 ? us : us_inline).push_back(d);
      }
      if (us.empty()) us.push_back(0);
      if (us_inline.empty()) us_inline.push_back(0);
      std::sort(us.begin(), us.end());
      std::sort(us_inline.begin(), us_inline.end());
      rtt_median.push_back(us[us.size() / 2]);
      rtt_p99.push_back(us[us.size() * 99 / 100]);
      rtt_inline_median.push_back(us_inline[us_inline.size() / 2]);
      rtt_inline_p99.push_back(us_inline[us_inline.size() * 99 / 100]);
      raw_rtt.push_back(raw_zmq_rtt_median_us(rtt_iters / 2));
      std::printf("run %d: goodput %.1f MB/s (%llu x %zu B in %.3f s), rtt median %.1f us p99 %.1f us,"
                  " inline_handlers rtt median %.1f us p99 %.1f us (bare zmq rtt median %.1f us)\n",
                  run, goodput.back() / 1e6, static_cast<unsigned long long>(messages), size, secs,
                  rtt_median.back(), rtt_p99.back(), rtt_inline_median.back(), rtt_inline_p99.back(),
                  raw_rtt.back());
      std::fflush(stdout);
    }
    auto list = [](const std::vector<double>& v) {
      std::ostringstream s;
      s << "[";
      for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
      s << "]";
      return s.str();
    };
    std::printf("{\"goodput_bytes_per_s\": %s, \"rtt_us_median\": %s, \"rtt_us_p99\": %s, "
                "\"rtt_inline_us_median\": %s, \"rtt_inline_us_p99\": %s, "
                "\"bare_zmq_rtt_us_median\": %s}\n",
                list(goodput).c_str(), list(rtt_median).c_str(), list(rtt_p99).c_str(),
                list(rtt_inline_median).c_str(), list(rtt_inline_p99).c_str(), list(raw_rtt).c_str());
    t->shutdown();
  } catch (const std::exception& e) {
    std::cerr << "transport_bench: " << e.what() << "\n";
    rc = 1;
  }
  std::filesystem::remove_all(dir);
  return rc;
}
