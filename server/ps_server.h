// bytecomp-server: the parameter server (sums pushes per partition and
// iteration, answers pulls) and, on the server named in the cluster config,
// the job coordinator (rendezvous, admission, strategy changes, barrier,
// failure notification). docs/server.md describes the protocol and rounds.
//
// Structure (server/):
//   * ps_server.cc: one transport (its handler threads parse and route
//     messages), the engine threads, job setup and end, strategy prepare;
//   * `engine_threads` engine threads (engine_thread.h); every partition
//     belongs to one engine (from the assignment), which alone runs the
//     partition's round (rounds.h: push accounting, sum, answers, release),
//     so the data path takes no lock shared across partitions (a job's plan
//     lock, JobPlans, is taken once per round, to fix the round's plan);
//   * the coordinator (coordinator.h) keeps its state behind its own mutex
//     and one timer thread (admission deadlines); it is on the control path
//     only;
//   * config.cc: ServerConfig::load.
//
// Threading: ParameterServer is thread-safe; shutdown() may be called from
// any thread except the transport's and engines' own.
// Lock order (where two meet): Coordinator::mu_ before the server's jobs_mu
// before a job's locks (JobPlans' and ServerJob::mu, never held together).
// No lock is held while calling into the transport.
// Ownership: the server owns its transport, engines and jobs; a job's memory
// goes away when the job ends or is aborted and its last queued engine task
// has run.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "server/cluster_config.h"
#include "server/metrics.h"
#include "transport/transport.h"

namespace bytecomp::server {

struct ServerConfig {
  NodeId node_id = 0;
  uint32_t engine_threads = 2;
  uint64_t max_job_bytes = 4ull << 30;     // reservation per job
  uint64_t max_total_bytes = 16ull << 30;  // reservation over all jobs
  uint32_t max_jobs = 64;
  // Serve the nodes on this host through shared memory (kShmAttach) instead
  // of loopback sockets. Key server.local_shm.
  bool local_shm = true;
  ClusterConfig cluster;
  transport::TransportConfig transport;  // listen defaults to this server's cluster address
  MetricsConfig metrics;

  // server.yaml (Document::locate(path, "server.yaml"), env prefix
  // BYTECOMP_SERVER): sections server, transport, metrics (server/metrics.h),
  // logging. server.cluster_file (relative to server.yaml's directory) names
  // the cluster config. Throws config::ConfigError naming file, line and key.
  static ServerConfig load(const std::optional<std::string>& path);
};

class ParameterServer {
 public:
  // Binds, starts engines and handlers; a non-coordinator server registers
  // with the coordinator in the background (retrying until it answers).
  // Throws Error on bind/config failure.
  explicit ParameterServer(ServerConfig config);
  ~ParameterServer();
  ParameterServer(const ParameterServer&) = delete;
  ParameterServer& operator=(const ParameterServer&) = delete;

  std::vector<std::string> addresses() const;
  // Prometheus text of the server's counters (server/metrics.h).
  // Thread-safe.
  std::string metrics_text() const;
  // Aborts every job (pending pulls answered with kUnavailable), stops the
  // transport and joins every thread. Idempotent.
  void shutdown();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace bytecomp::server
