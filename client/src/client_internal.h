// libbytecomp's inside, shared by its two files (not installed):
//   client.cc      a client's life: connect, declare, start, close, and the
//                  ABI's informational calls
//   operations.cc  the operations of a started job: push_pull (dense or
//                  client-compressed), broadcast, barrier, wait, poll
// The threading model is written at the top of client.cc.
#pragma once

#include <bytecomp/bytecomp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "bytecomp_build_config.h"
#include "client/ipc/protocol.h"
#include "client/ipc/shm_layout.h"
#include "common/error.h"

namespace bi = boost::interprocess;
using bytecomp::Error;
using bytecomp::ErrorCode;
namespace ipc = bytecomp::ipc;
using Clock = std::chrono::steady_clock;

// Names of the library's inside (a named namespace: bytecomp_client, whose
// members use them, is one type in both files).
namespace libbytecomp {

constexpr auto kSlice = std::chrono::milliseconds(50);
constexpr const char* kDefaultSocket = "/run/bytecomp/bytecompd.sock";

// The last error of this thread (bytecomp_last_error); defined in client.cc.
extern thread_local std::string t_last_error;

// An error with a C status (beyond ErrorCode: version mismatch, state,
// unsupported).
struct ApiError {
  bytecomp_status status;
  std::string message;
};

[[noreturn]] inline void fail(bytecomp_status s, std::string msg) { throw ApiError{s, std::move(msg)}; }

inline bytecomp_status from_code(ErrorCode c) {
  const int v = static_cast<int>(c);
  return (v >= 0 && v <= 9) ? static_cast<bytecomp_status>(v) : BYTECOMP_ERR_INTERNAL;
}

template <class F>
bytecomp_status guarded(F&& f) {
  try {
    f();
    return BYTECOMP_OK;
  } catch (const ApiError& e) {
    t_last_error = e.message;
    return e.status;
  } catch (const ipc::VersionMismatch& e) {
    t_last_error = std::string("bytecompd speaks ") + e.what() +
                   ": install a libbytecomp and bytecompd of the same release";
    return BYTECOMP_ERR_VERSION_MISMATCH;
  } catch (const Error& e) {
    t_last_error = e.what();
    return from_code(e.code());
  } catch (const std::bad_alloc&) {
    t_last_error = "out of memory in libbytecomp";
    return BYTECOMP_ERR_RESOURCE_EXHAUSTED;
  } catch (const std::exception& e) {
    t_last_error = std::string("internal error in libbytecomp: ") + e.what();
    return BYTECOMP_ERR_INTERNAL;
  }
}

struct TensorInfo {
  std::string name;
  uint64_t count;
  ipc::DType dtype;
  uint64_t bytes;
};

struct Op {
  uint32_t tensor;  // ipc::kBarrierTensor for a barrier
  uint64_t iteration;
  const char* kind = "push_pull";  // "broadcast", "barrier"
  bool done = false;
  bytecomp_status status = BYTECOMP_OK;
  std::string message;
};

}  // namespace libbytecomp

using namespace libbytecomp;  // private header: both files are this library

struct bytecomp_client {
  std::mutex mu;
  std::condition_variable cv;
  int fd = -1;
  std::string socket_path;
  std::string job_id;
  uint32_t local_rank = 0;
  uint32_t local_size = 1;
  std::chrono::milliseconds io_timeout{10000};
  // Daemon liveness (issue 28): the heartbeat last seen in the segment
  // header, when it was first seen, the bound, the daemon's pid.
  std::chrono::milliseconds daemon_timeout{5000};
  uint32_t last_beat = 0;
  Clock::time_point beat_seen{};
  pid_t daemon_pid = 0;

  enum class Phase { kDeclaring, kStarted, kBroken } phase = Phase::kDeclaring;
  bytecomp_status broken_status = BYTECOMP_OK;
  std::string broken_message;

  std::vector<TensorInfo> tensors;
  std::unordered_map<std::string, uint32_t> by_name;
  std::optional<ipc::StrategyMsg> strategy;  // bytecomp_set_strategy, sent at start

  std::string segment_name;
  bi::mapped_region region;
  ipc::SegmentHeader* header = nullptr;
  ipc::ClientArea* area = nullptr;
  std::unique_ptr<ipc::Ring> submit;
  std::unique_ptr<ipc::Ring> complete;
  ipc::Layout layout;

  std::unordered_map<bytecomp_handle, Op> ops;
  std::vector<bytecomp_handle> pending;  // per tensor; 0 when none
  std::vector<int64_t> last_iteration;   // per tensor; -1 before the first
  bytecomp_handle pending_barrier = 0;   // 0 when none
  uint64_t barrier_seq = 0;              // of the next barrier
  bytecomp_handle next_handle = 1;
  bool reaper_active = false;

  ~bytecomp_client() {
    if (fd >= 0) ::close(fd);
  }

  // --- socket helpers (no lock needed: used by one thread at a time) -----
  void send_msg(const std::vector<uint8_t>& m) {
    if (::send(fd, m.data(), m.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(m.size())) {
      fail(BYTECOMP_ERR_UNAVAILABLE, "sending to bytecompd at " + socket_path +
                                         " failed: " + std::strerror(errno) +
                                         " (did the daemon exit?)");
    }
  }
  // Waits up to `timeout` for one message; nullopt on timeout.
  std::optional<ipc::Decoded> recv_msg(std::chrono::milliseconds timeout) {
    pollfd p{fd, POLLIN, 0};
    int r;
    do {
      r = ::poll(&p, 1, static_cast<int>(timeout.count()));
    } while (r < 0 && errno == EINTR);
    if (r == 0) return std::nullopt;
    std::vector<uint8_t> buf(ipc::kMaxMessageBytes + 1);
    const ssize_t n = ::recv(fd, buf.data(), buf.size(), MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return std::nullopt;
    if (n <= 0) {
      fail(BYTECOMP_ERR_UNAVAILABLE,
           "connection to bytecompd at " + socket_path + " closed" +
               (n < 0 ? std::string(": ") + std::strerror(errno) : std::string()) +
               " (the daemon exited or was restarted; close this client and reconnect)");
    }
    buf.resize(static_cast<size_t>(n));
    return ipc::decode(buf);
  }

  // Tensor `id`'s partitions as the daemon published them in its slot
  // (their bytes each and count: the job's partition size cut into the
  // strategy's pieces); {0, 0} before the daemon published the job's
  // partition size. A slot that does not add up breaks the job (lock held;
  // started, id checked).
  std::pair<uint64_t, uint32_t> tensor_partitions(uint32_t id) {
    const uint64_t job_pb = header->partition_bytes.load(std::memory_order_acquire);
    if (job_pb == 0) return {0, 0};
    const auto* slots = reinterpret_cast<const ipc::TensorSlot*>(
        static_cast<const char*>(region.get_address()) + layout.tensors_offset);
    ipc::TensorSlot s = slots[id];
    s.bytes = layout.tensors[id].bytes;  // ours, not the segment's (checked at start)
    if (std::string why = ipc::check_tensor_partitions(s, job_pb); !why.empty()) {
      const std::string msg = "the daemon's partitions of tensor '" + tensors[id].name +
                              "' in shared memory do not add up: " + why;
      break_job(BYTECOMP_ERR_PROTOCOL, msg);
      fail(BYTECOMP_ERR_PROTOCOL, msg);
    }
    return {s.partition_bytes, s.partitions};
  }

  // "push_pull of tensor 'x' (iteration 3)", "barrier 2" (lock held).
  std::string describe(const Op& op) const {
    if (op.tensor == ipc::kBarrierTensor) return "barrier " + std::to_string(op.iteration);
    return std::string(op.kind) + " of tensor '" + tensors[op.tensor].name + "' (iteration " +
           std::to_string(op.iteration) + ")";
  }

  // Sends one message while started (lock held; the socket's only other
  // user then is check_health(), also under the lock).
  void send_started(const std::vector<uint8_t>& m) {
    try {
      send_msg(m);
    } catch (const ApiError& e) {
      break_job(e.status, e.message);
      throw;
    }
  }

  // --- broken state (lock held) --------------------------------------------
  void break_job(bytecomp_status s, const std::string& msg) {
    if (phase == Phase::kBroken) return;
    phase = Phase::kBroken;
    broken_status = s;
    broken_message = msg;
    for (auto& [h, op] : ops) {
      if (!op.done) {
        op.done = true;
        op.status = s;
        op.message = describe(op) + " failed: " + msg;
      }
    }
    cv.notify_all();
  }

  // Reads the job state and the socket without blocking (lock held).
  void check_health() {
    if (phase == Phase::kBroken) return;
    if (header != nullptr &&
        header->state.load(std::memory_order_acquire) ==
            static_cast<uint32_t>(ipc::JobState::kAborted)) {
      const size_t n = strnlen(header->abort_reason, ipc::kAbortReasonBytes);
      break_job(BYTECOMP_ERR_ABORTED,
                "job '" + job_id + "' was aborted by bytecompd: " +
                    std::string(header->abort_reason, n));
      return;
    }
    try {
      while (auto m = recv_msg(std::chrono::milliseconds(0))) {
        if (m->type == ipc::MsgType::kAbort || m->type == ipc::MsgType::kError) {
          const auto& e = std::get<ipc::ErrorMsg>(m->msg);
          break_job(BYTECOMP_ERR_ABORTED,
                    "job '" + job_id + "' was aborted by bytecompd: " + e.message);
          return;
        }
        break_job(BYTECOMP_ERR_PROTOCOL, "unexpected control message from bytecompd");
        return;
      }
    } catch (const ApiError& e) {
      // The daemon vanished without a word: it crashed or was killed. Its
      // segment would outlive it, so the clients remove it (same user).
      if (!segment_name.empty()) bi::shared_memory_object::remove(segment_name.c_str());
      break_job(e.status, e.message);
    } catch (const Error& e) {
      break_job(BYTECOMP_ERR_PROTOCOL, std::string("bad message from bytecompd: ") + e.what());
    }
  }

  // Moves finished entries from the completion ring into `ops` (lock held).
  void apply_completions() {
    ipc::RingEntry e;
    try {
      while (complete->pop(e)) {
        if (e.tensor == ipc::kBarrierTensor) {
          auto it = pending_barrier != 0 ? ops.find(pending_barrier) : ops.end();
          if (it == ops.end() || it->second.iteration != e.iteration) {
            break_job(BYTECOMP_ERR_PROTOCOL, "bytecompd completed barrier " +
                                                 std::to_string(e.iteration) +
                                                 " which is not in flight");
            return;
          }
          it->second.done = true;
          if (e.status != 0) {
            it->second.status = from_code(static_cast<ErrorCode>(e.status));
            it->second.message = describe(it->second) + " failed in bytecompd";
          }
          pending_barrier = 0;
          continue;
        }
        if (e.tensor >= tensors.size() || pending[e.tensor] == 0) {
          break_job(BYTECOMP_ERR_PROTOCOL, "bytecompd completed tensor " +
                                               std::to_string(e.tensor) +
                                               " which has no push_pull in flight");
          return;
        }
        Op& op = ops.at(pending[e.tensor]);
        if (op.iteration != e.iteration) {
          break_job(BYTECOMP_ERR_PROTOCOL,
                    "bytecompd completed iteration " + std::to_string(e.iteration) +
                        " of tensor '" + tensors[e.tensor].name + "', expected " +
                        std::to_string(op.iteration));
          return;
        }
        op.done = true;
        if (e.status != 0) {
          op.status = from_code(static_cast<ErrorCode>(e.status));
          op.message = describe(op) + " failed in bytecompd";
        }
        pending[e.tensor] = 0;
      }
    } catch (const Error& err) {
      break_job(BYTECOMP_ERR_PROTOCOL, err.what());
    }
  }

  // A stopped (SIGSTOP) or hung daemon keeps its socket open and says
  // nothing: its heartbeat in the segment stops moving. Fails the job once
  // it has not moved for daemon_timeout (lock held).
  void check_daemon_alive() {
    if (phase != Phase::kStarted || header == nullptr) return;
    const uint32_t beat = header->heartbeat.load(std::memory_order_relaxed);
    if (beat == 0) return;  // a daemon without a heartbeat
    const auto now = Clock::now();
    if (beat != last_beat) {
      last_beat = beat;
      beat_seen = now;
      return;
    }
    if (now - beat_seen < daemon_timeout) return;
    char secs[32];
    std::snprintf(secs, sizeof secs, "%.1f",
                  std::chrono::duration<double>(now - beat_seen).count());
    break_job(BYTECOMP_ERR_UNAVAILABLE,
              "bytecompd" + (daemon_pid > 0 ? " (pid " + std::to_string(daemon_pid) + ")"
                                            : std::string()) +
                  " at " + socket_path + " not responding for " + secs +
                  " s: its heartbeat in the shared memory of job '" + job_id +
                  "' stopped (the daemon is stopped or hung; bound "
                  "daemon_timeout_ms " + std::to_string(daemon_timeout.count()) +
                  ", BYTECOMP_DAEMON_TIMEOUT_MS)");
  }

  // One bounded reaping round. Lock held on entry and exit.
  void reap(std::unique_lock<std::mutex>& lock, std::chrono::microseconds max_wait) {
    reaper_active = true;
    lock.unlock();
    bool woken = false;
    try {
      woken = max_wait.count() > 0 ? ipc::timed_wait(area->wake, max_wait) : area->wake.try_wait();
    } catch (...) {
      woken = false;
    }
    lock.lock();
    reaper_active = false;
    apply_completions();
    if (!woken || header->state.load(std::memory_order_acquire) != 0) check_health();
    check_daemon_alive();
    cv.notify_all();
  }
};

namespace libbytecomp {

// A refusal of this rank's START (kError) carries its own cause's code; an
// ABORT is the end of a job that had started, whatever ended it (another
// rank's invalid call included): BYTECOMP_ERR_ABORTED, as every rank that
// already waits gets it from check_health(). A rank still mapping the segment
// when the job was aborted used to get the cause's code instead (issue 28:
// Broadcast.OneNodeDisagreeingSizesFailEveryRankNamingThem, INVALID_ARGUMENT
// on one rank under load).
inline bytecomp_status start_refusal_status(ipc::MsgType type, uint32_t code) {
  if (type == ipc::MsgType::kAbort) return BYTECOMP_ERR_ABORTED;
  return from_code(static_cast<ErrorCode>(code));
}

inline bytecomp_client* require_client(bytecomp_client* c) {
  if (c == nullptr) fail(BYTECOMP_ERR_INVALID_ARGUMENT, "client is NULL (connect first)");
  return c;
}

inline void require_started(bytecomp_client* c, const char* call) {
  if (c->phase == bytecomp_client::Phase::kDeclaring) {
    fail(BYTECOMP_ERR_STATE, std::string(call) + " before bytecomp_start(): declare every " +
                                 "tensor, then call bytecomp_start()");
  }
}

inline void require_healthy(bytecomp_client* c) {
  if (c->phase == bytecomp_client::Phase::kBroken) fail(c->broken_status, c->broken_message);
}

inline void require_tensor(bytecomp_client* c, uint32_t id) {
  if (id >= c->tensors.size()) {
    fail(BYTECOMP_ERR_INVALID_ARGUMENT,
         "tensor id " + std::to_string(id) + " was not declared (" +
             std::to_string(c->tensors.size()) + " tensors declared, ids 0.." +
             std::to_string(c->tensors.size() == 0 ? 0 : c->tensors.size() - 1) + ")");
  }
}

}  // namespace libbytecomp
