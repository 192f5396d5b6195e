#include "client/ipc/shm_layout.h"

#include <semaphore.h>
#include <time.h>

#include <cerrno>

#include <algorithm>
#include <cstring>
#include <new>

namespace bytecomp::ipc {

// A spin-emulated semaphore would burn cores while idle; make sure Boost
// picked the process-shared POSIX one.
static_assert(sizeof(boost::interprocess::interprocess_semaphore) == sizeof(sem_t),
              "Boost.Interprocess must use POSIX semaphores on this platform");

namespace {

uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

uint64_t checked_add(uint64_t a, uint64_t b) {
  if (a > UINT64_MAX - b) {
    throw Error(ErrorCode::kResourceExhausted, "shared-memory layout size overflows 64 bits");
  }
  return a + b;
}

uint64_t checked_mul(uint64_t a, uint64_t b) {
  if (b != 0 && a > UINT64_MAX / b) {
    throw Error(ErrorCode::kResourceExhausted, "shared-memory layout size overflows 64 bits");
  }
  return a * b;
}

}  // namespace

Layout Layout::compute(uint32_t local_size, const std::vector<uint64_t>& tensor_bytes) {
  Layout l;
  l.local_size = local_size;
  // At most one outstanding push per tensor and rank, so rings never fill.
  uint32_t cap = 1;
  while (cap < tensor_bytes.size()) cap <<= 1;
  l.ring_capacity = cap;
  uint64_t at = align_up(sizeof(SegmentHeader), kAlign);
  l.clients_offset = at;
  at = align_up(checked_add(at, checked_mul(sizeof(ClientArea), local_size)), kAlign);
  l.rings_offset = at;
  at = align_up(checked_add(at, checked_mul(uint64_t{local_size} * 2 * cap, sizeof(RingEntry))),
                kAlign);
  l.tensors_offset = at;
  at = align_up(checked_add(at, checked_mul(sizeof(TensorSlot), tensor_bytes.size())), kAlign);
  // Data pages start page-aligned so buffers can later be registered with
  // CUDA/RDMA without copying.
  at = align_up(at, 4096);
  l.data_offset = at;
  l.tensors.reserve(tensor_bytes.size());
  for (uint64_t b : tensor_bytes) {
    const uint64_t stride = align_up(checked_add(b, kAlign - 1), kAlign);
    l.tensors.push_back({b, at, stride, 0, 0});
    at = checked_add(at, checked_mul(stride, local_size));
  }
  l.total_bytes = align_up(std::max<uint64_t>(at, 4096), 4096);
  return l;
}

SegmentHeader* init_segment(void* base, const Layout& l) {
  auto* h = new (base) SegmentHeader();
  h->heartbeat.store(1, std::memory_order_relaxed);
  h->segment_bytes = l.total_bytes;
  h->local_size = l.local_size;
  h->num_tensors = static_cast<uint32_t>(l.tensors.size());
  h->ring_capacity = l.ring_capacity;
  h->clients_offset = l.clients_offset;
  h->rings_offset = l.rings_offset;
  h->tensors_offset = l.tensors_offset;
  h->data_offset = l.data_offset;
  auto* b = static_cast<char*>(base);
  for (uint32_t r = 0; r < l.local_size; ++r) {
    new (b + l.clients_offset + r * sizeof(ClientArea)) ClientArea();
  }
  auto* slots = reinterpret_cast<TensorSlot*>(b + l.tensors_offset);
  std::copy(l.tensors.begin(), l.tensors.end(), slots);
  return h;
}

SegmentHeader* check_segment(void* base, uint64_t mapped_bytes, const Layout& l) {
  auto fail = [](const std::string& what) -> SegmentHeader* {
    throw Error(ErrorCode::kMalformed, "job shared memory does not match the declarations: " +
                                           what + " (daemon and library from different builds?)");
  };
  if (mapped_bytes < sizeof(SegmentHeader) || mapped_bytes < l.total_bytes) {
    return fail("segment is " + std::to_string(mapped_bytes) + " bytes, expected " +
                std::to_string(l.total_bytes));
  }
  auto* h = static_cast<SegmentHeader*>(base);
  if (h->magic != kSegmentMagic) return fail("bad magic");
  if (h->layout_version != kLayoutVersion) {
    return fail("layout version " + std::to_string(h->layout_version) + ", expected " +
                std::to_string(kLayoutVersion));
  }
  if (h->segment_bytes != l.total_bytes || h->local_size != l.local_size ||
      h->num_tensors != l.tensors.size() || h->ring_capacity != l.ring_capacity ||
      h->clients_offset != l.clients_offset || h->rings_offset != l.rings_offset ||
      h->tensors_offset != l.tensors_offset || h->data_offset != l.data_offset) {
    return fail("header sizes or offsets differ");
  }
  const auto* slots = reinterpret_cast<const TensorSlot*>(static_cast<char*>(base) +
                                                          l.tensors_offset);
  for (size_t i = 0; i < l.tensors.size(); ++i) {
    if (slots[i].bytes != l.tensors[i].bytes || slots[i].offset != l.tensors[i].offset ||
        slots[i].stride != l.tensors[i].stride) {
      return fail("tensor " + std::to_string(i) + " slot differs");
    }
  }
  return h;
}

std::string check_tensor_partitions(const TensorSlot& slot, uint64_t job_partition_bytes) {
  const uint64_t pb = slot.partition_bytes;
  if (pb == 0 || pb % kAlign != 0 || pb > job_partition_bytes) {
    return "partition size " + std::to_string(pb) + " is not a positive multiple of " +
           std::to_string(kAlign) + " up to the job's " + std::to_string(job_partition_bytes);
  }
  const uint64_t want = slot.bytes == 0 ? 1 : (slot.bytes + pb - 1) / pb;
  if (slot.partitions != want) {
    return std::to_string(slot.partitions) + " partitions of " + std::to_string(pb) +
           " bytes for " + std::to_string(slot.bytes) + " bytes (expected " +
           std::to_string(want) + ")";
  }
  return {};
}

bool Ring::push(const RingEntry& entry) {
  const uint64_t head = h_->head.value.load(std::memory_order_relaxed);
  const uint64_t tail = h_->tail.value.load(std::memory_order_acquire);
  if (head - tail >= cap_) return false;
  e_[head & (cap_ - 1)] = entry;
  h_->head.value.store(head + 1, std::memory_order_release);
  return true;
}

bool Ring::pop(RingEntry& out) {
  const uint64_t tail = h_->tail.value.load(std::memory_order_relaxed);
  const uint64_t head = h_->head.value.load(std::memory_order_acquire);
  if (head == tail) return false;
  if (head - tail > cap_) {
    throw Error(ErrorCode::kMalformed, "notification ring corrupt: head " + std::to_string(head) +
                                           ", tail " + std::to_string(tail) + ", capacity " +
                                           std::to_string(cap_));
  }
  out = e_[tail & (cap_ - 1)];
  h_->tail.value.store(tail + 1, std::memory_order_release);
  return true;
}

bool timed_wait(boost::interprocess::interprocess_semaphore& sem,
                std::chrono::microseconds timeout) {
  // Boost 1.74 only offers an absolute CLOCK_REALTIME deadline, which a step
  // of the wall clock would stretch arbitrarily. With the POSIX backend
  // (asserted above: the object is exactly one sem_t) sem_clockwait on the
  // monotonic clock keeps every wait bounded.
  sem_t* s = reinterpret_cast<sem_t*>(&sem);
  timespec now{};
  ::clock_gettime(CLOCK_MONOTONIC, &now);
  const int64_t ns = static_cast<int64_t>(now.tv_nsec) + timeout.count() % 1000000 * 1000;
  timespec deadline{now.tv_sec + static_cast<time_t>(timeout.count() / 1000000 + ns / 1000000000),
                    static_cast<long>(ns % 1000000000)};
  for (;;) {
    if (::sem_clockwait(s, CLOCK_MONOTONIC, &deadline) == 0) return true;
    if (errno == ETIMEDOUT) return false;
    if (errno != EINTR) {
      throw Error(ErrorCode::kInternal,
                  std::string("sem_clockwait: ") + std::strerror(errno));
    }
  }
}

void publish_abort(SegmentHeader* h, ErrorCode code, const std::string& reason,
                   ClientArea* clients, uint32_t local_size) noexcept {
  uint32_t expected = static_cast<uint32_t>(JobState::kRunning);
  // The reason is written before the state flips (release), so a reader that
  // sees kAborted (acquire) reads a complete reason.
  if (h->state.load(std::memory_order_acquire) == expected) {
    h->abort_code = static_cast<uint32_t>(code);
    const size_t n = std::min(reason.size(), kAbortReasonBytes - 1);
    std::memcpy(h->abort_reason, reason.data(), n);
    h->abort_reason[n] = '\0';
    h->state.store(static_cast<uint32_t>(JobState::kAborted), std::memory_order_release);
  }
  for (uint32_t r = 0; r < local_size; ++r) {
    try {
      clients[r].wake.post();
    } catch (...) {
      // A client scribbled over its semaphore; it will see the socket close.
    }
  }
}

}  // namespace bytecomp::ipc
