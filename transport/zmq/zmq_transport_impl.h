// The ZeroMQ backend's transport class, shared by its parts (internal; see
// zmq_transport.h for the design), split by job like rdma/:
//   zmq_transport.cc  setup and teardown: context, sockets, the control queue
//   connection.cc     peers: routes (data + heartbeat DEALERs), loss,
//                     heartbeats, ZAP authentication, the socket monitor
//   datapath.cc       sending and receiving: queues to routes, send_one,
//                     read_socket, the event loop
#pragma once

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

namespace bytecomp::transport::zmq_detail {

BC_LOG_CATEGORY(LogZmq, "transport.zmq");

inline constexpr int kHwmMessages = 32;       // per pipe; bounds ZeroMQ's own queues
inline constexpr int kReadBatch = 256;        // messages read per socket per wakeup
inline constexpr char kZapEndpoint[] = "inproc://zeromq.zap.01";

inline std::string zmq_error(const std::string& what) {
  return what + ": " + zmq_strerror(zmq_errno());
}

inline void check(int rc, const std::string& what) {
  if (rc != 0) throw Error(ErrorCode::kUnavailable, "transport zmq: " + zmq_error(what));
}

// Routing ids: 'N' + node id for the data connection, 'H' + node id for the
// heartbeat connection (a second DEALER per added peer that carries nothing
// but heartbeats, so they never queue behind a large message: ZeroMQ hands
// a multipart message over only when its last frame arrived).
inline constexpr char kDataRid = 'N';
inline constexpr char kHeartbeatRid = 'H';

inline std::string routing_id_of(NodeId id, char kind = kDataRid) {
  std::string rid(5, '\0');
  rid[0] = kind;  // a routing id must not start with a zero byte
  for (int i = 0; i < 4; ++i) rid[1 + i] = static_cast<char>((id >> (8 * i)) & 0xFF);
  return rid;
}

inline bool node_of_routing_id(const void* data, size_t size, NodeId& out, char& kind) {
  const auto* p = static_cast<const unsigned char*>(data);
  if (size != 5 || (p[0] != kDataRid && p[0] != kHeartbeatRid)) return false;
  kind = static_cast<char>(p[0]);
  out = 0;
  for (int i = 0; i < 4; ++i) out |= static_cast<NodeId>(p[1 + i]) << (8 * i);
  return out != kNoNode;
}

// tcp://host:0 means an ephemeral port (ZeroMQ spells it '*').
inline std::string bind_spelling(const std::string& endpoint) {
  if (endpoint.rfind("tcp://", 0) == 0 && endpoint.size() > 2 &&
      endpoint.compare(endpoint.size() - 2, 2, ":0") == 0)
    return endpoint.substr(0, endpoint.size() - 1) + "*";
  return endpoint;
}

inline void check_endpoint(const std::string& endpoint, const char* what) {
  bool tcp = endpoint.rfind("tcp://", 0) == 0 && endpoint.find(':', 6) != std::string::npos;
  bool ipc = endpoint.rfind("ipc://", 0) == 0 && endpoint.size() > 6;
  if (!tcp && !ipc)
    throw Error(ErrorCode::kInvalidArgument,
                std::string("transport zmq: ") + what + " '" + endpoint +
                    "' is not a zmq endpoint (accepted: tcp://host:port, ipc:///path)");
}

// The abstract Unix socket a tcp listener is also bound as (local_ipc):
// "tcp://127.0.0.1:7100" -> "@bytecomp-tcp-127.0.0.1:7100" (the name as
// /proc/net/unix shows it; ZeroMQ spells it ipc://@...). Empty for anything
// but tcp://.
inline std::string local_alias(const std::string& tcp_endpoint) {
  if (tcp_endpoint.rfind("tcp://", 0) != 0) return {};
  return "@bytecomp-tcp-" + tcp_endpoint.substr(6);
}

// Where to connect for `address` (local_ipc): the abstract socket of a
// listener of this network namespace bound at exactly that tcp address, or
// at 0.0.0.0 on the port when HOST is one of this namespace's addresses;
// else `address` itself. Reads /proc/net/unix (and getifaddrs).
std::string local_route_for(const std::string& address);

inline void release_hint(void* /*data*/, void* hint) {
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

}  // namespace bytecomp::transport::zmq_detail
