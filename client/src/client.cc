// libbytecomp: the C ABI of bytecomp.h over the control protocol
// (client/ipc/protocol.h) and the job's shared memory (client/ipc/shm_layout.h).
//
// Threading: one mutex (Client::mu) guards all client state. Completions are
// collected by whichever waiting thread is the "reaper" at the time (one at
// most): it blocks on this client's wake semaphore without the lock, drains
// the completion ring, then publishes results under the lock and notifies
// the other waiters, which sleep on a condition variable. Every sleep is
// bounded (kSlice) so a lost daemon is noticed by checking the socket.
#include "client/src/client_internal.h"

thread_local std::string libbytecomp::t_last_error;

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
