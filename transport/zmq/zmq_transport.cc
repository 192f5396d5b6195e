#include "transport/zmq/zmq_transport.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <zmq.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "transport/core.h"
#include "transport/zmq/zap.h"

namespace bytecomp::transport {
namespace {

BC_LOG_CATEGORY(LogZmq, "transport.zmq");

constexpr int kHwmMessages = 32;       // per pipe; bounds ZeroMQ's own queues
constexpr int kReadBatch = 256;        // messages read per socket per wakeup
constexpr char kZapEndpoint[] = "inproc://zeromq.zap.01";

std::string zmq_error(const std::string& what) {
  return what + ": " + zmq_strerror(zmq_errno());
}

void check(int rc, const std::string& what) {
  if (rc != 0) throw Error(ErrorCode::kUnavailable, "transport zmq: " + zmq_error(what));
}

// Routing ids: 'N' + node id for the data connection, 'H' + node id for the
// heartbeat connection (a second DEALER per added peer that carries nothing
// but heartbeats, so they never queue behind a large message: ZeroMQ hands
// a multipart message over only when its last frame arrived).
constexpr char kDataRid = 'N';
constexpr char kHeartbeatRid = 'H';

std::string routing_id_of(NodeId id, char kind = kDataRid) {
  std::string rid(5, '\0');
  rid[0] = kind;  // a routing id must not start with a zero byte
  for (int i = 0; i < 4; ++i) rid[1 + i] = static_cast<char>((id >> (8 * i)) & 0xFF);
  return rid;
}

bool node_of_routing_id(const void* data, size_t size, NodeId& out, char& kind) {
  const auto* p = static_cast<const unsigned char*>(data);
  if (size != 5 || (p[0] != kDataRid && p[0] != kHeartbeatRid)) return false;
  kind = static_cast<char>(p[0]);
  out = 0;
  for (int i = 0; i < 4; ++i) out |= static_cast<NodeId>(p[1 + i]) << (8 * i);
  return out != kNoNode;
}

// tcp://host:0 means an ephemeral port (ZeroMQ spells it '*').
std::string bind_spelling(const std::string& endpoint) {
  if (endpoint.rfind("tcp://", 0) == 0 && endpoint.size() > 2 &&
      endpoint.compare(endpoint.size() - 2, 2, ":0") == 0)
    return endpoint.substr(0, endpoint.size() - 1) + "*";
  return endpoint;
}

void check_endpoint(const std::string& endpoint, const char* what) {
  bool tcp = endpoint.rfind("tcp://", 0) == 0 && endpoint.find(':', 6) != std::string::npos;
  bool ipc = endpoint.rfind("ipc://", 0) == 0 && endpoint.size() > 6;
  if (!tcp && !ipc)
    throw Error(ErrorCode::kInvalidArgument,
                std::string("transport zmq: ") + what + " '" + endpoint +
                    "' is not a zmq endpoint (accepted: tcp://host:port, ipc:///path)");
}

void release_hint(void* /*data*/, void* hint) {
  delete static_cast<std::shared_ptr<const void>*>(hint);
}

struct ZmqMsg {
  zmq_msg_t m;
  ZmqMsg() { zmq_msg_init(&m); }
  ~ZmqMsg() { zmq_msg_close(&m); }
  ZmqMsg(const ZmqMsg&) = delete;
  ZmqMsg& operator=(const ZmqMsg&) = delete;
};

class ZmqTransport final : public TransportBase {
 public:
  explicit ZmqTransport(const TransportConfig& config);
  ~ZmqTransport() override;

  std::vector<std::string> local_addresses() const override { return bound_; }

 protected:
  void backend_wakeup() override;
  void backend_outgoing() override;
  void backend_add_peer(NodeId id, const std::string& address) override;
  void backend_remove_peer(NodeId id) override;
  void backend_peer_lost(NodeId id, const Status& status) override;
  void backend_stop() override;

 private:
  struct Route {
    void* socket = nullptr;          // a DEALER we own, or router_ (not owned)
    void* heartbeat = nullptr;       // dealers only: the heartbeat DEALER
    std::string address;             // dealers only
    std::deque<Outgoing> fifo;       // accepted, not yet handed to ZeroMQ
    bool blocked = false;            // head hit the high-water mark
  };

  void* make_socket(int type);
  void* make_dealer(const std::string& address, char rid_kind);
  // Both DEALERs of an added peer (data, heartbeat); throws Error.
  void connect_route(Route& route);
  void close_route(Route& route);
  void close_socket(void*& s);
  void post_control(std::function<void()> fn);
  bool loop_has_work(void* socket);
  void loop();
  // Carries out queued add_peer()/remove_peer(); true if there were any.
  // Loop thread, or a thread holding io_mu_.
  bool run_control();
  // Moves queued messages to their routes' FIFOs. False when it stopped at
  // a pending peer change that only the loop thread may carry out.
  bool route_outgoing();
  void flush(NodeId id, Route& route);
  // 1 sent, 0 would block, -1 failed (status set).
  int send_one(Route& route, NodeId to, const Outgoing& out, Status& status);
  bool send_heartbeat(NodeId to);
  // heartbeat_only: the heartbeat DEALER (anything else on it is malformed).
  void read_socket(void* socket, bool is_router, NodeId dealer_peer, bool heartbeat_only = false);
  void handle_zap();
  void handle_monitor();
  void fail_route(Route& route, const Status& status);

  std::vector<std::string> bound_;
  void* ctx_ = nullptr;
  void* router_ = nullptr;
  void* zap_ = nullptr;
  void* monitor_ = nullptr;
  int wake_fd_ = -1;
  std::set<std::string> authorized_keys_;  // raw 32-byte CURVE keys
  // Refusals already logged at warn (loop thread only): a refused peer
  // reconnects every reconnect interval, which must not flood the log. ZAP
  // refusals are told apart by peer address and key; handshake failures
  // carry no peer address, so by endpoint, event and code. Bounded: past
  // kMaxRefusalsLogged distinct refusals the rest go to debug.
  static constexpr size_t kMaxRefusalsLogged = 256;
  std::set<std::string> refusals_logged_;
  // True the first time `key` is refused (then it is logged at warn).
  bool first_refusal(const std::string& key) {
    if (refusals_logged_.size() >= kMaxRefusalsLogged) return false;
    return refusals_logged_.insert(key).second;
  }
  void log_refusal(bool first, const std::string& what) {
    if (first) {
      BC_LOG(LogZmq(), kWarn) << "node " << self() << ": " << what;
    } else {
      BC_LOG(LogZmq(), kDebug) << "node " << self() << ": " << what;
    }
  }

  std::mutex control_mu_;
  std::deque<std::function<void()>> control_;
  std::atomic<bool> stop_{false};
  std::thread thread_;

  // Sockets and routes: the loop thread holds io_mu_ except while it
  // sleeps in poll(2); another thread that finds io_mu_ free may send
  // (backend_outgoing). ZeroMQ sockets may move between threads with a
  // full memory barrier, which the mutex provides.
  std::mutex io_mu_;
  bool io_closed_ = false;  // the loop has closed the sockets
  // Sockets whose ZMQ_EVENTS showed nothing and that nobody used since.
  std::set<void*> quiet_;
  std::map<NodeId, Route> dealers_;
  std::map<NodeId, Route> inbound_;  // peers that connected to our ROUTER
};

ZmqTransport::ZmqTransport(const TransportConfig& config) : TransportBase(config, "zmq") {
  for (const std::string& l : config.listen) check_endpoint(l, "listen endpoint");
  ctx_ = zmq_ctx_new();
  if (!ctx_) throw Error(ErrorCode::kUnavailable, zmq_error("transport zmq: zmq_ctx_new"));
  try {
    check(zmq_ctx_set(ctx_, ZMQ_IO_THREADS, config.io_threads), "ZMQ_IO_THREADS");
    check(zmq_ctx_set(ctx_, ZMQ_BLOCKY, 0), "ZMQ_BLOCKY");
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0)
      throw Error(ErrorCode::kUnavailable,
                  std::string("transport zmq: eventfd: ") + std::strerror(errno));
    if (config.curve.enabled) {
      std::array<uint8_t, 32> raw{};
      zmq_z85_decode(raw.data(), config.curve.public_key.c_str());
      authorized_keys_.insert(std::string(reinterpret_cast<char*>(raw.data()), raw.size()));
      for (const std::string& k : config.curve.authorized_keys) {
        zmq_z85_decode(raw.data(), k.c_str());
        authorized_keys_.insert(std::string(reinterpret_cast<char*>(raw.data()), raw.size()));
      }
      // The ZAP handler must exist before the first CURVE socket binds.
      zap_ = make_socket(ZMQ_REP);
      check(zmq_bind(zap_, kZapEndpoint), "bind ZAP handler");
    }
    router_ = make_socket(ZMQ_ROUTER);
    int one = 1;
    check(zmq_setsockopt(router_, ZMQ_ROUTER_MANDATORY, &one, sizeof one), "ZMQ_ROUTER_MANDATORY");
    check(zmq_setsockopt(router_, ZMQ_ROUTER_HANDOVER, &one, sizeof one), "ZMQ_ROUTER_HANDOVER");
    if (config.curve.enabled) {
      check(zmq_setsockopt(router_, ZMQ_CURVE_SERVER, &one, sizeof one), "ZMQ_CURVE_SERVER");
      check(zmq_setsockopt(router_, ZMQ_CURVE_SECRETKEY, config.curve.secret_key.c_str(), 40),
            "ZMQ_CURVE_SECRETKEY");
      check(zmq_setsockopt(router_, ZMQ_ZAP_DOMAIN, "bytecomp", 8), "ZMQ_ZAP_DOMAIN");
    }
    std::string mon = "inproc://bc-monitor-" + std::to_string(reinterpret_cast<uintptr_t>(this));
    check(zmq_socket_monitor(router_, mon.c_str(),
                             ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                                 ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                                 ZMQ_EVENT_HANDSHAKE_FAILED_AUTH),
          "zmq_socket_monitor");
    monitor_ = zmq_socket(ctx_, ZMQ_PAIR);
    if (!monitor_) throw Error(ErrorCode::kUnavailable, zmq_error("transport zmq: monitor socket"));
    check(zmq_connect(monitor_, mon.c_str()), "connect monitor");
    for (const std::string& l : config.listen) {
      if (zmq_bind(router_, bind_spelling(l).c_str()) != 0)
        throw Error(ErrorCode::kUnavailable, zmq_error("transport zmq: cannot listen on '" + l + "'"));
      std::array<char, 1024> last{};
      size_t len = last.size();
      check(zmq_getsockopt(router_, ZMQ_LAST_ENDPOINT, last.data(), &len), "ZMQ_LAST_ENDPOINT");
      bound_.emplace_back(last.data());
      BC_LOG(LogZmq(), kInfo) << "node " << self() << " listening on " << bound_.back();
    }
  } catch (...) {
    close_socket(monitor_);
    close_socket(router_);
    close_socket(zap_);
    zmq_ctx_term(ctx_);
    if (wake_fd_ >= 0) close(wake_fd_);
    throw;
  }
  thread_ = std::thread([this] { loop(); });
}

ZmqTransport::~ZmqTransport() {
  shutdown();
  // Closed only now: handler threads may call backend_wakeup() until
  // shutdown() joined them.
  close(wake_fd_);
}

void* ZmqTransport::make_socket(int type) {
  void* s = zmq_socket(ctx_, type);
  if (!s) throw Error(ErrorCode::kUnavailable, zmq_error("transport zmq: zmq_socket"));
  int zero = 0, hwm = kHwmMessages;
  int64_t max = static_cast<int64_t>(
      std::max<uint64_t>(config().max_frame_bytes, wire::kFixedBytes + 8ull * config().max_payloads));
  zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
  if (type == ZMQ_ROUTER || type == ZMQ_DEALER) {
    // A peer announcing a frame above this is disconnected by ZeroMQ before
    // any memory is allocated for it.
    check(zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &max, sizeof max), "ZMQ_MAXMSGSIZE");
    check(zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof hwm), "ZMQ_SNDHWM");
    check(zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof hwm), "ZMQ_RCVHWM");
  }
  return s;
}

void* ZmqTransport::make_dealer(const std::string& address, char rid_kind) {
  void* s = make_socket(ZMQ_DEALER);
  std::string rid = routing_id_of(self(), rid_kind);
  check(zmq_setsockopt(s, ZMQ_ROUTING_ID, rid.data(), rid.size()), "ZMQ_ROUTING_ID");
  int ivl = 100, ivl_max = 1000;
  zmq_setsockopt(s, ZMQ_RECONNECT_IVL, &ivl, sizeof ivl);
  zmq_setsockopt(s, ZMQ_RECONNECT_IVL_MAX, &ivl_max, sizeof ivl_max);
  if (config().curve.enabled) {
    const CurveConfig& c = config().curve;
    check(zmq_setsockopt(s, ZMQ_CURVE_SERVERKEY, c.public_key.c_str(), 40), "ZMQ_CURVE_SERVERKEY");
    check(zmq_setsockopt(s, ZMQ_CURVE_PUBLICKEY, c.public_key.c_str(), 40), "ZMQ_CURVE_PUBLICKEY");
    check(zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, c.secret_key.c_str(), 40), "ZMQ_CURVE_SECRETKEY");
  }
  if (zmq_connect(s, address.c_str()) != 0) {
    std::string e = zmq_error("transport zmq: cannot connect to '" + address + "'");
    zmq_close(s);
    throw Error(ErrorCode::kInvalidArgument, e);
  }
  return s;
}

void ZmqTransport::close_socket(void*& s) {
  quiet_.erase(s);
  if (s) zmq_close(s);
  s = nullptr;
}

void ZmqTransport::connect_route(Route& route) {
  route.socket = make_dealer(route.address, kDataRid);
  try {
    route.heartbeat = make_dealer(route.address, kHeartbeatRid);
  } catch (...) {
    close_socket(route.socket);
    throw;
  }
}

void ZmqTransport::close_route(Route& route) {
  close_socket(route.socket);
  close_socket(route.heartbeat);
}

void ZmqTransport::backend_wakeup() {
  // The loop looks at the send queue before it sleeps again: a reply from
  // an inline handler needs no wake-up (two syscalls saved per request).
  if (on_io_thread()) return;
  uint64_t one = 1;
  // EAGAIN only when the counter is saturated: the loop is waking anyway.
  [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof one);
}

void ZmqTransport::backend_outgoing() {
  // The loop routes the queue before it sleeps: nothing to do on its own
  // thread (an inline handler's reply).
  if (on_io_thread()) return;
  std::unique_lock io(io_mu_, std::try_to_lock);
  bool control_waits = false;
  if (io.owns_lock()) {
    // add_peer()/remove_peer() not yet carried out: routing now could
    // overtake them (the loop runs them with io_mu_ held, so none is
    // half done here).
    std::lock_guard lock(control_mu_);
    control_waits = !control_.empty();
  }
  if (!io.owns_lock() || io_closed_ || control_waits) {
    // The loop is awake and may already have looked at the queue: wake it.
    if (io.owns_lock()) io.unlock();
    backend_wakeup();
    return;
  }
  // The loop sleeps in poll(2) with the sockets free: do its routing on this
  // thread, so the message reaches ZeroMQ without a thread hand-off.
  bool wake = !route_outgoing();
  for (auto& [id, r] : dealers_) {
    if (r.fifo.empty() || r.blocked) continue;  // blocked: the loop waits for POLLOUT
    flush(id, r);  // marks the socket for the loop to look at again
    wake |= r.blocked || loop_has_work(r.socket);
  }
  bool via_router = false;
  for (auto& [id, r] : inbound_) {
    if (r.fifo.empty()) continue;
    flush(id, r);
    via_router = true;
    wake |= r.blocked;  // the loop retries a full ROUTER pipe
  }
  if (via_router) wake |= loop_has_work(router_);
  io.unlock();
  if (wake) backend_wakeup();
}

bool ZmqTransport::loop_has_work(void* socket) {
  // Our send may have taken in the command that should have woken the
  // loop's poll(2) on this socket's ZMQ_FD (say, a reply arriving): if the
  // socket has something to read, the loop must be told.
  int events = 0;
  size_t len = sizeof events;
  if (zmq_getsockopt(socket, ZMQ_EVENTS, &events, &len) != 0) return true;
  return (events & ZMQ_POLLIN) != 0;
}

void ZmqTransport::post_control(std::function<void()> fn) {
  {
    std::lock_guard lock(control_mu_);
    control_.push_back(std::move(fn));
  }
  backend_wakeup();
}

void ZmqTransport::backend_add_peer(NodeId id, const std::string& address) {
  check_endpoint(address, "peer address");
  post_control([this, id, address] {
    auto it = dealers_.find(id);
    if (it != dealers_.end()) {
      if (it->second.address == address) return;
      close_route(it->second);
      it->second.blocked = false;
    }
    Route& r = dealers_[id];
    r.address = address;
    try {
      connect_route(r);
    } catch (const Error& e) {
      BC_LOG(LogZmq(), kError) << "node " << self() << ": " << e.what();
      fail_route(r, Status::FromError(e));
      dealers_.erase(id);
    }
  });
}

void ZmqTransport::backend_remove_peer(NodeId id) {
  post_control([this, id] {
    Status gone(ErrorCode::kUnavailable, "peer " + std::to_string(id) + " was removed");
    if (auto it = dealers_.find(id); it != dealers_.end()) {
      fail_route(it->second, gone);
      close_route(it->second);
      dealers_.erase(it);
    }
    if (auto it = inbound_.find(id); it != inbound_.end()) {
      fail_route(it->second, gone);
      inbound_.erase(it);
    }
  });
}

void ZmqTransport::backend_peer_lost(NodeId id, const Status& status) {
  // Runs on the loop thread (from tick()). Rebuild, never reuse (DESIGN §5):
  // a fresh DEALER drops whatever the old one still buffered.
  if (auto it = dealers_.find(id); it != dealers_.end()) {
    Route& r = it->second;
    fail_route(r, status);
    close_route(r);
    r.blocked = false;
    try {
      connect_route(r);
    } catch (const Error& e) {
      BC_LOG(LogZmq(), kError) << "node " << self() << ": reconnect to node " << id
                               << " failed: " << e.what();
      dealers_.erase(it);
    }
  }
  if (auto it = inbound_.find(id); it != inbound_.end()) {
    fail_route(it->second, status);
    inbound_.erase(it);
  }
}

void ZmqTransport::fail_route(Route& route, const Status& status) {
  while (!route.fifo.empty()) {
    complete_send(route.fifo.front(), status);
    route.fifo.pop_front();
  }
  route.blocked = false;
}

void ZmqTransport::backend_stop() {
  stop_.store(true);
  backend_wakeup();
  if (thread_.joinable()) thread_.join();
}

bool ZmqTransport::run_control() {
  std::deque<std::function<void()>> control;
  {
    std::lock_guard lock(control_mu_);
    control.swap(control_);
  }
  for (auto& fn : control) fn();
  return !control.empty();
}

bool ZmqTransport::route_outgoing() {
  Outgoing out;
  for (;;) {
    bool control_waits = false;
    {
      // Popped under control_mu_: an add_peer()/remove_peer() posted before
      // this message was queued is then either visible here or already
      // carried out, so a send never overtakes the peer change before it.
      std::lock_guard lock(control_mu_);
      control_waits = !control_.empty();
      if (!control_waits && !pop_outgoing(out)) return true;
    }
    if (control_waits) {
      // Only the loop thread may change routes: it polls their sockets.
      if (!on_io_thread()) return false;
      run_control();
      continue;
    }
    NodeId to = out.to;
    Route* r = nullptr;
    if (auto it = dealers_.find(to); it != dealers_.end()) r = &it->second;
    else if (auto in = inbound_.find(to); in != inbound_.end()) r = &in->second;
    if (r != nullptr) {
      r->fifo.push_back(std::move(out));
    } else {
      complete_send(out, Status(ErrorCode::kUnavailable,
                                "no connection to node " + std::to_string(to) +
                                    " (not added with add_peer and not connected to us)"));
    }
  }
}

int ZmqTransport::send_one(Route& route, NodeId to, const Outgoing& out, Status& status) {
  const bool via_router = route.socket == router_;
  const uint64_t frame = config().max_frame_bytes;
  size_t frames = 0;
  for (const Buffer& b : out.payloads) frames += wire::frame_count(b.size(), frame);
  if (via_router) {
    std::string rid = routing_id_of(to);
    if (zmq_send(route.socket, rid.data(), rid.size(), ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) {
      if (zmq_errno() == EAGAIN) return 0;
      status = Status(zmq_errno() == EHOSTUNREACH ? ErrorCode::kUnavailable : ErrorCode::kInternal,
                      zmq_error("node " + std::to_string(to) + " is not connected"));
      return -1;
    }
  }
  std::vector<std::byte> head = wire::encode(out.header);
  int flags = ZMQ_DONTWAIT | (frames > 0 ? ZMQ_SNDMORE : 0);
  if (zmq_send(route.socket, head.data(), head.size(), flags) < 0) {
    if (zmq_errno() == EAGAIN && !via_router) return 0;
    // Past the routing id a ROUTER does not refuse the rest of the message.
    status = Status(ErrorCode::kInternal, zmq_error("send header to node " + std::to_string(to)));
    return -1;
  }
  size_t sent = 0;
  for (const Buffer& b : out.payloads) {
    for (uint64_t off = 0; off < b.size(); off += frame) {
      size_t len = static_cast<size_t>(std::min<uint64_t>(frame, b.size() - off));
      zmq_msg_t m;
      auto* hint = new std::shared_ptr<const void>(b.owner());
      if (zmq_msg_init_data(&m, const_cast<std::byte*>(b.data() + off), len, release_hint, hint) != 0) {
        delete hint;
        status = Status(ErrorCode::kInternal, zmq_error("zmq_msg_init_data"));
        return -1;
      }
      ++sent;
      // After the first frame ZeroMQ accepts the rest of a multipart message
      // (the high-water mark counts whole messages).
      if (zmq_msg_send(&m, route.socket, sent < frames ? ZMQ_SNDMORE : 0) < 0) {
        zmq_msg_close(&m);
        status = Status(ErrorCode::kInternal, zmq_error("send payload frame"));
        return -1;
      }
    }
  }
  return 1;
}

void ZmqTransport::flush(NodeId id, Route& route) {
  quiet_.erase(route.socket);
  while (!route.fifo.empty()) {
    Status status;
    int r = send_one(route, id, route.fifo.front(), status);
    if (r == 0) {
      route.blocked = true;
      return;
    }
    complete_send(route.fifo.front(), r > 0 ? Status() : status);
    route.fifo.pop_front();
  }
  route.blocked = false;
}

bool ZmqTransport::send_heartbeat(NodeId to) {
  // Sends on our heartbeat DEALER or on the ROUTER: look at both again.
  quiet_.erase(router_);
  if (auto it = dealers_.find(to); it != dealers_.end()) quiet_.erase(it->second.heartbeat);
  std::vector<std::byte> head = wire::encode(heartbeat_header(to));
  if (auto it = dealers_.find(to); it != dealers_.end()) {
    // Our own heartbeat connection: never behind data.
    if (!it->second.heartbeat) return false;
    return zmq_send(it->second.heartbeat, head.data(), head.size(), ZMQ_DONTWAIT) >= 0;
  }
  auto in = inbound_.find(to);
  if (in == inbound_.end()) return false;
  // To the peer's heartbeat DEALER when it is connected to us (a separate
  // pipe, so not behind the data); else on the data connection, unless that
  // is blocked (then the data itself proves us alive).
  std::string rid = routing_id_of(to, kHeartbeatRid);
  if (zmq_send(router_, rid.data(), rid.size(), ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0)
    return zmq_send(router_, head.data(), head.size(), ZMQ_DONTWAIT) >= 0;
  if (in->second.blocked) return false;
  rid = routing_id_of(to, kDataRid);
  if (zmq_send(router_, rid.data(), rid.size(), ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) return false;
  return zmq_send(router_, head.data(), head.size(), ZMQ_DONTWAIT) >= 0;
}

void ZmqTransport::read_socket(void* socket, bool is_router, NodeId dealer_peer,
                               bool heartbeat_only) {
  quiet_.erase(socket);
  const std::string origin_dealer = "node " + std::to_string(dealer_peer);
  for (int n = 0; n < kReadBatch && !receive_paused(); ++n) {
    // Collect one whole multipart message (ZeroMQ delivers them atomically).
    std::vector<std::unique_ptr<ZmqMsg>> parts;
    for (;;) {
      auto m = std::make_unique<ZmqMsg>();
      if (zmq_msg_recv(&m->m, socket, ZMQ_DONTWAIT) < 0) {
        if (parts.empty()) return;  // nothing (more) to read
        break;                      // cannot happen mid-message; be safe
      }
      bool more = zmq_msg_more(&m->m);
      parts.push_back(std::move(m));
      if (!more) break;
    }
    size_t idx = 0;
    NodeId conn_node = dealer_peer;
    std::string origin = origin_dealer;
    bool only_heartbeats = heartbeat_only;
    if (is_router) {
      const ZmqMsg& rid = *parts[idx++];
      char rid_kind = kDataRid;
      if (!node_of_routing_id(zmq_msg_data(const_cast<zmq_msg_t*>(&rid.m)),
                              zmq_msg_size(const_cast<zmq_msg_t*>(&rid.m)), conn_node, rid_kind)) {
        log_malformed("a connection to " + bound_.front(),
                      "routing id is not a ByteComp node id (" +
                          std::to_string(zmq_msg_size(const_cast<zmq_msg_t*>(&rid.m))) + " bytes)");
        continue;
      }
      only_heartbeats = rid_kind == kHeartbeatRid;
      origin = "node " + std::to_string(conn_node) + (only_heartbeats ? " (inbound heartbeats)" : " (inbound)");
    }
    if (idx >= parts.size()) {
      log_malformed(origin, "message without a header frame");
      continue;
    }
    zmq_msg_t& hm = parts[idx++]->m;
    wire::WireHeader h;
    std::string error;
    if (!wire::decode({static_cast<const std::byte*>(zmq_msg_data(&hm)), zmq_msg_size(&hm)},
                      limits(), h, error)) {
      log_malformed(origin, error);
      continue;
    }
    if (h.src != conn_node) {
      log_malformed(origin, "header claims source node " + std::to_string(h.src));
      continue;
    }
    if (h.dst != self()) {
      log_malformed(origin, "addressed to node " + std::to_string(h.dst) + ", this is node " +
                                std::to_string(self()));
      continue;
    }
    if (only_heartbeats) {
      // The heartbeat connection carries nothing else (its replies would
      // have no data route), and a heartbeat has no payloads.
      if (h.kind != wire::Kind::kHeartbeat || idx != parts.size()) {
        log_malformed(origin, std::string("heartbeat connection carried a ") +
                                  wire::kind_name(h.kind) + " message with " +
                                  std::to_string(parts.size() - idx) + " payload frames");
        continue;
      }
      // The way back to an inbound peer (its data connection) is learnt
      // from its heartbeats too, or it would never hear ours.
      if (is_router && !inbound_.count(conn_node)) inbound_[conn_node].socket = router_;
      note_alive(h.src);
      continue;
    }
    std::vector<wire::FrameSpan> spans;
    if (!wire::split_frames(
            h, idx, parts.size(), [&](size_t f) { return zmq_msg_size(&parts[f]->m); }, spans,
            error)) {
      log_malformed(origin, error);
      continue;
    }
    std::vector<Buffer> payloads;
    payloads.reserve(h.payload_sizes.size());
    struct Pieces {
      size_t index;
      uint64_t size;
      std::vector<std::shared_ptr<ZmqMsg>> frames;
    };
    std::vector<Pieces> pieces;
    for (size_t p = 0; p < spans.size(); ++p) {
      const uint64_t want = h.payload_sizes[p];
      const size_t first = spans[p].first;
      const size_t idx_end = first + spans[p].count;
      if (spans[p].count == 0) {
        payloads.emplace_back();
        continue;
      }
      if (spans[p].count == 1) {
        // One frame: hand ZeroMQ's buffer over without copying.
        std::shared_ptr<ZmqMsg> holder(std::move(parts[first]));
        payloads.push_back(Buffer::wrap(zmq_msg_data(&holder->m), zmq_msg_size(&holder->m),
                                        [holder] {}));
      } else {
        // Several frames: copied into one buffer later, off this thread.
        std::vector<std::shared_ptr<ZmqMsg>> frames;
        for (size_t f = first; f < idx_end; ++f) frames.emplace_back(std::move(parts[f]));
        pieces.push_back({payloads.size(), want, std::move(frames)});
        payloads.emplace_back();
      }
    }
    if (is_router && !inbound_.count(conn_node)) {
      Route& r = inbound_[conn_node];
      r.socket = router_;
    }
    Assembler assemble;
    if (!pieces.empty())
      assemble = [pieces = std::move(pieces)](std::vector<Buffer>& out) mutable {
        for (Pieces& p : pieces) {
          // Uninitialised storage: every byte is written below.
          std::shared_ptr<std::byte[]> mem(new std::byte[p.size]);
          std::byte* dst = mem.get();
          for (auto& f : p.frames) {
            size_t sz = zmq_msg_size(&f->m);
            std::memcpy(dst, zmq_msg_data(&f->m), sz);
            dst += sz;
            f.reset();  // free each frame as soon as it is copied
          }
          std::byte* data = mem.get();
          out[p.index] = Buffer::wrap(data, p.size, [mem] {});
        }
        pieces.clear();
      };
    on_received(std::move(h), std::move(payloads), std::move(assemble));
  }
}

void ZmqTransport::handle_zap() {
  // RFC 27 request: version, request id, domain, address, identity,
  // mechanism, credentials...
  quiet_.erase(zap_);
  std::vector<std::string> frames;
  for (;;) {
    ZmqMsg m;
    if (zmq_msg_recv(&m.m, zap_, ZMQ_DONTWAIT) < 0) {
      if (frames.empty()) return;
      break;
    }
    frames.emplace_back(static_cast<const char*>(zmq_msg_data(&m.m)), zmq_msg_size(&m.m));
    if (!zmq_msg_more(&m.m)) break;
  }
  const zmq::ZapVerdict v = zmq::check_zap_request(frames, authorized_keys_);
  if (!v.ok) {
    const bool first = first_refusal(v.refusal_key);
    if (v.curve) {
      log_refusal(first, "refused connection from " + v.from + ": " + v.reason +
                             (first ? " (its further attempts are logged at debug level)" : ""));
    } else {
      log_refusal(first, "refused connection: " + v.reason +
                             (first ? " (further attempts are logged at debug level)" : ""));
    }
  }
  const std::string& request_id = v.request_id;
  const std::string code = v.ok ? "200" : "400";
  const std::string text = v.ok ? "OK" : v.reason;
  zmq_send(zap_, "1.0", 3, ZMQ_SNDMORE);
  zmq_send(zap_, request_id.data(), request_id.size(), ZMQ_SNDMORE);
  zmq_send(zap_, code.data(), code.size(), ZMQ_SNDMORE);
  zmq_send(zap_, text.data(), text.size(), ZMQ_SNDMORE);
  zmq_send(zap_, "", 0, ZMQ_SNDMORE);
  zmq_send(zap_, "", 0, 0);
}

void ZmqTransport::handle_monitor() {
  quiet_.erase(monitor_);
  for (;;) {
    ZmqMsg ev;
    if (zmq_msg_recv(&ev.m, monitor_, ZMQ_DONTWAIT) < 0) return;
    uint16_t event = 0;
    uint32_t value = 0;
    if (zmq_msg_size(&ev.m) >= 6) {
      std::memcpy(&event, zmq_msg_data(&ev.m), 2);
      std::memcpy(&value, static_cast<char*>(zmq_msg_data(&ev.m)) + 2, 4);
    }
    std::string addr;
    if (zmq_msg_more(&ev.m)) {
      ZmqMsg a;
      if (zmq_msg_recv(&a.m, monitor_, ZMQ_DONTWAIT) >= 0)
        addr.assign(static_cast<const char*>(zmq_msg_data(&a.m)), zmq_msg_size(&a.m));
    }
    const char* what = event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH ? "authentication failed"
                       : event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL
                           ? "protocol error (not a ZMTP/CURVE peer, or wrong key)"
                           : "handshake failed";
    const bool first =
        first_refusal("handshake " + addr + " " + std::to_string(event) + " " + std::to_string(value));
    log_refusal(first, "refused a connection on " + addr + ": " + what + " (code " +
                           std::to_string(value) + ")" +
                           (first ? " (the same refusal again is logged at debug level)" : ""));
  }
}

void ZmqTransport::loop() {
  set_io_thread();
  std::unique_lock io(io_mu_);  // released only while this thread sleeps
  std::vector<zmq_pollitem_t> items;
  std::vector<NodeId> owners;  // dealer peer of items[i], kNoNode for others
  std::vector<pollfd> fds;
  std::vector<void*> fd_sockets;  // the socket behind fds[i] (nullptr: wake_fd_)
  std::vector<NodeId> heartbeats;
  Clock::time_point next_tick = Clock::now();
  while (!stop_.load()) {
    run_control();
    route_outgoing();
    bool router_blocked = false;
    for (auto& [id, r] : dealers_)
      if (!r.fifo.empty() && !r.blocked) flush(id, r);
    for (auto& [id, r] : inbound_) {
      if (!r.fifo.empty()) flush(id, r);  // a ROUTER has no per-peer POLLOUT: retry
      router_blocked |= r.blocked;
    }

    Clock::time_point now = Clock::now();
    if (now >= next_tick) {
      heartbeats.clear();
      next_tick = tick(now, heartbeats);
      for (NodeId id : heartbeats) send_heartbeat(id);
      continue;  // tick may have queued work (error replies, rebuilt sockets)
    }

    const bool paused = receive_paused();
    items.clear();
    owners.clear();
    items.push_back({router_, 0, static_cast<short>(paused ? 0 : ZMQ_POLLIN), 0});
    owners.push_back(kNoNode);
    if (zap_) {
      items.push_back({zap_, 0, ZMQ_POLLIN, 0});
      owners.push_back(kNoNode);
    }
    items.push_back({monitor_, 0, ZMQ_POLLIN, 0});
    owners.push_back(kNoNode);
    for (auto& [id, r] : dealers_) {
      short ev = static_cast<short>((paused ? 0 : ZMQ_POLLIN) | (r.blocked ? ZMQ_POLLOUT : 0));
      items.push_back({r.socket, 0, ev, 0});
      owners.push_back(id);
      // Not while paused: tick() holds liveness then anyway.
      if (r.heartbeat && !paused) {
        items.push_back({r.heartbeat, 0, ZMQ_POLLIN, 0});
        owners.push_back(id);
      }
    }
    // Look without waiting: ZMQ_EVENTS also takes in every command ZeroMQ
    // has for a socket, after which its ZMQ_FD stays quiet until something
    // new happens (what poll(2) below waits for). A socket that was quiet,
    // whose ZMQ_FD did not fire since and that nobody used since, is
    // skipped (each look is a system call or two).
    int ready = 0;
    for (zmq_pollitem_t& it : items) {
      it.revents = 0;
      if (it.events == 0) {
        quiet_.erase(it.socket);  // not watched: unknown when next looked at
        continue;
      }
      if (quiet_.count(it.socket)) continue;
      int events = 0;
      size_t len = sizeof events;
      if (zmq_getsockopt(it.socket, ZMQ_EVENTS, &events, &len) != 0) {
        BC_LOG(LogZmq(), kError) << "node " << self() << ": " << zmq_error("ZMQ_EVENTS");
        continue;
      }
      it.revents = static_cast<short>(events & it.events);
      if (it.revents) ++ready;
      else quiet_.insert(it.socket);
    }
    if (ready == 0) {
      auto wait = std::chrono::duration_cast<Millis>(next_tick - now) + Millis{1};
      // A full ROUTER pipe cannot be polled for; look again shortly (sleeping).
      if (router_blocked) wait = std::min(wait, Millis{1});
      fds.clear();
      fd_sockets.clear();
      fds.push_back({wake_fd_, POLLIN, 0});
      fd_sockets.push_back(nullptr);
      for (const zmq_pollitem_t& it : items) {
        if (it.events == 0) continue;
        int fd = -1;
        size_t len = sizeof fd;
        if (zmq_getsockopt(it.socket, ZMQ_FD, &fd, &len) == 0) {
          fds.push_back({fd, POLLIN, 0});
          fd_sockets.push_back(it.socket);
        }
      }
      // Sleep with the sockets free: a thread with a message to send may
      // write it itself meanwhile (backend_outgoing).
      io.unlock();
      int n = ::poll(fds.data(), fds.size(), static_cast<int>(wait.count()));
      io.lock();
      if (n > 0 && (fds[0].revents & POLLIN)) {
        uint64_t v;
        [[maybe_unused]] ssize_t r = read(wake_fd_, &v, sizeof v);
      }
      if (n <= 0) {
        quiet_.clear();  // timer (or error): look at every socket, a safety net
      } else {
        for (size_t i = 1; i < fds.size(); ++i)
          if (fds[i].revents) quiet_.erase(fd_sockets[i]);
      }
      continue;  // route, then look at every socket again
    }
    for (size_t i = 0; i < items.size(); ++i) {
      if (!items[i].revents) continue;
      void* s = items[i].socket;
      if (s == router_) {
        read_socket(router_, true, kNoNode);
      } else if (s == zap_) {
        handle_zap();
      } else if (s == monitor_) {
        handle_monitor();
      } else {
        auto it = dealers_.find(owners[i]);
        if (it == dealers_.end()) continue;
        if (it->second.heartbeat == s) {
          read_socket(s, false, owners[i], /*heartbeat_only=*/true);
          continue;
        }
        if (it->second.socket != s) continue;
        if (items[i].revents & ZMQ_POLLOUT) it->second.blocked = false;
        if (items[i].revents & ZMQ_POLLIN) read_socket(s, false, owners[i]);
      }
    }
  }
  // Shutting down: fail what never reached ZeroMQ, close everything.
  Status down(ErrorCode::kUnavailable, "transport shut down");
  route_outgoing();
  for (auto& [id, r] : dealers_) {
    fail_route(r, down);
    close_route(r);
  }
  for (auto& [id, r] : inbound_) fail_route(r, down);
  dealers_.clear();
  inbound_.clear();
  zmq_socket_monitor(router_, nullptr, 0);
  close_socket(monitor_);
  close_socket(router_);
  close_socket(zap_);
  zmq_ctx_term(ctx_);
  ctx_ = nullptr;
  io_closed_ = true;
}

}  // namespace

std::unique_ptr<Transport> make_zmq_transport(const TransportConfig& config) {
  return std::make_unique<ZmqTransport>(config);
}

}  // namespace bytecomp::transport
