// The node's half of automatic strategies (issue 13, docs/auto.md): one
// AutoTuner per multi-node job running with `strategy: {mode: auto}`.
//
//   attach()   right after the job joined the servers, on the engine thread,
//              before the first round: probes the link to every server of
//              the job (bounded; the first iteration waits for it) and
//              starts the tuner's thread.
//   profile    the thread reads the engine's phase timestamps and turns each
//              complete iteration into a sample (iteration time, each
//              tensor's ready time since the iteration began); after
//              skip_iterations, warmup_iterations samples make the node's
//              profile, with the cost of every accepted compressor measured
//              by real calls on this node and the intra-node reduce fitted
//              from the timestamps. It goes to the coordinator
//              (server/auto_planner.h), which merges all nodes' and plans.
//   apply      on the decision every node writes the run directory
//              (strategy.yaml, plan.yaml, timeline.json, explain.txt; later
//              measured.yaml) and logs the table; node rank 0 asks for the
//              strategy change, which applies on every node and server at
//              one iteration.
//   re-plan    node rank 0 compares measured iterations with the prediction
//              (ReplanTrigger); on a lasting drift it asks the coordinator
//              for a new epoch, and every node profiles again.
//
// Ownership: owned by the daemon's job (shared_ptr: the PS client's
// callbacks hold weak references); it borrows the Engine given to attach(),
// which outlives it (the job stops the tuner before the engine). Threading: attach() on the
// engine thread; the tuner thread does everything else; PS callbacks only
// queue events for it. stop() joins it (bounded: every wait is timed).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "daemon/engine_phases.h"
#include "planner/strategy/auto_spec.h"
#include "planner/strategy/profile.h"
#include "server/ps_client.h"

namespace bytecomp::daemon {

class Engine;

// One complete iteration as the engine saw it.
struct IterationSample {
  uint64_t iteration = 0;
  double iteration_us = 0;        // end of the previous iteration to the end of this one
  std::vector<double> ready_us;   // per tensor: all local ranks submitted, since the previous end
};

// The complete iterations in `records` (every partition of every tensor
// published, and the previous iteration too, whose end starts this one).
// `partitions[t]` is tensor t's partition count.
std::vector<IterationSample> iteration_samples(const std::vector<PhaseRecord>& records,
                                               const std::vector<uint32_t>& partitions);

// Least squares of the intra-node reduce time (kStart -> kReduced) against
// partition elements; `elements[t]` is each of tensor t's partitions' size
// (the last may be shorter: `last_elements[t]`).
strategy::LinearFit reduce_fit(const std::vector<PhaseRecord>& records,
                             const std::vector<uint64_t>& elements,
                             const std::vector<uint64_t>& last_elements,
                             const std::vector<uint32_t>& partitions);

// Medians over `samples` (at least one) of the iteration time and of each
// tensor's ready time.
strategy::NodeProfile profile_of(const std::vector<IterationSample>& samples,
                               const std::vector<std::string>& names,
                               const std::vector<uint64_t>& elements);

// Real calls of `spec` on this thread for each size (elements) `reps`
// times; the fits of compress and decompress (this thread's CPU time, so
// that a busy host's preemptions do not count as cost: the planner models
// how the host's cores are shared), and the wire size.
strategy::CompressorMeasure measure_compressor(const std::string& spec,
                                             const std::vector<uint64_t>& sizes,
                                             int reps);

// Whether a server endpoint ("tcp://HOST:PORT", "ipc://...") is on this
// host: a numeric HOST that is one of this host's interface addresses (or
// loopback), or a host-local transport. Names are not resolved (no DNS
// wait): a named host counts as remote.
bool endpoint_is_local(const std::string& endpoint);

// User + system CPU time of process `pid` in microseconds (/proc/PID/stat);
// nullopt when it cannot be read (the process is gone).
std::optional<double> process_cpu_us(int pid);

// CPU time (user, nice, system, irq, softirq and steal, all cores) the
// whole host has spent since boot, in microseconds: from /proc/stat, or
// from the text of one (its first, aggregate "cpu" line); nullopt when it
// cannot be read. Every process counts, the job's and everyone else's: the
// planner subtracts the job's own to see what other work takes of the
// cores (docs/planner.md "CPU training on a shared host").
std::optional<double> host_busy_cpu_us(std::string_view stat_text);
std::optional<double> host_busy_cpu_us();

// This host's identity: its boot id (the same in every network namespace
// and container of the host); "" when unreadable.
std::string host_id();

// The order in which node `rank` probes `servers` servers: starting at
// rank + 1. When every node probes at once (they all start the job
// together) and server k runs on node k, each step pairs every node with a
// different server, so no link carries two probes.
std::vector<size_t> probe_order(size_t servers, uint32_t rank);

// Decides when measurements have drifted from the prediction for long
// enough to re-plan. Pure: fed with iteration times.
//
// Hysteresis (issue 29: a small fast job re-planned 6 times in 10 epochs):
// a re-plan needs `iterations` drifted iterations in a row (one blip resets
// the streak), at least `min_interval` iterations after the prediction came
// into force, and fewer than `max_replans` re-plans in the last
// `per_iterations` iterations; the coordinator's decide() then keeps the
// running strategy unless the new plan clears the min_gain bar against it
// (planner/online.h Decision::kept_current).
//
// What "drift" is measured against: until the first re-plan, the
// prediction (one re-plan corrects a model that got this job wrong); after
// it, the iteration time measured under the re-planned strategy (the median
// of its first max(min_interval, iterations) iterations). A model that
// still mispredicts the same steady job then never re-plans it again
// (issue 29: 4 nodes on a steady 100 Mbit/s link, predicted 167 ms after
// the re-plan, measured 38 ms, asked again every `per_iterations`); a link
// or load that really changes moves the measurement and does.
class ReplanTrigger {
 public:
  ReplanTrigger(double drift, uint32_t iterations, uint32_t min_interval,
                uint32_t max_replans = 1000000, uint32_t per_iterations = 1)
      : drift_(drift), needed_(iterations), min_interval_(min_interval),
        max_replans_(max_replans), per_(per_iterations) {}
  // A prediction in force from `iteration` (a strategy change there).
  void set_prediction(double predicted_us, uint64_t iteration);
  // No prediction (a failed plan, or a re-plan under way).
  void clear() {
    predicted_us_ = 0;
    reference_us_ = 0;
    streak_ = 0;
  }
  // A measured iteration; a reason when it is time to re-plan (which the
  // trigger counts against the per-N bound).
  std::optional<std::string> observe(uint64_t iteration, double measured_us);
  // Why the current lasting drift does not re-plan ("" when none is held
  // back: no drift, or the streak ended).
  const std::string& held_back() const { return held_back_; }
  // What drift is measured against now (0: no prediction, or settling).
  double reference_us() const { return predicted_us_ > 0 ? reference_us_ : 0.0; }

 private:
  double drift_;
  uint32_t needed_;
  uint32_t min_interval_;
  uint32_t max_replans_;
  uint32_t per_;
  std::deque<uint64_t> fired_;  // iterations of the re-plans within the last per_
  std::string held_back_;
  double predicted_us_ = 0;
  uint64_t since_ = 0;
  uint32_t streak_ = 0;
  std::vector<double> drifted_;
  bool replanned_ = false;        // fired at least once in this job's life
  double reference_us_ = 0;       // what drift is measured against (0: settling)
  std::vector<double> settling_;  // after a re-plan: the first iterations measured
};

// The median of `v` (0 when empty).
double median(std::vector<double> v);
// Microseconds since `t0` (steady clock).
double us_since(std::chrono::steady_clock::time_point t0);

// Writes `text` to `dir`/`name` so that a reader, or another writer of the
// same name (another node's daemon where the run directories resolve to one
// shared folder, e.g. NFS home directories), never sees a partial file: a
// temporary file of a name of its own (host, pid, a random suffix: created
// with O_EXCL, so no two writers share one), then rename() over the name,
// which is atomic on one filesystem (NFS included). Creates `dir` if
// missing. Returns "" or what failed (the path and the reason).
// Thread-safe.
std::string write_file_atomic(const std::string& dir, const std::string& name,
                              const std::string& text);

// The loss guard (issue 29, docs/auto.md "Loss rollback"): the training
// processes report their loss (bytecomp.torch's report_loss(), the `loss`
// operator request); each report is stamped with the latest iteration the
// daemon saw. Losses reported up to the first switch to a compressed
// strategy are the uncompressed baseline: the median of the last `window`
// of them (at least kMinBaseline). After the switch, once `window` losses
// came in, the job has diverged when the median of the last `window`
// exceeds the baseline by more than `tolerance` (a fraction of it), or at
// once when a loss is not finite. Healthy training lowers its loss below
// the warm-up's, so a compressed run that ends up above it is not
// following the uncompressed trend. Pure.
class LossGuard {
 public:
  static constexpr size_t kMinBaseline = 3;
  LossGuard(uint32_t window, double tolerance) : window_(window), tolerance_(tolerance) {}
  void report(uint64_t iteration, double loss);
  // A compressed strategy in force from `iteration`; only the first counts
  // (the baseline is the uncompressed warm-up's, whatever re-plans follow).
  void compressed_from(uint64_t iteration);
  bool armed() const { return switched_; }
  // The divergence, once: a reason to roll back.
  std::optional<std::string> check();
  // Diagnostics: the baseline (0 until known) and the post-switch reports.
  double baseline() const;
  size_t after() const { return after_.size(); }

 private:
  uint32_t window_;
  double tolerance_;
  bool switched_ = false, fired_ = false;
  uint64_t switch_ = 0;
  std::deque<double> before_, after_;
  std::deque<std::pair<uint64_t, double>> pending_;  // reported before the switch was known
  bool non_finite_ = false;
};

// The strategy a loss-guard rollback switches the job to: every tensor
// uncompressed (what the warm-up ran), with `meta` naming the node whose
// guard fired and why. The guard of any node may fire (each judges its own
// ranks' losses); the change it requests applies on every node, and every
// node recognises it in the job's timeline by this mark (rollback_of), so
// the whole job is rolled back whichever node judged it diverged.
// `start_yaml`: the job's start strategy, placement included: what the
// uncompressed warm-up ran (the guard's baseline); tensors a plan moved
// between the ring and the servers since go back where they started (a
// ring <-> ps move, which the coordinator applies at one iteration like
// any change); "" = every tensor uncompressed on the servers.
std::string rollback_yaml(uint32_t node_rank, const std::string& why,
                          const std::string& start_yaml = "");
struct Rollback {
  uint32_t node_rank = 0;
  std::string why;
};
// The rollback `yaml` (a strategy in force) stands for; nullopt for any
// other strategy.
std::optional<Rollback> rollback_of(const std::string& yaml);

class AutoTuner : public std::enable_shared_from_this<AutoTuner> {
 public:
  struct Options {
    std::string job;
    strategy::AutoSpec spec;
    std::vector<std::string> names;
    std::vector<uint64_t> elements;  // fp32 elements per tensor
    uint32_t local_ranks = 1;
    uint32_t pool_threads = 1;
    std::vector<int> pids;  // the local ranks' processes (their CPU time is profiled)
    std::string run_dir;  // created if missing; empty: no files
  };
  explicit AutoTuner(Options options);
  ~AutoTuner();
  AutoTuner(const AutoTuner&) = delete;
  AutoTuner& operator=(const AutoTuner&) = delete;

  // `engine` is the job's, which outlives this tuner.
  void attach(Engine& engine, const std::shared_ptr<server::PsJob>& ps, uint64_t partition_bytes);
  void stop();

  // For bytecompctl and tests.
  struct View {
    std::string state;  // "probing", "profiling", "planning", "applied", "failed", "rolled back", "stopped"
    uint64_t epoch = 0;
    double predicted_us = 0;
    double link_gbps = 0, link_latency_us = 0;
    uint64_t decisions = 0, replans = 0;
    std::string last_message;
    std::string run_dir;
    std::string strategy_yaml;  // in force since the last switch ("" = uncompressed)
    bool joined = false;        // attach() ran: strategy_yaml is the job's, not a default
  };
  View view() const;

  // A training process's loss (any thread: queued for the tuner thread).
  void report_loss(double loss);
  // What a training process measured of the CUDA compressors (any thread;
  // the `gpu_profile` request): carried in the node's next profiles.
  void report_gpu(strategy::GpuReport report);

 private:
  enum class State { kIdle, kProfiling, kWaiting, kApplied, kFailed, kRolledBack };
  void check_loss();
  void roll_back(const Rollback& r, bool own);
  bool compresses(const std::string& yaml) const;
  void run();
  void probe_link();
  void measure_compressors();
  void collect();
  void send_profile();
  void on_event(const server::AutoEvent& e);
  void handle(const server::AutoEvent& e);
  void write_file(const std::string& name, const std::string& text) const;
  void write_measured();

  Options o_;
  Engine* engine_ = nullptr;
  std::shared_ptr<server::PsJob> ps_;
  std::vector<uint32_t> partitions_;
  std::vector<uint64_t> part_elems_, last_elems_;
  ReplanTrigger trigger_;
  LossGuard loss_guard_;
  uint64_t last_iteration_ = 0;  // latest complete iteration seen (stamps losses)
  // A re-profile's window starts after its own link probe and compressor
  // measurement: iterations that ran while the probe loaded the link are not
  // the strategy's (issue 29: 163 ms profiled against 45 ms running).
  bool reprofile_after_probe_ = false;
  bool loss_reported_ = false;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<server::AutoEvent> events_;  // from PS callbacks
  std::vector<double> losses_;            // from report_loss()
  strategy::GpuReport gpu_;               // from report_gpu()
  bool stopping_ = false;
  View view_;

  // Tuner thread only.
  uint64_t seen_change_ = 0;  // first iteration of the job timeline's entry last seen
  State state_ = State::kIdle;
  uint64_t epoch_ = 0;
  uint64_t profile_from_ = 0;
  std::map<uint64_t, IterationSample> samples_;
  // Per sampled iteration: the local ranks' CPU time (us) when it was seen.
  std::map<uint64_t, double> cpu_marks_;
  std::map<uint64_t, double> self_marks_;  // the daemon's own CPU time
  std::map<uint64_t, double> host_marks_;  // the whole host's busy CPU time
  std::vector<strategy::CompressorMeasure> measures_;
  double link_gbps_ = 0, link_latency_us_ = 0;
  std::string current_yaml_;
  std::string start_yaml_;  // the join strategy (the job's placements)
  double predicted_us_ = 0;
  uint64_t switch_iteration_ = 0;
  bool have_switch_ = false;
  size_t measured_written_ = 0;
  std::thread thread_;
};

}  // namespace bytecomp::daemon
