#include "daemon/auto_tuner.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "common/log.h"
#include "compress/compressor.h"
#include "daemon/engine.h"
#include "planner/strategy/strategy.h"

namespace bytecomp::daemon {

using Clock = std::chrono::steady_clock;
using strategy::CompressorMeasure;
using strategy::LinearFit;
using strategy::NodeProfile;

BC_LOG_CATEGORY(LogAuto, "daemon.auto");

AutoTuner::AutoTuner(Options options)
    : o_(std::move(options)),
      trigger_(o_.spec.replan_drift, o_.spec.replan_iterations, o_.spec.replan_min_interval,
               o_.spec.replan_max, o_.spec.replan_per),
      loss_guard_(o_.spec.loss_window, o_.spec.loss_tolerance) {
  view_.state = "probing";
  view_.run_dir = o_.run_dir;
}

AutoTuner::~AutoTuner() { stop(); }

void AutoTuner::stop() {
  {
    std::lock_guard lk(mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
    view_.state = "stopped";
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

AutoTuner::View AutoTuner::view() const {
  std::lock_guard lk(mu_);
  return view_;
}

void AutoTuner::report_loss(double loss) {
  {
    std::lock_guard lk(mu_);
    // Bounded: a tuner thread that is behind drops the oldest reports.
    if (losses_.size() >= 4096) losses_.erase(losses_.begin());
    losses_.push_back(loss);
  }
  cv_.notify_all();
}

void AutoTuner::report_gpu(strategy::GpuReport report) {
  std::lock_guard lk(mu_);
  gpu_ = std::move(report);  // the latest process's report stands
}

bool AutoTuner::compresses(const std::string& yaml) const {
  if (yaml.empty()) return false;
  try {
    const strategy::Strategy st = strategy::Strategy::parse(yaml, "job strategy");
    for (size_t t = 0; t < o_.names.size(); ++t)
      if (st.resolve(o_.names[t], 4 * o_.elements[t]).compressed()) return true;
  } catch (const std::exception&) {
    // The engine accepted it; a parse error here is a bug, and guarding
    // what we cannot read is the safe side.
    return true;
  }
  return false;
}

void AutoTuner::check_loss() {
  if (!o_.spec.loss_guard || state_ == State::kRolledBack) return;
  const std::optional<std::string> why = loss_guard_.check();
  if (!why) return;
  roll_back(Rollback{ps_->info().rank, *why}, true);
}

// `own`: this node's guard fired, and it asks the coordinator for the
// rollback (any node may: each judges its own ranks' losses, and a guard
// that fired on one node alone must still roll the whole job back).
// Otherwise another node's rollback reached this node through the job's
// timeline. Either way the node ends rolled back with the same text.
void AutoTuner::roll_back(const Rollback& r, bool own) {
  const std::string text = "loss guard of node " + std::to_string(r.node_rank) + ": " + r.why +
                           "; rolling back to uncompressed on every node";
  if (own) {
    BC_LOG(LogAuto(), kWarn) << "job " << o_.job << ": " << text;
    // Two guards firing at once: the second finds the first's change and
    // does not ask again (a request racing it is refused by the coordinator,
    // which admits one change at a time).
    if (!rollback_of(*ps_->timeline().latest().yaml))
      engine_->request_strategy(rollback_yaml(r.node_rank, r.why, start_yaml_));
  } else {
    BC_LOG(LogAuto(), kWarn) << "job " << o_.job << ": rolled back by " << text;
  }
  write_file("rollback.txt", text + "\n");
  state_ = State::kRolledBack;
  trigger_.clear();
  std::lock_guard lk(mu_);
  view_.state = "rolled back";
  view_.last_message = text;
  view_.predicted_us = 0;
}

void AutoTuner::attach(Engine& engine, const std::shared_ptr<server::PsJob>& ps,
                       uint64_t partition_bytes) {
  engine_ = &engine;
  ps_ = ps;
  const uint64_t per = std::max<uint64_t>(1, partition_bytes / 4);
  for (uint64_t n : o_.elements) {
    const uint64_t parts = std::max<uint64_t>(1, (n + per - 1) / per);
    partitions_.push_back(static_cast<uint32_t>(parts));
    part_elems_.push_back(std::min(n, per));
    last_elems_.push_back(n - (parts - 1) * per);
  }
  current_yaml_ = ps->info().strategy_yaml;
  start_yaml_ = current_yaml_;
  if (!start_yaml_.empty())
    BC_LOG(LogAuto(), kInfo) << "job " << o_.job << ": strategy auto starts with "
                             << [&] {
                                  const auto m = strategy::Strategy::parse(start_yaml_, "start").meta;
                                  const auto it = m.find("ring_tensors");
                                  return it == m.end() ? std::string("its") : it->second;
                                }()
                             << " tensor(s) on the daemons' ring (never compressed beyond fp16; "
                                "decided by the coordinator, whose plans may move tensors "
                                "between the ring and the servers)";
  {
    // bytecompctl shows the start placement (ring tensors) before any switch.
    std::lock_guard lk(mu_);
    view_.strategy_yaml = current_yaml_;
    view_.joined = true;
  }
  profile_from_ = ps->info().start_iteration + o_.spec.skip_iterations;
  std::weak_ptr<AutoTuner> weak = weak_from_this();
  ps->on_auto([weak](const server::AutoEvent& e) {
    if (auto self = weak.lock()) self->on_event(e);
  });
  seen_change_ = ps->info().start_iteration;
  if (!o_.run_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(o_.run_dir, ec);
    if (ec)
      BC_LOG(LogAuto(), kWarn) << "job " << o_.job << ": cannot create run directory " << o_.run_dir
                               << ": " << ec.message() << " (the decision is logged only)";
  }
  // Before the first round: the probe then has the link to itself.
  probe_link();
  state_ = State::kProfiling;
  {
    std::lock_guard lk(mu_);
    view_.state = "profiling";
  }
  BC_LOG(LogAuto(), kInfo) << "job " << o_.job << ": auto strategy: profiling iterations from "
                           << profile_from_ << " (" << o_.spec.warmup_iterations
                           << " iterations), then planning on the coordinator";
  thread_ = std::thread([this] { run(); });
}

void AutoTuner::probe_link() {
  if (!ps_) return;
  constexpr auto kTimeout = server::Millis{5000};
  const uint64_t small = 64 << 10;
  std::string problem;
  auto timed = [&](transport::NodeId s, uint64_t up, uint64_t down) -> double {
    {
      std::lock_guard lk(mu_);
      if (stopping_) {
        problem = "stopped";
        return -1;
      }
    }
    const auto t0 = Clock::now();
    bytecomp::Status st = ps_->probe(s, up, down, kTimeout);
    if (!st.ok()) {
      problem = st.message();
      return -1;
    }
    return us_since(t0);
  };
  // The link is the node's NIC: a colocated server's traffic never crosses
  // it, so it is left out. Every other node probes at the same time; what
  // they share can only lower a measured rate, so the node's rate is the
  // best one it measured and its latency the median round trip.
  const std::vector<server::ServerInfo>& servers = ps_->info().servers;
  std::vector<double> rtts;
  double gbps = 0;
  for (size_t idx : probe_order(servers.size(), ps_->info().rank)) {
    const server::ServerInfo& s = servers[idx];
    if (endpoint_is_local(s.address)) continue;
    double rtt = 1e300;
    for (int i = 0; i < 5; ++i) {
      const double t = timed(s.id, 0, 0);
      if (t < 0) break;
      rtt = std::min(rtt, t);
    }
    if (!problem.empty()) break;
    rtts.push_back(rtt);
    for (int dir = 0; dir < 2; ++dir) {
      uint64_t big = 1 << 20;
      auto once = [&](uint64_t n) { return dir == 0 ? timed(s.id, n, 0) : timed(s.id, 0, n); };
      double ts = once(small), tb = once(big);
      // A shaped link passes its token bucket's burst at line rate: a large
      // probe keeps that share small.
      if (tb >= 0 && tb < 50e3) {
        big = 8 << 20;
        tb = once(big);
      }
      if (ts < 0 || tb < 0) break;
      if (tb > ts) gbps = std::max(gbps, (big - small) * 8.0 / (tb - ts) / 1e3);
    }
    if (!problem.empty()) break;
  }
  double latency = rtts.empty() ? 0 : median(rtts) / 2;
  if (!problem.empty()) {
    BC_LOG(LogAuto(), kWarn) << "job " << o_.job << ": link probe failed (" << problem
                             << "); the planner calibrates the link from the iteration time";
    gbps = 0;
    latency = 0;
  } else if (rtts.empty()) {
    BC_LOG(LogAuto(), kInfo) << "job " << o_.job << ": every server is on this host: no link "
                             << "to probe; the planner calibrates it from the iteration time";
  }
  link_gbps_ = gbps;
  link_latency_us_ = latency;
  std::lock_guard lk(mu_);
  view_.link_gbps = gbps;
  view_.link_latency_us = latency;
}

void AutoTuner::measure_compressors() {
  // Representative partition sizes of this job (at most six).
  std::vector<uint64_t> all = part_elems_;
  all.insert(all.end(), last_elems_.begin(), last_elems_.end());
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  std::vector<uint64_t> sizes;
  const size_t k = std::min<size_t>(6, all.size());
  for (size_t i = 0; i < k; ++i) sizes.push_back(all[k == 1 ? 0 : i * (all.size() - 1) / (k - 1)]);
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  measures_.clear();
  std::vector<std::string> specs = o_.spec.compressors;
  if (std::find(specs.begin(), specs.end(), "fp16") == specs.end()) specs.push_back("fp16");
  for (const std::string& s : specs) {
    try {
      measures_.push_back(measure_compressor(s, sizes, 3));
    } catch (const Error& e) {
      BC_LOG(LogAuto(), kWarn) << "job " << o_.job << ": measuring " << s << " failed: " << e.what();
    }
  }
}

void AutoTuner::on_event(const server::AutoEvent& e) {
  {
    std::lock_guard lk(mu_);
    events_.push_back(e);
  }
  cv_.notify_all();
}

void AutoTuner::write_file(const std::string& name, const std::string& text) const {
  if (o_.run_dir.empty()) return;
  if (std::string err = write_file_atomic(o_.run_dir, name, text); !err.empty())
    BC_LOG(LogAuto(), kWarn) << "job " << o_.job << ": " << err;
}

void AutoTuner::send_profile() {
  std::vector<IterationSample> window;
  for (const auto& [it, s] : samples_)
    if (it >= profile_from_ && window.size() < o_.spec.warmup_iterations) window.push_back(s);
  NodeProfile p = profile_of(window, o_.names, o_.elements);
  p.node_rank = ps_->info().rank;
  p.local_ranks = o_.local_ranks;
  p.pool_threads = o_.pool_threads;
  p.cpu_cores = std::max(1u, std::thread::hardware_concurrency());
  p.reduce = reduce_fit(engine_->phase_records(), part_elems_, last_elems_, partitions_);
  p.compressors = measures_;
  {
    std::lock_guard lock(mu_);
    p.gpu_compressors = gpu_.compressors;
    p.gpu_note = gpu_.note;
  }
  p.link_gbps = link_gbps_;
  p.link_latency_us = link_latency_us_;
  p.current_strategy_yaml = current_yaml_;
  p.host = host_id();
  // CPU time per iteration over the window (first to last sample seen).
  auto per_iteration = [&](const std::map<uint64_t, double>& marks) {
    if (window.size() < 2) return 0.0;
    const auto a = marks.find(window.front().iteration), b = marks.find(window.back().iteration);
    if (a == marks.end() || b == marks.end() || b->second <= a->second) return 0.0;
    return (b->second - a->second) /
           static_cast<double>(window.back().iteration - window.front().iteration);
  };
  if (!o_.pids.empty())
    p.train_cpu_us = per_iteration(cpu_marks_) / static_cast<double>(o_.pids.size());
  p.daemon_cpu_us = per_iteration(self_marks_);
  p.host_cpu_us = per_iteration(host_marks_);
  write_file("profile-node" + std::to_string(p.node_rank) + ".yaml", p.to_yaml());
  BC_LOG(LogAuto(), kInfo) << "job " << o_.job << ": profile of iterations " << p.first_iteration
                           << ".. (" << p.iterations << "): " << p.iteration_us / 1000.0
                           << " ms per iteration, link " << link_gbps_ << " Gbit/s, "
                           << link_latency_us_ << " us; sent to the coordinator (epoch " << epoch_
                           << ")";
  const std::string job = o_.job;
  const uint64_t epoch = epoch_;
  ps_->auto_profile(epoch_, p.to_yaml(), o_.spec.to_yaml(), [job, epoch](const bytecomp::Status& s) {
    if (!s.ok())
      BC_LOG(LogAuto(), kWarn) << "job " << job << ": profile of epoch " << epoch
                               << " refused: " << s.message();
  });
  state_ = State::kWaiting;
  std::lock_guard lk(mu_);
  view_.state = "planning";
  view_.epoch = epoch_;
}

void AutoTuner::handle(const server::AutoEvent& e) {
  using K = server::AutoEvent::Kind;
  if (e.kind == K::kProfileRequest) {
    epoch_ = e.epoch;
    profile_from_ = e.from_iteration;
    trigger_.clear();
    have_switch_ = false;
    BC_LOG(LogAuto(), kInfo) << "job " << o_.job << ": re-profiling from iteration " << profile_from_
                             << " (epoch " << epoch_ << "): " << e.text;
    probe_link();
    measure_compressors();
    reprofile_after_probe_ = true;
    state_ = State::kProfiling;
    std::lock_guard lk(mu_);
    view_.state = "profiling";
    view_.epoch = epoch_;
    ++view_.replans;
    return;
  }
  if (e.epoch != epoch_) return;  // a stale answer
  if (state_ == State::kRolledBack) {
    BC_LOG(LogAuto(), kInfo) << "job " << o_.job << ": epoch " << e.epoch
                             << " decided after the loss guard rolled the job back: ignored";
    return;
  }
  if (e.kind == K::kFailed) {
    BC_LOG(LogAuto(), kWarn) << "job " << o_.job << ": no automatic strategy for epoch " << e.epoch
                             << ", keeping the current one: " << e.text;
    state_ = State::kFailed;
    trigger_.clear();
    std::lock_guard lk(mu_);
    view_.state = "failed";
    view_.last_message = e.text;
    return;
  }
  predicted_us_ = e.predicted_us;
  write_file("strategy.yaml", e.strategy_yaml);
  write_file("plan.yaml", e.decision_yaml);
  write_file("explain.txt", e.text);
  write_file("timeline.json", e.timeline_json);
  measured_written_ = 0;
  {
    log::Line line(LogAuto(), log::Level::kInfo);
    line.stream() << "job " << o_.job << ": automatic strategy (epoch " << e.epoch << "):\n" << e.text;
  }
  if (ps_->info().rank == 0) engine_->request_strategy(e.strategy_yaml);
  state_ = State::kApplied;
  have_switch_ = false;
  std::lock_guard lk(mu_);
  view_.state = "applied";
  view_.predicted_us = predicted_us_;
  ++view_.decisions;
  view_.last_message.clear();
}

void AutoTuner::write_measured() {
  std::vector<double> v;
  for (const auto& [it, s] : samples_)
    if (it > switch_iteration_) v.push_back(s.iteration_us);
  if (v.size() < measured_written_ + 5) return;
  measured_written_ = v.size();
  std::ostringstream o;
  o.precision(10);
  o << "version: 1\nepoch: " << epoch_ << "\nswitch_iteration: " << switch_iteration_
    << "\niteration_us: " << median(v) << "\niterations: " << v.size()
    << "\npredicted_us: " << predicted_us_ << "\n";
  // Per node (the run directory may be shared by every node's daemon):
  // measured-node<r>.yaml; node rank 0's is also measured.yaml, the one
  // `bytecomp-plan explain RUN_DIR` reads.
  const uint32_t rank = ps_->info().rank;
  write_file("measured-node" + std::to_string(rank) + ".yaml", o.str());
  if (rank == 0) write_file("measured.yaml", o.str());
}

void AutoTuner::run() {
  measure_compressors();
  auto last_warn = Clock::now();
  std::unique_lock lk(mu_);
  while (!stopping_) {
    cv_.wait_for(lk, std::chrono::milliseconds(20));
    if (stopping_) break;
    std::deque<server::AutoEvent> events;
    events.swap(events_);
    std::vector<double> losses;
    losses.swap(losses_);
    lk.unlock();
    for (const server::AutoEvent& e : events) handle(e);
    if (!losses.empty() && !loss_reported_) {
      loss_reported_ = true;
      BC_LOG(LogAuto(), kInfo) << "job " << o_.job << ": loss reports arrive (the loss guard is "
                               << (o_.spec.loss_guard ? "on" : "off") << ")";
    }
    for (double l : losses) loss_guard_.report(last_iteration_, l);
    // The job's timeline (the PS client's) has every announced change.
    if (const strategy::Timeline::Entry latest = ps_->timeline().latest();
        latest.first != seen_change_) {
      seen_change_ = latest.first;
      current_yaml_ = *latest.yaml;
      {
        std::lock_guard vl(mu_);
        view_.strategy_yaml = current_yaml_;
      }
      if (const std::optional<Rollback> r = rollback_of(current_yaml_)) {
        if (state_ != State::kRolledBack) roll_back(*r, false);
      } else if (state_ == State::kApplied && !have_switch_) {
        switch_iteration_ = latest.first;
        have_switch_ = true;
        trigger_.set_prediction(predicted_us_, switch_iteration_ + 1);
        if (compresses(current_yaml_) && !loss_guard_.armed()) {
          loss_guard_.compressed_from(switch_iteration_);
          BC_LOG(LogAuto(), kInfo) << "job " << o_.job << ": loss guard armed at iteration "
                                   << switch_iteration_ << " (baseline "
                                   << loss_guard_.baseline() << "; 0: not enough reports yet)";
        }
      }
    }
    for (IterationSample& s : iteration_samples(engine_->phase_records(), partitions_)) {
      const uint64_t it = s.iteration;
      last_iteration_ = std::max(last_iteration_, it);
      const bool fresh = samples_.emplace(it, std::move(s)).second;
      if (fresh && !o_.pids.empty()) {
        double cpu = 0;
        bool all = true;
        for (int pid : o_.pids) {
          const std::optional<double> c = process_cpu_us(pid);
          all = all && c.has_value();
          cpu += c.value_or(0);
        }
        if (all) cpu_marks_[it] = cpu;
      }
      if (fresh)
        if (const std::optional<double> me = process_cpu_us(::getpid())) self_marks_[it] = *me;
      if (fresh)
        if (const std::optional<double> host = host_busy_cpu_us()) host_marks_[it] = *host;
      if (fresh && state_ == State::kApplied && have_switch_ && it > switch_iteration_ &&
          ps_->info().rank == 0) {
        const std::string before = trigger_.held_back();
        const double reference = trigger_.reference_us();
        auto why = trigger_.observe(it, samples_.at(it).iteration_us);
        if (reference <= 0 && trigger_.reference_us() > 0 &&
            trigger_.reference_us() != predicted_us_)
          BC_LOG(LogAuto(), kInfo) << "job " << o_.job << ": re-plan reference "
                                   << trigger_.reference_us() / 1000.0
                                   << " ms per iteration, measured up to iteration " << it
                                   << " under the re-planned strategy (predicted "
                                   << predicted_us_ / 1000.0 << " ms)";
        if (!trigger_.held_back().empty() && before.empty())  // once per held-back streak
          BC_LOG(LogAuto(), kInfo) << "job " << o_.job << ": lasting drift, re-plan held back: "
                                   << trigger_.held_back();
        if (why) {
          BC_LOG(LogAuto(), kInfo) << "job " << o_.job << ": asking for a re-plan: " << *why;
          const std::string job = o_.job;
          ps_->auto_replan(it + 3, *why, [job](const bytecomp::Status& st) {
            if (!st.ok())
              BC_LOG(LogAuto(), kInfo) << "job " << job << ": re-plan refused: " << st.message();
          });
        }
      }
    }
    if (reprofile_after_probe_) {
      reprofile_after_probe_ = false;
      // +2: the iteration after the latest complete one may have begun
      // while the probe still ran.
      if (last_iteration_ + 2 > profile_from_) {
        profile_from_ = last_iteration_ + 2;
        BC_LOG(LogAuto(), kInfo) << "job " << o_.job << ": link probed; the profile starts at "
                                 << "iteration " << profile_from_;
      }
    }
    check_loss();
    while (samples_.size() > 512) samples_.erase(samples_.begin());
    while (cpu_marks_.size() > 512) cpu_marks_.erase(cpu_marks_.begin());
    while (self_marks_.size() > 512) self_marks_.erase(self_marks_.begin());
    while (host_marks_.size() > 512) host_marks_.erase(host_marks_.begin());
    if (state_ == State::kApplied && have_switch_) write_measured();
    if (state_ == State::kProfiling) {
      size_t n = 0;
      for (const auto& [it, s] : samples_) n += it >= profile_from_;
      if (n >= o_.spec.warmup_iterations) {
        send_profile();
      } else if (Clock::now() - last_warn > std::chrono::seconds(60)) {
        last_warn = Clock::now();
        BC_LOG(LogAuto(), kWarn) << "job " << o_.job << ": still profiling: " << n << " of "
                                 << o_.spec.warmup_iterations
                                 << " complete iterations seen (is every tensor reduced every "
                                    "iteration, and engine.phase_timestamps on?)";
      }
    }
    lk.lock();
  }
}

}  // namespace bytecomp::daemon
