// Daemon: assembling a job once every local rank started (strategy mode,
// the cluster's job declaration, the engine), ending it, and SIGHUP reloads.
#include <unistd.h>

#include <algorithm>
#include <sstream>

#include "daemon/daemon_internal.h"

namespace bytecomp::daemon {

std::shared_ptr<const strategy::Strategy> Daemon::load_strategy() const {
  if (config_.strategy_file.empty()) return nullptr;
  return std::make_shared<const strategy::Strategy>(
      strategy::Strategy::load_file(config_.strategy_file));
}


void Daemon::maybe_start(Job& j) {
  if (j.started != j.local_size) return;
  // mode: auto, from the job's own text or the daemon's configuration.
  std::optional<strategy::AutoSpec> auto_spec;
  if (j.strategy) {
    try {
      auto_spec = strategy::AutoSpec::parse_job_text(j.strategy->text, j.strategy->source);
      if (!auto_spec)
        j.own_strategy = std::make_shared<const strategy::Strategy>(
            strategy::Strategy::parse(j.strategy->text, j.strategy->source));
    } catch (const Error& e) {
      abort_job(j, ErrorCode::kInvalidArgument,
                "cannot start the job: the job's strategy '" + j.strategy->source +
                    "' is invalid: " + e.what());
      return;
    }
  }
  if (!j.strategy && config_.strategy_mode == "auto") auto_spec = config_.auto_spec;
  if (auto_spec && j.num_nodes <= 1) {
    BC_LOG(LogDaemon(), kInfo) << "job " << j.id << ": strategy auto on one node: every tensor "
                               << "stays uncompressed (nothing crosses a network)";
  }
  const bool auto_job = auto_spec && j.num_nodes > 1;
  // The job's own strategy overrides the daemon's default for this job only;
  // an auto job starts uncompressed (its warm-up is the profile).
  const std::shared_ptr<const strategy::Strategy> strategy =
      auto_spec ? nullptr : j.own_strategy ? j.own_strategy : strategy_;
  const std::string strategy_source =
      j.own_strategy ? j.strategy->source : config_.strategy_file;
  const std::string strategy_text = j.own_strategy ? j.strategy->text : strategy_text_;
  Engine::JoinFn join;
  if (j.num_nodes > 1) {
    std::string problem;
    if (!ps_client_) {
      problem = "this bytecompd has no inter-node path configured (set internode.cluster_file, "
                "node_id and nodes in its configuration)";
    } else if (config_.nodes.size() < j.num_nodes) {
      problem = "internode.nodes lists " + std::to_string(config_.nodes.size()) + " daemons";
    } else if (config_.nodes[j.node_rank] != config_.node_id) {
      problem = "node rank " + std::to_string(j.node_rank) + " is daemon " +
                std::to_string(config_.nodes[j.node_rank]) + " in internode.nodes, but this is " +
                std::to_string(config_.node_id) + " (connect to the right node's daemon)";
    }
    server::JobSpec spec;
    spec.name = j.id;
    spec.nodes.assign(config_.nodes.begin(), config_.nodes.begin() + std::min<size_t>(
                                                                      config_.nodes.size(), j.num_nodes));
    for (const auto& d : j.reference) {
      if (d.dtype != ipc::DType::kFloat32 && problem.empty()) {
        problem = "tensor '" + d.name + "' is " + ipc::dtype_name(d.dtype) +
                  ": the parameter servers sum float32 only";
      }
      spec.tensors.push_back({d.name, d.count, compress::DType::kFloat32});
    }
    if (strategy) spec.strategy_yaml = strategy_text;
    // An auto job changes its tensors' plans one by one: never fused.
    spec.fusion.enabled = config_.fusion_enabled && !auto_job;
    spec.fusion.first_bucket_bytes = config_.fusion_first_bucket_bytes;
    spec.fusion.bucket_cap_bytes = config_.fusion_bucket_cap_bytes;
    // An auto job registers no strategy but its settings: the coordinator
    // decides its start placement (strategy::start_strategy_yaml) from
    // inputs every node shares and sends it in the admission, which every
    // party's plans come from (a daemon's own scheduler.partition_bytes or
    // peer endpoint would make the nodes disagree).
    if (auto_job) spec.auto_spec_yaml = auto_spec->to_yaml();
    if (problem.empty()) {
      try {
        for (const auto& plan : strategy::plans_for(strategy::Scope::kCluster, spec.tensors,
                                                     spec.strategy_yaml, "strategy")) {
          if (strategy::between_daemons(plan.placement) && !peer_hub_) {
            problem = std::string("a tensor's strategy uses inter: ") +
                      (plan.placement == strategy::Placement::kPeer ? "allgather"
                                                                    : "allreduce (a ring)") +
                      " between daemons, but this bytecompd has no peer endpoint (set "
                      "internode.peer_listen)";
            break;
          }
        }
      } catch (const Error& e) {
        problem = e.what();
      }
    }
    if (peer_hub_) spec.peer_address = peer_hub_->address();
    if (!problem.empty()) {
      abort_job(j, ErrorCode::kUnavailable,
                "job '" + j.id + "' spans " + std::to_string(j.num_nodes) + " nodes: " + problem);
      return;
    }
    server::PsClient* client = ps_client_.get();
    const auto timeout = admission_timeout_;
    join = [client, spec, timeout] { return client->join(spec, timeout); };
  }
  std::vector<uint64_t> sizes;
  std::vector<TensorSpec> specs;
  uint64_t total = 0;
  for (const auto& d : j.reference) {
    const uint64_t b = d.count * ipc::dtype_size(d.dtype);
    sizes.push_back(b);
    specs.push_back({d.name, d.count, d.dtype});
    j.specs.push_back(specs.back());
    total += b;
  }
  try {
    const ipc::Layout layout = ipc::Layout::compute(j.local_size, sizes);
    if (layout.total_bytes > config_.max_job_bytes) {
      throw Error(ErrorCode::kResourceExhausted,
                  "job needs " + std::to_string(layout.total_bytes) +
                      " bytes of shared memory (tensors of " + std::to_string(total) +
                      " bytes x " + std::to_string(j.local_size) +
                      " local ranks), more than shm.max_job_bytes " +
                      std::to_string(config_.max_job_bytes));
    }
    const std::string name = segment_prefix(instance_) + std::to_string(::getpid()) + "." +
                             std::to_string(next_job_seq_++);
    Job* jp = &j;
    const int wake = wake_fd_;
    // Multi-node jobs follow the coordinator's plans (ps_->timeline()).
    std::vector<TensorPlan> plans = counting_plans(
        strategy && !join ? make_plans(*strategy, strategy_source, specs)
                          : uncompressed_plans(specs.size()),
        j.bytes);
    j.layout = layout;
    j.active_strategy = strategy;
    j.strategy_mode = auto_spec ? (j.strategy ? "job-auto" : "auto")
                      : j.own_strategy ? "job" : strategy ? "daemon" : "none";
    j.strategy_source = strategy ? strategy_source : std::string();
    if (strategy && join) (void)make_plans(*strategy, strategy_source, specs);
    if (auto_job) {
      AutoTuner::Options to;
      to.job = j.id;
      to.spec = *auto_spec;
      for (const auto& d : j.reference) {
        to.names.push_back(d.name);
        to.elements.push_back(d.count);
      }
      to.local_ranks = j.local_size;
      to.pool_threads = static_cast<uint32_t>(pool_.concurrency());
      for (const Conn* m : j.members)
        if (m) to.pids.push_back(m->pid);
      to.run_dir = run_dir_for(config_, j.id);
      j.tuner = std::make_shared<AutoTuner>(std::move(to));
    }
    j.segment = std::make_shared<Segment>(name, layout.total_bytes, j.uid, j.gid);
    Engine::Options eo;
    eo.job = j.id;
    eo.segment = j.segment->data();
    eo.layout = layout;
    eo.tensors = std::move(specs);
    eo.plans = std::move(plans);
    eo.node_rank = j.node_rank;
    eo.on_failure = [jp, wake](ErrorCode code, const std::string& reason) {
      {
        std::lock_guard lock(jp->fail_mu);
        jp->failed = true;
        jp->fail_code = code;
        jp->fail_reason = reason;
      }
      const uint64_t one = 1;
      (void)::write(wake, &one, sizeof one);
    };
    eo.join = std::move(join);
    if (eo.join) {
      std::weak_ptr<AutoTuner> weak = j.tuner;  // empty unless an auto job
      eo.on_joined = [jp, weak](Engine& e, const std::shared_ptr<server::PsJob>& ps, uint64_t pb) {
        {
          std::lock_guard lock(jp->ps_mu);
          jp->ps = ps;
        }
        if (auto t = weak.lock()) t->attach(e, ps, pb);
      };
    }
    eo.peers = PeerOptions{peer_hub_.get(), request_timeout_, config_.ring_chunk_bytes};
    eo.keep_mapped = j.segment;
    // Multi-node paths compress with the coordinator's plans: counted inside.
    if (eo.join) eo.bytes = j.bytes;
    j.engine = std::make_unique<Engine>(std::move(eo), pool_, tunables_);
    for (Conn* m : j.members) {
      m->state = Conn::State::kRunning;
      send_msg(m->fd, ipc::encode(ipc::Ready{name, layout.total_bytes}));
    }
    ++counters_.jobs_started;
    BC_LOG(LogDaemon(), kInfo) << "job " << j.id << " running: " << j.reference.size()
                               << " tensors, segment " << name << " (" << layout.total_bytes
                               << " bytes)";
  } catch (const Error& e) {
    abort_job(j, e.code(), std::string("cannot start the job: ") + e.what());
  }
}

void Daemon::abort_job(Job& j, ErrorCode code, std::string reason) {
  if (j.engine) {
    // The first abort stands, on the socket as in shared memory: a client
    // that read an engine failure from shared memory and exited must not
    // make the others see "local rank 1 ... disconnected" instead of the
    // cause (the control thread may see that socket close before it reaps
    // the engine's failure).
    auto [first_code, first] = j.engine->publish_abort(code, reason);
    if (first != reason) {
      BC_LOG(LogDaemon(), kInfo) << "job " << j.id << ": " << reason << " (after the abort)";
      code = first_code;
      reason = std::move(first);
    }
    if (j.tuner) j.tuner->stop();
    j.engine->stop();
  }
  BC_LOG(LogDaemon(), kWarn) << "job " << j.id << " aborted: " << reason;
  j.aborted = true;
  ++counters_.aborts[std::string(to_string(code))];
  const auto msg = ipc::encode(ipc::ErrorMsg{static_cast<uint32_t>(code), reason},
                               j.engine ? ipc::MsgType::kAbort : ipc::MsgType::kError);
  for (Conn* m : j.members) {
    if (m == nullptr || m->closed) continue;
    send_msg(m->fd, msg);
    m->job = nullptr;
    disconnect(*m, "job aborted");
  }
  finish_job(j);
}

void Daemon::finish_job(Job& j) {
  for (Conn* m : j.members) {
    if (m != nullptr) m->job = nullptr;
  }
  // Every rank that left with BYE has its results: the counts are final.
  if (j.engine && j.segment) sample(j);
  counters_.pushpulls += j.pushpulls;
  counters_.compress_input_bytes += j.bytes->input_bytes.load();
  counters_.compress_output_bytes += j.bytes->output_bytes.load();
  if (j.engine && !j.aborted) ++counters_.jobs_finished;
  if (j.tuner) j.tuner->stop();
  j.tuner.reset();
  j.engine.reset();
  if (j.segment) j.segment->unlink();
  j.segment.reset();
  BC_LOG(LogDaemon(), kInfo) << "job " << j.id << " ended";
  jobs_.erase(j.key);
}

void Daemon::reap_failed_jobs() {
  std::vector<Job*> failed;
  for (auto& [k, j] : jobs_) {
    std::lock_guard lock(j->fail_mu);
    if (j->failed) failed.push_back(j.get());
  }
  for (Job* j : failed) {
    ErrorCode code;
    std::string reason;
    {
      std::lock_guard lock(j->fail_mu);
      code = j->fail_code;
      reason = j->fail_reason;
    }
    abort_job(*j, code, reason);
  }
}

void Daemon::check_setup_deadlines() {
  const auto now = Clock::now();
  // A connection that never says HELLO must not hold a descriptor forever.
  const auto hello_bound = std::chrono::milliseconds(tunables_.setup_timeout_ms.load());
  for (auto& [fd, c] : conns_) {
    // An operator's connection waits for its answer (ask_servers), not HELLO.
    if (!c->closed && c->state == Conn::State::kNew && !c->ctl &&
        now - c->accepted_at > hello_bound) {
      reject(*c, ErrorCode::kTimeout, "no HELLO within control.setup_timeout_ms");
    }
  }
  std::vector<Job*> late;
  for (auto& [k, j] : jobs_) {
    if (!j->engine && now > j->setup_deadline) late.push_back(j.get());
  }
  for (Job* j : late) {
    uint32_t joined = 0;
    for (Conn* m : j->members) joined += m != nullptr;
    abort_job(*j, ErrorCode::kTimeout,
              "job '" + j->id + "' did not start within control.setup_timeout_ms (" +
                  std::to_string(tunables_.setup_timeout_ms.load()) + " ms): " +
                  std::to_string(joined) + " of " + std::to_string(j->local_size) +
                  " local ranks connected, " + std::to_string(j->started) + " started");
  }
}

std::pair<bool, std::string> Daemon::reload() {
  notifier_.reloading();
  // READY=1 again however the reload ends (systemd waits for it).
  struct ReadyAgain {
    ServiceNotifier& n;
    ~ReadyAgain() { n.ready(); }
  } ready_again{notifier_};
  try {
    // Everything is read and checked before anything is applied, so a bad
    // file leaves the daemon exactly as it was.
    DaemonConfig next = DaemonConfig::parse(config::Document::locate(config_path_, "daemon.yaml"));
    std::shared_ptr<const strategy::Strategy> strategy;
    if (!next.strategy_file.empty()) {
      strategy = std::make_shared<const strategy::Strategy>(
          strategy::Strategy::load_file(next.strategy_file));
    }
    std::string kept;
    for (auto [changed, key] : {std::pair{next.socket_path != config_.socket_path, "control.socket"},
                                {next.instance != config_.instance, "shm.instance"},
                                {next.threads != config_.threads, "scheduler.threads"},
                                {next.socket_mode != config_.socket_mode, "control.socket_mode"},
                                {next.cluster_file != config_.cluster_file, "internode.cluster_file"},
                                {next.node_id != config_.node_id, "internode.node_id"},
                                {next.nodes != config_.nodes, "internode.nodes"},
                                {next.peer_listen != config_.peer_listen, "internode.peer_listen"},
                                {next.ring_chunk_bytes != config_.ring_chunk_bytes,
                                 "internode.ring_chunk_bytes"}}) {
      if (changed) {
        BC_LOG(LogDaemon(), kWarn) << "SIGHUP: " << key
                                   << " changed, which needs a restart: keeping the running value";
        kept += std::string(kept.empty() ? "" : ", ") + key;
      }
    }
    config_.setup_timeout_ms = next.setup_timeout_ms;
    config_.partition_bytes = next.partition_bytes;
    config_.max_inflight_bytes = next.max_inflight_bytes;
    config_.link_window = next.link_window;
    config_.phase_timestamps = next.phase_timestamps;
    config_.fusion_enabled = next.fusion_enabled;
    config_.fusion_first_bucket_bytes = next.fusion_first_bucket_bytes;
    config_.fusion_bucket_cap_bytes = next.fusion_bucket_cap_bytes;
    config_.fusion_member_timeout_ms = next.fusion_member_timeout_ms;
    config_.allow_other_users = next.allow_other_users;
    config_.max_job_bytes = next.max_job_bytes;
    config_.strategy_file = next.strategy_file;
    config_.strategy_mode = next.strategy_mode;
    config_.auto_spec = next.auto_spec;
    config_.run_dir = next.run_dir;
    config_.metrics_textfile_dir = next.metrics_textfile_dir;
    config_.metrics_interval_ms = next.metrics_interval_ms;
    config_.sources = next.sources;
    next_metrics_ = {};
    tunables_.apply(config_);
    strategy_ = strategy;
    strategy_text_ = strategy_ ? read_text(config_.strategy_file) : std::string();
    // Whether a multi-node job already runs `text`: the latest entry of its
    // timeline (its start strategy, or the last change announced to it).
    auto runs_strategy = [](Job& j, const std::string& text) {
      std::shared_ptr<server::PsJob> ps;
      {
        std::lock_guard lock(j.ps_mu);
        ps = j.ps.lock();
      }
      if (!ps) return false;  // not joined yet: its engine takes the request then
      const auto yaml = ps->timeline().latest().yaml;
      return yaml && *yaml == text;
    };
    for (auto& [key, j] : jobs_) {
      // A job that brought its own strategy keeps it; an auto job keeps
      // choosing its own (the new mode applies to new jobs).
      if (!j->engine || j->own_strategy || j->tuner || j->strategy) continue;
      if (config_.strategy_mode == "auto") continue;
      // Of a multi-node job only node rank 0 asks the coordinator, which
      // announces the change to every node and server for one iteration.
      if (j->num_nodes > 1 && j->node_rank != 0) continue;
      try {
        // Checked against the job's tensors before anything changes.
        std::vector<TensorPlan> plans = strategy_
                                            ? make_plans(*strategy_, config_.strategy_file, j->specs)
                                            : uncompressed_plans(j->specs.size());
        if (j->num_nodes > 1) {
          if (runs_strategy(*j, strategy_text_)) {
            // A reload of other settings (bench-cluster's fusion drop-in)
            // would otherwise ask for the strategy the job already runs,
            // and, for a job idle since an earlier such request, for a
            // second change at the same iteration, which the coordinator
            // refuses ("is not after the last change").
            BC_LOG(LogDaemon(), kInfo) << "SIGHUP: job " << j->id
                                       << " already runs this strategy: no change asked";
          } else {
            j->engine->request_strategy(strategy_text_);
          }
        } else {
          j->engine->set_plans(counting_plans(std::move(plans), j->bytes));
        }
        j->active_strategy = strategy_;
        j->strategy_mode = strategy_ ? "daemon" : "none";
        j->strategy_source = config_.strategy_file;
      } catch (const Error& e) {
        BC_LOG(LogDaemon(), kError) << "SIGHUP: job " << j->id << " keeps its strategy: "
                                    << e.what();
      }
    }
    std::ostringstream done;
    done << "reloaded (partition_bytes " << config_.partition_bytes
         << " for new jobs, max_inflight_bytes " << config_.max_inflight_bytes
         << ", link_window " << config_.link_window
         << ", setup_timeout_ms " << config_.setup_timeout_ms << ", strategy '"
         << config_.strategy_file << "', metrics '" << config_.metrics_textfile_dir
         << "', fusion " << (config_.fusion_enabled ? "on" : "off")
         << " for new jobs, log levels)";
    if (!kept.empty()) done << "; needs a restart, not applied: " << kept;
    BC_LOG(LogDaemon(), kInfo) << "SIGHUP: " << done.str();
    ++counters_.reloads;
    return {true, done.str()};
  } catch (const Error& e) {
    BC_LOG(LogDaemon(), kError) << "SIGHUP: configuration not reloaded, keeping the old one: "
                                << e.what();
    ++counters_.reload_failures;
    return {false, std::string("configuration not reloaded, keeping the old one: ") + e.what()};
  }
}

}  // namespace bytecomp::daemon
