// bytecomp-ps-echo: the baseline of scripts/bench-server. A bare transport
// endpoint with the parameter server's traffic pattern but no rounds and no
// summation: a push is answered with an empty OK at once, a pull with one
// preallocated buffer of --answer-bytes (the partition size). Driven by
// bytecomp-ps-worker --raw-echo, it measures what the transport alone
// sustains under the same load, in the same run.
//
//   bytecomp-ps-echo --cluster cluster.yaml --ready-file PATH --answer-bytes N
// Runs until SIGTERM/SIGINT.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "server/cluster_config.h"
#include "server/protocol.h"

using namespace bytecomp;
using namespace bytecomp::server;

int main(int argc, char** argv) {
  std::string cluster_path, ready;
  uint64_t answer = 4u << 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--cluster") cluster_path = argv[i + 1];
    else if (a == "--ready-file") ready = argv[i + 1];
    else if (a == "--answer-bytes") answer = std::stoull(argv[i + 1]);
  }
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  try {
    ClusterConfig cluster = load_cluster_config(cluster_path);
    transport::TransportConfig tc = cluster.transport;
    tc.node_id = cluster.coordinator;
    tc.listen = {"tcp://127.0.0.1:0"};
    auto tp = transport::make_transport(tc);
    transport::Buffer payload = transport::Buffer::allocate(answer);
    transport::Transport* t = tp.get();
    tp->set_handler(proto::kPush, [t](transport::Incoming in) { t->reply(in, proto::ok_reply(), nullptr); });
    tp->set_handler(proto::kPull, [t, payload](transport::Incoming in) {
      t->reply(in, proto::ok_reply(payload), nullptr);
    });
    tp->start();
    std::ofstream(ready + ".tmp") << tp->local_addresses().at(0) << "\n";
    std::rename((ready + ".tmp").c_str(), ready.c_str());
    int sig = 0;
    sigwait(&sigs, &sig);
    tp->shutdown();
  } catch (const Error& e) {
    std::fprintf(stderr, "bytecomp-ps-echo: %s\n", e.what());
    return 1;
  }
  return 0;
}
