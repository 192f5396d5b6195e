// ZeroMQ backend: peers, routes, liveness and authentication
// (zmq_transport_impl.h).
#include "transport/zmq/zmq_transport_impl.h"

namespace bytecomp::transport::zmq_detail {

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

}  // namespace bytecomp::transport::zmq_detail
