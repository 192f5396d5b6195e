// Connection setup and loss: peers added and removed, CM events, queue pairs
// and their slots, the hello handshake, reconnects with back-off.
#include <netdb.h>

#include <algorithm>
#include <cstring>

#include "transport/rdma/rdma_transport_impl.h"

namespace bytecomp::transport::rdma {

namespace {

// Our side of the handshake, the same for rdma_accept and rdma_connect.
// `mine` carries the hello and must outlive that call.
rdma_conn_param handshake_param(Hello& mine, NodeId self, uint32_t recv_slots) {
  mine.node = self;
  mine.recv_slots = recv_slots;
  rdma_conn_param param{};
  param.private_data = &mine;
  param.private_data_len = sizeof mine;
  param.responder_resources = 1;
  param.initiator_depth = 1;
  param.rnr_retry_count = 7;
  param.retry_count = 7;
  return param;
}

}  // namespace

void RdmaTransport::backend_add_peer(NodeId id, const std::string& address) {
  parse_endpoint(address, "peer address");
  {
    std::lock_guard lock(control_mu_);
    control_.push_back([this, id, address] {
      outbound_[id] = address;
      if (by_node_.count(id)) return;
      auto c = new_conn();
      c->node = id;
      c->outbound = true;
      c->address = address;
      Conn& ref = *c;
      by_node_[id] = c->serial;
      conns_[c->serial] = std::move(c);
      connect_out(ref);
    });
  }
  backend_wakeup();
}

void RdmaTransport::backend_remove_peer(NodeId id) {
  {
    std::lock_guard lock(control_mu_);
    control_.push_back([this, id] {
      outbound_.erase(id);
      if (auto it = by_node_.find(id); it != by_node_.end())
        close_conn(it->second, Status(ErrorCode::kUnavailable, "peer " + std::to_string(id) + " was removed"));
    });
  }
  backend_wakeup();
}

void RdmaTransport::backend_peer_lost(NodeId id, const Status& status) {
  // Loop thread. Rebuild: a fresh QP, never the old one.
  if (auto it = by_node_.find(id); it != by_node_.end()) close_conn(it->second, status);
  if (auto it = outbound_.find(id); it != outbound_.end()) {
    auto c = new_conn();
    c->node = id;
    c->outbound = true;
    c->address = it->second;
    Conn& ref = *c;
    by_node_[id] = c->serial;
    conns_[c->serial] = std::move(c);
    connect_out(ref);
  }
}

std::unique_ptr<RdmaTransport::Conn> RdmaTransport::new_conn() {
  auto c = std::make_unique<Conn>();
  c->serial = next_serial_++;
  if (next_serial_ == 0) next_serial_ = 1;
  return c;
}

void RdmaTransport::connect_out(Conn& c) {
  Endpoint ep = parse_endpoint(c.address, "peer address");
  addrinfo hints{}, *ai = nullptr;
  hints.ai_family = AF_INET;
  std::string error;
  if (rdma_create_id(cm_channel_, &c.id, reinterpret_cast<void*>(static_cast<uintptr_t>(c.serial)),
                     RDMA_PS_TCP) != 0) {
    error = errno_text("rdma_create_id");
  } else if (getaddrinfo(ep.host.c_str(), ep.port.c_str(), &hints, &ai) != 0 || !ai) {
    error = "cannot resolve " + c.address;
  } else {
    if (rdma_resolve_addr(c.id, nullptr, ai->ai_addr, 2000) != 0) error = errno_text("rdma_resolve_addr");
    freeaddrinfo(ai);
  }
  c.state = ConnState::kResolving;
  if (!error.empty()) {
    // Reported like any unreachable peer, by the heartbeat bound (the core
    // saw add_peer()); retried with back-off.
    BC_LOG(LogRdma(), kWarn) << "node " << self() << ": connecting to node " << c.node << " at "
                             << c.address << ": " << error;
    if (c.id) doomed_.push_back(c.id);
    c.id = nullptr;
    c.state = ConnState::kWaiting;
    c.attempts++;
    c.reconnect_at = Clock::now() + Millis{100} * (1 << std::min(c.attempts, 4));
  }
}

bool RdmaTransport::setup_qp(Conn& c, std::string& error) {
  if (c.id->verbs != dev_->context) {
    error = "peer is reachable only through another RDMA device than the configured one";
    return false;
  }
  const RdmaConfig& rc = config().rdma;
  ibv_qp_init_attr attr{};
  attr.send_cq = cq_;
  attr.recv_cq = cq_;
  attr.qp_type = IBV_QPT_RC;
  attr.cap.max_send_wr = rc.max_send_wr;
  attr.cap.max_recv_wr = rc.recv_buffers;
  attr.cap.max_send_sge = 16;
  attr.cap.max_recv_sge = 1;
  attr.sq_sig_all = 0;
  if (rdma_create_qp(c.id, dev_->pd, &attr) != 0) {
    error = errno_text("rdma_create_qp");
    return false;
  }
  auto make_slab = [&](uint32_t slots, int access) {
    auto s = std::make_unique<Slab>();
    s->slot_bytes = rc.buffer_bytes;
    s->mem.resize(static_cast<size_t>(slots) * rc.buffer_bytes);
    s->mr = ibv_reg_mr(dev_->pd, s->mem.data(), s->mem.size(), access);
    for (uint32_t i = slots; i > 0; --i) s->free_slots.push_back(i - 1);
    return s;
  };
  c.recv = make_slab(rc.recv_buffers, IBV_ACCESS_LOCAL_WRITE);
  // Half the send queue depth for eager/control sends; the rest is for writes.
  c.send = make_slab(std::max<uint32_t>(rc.max_send_wr / 2, 8), 0);
  if (!c.recv->mr || !c.send->mr) {
    error = errno_text("ibv_reg_mr of the connection's slots");
    return false;
  }
  for (uint32_t i = 0; i < rc.recv_buffers; ++i) post_recv(c, i);
  c.recv->free_slots.clear();
  return true;
}

RdmaTransport::Conn* RdmaTransport::conn_by_serial(uint32_t serial) {
  auto it = conns_.find(serial);
  return it == conns_.end() ? nullptr : it->second.get();
}

RdmaTransport::Conn* RdmaTransport::ready_conn(NodeId node) {
  auto it = by_node_.find(node);
  if (it == by_node_.end()) return nullptr;
  return conn_by_serial(it->second);
}

void RdmaTransport::handle_cm_event(rdma_cm_event* ev) {
  rdma_cm_id* id = ev->id;
  switch (ev->event) {
    case RDMA_CM_EVENT_CONNECT_REQUEST: {
      // Inbound: check the hello before spending a QP on it.
      Hello hello;
      const std::string problem =
          check_request_hello(ev->param.conn.private_data, ev->param.conn.private_data_len, self(), hello);
      if (!problem.empty()) {
        log_malformed("an RDMA connection request", problem);
        rdma_reject(id, nullptr, 0);
        doomed_.push_back(id);
        break;
      }
      auto c = new_conn();
      c->node = hello.node;
      c->id = id;
      id->context = reinterpret_cast<void*>(static_cast<uintptr_t>(c->serial));
      std::string error;
      if (!setup_qp(*c, error)) {
        BC_LOG(LogRdma(), kError) << "node " << self() << ": refusing node " << hello.node << ": " << error;
        rdma_reject(id, nullptr, 0);
        if (id->qp) rdma_destroy_qp(id);
        doomed_.push_back(id);
        break;
      }
      c->send_credits = static_cast<int>(std::min<uint32_t>(hello.recv_slots, config().rdma.max_send_wr / 2));
      Hello mine;
      rdma_conn_param param = handshake_param(mine, self(), config().rdma.recv_buffers);
      c->state = ConnState::kConnecting;
      uint32_t serial = c->serial;
      conns_[serial] = std::move(c);
      if (rdma_accept(id, &param) != 0) {
        BC_LOG(LogRdma(), kError) << "node " << self() << ": " << errno_text("rdma_accept");
        close_conn(serial, Status(ErrorCode::kUnavailable, "accept failed"));
      }
      break;
    }
    case RDMA_CM_EVENT_ADDR_RESOLVED: {
      Conn* c = conn_by_serial(static_cast<uint32_t>(reinterpret_cast<uintptr_t>(id->context)));
      if (c && rdma_resolve_route(id, 2000) != 0)
        BC_LOG(LogRdma(), kWarn) << "node " << self() << ": " << errno_text("rdma_resolve_route");
      break;
    }
    case RDMA_CM_EVENT_ROUTE_RESOLVED: {
      Conn* c = conn_by_serial(static_cast<uint32_t>(reinterpret_cast<uintptr_t>(id->context)));
      if (!c) break;
      std::string error;
      if (!setup_qp(*c, error)) {
        BC_LOG(LogRdma(), kWarn) << "node " << self() << ": connecting to node " << c->node << ": " << error;
        break;
      }
      Hello mine;
      rdma_conn_param param = handshake_param(mine, self(), config().rdma.recv_buffers);
      c->state = ConnState::kConnecting;
      if (rdma_connect(id, &param) != 0)
        BC_LOG(LogRdma(), kWarn) << "node " << self() << ": " << errno_text("rdma_connect");
      break;
    }
    case RDMA_CM_EVENT_ESTABLISHED: {
      Conn* c = conn_by_serial(static_cast<uint32_t>(reinterpret_cast<uintptr_t>(id->context)));
      if (!c) break;
      if (c->outbound) {
        Hello hello;
        if (!accepted_hello_matches(ev->param.conn.private_data, ev->param.conn.private_data_len, c->node,
                                    hello)) {
          log_malformed("node " + std::to_string(c->node),
                        "accepted with a hello that does not match (node " + std::to_string(hello.node) + ")");
          close_conn(c->serial, Status(ErrorCode::kMalformed, "bad hello"));
          break;
        }
        c->send_credits = static_cast<int>(std::min<uint32_t>(hello.recv_slots, config().rdma.max_send_wr / 2));
      } else {
        // An inbound connection replaces an older one from the same node.
        if (auto old = by_node_.find(c->node); old != by_node_.end() && old->second != c->serial) {
          Conn* prev = conn_by_serial(old->second);
          if (prev && prev->outbound) {
            // Both sides connected: keep the one started by the lower id.
            if (self() < c->node) {
              close_conn(c->serial, Status(ErrorCode::kUnavailable, "duplicate connection"));
              break;
            }
          }
          close_conn(old->second, Status(ErrorCode::kUnavailable, "replaced by a new connection"));
        }
        by_node_[c->node] = c->serial;
      }
      c->state = ConnState::kReady;
      BC_LOG(LogRdma(), kDebug) << "node " << self() << ": connected to node " << c->node;
      flush(*c);
      break;
    }
    case RDMA_CM_EVENT_ADDR_ERROR:
    case RDMA_CM_EVENT_ROUTE_ERROR:
    case RDMA_CM_EVENT_CONNECT_ERROR:
    case RDMA_CM_EVENT_UNREACHABLE:
    case RDMA_CM_EVENT_REJECTED:
    case RDMA_CM_EVENT_DISCONNECTED:
    case RDMA_CM_EVENT_DEVICE_REMOVAL: {
      uint32_t serial = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(id->context));
      if (id == listener_) {
        BC_LOG(LogRdma(), kError) << "node " << self() << ": listener event " << rdma_event_str(ev->event);
        break;
      }
      Conn* c = conn_by_serial(serial);
      if (!c) break;
      BC_LOG(LogRdma(), kInfo) << "node " << self() << ": connection to node " << c->node << ": "
                               << rdma_event_str(ev->event);
      // Queued work waits for the heartbeat verdict (the core reports the
      // loss and rebuilds through backend_peer_lost()); in-flight work is
      // failed now since this QP is gone.
      Status s(ErrorCode::kPeerLost, std::string("connection ") + rdma_event_str(ev->event));
      NodeId node = c->node;
      bool outbound = c->outbound;
      int attempts = c->state == ConnState::kReady ? 0 : c->attempts;
      std::deque<Outgoing> keep = std::move(c->fifo);
      close_conn(serial, s);
      if (outbound && outbound_.count(node)) {
        // Retry later, not at once: an unreachable peer must not turn into
        // a connect loop. The heartbeat bound reports it meanwhile.
        auto fresh = new_conn();
        fresh->node = node;
        fresh->outbound = true;
        fresh->address = outbound_[node];
        fresh->fifo = std::move(keep);
        fresh->attempts = attempts + 1;
        fresh->state = ConnState::kWaiting;
        fresh->reconnect_at = Clock::now() + Millis{100} * (1 << std::min(fresh->attempts, 4));
        by_node_[node] = fresh->serial;
        conns_[fresh->serial] = std::move(fresh);
      } else {
        for (Outgoing& o : keep) complete_send(o, s);
      }
      break;
    }
    default:
      break;
  }
}

void RdmaTransport::fail_conn_work(Conn& c, const Status& status) {
  for (Outgoing& o : c.fifo) complete_send(o, status);
  c.fifo.clear();
  for (auto& [id, rdv] : c.sending) {
    for (ibv_mr* mr : rdv.mrs) regcache_->hold(mr, -1);
    complete_send(rdv.out, status);
  }
  c.sending.clear();
  for (auto& [slot, rdv] : c.receiving) pool_->give_back(rdv.region);
  c.receiving.clear();
}

void RdmaTransport::close_conn(uint32_t serial, const Status& status) {
  auto it = conns_.find(serial);
  if (it == conns_.end()) return;
  Conn& c = *it->second;
  fail_conn_work(c, status);
  if (auto b = by_node_.find(c.node); b != by_node_.end() && b->second == serial) by_node_.erase(b);
  if (c.id) {
    rdma_disconnect(c.id);
    if (c.id->qp) rdma_destroy_qp(c.id);  // flushed completions find no conn and are ignored
    doomed_.push_back(c.id);
  }
  conns_.erase(it);
}

}  // namespace bytecomp::transport::rdma
