// libbytecomp: the C ABI of bytecomp.h over the control protocol
// (client/ipc/protocol.h) and the job's shared memory (client/ipc/shm_layout.h).
//
// Threading: one mutex (Client::mu) guards all client state. Completions are
// collected by whichever waiting thread is the "reaper" at the time (one at
// most): it blocks on this client's wake semaphore without the lock, drains
// the completion ring, then publishes results under the lock and notifies
// the other waiters, which sleep on a condition variable. Every sleep is
// bounded (kSlice) so a lost daemon is noticed by checking the socket.
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

namespace {

constexpr auto kSlice = std::chrono::milliseconds(50);
constexpr const char* kDefaultSocket = "/run/bytecomp/bytecompd.sock";

thread_local std::string t_last_error;

// An error with a C status (beyond ErrorCode: version mismatch, state,
// unsupported).
struct ApiError {
  bytecomp_status status;
  std::string message;
};

[[noreturn]] void fail(bytecomp_status s, std::string msg) { throw ApiError{s, std::move(msg)}; }

bytecomp_status from_code(ErrorCode c) {
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

}  // namespace

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

namespace {

// A refusal of this rank's START (kError) carries its own cause's code; an
// ABORT is the end of a job that had started, whatever ended it (another
// rank's invalid call included): BYTECOMP_ERR_ABORTED, as every rank that
// already waits gets it from check_health(). A rank still mapping the segment
// when the job was aborted used to get the cause's code instead (issue 28:
// Broadcast.OneNodeDisagreeingSizesFailEveryRankNamingThem, INVALID_ARGUMENT
// on one rank under load).
bytecomp_status start_refusal_status(ipc::MsgType type, uint32_t code) {
  if (type == ipc::MsgType::kAbort) return BYTECOMP_ERR_ABORTED;
  return from_code(static_cast<ErrorCode>(code));
}

bytecomp_client* require_client(bytecomp_client* c) {
  if (c == nullptr) fail(BYTECOMP_ERR_INVALID_ARGUMENT, "client is NULL (connect first)");
  return c;
}

void require_started(bytecomp_client* c, const char* call) {
  if (c->phase == bytecomp_client::Phase::kDeclaring) {
    fail(BYTECOMP_ERR_STATE, std::string(call) + " before bytecomp_start(): declare every " +
                                 "tensor, then call bytecomp_start()");
  }
}

void require_healthy(bytecomp_client* c) {
  if (c->phase == bytecomp_client::Phase::kBroken) fail(c->broken_status, c->broken_message);
}

void require_tensor(bytecomp_client* c, uint32_t id) {
  if (id >= c->tensors.size()) {
    fail(BYTECOMP_ERR_INVALID_ARGUMENT,
         "tensor id " + std::to_string(id) + " was not declared (" +
             std::to_string(c->tensors.size()) + " tensors declared, ids 0.." +
             std::to_string(c->tensors.size() == 0 ? 0 : c->tensors.size() - 1) + ")");
  }
}

}  // namespace

extern "C" {

void bytecomp_connect_options_init(bytecomp_connect_options* o) {
  if (o == nullptr) return;
  std::memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->local_size = 1;
  o->num_nodes = 1;
  o->connect_timeout_ms = 10000;
  o->daemon_timeout_ms = 0;
}

bytecomp_status bytecomp_connect(const bytecomp_connect_options* o, bytecomp_client** out) {
  return guarded([&] {
    if (out == nullptr) fail(BYTECOMP_ERR_INVALID_ARGUMENT, "out is NULL");
    *out = nullptr;
    if (o == nullptr) fail(BYTECOMP_ERR_INVALID_ARGUMENT, "options are NULL");
    // struct_size lets later libraries accept older callers' shorter structs.
    if (o->struct_size < offsetof(bytecomp_connect_options, connect_timeout_ms) + 4) {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT,
           "options.struct_size is " + std::to_string(o->struct_size) +
               ": call bytecomp_connect_options_init() first");
    }
    if (o->job_id == nullptr) fail(BYTECOMP_ERR_INVALID_ARGUMENT, "options.job_id is NULL");
    if (std::string p = ipc::check_job_id(o->job_id); !p.empty()) {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT, "options.job_id '" + std::string(o->job_id) + "': " + p);
    }
    if (o->local_size == 0 || o->local_size > ipc::kMaxLocalSize) {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT, "options.local_size " + std::to_string(o->local_size) +
                                              " not in 1.." + std::to_string(ipc::kMaxLocalSize));
    }
    if (o->local_rank >= o->local_size) {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT, "options.local_rank " + std::to_string(o->local_rank) +
                                              " must be below local_size " +
                                              std::to_string(o->local_size));
    }
    if (o->num_nodes == 0 || o->num_nodes > ipc::kMaxNodes || o->node_rank >= o->num_nodes) {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT,
           "options.node_rank " + std::to_string(o->node_rank) + " / num_nodes " +
               std::to_string(o->num_nodes) + ": need node_rank < num_nodes <= " +
               std::to_string(ipc::kMaxNodes));
    }
    if (o->connect_timeout_ms == 0) {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT, "options.connect_timeout_ms must be > 0");
    }
    auto c = std::make_unique<bytecomp_client>();
    c->job_id = o->job_id;
    c->local_rank = o->local_rank;
    c->local_size = o->local_size;
    c->io_timeout = std::chrono::milliseconds(o->connect_timeout_ms);
    // Daemon liveness bound: the option (callers that know the field), else
    // $BYTECOMP_DAEMON_TIMEOUT_MS, else 5 s.
    uint32_t daemon_ms = 0;
    if (o->struct_size >= offsetof(bytecomp_connect_options, daemon_timeout_ms) + 4)
      daemon_ms = o->daemon_timeout_ms;
    if (daemon_ms == 0) {
      if (const char* d = std::getenv("BYTECOMP_DAEMON_TIMEOUT_MS"); d != nullptr && *d) {
        char* end = nullptr;
        const unsigned long v = std::strtoul(d, &end, 10);
        if (*end != '\0' || v == 0 || v > 86400000ul) {
          fail(BYTECOMP_ERR_INVALID_ARGUMENT,
               std::string("BYTECOMP_DAEMON_TIMEOUT_MS='") + d +
                   "': expected milliseconds, 1..86400000");
        }
        daemon_ms = static_cast<uint32_t>(v);
      }
    }
    c->daemon_timeout = std::chrono::milliseconds(daemon_ms == 0 ? 5000 : daemon_ms);
    const char* env = std::getenv("BYTECOMP_SOCKET");
    c->socket_path = o->socket_path != nullptr ? o->socket_path
                     : (env != nullptr && *env) ? env
                                                : kDefaultSocket;
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (c->socket_path.size() >= sizeof addr.sun_path) {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT, "socket path '" + c->socket_path + "' is longer than " +
                                              std::to_string(sizeof addr.sun_path - 1) + " bytes");
    }
    std::memcpy(addr.sun_path, c->socket_path.data(), c->socket_path.size());
    c->fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (c->fd < 0) fail(BYTECOMP_ERR_UNAVAILABLE, std::string("socket(): ") + std::strerror(errno));
    timeval tv{static_cast<time_t>(o->connect_timeout_ms / 1000),
               static_cast<suseconds_t>(o->connect_timeout_ms % 1000) * 1000};
    ::setsockopt(c->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    const auto deadline = Clock::now() + c->io_timeout;
    for (;;) {
      if (::connect(c->fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
        ucred cred{};
        socklen_t len = sizeof cred;
        if (::getsockopt(c->fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) c->daemon_pid = cred.pid;
        break;
      }
      // A full backlog is transient; anything else means no daemon there.
      if ((errno == EAGAIN || errno == EINTR) && Clock::now() < deadline) {
        ::usleep(10000);
        continue;
      }
      fail(BYTECOMP_ERR_UNAVAILABLE,
           "cannot connect to bytecompd at " + c->socket_path + ": " + std::strerror(errno) +
               " (is the daemon running? start bytecompd, or point socket_path / "
               "BYTECOMP_SOCKET at its control socket)");
    }
    ipc::Hello hello;
    hello.job_id = c->job_id;
    hello.local_rank = o->local_rank;
    hello.local_size = o->local_size;
    hello.node_rank = o->node_rank;
    hello.num_nodes = o->num_nodes;
    hello.client_version = BYTECOMP_VERSION;
    c->send_msg(ipc::encode(hello));
    auto reply = c->recv_msg(c->io_timeout);
    if (!reply) {
      fail(BYTECOMP_ERR_TIMEOUT, "bytecompd at " + c->socket_path + " did not answer within " +
                                     std::to_string(o->connect_timeout_ms) + " ms");
    }
    if (reply->type == ipc::MsgType::kError) {
      const auto& e = std::get<ipc::ErrorMsg>(reply->msg);
      const bool version = e.message.find("protocol version") != std::string::npos;
      fail(version ? BYTECOMP_ERR_VERSION_MISMATCH : from_code(static_cast<ErrorCode>(e.code)),
           "bytecompd refused the connection: " + e.message);
    }
    if (reply->type != ipc::MsgType::kWelcome) {
      fail(BYTECOMP_ERR_PROTOCOL, "bytecompd answered HELLO with an unexpected message");
    }
    *out = c.release();
  });
}

bytecomp_status bytecomp_declare_tensor(bytecomp_client* c, const char* name, uint64_t count,
                                        bytecomp_dtype dtype, bytecomp_device_type device,
                                        int32_t device_index, uint32_t* out_id) {
  return guarded([&] {
    require_client(c);
    std::lock_guard lock(c->mu);
    if (c->phase != bytecomp_client::Phase::kDeclaring) {
      fail(BYTECOMP_ERR_STATE, "bytecomp_declare_tensor after bytecomp_start(): every tensor "
                               "must be declared before the job starts");
    }
    if (name == nullptr || *name == '\0') {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT, "tensor name is NULL or empty");
    }
    const std::string n(name);
    if (n.size() > ipc::kMaxTensorNameBytes) {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT, "tensor name of " + std::to_string(n.size()) +
                                              " bytes exceeds " +
                                              std::to_string(ipc::kMaxTensorNameBytes));
    }
    if (c->by_name.count(n) != 0) {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT, "tensor '" + n + "' is already declared (id " +
                                              std::to_string(c->by_name[n]) + ")");
    }
    ipc::DType dt = ipc::DType::kFloat32;
    // bytecomp_dtype values are the control protocol's dtype codes.
    if (static_cast<int>(dtype) < 0 || static_cast<int>(dtype) >= ipc::kNumDTypes ||
        !ipc::dtype_from_wire(static_cast<uint8_t>(dtype), dt)) {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT, "tensor '" + n + "': unknown dtype " +
                                              std::to_string(static_cast<int>(dtype)) +
                                              " (use a bytecomp_dtype value)");
    }
    if (device == BYTECOMP_DEVICE_CUDA) {
      fail(BYTECOMP_ERR_UNSUPPORTED,
           "tensor '" + n + "': GPU (CUDA) tensors are not supported by this release; copy the "
                            "gradient into the tensor's CPU buffer (declare it with "
                            "BYTECOMP_DEVICE_CPU and use bytecomp_tensor_buffer)");
    }
    if (device != BYTECOMP_DEVICE_CPU) {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT, "tensor '" + n + "': unknown device type " +
                                              std::to_string(static_cast<int>(device)));
    }
    (void)device_index;
    if (count == 0 || count > (uint64_t{1} << 40) / ipc::dtype_size(dt)) {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT, "tensor '" + n + "': element count " +
                                              std::to_string(count) +
                                              " must be in 1..(1 TiB / element size)");
    }
    if (c->tensors.size() >= ipc::kMaxTensors) {
      fail(BYTECOMP_ERR_RESOURCE_EXHAUSTED, "more than " + std::to_string(ipc::kMaxTensors) +
                                                " tensors declared");
    }
    const auto id = static_cast<uint32_t>(c->tensors.size());
    c->tensors.push_back({n, count, dt, count * ipc::dtype_size(dt)});
    c->by_name.emplace(n, id);
    if (out_id != nullptr) *out_id = id;
  });
}

bytecomp_status bytecomp_set_strategy(bytecomp_client* c, const char* yaml_text,
                                      const char* source_name) {
  return guarded([&] {
    require_client(c);
    std::lock_guard lock(c->mu);
    if (c->phase != bytecomp_client::Phase::kDeclaring) {
      fail(BYTECOMP_ERR_STATE, "bytecomp_set_strategy after bytecomp_start(): set the job's "
                               "strategy before starting it");
    }
    if (yaml_text == nullptr || *yaml_text == '\0') {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT, "strategy text is NULL or empty");
    }
    ipc::StrategyMsg m;
    m.source = source_name != nullptr && *source_name != '\0' ? source_name : "<client strategy>";
    m.text = yaml_text;
    if (m.source.size() > ipc::kMaxSourceNameBytes) {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT, "strategy source name of " +
                                              std::to_string(m.source.size()) +
                                              " bytes exceeds " +
                                              std::to_string(ipc::kMaxSourceNameBytes));
    }
    if (m.text.size() > ipc::kMaxStrategyBytes) {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT,
           "strategy text of " + std::to_string(m.text.size()) + " bytes exceeds the limit of " +
               std::to_string(ipc::kMaxStrategyBytes) +
               " (use pattern rules rather than one entry per tensor)");
    }
    c->strategy = std::move(m);
  });
}

bytecomp_status bytecomp_start(bytecomp_client* c, uint32_t timeout_ms) {
  return guarded([&] {
    require_client(c);
    std::lock_guard lock(c->mu);
    require_healthy(c);
    if (c->phase != bytecomp_client::Phase::kDeclaring) {
      fail(BYTECOMP_ERR_STATE, "bytecomp_start called twice");
    }
    if (c->tensors.empty()) {
      fail(BYTECOMP_ERR_STATE, "bytecomp_start with no tensor declared: declare tensors first");
    }
    // From here on any failure leaves the client unusable: the daemon may
    // have half a job.
    try {
      for (uint32_t i = 0; i < c->tensors.size(); ++i) {
        ipc::Declare d;
        d.index = i;
        d.name = c->tensors[i].name;
        d.count = c->tensors[i].count;
        d.dtype = c->tensors[i].dtype;
        c->send_msg(ipc::encode(d));
      }
      if (c->strategy) c->send_msg(ipc::encode(*c->strategy));
      c->send_msg(ipc::encode(ipc::Start{static_cast<uint32_t>(c->tensors.size())}));
      const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
      std::optional<ipc::Decoded> reply;
      while (!reply) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline -
                                                                                Clock::now());
        if (left.count() <= 0) {
          fail(BYTECOMP_ERR_TIMEOUT,
               "job '" + c->job_id + "' did not start within " + std::to_string(timeout_ms) +
                   " ms: bytecompd waits for all " + std::to_string(c->local_size) +
                   " local ranks to connect and call bytecomp_start (close this client)");
        }
        reply = c->recv_msg(left);
      }
      if (reply->type == ipc::MsgType::kError || reply->type == ipc::MsgType::kAbort) {
        const auto& e = std::get<ipc::ErrorMsg>(reply->msg);
        fail(start_refusal_status(reply->type, e.code),
             "bytecompd could not start job '" + c->job_id + "': " + e.message);
      }
      if (reply->type != ipc::MsgType::kReady) {
        fail(BYTECOMP_ERR_PROTOCOL, "bytecompd answered START with an unexpected message");
      }
      const auto& ready = std::get<ipc::Ready>(reply->msg);
      std::vector<uint64_t> sizes;
      for (const auto& t : c->tensors) sizes.push_back(t.bytes);
      c->layout = ipc::Layout::compute(c->local_size, sizes);
      c->segment_name = ready.segment_name;
      try {
        bi::shared_memory_object shm(bi::open_only, ready.segment_name.c_str(), bi::read_write);
        bi::mapped_region region(shm, bi::read_write);
        c->region.swap(region);
      } catch (const bi::interprocess_exception& e) {
        // The job may have been aborted right after READY (e.g. another node
        // refused it): the daemon sends ABORT before it removes the segment,
        // so the reason is already waiting on the socket.
        const std::string why = e.what();
        std::optional<ipc::Decoded> abort;
        try {
          abort = c->recv_msg(std::chrono::milliseconds(200));
        } catch (const std::exception&) {
        }
        if (abort && (abort->type == ipc::MsgType::kAbort || abort->type == ipc::MsgType::kError)) {
          const auto& m = std::get<ipc::ErrorMsg>(abort->msg);
          fail(start_refusal_status(abort->type, m.code),
               "job '" + c->job_id + "' was aborted by bytecompd as it started: " + m.message);
        }
        fail(BYTECOMP_ERR_UNAVAILABLE,
             "cannot map job shared memory '" + ready.segment_name + "': " + why);
      }
      c->header = ipc::check_segment(c->region.get_address(), c->region.get_size(), c->layout);
      c->last_beat = c->header->heartbeat.load(std::memory_order_relaxed);
      c->beat_seen = Clock::now();
      auto* base = static_cast<char*>(c->region.get_address());
      c->area = reinterpret_cast<ipc::ClientArea*>(base + c->layout.clients_offset) +
                c->local_rank;
      c->submit = std::make_unique<ipc::Ring>(
          c->area->submit,
          reinterpret_cast<ipc::RingEntry*>(base + c->layout.submit_ring_offset(c->local_rank)),
          c->layout.ring_capacity);
      c->complete = std::make_unique<ipc::Ring>(
          c->area->complete,
          reinterpret_cast<ipc::RingEntry*>(base + c->layout.complete_ring_offset(c->local_rank)),
          c->layout.ring_capacity);
      c->pending.assign(c->tensors.size(), 0);
      c->last_iteration.assign(c->tensors.size(), -1);
      c->phase = bytecomp_client::Phase::kStarted;
    } catch (const ApiError& e) {
      c->break_job(e.status, e.message);
      throw;
    } catch (const Error& e) {
      c->break_job(from_code(e.code()), e.what());
      throw;
    }
  });
}

bytecomp_status bytecomp_tensor_id(bytecomp_client* c, const char* name, uint32_t* out) {
  return guarded([&] {
    require_client(c);
    if (name == nullptr || out == nullptr) fail(BYTECOMP_ERR_INVALID_ARGUMENT, "NULL argument");
    std::lock_guard lock(c->mu);
    auto it = c->by_name.find(name);
    if (it == c->by_name.end()) {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT, std::string("no tensor named '") + name + "' declared");
    }
    *out = it->second;
  });
}

bytecomp_status bytecomp_tensor_buffer(bytecomp_client* c, uint32_t id, void** data,
                                       uint64_t* bytes) {
  return guarded([&] {
    require_client(c);
    if (data == nullptr) fail(BYTECOMP_ERR_INVALID_ARGUMENT, "out_data is NULL");
    std::lock_guard lock(c->mu);
    require_started(c, "bytecomp_tensor_buffer");
    require_healthy(c);
    require_tensor(c, id);
    const ipc::TensorSlot& s = c->layout.tensors[id];
    *data = static_cast<char*>(c->region.get_address()) + s.offset + s.stride * c->local_rank;
    if (bytes != nullptr) *bytes = s.bytes;
  });
}

namespace {
bytecomp_status push_pull(bytecomp_client* c, uint32_t id, uint64_t iteration,
                          bytecomp_handle* out, uint32_t flags, const char* fn) {
  return guarded([&] {
    require_client(c);
    if (out == nullptr) fail(BYTECOMP_ERR_INVALID_ARGUMENT, "out_handle is NULL");
    *out = 0;
    std::lock_guard lock(c->mu);
    require_started(c, fn);
    if ((flags & ipc::kSubmitCompressed) != 0 &&
        c->header->partition_bytes.load(std::memory_order_acquire) == 0) {
      fail(BYTECOMP_ERR_STATE, std::string(fn) + ": the daemon has not published the job's "
                               "partition size yet (bytecomp_partition_bytes is 0): push dense");
    }
    c->check_health();
    require_healthy(c);
    require_tensor(c, id);
    const TensorInfo& t = c->tensors[id];
    if (c->pending[id] != 0) {
      fail(BYTECOMP_ERR_STATE, "tensor '" + t.name + "' already has a push_pull in flight (iteration " +
                                   std::to_string(c->ops.at(c->pending[id]).iteration) +
                                   "): wait for that handle before pushing it again");
    }
    if (iteration > static_cast<uint64_t>(INT64_MAX) ||
        static_cast<int64_t>(iteration) <= c->last_iteration[id]) {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT,
           "tensor '" + t.name + "': iteration " + std::to_string(iteration) +
               " is not after the last one pushed (" + std::to_string(c->last_iteration[id]) +
               "); iterations of a tensor must increase");
    }
    if (!c->submit->push({id, {flags}, iteration})) {
      fail(BYTECOMP_ERR_INTERNAL, "submit ring full although every tensor has at most one "
                                  "push in flight");
    }
    try {
      c->header->doorbell.post();
    } catch (const std::exception& e) {
      c->break_job(BYTECOMP_ERR_PROTOCOL, std::string("job doorbell unusable: ") + e.what());
      require_healthy(c);
    }
    const bytecomp_handle h = c->next_handle++;
    c->ops.emplace(h, Op{id, iteration});
    c->pending[id] = h;
    c->last_iteration[id] = static_cast<int64_t>(iteration);
    *out = h;
  });
}

}  // namespace

bytecomp_status bytecomp_push_pull(bytecomp_client* c, uint32_t id, uint64_t iteration,
                                   bytecomp_handle* out) {
  return push_pull(c, id, iteration, out, 0, "bytecomp_push_pull");
}

bytecomp_status bytecomp_push_pull_compressed(bytecomp_client* c, uint32_t id, uint64_t iteration,
                                              bytecomp_handle* out) {
  return push_pull(c, id, iteration, out, ipc::kSubmitCompressed, "bytecomp_push_pull_compressed");
}

bytecomp_status bytecomp_partition_bytes(bytecomp_client* c, uint64_t* out) {
  return guarded([&] {
    require_client(c);
    if (out == nullptr) fail(BYTECOMP_ERR_INVALID_ARGUMENT, "out_bytes is NULL");
    *out = 0;
    std::lock_guard lock(c->mu);
    require_started(c, "bytecomp_partition_bytes");
    *out = c->header->partition_bytes.load(std::memory_order_acquire);
  });
}

bytecomp_status bytecomp_broadcast(bytecomp_client* c, uint32_t id, uint64_t iteration,
                                   uint32_t root_rank, uint64_t nbytes, uint64_t tag,
                                   bytecomp_handle* out) {
  return guarded([&] {
    require_client(c);
    if (out == nullptr) fail(BYTECOMP_ERR_INVALID_ARGUMENT, "out_handle is NULL");
    *out = 0;
    std::lock_guard lock(c->mu);
    require_started(c, "bytecomp_broadcast");
    c->check_health();
    require_healthy(c);
    require_tensor(c, id);
    const TensorInfo& t = c->tensors[id];
    if (c->pending[id] != 0) {
      fail(BYTECOMP_ERR_STATE, "tensor '" + t.name + "' already has an operation in flight (" +
                                   c->describe(c->ops.at(c->pending[id])) +
                                   "): wait for that handle first");
    }
    if (iteration > static_cast<uint64_t>(INT64_MAX) ||
        static_cast<int64_t>(iteration) <= c->last_iteration[id]) {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT,
           "tensor '" + t.name + "': iteration " + std::to_string(iteration) +
               " is not after the last one (" + std::to_string(c->last_iteration[id]) +
               "); iterations of a tensor must increase");
    }
    if (nbytes > t.bytes) {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT, "broadcast of " + std::to_string(nbytes) +
                                              " bytes exceeds tensor '" + t.name + "''s " +
                                              std::to_string(t.bytes) + " bytes");
    }
    ipc::Collective m;
    m.op = ipc::CollectiveOp::kBroadcast;
    m.tensor = id;
    m.iteration = iteration;
    m.root = root_rank;
    m.nbytes = nbytes;
    m.tag = tag;
    c->send_started(ipc::encode(m));
    const bytecomp_handle h = c->next_handle++;
    Op op{id, iteration};
    op.kind = "broadcast";
    c->ops.emplace(h, std::move(op));
    c->pending[id] = h;
    c->last_iteration[id] = static_cast<int64_t>(iteration);
    *out = h;
  });
}

bytecomp_status bytecomp_barrier(bytecomp_client* c, bytecomp_handle* out) {
  return guarded([&] {
    require_client(c);
    if (out == nullptr) fail(BYTECOMP_ERR_INVALID_ARGUMENT, "out_handle is NULL");
    *out = 0;
    std::lock_guard lock(c->mu);
    require_started(c, "bytecomp_barrier");
    c->check_health();
    require_healthy(c);
    if (c->pending_barrier != 0) {
      fail(BYTECOMP_ERR_STATE, c->describe(c->ops.at(c->pending_barrier)) +
                                   " is still in flight: wait for that handle first");
    }
    ipc::Collective m;
    m.op = ipc::CollectiveOp::kBarrier;
    m.tensor = ipc::kBarrierTensor;
    m.iteration = c->barrier_seq;
    c->send_started(ipc::encode(m));
    const bytecomp_handle h = c->next_handle++;
    Op op{ipc::kBarrierTensor, c->barrier_seq++};
    op.kind = "barrier";
    c->ops.emplace(h, std::move(op));
    c->pending_barrier = h;
    *out = h;
  });
}

bytecomp_status bytecomp_wait(bytecomp_client* c, bytecomp_handle h, uint32_t timeout_ms) {
  return guarded([&] {
    require_client(c);
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    std::unique_lock lock(c->mu);
    require_started(c, "bytecomp_wait");
    bool reaped_once = false;
    for (;;) {
      auto it = c->ops.find(h);
      if (it == c->ops.end()) {
        fail(BYTECOMP_ERR_INVALID_ARGUMENT,
             "unknown handle " + std::to_string(h) +
                 " (never returned by bytecomp_push_pull, or already waited for)");
      }
      if (it->second.done) {
        Op op = std::move(it->second);
        c->ops.erase(it);
        if (c->pending.size() > op.tensor && c->pending[op.tensor] == h) c->pending[op.tensor] = 0;
        if (c->pending_barrier == h) c->pending_barrier = 0;
        if (op.status != BYTECOMP_OK) fail(op.status, op.message);
        return;
      }
      const auto now = Clock::now();
      if (now >= deadline && !reaped_once && !c->reaper_active) {
        // Even a zero timeout looks at the completions once.
        reaped_once = true;
        c->reap(lock, std::chrono::microseconds(0));
        continue;
      }
      if (now >= deadline) {
        fail(BYTECOMP_ERR_TIMEOUT,
             c->describe(it->second) + " not finished within " +
                 std::to_string(timeout_ms) + " ms; the handle stays valid");
      }
      const auto slice = std::min<Clock::duration>(deadline - now, kSlice);
      if (!c->reaper_active) {
        reaped_once = true;
        c->reap(lock, std::chrono::duration_cast<std::chrono::microseconds>(slice));
      } else {
        c->cv.wait_for(lock, slice);
      }
    }
  });
}

bytecomp_status bytecomp_poll(bytecomp_client* c, bytecomp_handle h, int* done) {
  return guarded([&] {
    require_client(c);
    if (done == nullptr) fail(BYTECOMP_ERR_INVALID_ARGUMENT, "out_done is NULL");
    std::unique_lock lock(c->mu);
    require_started(c, "bytecomp_poll");
    auto it = c->ops.find(h);
    if (it == c->ops.end()) {
      fail(BYTECOMP_ERR_INVALID_ARGUMENT,
           "unknown handle " + std::to_string(h) +
               " (never returned by bytecomp_push_pull, or already waited for)");
    }
    if (!it->second.done && !c->reaper_active && c->phase == bytecomp_client::Phase::kStarted) {
      c->reap(lock, std::chrono::microseconds(0));
      it = c->ops.find(h);
    }
    *done = it->second.done ? 1 : 0;
  });
}

bytecomp_status bytecomp_close(bytecomp_client* c) {
  if (c == nullptr) return BYTECOMP_OK;
  std::unique_ptr<bytecomp_client> owned(c);
  return guarded([&] {
    std::unique_lock lock(c->mu);
    if (c->phase == bytecomp_client::Phase::kStarted) c->check_health();
    if (c->phase != bytecomp_client::Phase::kBroken && c->fd >= 0) {
      // Best effort: a graceful leave lets the daemon end the job quietly.
      const auto bye = ipc::encode(ipc::Bye{});
      (void)::send(c->fd, bye.data(), bye.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    const bool broken = c->phase == bytecomp_client::Phase::kBroken;
    const bytecomp_status s = c->broken_status;
    const std::string msg = c->broken_message;
    lock.unlock();
    owned.reset();
    if (broken) fail(s, msg);
  });
}

const char* bytecomp_last_error(void) { return t_last_error.c_str(); }

const char* bytecomp_status_name(int s) {
  switch (s) {
    case BYTECOMP_OK: return "BYTECOMP_OK";
    case BYTECOMP_ERR_INVALID_ARGUMENT: return "BYTECOMP_ERR_INVALID_ARGUMENT";
    case BYTECOMP_ERR_CONFIG: return "BYTECOMP_ERR_CONFIG";
    case BYTECOMP_ERR_PROTOCOL: return "BYTECOMP_ERR_PROTOCOL";
    case BYTECOMP_ERR_TIMEOUT: return "BYTECOMP_ERR_TIMEOUT";
    case BYTECOMP_ERR_PEER_LOST: return "BYTECOMP_ERR_PEER_LOST";
    case BYTECOMP_ERR_ABORTED: return "BYTECOMP_ERR_ABORTED";
    case BYTECOMP_ERR_UNAVAILABLE: return "BYTECOMP_ERR_UNAVAILABLE";
    case BYTECOMP_ERR_RESOURCE_EXHAUSTED: return "BYTECOMP_ERR_RESOURCE_EXHAUSTED";
    case BYTECOMP_ERR_INTERNAL: return "BYTECOMP_ERR_INTERNAL";
    case BYTECOMP_ERR_VERSION_MISMATCH: return "BYTECOMP_ERR_VERSION_MISMATCH";
    case BYTECOMP_ERR_STATE: return "BYTECOMP_ERR_STATE";
    case BYTECOMP_ERR_UNSUPPORTED: return "BYTECOMP_ERR_UNSUPPORTED";
  }
  return "unknown";
}

uint32_t bytecomp_dtype_size(int dtype) {
  ipc::DType dt = ipc::DType::kFloat32;
  if (dtype < 0 || dtype >= ipc::kNumDTypes || !ipc::dtype_from_wire(static_cast<uint8_t>(dtype), dt))
    return 0;
  return static_cast<uint32_t>(ipc::dtype_size(dt));
}

uint32_t bytecomp_abi_version(void) { return BYTECOMP_ABI_VERSION; }

const char* bytecomp_version_string(void) {
  static const std::string v = std::string(BYTECOMP_VERSION) + " (protocol " +
                               std::to_string(ipc::kProtocolVersion) + ")";
  return v.c_str();
}

}  // extern "C"
