#include "daemon/engine_phases.h"

#include <time.h>

#include <algorithm>

namespace bytecomp::daemon {

std::string_view phase_name(Phase p) {
  switch (p) {
    case Phase::kFirstRank: return "first_rank";
    case Phase::kAllRanks: return "all_ranks";
    case Phase::kStart: return "start";
    case Phase::kReduced: return "reduced";
    case Phase::kCompressed: return "compressed";
    case Phase::kSent: return "sent";
    case Phase::kArrived: return "arrived";
    case Phase::kDecompressed: return "decompressed";
    case Phase::kCopiedOut: return "copied_out";
  }
  return "?";
}

std::string_view span_name(size_t span) {
  static constexpr std::string_view kNames[kSpanCount] = {
      "wait_ranks", "queue", "reduce", "compress", "send", "wire", "decompress", "copy_out"};
  return span < kSpanCount ? kNames[span] : "?";
}

uint64_t monotonic_ns() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

void PhaseLog::setup(const std::vector<uint32_t>& partitions, bool enabled) {
  if (enabled) {
    uint64_t slots = 0;
    for (uint32_t n : partitions) {
      first_.push_back(slots);
      slots += n;
    }
    partitions_ = partitions;
    records_ = std::make_unique<Record[]>(slots * kIterations);
    stats_ = std::make_unique<Stats>();
  }
  ready_.store(true, std::memory_order_release);
}

void PhaseLog::stamp_through(uint32_t tensor, uint32_t partition, uint64_t iteration, Phase from,
                             uint64_t ns) {
  if (records_ == nullptr) return;
  Record& r = record(tensor, partition, iteration);
  for (size_t p = static_cast<size_t>(from); p < kPhaseCount; ++p) {
    r.ns[p].store(ns, std::memory_order_relaxed);
  }
}

void PhaseLog::account(const Record& r) {
  Stats& s = *stats_;
  uint64_t prev = r.ns[0].load(std::memory_order_relaxed);
  for (size_t i = 0; i < kSpanCount; ++i) {
    const uint64_t next = r.ns[i + 1].load(std::memory_order_relaxed);
    // A phase left unstamped (0) gives no duration: its spans are skipped.
    // kArrived is the transport thread's clock read, which can precede the
    // worker's kSent stamp when the answer is quick: that span counts as 0.
    if (prev != 0 && next != 0) {
      const uint64_t d = next > prev ? next - prev : 0;
      const size_t b = static_cast<size_t>(
          std::lower_bound(kBucketBoundsNs.begin(), kBucketBoundsNs.end(), d) -
          kBucketBoundsNs.begin());
      s.buckets[i][b].fetch_add(1, std::memory_order_relaxed);
      s.sum_ns[i].fetch_add(d, std::memory_order_relaxed);
      s.count[i].fetch_add(1, std::memory_order_relaxed);
    }
    prev = next;
  }
  s.records.fetch_add(1, std::memory_order_relaxed);
}

PhaseStats PhaseLog::stats() const {
  PhaseStats out;
  if (!ready_.load(std::memory_order_acquire) || stats_ == nullptr) return out;
  for (size_t i = 0; i < kSpanCount; ++i) {
    for (size_t b = 0; b < kBuckets; ++b) {
      out.buckets[i][b] = stats_->buckets[i][b].load(std::memory_order_relaxed);
    }
    out.sum_ns[i] = stats_->sum_ns[i].load(std::memory_order_relaxed);
    out.count[i] = stats_->count[i].load(std::memory_order_relaxed);
  }
  out.records = stats_->records.load(std::memory_order_relaxed);
  return out;
}

std::vector<PhaseRecord> PhaseLog::snapshot() const {
  std::vector<PhaseRecord> out;
  if (!ready_.load(std::memory_order_acquire) || records_ == nullptr) return out;
  for (uint32_t t = 0; t < partitions_.size(); ++t) {
    for (uint32_t p = 0; p < partitions_[t]; ++p) {
      std::vector<PhaseRecord> mine;
      for (uint32_t k = 0; k < kIterations; ++k) {
        const Record& r = records_[(first_[t] + p) * kIterations + k];
        const uint64_t before = r.seq.load(std::memory_order_acquire);
        if (before == 0) continue;
        PhaseRecord copy;
        copy.tensor = t;
        copy.partition = p;
        copy.iteration = before - 1;
        for (size_t i = 0; i < kPhaseCount; ++i) copy.ns[i] = r.ns[i].load(std::memory_order_relaxed);
        std::atomic_thread_fence(std::memory_order_acquire);
        // Rewritten meanwhile: that iteration is gone, the new one not done.
        if (r.seq.load(std::memory_order_relaxed) != before) continue;
        mine.push_back(copy);
      }
      std::sort(mine.begin(), mine.end(),
                [](const PhaseRecord& a, const PhaseRecord& b) { return a.iteration < b.iteration; });
      out.insert(out.end(), mine.begin(), mine.end());
    }
  }
  return out;
}

}  // namespace bytecomp::daemon
