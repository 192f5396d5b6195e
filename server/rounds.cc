#include "server/rounds.h"

#include <chrono>

#include <algorithm>
#include <cstring>

#include "compress/reduce.h"
#include "planner/strategy/answer.h"
#include "server/server_log.h"

namespace bytecomp::server {

using transport::Buffer;
using transport::Incoming;

// Recycles a partition's fp32 blocks: the sum of round i becomes the pull
// answer (shared with the transport while being sent) and a spare block
// becomes the sum of round i+1, without a copy or a fresh allocation.
// Thread-safe (the transport releases blocks on its threads).
class BlockPool {
 public:
  explicit BlockPool(size_t floats) : floats_(floats) {}
  std::unique_ptr<float[]> get() {
    {
      std::lock_guard lk(mu_);
      if (!free_.empty()) {
        auto p = std::move(free_.back());
        free_.pop_back();
        return p;
      }
    }
    return std::unique_ptr<float[]>(new float[std::max<size_t>(floats_, 1)]);
  }
  void put(std::unique_ptr<float[]> p) {
    std::lock_guard lk(mu_);
    if (free_.size() < 2) free_.push_back(std::move(p));
  }

 private:
  size_t floats_;
  std::mutex mu_;
  std::vector<std::unique_ptr<float[]>> free_;
};

// ---------------------------------------------------------------------------
// Strategy changes

Status rounds_admit_change(uint64_t iteration, const std::vector<const PartitionRound*>& rounds,
                           const std::string& who) {
  for (const PartitionRound* r : rounds) {
    int64_t f = r->frozen();
    if (f >= 0 && static_cast<uint64_t>(f) >= iteration)
      return Status(ErrorCode::kInvalidArgument,
                    who + ": " + r->label() + " already started iteration " + std::to_string(f) +
                        " (request changes at least one iteration ahead)");
  }
  return Status::Ok();
}

bool fuses_sum(const TensorPlan& plan) {
  return plan.compressed_push() && !strategy::between_daemons(plan.placement) &&
         plan.sum == SumMode::kDense && plan.pull == PullFormat::kCompressed &&
         compress::make_sum_recompressor(plan.spec(), plan.server_error_feedback)
             ->fuses_sum_compress();
}

uint64_t round_reservation(const TensorPlan& plan, uint64_t count, size_t nodes,
                           bool deterministic) {
  // A ring tensor's round holds nothing (its blocks come with its first push).
  if (strategy::between_daemons(plan.placement)) return 0;
  uint64_t r = 4 * count * 4;  // sum + answer in flight + spare block + held first push
  if (plan.sum == SumMode::kCompressed || deterministic || fuses_sum(plan))
    r += nodes * push_bytes_bound(plan, count);
  if (plan.pull != PullFormat::kFp32) r += 2 * pull_bytes_bound(plan, count);
  if (plan.server_error_feedback) r += count * 4;  // the server's residual
  return r;
}

// ---------------------------------------------------------------------------
// PartitionRound

PartitionRound::PartitionRound(RoundSetup setup, const Timeline& plans)
    : setup_(std::move(setup)), plans_(plans), collecting_(setup_.start_iteration) {
  if (setup_.nodes == 0) throw Error(ErrorCode::kInvalidArgument, setup_.label + ": a job without nodes");
  pool_ = std::make_shared<BlockPool>(setup_.part.count);
  // The sum block comes with the first push: a ring tensor's partition may
  // never see one.
  pending_.resize(setup_.nodes);
  pushed_.assign(setup_.nodes, 0);
}

PartitionRound::~PartitionRound() = default;

compress::CompressContext PartitionRound::ctx() const {
  compress::CompressContext c;
  c.iteration = collecting_;
  c.shared_seed = setup_.shared_seed;
  c.private_seed = setup_.private_seed;
  return c;
}

void PartitionRound::fix_plan() {
  TensorPlan plan = plans_.plan(setup_.part.tensor, collecting_, &frozen_);
  if (plan_ready_ && plan == plan_) return;
  plan_ = std::move(plan);
  plan_ready_ = true;
  // A ring plan's pushes are refused (push()): nothing to decode them with.
  if (plan_.compressed_push() && !strategy::between_daemons(plan_.placement)) {
    // It decodes the pushes and, under a gathering collective, recompresses
    // their sum: with the server's own error feedback, and never with the
    // nodes' momentum (they applied it; again on the sum it compounds).
    comp_ = compress::make_sum_recompressor(plan_.spec(), plan_.server_error_feedback);
    state_ = comp_->make_state(setup_.part.count);
  } else {
    comp_.reset();
    state_.reset();
  }
  fused_ = comp_ && plan_.sum == SumMode::kDense && plan_.pull == PullFormat::kCompressed &&
           comp_->fuses_sum_compress();
}

PushOutcome PartitionRound::push(transport::NodeId from, uint32_t rank, uint64_t it,
                                 const std::vector<Buffer>& payloads, bool shared) {
  PushOutcome out;
  auto refuse = [&](ErrorCode code, std::string why) {
    out.status = Status(code, std::move(why));
    return std::move(out);
  };
  const std::string& label = setup_.label;
  if (released_) return refuse(ErrorCode::kUnavailable, "push refused: " + label + " is released");
  if (rank >= pushed_.size())
    return refuse(ErrorCode::kInvalidArgument,
                  "push refused: rank " + std::to_string(rank) + " of node " +
                      std::to_string(from) + " is not below the job's " +
                      std::to_string(pushed_.size()) + " ranks");
  const std::string who = "node " + std::to_string(from) + " (rank " + std::to_string(rank) + ")";
  if (it < collecting_)
    return refuse(ErrorCode::kInvalidArgument,
                  "push refused: stale iteration " + std::to_string(it) + " from " + who + ": " +
                      label + " is collecting iteration " + std::to_string(collecting_));
  skip_to(it);
  if (it > collecting_)
    return refuse(ErrorCode::kInvalidArgument,
                  "push refused: future iteration " + std::to_string(it) + " from " + who + ": " +
                      label + " is collecting iteration " + std::to_string(collecting_));
  if (pushed_[rank])
    return refuse(ErrorCode::kInvalidArgument,
                  "push refused: duplicate push from " + who + " for iteration " +
                      std::to_string(it) + " of " + label);
  if (payloads.size() != 1)
    return refuse(ErrorCode::kInvalidArgument,
                  "push refused: " + std::to_string(payloads.size()) + " payload buffers for " +
                      label + " (accepted: exactly 1)");
  if (n_pushed_ == 0) {
    fix_plan();
    if (strategy::between_daemons(plan_.placement))
      return refuse(ErrorCode::kInvalidArgument,
                    "push refused: " + label + " goes round the daemons' ring at iteration " +
                        std::to_string(it) + " (its plan: " + plan_.describe() + ")");
    if (!sum_) sum_ = pool_->get();
    started_ns_ = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                            std::chrono::steady_clock::now().time_since_epoch())
                                            .count());
  }
  // Compressed bytes the sender could rewrite between inspect() and the
  // decode (later still for a stored push) would pass the checks and then
  // decode as something else: decode our own copy. Raw fp32 needs none:
  // any bytes are floats, and they are only the sender's own contribution.
  Buffer copy;
  if (shared && plan_.compressed_push())
    copy = Buffer::copy_of(payloads[0].data(), payloads[0].size());
  const Buffer& b = copy.empty() ? payloads[0] : copy;
  const uint64_t count = setup_.part.count;
  if (!plan_.compressed_push()) {
    if (b.size() != count * 4)
      return refuse(ErrorCode::kInvalidArgument,
                    "push refused: wrong length " + std::to_string(b.size()) + " bytes from " +
                        who + " for " + label + " (expected " + std::to_string(count * 4) +
                        " = " + std::to_string(count) + " fp32)");
  } else {
    compress::WireInfo info;
    try {
      info = compress::inspect(b.span());
    } catch (const Error& e) {
      return refuse(ErrorCode::kMalformed, "push refused: malformed compressed buffer from " +
                                               who + " for " + label + ": " + e.what());
    }
    if (info.algorithm != plan_.spec().name)
      return refuse(ErrorCode::kInvalidArgument,
                    "push refused: buffer from " + who + " is compressed with '" + info.algorithm +
                        "' but " + label + " expects '" + plan_.spec().name + "'");
    if (info.count != count || info.total_bytes != b.size())
      return refuse(ErrorCode::kInvalidArgument,
                    "push refused: wrong length from " + who + " for " + label + ": buffer of " +
                        std::to_string(b.size()) + " bytes holds " + std::to_string(info.count) +
                        " elements (expected " + std::to_string(count) + ")");
  }
  const bool store = plan_.sum == SumMode::kCompressed || setup_.deterministic || fused_;
  if (fused_) {
    // Summed at the round's end (sum_compress); checked now, so a bad push
    // is refused as an accumulated one would be.
    try {
      comp_->check(b.span(), count);
    } catch (const Error& e) {
      return refuse(ErrorCode::kMalformed, "push refused: cannot decode buffer from " + who +
                                               " for " + label + ": " + e.what());
    }
  } else if (!store) {
    try {
      accumulate(b);
    } catch (const Error& e) {
      return refuse(ErrorCode::kMalformed, "push refused: cannot decode buffer from " + who +
                                               " for " + label + ": " + e.what());
    }
  }
  pushed_[rank] = 1;
  ++n_pushed_;
  if (store) {
    pending_[rank] = b;
    if (plan_.sum == SumMode::kDense && !fused_) {
      while (next_rank_ < pending_.size() && !pending_[next_rank_].empty()) {
        if (!poisoned_) {
          try {
            accumulate(pending_[next_rank_]);
          } catch (const Error& e) {
            poisoned_ = true;
            poison_ = "cannot decode the push of rank " + std::to_string(next_rank_) + ": " +
                      e.what();
          }
        }
        pending_[next_rank_] = Buffer();
        ++next_rank_;
      }
    }
  }
  if (n_pushed_ == pushed_.size()) return complete();
  return out;
}

void PartitionRound::skip_to(uint64_t iteration) {
  // Only an idle round skips, and only iterations no server ran: the
  // tensor's plan put them on the daemons' ring (every server prepared a
  // change before any node ran it, so the timeline here knows them).
  if (iteration <= collecting_ || n_pushed_ > 0 || !waiting_.empty()) return;
  if (!plans_.off_servers(setup_.part.tensor, collecting_, iteration)) return;
  collecting_ = iteration;
}

void PartitionRound::accumulate(const Buffer& b) {
  const size_t n = setup_.part.count;
  if (comp_) {
    comp_->decompress(b.span(), compress::TensorView::cpu(sum_.get(), n), sum_started_, ctx());
  } else {
    const float* src = reinterpret_cast<const float*>(b.data());
    std::vector<float> aligned;
    if (reinterpret_cast<uintptr_t>(src) % alignof(float) != 0) {
      aligned.resize(n);
      std::memcpy(aligned.data(), b.data(), n * 4);
      src = aligned.data();
    }
    if (!sum_started_) {
      if (aligned.empty()) {
        // Keep the first push as it arrived and sum it with the second in
        // one pass (compress::sum writes dst without reading it): one fewer
        // pass over the partition than copy-then-add, same additions in the
        // same order.
        held_ = b;
        sum_started_ = true;
        return;
      }
      std::memcpy(sum_.get(), src, n * 4);
    } else if (!held_.empty()) {
      const float* srcs[2] = {reinterpret_cast<const float*>(held_.data()), src};
      compress::sum(sum_.get(), srcs, n);
      held_ = Buffer();
    } else {
      compress::sum_into(sum_.get(), src, n);
    }
  }
  sum_started_ = true;
}

PushOutcome PartitionRound::complete() {
  PushOutcome out;
  out.completed = true;
  out.started_ns = started_ns_;
  const size_t n = setup_.part.count;
  Buffer result;
  try {
    if (poisoned_) throw Error(ErrorCode::kMalformed, poison_);
    if (!held_.empty()) {  // a one-node job: the push is the sum
      std::memcpy(sum_.get(), held_.data(), n * 4);
      held_ = Buffer();
    }
    if (fused_) {
      // Decoded, summed in rank order (the deterministic order) and
      // recompressed a few thousand elements at a time, without the fp32 sum
      // in memory: the same bits as summing into sum_ and encode_answer().
      std::vector<std::span<const std::byte>> inputs;
      for (const Buffer& b : pending_) inputs.push_back(b.span());
      Buffer buf = Buffer::allocate(pull_bytes_bound(plan_, n));
      size_t len = comp_->sum_compress(inputs, n, sum_.get(), {buf.mutable_data(), buf.size()},
                                       *state_, ctx());
      result = buf.slice(0, len);
    } else if (plan_.sum == SumMode::kCompressed) {
      std::vector<std::span<const std::byte>> inputs;
      for (const Buffer& b : pending_) inputs.push_back(b.span());
      Buffer buf = Buffer::allocate(comp_->max_compressed_bytes(n));
      size_t len = comp_->aggregate(inputs, {buf.mutable_data(), buf.size()}, ctx());
      result = buf.slice(0, len);
    } else if (strategy::answer_is_raw_sum(plan_.pull)) {
      // The block's owner rides in the release function's capture, so it
      // returns to the pool when the last copy of that function goes
      // (however many copies Buffer::wrap makes of it).
      std::shared_ptr<BlockPool> pool = pool_;
      std::shared_ptr<float[]> block(sum_.release(), [pool](float* p) {
        pool->put(std::unique_ptr<float[]>(p));
      });
      const float* raw = block.get();
      result = Buffer::wrap(raw, n * 4, [block] {});
      sum_ = pool_->get();
    } else {
      Buffer buf = Buffer::allocate(pull_bytes_bound(plan_, n));
      size_t len = strategy::encode_answer(plan_.pull, sum_.get(), n,
                                           {buf.mutable_data(), buf.size()}, comp_.get(),
                                           state_.get(), ctx());
      result = buf.slice(0, len);
    }
  } catch (const Error& e) {
    out.failure = setup_.label + ", iteration " + std::to_string(collecting_) + ": " + e.what();
  }
  for (Buffer& b : pending_) b = Buffer();
  held_ = Buffer();
  std::fill(pushed_.begin(), pushed_.end(), 0);
  n_pushed_ = 0;
  next_rank_ = 0;
  sum_started_ = false;
  poisoned_ = false;
  if (!out.failure.empty()) {
    // A round that cannot be summed cannot be repeated: the job fails.
    for (Incoming& in : waiting_)
      out.answers.push_back({std::move(in), Status(ErrorCode::kAborted, out.failure), {}});
    waiting_.clear();
    ++collecting_;
    return out;
  }
  result_ = std::move(result);
  has_result_ = true;
  result_iteration_ = collecting_;
  ++collecting_;
  for (Incoming& in : waiting_) out.answers.push_back({std::move(in), Status::Ok(), result_});
  waiting_.clear();
  return out;
}

std::optional<RoundAnswer> PartitionRound::pull(Incoming in) {
  auto refuse = [&](ErrorCode code, std::string why) {
    return RoundAnswer{std::move(in), Status(code, std::move(why)), {}};
  };
  const std::string& label = setup_.label;
  if (released_) return refuse(ErrorCode::kUnavailable, "pull refused: " + label + " is released");
  const uint64_t it = in.message.header.arg;
  if (has_result_ && it == result_iteration_) return RoundAnswer{std::move(in), Status::Ok(), result_};
  skip_to(it);
  if (it == collecting_) {
    // No push would ever finish a round the daemons' ring runs.
    if (n_pushed_ == 0) {
      const TensorPlan plan = plans_.plan(setup_.part.tensor, it);
      if (strategy::between_daemons(plan.placement))
        return refuse(ErrorCode::kInvalidArgument,
                      "pull refused: " + label + " goes round the daemons' ring at iteration " +
                          std::to_string(it) + " (its plan: " + plan.describe() + ")");
    }
    for (const Incoming& w : waiting_)
      if (w.from == in.from)
        return refuse(ErrorCode::kInvalidArgument,
                      "pull refused: duplicate pull from node " + std::to_string(in.from) +
                          " for iteration " + std::to_string(it) + " of " + label +
                          " (one is already waiting)");
    waiting_.push_back(std::move(in));
    return std::nullopt;
  }
  if (it < collecting_)
    return refuse(ErrorCode::kInvalidArgument,
                  "pull refused: stale iteration " + std::to_string(it) + " of " + label +
                      ": its result is gone (" +
                      (has_result_ ? "holding iteration " + std::to_string(result_iteration_)
                                   : std::string("no result yet")) +
                      ", collecting " + std::to_string(collecting_) + ")");
  return refuse(ErrorCode::kInvalidArgument,
                "pull refused: future iteration " + std::to_string(it) + " of " + label +
                    ": collecting iteration " + std::to_string(collecting_));
}

std::vector<RoundAnswer> PartitionRound::release(const Status& why) {
  std::vector<RoundAnswer> out;
  if (released_) return out;
  released_ = true;
  if (why.code() != ErrorCode::kOk && (n_pushed_ > 0 || !waiting_.empty())) {
    std::string ranks, pulls;
    for (size_t r = 0; r < pushed_.size(); ++r)
      if (pushed_[r]) ranks += (ranks.empty() ? "" : ",") + std::to_string(r);
    for (const Incoming& in : waiting_)
      pulls += (pulls.empty() ? "" : ",") + std::to_string(in.from);
    BC_LOG(LogServer(), kDebug) << setup_.label << " released unfinished: collecting iteration "
                                << collecting_ << ", pushes from ranks {" << ranks
                                << "}, pulls waiting from nodes {" << pulls << "}";
  }
  // An ok `why` would turn the waiting pulls' answers into empty sums.
  const Status err = why.ok() ? Status(ErrorCode::kUnavailable, setup_.label + " released") : why;
  for (Incoming& in : waiting_) out.push_back({std::move(in), err, {}});
  waiting_.clear();
  waiting_.shrink_to_fit();
  pending_.clear();
  held_ = Buffer();
  result_ = Buffer();
  sum_.reset();
  state_.reset();
  comp_.reset();
  return out;
}

// ---------------------------------------------------------------------------
// BroadcastRound

BroadcastRound::BroadcastRound(Partition part, std::string label, uint32_t nodes)
    : part_(part), label_(std::move(label)), nodes_(nodes), from_(nodes, 0) {}

BroadcastOutcome BroadcastRound::fail_all(Incoming in, const std::string& why) {
  BroadcastOutcome out;
  out.failure = label_ + ": broadcast of iteration " + std::to_string(collecting_) + ": " + why;
  const Status err(ErrorCode::kInvalidArgument, out.failure);
  for (Incoming& w : waiting_) out.answers.push_back({std::move(w), err, {}});
  out.answers.push_back({std::move(in), err, {}});
  finish();
  return out;
}

void BroadcastRound::finish() {
  waiting_.clear();
  ranks_.clear();
  std::fill(from_.begin(), from_.end(), 0);
  data_ = Buffer();
  root_rank_ = -1;
  last_done_ = static_cast<int64_t>(collecting_);
}

BroadcastOutcome BroadcastRound::add(Incoming in, uint32_t rank, bool is_root) {
  const uint64_t iteration = in.message.header.arg;
  const std::string node = "node " + std::to_string(in.from) + " (rank " + std::to_string(rank) + ")";
  BroadcastOutcome out;
  auto refuse = [&](const std::string& why) {
    out.answers.push_back({std::move(in), Status(ErrorCode::kInvalidArgument, label_ + ": " + why), {}});
    return std::move(out);
  };
  if (released_) return refuse("released");
  const size_t want_payloads = is_root ? 2 : 1;
  if (in.message.payloads.size() != want_payloads)
    return refuse("broadcast from " + node + " has " + std::to_string(in.message.payloads.size()) +
                  " payloads, expected " + std::to_string(want_payloads));
  proto::BroadcastMeta meta;
  try {
    meta = proto::decode_broadcast_meta(in.message.payloads[0].view());
  } catch (const Error& e) {
    out.answers.push_back({std::move(in), Status(ErrorCode::kMalformed, e.what()), {}});
    return out;
  }
  if (rank >= nodes_) return refuse(node + " is not a rank of the job");
  if (waiting_.empty()) {
    if (static_cast<int64_t>(iteration) <= last_done_)
      return refuse("broadcast of iteration " + std::to_string(iteration) + " from " + node +
                    " is not after the last one (" + std::to_string(last_done_) + ")");
    collecting_ = iteration;
    meta_ = meta;
    first_rank_ = rank;
  } else if (iteration != collecting_) {
    return fail_all(std::move(in), node + " sent iteration " + std::to_string(iteration) +
                                       ", rank " + std::to_string(first_rank_) + " iteration " +
                                       std::to_string(collecting_) +
                                       " (the ranks run different broadcasts)");
  }
  if (from_[rank]) return fail_all(std::move(in), node + " sent its part twice");
  if (!(meta == meta_))
    return fail_all(std::move(in), "the ranks disagree: " + node + " passed " +
                                       proto::describe(meta) + ", rank " +
                                       std::to_string(first_rank_) + " passed " +
                                       proto::describe(meta_));
  const uint64_t begin = part_.offset * 4;
  if (part_.index > 0 && begin >= meta.nbytes)
    return fail_all(std::move(in), node + " sent partition " + std::to_string(part_.index) +
                                       ", beyond the broadcast's " + std::to_string(meta.nbytes) +
                                       " bytes");
  const uint64_t want = meta.nbytes <= begin ? 0 : std::min<uint64_t>(meta.nbytes - begin, part_.count * 4);
  if (is_root) {
    if (root_rank_ >= 0)
      return fail_all(std::move(in), node + " and rank " + std::to_string(root_rank_) +
                                         " both hold root rank " + std::to_string(meta.root));
    if (in.message.payloads[1].size() != want)
      return fail_all(std::move(in), "root " + node + " sent " +
                                         std::to_string(in.message.payloads[1].size()) +
                                         " bytes for a partition of " + std::to_string(want));
    data_ = in.message.payloads[1];
    root_rank_ = rank;
  }
  from_[rank] = 1;
  ranks_.push_back(rank);
  waiting_.push_back(std::move(in));
  if (waiting_.size() < nodes_) return out;
  if (root_rank_ < 0) {
    Incoming last = std::move(waiting_.back());
    waiting_.pop_back();
    return fail_all(std::move(last), "no node holds root rank " + std::to_string(meta_.root) +
                                         " (root beyond the job's ranks, or nodes with "
                                         "different numbers of local ranks)");
  }
  for (size_t i = 0; i < waiting_.size(); ++i) {
    const bool root = static_cast<int64_t>(ranks_[i]) == root_rank_;
    out.answers.push_back({std::move(waiting_[i]), Status::Ok(), root ? Buffer() : data_});
  }
  finish();
  return out;
}

std::vector<RoundAnswer> BroadcastRound::release(const Status& why) {
  std::vector<RoundAnswer> out;
  if (released_) return out;
  released_ = true;
  const Status err = why.ok() ? Status(ErrorCode::kUnavailable, label_ + " released") : why;
  for (Incoming& in : waiting_) out.push_back({std::move(in), err, {}});
  waiting_.clear();
  data_ = Buffer();
  return out;
}

}  // namespace bytecomp::server
