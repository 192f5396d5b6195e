// Layout of a job's shared-memory segment, version 1, and the notification
// rings inside it. The daemon creates the segment (Boost.Interprocess
// shared_memory_object, mode 0600, owned by the job's user) and both sides
// map it. Offsets are from the segment's start, every block 64-byte aligned:
//
//   SegmentHeader            magic, sizes, job state, abort reason, doorbell
//   ClientArea[local_size]   per local rank: wake semaphore, two ring indices
//   RingEntry[local_size][2][ring_capacity]   submit ring, completion ring
//   TensorSlot[num_tensors]  per tensor: bytes, offset of rank 0, rank stride
//   data                     tensor t of rank r at data_offset + r * stride
//
// Both sides compute the layout from the declarations (Layout below); the
// client checks that the segment's header equals what it computed, so a
// daemon built from other sources is caught rather than trusted.
//
// Notifications: each ring is single-producer single-consumer, with 64-bit
// head/tail counters (atomics in shared memory, lock-free and address-free on
// the platforms we build for). A producer pushes an entry, then posts the
// consumer's semaphore (interprocess_semaphore, a process-shared POSIX sem_t:
// no owner, so a process dying at any point leaves it usable). Consumers
// block in timed waits; nobody spins. Client -> daemon: submit rings, one
// doorbell per job. Daemon -> client: completion rings, one wake per client.
// The daemon validates every index it reads from the segment (a client may
// scribble anything there); the client validates what the daemon writes.
//
// Thread-safety: rings are SPSC: one producer thread (or callers serialised
// by a lock) and one consumer at a time.
#pragma once

#include <atomic>
#include <boost/interprocess/sync/interprocess_semaphore.hpp>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "client/ipc/protocol.h"

namespace bytecomp::ipc {

inline constexpr uint32_t kSegmentMagic = 0x47534342;  // "BCSG"
// 2: the header carries the daemon's heartbeat and the job's partition size.
// 3: each TensorSlot carries the tensor's own partition size and count
//    (strategy::tensor_partition_bytes: the strategy's `pieces`).
inline constexpr uint32_t kLayoutVersion = 3;
inline constexpr uint64_t kAlign = 64;
inline constexpr size_t kAbortReasonBytes = 1024;

static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(std::atomic<uint32_t>::is_always_lock_free);

enum class JobState : uint32_t { kRunning = 0, kAborted = 1 };

// Submit: tensor + iteration + flags (kSubmit* bits). Completion: tensor +
// iteration + status (an ErrorCode value; the reason is in the header for
// aborts). The second word is named by the ring it travels on.
struct RingEntry {
  uint32_t tensor;
  union {
    uint32_t status;  // completion ring
    uint32_t flags;   // submit ring
  };
  uint64_t iteration;
};
// Submit flag: the client wrote, at the start of each partition's byte range
// of its buffer (partitions of SegmentHeader::partition_bytes), that
// partition's payload already compressed with the compressor of the plan in
// force (the CPU library's wire format; e.g. by a CUDA compressor in the
// client, docs/gpu.md). The daemon skips its own compressor for the round;
// every local rank of a round must agree. The aggregate comes back dense.
inline constexpr uint32_t kSubmitCompressed = 1u;
// With kSubmitCompressed: bits 8..31 count the leading partitions the client
// left dense for the daemon's CPU pool to compress (the strategy's
// cpu_share, docs/gpu.md §4); 0 (every older client) = all compressed.
inline constexpr uint32_t kSubmitDenseShift = 8;
inline constexpr uint32_t kSubmitDenseMask = 0xFFFFFF00u;
inline constexpr uint32_t kSubmitMaxDense = kSubmitDenseMask >> kSubmitDenseShift;
inline constexpr uint32_t kSubmitKnownFlags = kSubmitCompressed | kSubmitDenseMask;
inline constexpr uint32_t submit_dense_partitions(uint32_t flags) {
  return (flags & kSubmitDenseMask) >> kSubmitDenseShift;
}
static_assert(sizeof(RingEntry) == 16);

struct alignas(64) RingIndex {
  std::atomic<uint64_t> value{0};
};

struct RingHeader {
  RingIndex head;  // producer's counter
  RingIndex tail;  // consumer's counter
};

struct alignas(64) ClientArea {
  boost::interprocess::interprocess_semaphore wake{0};
  RingHeader submit;
  RingHeader complete;
};

struct alignas(64) SegmentHeader {
  uint32_t magic = kSegmentMagic;
  uint32_t layout_version = kLayoutVersion;
  uint64_t segment_bytes = 0;
  uint32_t local_size = 0;
  uint32_t num_tensors = 0;
  uint32_t ring_capacity = 0;
  // The daemon's liveness (issue 28): its control thread adds 1 at least
  // every 250 ms while it runs; init_segment() starts it at 1. A client
  // that sees it unchanged for its daemon timeout reports the daemon as not
  // responding (stopped or hung). 0: a daemon without a heartbeat (the
  // client then does not check).
  std::atomic<uint32_t> heartbeat{0};
  // The job's partition size in bytes once the daemon knows it (at start for
  // a single-node job, after the join for a multi-node one: the cluster's);
  // 0 before. Written once by the daemon before any round begins.
  std::atomic<uint32_t> partition_bytes{0};
  uint64_t clients_offset = 0;
  uint64_t rings_offset = 0;
  uint64_t tensors_offset = 0;
  uint64_t data_offset = 0;
  std::atomic<uint32_t> state{static_cast<uint32_t>(JobState::kRunning)};
  uint32_t abort_code = 0;
  char abort_reason[kAbortReasonBytes] = {};
  boost::interprocess::interprocess_semaphore doorbell{0};
};

struct TensorSlot {
  uint64_t bytes;
  uint64_t offset;  // of local rank 0's buffer
  uint64_t stride;  // rank r's buffer is at offset + r * stride
  // Layout 3: the tensor's partitions, fixed for the job: bytes each (the
  // last may be shorter; the job's partition size cut into the strategy's
  // `pieces`) and how many. 0 until the daemon publishes them: it writes
  // both before its release store of SegmentHeader::partition_bytes, so a
  // client that read that non-zero (acquire) reads them complete. Layout
  // compute() leaves them 0; check_segment() does not compare them.
  uint32_t partition_bytes = 0;
  uint32_t partitions = 0;
};
static_assert(sizeof(TensorSlot) == 32);

// Checks what the daemon published in a slot once the header's partition
// size is non-zero: a positive multiple of 64 not above `job_partition_bytes`,
// and `partitions` = ceil(bytes / partition_bytes) (1 for 0 bytes). Empty
// when sound, else what is wrong (the client fails naming the tensor).
std::string check_tensor_partitions(const TensorSlot& slot, uint64_t job_partition_bytes);

// Where everything goes, computed identically by daemon and client.
struct Layout {
  uint32_t local_size = 0;
  uint32_t ring_capacity = 0;
  uint64_t clients_offset = 0;
  uint64_t rings_offset = 0;
  uint64_t tensors_offset = 0;
  uint64_t data_offset = 0;
  uint64_t total_bytes = 0;
  std::vector<TensorSlot> tensors;

  // Throws Error(kResourceExhausted) if the size overflows.
  static Layout compute(uint32_t local_size, const std::vector<uint64_t>& tensor_bytes);

  uint64_t submit_ring_offset(uint32_t rank) const {
    return rings_offset + (uint64_t{rank} * 2) * ring_capacity * sizeof(RingEntry);
  }
  uint64_t complete_ring_offset(uint32_t rank) const {
    return rings_offset + (uint64_t{rank} * 2 + 1) * ring_capacity * sizeof(RingEntry);
  }
};

// Writes the header, client areas and tensor table into a zeroed mapping of
// layout.total_bytes bytes.
SegmentHeader* init_segment(void* base, const Layout& layout);

// Checks a mapped segment against the layout this side computed; throws
// Error(kMalformed) naming the first difference.
SegmentHeader* check_segment(void* base, uint64_t mapped_bytes, const Layout& layout);

// SPSC ring over `capacity` (a power of two) entries.
class Ring {
 public:
  Ring(RingHeader& header, RingEntry* entries, uint32_t capacity)
      : h_(&header), e_(entries), cap_(capacity) {}
  // false when full.
  bool push(const RingEntry& entry);
  // false when empty; throws Error(kMalformed) if the counters are corrupt.
  bool pop(RingEntry& out);

 private:
  RingHeader* h_;
  RingEntry* e_;
  uint32_t cap_;
};

// Waits at most `timeout` for a post; true when one was consumed.
bool timed_wait(boost::interprocess::interprocess_semaphore& sem,
                std::chrono::microseconds timeout);

// Records an abort in the header (first reason wins) and wakes everyone.
// Only the daemon calls it, serialised by its job lock.
void publish_abort(SegmentHeader* header, ErrorCode code, const std::string& reason,
                   ClientArea* clients, uint32_t local_size) noexcept;

}  // namespace bytecomp::ipc
