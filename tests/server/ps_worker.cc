// bytecomp-ps-worker: a test node built on the client library the daemon
// links (server/ps_client.h). Joins a job, pushes deterministic gradients
// (tests/server/testdata.h) for every partition and iteration, pulls the
// sums and optionally dumps them for the test to check. Last stdout line:
// "OK ..." or "ERROR <code>: <message>" (exit status 3).
//
//   bytecomp-ps-worker --cluster cluster.yaml --node 100 --job j --nodes 100,101
//       --tensors a:1000,b:5000 [--strategy s.yaml] [--deterministic]
//       [--iterations 10] [--start 0] [--seed 1] [--dump FILE]
//       [--pause-at ITER:PUSHES] [--bench] [--leave] [--start-at EPOCH_MS]
//   bytecomp-ps-worker --raw-echo ADDRESS ... : the same traffic straight over
//       the transport to bytecomp-ps-echo (scripts/bench-server's baseline)
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/config.h"
#include "compress/compressor.h"
#include "server/protocol.h"
#include "server/ps_client.h"
#include "tests/server/testdata.h"

using namespace bytecomp;
using namespace bytecomp::server;

namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

[[noreturn]] void die(const Status& s) {
  std::cout << "ERROR " << to_string(s.code()) << ": " << s.message() << std::endl;
  std::_Exit(3);
}

struct Options {
  std::string cluster, job, strategy_file, dump;
  NodeId node = 0;
  std::vector<NodeId> nodes;
  std::vector<TensorSpec> tensors;
  bool deterministic = false, bench = false, leave = false;
  uint64_t iterations = 10, start = 0, seed = 1;
  int64_t pause_iter = -1;
  uint64_t pause_pushes = 0;
  uint64_t timeout_ms = 20000;
  std::string raw_echo;
  int64_t start_at_ms = 0;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::cerr << "missing value for " << a << "\n";
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--cluster") o.cluster = next();
    else if (a == "--node") o.node = static_cast<NodeId>(std::stoul(next()));
    else if (a == "--job") o.job = next();
    else if (a == "--nodes")
      for (auto& n : split(next(), ',')) o.nodes.push_back(static_cast<NodeId>(std::stoul(n)));
    else if (a == "--tensors")
      for (auto& t : split(next(), ',')) {
        auto kv = split(t, ':');
        o.tensors.push_back({kv.at(0), std::stoull(kv.at(1)), compress::DType::kFloat32});
      }
    else if (a == "--strategy") o.strategy_file = next();
    else if (a == "--deterministic") o.deterministic = true;
    else if (a == "--iterations") o.iterations = std::stoull(next());
    else if (a == "--start") o.start = std::stoull(next());
    else if (a == "--seed") o.seed = std::stoull(next());
    else if (a == "--dump") o.dump = next();
    else if (a == "--bench") o.bench = true;
    else if (a == "--leave") o.leave = true;
    else if (a == "--timeout-ms") o.timeout_ms = std::stoull(next());
    else if (a == "--raw-echo") o.raw_echo = next();
    else if (a == "--start-at") o.start_at_ms = std::stoll(next());
    else if (a == "--pause-at") {
      auto kv = split(next(), ':');
      o.pause_iter = std::stoll(kv.at(0));
      o.pause_pushes = std::stoull(kv.at(1));
    } else {
      std::cerr << "unknown argument " << a << "\n";
      std::exit(2);
    }
  }
  return o;
}

// Counts outstanding completions of one iteration.
struct Waiter {
  std::mutex mu;
  std::condition_variable cv;
  size_t left = 0;
  Status first;
  void done(const Status& s) {
    std::lock_guard lk(mu);
    if (!s.ok() && first.ok()) first = s;
    if (--left == 0) cv.notify_all();
  }
  Status wait(std::chrono::milliseconds t) {
    std::unique_lock lk(mu);
    if (!cv.wait_for(lk, t, [&] { return left == 0; }))
      return first.ok() ? Status(ErrorCode::kTimeout, "iteration did not complete") : first;
    return first;
  }
};

// Sleeps until the wall-clock time the bench script gave every worker, so
// their measured loops overlap.
void wait_start(const Options& o) {
  if (o.start_at_ms <= 0) return;
  auto target = std::chrono::system_clock::time_point(std::chrono::milliseconds(o.start_at_ms));
  std::this_thread::sleep_until(target);
}

// The baseline: identical partitions, requests and payloads, over a bare
// transport to bytecomp-ps-echo (no rounds, no sums).
int raw_echo(const Options& o, const ClusterConfig& cluster) {
  transport::TransportConfig tc = cluster.transport;
  tc.node_id = o.node;
  tc.listen = {};
  auto tp = transport::make_transport(tc);
  tp->start();
  const NodeId echo = cluster.coordinator;
  tp->add_peer(echo, o.raw_echo);
  std::vector<TensorPlan> plans(o.tensors.size());
  Assignment a = assign_partitions(o.tensors, plans, {ServerInfo{echo, o.raw_echo, 1}},
                                   cluster.partition_bytes);
  std::vector<std::vector<float>> data(a.partitions.size());
  for (size_t i = 0; i < a.partitions.size(); ++i) {
    data[i].resize(a.partitions[i].count);
    testing::fill(data[i].data(), data[i].size(), o.seed, 0, a.partitions[i].tensor, 0,
                  a.partitions[i].offset);
  }
  wait_start(o);
  uint64_t bytes = 0;
  auto t0 = std::chrono::steady_clock::now();
  for (uint64_t it = 0; it < o.iterations; ++it) {
    Waiter w;
    w.left = 2 * a.partitions.size();
    std::mutex bmu;
    for (size_t i = 0; i < a.partitions.size(); ++i) {
      const Partition& p = a.partitions[i];
      const transport::Message push = proto::to_message(proto::Push{
          0, p.key, it, transport::Buffer::wrap(data[i].data(), p.count * 4, nullptr)});
      bytes += p.count * 4;
      tp->request(echo, push, std::chrono::milliseconds(o.timeout_ms),
                  [&w](transport::Response r) { w.done(r.status); });
      tp->request(echo, proto::to_message(proto::Pull{0, p.key, it}),
                  std::chrono::milliseconds(o.timeout_ms),
                  [&w, &bytes, &bmu](transport::Response r) {
                    {
                      std::lock_guard lk(bmu);
                      bytes += r.response.payload_bytes();
                    }
                    w.done(r.status);
                  });
    }
    Status st = w.wait(std::chrono::milliseconds(o.timeout_ms));
    if (!st.ok()) die(st);
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  tp->shutdown();
  std::cout << "OK raw partitions=" << a.partitions.size() << " bytes=" << bytes
            << " seconds=" << secs << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  try {
    ClusterConfig cluster = load_cluster_config(o.cluster);
    if (!o.raw_echo.empty()) return raw_echo(o, cluster);
    transport::TransportConfig tc = cluster.transport;
    tc.node_id = o.node;
    tc.listen = {};
    auto client = PsClient::create(cluster, tc);
    JobSpec spec;
    spec.name = o.job;
    spec.nodes = o.nodes;
    spec.tensors = o.tensors;
    spec.deterministic = o.deterministic;
    spec.start_iteration = o.start;
    if (!o.strategy_file.empty()) {
      std::ifstream f(o.strategy_file);
      std::stringstream ss;
      ss << f.rdbuf();
      spec.strategy_yaml = ss.str();
    }
    std::shared_ptr<PsJob> job = client->join(spec);
    const JobInfo& info = job->info();
    const auto& parts = info.assignment.partitions;
    std::ofstream dump;
    if (!o.dump.empty()) dump.open(o.dump, std::ios::binary);

    // Per partition: compressor and worker-side state (kept across iterations).
    std::vector<std::unique_ptr<compress::Compressor>> comps(parts.size());
    std::vector<std::unique_ptr<compress::TensorState>> states(parts.size());
    std::vector<TensorPlan> current(parts.size());
    std::vector<std::vector<float>> data(parts.size());
    for (size_t i = 0; i < parts.size(); ++i) data[i].resize(parts[i].count);

    wait_start(o);
    uint64_t bytes = 0;
    auto t0 = std::chrono::steady_clock::now();
    for (uint64_t it = o.start; it < o.start + o.iterations; ++it) {
      Waiter w;
      w.left = 2 * parts.size();
      std::vector<transport::Buffer> results(parts.size());
      uint64_t pushes = 0;
      for (size_t i = 0; i < parts.size(); ++i) {
        const Partition& p = parts[i];
        TensorPlan plan = job->timeline().plan(p.tensor, it);
        if (!(plan == current[i]) || (plan.compressed_push() && !comps[i])) {
          current[i] = plan;
          comps[i].reset();
          states[i].reset();
          if (plan.compressed_push()) {
            comps[i] = compress::make_compressor(plan.spec());
            states[i] = comps[i]->make_state(p.count);
          }
        }
        if (!o.bench || it == o.start)
          testing::fill(data[i].data(), p.count, o.seed, info.rank, p.tensor, it, p.offset);
        transport::Buffer payload;
        if (comps[i]) {
          std::vector<std::byte> out(comps[i]->max_compressed_bytes(p.count));
          compress::CompressContext ctx;
          ctx.iteration = it;
          ctx.shared_seed = partition_seed(info.name, p.key);
          ctx.private_seed = testing::splitmix(info.rank * 31 + p.key);
          size_t len = comps[i]->compress(compress::ConstTensorView::cpu(data[i].data(), p.count),
                                          out, *states[i], ctx);
          out.resize(len);
          payload = transport::Buffer::take(std::move(out));
        } else if (o.bench) {
          payload = transport::Buffer::wrap(data[i].data(), p.count * 4, nullptr);
        } else {
          payload = transport::Buffer::copy_of(data[i].data(), p.count * 4);
        }
        if (o.pause_iter == static_cast<int64_t>(it) && pushes == o.pause_pushes) {
          std::cout << "PAUSED" << std::endl;
          std::this_thread::sleep_for(std::chrono::seconds(60));
          std::_Exit(4);
        }
        bytes += payload.size();
        ++pushes;
        job->push(p.key, it, payload, [&w](const Status& s) { w.done(s); });
        job->pull(p.key, it, [&w, &results, i](const Status& s, transport::Buffer b) {
          if (s.ok()) results[i] = b;
          w.done(s);
        });
      }
      Status st = w.wait(std::chrono::milliseconds(o.timeout_ms));
      if (!st.ok()) die(st);
      for (size_t i = 0; i < parts.size(); ++i) {
        bytes += results[i].size();
        if (dump.is_open()) {
          uint64_t hdr[3] = {it, parts[i].key, results[i].size()};
          dump.write(reinterpret_cast<const char*>(hdr), sizeof hdr);
          dump.write(reinterpret_cast<const char*>(results[i].data()),
                     static_cast<std::streamsize>(results[i].size()));
        }
      }
    }
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (dump.is_open()) dump.close();
    Status b = job->barrier(std::chrono::milliseconds(o.timeout_ms));
    if (!b.ok()) die(b);
    if (o.leave) {
      Status l = job->leave();
      if (!l.ok()) die(l);
    }
    std::cout << "OK rank=" << info.rank << " partitions=" << parts.size() << " bytes=" << bytes
              << " seconds=" << secs << std::endl;
  } catch (const Error& e) {
    die(Status::FromError(e));
  }
  return 0;
}
