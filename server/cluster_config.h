// The cluster description every party reads (configs/cluster.yaml):
//
//   version: 1
//   cluster:
//     coordinator: 0                # id of the server that runs rendezvous
//     partition_bytes: 4MiB
//     servers:
//       - {id: 0, address: "tcp://10.0.0.1:9100", engine_threads: 4}
//     daemons:                      # optional: known daemons (admission
//       - {id: 100, address: "tcp://10.0.0.2:9200"}   # names them in errors)
//     timeouts:
//       admission_ms: 30000         # all nodes must register within this
//       request_ms: 30000           # push/pull/barrier default deadline
//       setup_ms: 10000             # coordinator -> server job setup
//   transport: {...}                # optional; see transport.h (CURVE keys here)
//
// A server whose address has port 0 binds an ephemeral port and reports the
// real address to the coordinator; clients learn server addresses from the
// coordinator at admission, so only the coordinator's address must be real.
//
// Thread-safety: plain values.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "server/job.h"
#include "transport/transport.h"

namespace bytecomp::config {
class Reader;
}

namespace bytecomp::server {

struct DaemonInfo {
  NodeId id = 0;
  std::string address;  // informational (errors, tools); may be empty
};

struct ClusterConfig {
  NodeId coordinator = 0;
  uint64_t partition_bytes = 4ull << 20;
  std::vector<ServerInfo> servers;
  std::vector<DaemonInfo> daemons;
  std::chrono::milliseconds admission_timeout{30000};
  std::chrono::milliseconds request_timeout{30000};
  std::chrono::milliseconds setup_timeout{10000};
  // The file's optional `transport:` section (defaults when absent).
  transport::TransportConfig transport;

  const ServerInfo* server(NodeId id) const;
  const ServerInfo& coordinator_info() const;  // validated to exist
  // "node 101 (tcp://...)" for messages.
  std::string describe_node(NodeId id) const;
};

// Reads the `cluster:` section and the optional `transport:` section of
// `root`, validates (unique ids, coordinator among the servers, a server id
// never a daemon id) and calls finish() on what it read. Throws
// config::ConfigError naming file, line and key.
ClusterConfig read_cluster_config(config::Reader& root);
// Document::locate(path, "cluster.yaml") + root("BYTECOMP_CLUSTER") + finish.
ClusterConfig load_cluster_config(const std::optional<std::string>& path);

}  // namespace bytecomp::server
