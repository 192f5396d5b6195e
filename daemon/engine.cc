#include "daemon/engine.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include <pthread.h>

#include "common/log.h"
#include "daemon/client_payload.h"
#include "daemon/engine_local.h"
#include "daemon/engine_ps.h"
#include "planner/strategy/partition.h"

namespace bytecomp::daemon {

BC_LOG_CATEGORY(LogEngine, "daemon.engine");
// One line per phase record at a job's end (debug): a trace of the last
// PhaseLog::kIterations iterations.
BC_LOG_CATEGORY(LogPhases, "daemon.phases");

namespace {

// Tensor fusion: copies the bytes [begin, end) of a bucket between every
// local rank's staging copy (`bufs`) and its members' buffers in the
// segment (pack: members -> staging). Per partition, on the pool worker
// that runs it, so packing overlaps the other partitions' rounds.
void bucket_copy(const server::Bucket& bucket, const std::vector<TensorSpec>& tensors,
                 const ipc::Layout& layout, char* base, const std::vector<char*>& bufs,
                 uint64_t begin, uint64_t end, bool pack) {
  for (size_t i = 0; i < bucket.members.size(); ++i) {
    const uint32_t m = bucket.members[i];
    const uint64_t first = bucket.offsets[i] * 4;
    const uint64_t last = first + tensors[m].bytes();
    const uint64_t from = std::max(first, begin), to = std::min(last, end);
    if (from >= to) continue;
    const ipc::TensorSlot& slot = layout.tensors[m];
    for (size_t r = 0; r < bufs.size(); ++r) {
      char* member = base + slot.offset + slot.stride * r + (from - first);
      char* staged = bufs[r] + from;
      if (pack) {
        std::memcpy(staged, member, to - from);
      } else {
        std::memcpy(member, staged, to - from);
      }
    }
  }
}

// Bound on one idle sleep; stop() also posts the doorbell, so this only
// limits how stale a missed wake-up can get.
constexpr auto kIdleWait = std::chrono::milliseconds(200);
}  // namespace

void Inbox::ring() {
  if (doorbell_ == nullptr) return;
  try {
    doorbell_->post();
  } catch (...) {
  }
}

void Inbox::deliver(Arrival a) {
  if (stamp_) a.at_ns = monotonic_ns();
  std::lock_guard lock(mu_);
  if (doorbell_ == nullptr) return;
  arrivals_.push_back(std::move(a));
  ring();
}

void Inbox::acked(uint64_t bytes, int64_t link, uint64_t link_bytes) {
  std::lock_guard lock(mu_);
  if (doorbell_ == nullptr) return;
  acked_.bytes += bytes;
  if (link >= 0) acked_.links.emplace_back(static_cast<uint32_t>(link), link_bytes);
  ring();
}

Inbox::Acked Inbox::take_acked() {
  std::lock_guard lock(mu_);
  return std::exchange(acked_, {});
}

void Inbox::fail(const Status& s) {
  std::lock_guard lock(mu_);
  if (doorbell_ == nullptr) return;
  if (failure_.ok()) failure_ = s;
  ring();
}

void Inbox::wake() {
  std::lock_guard lock(mu_);
  ring();
}

void Inbox::close() {
  std::lock_guard lock(mu_);
  doorbell_ = nullptr;
  arrivals_.clear();
}

std::vector<Inbox::Arrival> Inbox::take() {
  std::lock_guard lock(mu_);
  return std::exchange(arrivals_, {});
}

Status Inbox::failure() {
  std::lock_guard lock(mu_);
  return failure_;
}

Engine::Engine(Options o, ThreadPool& pool, const Tunables& tunables)
    : job_(std::move(o.job)),
      base_(static_cast<char*>(o.segment)),
      layout_(o.layout),
      tensors_(std::move(o.tensors)),
      pool_(pool),
      tunables_(tunables),
      on_failure_(std::move(o.on_failure)),
      header_(ipc::init_segment(o.segment, o.layout)),
      clients_(reinterpret_cast<ipc::ClientArea*>(base_ + o.layout.clients_offset)),
      rounds_(tensors_.size()),
      left_(new std::atomic<bool>[o.layout.local_size]),
      node_rank_(o.node_rank),
      partition_bytes_(std::max<uint64_t>(64, tunables.partition_bytes.load() / 64 * 64)),
      join_(std::move(o.join)),
      on_joined_(std::move(o.on_joined)),
      peer_opts_(o.peers),
      keep_mapped_(std::move(o.keep_mapped)),
      bytes_(std::move(o.bytes)),
      reducer_(o.reducer ? std::move(o.reducer) : std::make_unique<ShmSimdReducer>()),
      inbox_(std::make_shared<Inbox>(&header_->doorbell, tunables.phase_timestamps.load())) {
  if (o.plans.size() != tensors_.size()) {
    throw Error(ErrorCode::kInternal, "engine of job " + job_ + ": " +
                                          std::to_string(o.plans.size()) + " plans for " +
                                          std::to_string(tensors_.size()) + " tensors");
  }
  for (uint32_t r = 0; r < layout_.local_size; ++r) {
    left_[r] = false;
    submit_.emplace_back(clients_[r].submit,
                         reinterpret_cast<ipc::RingEntry*>(base_ + layout_.submit_ring_offset(r)),
                         layout_.ring_capacity);
    complete_.emplace_back(
        clients_[r].complete,
        reinterpret_cast<ipc::RingEntry*>(base_ + layout_.complete_ring_offset(r)),
        layout_.ring_capacity);
  }
  for (Round& r : rounds_) r.from.assign(layout_.local_size, false);
  collectives_ = std::make_unique<Collectives>(CollectiveContext{
      &tensors_, layout_.local_size, node_rank_, inbox_, keep_mapped_,
      [this](uint32_t t, std::vector<char*>& out) { buffers_of(t, out); },
      [this](uint32_t t, uint64_t it) { return notify_ranks(t, it); },
      [this](ErrorCode code, const std::string& why) { fail(code, why); },
      [this](uint32_t t) { return rounds_[t].arrived > 0; }});
  phase_timestamps_ = tunables.phase_timestamps.load();
  units_ = tensors_;
  if (!join_) {
    // Multi-node paths open on the engine thread, after the join.
    setup_phases(o.plans);
    own_timeline_ = std::make_unique<strategy::Timeline>(0, std::move(o.plans));
    timeline_ = own_timeline_.get();
    local_ = std::make_unique<LocalPath>(
        // The daemon's plans count their own compression (counting_plans).
        PathContext{job_, &tensors_, tensor_pb_, reducer_.get(), inbox_, &phases_, nullptr},
        node_rank_, timeline_->at(0));
    path_of_.assign(tensors_.size(), local_.get());
  }
  thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "bc-engine");
    loop();
  });
}

Engine::~Engine() { stop(); }

void Engine::stop() {
  stop_.store(true);
  try {
    header_->doorbell.post();
  } catch (...) {
    // Scribbled over by a client; the idle timeout ends the loop.
  }
  if (thread_.joinable()) {
    thread_.join();
    log_phases();
  }
  // Late PS callbacks must not touch the segment once it is unmapped.
  inbox_->close();
  if (ps_path_) ps_path_->close();
  if (peer_path_) peer_path_->close();
  if (ring_path_) ring_path_->close();
  collectives_->close();
  if (ps_) {
    // Tells the coordinator and fails what is still pending. An aborted job
    // is aborted for every node at once (a job the coordinator already
    // aborted is unknown to it by now: that refusal is harmless). Without
    // waiting for the answer: stop() runs on the daemon's control thread,
    // which serves every other job meanwhile (the PsClient's close waits for
    // outstanding answers when the daemon exits).
    std::string reason;
    {
      std::lock_guard lock(abort_mu_);
      reason = abort_reason_;
    }
    auto log = [job = job_, aborting = !reason.empty()](const Status& s) {
      if (!s.ok())
        BC_LOG(LogEngine(), kDebug) << "job " << job << (aborting ? ": abort: " : ": leave: ")
                                    << s.to_string();
    };
    if (reason.empty()) {
      ps_->leave_async(log, std::chrono::milliseconds(2000));
    } else {
      ps_->abort_async(reason, log, std::chrono::milliseconds(2000));
    }
    ps_.reset();
  }
}

void Engine::set_plans(std::vector<TensorPlan> plans) {
  // layout_plans_ is fixed since the constructor (single-node jobs).
  if (std::string why = strategy::layout_change(tensors_, layout_plans_, plans); !why.empty())
    throw Error(ErrorCode::kInvalidArgument, "job " + job_ + ": " + why);
  {
    std::lock_guard lock(pending_mu_);
    pending_ = std::move(plans);
  }
  try {
    header_->doorbell.post();
  } catch (...) {
  }
}

void Engine::request_strategy(std::string strategy_yaml) {
  {
    std::lock_guard lock(pending_mu_);
    pending_yaml_ = std::move(strategy_yaml);
  }
  try {
    header_->doorbell.post();
  } catch (...) {
  }
}

void Engine::adopt_pending() {
  std::optional<std::vector<TensorPlan>> p;
  std::optional<std::string> yaml;
  {
    std::lock_guard lock(pending_mu_);
    p.swap(pending_);
    if (ps_) yaml.swap(pending_yaml_);
  }
  if (yaml) {
    const int64_t latest = latest_begun();
    // Two ahead: the servers may already collect latest + 1 for some tensor.
    // No node can begin `at` before it has the update: this node holds its
    // rounds of at - 1 until every node confirmed it, and no round of at - 1
    // completes without them (scripts/soak at ~300 iterations/s refused a
    // push of `at` in 1 of 8 runs before the hold, with this lead alone).
    // And after every change already announced or asked for: a second
    // change on a job idle since the first would otherwise ask for the same
    // iteration, which the coordinator refuses ("not after the last change").
    int64_t next = latest + 2;
    next = std::max(next, last_requested_at_ + 1);
    if (timeline_) next = std::max(next, static_cast<int64_t>(timeline_->latest().first) + 1);
    last_requested_at_ = next;
    const auto at = static_cast<uint64_t>(next);
    const std::string job = job_;
    // Rounds of E - 1 and later wait until every node confirmed (docs/daemon.md).
    const int64_t hold = static_cast<int64_t>(at) - 1;
    hold_from_ = hold_from_ < 0 ? hold : std::min<int64_t>(hold_from_, hold);
    changes_unconfirmed_->fetch_add(1);
    std::weak_ptr<Inbox> inbox = inbox_;
    ps_->set_strategy(std::move(*yaml), at, [job, at, inbox, count = changes_unconfirmed_](
                                                const Status& s) {
      count->fetch_sub(1);
      if (auto i = inbox.lock()) i->wake();
      if (s.ok()) {
        BC_LOG(LogEngine(), kInfo) << "job " << job << ": strategy change applies on every node "
                                   << "from iteration " << at;
      } else {
        BC_LOG(LogEngine(), kError) << "job " << job << ": strategy change refused: "
                                    << s.to_string();
      }
    });
  }
  if (!p || !own_timeline_) return;
  // The switch iteration is after every round already begun, so no tensor
  // changes plan in the middle of an iteration some other tensor finished.
  const int64_t at = latest_begun() + 1;
  if (Status s = own_timeline_->add(static_cast<uint64_t>(at), std::move(*p), ""); !s.ok()) {
    fail(s.code(), "job " + job_ + ": " + s.message());
    return;
  }
  switch_published_.store(at);
  BC_LOG(LogEngine(), kInfo) << "job " << job_ << ": new strategy applies from iteration " << at;
}

void Engine::setup_phases(const std::vector<TensorPlan>& plans) {
  // Each unit cut by server::unit_partition_bytes: a sharded bucket into its
  // equal shards, everything else by its option's pieces (the servers'
  // assignment does the same from the same plans). `plans` are per unit
  // (ps_->info().plans, or a single-node job's per declared tensor).
  // Clients lay out compressed submissions by the declared tensors' slots
  // (ipc::kSubmitCompressed): written before the header's release store
  // below, which is what clients wait for. A fused member's slot holds its
  // own cut (pieces 1, server/fusion.h), which is also how its partitions
  // sit on the servers for broadcasts; its reductions run in its bucket.
  layout_plans_ = plans;
  tensor_pb_.assign(units_.size(), partition_bytes_);
  std::vector<uint32_t> parts;
  for (uint32_t u = 0; u < units_.size(); ++u) {
    if (u < plans.size())
      tensor_pb_[u] = server::unit_partition_bytes(
          plans[u], u < shard_elems_.size() ? shard_elems_[u] : 0, partition_bytes_);
    const uint64_t n = strategy::partition_count(units_[u].bytes(), tensor_pb_[u]);
    if (n > UINT32_MAX || tensor_pb_[u] > UINT32_MAX)
      throw Error(ErrorCode::kInvalidArgument, "job " + job_ + ": tensor '" + units_[u].name +
                                                   "' has too many partitions");
    parts.push_back(static_cast<uint32_t>(n));
  }
  auto* slots = reinterpret_cast<ipc::TensorSlot*>(base_ + layout_.tensors_offset);
  for (uint32_t t = 0; t < tensors_.size(); ++t) {
    slots[t].partition_bytes = static_cast<uint32_t>(tensor_pb_[t]);
    slots[t].partitions = parts[t];
  }
  header_->partition_bytes.store(
      static_cast<uint32_t>(std::min<uint64_t>(partition_bytes_, UINT32_MAX)),
      std::memory_order_release);
  phases_.setup(parts, phase_timestamps_);
}

std::vector<PhaseRecord> Engine::phase_records() const { return phases_.snapshot(); }

void Engine::log_phases() const {
  if (!LogPhases().enabled(log::Level::kDebug)) return;
  for (const PhaseRecord& r : phases_.snapshot()) {
    log::Line line(LogPhases(), log::Level::kDebug);
    line.stream() << "job " << job_ << " tensor '" << unit_name(r.tensor) << "' partition "
                  << r.partition << " iteration " << r.iteration << " path "
                  << (r.tensor < path_of_.size() ? path_of_[r.tensor]->name() : "?") << ":";
    for (size_t p = 0; p < kPhaseCount; ++p) {
      line.stream() << ' ' << phase_name(static_cast<Phase>(p)) << '=' << r.ns[p];
    }
  }
}

void Engine::publish_gauges() {
  uint32_t waiting = 0;
  for (const Round& r : rounds_) waiting += r.arrived > 0 && !r.running;
  queued_pub_.store(sched_.size(), std::memory_order_relaxed);
  inflight_pub_.store(inflight_bytes_, std::memory_order_relaxed);
  waiting_pub_.store(waiting, std::memory_order_relaxed);
}

uint64_t Engine::unit_partition_bytes(uint32_t unit) const { return tensor_pb_.at(unit); }

const std::string& Engine::unit_name(uint32_t unit) const {
  return unit < units_.size() ? units_[unit].name : tensors_.at(unit).name;
}

void Engine::begin_round(uint32_t tensor) {
  Round& round = rounds_[tensor];
  if (fusion_ && fusion_->fused(tensor)) {
    const auto b = static_cast<uint32_t>(fusion_->bucket_of[tensor]);
    const auto unit = static_cast<uint32_t>(fusion_->declared + b);
    BucketRound& br = buckets_[b];
    if (round.compressed) {
      fail(ErrorCode::kInvalidArgument,
           "tensor '" + tensors_[tensor].name + "' (iteration " + std::to_string(round.iteration) +
               ") was submitted compressed by the client, but it is fused into bucket '" +
               unit_name(unit) + "' (tensor fusion fuses only tensors the daemon compresses)");
      return;
    }
    if (br.ready == 0) br.first_ns = round.first_ns;
    if (br.iteration != round.iteration) {
      // track_buckets() refused a member of another iteration at its push.
      fail(ErrorCode::kInternal, "bucket '" + unit_name(unit) + "': tensor '" +
                                     tensors_[tensor].name + "' began iteration " +
                                     std::to_string(round.iteration) + " while the bucket is at " +
                                     std::to_string(br.iteration));
      return;
    }
    if (++br.ready == fusion_->buckets[b].members.size()) begin_bucket(unit, br.iteration);
    return;
  }
  // The round's plan, fixed once for all its partitions, and its path.
  const strategy::Timeline::Entry in_force = timeline_->at(round.iteration);
  if (local_) local_->follow(tensor, in_force);
  if (ps_) {
    path_of_[tensor] = path_for(tensor, (*in_force.plans)[tensor], round.iteration);
    if (path_of_[tensor] == nullptr) return;
  }
  if (round.compressed) {
    // The client's CPU share (leading dense partitions) must be the plan's.
    const uint64_t parts = strategy::partition_count(tensors_[tensor].bytes(), tensor_pb_[tensor]);
    if (std::string why = check_split((*in_force.plans)[tensor], tensors_[tensor].name,
                                      round.iteration, parts, round.dense);
        !why.empty()) {
      fail(ErrorCode::kInvalidArgument, why);
      return;
    }
  }
  round.partitions_left = sched_.add(
      tensor, round.iteration, tensors_[tensor].bytes(), tensor_pb_[tensor],
      static_cast<uint32_t>(ipc::dtype_size(tensors_[tensor].dtype)),
      std::shared_ptr<const TensorPlan>(in_force.plans, &(*in_force.plans)[tensor]),
      round.compressed, round.dense);
  if (phases_.enabled()) {
    const uint64_t now = monotonic_ns();
    for (size_t p = 0; p < round.partitions_left; ++p) {
      phases_.begin(tensor, static_cast<uint32_t>(p), round.iteration, round.first_ns, now);
    }
  }
}

void Engine::begin_bucket(uint32_t unit, uint64_t iteration) {
  const server::Bucket& bucket = fusion_->bucket(unit);
  BucketRound& br = buckets_[unit - fusion_->declared];
  br.collecting = false;
  // The members are packed into the staging copies (in ready order, as the
  // servers' and the other nodes' layout says) partition by partition, in
  // run_batch(), and unpacked in process_arrivals().
  const strategy::Timeline::Entry in_force = timeline_->at(iteration);
  path_of_[unit] = path_for(unit, (*in_force.plans)[unit], iteration);
  if (path_of_[unit] == nullptr) return;
  br.partitions_left = sched_.add(
      unit, iteration, units_[unit].bytes(), unit_partition_bytes(unit), 4,
      std::shared_ptr<const TensorPlan>(in_force.plans, &(*in_force.plans)[unit]), false, 0,
      bucket.members.back(),
      // Shard i sits on server (s0 + i) mod S: node r starting at shard r
      // pushes to another server than every other node at each step (the
      // same order everywhere made all nodes push to one server at a time:
      // 0.80x of unfused at 100 Mbit/s, 4 nodes).
      unit < shard_elems_.size() && shard_elems_[unit] > 0 ? node_rank_ : 0);
  if (phases_.enabled()) {
    const uint64_t now = monotonic_ns();
    for (size_t p = 0; p < br.partitions_left; ++p) {
      phases_.begin(unit, static_cast<uint32_t>(p), iteration, br.first_ns, now);
    }
  }
}

void Engine::complete_bucket(uint32_t unit) {
  // Every partition was unpacked into the members as it finished.
  const server::Bucket& bucket = fusion_->bucket(unit);
  BucketRound& br = buckets_[unit - fusion_->declared];
  br.ready = 0;
  for (uint32_t m : bucket.members) {
    complete(m);
    if (failed_.load()) return;
  }
}

void Engine::partition_done(uint32_t unit) {
  if (fusion_ && fusion_->is_bucket(unit)) {
    if (--buckets_[unit - fusion_->declared].partitions_left == 0) complete_bucket(unit);
  } else if (--rounds_[unit].partitions_left == 0) {
    complete(unit);
  }
}

void Engine::release_held() {
  if (hold_from_ < 0 || changes_unconfirmed_->load() > 0) return;
  hold_from_ = -1;
  // In arrival order, as drain() would have begun them.
  for (uint32_t t : std::exchange(held_, {})) begin_round(t);
}

int64_t Engine::latest_begun() const {
  int64_t latest = -1;
  for (const Round& r : rounds_) {
    latest = std::max(latest, r.last_done);
    if (r.arrived > 0) latest = std::max(latest, static_cast<int64_t>(r.iteration));
  }
  return latest;
}

void Engine::rank_left(uint32_t rank) {
  if (rank < layout_.local_size) left_[rank] = true;
  try {
    header_->doorbell.post();
  } catch (...) {
  }
}

std::pair<ErrorCode, std::string> Engine::publish_abort(ErrorCode code, const std::string& reason) {
  std::lock_guard lock(abort_mu_);
  if (abort_reason_.empty()) {
    abort_reason_ = reason.empty() ? "aborted" : reason;
    abort_code_ = code;
  }
  ipc::publish_abort(header_, code, reason, clients_, layout_.local_size);
  return {abort_code_, abort_reason_};
}

void Engine::fail(ErrorCode code, const std::string& reason) {
  if (failed_.exchange(true)) return;
  BC_LOG(LogEngine(), kWarn) << "job " << job_ << " aborted: " << reason;
  publish_abort(code, reason);
  stop_.store(true);
  on_failure_(code, reason);
}

bool Engine::open_paths() {
  // Blocks until every node registered (bounded by the cluster's admission
  // timeout); submissions wait in the rings meanwhile.
  try {
    ps_ = join_();
  } catch (const Error& e) {
    fail(e.code() == ErrorCode::kOk ? ErrorCode::kUnavailable : e.code(),
         std::string("joining the parameter servers failed: ") + e.what());
    return false;
  }
  const uint64_t pb = ps_->info().partition_bytes;
  if (pb % 64 != 0) {
    fail(ErrorCode::kConfig, "cluster partition_bytes " + std::to_string(pb) +
                                 " is not a multiple of 64");
    return false;
  }
  partition_bytes_ = pb;
  timeline_ = &ps_->timeline();
  // The job's units: the declared tensors, then its fused buckets.
  units_ = ps_->info().tensors;
  if (!ps_->info().units.buckets.empty()) {
    fusion_ = &ps_->info().units;
    shard_elems_ = server::shard_elements(*fusion_, ps_->info().servers.size(), pb);
    staging_ = std::make_shared<std::vector<std::unique_ptr<char[]>>>();
    buckets_.resize(fusion_->buckets.size());
    rank_iteration_.assign(layout_.local_size, -1);
    rank_since_.assign(layout_.local_size, {});
    uint64_t fused = 0;
    for (size_t b = 0; b < fusion_->buckets.size(); ++b) {
      const uint64_t bytes = fusion_->buckets[b].count * 4;
      fused += bytes;
      for (uint32_t r = 0; r < layout_.local_size; ++r) {
        staging_->push_back(std::make_unique<char[]>(bytes + 64));
        const auto at = reinterpret_cast<uintptr_t>(staging_->back().get());
        buckets_[b].bufs.push_back(reinterpret_cast<char*>((at + 63) / 64 * 64));
      }
      buckets_[b].pushed.assign(layout_.local_size, 0);
    }
    // The PS path may push straight from staging: keep it with the segment.
    if (keep_mapped_) {
      keep_mapped_ = std::shared_ptr<const void>(
          std::make_shared<std::pair<std::shared_ptr<const void>,
                                     std::shared_ptr<std::vector<std::unique_ptr<char[]>>>>>(
              keep_mapped_, staging_));
    }
    BC_LOG(LogEngine(), kInfo) << "job " << job_ << ": " << fusion_->buckets.size()
                               << " fused buckets hold " << fused << " bytes of "
                               << fusion_->declared << " tensors";
  }
  std::weak_ptr<Inbox> inbox = inbox_;
  ps_->on_failure([inbox](const Status& s) {
    if (auto i = inbox.lock()) i->fail(s);
  });
  BC_LOG(LogEngine(), kInfo) << "job " << job_ << ": joined the parameter servers as rank "
                             << ps_->info().rank << " of " << ps_->info().nodes.size();
  // The job's first plans, per unit: what the servers' assignment was cut by.
  try {
    setup_phases(ps_->info().plans);
  } catch (const Error& e) {
    fail(e.code(), e.what());
    return false;
  }
  const PathContext ctx{job_,   &units_, tensor_pb_, reducer_.get(),
                        inbox_, &phases_,  bytes_.get()};
  ps_path_ = std::make_unique<PsPath>(ctx, ps_, keep_mapped_);
  try {
    peer_path_ = PeerPath::open(ctx, ps_, peer_opts_);
    ring_path_ = RingPath::open(ctx, ps_, peer_opts_);
  } catch (const Error& e) {
    fail(e.code(), e.what());
    return false;
  }
  // The start plans' paths; each round sets its own (begin_round).
  path_of_.resize(units_.size());
  const strategy::Timeline::Entry first = timeline_->at(ps_->info().start_iteration);
  for (uint32_t t = 0; t < units_.size(); ++t) {
    path_of_[t] = path_for(t, (*first.plans)[t], ps_->info().start_iteration);
    if (path_of_[t] == nullptr) return false;
  }
  collectives_->joined(ps_, tensor_pb_, peer_opts_);
  if (on_joined_) on_joined_(*this, ps_, partition_bytes_);
  return true;
}

ExecutionPath* Engine::path_for(uint32_t unit, const TensorPlan& plan, uint64_t iteration) {
  // An allgather tensor keeps its placement for the job (the coordinator
  // refuses moving it); ring <-> ps moves at the plan's iteration.
  if (peer_path_ && peer_path_->runs(unit)) return peer_path_.get();
  if (plan.placement != strategy::Placement::kRing) return ps_path_.get();
  if (ring_path_ && ring_path_->may_run(unit)) return ring_path_.get();
  fail(ErrorCode::kInternal,
       "tensor '" + unit_name(unit) + "' goes round the daemons' ring from iteration " +
           std::to_string(iteration) +
           ", but this job's ring was not opened for it (the coordinator admits a move onto "
           "the ring only where every node has a peer endpoint)");
  return nullptr;
}

void Engine::loop() {
  try {
    if (join_ && !open_paths()) return;
    while (!stop_.load()) {
      publish_gauges();
      ipc::timed_wait(header_->doorbell, kIdleWait);
      if (stop_.load()) break;
      if (const Status f = inbox_->failure(); !f.ok()) {
        fail(f.code() == ErrorCode::kOk ? ErrorCode::kAborted : f.code(),
             "inter-node: " + f.message());
        break;
      }
      const auto now = std::chrono::steady_clock::now();
      Status late = peer_path_ ? peer_path_->check(now) : Status::Ok();
      if (late.ok() && ring_path_) late = ring_path_->check(now);
      if (late.ok()) late = collectives_->check(now);
      if (!late.ok()) {
        fail(late.code(), "inter-node: " + late.message());
        break;
      }
      if (fusion_ && !check_buckets(now)) break;
      adopt_pending();
      release_held();
      if (!drain() || !collectives_->drain() || !check_left()) break;
      while (!stop_.load()) {
        if (ps_ && !process_arrivals()) return;
        if (sched_.empty()) break;
        const uint64_t bound = tunables_.max_inflight_bytes.load();
        // With that many bytes pushed (or sent to the peers) and
        // unacknowledged, wait (the doorbell rings) before pushing more, so
        // that a high-priority tensor arriving meanwhile does not queue
        // behind them. Only pushes count: a pull (or an allgather round) is
        // answered when every node pushed, and the nodes may start their
        // partitions in different orders (each by its local priority and
        // readiness), so a bound held until the answers would deadlock them.
        if (inflight_bytes_ >= bound) break;
        // Per server link, a window of a few partitions: a high-priority
        // partition arriving later waits behind at most that on its link,
        // not behind every byte already handed to the transport's FIFO.
        // Each node's window depends only on its own pushes' acknowledgements
        // (given whatever the other nodes do), so the nodes cannot wait on
        // each other through it.
        const uint64_t window = tunables_.link_window.load() * partition_bytes_;
        std::vector<Task> batch = sched_.next_batch(
            pool_.concurrency(), bound - inflight_bytes_, [&](Task& t) {
              if (window == 0) return true;
              const auto charge = path_of_[t.tensor]->link_charge(t);
              if (!charge) return true;
              uint64_t& used = link_inflight_[charge->link];
              if (used > 0 && used + charge->bytes > window) return false;  // an idle link takes any
              used += charge->bytes;
              t.link = charge->link;
              t.link_bytes = charge->bytes;
              return true;
            });
        if (batch.empty()) break;  // every queued partition's link is full: an ack rings
        run_batch(batch);
        publish_gauges();
        // New arrivals between batches, so a high-priority tensor overtakes
        // the rest of a large one.
        if (!drain()) break;
      }
    }
  } catch (const Error& e) {
    // e.g. a client's unusable compressed payload (kMalformed, kInvalidArgument).
    fail(e.code(), std::string("engine error: ") + e.what());
  } catch (const std::exception& e) {
    fail(ErrorCode::kInternal, std::string("engine error: ") + e.what());
  }
}

bool Engine::drain() {
  ipc::RingEntry e;
  for (uint32_t r = 0; r < layout_.local_size; ++r) {
    for (;;) {
      try {
        if (!submit_[r].pop(e)) break;
      } catch (const Error& err) {
        fail(ErrorCode::kMalformed, "local rank " + std::to_string(r) + ": " + err.what());
        return false;
      }
      if (const SubmitError bad = check_tensor_id(r, e, tensors_.size())) {
        fail(bad->first, bad->second);
        return false;
      }
      if (const SubmitError bad = check_flags(r, e)) {
        fail(bad->first, bad->second);
        return false;
      }
      Round& round = rounds_[e.tensor];
      if (const SubmitError bad = check_round(r, e, tensors_[e.tensor].name, round)) {
        fail(bad->first, bad->second);
        return false;
      }
      if (fusion_ && !track_buckets(r, e)) return false;
      if (round.arrived == 0) {
        round.iteration = e.iteration;
        round.compressed = (e.flags & ipc::kSubmitCompressed) != 0;
        round.dense = ipc::submit_dense_partitions(e.flags);
        round.first_ns = phases_.enabled() ? monotonic_ns() : 0;
      }
      round.from[r] = true;
      if (++round.arrived == layout_.local_size) {
        round.running = true;
        if (hold_from_ >= 0 && static_cast<int64_t>(round.iteration) >= hold_from_) {
          held_.push_back(e.tensor);
        } else {
          begin_round(e.tensor);
        }
      }
    }
  }
  return true;
}

namespace {
// "'a', 'b', 'c', 'd' and 3 more"
std::string name_list(const std::vector<std::string>& names) {
  constexpr size_t kShown = 4;
  std::string out;
  for (size_t i = 0; i < names.size() && i < kShown; ++i)
    out += (i ? ", '" : "'") + names[i] + "'";
  if (names.size() > kShown) out += " and " + std::to_string(names.size() - kShown) + " more";
  return out;
}

// Why and what to do, after every missing-member failure.
constexpr const char* kMemberRule =
    ": every member of a fused bucket must be pushed in every iteration (tensor fusion has no "
    "find_unused_parameters: push an unused parameter's gradient as zeros, or turn fusion off; "
    "docs/daemon.md \"Tensor fusion\")";
}  // namespace

std::string Engine::missing_members(uint32_t b, const std::vector<uint32_t>& ranks) const {
  const server::Bucket& bucket = fusion_->buckets[b];
  const BucketRound& br = buckets_[b];
  std::vector<uint32_t> all;
  const std::vector<uint32_t>* of = &ranks;
  if (ranks.empty()) {
    for (uint32_t r = 0; r < layout_.local_size; ++r) all.push_back(r);
    of = &all;
  }
  std::vector<std::string> names;
  std::vector<bool> missed(layout_.local_size, false);
  for (uint32_t m : bucket.members) {
    // A member of a collecting bucket is at the bucket's iteration
    // (track_buckets refuses any other), so `from` says who pushed it.
    const Round& round = rounds_[m];
    bool missing = false;
    for (uint32_t r : *of) {
      if (round.arrived > 0 && round.from[r]) continue;
      missing = true;
      missed[r] = true;
    }
    if (missing) names.push_back(tensors_[m].name);
  }
  std::vector<std::string> who;
  for (uint32_t r = 0; r < layout_.local_size; ++r)
    if (missed[r]) who.push_back(std::to_string(r));
  std::string ranks_text;
  for (size_t i = 0; i < who.size(); ++i) ranks_text += (i ? ", " : "") + who[i];
  return std::string(names.size() == 1 ? "fused tensor " : "fused tensors ") + name_list(names) +
         " (bucket '" + unit_name(static_cast<uint32_t>(fusion_->declared + b)) +
         "', iteration " + std::to_string(br.iteration) + ") " +
         (names.size() == 1 ? "was" : "were") + " not pushed by local rank" +
         (who.size() == 1 ? " " : "s ") + ranks_text + " of node rank " +
         std::to_string(node_rank_);
}

bool Engine::track_buckets(uint32_t rank, const ipc::RingEntry& e) {
  // A rank pushes an iteration's tensors before any of the next (DDP's rule,
  // which fusion relies on: a bucket's members all come in one iteration),
  // so a rank that moved on will never push what it left out.
  if (static_cast<int64_t>(e.iteration) > rank_iteration_[rank]) {
    rank_iteration_[rank] = static_cast<int64_t>(e.iteration);
    rank_since_[rank] = std::chrono::steady_clock::now();
  }
  for (uint32_t b = 0; b < buckets_.size(); ++b) {
    const BucketRound& br = buckets_[b];
    if (!br.collecting || e.iteration <= br.iteration ||
        br.pushed[rank] == fusion_->buckets[b].members.size())
      continue;
    fail(ErrorCode::kInvalidArgument, missing_members(b, {rank}) + ", which pushed tensor '" +
                                          tensors_[e.tensor].name + "' of iteration " +
                                          std::to_string(e.iteration) + " already" + kMemberRule);
    return false;
  }
  if (!fusion_->fused(e.tensor)) return true;
  const auto b = static_cast<uint32_t>(fusion_->bucket_of[e.tensor]);
  BucketRound& br = buckets_[b];
  if (!br.collecting) {
    // Not running either: its members' rounds run until the bucket
    // completes, and check_round refuses a second push of one meanwhile.
    br.collecting = true;
    br.iteration = e.iteration;
    br.since = std::chrono::steady_clock::now();
    std::fill(br.pushed.begin(), br.pushed.end(), 0u);
  } else if (e.iteration != br.iteration) {
    // An earlier iteration (a later one was refused above).
    fail(ErrorCode::kInvalidArgument,
         "local rank " + std::to_string(rank) + " pushed fused tensor '" +
             tensors_[e.tensor].name + "' for iteration " + std::to_string(e.iteration) +
             " while its bucket '" + unit_name(static_cast<uint32_t>(fusion_->declared + b)) +
             "' collects iteration " + std::to_string(br.iteration) +
             ": the members of a bucket are pushed with the same iteration");
    return false;
  }
  ++br.pushed[rank];
  return true;
}

bool Engine::check_buckets(std::chrono::steady_clock::time_point now) {
  const uint32_t ms = tunables_.fusion_member_timeout_ms.load();
  for (uint32_t b = 0; b < buckets_.size(); ++b) {
    const BucketRound& br = buckets_[b];
    if (!br.collecting) continue;
    // Late: a rank that pushed every member (the bucket then waits for the
    // other ranks, or for a strategy change's confirmation, which has its
    // own bound), or one that has not begun the bucket's iteration (e.g.
    // checkpointing while its siblings went on; it is caught when it moves
    // past the iteration without the member). Missing: a rank inside the
    // iteration for longer than the bound without the member.
    const size_t members = fusion_->buckets[b].members.size();
    bool missing = false;
    for (uint32_t r = 0; r < br.pushed.size() && !missing; ++r) {
      if (br.pushed[r] == members || rank_iteration_[r] < static_cast<int64_t>(br.iteration))
        continue;
      missing = now - std::max(br.since, rank_since_[r]) >= std::chrono::milliseconds(ms);
    }
    if (!missing) continue;
    fail(ErrorCode::kAborted, missing_members(b, {}) + " within fusion.member_timeout_ms (" +
                                  std::to_string(ms) + " ms) of its bucket's first push" +
                                  kMemberRule);
    return false;
  }
  return true;
}

bool Engine::check_left() {
  for (uint32_t r = 0; r < layout_.local_size; ++r) {
    if (!left_[r].load()) continue;
    if (!collectives_->check_left(r)) return false;
    for (size_t t = 0; t < rounds_.size(); ++t) {
      // Closing with its own push_pull unfinished: the caller abandoned work
      // the others share (its buffer would be summed after it let go of it).
      if (rounds_[t].from[r]) {
        fail(ErrorCode::kAborted, "local rank " + std::to_string(r) +
                                      " closed the job with its push_pull of tensor '" +
                                      tensors_[t].name + "' (iteration " +
                                      std::to_string(rounds_[t].iteration) + ") still in flight");
        return false;
      }
      // A rank that finished everything it pushed leaves quietly: the others
      // keep reading their results, and only a round still waiting for it
      // can never finish.
      if (rounds_[t].arrived > 0 && !rounds_[t].running && !rounds_[t].from[r]) {
        fail(ErrorCode::kAborted, "local rank " + std::to_string(r) +
                                      " closed the job while tensor '" + tensors_[t].name +
                                      "' (iteration " + std::to_string(rounds_[t].iteration) +
                                      ") still waited for it");
        return false;
      }
    }
  }
  return true;
}

void Engine::submit_collective(uint32_t rank, const ipc::Collective& c) {
  collectives_->submit(rank, c);
  try {
    header_->doorbell.post();
  } catch (...) {
  }
}

void Engine::buffers_of(uint32_t tensor, std::vector<char*>& out) const {
  if (fusion_ && fusion_->is_bucket(tensor)) {
    out = buckets_[tensor - fusion_->declared].bufs;
    return;
  }
  const ipc::TensorSlot& s = layout_.tensors[tensor];
  out.clear();
  for (uint32_t r = 0; r < layout_.local_size; ++r) out.push_back(base_ + s.offset + s.stride * r);
}

void Engine::run_batch(const std::vector<Task>& batch) {
  std::vector<std::vector<char*>> bufs(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    buffers_of(batch[i].tensor, bufs[i]);
    if (!path_of_[batch[i].tensor]->synchronous()) inflight_bytes_ += batch[i].bytes();
  }
  pool_.parallel_for(
      batch.size(), 1,
      [&](size_t b, size_t e) {
        for (size_t i = b; i < e; ++i) {
          const Task& t = batch[i];
          phases_.stamp(t.tensor, t.index, t.iteration, Phase::kStart);
          ExecutionPath& path = *path_of_[t.tensor];
          const bool bucket = fusion_ && fusion_->is_bucket(t.tensor);
          if (bucket) {
            bucket_copy(fusion_->bucket(t.tensor), tensors_, layout_, base_, bufs[i], t.begin,
                        t.end, true);
          }
          path.start(t, bufs[i]);
          if (path.synchronous()) {
            if (bucket) {
              bucket_copy(fusion_->bucket(t.tensor), tensors_, layout_, base_, bufs[i], t.begin,
                          t.end, false);
            }
            phases_.end(t.tensor, t.index, t.iteration);
          }
        }
      },
      batch.size());
  // Asynchronous paths' tasks complete in process_arrivals().
  for (const Task& t : batch) {
    if (path_of_[t.tensor]->synchronous()) partition_done(t.tensor);
  }
}

bool Engine::process_arrivals() {
  const Inbox::Acked acked = inbox_->take_acked();
  inflight_bytes_ -= std::min(inflight_bytes_, acked.bytes);
  for (const auto& [link, bytes] : acked.links) {
    uint64_t& used = link_inflight_[link];
    used -= std::min(used, bytes);
  }
  std::vector<Inbox::Arrival> arrived = inbox_->take();
  if (arrived.empty()) return true;
  // The engine's own collectives first; the rest are the paths'.
  std::vector<Inbox::Arrival> paths;
  for (Inbox::Arrival& a : arrived) {
    if (a.kind == Inbox::Arrival::Kind::kPath) {
      paths.push_back(std::move(a));
    } else if (!collectives_->finish(a)) {
      return false;
    }
  }
  arrived = std::move(paths);
  if (arrived.empty()) return true;
  for (const auto& a : arrived) {
    if (!a.status.ok()) {
      fail(a.status.code(), "pull of tensor '" + unit_name(a.task.tensor) + "' (iteration " +
                                std::to_string(a.task.iteration) + ") failed: " + a.status.message());
      return false;
    }
  }
  std::vector<std::string> errors(arrived.size());
  pool_.parallel_for(
      arrived.size(), 1,
      [&](size_t b, size_t e) {
        std::vector<char*> bufs;
        for (size_t i = b; i < e; ++i) {
          const Task& t = arrived[i].task;
          phases_.stamp(t.tensor, t.index, t.iteration, Phase::kArrived, arrived[i].at_ns);
          buffers_of(t.tensor, bufs);
          errors[i] = path_of_[t.tensor]->finish(arrived[i], bufs);
          if (errors[i].empty() && fusion_ && fusion_->is_bucket(t.tensor)) {
            bucket_copy(fusion_->bucket(t.tensor), tensors_, layout_, base_, bufs, t.begin, t.end,
                        false);
          }
          if (errors[i].empty()) phases_.end(t.tensor, t.index, t.iteration);
        }
      },
      arrived.size());
  for (size_t i = 0; i < arrived.size(); ++i) {
    if (!errors[i].empty()) {
      fail(ErrorCode::kMalformed, "answer for tensor '" + unit_name(arrived[i].task.tensor) +
                                      "' unusable: " + errors[i]);
      return false;
    }
  }
  // Bytes in flight were released by the acknowledgements (servers' for
  // pushes, peers' for allgather payloads), not here.
  for (const auto& a : arrived) partition_done(a.task.tensor);
  return true;
}

bool Engine::notify_ranks(uint32_t tensor, uint64_t iteration) {
  for (uint32_t r = 0; r < layout_.local_size; ++r) {
    if (!complete_[r].push({tensor, 0, iteration})) {
      fail(ErrorCode::kMalformed, "completion ring of local rank " + std::to_string(r) +
                                      " is full (client does not drain it)");
      return false;
    }
    try {
      clients_[r].wake.post();
    } catch (const std::exception& e) {
      fail(ErrorCode::kMalformed, "wake semaphore of local rank " + std::to_string(r) +
                                      " unusable: " + e.what());
      return false;
    }
  }
  return true;
}

void Engine::complete(uint32_t tensor) {
  Round& round = rounds_[tensor];
  if (!notify_ranks(tensor, round.iteration)) return;
  round.last_done = static_cast<int64_t>(round.iteration);
  round.arrived = 0;
  round.running = false;
  round.compressed = false;
  round.dense = 0;
  std::fill(round.from.begin(), round.from.end(), false);
}

}  // namespace bytecomp::daemon
