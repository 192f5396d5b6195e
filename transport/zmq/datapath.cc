// ZeroMQ backend: sending, receiving and the event loop
// (zmq_transport_impl.h).
#include "transport/zmq/zmq_transport_impl.h"

namespace bytecomp::transport::zmq_detail {

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

}  // namespace bytecomp::transport::zmq_detail
