#include "transport/core.h"

#include <algorithm>
#include <future>

#include <pthread.h>

namespace bytecomp::transport {

// --------------------------------------------------------------------------
// Dispatcher

void Dispatcher::start() {
  std::lock_guard lock(mu_);
  if (thread_.joinable() || stopping_) return;
  thread_ = std::thread([this] {
    // Named for per-thread CPU figures (scripts/bench-cpu) and profiles.
    pthread_setname_np(pthread_self(), name_.substr(0, 15).c_str());
    run();
  });
}

void Dispatcher::post(std::function<void()> fn) {
  {
    std::lock_guard lock(mu_);
    if (!stopping_) {
      queue_.push_back(std::move(fn));
      cv_.notify_one();
      return;
    }
  }
  // Stopped: nobody will run it later. Completions run now (each fires
  // exactly once, also after shutdown); dropped handler work is released.
  if (run_after_stop_) fn();
}

size_t Dispatcher::size() const {
  std::lock_guard lock(mu_);
  return queue_.size();
}

void Dispatcher::stop(bool run_rest) {
  std::thread t;
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    run_after_stop_ = run_rest;
    t = std::move(thread_);
  }
  cv_.notify_all();
  if (t.joinable()) t.join();
  // Never started (or raced): run what is left here so every callback fires.
  std::deque<std::function<void()>> rest;
  {
    std::lock_guard lock(mu_);
    rest.swap(queue_);
  }
  if (run_rest)
    for (auto& fn : rest) fn();
}

void Dispatcher::run() {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping and drained
    auto fn = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    fn();
    fn = nullptr;  // release captures (payload buffers) outside the lock
    lock.lock();
  }
}

// --------------------------------------------------------------------------
// TransportBase

TransportBase::TransportBase(const TransportConfig& config, std::string backend_name)
    : config_(config), backend_name_(std::move(backend_name)) {
  config_.validate();
  for (int i = 0; i < config_.handler_threads; ++i)
    handler_threads_.push_back(std::make_unique<Dispatcher>("bc-tp-handler"));
  completions_.start();
}

TransportBase::~TransportBase() {
  // Derived classes call shutdown() in their destructors (backend_stop() is
  // theirs); this is only a guard for the core's own threads.
  for (auto& h : handler_threads_) h->stop(false);
  completions_.stop();
}

Millis TransportBase::wait_bound() const {
  return config_.send_block_timeout + config_.default_request_timeout +
         4 * config_.peer_timeout + Millis{60000};
}

void TransportBase::set_handler(uint16_t type, Handler handler) {
  register_handler(type, std::move(handler), false);
}

void TransportBase::set_inline_handler(uint16_t type, Handler handler) {
  register_handler(type, std::move(handler), true);
}

void TransportBase::register_handler(uint16_t type, Handler handler, bool run_inline) {
  if (type > kMaxUserType)
    throw Error(ErrorCode::kInvalidArgument,
                "transport: handler type " + std::to_string(type) +
                    " is reserved (accepted: 0.." + std::to_string(kMaxUserType) + ")");
  std::lock_guard lock(mu_);
  handlers_[type] = TypeHandler{std::move(handler), run_inline};
}

void TransportBase::set_default_handler(Handler handler) {
  std::lock_guard lock(mu_);
  default_handler_ = std::move(handler);
}

void TransportBase::on_peer_failure(PeerFailureCallback callback) {
  std::lock_guard lock(mu_);
  peer_failure_ = std::move(callback);
}

void TransportBase::start() {
  {
    std::lock_guard lock(mu_);
    if (started_ || stopping_) return;
    started_ = true;
  }
  for (auto& h : handler_threads_) h->start();
}

void TransportBase::add_peer(NodeId id, const std::string& address) {
  if (id == config_.node_id || id == kNoNode)
    throw Error(ErrorCode::kInvalidArgument,
                "transport: add_peer(" + std::to_string(id) + ", '" + address +
                    "'): id is this node's own or reserved");
  backend_add_peer(id, address);  // validates the address first
  std::lock_guard lock(mu_);
  Peer& p = peers_[id];
  p.outbound = true;
  if (p.state != PeerState::kAlive) p.state = PeerState::kConnecting;
  // The peer has one peer_timeout to answer our first heartbeat.
  p.last_seen = Clock::now();
  p.next_heartbeat = Clock::now();
  BC_LOG(LogTransport(), kDebug) << "node " << self() << ": peer " << id << " at " << address;
}

void TransportBase::remove_peer(NodeId id) {
  {
    std::lock_guard lock(mu_);
    peers_.erase(id);
  }
  backend_remove_peer(id);
  fail_requests_to(id, Status(ErrorCode::kUnavailable,
                              "peer " + std::to_string(id) + " was removed"));
}

PeerState TransportBase::peer_state(NodeId id) const {
  std::lock_guard lock(mu_);
  auto it = peers_.find(id);
  return it == peers_.end() ? PeerState::kUnknown : it->second.state;
}

bool TransportBase::stopping() const {
  std::lock_guard lock(mu_);
  return stopping_;
}

Status TransportBase::validate_message(const Message& m) const {
  if (m.header.type > kMaxUserType)
    return {ErrorCode::kInvalidArgument,
            "message type " + std::to_string(m.header.type) + " is reserved (accepted: 0.." +
                std::to_string(kMaxUserType) + ")"};
  if (m.payloads.size() > config_.max_payloads)
    return {ErrorCode::kInvalidArgument,
            "message has " + std::to_string(m.payloads.size()) +
                " payloads (limit max_payloads = " + std::to_string(config_.max_payloads) + ")"};
  if (m.payload_bytes() > config_.max_message_bytes)
    return {ErrorCode::kInvalidArgument,
            "message has " + std::to_string(m.payload_bytes()) +
                " payload bytes (limit max_message_bytes = " +
                std::to_string(config_.max_message_bytes) + ")"};
  return {};
}

void TransportBase::send(NodeId to, Message message, SendCallback done) {
  Outgoing out;
  out.to = to;
  out.header.kind = wire::Kind::kData;
  out.header.src = self();
  out.header.dst = to;
  out.header.user = message.header;
  for (const Buffer& b : message.payloads) out.header.payload_sizes.push_back(b.size());
  out.bytes = message.payload_bytes() + out.header.encoded_size();
  out.payloads = std::move(message.payloads);
  out.done = std::move(done);
  Status bad = validate_message(Message{message.header, out.payloads});
  if (!bad.ok()) {
    complete_send(out, bad);
    return;
  }
  enqueue(std::move(out));
}

void TransportBase::enqueue(Outgoing out) {
  std::unique_lock lock(mu_);
  // A lost peer fails sends at once instead of filling queues it will never
  // drain; its heartbeats coming back make it reachable again.
  if (auto it = peers_.find(out.to); it != peers_.end() && it->second.state == PeerState::kLost) {
    lock.unlock();
    out.bytes = 0;
    complete_send(out, Status(ErrorCode::kPeerLost,
                              "node " + std::to_string(out.to) + " is lost (silent for peer_timeout " +
                                  std::to_string(config_.peer_timeout.count()) + " ms)"));
    return;
  }
  auto fits = [&] {
    // A message bigger than the whole budget is let through an empty queue,
    // otherwise it could never be sent.
    return queued_messages_ == 0 ||
           (queued_messages_ < config_.send_queue_messages &&
            queued_bytes_ + out.bytes <= config_.send_queue_bytes);
  };
  // An inline handler's reply is let through a full queue: blocking here
  // would wait for the thread that drains it (this one) until the timeout.
  // The loop moves the queue to the wire right after the handler returns.
  if (!stopping_ && !fits() && !on_io_thread()) {
    bool ok = false;
    if (config_.backpressure == TransportConfig::Backpressure::kBlock)
      ok = send_space_cv_.wait_for(lock, config_.send_block_timeout,
                                   [&] { return stopping_ || fits(); });
    if (!ok && !stopping_) {
      std::string why = "send queue full (" + std::to_string(queued_messages_) + " messages, " +
                        std::to_string(queued_bytes_) + " bytes queued; limits " +
                        std::to_string(config_.send_queue_messages) + " / " +
                        std::to_string(config_.send_queue_bytes) + ")";
      if (config_.backpressure == TransportConfig::Backpressure::kBlock)
        why += " for " + std::to_string(config_.send_block_timeout.count()) + " ms";
      lock.unlock();
      out.bytes = 0;  // holds no budget
      complete_send(out, Status(ErrorCode::kResourceExhausted, why));
      return;
    }
  }
  if (stopping_) {
    lock.unlock();
    out.bytes = 0;
    complete_send(out, Status(ErrorCode::kUnavailable, "transport shut down"));
    return;
  }
  queued_bytes_ += out.bytes;
  ++queued_messages_;
  send_queue_.push_back(std::move(out));
  lock.unlock();
  backend_outgoing();
}

bool TransportBase::pop_outgoing(Outgoing& out) {
  std::lock_guard lock(mu_);
  if (send_queue_.empty()) return false;
  out = std::move(send_queue_.front());
  send_queue_.pop_front();
  return true;
}

void TransportBase::complete_send(Outgoing& out, Status status) {
  if (out.bytes > 0) {
    {
      std::lock_guard lock(mu_);
      queued_bytes_ -= out.bytes;
      --queued_messages_;
    }
    out.bytes = 0;
    send_space_cv_.notify_all();
  }
  // Payloads are released now (the backend holds its own references while
  // bytes are in flight), not when the callback runs.
  out.payloads.clear();
  if (!status.ok())
    BC_LOG(LogTransport(), kDebug) << "node " << self() << ": send of "
                                   << wire::kind_name(out.header.kind) << " to " << out.to
                                   << " failed: " << status.to_string();
  if (out.request_id != 0 && !status.ok()) {
    // finish_request delivers on the completion thread (or, for call(),
    // fulfils its promise here).
    uint64_t id = out.request_id;
    out.request_id = 0;
    finish_request(id, Response{status, out.to, {}});
  }
  out.request_id = 0;
  if (out.done)
    completions_.post([done = std::move(out.done), status = std::move(status)] { done(status); });
  out.done = nullptr;
}

void TransportBase::request(NodeId to, Message message, Millis timeout, ResponseCallback done) {
  start_request(to, std::move(message), timeout, std::move(done), false);
}

void TransportBase::request_for_call(NodeId to, Message message, Millis timeout,
                                     ResponseCallback done) {
  start_request(to, std::move(message), timeout, std::move(done), true);
}

void TransportBase::start_request(NodeId to, Message message, Millis timeout,
                                  ResponseCallback done, bool run_inline) {
  if (timeout.count() <= 0) timeout = config_.default_request_timeout;
  uint64_t id;
  {
    std::lock_guard lock(mu_);
    id = next_request_id_++;
    auto dl = deadlines_.emplace(Clock::now() + timeout, id);
    pending_.emplace(id, Pending{to, std::move(done), run_inline, dl});
  }
  // The loop's next deadline may have moved earlier: enqueue() below (or
  // complete_send(), which finishes the request at once) wakes it.
  Outgoing out;
  out.to = to;
  out.header.kind = wire::Kind::kRequest;
  out.header.src = self();
  out.header.dst = to;
  out.header.user = message.header;
  out.header.correlation = id;
  for (const Buffer& b : message.payloads) out.header.payload_sizes.push_back(b.size());
  out.bytes = message.payload_bytes() + out.header.encoded_size();
  Status bad = validate_message(message);
  out.payloads = std::move(message.payloads);
  out.request_id = id;
  if (!bad.ok()) {
    complete_send(out, bad);
    return;
  }
  enqueue(std::move(out));
}

void TransportBase::reply(const Incoming& request, Message response, SendCallback done) {
  if (!request.expects_reply || request.request_id == 0)
    throw Error(ErrorCode::kInvalidArgument,
                "transport: reply() to a message from node " + std::to_string(request.from) +
                    " that was not a request");
  Outgoing out;
  out.to = request.from;
  out.header.kind = wire::Kind::kResponse;
  out.header.src = self();
  out.header.dst = request.from;
  out.header.user = response.header;
  out.header.correlation = request.request_id;
  for (const Buffer& b : response.payloads) out.header.payload_sizes.push_back(b.size());
  out.bytes = response.payload_bytes() + out.header.encoded_size();
  Status bad = validate_message(response);
  out.payloads = std::move(response.payloads);
  out.done = std::move(done);
  if (!bad.ok()) {
    complete_send(out, bad);
    return;
  }
  enqueue(std::move(out));
}

void TransportBase::send_error_reply(const Incoming& request, ErrorCode code,
                                     const std::string& message) {
  Outgoing out;
  out.to = request.from;
  out.header.kind = wire::Kind::kError;
  out.header.src = self();
  out.header.dst = request.from;
  out.header.user.type = request.message.header.type;
  out.header.correlation = request.request_id;
  out.header.status_code = static_cast<uint32_t>(code);
  out.payloads.push_back(Buffer::copy_of(message));
  out.header.payload_sizes.push_back(message.size());
  out.bytes = message.size() + out.header.encoded_size();
  enqueue(std::move(out));
}

void TransportBase::finish_request(uint64_t id, Response response, Assembler assemble) {
  ResponseCallback done;
  bool run_inline = false;
  {
    std::lock_guard lock(mu_);
    auto it = pending_.find(id);
    if (it == pending_.end()) return;  // already finished (first outcome wins)
    done = std::move(it->second.done);
    run_inline = it->second.run_inline;
    deadlines_.erase(it->second.deadline);
    pending_.erase(it);
  }
  deliver_response(std::move(done), run_inline, std::move(response), std::move(assemble));
}

void TransportBase::deliver_response(ResponseCallback done, bool run_inline, Response response,
                                     Assembler assemble) {
  if (done && run_inline) {
    // call()'s waiter: cheap, except for a multi-frame reply's copy.
    if (assemble) assemble(response.response.payloads);
    done(std::move(response));
  } else if (done) {
    completions_.post([done = std::move(done), r = std::move(response),
                       assemble = std::move(assemble)]() mutable {
      if (assemble) assemble(r.response.payloads);
      done(std::move(r));
    });
  }
}

void TransportBase::fail_requests_to(NodeId peer, const Status& status) {
  std::vector<uint64_t> ids;
  {
    std::lock_guard lock(mu_);
    for (auto& [id, p] : pending_)
      if (p.peer == peer) ids.push_back(id);
  }
  for (uint64_t id : ids) finish_request(id, Response{status, peer, {}});
}

void TransportBase::note_alive(NodeId id) {
  bool revived = false;
  {
    std::lock_guard lock(mu_);
    Peer& p = peers_[id];  // an inbound peer is learnt from its traffic
    p.last_seen = Clock::now();
    if (p.state != PeerState::kAlive) {
      revived = p.state == PeerState::kLost;
      if (p.next_heartbeat == Clock::time_point{}) p.next_heartbeat = Clock::now();
      p.state = PeerState::kAlive;
    }
  }
  if (revived)
    BC_LOG(LogTransport(), kInfo) << "node " << self() << ": peer " << id << " is back";
}

bool TransportBase::receive_paused() const {
  return receive_queued_.load(std::memory_order_relaxed) >= config_.receive_queue_messages;
}

void TransportBase::on_received(wire::WireHeader&& h, std::vector<Buffer>&& payloads,
                                Assembler assemble) {
  note_alive(h.src);
  switch (h.kind) {
    case wire::Kind::kHeartbeat:
      return;
    case wire::Kind::kResponse:
    case wire::Kind::kError: {
      Response r;
      r.from = h.src;
      {
        std::lock_guard lock(mu_);
        auto it = pending_.find(h.correlation);
        if (it == pending_.end()) {
          BC_LOG(LogTransport(), kDebug)
              << "node " << self() << ": late or unknown response " << h.correlation
              << " from " << h.src << " dropped";
          return;
        }
        if (it->second.peer != h.src) {
          log_malformed("node " + std::to_string(h.src),
                        "response " + std::to_string(h.correlation) +
                            " answers a request sent to node " +
                            std::to_string(it->second.peer));
          return;
        }
      }
      if (h.kind == wire::Kind::kError) {
        std::string text = payloads.empty() ? std::string() : std::string(payloads[0].view());
        r.status = Status(static_cast<ErrorCode>(h.status_code),
                          "node " + std::to_string(h.src) + ": " + text);
      } else {
        r.response.header = h.user;
        r.response.payloads = std::move(payloads);
      }
      finish_request(h.correlation, std::move(r),
                     h.kind == wire::Kind::kResponse ? std::move(assemble) : nullptr);
      return;
    }
    case wire::Kind::kData:
    case wire::Kind::kRequest: {
      Incoming in;
      in.from = h.src;
      in.message.header = h.user;
      in.message.payloads = std::move(payloads);
      in.expects_reply = h.kind == wire::Kind::kRequest;
      in.request_id = h.correlation;
      dispatch(std::move(in), std::move(assemble));
      return;
    }
  }
}

void TransportBase::dispatch(Incoming in, Assembler assemble) {
  // Inline only when nothing received earlier still waits for a handler
  // thread (dispatch runs on the loop thread alone, so the count cannot
  // grow meanwhile): per-sender order holds either way.
  if (on_io_thread() && receive_queued_.load(std::memory_order_relaxed) == 0) {
    bool run_here;
    {
      std::lock_guard lock(mu_);
      auto it = handlers_.find(in.message.header.type);
      // A per-type inline handler leaves a multi-frame payload's copy to
      // the handler threads (the loop must not stall on big copies).
      run_here = started_ && (config_.inline_handlers ||
                              (it != handlers_.end() && it->second.run_inline && !assemble));
    }
    if (run_here) {
      run_handler(std::move(in), std::move(assemble));
      return;
    }
  }
  Dispatcher& d = *handler_threads_[in.from % handler_threads_.size()];
  receive_queued_.fetch_add(1, std::memory_order_relaxed);
  d.post([this, in = std::move(in), assemble = std::move(assemble)]() mutable {
    run_handler(std::move(in), std::move(assemble));
    // Reading resumes: wake the loop only if it had paused (a wake-up per
    // message would cost the loop a spurious round on every request).
    if (receive_queued_.fetch_sub(1, std::memory_order_relaxed) >= config_.receive_queue_messages)
      backend_wakeup();
  });
}

void TransportBase::run_handler(Incoming in, Assembler assemble) {
  {
    if (assemble) assemble(in.message.payloads);
    Handler h;
    {
      std::lock_guard lock(mu_);
      auto it = handlers_.find(in.message.header.type);
      if (it != handlers_.end()) h = it->second.fn;
      else h = default_handler_;
    }
    if (h) {
      try {
        h(std::move(in));
      } catch (const std::exception& e) {
        BC_LOG(LogTransport(), kError) << "node " << self() << ": handler for type "
                                       << in.message.header.type << " threw: " << e.what();
      }
    } else {
      BC_LOG(LogTransport(), kWarn) << "node " << self() << ": no handler for message type "
                                    << in.message.header.type << " from node " << in.from
                                    << "; dropped";
      if (in.expects_reply)
        send_error_reply(in, ErrorCode::kUnavailable,
                         "no handler for message type " +
                             std::to_string(in.message.header.type));
    }
  }
}

Clock::time_point TransportBase::tick(Clock::time_point now, std::vector<NodeId>& heartbeat_to) {
  struct Expired {
    uint64_t id;
    Pending pending;
  };
  std::vector<Expired> expired;
  std::vector<NodeId> lost;
  PeerFailureCallback on_fail;
  bool paused = receive_paused();
  Clock::time_point next = now + config_.heartbeat_interval;
  {
    std::lock_guard lock(mu_);
    // Taken out of the table here, under the same lock, so no other
    // thread can finish them meanwhile.
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      uint64_t id = deadlines_.begin()->second;
      deadlines_.erase(deadlines_.begin());
      auto it = pending_.find(id);
      if (it == pending_.end()) continue;
      expired.push_back({id, std::move(it->second)});
      pending_.erase(it);
    }
    if (!deadlines_.empty()) next = std::min(next, deadlines_.begin()->first);
    for (auto& [id, p] : peers_) {
      // While we are not reading, silence is ours, not the peer's.
      if (paused) p.last_seen = now;
      if (p.next_heartbeat <= now) {
        heartbeat_to.push_back(id);
        p.next_heartbeat = now + config_.heartbeat_interval;
      }
      next = std::min(next, p.next_heartbeat);
      if (p.state != PeerState::kLost) {
        if (now - p.last_seen >= config_.peer_timeout) {
          p.state = PeerState::kLost;
          lost.push_back(id);
        } else {
          next = std::min(next, p.last_seen + config_.peer_timeout);
        }
      }
    }
    on_fail = peer_failure_;
  }
  for (Expired& e : expired) {
    Response r;
    r.from = e.pending.peer;
    r.status = Status(ErrorCode::kTimeout, "no reply from node " + std::to_string(r.from) +
                                               " to request " + std::to_string(e.id) +
                                               " within its deadline");
    deliver_response(std::move(e.pending.done), e.pending.run_inline, std::move(r), nullptr);
  }
  for (NodeId id : lost) {
    Status s(ErrorCode::kPeerLost, "node " + std::to_string(id) + " sent nothing for " +
                                       std::to_string(config_.peer_timeout.count()) +
                                       " ms (peer_timeout)");
    BC_LOG(LogTransport(), kWarn) << "node " << self() << ": " << s.message();
    fail_requests_to(id, s);
    backend_peer_lost(id, s);
    if (on_fail) completions_.post([on_fail, id, s] { on_fail(id, s); });
  }
  return next;
}

wire::WireHeader TransportBase::heartbeat_header(NodeId to) const {
  wire::WireHeader h;
  h.kind = wire::Kind::kHeartbeat;
  h.src = self();
  h.dst = to;
  return h;
}

void TransportBase::log_malformed(const std::string& origin, const std::string& problem) const {
  // A stream of garbage must not flood the log: per origin, at most
  // kMalformedBurst lines per second, then one line saying how many were
  // suppressed.
  constexpr int kMalformedBurst = 20;
  uint64_t suppressed = 0;
  {
    std::lock_guard lock(malformed_mu_);
    if (malformed_.size() > 1024) malformed_.clear();  // bound the bookkeeping
    MalformedLog& m = malformed_[origin];
    auto now = Clock::now();
    if (now - m.window_start >= std::chrono::seconds(1)) {
      suppressed = m.suppressed;
      m = MalformedLog{now, 0, 0};
    }
    if (++m.lines > kMalformedBurst) {
      ++m.suppressed;
      return;
    }
  }
  if (suppressed > 0)
    BC_LOG(LogTransport(), kError) << "node " << self() << ": " << suppressed
                                   << " more malformed messages from " << origin
                                   << " were dropped without a log line";
  BC_LOG(LogTransport(), kError) << "node " << self() << ": malformed message from " << origin
                                 << " dropped: " << problem;
}

void TransportBase::shutdown() {
  std::lock_guard serial(shutdown_mu_);
  {
    std::lock_guard lock(mu_);
    if (stopped_) return;
    stopping_ = true;
  }
  send_space_cv_.notify_all();
  backend_stop();
  // Anything still in the core queue never reached the backend.
  Outgoing out;
  while (pop_outgoing(out)) complete_send(out, Status(ErrorCode::kUnavailable, "transport shut down"));
  std::vector<uint64_t> ids;
  {
    std::lock_guard lock(mu_);
    for (auto& [id, p] : pending_) ids.push_back(id);
  }
  for (uint64_t id : ids)
    finish_request(id, Response{Status(ErrorCode::kUnavailable, "transport shut down"), kNoNode, {}});
  // Handlers first (they may still reply: those fail fast now), then the
  // completions they produced.
  for (auto& h : handler_threads_) h->stop(/*run_rest=*/false);
  completions_.stop();
  std::lock_guard lock(mu_);
  stopped_ = true;
}

}  // namespace bytecomp::transport
