// Two-process loopback benchmark of the transport (driven by
// scripts/bench-transport): one-way goodput of large messages and round-trip
// latency of small requests, against a transport_peer child process.
//
//   transport_bench [--backend zmq] [--endpoint tcp|ipc] [--size BYTES]
//                   [--messages N] [--rtt-iters N] [--runs N] [--io-threads N]
//                   [--variants default,typed,inline,spin20] [--spin-us N]
//                   [--local-ipc 0|1]
// (tcp: TCP on both sides unless --local-ipc 1, like the bare-ZeroMQ floor.)
// Round trips are measured per variant, each with its own client transport
// and peer process, one variant after the other (idle ones sleep):
//   default  the config defaults on both sides (wait_spin_us: --spin-us
//            when given);
//   typed    the defaults, the request of type kEchoInline, which the peer
//            registered with set_inline_handler (as the server registers
//            its data messages);
//   inline   the same with inline_handlers: true at the peer;
//   spin20   wait_spin_us: 20 (call() looks for its reply 20 us, yielding,
//            before it sleeps; the default is 0).
// For each, the CPU time both processes spent per round trip is reported
// (the bench process via getrusage, the peer via /proc/PID/stat ticks).
// Prints one line per run and, last, one JSON line:
//   {"goodput_bytes_per_s": [...], "rtt_us_median": [...], ...}
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
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

// CPU seconds this process used so far (all threads).
double self_cpu_s() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

// CPU seconds process `pid` used so far (utime + stime, clock ticks).
double proc_cpu_s(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  auto close = text.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(text.substr(close + 2));
  std::string field;
  double ticks = 0;
  // After "pid (comm) ": state is field 3; utime and stime are 14 and 15.
  for (int i = 3; i <= 15 && rest >> field; ++i)
    if (i >= 14) ticks += std::stod(field);
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string backend = "zmq", endpoint = "tcp";
  size_t size = 4u << 20;
  uint64_t messages = 500, rtt_iters = 3000;
  int runs = 3;
  int io_threads = 2;  // ZeroMQ I/O threads on both sides
  int spin_us = -1;    // -1: the config default
  // tcp runs stay TCP (the floor, bare ZeroMQ, and iperf3 are TCP):
  // --local-ipc 1 lets the transport use its Unix-socket alias instead.
  bool local_ipc = false;
  std::string variants_arg = "default,typed,inline,spin20";
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--backend") backend = v;
    else if (k == "--endpoint") endpoint = v;
    else if (k == "--size") size = std::stoull(v);
    else if (k == "--messages") messages = std::stoull(v);
    else if (k == "--rtt-iters") rtt_iters = std::stoull(v);  // per variant
    else if (k == "--runs") runs = std::stoi(v);
    else if (k == "--io-threads") io_threads = std::stoi(v);
    else if (k == "--variants") variants_arg = v;
    else if (k == "--spin-us") spin_us = std::stoi(v);
    else if (k == "--local-ipc") local_ipc = v == "1" || v == "true";
    else {
      std::cerr << "transport_bench: unknown option " << k << "\n";
      return 2;
    }
  }
  std::vector<std::string> variants = split(variants_arg);
  for (const std::string& v : variants)
    if (v != "default" && v != "typed" && v != "inline" && v != "spin20") {
      std::cerr << "transport_bench: unknown variant '" << v
                << "' (accepted: default, typed, inline, spin20)\n";
      return 2;
    }
  if (variants.empty() || variants[0] != "default") variants.insert(variants.begin(), "default");
  char tmpl[] = "/tmp/bc-transport-bench-XXXXXX";
  if (!mkdtemp(tmpl)) return 1;
  std::string dir = tmpl;
  int rc = 0;
  try {
    bytecomp::log::configure_from_env();
    auto listen = [&](const std::string& name) {
      return endpoint == "ipc" ? "ipc://" + dir + "/" + name + ".sock" : std::string("tcp://127.0.0.1:0");
    };
    struct Variant {
      std::string name;
      std::unique_ptr<testing::PeerProcess> peer;
      std::unique_ptr<Transport> client;
      std::vector<double> goodput, median, p99, cpu_us;
      uint64_t seq = 0;  // the peer checks its sequence numbers
    };
    std::vector<Variant> vs;
    NodeId next_node = 1;
    for (const std::string& name : variants) {
      Variant v;
      v.name = name;
      int spin = name == "spin20" ? 20 : spin_us;
      std::ostringstream yaml;
      yaml << "version: 1\ntransport:\n  backend: " << backend << "\n  io_threads: " << io_threads
           << "\n  listen: [\"" << listen("peer-" + name) << "\"]\n";
      if (name == "inline") yaml << "  inline_handlers: true\n";
      yaml << "  local_ipc: " << (local_ipc ? "true" : "false") << "\n";
      if (spin >= 0) yaml << "  wait_spin_us: " << spin << "\n";
      std::ofstream(dir + "/peer-" + name + ".yaml") << yaml.str();
      v.peer = std::make_unique<testing::PeerProcess>(dir + "/peer-" + name + ".yaml", next_node);
      TransportConfig cfg;
      cfg.backend = backend;
      cfg.listen = {listen("bench-" + name)};
      cfg.node_id = 100 + next_node;
      cfg.io_threads = io_threads;
      cfg.local_ipc = local_ipc;
      if (spin >= 0) cfg.wait_spin = std::chrono::microseconds{spin};
      v.client = make_transport(cfg);
      v.client->add_peer(next_node, v.peer->address());
      v.client->start();
      ++next_node;
      vs.push_back(std::move(v));
    }
    Buffer payload = Buffer::allocate(size);
    tp::fill_pattern(payload.mutable_data(), size, 1);
    Buffer small = Buffer::allocate(64);

    std::vector<double> raw_rtt;
    for (int run = 0; run < runs; ++run) {
      // Goodput (default variant): stream, then one request that queues
      // behind every message (same ordered connection) and whose answer
      // counts them.
      {
        const size_t vi = 0;
        Variant& v = vs[vi];
        Transport& t = *v.client;
        const NodeId gp = static_cast<NodeId>(vi + 1);
        Response before = t.call(gp, Message{{tp::kStats, 0, 0, 0, 0}, {}}, Millis{30000});
        before.status.throw_if_error();
        auto t0 = std::chrono::steady_clock::now();
        for (uint64_t i = 0; i < messages; ++i)
          t.send(gp, Message{{tp::kSeq, 0, 0, 9, v.seq++}, {payload}}, nullptr);
        Response after = t.call(gp, Message{{tp::kStats, 0, 0, 0, 0}, {}}, Millis{120000});
        after.status.throw_if_error();
        double secs = Sec(std::chrono::steady_clock::now() - t0).count();
        std::string text(after.response.payloads.at(0).view());
        if (text.find("errors=0") == std::string::npos)
          throw Error(ErrorCode::kInternal, "peer saw reordered messages: " + text);
        v.goodput.push_back(static_cast<double>(messages * size) / secs);
        std::printf("run %d: %-8s goodput %.1f MB/s (%llu x %zu B in %.3f s)\n", run, v.name.c_str(),
                    v.goodput.back() / 1e6, static_cast<unsigned long long>(messages), size, secs);
      }

      // Round trips of 64-byte requests, one at a time, one variant after
      // the other (blocks alternating between peers skewed the figures).
      for (size_t vi = 0; vi < vs.size(); ++vi) {
        Variant& v = vs[vi];
        const NodeId p = static_cast<NodeId>(vi + 1);
        const uint16_t echo = v.name == "typed" ? tp::kEchoInline : tp::kEcho;
        for (int w = 0; w < 200; ++w) v.client->call(p, Message{{echo, 0, 0, 0, 0}, {small}});
        std::vector<double> us;
        us.reserve(rtt_iters);
        double cpu0 = self_cpu_s() + proc_cpu_s(v.peer->pid());
        for (uint64_t i = 0; i < rtt_iters; ++i) {
          auto s0 = std::chrono::steady_clock::now();
          Response r = v.client->call(p, Message{{echo, 0, 0, 0, i}, {small}}, Millis{10000});
          double d = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - s0).count();
          r.status.throw_if_error();
          us.push_back(d);
        }
        double cpu = self_cpu_s() + proc_cpu_s(v.peer->pid()) - cpu0;
        std::sort(us.begin(), us.end());
        v.median.push_back(us[us.size() / 2]);
        v.p99.push_back(us[us.size() * 99 / 100]);
        v.cpu_us.push_back(cpu * 1e6 / static_cast<double>(rtt_iters));
        std::printf("run %d: %-8s rtt median %.1f us p99 %.1f us, cpu %.1f us per round trip (both processes)\n",
                    run, v.name.c_str(), v.median.back(), v.p99.back(), v.cpu_us.back());
      }
      raw_rtt.push_back(raw_zmq_rtt_median_us(rtt_iters));
      std::printf("run %d: bare zmq rtt median %.1f us\n", run, raw_rtt.back());
      std::fflush(stdout);
    }
    auto list = [](const std::vector<double>& v) {
      std::ostringstream s;
      s << "[";
      for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
      s << "]";
      return s.str();
    };
    std::ostringstream json;
    json << "{\"goodput_bytes_per_s\": " << list(vs[0].goodput);
    for (const Variant& v : vs) {
      std::string key = v.name == "default" ? "rtt" : "rtt_" + v.name;
      json << ", \"" << key << "_us_median\": " << list(v.median) << ", \"" << key
           << "_us_p99\": " << list(v.p99) << ", \"" << key << "_cpu_us\": " << list(v.cpu_us);
    }
    json << ", \"bare_zmq_rtt_us_median\": " << list(raw_rtt) << "}";
    std::printf("%s\n", json.str().c_str());
    for (Variant& v : vs) v.client->shutdown();
  } catch (const std::exception& e) {
    std::cerr << "transport_bench: " << e.what() << "\n";
    rc = 1;
  }
  std::filesystem::remove_all(dir);
  return rc;
}
