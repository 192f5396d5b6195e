// ZeroMQ backend: setup and teardown (zmq_transport_impl.h).
#include "transport/zmq/zmq_transport_impl.h"

#include <algorithm>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <pthread.h>

#include <fstream>

namespace bytecomp::transport::zmq_detail {

namespace {

// Whether /proc/net/unix lists a socket bound to the abstract `name`
// ("@..."): /proc/net/unix shows the sockets of the reader's network
// namespace only.
bool abstract_socket_exists(const std::string& name) {
  std::ifstream in("/proc/net/unix");
  std::string line;
  while (std::getline(in, line)) {
    const size_t at = line.rfind(' ');
    if (at != std::string::npos && line.compare(at + 1, std::string::npos, name) == 0) return true;
  }
  return false;
}

// Whether `host` (numeric, as in a tcp:// address; IPv6 in brackets) is an
// address of one of this namespace's interfaces.
bool is_local_address(std::string host) {
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) != 0) return false;
  bool found = false;
  for (ifaddrs* i = ifs; i != nullptr && !found; i = i->ifa_next) {
    if (i->ifa_addr == nullptr) continue;
    char buf[INET6_ADDRSTRLEN] = {};
    if (i->ifa_addr->sa_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof buf);
    } else if (i->ifa_addr->sa_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr, buf, sizeof buf);
    } else {
      continue;
    }
    found = host == buf;
  }
  freeifaddrs(ifs);
  return found;
}

}  // namespace

std::string local_route_for(const std::string& address) {
  const std::string exact = local_alias(address);
  if (exact.empty()) return address;
  if (abstract_socket_exists(exact)) return "ipc://" + exact;
  const std::string hostport = address.substr(6);
  const size_t colon = hostport.rfind(':');
  if (colon == std::string::npos) return address;
  const std::string wildcard = local_alias("tcp://0.0.0.0" + hostport.substr(colon));
  if (abstract_socket_exists(wildcard) && is_local_address(hostport.substr(0, colon)))
    return "ipc://" + wildcard;
  return address;
}

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
      const std::string alias = local_alias(bound_.back());
      if (config.local_ipc && !alias.empty()) {
        // Peers of this network namespace connect here instead (local_ipc).
        // Taken already (another listener at the same host:port of this
        // namespace cannot exist; a leftover cannot either: abstract names
        // vanish with their socket): peers then use TCP.
        if (zmq_bind(router_, ("ipc://" + alias).c_str()) != 0)
          BC_LOG(LogZmq(), kWarn) << "node " << self() << ": cannot bind ipc://" << alias
                                  << " (" << zmq_strerror(zmq_errno())
                                  << "); peers on this host use TCP";
      }
    }
  } catch (...) {
    close_socket(monitor_);
    close_socket(router_);
    close_socket(zap_);
    zmq_ctx_term(ctx_);
    if (wake_fd_ >= 0) close(wake_fd_);
    throw;
  }
  thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "bc-tp-loop");
    loop();
  });
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
#ifdef ZMQ_CONNECT_TIMEOUT
  // A connect whose SYNs are dropped (a partition) would otherwise sit in
  // the kernel's SYN back-off (1, 3, 7, 15 s...) after the link heals;
  // giving up after peer_timeout retries within reconnect_ivl_max (issue 28).
  const int connect_ms = static_cast<int>(std::min<int64_t>(config().peer_timeout.count(), 60000));
  zmq_setsockopt(s, ZMQ_CONNECT_TIMEOUT, &connect_ms, sizeof connect_ms);
#endif
  if (config().curve.enabled) {
    const CurveConfig& c = config().curve;
    check(zmq_setsockopt(s, ZMQ_CURVE_SERVERKEY, c.public_key.c_str(), 40), "ZMQ_CURVE_SERVERKEY");
    check(zmq_setsockopt(s, ZMQ_CURVE_PUBLICKEY, c.public_key.c_str(), 40), "ZMQ_CURVE_PUBLICKEY");
    check(zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, c.secret_key.c_str(), 40), "ZMQ_CURVE_SECRETKEY");
  }
  // A listener of this network namespace: its Unix socket (local_ipc).
  const std::string target = config().local_ipc ? local_route_for(address) : address;
  if (target != address && rid_kind == kDataRid)
    BC_LOG(LogZmq(), kDebug) << "node " << self() << ": " << address
                             << " is on this host; connecting through " << target;
  if (zmq_connect(s, target.c_str()) != 0) {
    std::string e = zmq_error("transport zmq: cannot connect to '" + target + "'");
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

void ZmqTransport::post_control(std::function<void()> fn) {
  {
    std::lock_guard lock(control_mu_);
    control_.push_back(std::move(fn));
  }
  backend_wakeup();
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

void ZmqTransport::backend_stop() {
  stop_.store(true);
  backend_wakeup();
  if (thread_.joinable()) thread_.join();
}

}  // namespace bytecomp::transport::zmq_detail

namespace bytecomp::transport {

std::unique_ptr<Transport> make_zmq_transport(const TransportConfig& config) {
  return std::make_unique<zmq_detail::ZmqTransport>(config);
}

}  // namespace bytecomp::transport
