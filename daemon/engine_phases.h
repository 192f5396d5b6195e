// Phase timestamps of the engine's tasks: for each partition of each tensor,
// the monotonic time (CLOCK_MONOTONIC, ns) at which each phase of a round
// ended, for the last kIterations iterations. The online planner, metrics
// and a trace writer read them (Engine::phase_records()); bytecompd logs
// them at a job's end under the category "daemon.phases" (debug).
//
//   kFirstRank     the first local rank's submission was seen
//   kAllRanks      the last one was: "wait for local ranks" ends
//   kStart         a worker began the partition (queueing ends)
//   kReduced       the intra-node sum is done
//   kCompressed    compression is done (= kReduced when uncompressed)
//   kSent          the payload is ready and handed to the transport, which
//                  sends it asynchronously (local path: = kCompressed)
//   kArrived       the inter-node result was delivered to the engine
//                  (transport thread's time; local path: = kSent)
//   kDecompressed  the result is decoded into rank 0's buffer
//   kCopiedOut     every local rank's buffer holds the result
// The local path's uncompressed tensors sum and copy out in one blocked
// pass: their kReduced..kCopiedOut are one time, the end of that pass.
//
// Cost: storage is allocated once per job (partitions x kIterations x
// (kPhaseCount + 1) x 8 bytes); a stamp is one clock read and one relaxed
// store, with no allocation and no lock. Disabled (engine.phase_timestamps:
// false), a stamp is one predictable branch.
//
// Every published record is also added to the job's span histograms
// (PhaseStats: the time between consecutive phases, cumulative since the
// job started), so metrics count every round, not only the last
// kIterations ones: end() costs kSpanCount bucket searches and relaxed
// additions more (the workers that publish add to shared counters).
//
// Thread-safety: each record is written by one thread at a time (the engine
// thread, then the worker running the partition, ...; handed over through
// the pool's and the Inbox's synchronisation). snapshot() may run on any
// thread at any time: each record is a seqlock (its iteration is published
// last), so a copy is either a whole iteration or left out.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

namespace bytecomp::daemon {

enum class Phase : uint8_t {
  kFirstRank,
  kAllRanks,
  kStart,
  kReduced,
  kCompressed,
  kSent,
  kArrived,
  kDecompressed,
  kCopiedOut,
};
inline constexpr size_t kPhaseCount = 9;
std::string_view phase_name(Phase p);

uint64_t monotonic_ns();

// The spans between consecutive phases, as metrics and traces name them:
//   wait_ranks  kFirstRank..kAllRanks    the other local ranks' submissions
//   queue       kAllRanks..kStart        waiting for a worker (scheduler)
//   reduce      kStart..kReduced         intra-node sum
//   compress    kReduced..kCompressed
//   send        kCompressed..kSent       payload built and handed over
//   wire        kSent..kArrived          network and servers / peers
//   decompress  kArrived..kDecompressed
//   copy_out    kDecompressed..kCopiedOut  result into every local rank
inline constexpr size_t kSpanCount = kPhaseCount - 1;
std::string_view span_name(size_t span);

// Upper bounds (ns) of the duration histograms' buckets, 10 us .. 10 s; a
// last bucket (+Inf) takes the rest.
inline constexpr std::array<uint64_t, 19> kBucketBoundsNs{
    10'000,      25'000,      50'000,      100'000,       250'000,
    500'000,     1'000'000,   2'500'000,   5'000'000,     10'000'000,
    25'000'000,  50'000'000,  100'000'000, 250'000'000,   500'000'000,
    1'000'000'000, 2'500'000'000, 5'000'000'000, 10'000'000'000};
inline constexpr size_t kBuckets = kBucketBoundsNs.size() + 1;

// A copy of the span histograms: per span, counts per bucket (not
// cumulative), the sum of durations and their number.
struct PhaseStats {
  std::array<std::array<uint64_t, kBuckets>, kSpanCount> buckets{};
  std::array<uint64_t, kSpanCount> sum_ns{};
  std::array<uint64_t, kSpanCount> count{};
  uint64_t records = 0;  // published records (partition rounds)
};

struct PhaseRecord {
  uint32_t tensor = 0;
  uint32_t partition = 0;
  uint64_t iteration = 0;
  std::array<uint64_t, kPhaseCount> ns{};  // indexed by Phase
  uint64_t at(Phase p) const { return ns[static_cast<size_t>(p)]; }
};

class PhaseLog {
 public:
  static constexpr uint32_t kIterations = 8;

  // Disabled until setup().
  PhaseLog() = default;
  PhaseLog(const PhaseLog&) = delete;
  PhaseLog& operator=(const PhaseLog&) = delete;

  // Once, before any stamp: partitions[t] is the partition count of tensor t.
  void setup(const std::vector<uint32_t>& partitions, bool enabled);
  bool enabled() const { return records_ != nullptr; }

  // Opens the record of (tensor, partition, iteration), overwriting the one
  // of iteration - kIterations, and stamps the round's first two phases.
  void begin(uint32_t tensor, uint32_t partition, uint64_t iteration, uint64_t first_rank_ns,
             uint64_t all_ranks_ns) {
    if (records_ == nullptr) return;
    Record& r = record(tensor, partition, iteration);
    r.seq.store(0, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    for (auto& v : r.ns) v.store(0, std::memory_order_relaxed);
    r.ns[static_cast<size_t>(Phase::kFirstRank)].store(first_rank_ns, std::memory_order_relaxed);
    r.ns[static_cast<size_t>(Phase::kAllRanks)].store(all_ranks_ns, std::memory_order_relaxed);
  }
  void stamp(uint32_t tensor, uint32_t partition, uint64_t iteration, Phase p, uint64_t ns) {
    if (records_ == nullptr) return;
    record(tensor, partition, iteration)
        .ns[static_cast<size_t>(p)]
        .store(ns, std::memory_order_relaxed);
  }
  void stamp(uint32_t tensor, uint32_t partition, uint64_t iteration, Phase p) {
    if (records_ == nullptr) return;
    stamp(tensor, partition, iteration, p, monotonic_ns());
  }
  // Every phase from `from` to kCopiedOut at one time (phases a path does
  // not have).
  void stamp_through(uint32_t tensor, uint32_t partition, uint64_t iteration, Phase from,
                     uint64_t ns);
  // Publishes the record: readers see it from now on.
  void end(uint32_t tensor, uint32_t partition, uint64_t iteration) {
    if (records_ == nullptr) return;
    Record& r = record(tensor, partition, iteration);
    account(r);
    r.seq.store(iteration + 1, std::memory_order_release);
  }

  // Every published record of the last kIterations iterations, by tensor,
  // partition, then iteration. Allocates; not for the hot path.
  std::vector<PhaseRecord> snapshot() const;
  // The span histograms of every record published so far (all zero when
  // disabled or before setup()). Thread-safe; the counters are read one by
  // one, so a copy taken while records are published may hold a record in
  // some spans and not yet in others.
  PhaseStats stats() const;
  // Partitions of each tensor (empty when disabled or before setup()).
  // Thread-safe.
  std::vector<uint32_t> partitions() const {
    if (!ready_.load(std::memory_order_acquire) || records_ == nullptr) return {};
    return partitions_;
  }

 private:
  struct Record {
    std::atomic<uint64_t> seq{0};  // iteration + 1 once published, 0 while written
    std::array<std::atomic<uint64_t>, kPhaseCount> ns{};
  };
  struct Stats {
    std::array<std::array<std::atomic<uint64_t>, kBuckets>, kSpanCount> buckets{};
    std::array<std::atomic<uint64_t>, kSpanCount> sum_ns{};
    std::array<std::atomic<uint64_t>, kSpanCount> count{};
    std::atomic<uint64_t> records{0};
  };
  // Adds a finished record's spans to stats_ (called by its writer).
  void account(const Record& r);
  Record& record(uint32_t tensor, uint32_t partition, uint64_t iteration) {
    return records_[(first_[tensor] + partition) * kIterations + iteration % kIterations];
  }

  std::vector<uint64_t> first_;  // first partition slot of each tensor
  std::vector<uint32_t> partitions_;
  std::unique_ptr<Record[]> records_;
  std::unique_ptr<Stats> stats_;  // with records_
  // setup() done (snapshot() may run on another thread before it).
  std::atomic<bool> ready_{false};
};

}  // namespace bytecomp::daemon
