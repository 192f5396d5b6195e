// bytecompd's configuration (configs/daemon.yaml documents every key).
//
// Thread-safety: DaemonConfig is a plain value. The reloadable part is
// published to running jobs through Tunables (atomics), so SIGHUP changes
// take effect at a job's next scheduling step without locks.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/config.h"
#include "planner/strategy/auto_spec.h"

namespace bytecomp::daemon {

struct DaemonConfig {
  // control: not reloadable (needs a restart).
  std::string socket_path = "/run/bytecomp/bytecompd.sock";
  uint32_t socket_mode = 0666;  // access is checked per peer (SO_PEERCRED)
  bool allow_other_users = false;
  // shm: not reloadable.
  std::string instance;  // empty: derived from socket_path
  uint64_t max_job_bytes = 16ull << 30;
  // compute: not reloadable.
  int threads = 2;
  // Reloadable.
  uint32_t setup_timeout_ms = 60000;
  uint64_t partition_bytes = 4ull << 20;  // new jobs only
  uint64_t max_inflight_bytes = 64ull << 20;
  // Multi-node pushes: per server link, at most this many partitions'
  // bytes (link_window x partition_bytes, on the wire) unacknowledged; 0:
  // only max_inflight_bytes bounds them.
  uint32_t link_window = 2;
  // Strategy file (planner's format); empty: every tensor uncompressed.
  // Reloadable: running jobs switch at an iteration boundary.
  std::string strategy_file;
  // strategy.mode: "file" (strategy_file, or uncompressed) or "auto" (the
  // runtime profiles each multi-node job and plans its strategy, within
  // auto_spec; docs/auto.md). Reloadable for new jobs.
  std::string strategy_mode = "file";
  strategy::AutoSpec auto_spec;
  // Where each auto job's decision is written (<run_dir>/<job>/); empty:
  // <directory of control.socket>/runs.
  std::string run_dir;
  // internode: not reloadable. Multi-node jobs go through the parameter
  // servers of cluster_file; node_rank r of a job is daemon nodes[r].
  std::string cluster_file;
  uint32_t node_id = 0;
  std::vector<uint32_t> nodes;
  // Endpoint the other nodes' daemons reach this one on for peer allgather
  // (tcp://host:port, port 0 = ephemeral; ipc:///path); sent to them through
  // the coordinator at each job's admission. Empty: no peer allgather.
  std::string peer_listen;
  // The partitions owned by the parameter server on this host travel
  // through shared memory instead of loopback sockets when that server
  // agrees (server.local_shm); otherwise, and for every other server, over
  // the network (server/local_shm.h).
  bool local_shm = true;
  // Chunk size of the ring allreduce (inter: allreduce) and of the
  // broadcast chain, 64 B .. 1 MiB, a multiple of 4; every node of a job
  // must use the same.
  uint64_t ring_chunk_bytes = 1u << 20;
  // fusion (reloadable, new jobs): tensor fusion of multi-node jobs
  // (server/fusion.h); every node of a job must have the same values (the
  // coordinator refuses the job otherwise). Auto jobs never fuse.
  bool fusion_enabled = false;
  uint64_t fusion_first_bucket_bytes = 1ull << 20;
  uint64_t fusion_bucket_cap_bytes = 25ull << 20;
  // How long a bucket waits for a member that some local rank has not pushed
  // in the bucket's iteration before it fails the job naming the member
  // (an unused parameter would otherwise hold its bucket for ever). Local to
  // this node: nodes may differ. Reloadable (running jobs too).
  uint32_t fusion_member_timeout_ms = 20000;
  // metrics (reloadable): Prometheus textfile (bytecompd.prom) in this
  // directory every interval_ms; empty: no file (bytecompctl metrics still
  // answers).
  std::string metrics_textfile_dir;
  uint32_t metrics_interval_ms = 5000;
  // The files read (main file, then drop-ins); empty: built-in defaults.
  std::vector<std::string> sources;
  // engine: reloadable, new jobs only. Per-partition phase timestamps
  // (daemon/engine_phases.h).
  bool phase_timestamps = true;

  // Throws config::ConfigError naming file, line, key and accepted values.
  // Applies the `logging:` section (and BYTECOMP_LOG) as a side effect.
  static DaemonConfig parse(const config::Document& doc);
};

// The reloadable knobs as seen by running jobs.
struct Tunables {
  std::atomic<uint32_t> setup_timeout_ms{60000};
  std::atomic<uint64_t> partition_bytes{4ull << 20};
  std::atomic<uint64_t> max_inflight_bytes{64ull << 20};
  std::atomic<uint32_t> link_window{2};
  std::atomic<bool> phase_timestamps{true};
  std::atomic<uint32_t> fusion_member_timeout_ms{20000};

  void apply(const DaemonConfig& c) {
    fusion_member_timeout_ms.store(c.fusion_member_timeout_ms);
    phase_timestamps.store(c.phase_timestamps);
    setup_timeout_ms.store(c.setup_timeout_ms);
    partition_bytes.store(c.partition_bytes);
    max_inflight_bytes.store(c.max_inflight_bytes);
    link_window.store(c.link_window);
  }
};

}  // namespace bytecomp::daemon
