#include "server/cluster_config.h"

#include <set>

#include "common/config.h"

namespace bytecomp::server {

const ServerInfo* ClusterConfig::server(NodeId id) const {
  for (const ServerInfo& s : servers)
    if (s.id == id) return &s;
  return nullptr;
}

const ServerInfo& ClusterConfig::coordinator_info() const {
  const ServerInfo* s = server(coordinator);
  if (!s)
    throw Error(ErrorCode::kConfig,
                "coordinator " + std::to_string(coordinator) + " is not among the servers");
  return *s;
}

std::string ClusterConfig::describe_node(NodeId id) const {
  std::string s = "node " + std::to_string(id);
  for (const DaemonInfo& d : daemons)
    if (d.id == id && !d.address.empty()) s += " (" + d.address + ")";
  return s;
}

ClusterConfig read_cluster_config(config::Reader& root) {
  using config::Range;
  ClusterConfig c;
  config::Reader cl = root.section("cluster");
  cl.require("coordinator").require("servers");
  cl.get("coordinator", c.coordinator)
      .get_bytes("partition_bytes", c.partition_bytes, Range<uint64_t>{4096, 1ull << 30});
  std::set<NodeId> ids;
  for (config::Reader& r : cl.list("servers")) {
    ServerInfo s;
    r.require("id").require("address");
    r.get("id", s.id, Range<uint32_t>{0, 0xFFFFFFFEu})
        .get("address", s.address)
        .get("engine_threads", s.engine_threads, Range<uint32_t>{1, 256});
    if (s.address.rfind("tcp://", 0) != 0 && s.address.rfind("ipc://", 0) != 0 &&
        s.address.rfind("rdma://", 0) != 0)
      r.fail("address", "'" + s.address + "' is not an endpoint",
             "tcp://host:port, ipc:///path or rdma://host:port");
    if (!ids.insert(s.id).second)
      r.fail("id", "server id " + std::to_string(s.id) + " is used twice", "unique node ids");
    r.finish();
    c.servers.push_back(std::move(s));
  }
  if (c.servers.empty()) cl.fail("servers", "no servers listed", "at least one server");
  for (config::Reader& r : cl.list("daemons")) {
    DaemonInfo d;
    r.require("id");
    r.get("id", d.id, Range<uint32_t>{0, 0xFFFFFFFEu}).get("address", d.address);
    if (!ids.insert(d.id).second)
      r.fail("id", "node id " + std::to_string(d.id) + " is used twice", "unique node ids");
    r.finish();
    c.daemons.push_back(std::move(d));
  }
  if (!c.server(c.coordinator))
    cl.fail("coordinator", "server " + std::to_string(c.coordinator) + " is not listed",
            "the id of one of cluster.servers");
  config::Reader t = cl.section("timeouts");
  uint32_t adm = 30000, req = 30000, setup = 10000;
  t.get("admission_ms", adm, Range<uint32_t>{100, 3600000})
      .get("request_ms", req, Range<uint32_t>{100, 3600000})
      .get("setup_ms", setup, Range<uint32_t>{100, 3600000});
  t.finish();
  c.admission_timeout = std::chrono::milliseconds(adm);
  c.request_timeout = std::chrono::milliseconds(req);
  c.setup_timeout = std::chrono::milliseconds(setup);
  cl.finish();
  config::Reader tr = root.section("transport");
  c.transport = transport::read_transport_config(tr);
  return c;
}

ClusterConfig load_cluster_config(const std::optional<std::string>& path) {
  config::Document doc = config::Document::locate(path, "cluster.yaml");
  config::Reader root = doc.root("BYTECOMP_CLUSTER");
  ClusterConfig c = read_cluster_config(root);
  root.finish();
  return c;
}

}  // namespace bytecomp::server
