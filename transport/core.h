// TransportBase: everything a backend shares (internal to transport/).
//
// It implements the public Transport API on top of four backend hooks, and
// owns: the bounded send queue (with back-pressure), request correlation and
// per-request deadlines, the peer table with heartbeat liveness, the handler
// threads (received messages, hashed by sender so per-sender order holds) and
// the completion thread (send completions, responses, peer failures).
//
// A backend owns one I/O loop thread that:
//   * pops Outgoing messages (pop_outgoing) and reports each one's fate once
//     (complete_send);
//   * hands every received, validated message to on_received();
//   * calls tick() when its deadline passes, sends a heartbeat to every peer
//     tick() names and rebuilds connections named by backend_peer_lost().
//
// Thread-safety: thread-safe. Locks: mu_ (send queue, pending requests, peer
// table) and the dispatch queues' own locks are never held together, and no
// lock is held while user code or a backend hook runs.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/log.h"
#include "transport/transport.h"
#include "transport/wire.h"

namespace bytecomp::transport {

BC_LOG_CATEGORY(LogTransport, "transport");

struct Outgoing {
  NodeId to = kNoNode;
  wire::WireHeader header;
  std::vector<Buffer> payloads;
  SendCallback done;     // wrapped: runs on the completion thread
  // request(): a failed send finishes this request (no callback is posted
  // for a successful one, so a request costs the completion thread nothing).
  uint64_t request_id = 0;
  uint64_t bytes = 0;    // budget held in the send queue
};

// A single-consumer FIFO of closures run by one thread (handlers, completions).
class Dispatcher {
 public:
  explicit Dispatcher(std::string name) : name_(std::move(name)) {}
  ~Dispatcher() { stop(); }
  void start();
  void post(std::function<void()> fn);
  size_t size() const;
  // Joins the thread; what is still queued is run here (run_rest) or
  // dropped (its captures released).
  void stop(bool run_rest = true);

 private:
  void run();
  std::string name_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  bool run_after_stop_ = true;
  std::thread thread_;
};

class TransportBase : public Transport {
 public:
  ~TransportBase() override;

  NodeId self() const override { return config_.node_id; }
  std::string_view backend() const override { return backend_name_; }
  void set_handler(uint16_t type, Handler handler) override;
  void set_inline_handler(uint16_t type, Handler handler) override;
  void set_default_handler(Handler handler) override;
  void on_peer_failure(PeerFailureCallback callback) override;
  void start() override;
  void add_peer(NodeId id, const std::string& address) override;
  void remove_peer(NodeId id) override;
  PeerState peer_state(NodeId id) const override;
  void send(NodeId to, Message message, SendCallback done) override;
  void request(NodeId to, Message message, Millis timeout,
               ResponseCallback done) override;
  void reply(const Incoming& request, Message response,
             SendCallback done) override;
  void shutdown() override;

  const TransportConfig& config() const { return config_; }

 protected:
  TransportBase(const TransportConfig& config, std::string backend_name);
  Millis wait_bound() const override;
  std::chrono::microseconds wait_spin() const override { return config_.wait_spin; }
  bool on_io_thread() const override {
    return io_thread_.load(std::memory_order_relaxed) == std::this_thread::get_id();
  }
  // The backend's loop thread calls this first thing (inline handlers and
  // the blocking wrappers' guard need to recognise it).
  void set_io_thread() { io_thread_.store(std::this_thread::get_id()); }
  void request_for_call(NodeId to, Message message, Millis timeout, ResponseCallback done) override;

  // --- backend hooks (called without locks held) ---
  // Make the I/O loop look at the send queue / control commands soon.
  virtual void backend_wakeup() = 0;
  // A message was queued (called by the queuing thread, after it queued,
  // without locks held). A backend may move it to the wire on the calling
  // thread when its sockets are free, sparing the I/O loop a wake-up.
  virtual void backend_outgoing() { backend_wakeup(); }
  // Validate `address` (throw Error(kInvalidArgument)) and connect.
  virtual void backend_add_peer(NodeId id, const std::string& address) = 0;
  virtual void backend_remove_peer(NodeId id) = 0;
  // Called on the I/O loop thread from tick(): drop and rebuild the
  // connection to `id`, failing what is queued for it with `status`.
  virtual void backend_peer_lost(NodeId id, const Status& status) = 0;
  // Stop and join the I/O loop; fail everything the backend still holds via
  // complete_send(). Called once by shutdown(), before the core stops.
  virtual void backend_stop() = 0;

  // --- services for the backend's I/O loop ---
  bool pop_outgoing(Outgoing& out);
  void complete_send(Outgoing& out, Status status);
  // Completes payloads that were left for later (e.g. a payload that came
  // in several frames, reassembled by copying). Runs on the handler or
  // completion thread, so big copies do not stall the I/O loop (and with it
  // heartbeats).
  using Assembler = std::function<void(std::vector<Buffer>&)>;
  // A validated message from `from`; payload buffers own their bytes.
  void on_received(wire::WireHeader&& header, std::vector<Buffer>&& payloads,
                   Assembler assemble = nullptr);
  // Any traffic from a peer proves it alive.
  void note_alive(NodeId id);
  // Whether handlers lag so far behind that reading should pause (the
  // receive queue bound). Liveness timers are held while paused.
  bool receive_paused() const;
  // Runs timers; appends the peers that are due a heartbeat; returns when to
  // call again.
  Clock::time_point tick(Clock::time_point now, std::vector<NodeId>& heartbeat_to);
  wire::WireHeader heartbeat_header(NodeId to) const;
  wire::Limits limits() const {
    return {config_.max_message_bytes, config_.max_payloads};
  }
  // Drops the message with a logged error (never throws).
  void log_malformed(const std::string& origin, const std::string& problem) const;
  bool stopping() const;

 private:
  struct Pending {
    NodeId peer;
    ResponseCallback done;
    bool run_inline;  // internal waiter (call()): run on the finishing thread
    std::multimap<Clock::time_point, uint64_t>::iterator deadline;
  };
  struct Peer {
    PeerState state = PeerState::kConnecting;
    Clock::time_point last_seen;
    Clock::time_point next_heartbeat;
    bool outbound = false;  // added by add_peer()
  };

  void enqueue(Outgoing out);
  void start_request(NodeId to, Message message, Millis timeout, ResponseCallback done, bool run_inline);
  void finish_request(uint64_t id, Response response, Assembler assemble = nullptr);
  void deliver_response(ResponseCallback done, bool run_inline, Response response,
                        Assembler assemble);
  void fail_requests_to(NodeId peer, const Status& status);
  void dispatch(Incoming incoming, Assembler assemble);
  void run_handler(Incoming incoming, Assembler assemble);
  void send_error_reply(const Incoming& request, ErrorCode code, const std::string& message);
  Status validate_message(const Message& message) const;

  TransportConfig config_;
  std::string backend_name_;

  mutable std::mutex mu_;
  std::condition_variable send_space_cv_;
  std::deque<Outgoing> send_queue_;
  uint64_t queued_bytes_ = 0;     // accepted, not yet completed
  uint64_t queued_messages_ = 0;
  bool stopping_ = false;
  bool stopped_ = false;
  uint64_t next_request_id_ = 1;
  std::unordered_map<uint64_t, Pending> pending_;
  std::multimap<Clock::time_point, uint64_t> deadlines_;
  std::unordered_map<NodeId, Peer> peers_;
  PeerFailureCallback peer_failure_;
  struct TypeHandler {
    Handler fn;
    bool run_inline = false;  // set_inline_handler
  };
  std::unordered_map<uint16_t, TypeHandler> handlers_;
  void register_handler(uint16_t type, Handler handler, bool run_inline);
  Handler default_handler_;
  bool started_ = false;

  std::mutex shutdown_mu_;  // serialises shutdown(); taken before mu_
  Dispatcher completions_{"bc-tp-complete"};
  std::vector<std::unique_ptr<Dispatcher>> handler_threads_;
  std::atomic<size_t> receive_queued_{0};
  std::atomic<std::thread::id> io_thread_{};
  struct MalformedLog {
    Clock::time_point window_start{};
    int lines = 0;
    uint64_t suppressed = 0;
  };
  mutable std::mutex malformed_mu_;  // leaf lock
  mutable std::map<std::string, MalformedLog> malformed_;
};

}  // namespace bytecomp::transport
