// Daemon: operator requests (bytecompctl over the control socket) and the
// Prometheus textfile; daemon/ctl.h renders what they answer.
#include <algorithm>
#include <sstream>

#include "bytecomp_build_config.h"
#include "common/prometheus.h"
#include "daemon/daemon_internal.h"

namespace bytecomp::daemon {

void Daemon::reply_ctl(Conn& c, ErrorCode code, const std::string& text) {
  if (text.size() > ipc::kMaxCtlReplyBytes) {
    return reply_ctl(c, ErrorCode::kResourceExhausted,
                     "the answer of " + std::to_string(text.size()) +
                         " bytes exceeds the limit of " + std::to_string(ipc::kMaxCtlReplyBytes));
  }
  if (!send_all(c.fd, ipc::encode_ctl_reply(static_cast<uint32_t>(code), text),
                std::chrono::milliseconds(2000))) {
    BC_LOG(LogDaemon(), kWarn) << "pid " << c.pid << ": bytecompctl did not read its answer";
  }
  disconnect(c, "control request answered");
}

void Daemon::on_ctl(Conn& c, const ipc::CtlRequest& req) {
  ++counters_.ctl_requests;
  if (c.state != Conn::State::kNew || c.ctl) {
    return reject(c, ErrorCode::kMalformed,
                  "CTL_REQUEST on a connection that already sent a request or joined a job");
  }
  c.ctl = true;
  if (req.ctl_version != ipc::kCtlVersion) {
    return reply_ctl(c, ErrorCode::kInvalidArgument,
                     "bytecompctl speaks operator protocol version " +
                         std::to_string(req.ctl_version) + ", this bytecompd " +
                         BYTECOMP_VERSION + " speaks " + std::to_string(ipc::kCtlVersion) +
                         ": use the bytecompctl of the daemon's release");
  }
  // Root and the daemon's own user see every job and may change the daemon;
  // other users see their own jobs.
  const bool privileged = c.uid == 0 || c.uid == ::geteuid();
  const std::string& cmd = req.command;
  auto deny = [&] {
    reply_ctl(c, ErrorCode::kInvalidArgument,
              "permission denied: '" + cmd + "' needs root or bytecompd's user (uid " +
                  std::to_string(::geteuid()) + "); you are uid " + std::to_string(c.uid));
  };
  if (cmd == "status") return reply_ctl(c, ErrorCode::kOk, status_json(view(privileged, c.uid)));
  if (cmd == "jobs") return reply_ctl(c, ErrorCode::kOk, jobs_json(view(privileged, c.uid)));
  if (cmd == "strategy") {
    for (auto& [key, j] : jobs_) {
      if (j->id == req.arg && (privileged || j->uid == c.uid)) {
        return reply_ctl(c, ErrorCode::kOk, strategy_json(job_view(*j, true)));
      }
    }
    return reply_ctl(c, ErrorCode::kInvalidArgument,
                     req.arg.empty() ? "strategy needs a job id (bytecompctl jobs lists them)"
                                     : "no job '" + req.arg +
                                           "' on this bytecompd (bytecompctl jobs lists them)");
  }
  if (cmd == "trace") {
    for (auto& [key, j] : jobs_) {
      if (j->id != req.arg || !(privileged || j->uid == c.uid)) continue;
      if (!j->engine) {
        return reply_ctl(c, ErrorCode::kUnavailable,
                         "job '" + req.arg + "' is still forming: no iteration to trace yet");
      }
      const std::vector<uint32_t> parts = j->engine->phase_partitions();
      if (parts.empty()) {
        return reply_ctl(c, ErrorCode::kUnavailable,
                         "job '" + req.arg + "' has no phase records: engine.phase_timestamps "
                         "was off when it started" +
                             std::string(j->num_nodes > 1
                                             ? ", or it has not joined its servers yet"
                                             : ""));
      }
      std::vector<std::string> names;
      for (const TensorSpec& t : j->specs) names.push_back(t.name);
      return reply_ctl(c, ErrorCode::kOk,
                       trace_json(j->id, names, parts, j->engine->phase_records(),
                                  monotonic_ns()));
    }
    return reply_ctl(c, ErrorCode::kInvalidArgument,
                     req.arg.empty() ? "trace needs a job id (bytecompctl jobs lists them)"
                                     : "no job '" + req.arg +
                                           "' on this bytecompd (bytecompctl jobs lists them)");
  }
  if (cmd == "loss") {
    // A training process's loss for the auto strategy's loss guard
    // (bytecomp.torch report_loss()): "JOB LOSS".
    const size_t sp = req.arg.find(' ');
    const std::string id = req.arg.substr(0, sp);
    double loss = 0;
    bool parsed = false;
    if (sp != std::string::npos) {
      try {
        size_t used = 0;
        const std::string v = req.arg.substr(sp + 1);
        loss = std::stod(v, &used);
        parsed = used == v.size();
      } catch (const std::exception&) {
        // "nan" and "inf" parse; anything else is refused below.
      }
    }
    if (!parsed)
      return reply_ctl(c, ErrorCode::kInvalidArgument,
                       "loss takes 'JOB LOSS' (a job id and a number), got '" + req.arg + "'");
    for (auto& [key, j] : jobs_) {
      if (j->id != id || !(privileged || j->uid == c.uid)) continue;
      if (!j->tuner) return reply_ctl(c, ErrorCode::kOk, "ignored: job '" + id + "' is not auto\n");
      j->tuner->report_loss(loss);
      return reply_ctl(c, ErrorCode::kOk, "ok\n");
    }
    return reply_ctl(c, ErrorCode::kInvalidArgument,
                     "no job '" + id + "' on this bytecompd (bytecompctl jobs lists them)");
  }
  if (cmd == "gpu_profile") {
    // A training process's measurement of the CUDA compressors for the auto
    // tuner's profile (bytecomp/gpu_profile.py): "JOB\n<report YAML>".
    const size_t sp = req.arg.find_first_of(" \n");
    const std::string id = req.arg.substr(0, sp);
    if (sp == std::string::npos)
      return reply_ctl(c, ErrorCode::kInvalidArgument,
                       "gpu_profile takes 'JOB' and a report (docs/gpu.md §4)");
    strategy::GpuReport report;
    try {
      report = strategy::parse_gpu_report(req.arg.substr(sp + 1), "report");
    } catch (const std::exception& e) {
      return reply_ctl(c, ErrorCode::kInvalidArgument,
                       std::string("gpu_profile: ") + e.what());
    }
    for (auto& [key, j] : jobs_) {
      if (j->id != id || !(privileged || j->uid == c.uid)) continue;
      if (!j->tuner) return reply_ctl(c, ErrorCode::kOk, "ignored: job '" + id + "' is not auto\n");
      j->tuner->report_gpu(std::move(report));
      return reply_ctl(c, ErrorCode::kOk, "ok\n");
    }
    return reply_ctl(c, ErrorCode::kInvalidArgument,
                     "no job '" + id + "' on this bytecompd (bytecompctl jobs lists them)");
  }
  if (cmd == "servers") return ask_servers(c);
  if (cmd == "metrics") {
    if (!config_.metrics_textfile_dir.empty()) write_metrics();
    return reply_ctl(c, ErrorCode::kOk, metrics_text(view(privileged, c.uid)));
  }
  if (cmd == "reload") {
    if (!privileged) return deny();
    auto [ok, what] = reload();
    return reply_ctl(c, ok ? ErrorCode::kOk : ErrorCode::kConfig, what + "\n");
  }
  if (cmd == "drain") {
    if (!privileged) return deny();
    if (req.arg != "on" && req.arg != "off") {
      return reply_ctl(c, ErrorCode::kInvalidArgument,
                       "drain takes 'on' or 'off', got '" + req.arg + "'");
    }
    draining_ = req.arg == "on";
    BC_LOG(LogDaemon(), kInfo) << (draining_ ? "draining: no new jobs accepted, "
                                             : "drain ended: accepting new jobs, ")
                               << jobs_.size() << " job(s) admitted";
    notifier_.status(draining_ ? "draining" : "serving");
    return reply_ctl(c, ErrorCode::kOk, status_json(view(true, c.uid)));
  }
  reply_ctl(c, ErrorCode::kInvalidArgument,
            "unknown command '" + cmd +
                "' (accepted: status, jobs, strategy, trace, loss, gpu_profile, servers, "
                "metrics, reload, drain)");
}

void Daemon::ask_servers(Conn& c) {
  if (!ps_client_) {
    return reply_ctl(c, ErrorCode::kUnavailable,
                     "this bytecompd has no inter-node configuration (internode.cluster_file): "
                     "it knows no parameter servers");
  }
  // Short per server: the operator waits, and a dead server must not hold
  // the answer about the others for long.
  constexpr std::chrono::milliseconds kPerServer{2000};
  server::PsClient* client = ps_client_.get();
  const int wake = wake_fd_;
  pending_ctl_.push_back(
      {c.id, std::async(std::launch::async, [client, wake, servers = servers_,
                                             coordinator = coordinator_, kPerServer] {
         std::string out = "{\"servers\":[";
         for (size_t i = 0; i < servers.size(); ++i) {
           const server::ServerInfo& s = servers[i];
           std::string entry = "{\"id\":" + std::to_string(s.id) + ",\"address\":" +
                               json_string(s.address) + ",\"coordinator\":" +
                               (s.id == coordinator ? "true" : "false");
           try {
             entry += ",\"metrics\":" + json_string(client->metrics(s.id, kPerServer)) +
                      ",\"error\":null}";
           } catch (const std::exception& e) {
             entry += ",\"metrics\":null,\"error\":" + json_string(e.what()) + "}";
           }
           out += (i ? "," : "") + entry;
         }
         out += "]}\n";
         const uint64_t one = 1;
         (void)::write(wake, &one, sizeof one);
         return out;
       })});
}

void Daemon::answer_pending_ctl() {
  for (auto it = pending_ctl_.begin(); it != pending_ctl_.end();) {
    if (it->answer.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
      ++it;
      continue;
    }
    const std::string text = it->answer.get();
    const uint64_t id = it->conn_id;
    it = pending_ctl_.erase(it);
    // The operator may have gone meanwhile (then the answer is dropped).
    for (auto& [fd, conn] : conns_) {
      if (conn->id == id && !conn->closed) {
        reply_ctl(*conn, ErrorCode::kOk, text);
        break;
      }
    }
  }
}

void Daemon::sample(Job& j) {
  // Local rank 0's completion ring: its head counts every push_pull the
  // engine completed; the entry before it is the latest. The engine may be
  // overwriting that slot meanwhile (with one tensor the ring has one slot),
  // and then it writes a completion that is being published right now: the
  // iteration read is never older than the latest at the time of the head's
  // load, which is what the gauge claims. One aligned 8-byte load.
  auto* base = static_cast<char*>(j.segment->data());
  auto* clients = reinterpret_cast<ipc::ClientArea*>(base + j.layout.clients_offset);
  const auto& head = clients[0].complete.head.value;
  const uint64_t h = head.load(std::memory_order_acquire);
  j.pushpulls = h;
  const uint32_t cap = j.layout.ring_capacity;
  if (h == 0 || cap == 0) return;
  const auto* ring = reinterpret_cast<const ipc::RingEntry*>(base + j.layout.complete_ring_offset(0));
  auto& slot = const_cast<uint64_t&>(ring[(h - 1) & (cap - 1)].iteration);
  j.last_iteration = static_cast<int64_t>(std::atomic_ref<uint64_t>(slot).load(std::memory_order_relaxed));
}

JobView Daemon::job_view(Job& j, bool with_tensors) {
  JobView v;
  v.id = j.id;
  v.uid = j.uid;
  v.state = j.engine ? "running" : "forming";
  v.local_size = j.local_size;
  for (Conn* m : j.members) v.connected += m != nullptr;
  v.started = j.started;
  v.node_rank = j.node_rank;
  v.num_nodes = j.num_nodes;
  if (j.num_nodes > 1) {
    v.nodes.assign(config_.nodes.begin(),
                   config_.nodes.begin() + std::min<size_t>(config_.nodes.size(), j.num_nodes));
  }
  v.tensors = static_cast<uint32_t>(j.reference.size());
  for (const auto& d : j.reference) v.tensor_bytes += d.count * ipc::dtype_size(d.dtype);
  v.age_seconds = std::chrono::duration<double>(Clock::now() - j.created).count();
  v.strategy_mode = j.strategy_mode;
  v.strategy_source = j.strategy_source;
  if (j.engine) {
    v.strategy_switch_iteration = j.engine->plans_switch_iteration();
    if (j.segment) sample(j);
  }
  v.pushpulls = j.pushpulls;
  v.last_iteration = j.last_iteration;
  if (j.engine) {
    const Engine::Gauges g = j.engine->gauges();
    v.engine_gauges = true;
    v.queued_partitions = g.queued_partitions;
    v.inflight_bytes = g.inflight_bytes;
    v.waiting_tensors = g.waiting_tensors;
    // Empty with engine.phase_timestamps off, or before a multi-node job
    // joined its servers.
    if (!j.engine->phase_partitions().empty()) {
      v.phase_stats = j.engine->phase_stats();
      for (size_t i = 0; i < kSpanCount; ++i) {
        v.phase_seconds[std::string(span_name(i))] =
            static_cast<double>(v.phase_stats->sum_ns[i]) / 1e9;
      }
      v.last_iteration_seconds = last_iteration_seconds(j.engine->phase_records());
    }
  }
  // Single-node plans count through their wrappers, multi-node paths
  // through the engine (PathContext::bytes).
  v.compress_counted = j.engine != nullptr;
  v.compress_input_bytes = j.bytes->input_bytes.load();
  v.compress_output_bytes = j.bytes->output_bytes.load();
  std::shared_ptr<const strategy::Strategy> in_force = j.active_strategy;
  // An auto job has no strategy in force until it joined (the coordinator
  // sends its start placement then): listing the configured one meanwhile
  // showed every tensor on the servers, ring tensors included.
  bool placement_known = true;
  if (j.tuner) {
    const AutoTuner::View t = j.tuner->view();
    v.auto_view = AutoView{t.state, t.epoch, t.predicted_us / 1e6, t.link_gbps,
                           t.link_latency_us, t.decisions, t.replans, t.last_message, t.run_dir};
    placement_known = t.joined;
    if (!t.strategy_yaml.empty()) {
      try {
        in_force = std::make_shared<const strategy::Strategy>(
            strategy::Strategy::parse(t.strategy_yaml, "auto decision"));
      } catch (const Error&) {
        // The coordinator checked it; a strategy that does not parse here
        // shows as uncompressed rather than failing the operator's request.
      }
    }
  }
  if (with_tensors && placement_known) {
    const strategy::Option none;
    for (const auto& d : j.reference) {
      const uint64_t bytes = d.count * ipc::dtype_size(d.dtype);
      const strategy::Option& o = in_force ? in_force->resolve(d.name, bytes) : none;
      v.tensor_list.push_back({d.name, ipc::dtype_name(d.dtype), d.count, bytes, o.describe(),
                               o.compressor});
    }
  }
  return v;
}

DaemonView Daemon::view(bool all_users, uid_t uid) {
  DaemonView v;
  v.version = BYTECOMP_VERSION;
  v.pid = ::getpid();
  v.start_time = std::chrono::duration<double>(started_wall_.time_since_epoch()).count();
  v.uptime_seconds = std::chrono::duration<double>(Clock::now() - started_).count();
  v.config_sources = config_.sources;
  v.socket = config_.socket_path;
  v.instance = instance_;
  v.node_id = config_.node_id;
  v.multi_node = ps_client_ != nullptr;
  v.draining = draining_;
  v.watchdog_seconds = std::chrono::duration<double>(notifier_.interval()).count();
  if (!config_.metrics_textfile_dir.empty()) {
    v.metrics_file = config_.metrics_textfile_dir + "/bytecompd.prom";
  }
  v.metrics_interval_ms = config_.metrics_interval_ms;
  for (auto& [key, j] : jobs_) {
    if (all_users || j->uid == uid) v.jobs.push_back(job_view(*j, false));
  }
  v.counters = counters_;
  return v;
}

void Daemon::write_metrics() {
  next_metrics_ = Clock::now() + std::chrono::milliseconds(config_.metrics_interval_ms);
  const std::string path = config_.metrics_textfile_dir + "/bytecompd.prom";
  try {
    prom::write_atomically(path, metrics_text(view(true, 0)));
    ++counters_.metrics_writes;
  } catch (const Error& e) {
    // Once per interval at most: the next attempt is next_metrics_ away.
    BC_LOG(LogDaemon(), kWarn) << "metrics: " << e.what();
    ++counters_.metrics_write_failures;
  }
}

}  // namespace bytecomp::daemon
