// ServerConfig::load: server.yaml and the cluster config it names.
#include <filesystem>

#include "common/config.h"
#include "common/logging_config.h"
#include "server/ps_server.h"

namespace bytecomp::server {


ServerConfig ServerConfig::load(const std::optional<std::string>& path) {
  using config::Range;
  config::Document doc = config::Document::locate(path, "server.yaml");
  config::Reader root = doc.root("BYTECOMP_SERVER");
  ServerConfig c;
  config::Reader s = root.section("server");
  std::string cluster_file = "cluster.yaml";
  s.require("node_id");
  s.get("node_id", c.node_id, Range<uint32_t>{0, 0xFFFFFFFEu})
      .get("cluster_file", cluster_file)
      .get("engine_threads", c.engine_threads, Range<uint32_t>{1, 256})
      .get_bytes("max_job_bytes", c.max_job_bytes, Range<uint64_t>{1ull << 20, 1ull << 42})
      .get_bytes("max_total_bytes", c.max_total_bytes, Range<uint64_t>{1ull << 20, 1ull << 44})
      .get("max_jobs", c.max_jobs, Range<uint32_t>{1, 100000})
      .get("local_shm", c.local_shm);
  if (c.max_total_bytes < c.max_job_bytes)
    s.fail("max_total_bytes",
           std::to_string(c.max_total_bytes) + " is below max_job_bytes " +
               std::to_string(c.max_job_bytes),
           ">= server.max_job_bytes");
  std::filesystem::path cf(cluster_file);
  if (cf.is_relative() && !doc.is_defaults())
    cf = std::filesystem::path(doc.name()).parent_path() / cf;
  try {
    c.cluster = load_cluster_config(cf.string());
  } catch (const Error& e) {
    s.fail("cluster_file", e.what(), "a valid cluster config (configs/cluster.yaml)");
  }
  if (!c.cluster.server(c.node_id))
    s.fail("node_id",
           "server " + std::to_string(c.node_id) + " is not listed in " + cf.string(),
           "the id of one of cluster.servers");
  s.finish();
  config::Reader t = root.section("transport");
  bool listen_given = t.has("listen");
  c.transport = transport::read_transport_config(t);
  c.transport.node_id = c.node_id;
  if (!listen_given) c.transport.listen = {c.cluster.server(c.node_id)->address};
  c.metrics = MetricsConfig::read(root);
  config::apply_logging_section(root);
  root.finish();
  return c;
}

}  // namespace bytecomp::server
