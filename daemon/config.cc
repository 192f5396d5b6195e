#include "daemon/config.h"

#include "common/logging_config.h"

namespace bytecomp::daemon {

DaemonConfig DaemonConfig::parse(const config::Document& doc) {
  using config::Range;
  DaemonConfig c;
  config::Reader root = doc.root("BYTECOMPD");

  config::Reader control = root.section("control");
  uint32_t mode = c.socket_mode;
  control.get("socket", c.socket_path)
      .get("socket_mode", mode, Range<uint32_t>{0, 0777})
      .get("allow_other_users", c.allow_other_users)
      .get("setup_timeout_ms", c.setup_timeout_ms, Range<uint32_t>{100, 3600000});
  if (c.socket_path.empty() || c.socket_path.front() != '/') {
    control.fail("socket", "'" + c.socket_path + "' is not an absolute path", "an absolute path");
  }
  if (c.socket_path.size() > 107) {
    control.fail("socket", "path is " + std::to_string(c.socket_path.size()) + " bytes long",
                 "at most 107 bytes (sockaddr_un)");
  }
  c.socket_mode = mode;
  control.finish();

  config::Reader shm = root.section("shm");
  shm.get("instance", c.instance)
      .get_bytes("max_job_bytes", c.max_job_bytes, Range<uint64_t>{1ull << 20, 1ull << 40});
  for (char ch : c.instance) {
    if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
          ch == '_' || ch == '-') ||
        c.instance.size() > 32) {
      shm.fail("instance", "'" + c.instance + "' is not a valid instance name",
               "1..32 characters of [A-Za-z0-9_-], or empty for a name derived from the socket");
    }
  }
  shm.finish();

  config::Reader sched = root.section("scheduler");
  sched.get("threads", c.threads, Range<int>{0, 256})
      .get_bytes("partition_bytes", c.partition_bytes, Range<uint64_t>{4096, 1ull << 30})
      .get_bytes("max_inflight_bytes", c.max_inflight_bytes, Range<uint64_t>{4096, 1ull << 40})
      .get("link_window", c.link_window, Range<uint32_t>{0, 1024});
  if (c.max_inflight_bytes < c.partition_bytes) {
    sched.fail("max_inflight_bytes",
               std::to_string(c.max_inflight_bytes) + " is below partition_bytes " +
                   std::to_string(c.partition_bytes),
               ">= scheduler.partition_bytes");
  }
  sched.finish();

  config::Reader inter = root.section("internode");
  std::vector<std::string> nodes;
  inter.get("cluster_file", c.cluster_file)
      .get("node_id", c.node_id, Range<uint32_t>{0, 0xFFFFFFFEu})
      .get("nodes", nodes)
      .get("peer_listen", c.peer_listen)
      .get("local_shm", c.local_shm)
      .get_bytes("ring_chunk_bytes", c.ring_chunk_bytes, Range<uint64_t>{64, 1u << 20});
  if (c.ring_chunk_bytes % 4 != 0) {
    inter.fail("ring_chunk_bytes", std::to_string(c.ring_chunk_bytes) + " is not a multiple of 4",
               "64 B to 1 MiB, a multiple of 4 (whole fp32 elements)");
  }
  for (const std::string& n : nodes) {
    try {
      size_t used = 0;
      const unsigned long v = std::stoul(n, &used);
      if (used != n.size() || v > 0xFFFFFFFEul) throw std::out_of_range(n);
      c.nodes.push_back(static_cast<uint32_t>(v));
    } catch (const std::exception&) {
      inter.fail("nodes", "'" + n + "' is not a node id", "a list of daemon node ids (integers)");
    }
  }
  if (!c.cluster_file.empty() && c.nodes.empty()) {
    inter.fail("nodes", "empty while cluster_file is set",
               "the daemons' node ids in node-rank order, this daemon's node_id among them");
  }
  if (!c.peer_listen.empty()) {
    const bool scheme = c.peer_listen.rfind("tcp://", 0) == 0 ||
                        c.peer_listen.rfind("ipc://", 0) == 0 ||
                        c.peer_listen.rfind("rdma://", 0) == 0;
    if (!scheme || c.peer_listen.size() > 1024) {
      inter.fail("peer_listen", "'" + c.peer_listen + "' is not an endpoint",
                 "tcp://HOST:PORT (port 0: ephemeral), ipc:///PATH, or rdma://HOST:PORT with the "
                 "rdma backend; empty: no peer allgather");
    }
    if (c.cluster_file.empty()) {
      inter.fail("peer_listen", "set while cluster_file is empty",
                 "a cluster_file too (peers are found through its coordinator)");
    }
  }
  inter.finish();

  config::Reader fusion = root.section("fusion");
  fusion.get("enabled", c.fusion_enabled)
      .get_bytes("first_bucket_bytes", c.fusion_first_bucket_bytes,
                 Range<uint64_t>{4096, 1ull << 34})
      .get_bytes("bucket_cap_bytes", c.fusion_bucket_cap_bytes, Range<uint64_t>{4096, 1ull << 34})
      .get("member_timeout_ms", c.fusion_member_timeout_ms, Range<uint32_t>{100, 3600000});
  if (c.fusion_first_bucket_bytes > c.fusion_bucket_cap_bytes) {
    fusion.fail("first_bucket_bytes",
                std::to_string(c.fusion_first_bucket_bytes) + " is above bucket_cap_bytes " +
                    std::to_string(c.fusion_bucket_cap_bytes),
                "4 KiB to bucket_cap_bytes (the first bucket is the small one)");
  }
  fusion.finish();

  config::Reader strategy = root.section("strategy");
  strategy.get_enum("mode", c.strategy_mode, {"file", "auto"}).get("file", c.strategy_file).get("run_dir", c.run_dir);
  c.auto_spec = strategy::AutoSpec::read(strategy);
  if (c.strategy_mode == "auto" && !c.strategy_file.empty())
    strategy.fail("file", "set with mode: auto", "mode: file with a file, or mode: auto without one");
  if (!c.run_dir.empty() && c.run_dir.front() != '/')
    strategy.fail("run_dir", "'" + c.run_dir + "' is not an absolute path", "an absolute directory path");
  strategy.finish();

  config::Reader metrics = root.section("metrics");
  metrics.get("textfile_dir", c.metrics_textfile_dir)
      .get("interval_ms", c.metrics_interval_ms, Range<uint32_t>{500, 3600000});
  if (!c.metrics_textfile_dir.empty() && c.metrics_textfile_dir.front() != '/') {
    metrics.fail("textfile_dir", "'" + c.metrics_textfile_dir + "' is not an absolute path",
                 "an absolute directory path, or empty for no file");
  }
  metrics.finish();
  c.sources = doc.sources();
  config::Reader engine = root.section("engine");
  engine.get("phase_timestamps", c.phase_timestamps);
  engine.finish();

  // Last, so a bad key elsewhere leaves the log levels untouched.
  config::apply_logging_section(root);
  root.finish();
  return c;
}

}  // namespace bytecomp::daemon
