// The message transport: everything that crosses a machine boundary (daemon to
// server, daemon to daemon) goes through this interface. Backends:
//   "zmq"  – ZeroMQ over tcp:// (between machines) or ipc:// (one machine);
//   "rdma" – libibverbs/librdmacm RC queue pairs (built when libibverbs exists).
// Both share the wire header, its validation, request correlation, liveness
// (heartbeats) and dispatch (transport/core.h); a backend only moves frames.
//
// Model (control vs payload, as in TensorPipe): a Message is a small typed
// Header (control, copied, fixed size on the wire) plus zero or more payload
// Buffers (data, never copied on send: ZeroMQ references them through
// zmq_msg_init_data, RDMA through registered memory).
//
// Endpoints are identified by NodeId. A node learns a peer's address with
// add_peer(id, address) and can then send to it; a peer that connected to us
// can be answered (and sent to) by its id without us knowing its address.
//
// Error model (common/error.h): setup/config errors and API misuse (bad
// address, unknown backend, bad config) throw bytecomp::Error. Everything
// asynchronous completes with a bytecomp::Status: kOk, kTimeout (a request's
// deadline passed), kPeerLost (peer missed heartbeats for peer_timeout, or its
// connection failed), kResourceExhausted (bounded queue full under
// backpressure=fail, or the block timed out), kInvalidArgument (message too
// large / too many payloads), kUnavailable (unknown peer, no handler on the
// remote side, shut down), kMalformed (a reply failed validation).
//
// Threading model:
//   * Transport is thread-safe: every public method may be called from any
//     thread, including from inside handlers and callbacks.
//   * Backend I/O runs on the backend's own threads (ZeroMQ io_threads plus
//     one poll loop; for RDMA one completion-channel thread). User code never
//     runs on them (except inline_handlers). With zmq, a thread calling
//     send()/request()/reply() while the loop sleeps hands its message to
//     ZeroMQ itself (no thread hand-off); that runs no user code either.
//   * Incoming messages (send()s and request()s from peers) run on one of
//     `handler_threads` handler threads. All messages from one sender go to
//     the same handler thread, so per-sender order is kept.
//   * Send completions, response callbacks and peer-failure callbacks run on
//     one separate completion thread, in the order their events happened. So a
//     handler MAY block waiting for a response to its own request (the
//     completion thread delivers it), but callbacks must not block for long:
//     they delay every other completion.
//   * Nothing waits forever: every request has a deadline, every blocking
//     send has send_block_timeout, peers are declared lost after peer_timeout.
//
// Ownership:
//   * make_transport() returns the sole owner (unique_ptr). Destroying it (or
//     shutdown()) stops accepting work, fails everything pending with
//     kUnavailable ("transport shut down"), joins every thread and releases
//     every payload Buffer still held. Do not destroy it from inside one of
//     its own handlers or callbacks.
//   * A Buffer passed to send()/request()/reply() is shared with the
//     transport until the bytes left the process (or the send failed); its
//     release function then runs exactly once, on some transport thread,
//     when the last reference (yours or the transport's) goes away. Do not
//     modify the memory before that.
//   * Buffers in a received Message own their bytes (or a reference to the
//     backend's receive buffer); keep them as long as you like.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"

namespace bytecomp::config {
class Reader;
}

namespace bytecomp::transport {

using NodeId = uint32_t;
inline constexpr NodeId kNoNode = 0xFFFFFFFFu;

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

// ---------------------------------------------------------------------------
// Message

// The application's typed header. Every field is the caller's to use; the
// transport adds (and checks) its own fields on the wire: magic, wire
// version, message kind, sender id, correlation id, payload sizes.
struct Header {
  // Message type; handlers are registered per type. 0..kMaxUserType.
  uint16_t type = 0;
  uint16_t flags = 0;  // application-defined
  uint32_t aux = 0;    // application-defined (e.g. shard or chunk index)
  uint64_t key = 0;    // application-defined (e.g. tensor key)
  uint64_t arg = 0;    // application-defined (e.g. iteration / round)
};
inline constexpr uint16_t kMaxUserType = 0xEFFF;  // above: transport-internal

// An immutable byte range with shared ownership. Copying shares; the release
// function (or the owned storage) goes away with the last copy. Thread-safe
// to copy and destroy from several threads (like shared_ptr).
class Buffer {
 public:
  Buffer() = default;

  // Zero-copy: refers to caller memory; `release` runs exactly once, on an
  // arbitrary thread, when neither caller nor transport refers to it. An
  // empty `release` means the caller guarantees the memory outlives the
  // transport's use (see the ownership rules above).
  static Buffer wrap(const void* data, size_t size,
                     std::function<void()> release);
  // Takes ownership of the bytes.
  static Buffer take(std::vector<std::byte> bytes);
  static Buffer take(std::string bytes);
  // Copies (for small control data).
  static Buffer copy_of(const void* data, size_t size);
  static Buffer copy_of(std::string_view text) {
    return copy_of(text.data(), text.size());
  }
  // Owned, zero-filled, writable through mutable_data() until shared.
  static Buffer allocate(size_t size);
  // As allocate() without the zeroing, for a caller that writes every byte
  // before sharing it (a bulk encoder: the zeroing is a second pass).
  static Buffer allocate_for_overwrite(size_t size);

  const std::byte* data() const noexcept { return data_; }
  size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  std::span<const std::byte> span() const noexcept { return {data_, size_}; }
  std::string_view view() const noexcept {
    return {reinterpret_cast<const char*>(data_), size_};
  }
  // Only for buffers made by allocate*(); throws Error(kInvalidArgument) else.
  std::byte* mutable_data();
  // A sub-range sharing ownership; throws Error(kInvalidArgument) when out of
  // range.
  Buffer slice(size_t offset, size_t size) const;

  // The keep-alive token (backends hold it while the bytes are in flight).
  const std::shared_ptr<const void>& owner() const noexcept { return owner_; }

 private:
  Buffer(std::shared_ptr<const void> owner, const std::byte* data, size_t size,
         bool writable)
      : owner_(std::move(owner)), data_(data), size_(size), writable_(writable) {}
  std::shared_ptr<const void> owner_;
  const std::byte* data_ = nullptr;
  size_t size_ = 0;
  bool writable_ = false;
};

struct Message {
  Header header;
  std::vector<Buffer> payloads;

  size_t payload_bytes() const noexcept {
    size_t n = 0;
    for (const Buffer& b : payloads) n += b.size();
    return n;
  }
};

// An incoming message as a handler sees it.
struct Incoming {
  NodeId from = kNoNode;
  Message message;
  // Set when the sender used request(): answer with Transport::reply(). A
  // request that gets no reply times out at the requester.
  bool expects_reply = false;
  uint64_t request_id = 0;  // correlation id; used by reply()
};

// Outcome of a request(): on success `status.ok()` and `response` holds the
// reply; otherwise `response` is empty.
struct Response {
  Status status;
  NodeId from = kNoNode;
  Message response;
};

using SendCallback = std::function<void(const Status&)>;
using ResponseCallback = std::function<void(Response)>;
using Handler = std::function<void(Incoming)>;
// `status.code()` is kPeerLost (missed heartbeats / connection failed). Called
// once per transition to lost; after the peer comes back (its heartbeats
// resume) a later loss is reported again.
using PeerFailureCallback = std::function<void(NodeId, const Status&)>;

enum class PeerState { kUnknown, kConnecting, kAlive, kLost };
std::string_view to_string(PeerState state) noexcept;

// ---------------------------------------------------------------------------
// Configuration: the `transport:` section of a component's YAML file.

struct CurveConfig {
  bool enabled = false;
  // The cluster key pair, Z85 (40 characters each; `bytecomp-transport-keygen`
  // — transport/tools — prints a fresh pair). Every node of a cluster holds it;
  // nodes use it both to accept connections and to connect.
  std::string public_key;
  std::string secret_key;
  // Further client public keys accepted (key rotation). The cluster public
  // key is always accepted.
  std::vector<std::string> authorized_keys;
};

struct RdmaConfig {
  std::string device;          // "" = first device found
  int port = 1;                // HCA port
  int gid_index = 0;           // RoCE GID index
  uint32_t recv_buffers = 64;  // pre-posted receive buffers per peer
  uint64_t buffer_bytes = 64 * 1024;       // size of each eager buffer
  uint64_t eager_limit = 16 * 1024;        // above: RDMA write (rendezvous)
  uint32_t max_send_wr = 256;
  uint64_t registration_cache_bytes = 1ull << 30;  // registered-memory cache
};

struct TransportConfig {
  std::string backend = "zmq";  // zmq | rdma
  NodeId node_id = 0;
  // Endpoints to listen on. zmq: tcp://host:port (port 0 = ephemeral),
  // ipc:///path. rdma: rdma://host:port. Empty = do not listen (connect only).
  std::vector<std::string> listen = {"tcp://127.0.0.1:0"};
  int io_threads = 2;        // ZeroMQ I/O threads
  int handler_threads = 1;   // threads running message handlers
  // Opt-in: run handlers on the backend's I/O loop thread instead of a
  // handler thread, sparing two thread hand-offs per request (the reply is
  // written by the same thread that read the request). Only for handlers
  // that never block and finish in microseconds: while one runs, this node
  // reads, writes and heartbeats nothing. An inline handler must not use
  // call() or send_wait() (they fail at once with kInvalidArgument: the
  // thread they would wait for is the one running the handler); send(),
  // request() and reply() are fine. Messages that arrive before start(), or
  // while earlier ones still wait in the receive queue, still go through
  // the handler threads, so per-sender order holds.
  bool inline_handlers = false;
  // Bounded spin of a thread blocked in call() or send_wait(): it looks
  // for its completion this long (yielding the CPU between looks) before
  // it sleeps on it. Costs at most this much CPU per call. Off by default:
  // on the 2-core test machine 20 us showed no consistent gain (the
  // variant measured last was faster whichever it was), and spinning
  // longer than a round trip made it clearly worse (docs/transport.md,
  // Measured). 0 = sleep at once. Key wait_spin_us, 0..1000.
  std::chrono::microseconds wait_spin{0};
  // zmq: a peer on this host is reached over a Unix socket instead of TCP
  // loopback. Every tcp:// listen endpoint is also bound as the abstract
  // socket ipc://@bytecomp-tcp-HOST:PORT (abstract sockets are private to
  // the network namespace, so only processes that share this one's network
  // stack can see it), and add_peer("tcp://HOST:PORT") connects to that
  // socket when it exists in this namespace (for a 0.0.0.0 listener: when
  // HOST is one of this namespace's addresses). Same framing, heartbeats and
  // CURVE; about a third of loopback TCP's CPU per byte (docs/transport.md).
  // Off by default: an abstract name has no owner or permission, so any
  // process of the namespace (any user) that binds a listener's name first
  // receives its local peers' traffic; the listener then refuses to start,
  // but a peer that connects before its listener exists could still reach
  // it. Turn it on where every local user is trusted. Key local_ipc.
  bool local_ipc = false;

  Millis heartbeat_interval{500};
  // A peer silent for this long is reported lost (the detection bound).
  Millis peer_timeout{3000};
  Millis default_request_timeout{10000};

  uint64_t max_frame_bytes = 16ull << 20;    // payloads split into frames this big
  uint64_t max_message_bytes = 1ull << 30;   // total payload bytes per message
  uint32_t max_payloads = 64;                // payload buffers per message

  // Bounded queues (per transport): messages accepted by send() but not yet
  // handed to the wire, and received messages not yet handled.
  uint32_t send_queue_messages = 4096;
  uint64_t send_queue_bytes = 2ull << 30;
  uint32_t receive_queue_messages = 4096;
  // When the send queue is full: block the caller (up to send_block_timeout)
  // or fail the send at once with kResourceExhausted.
  enum class Backpressure { kBlock, kFail };
  Backpressure backpressure = Backpressure::kBlock;
  Millis send_block_timeout{10000};

  CurveConfig curve;
  RdmaConfig rdma;

  // Throws Error(kConfig) naming the field when values do not fit together
  // (read_transport_config calls it; call it yourself for hand-built configs).
  void validate() const;
};

// Reads a `transport:` section (the caller passes root.section("transport")
// and owns the surrounding document). Every key is validated and finish() is
// called. Keys (all optional):
//   backend, node_id, listen (list), io_threads, handler_threads,
//   inline_handlers, wait_spin_us, local_ipc,
//   heartbeat_interval_ms, peer_timeout_ms, default_request_timeout_ms,
//   max_frame_bytes, max_message_bytes, max_payloads,
//   send_queue_messages, send_queue_bytes, receive_queue_messages,
//   backpressure (block|fail), send_block_timeout_ms,
//   curve: {enabled, public_key, secret_key, authorized_keys},
//   rdma: {device, port, gid_index, recv_buffers, buffer_bytes, eager_limit,
//          max_send_wr, registration_cache_bytes}
TransportConfig read_transport_config(config::Reader& section);

// ---------------------------------------------------------------------------
// The interface

class Transport {
 public:
  virtual ~Transport() = default;
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  virtual NodeId self() const = 0;
  virtual std::string_view backend() const = 0;
  // The endpoints actually bound (ephemeral ports resolved), in the order of
  // config.listen. Give one of them to peers for add_peer().
  virtual std::vector<std::string> local_addresses() const = 0;

  // Registers the handler for `type` (replacing any previous one). Messages
  // whose type has no handler go to the default handler; with none, they
  // are dropped with a logged warning and a request gets a kUnavailable
  // error reply.
  virtual void set_handler(uint16_t type, Handler handler) = 0;
  // The same, for a handler that never blocks and finishes in microseconds:
  // it runs on the backend's I/O loop thread, like every handler under
  // TransportConfig::inline_handlers, but for this type only (one thread
  // hand-off fewer per message; the same rules: no call()/send_wait() from
  // it, and while it runs this node reads, writes and heartbeats nothing).
  // A message that arrives while earlier ones still wait for a handler
  // thread goes through the handler threads too, so per-sender order holds.
  virtual void set_inline_handler(uint16_t type, Handler handler) = 0;
  virtual void set_default_handler(Handler handler) = 0;
  virtual void on_peer_failure(PeerFailureCallback callback) = 0;

  // Starts dispatching received messages to handlers. Until then they wait
  // in the bounded receive queue, so handlers can be registered after the
  // transport was created (and its address published) without losing any.
  virtual void start() = 0;

  // Connects to a peer (asynchronously; sends queue meanwhile). Calling it
  // again with a new address re-targets the peer. Throws Error
  // (kInvalidArgument) for a malformed address or id == self().
  virtual void add_peer(NodeId id, const std::string& address) = 0;
  // Forgets a peer: its pending sends and requests fail with kUnavailable.
  virtual void remove_peer(NodeId id) = 0;
  virtual PeerState peer_state(NodeId id) const = 0;

  // One-way message. `done` (may be empty) runs on the completion thread
  // once the message was handed to the wire (kOk) or cannot be (an error).
  // kOk does not mean the peer processed it; use request() for that.
  virtual void send(NodeId to, Message message, SendCallback done) = 0;

  // Request/response. `done` runs exactly once on the completion thread with
  // the reply, or with kTimeout after `timeout` (Millis{0} = the config's
  // default_request_timeout), or kPeerLost/kUnavailable/... earlier.
  virtual void request(NodeId to, Message message, Millis timeout,
                       ResponseCallback done) = 0;

  // Answers a request received by a handler. Replying to an Incoming that
  // did not expect a reply throws Error(kInvalidArgument).
  virtual void reply(const Incoming& request, Message response,
                     SendCallback done) = 0;

  // Blocking convenience wrappers (never from the completion thread: they
  // wait for it). call() waits at most `timeout` (plus scheduling).
  Status send_wait(NodeId to, Message message);
  Response call(NodeId to, Message message, Millis timeout = Millis{0});

  // Stops everything; idempotent; also done by the destructor.
  virtual void shutdown() = 0;

 protected:
  Transport() = default;
  // Upper bound the blocking wrappers wait for a completion that the
  // transport guarantees to deliver (a safety net, not a timeout policy).
  virtual Millis wait_bound() const { return Millis{600000}; }
  // Whether the calling thread is the backend's I/O loop (an inline
  // handler): the blocking wrappers refuse to wait there.
  virtual bool on_io_thread() const { return false; }
  // How long call() and send_wait() look for their completion, yielding,
  // before they block on it (see TransportConfig::wait_spin).
  virtual std::chrono::microseconds wait_spin() const { return {}; }
  // request() for call(): `done` only fulfils a promise, so a backend may
  // run it on its I/O thread and spare the completion-thread hop.
  virtual void request_for_call(NodeId to, Message message, Millis timeout, ResponseCallback done) {
    request(to, std::move(message), timeout, std::move(done));
  }
};

// Backends compiled into this build ("zmq", and "rdma" with libibverbs).
std::vector<std::string> available_backends();

// Whether `backend` can run on this machine (built in and, for rdma, an RDMA
// device present). When not, `reason` (if given) says why, for logs and test
// skips.
bool backend_usable(std::string_view backend, std::string* reason = nullptr);

// The factory. Creates, binds config.listen and starts I/O (not dispatch:
// see start()). Throws Error(kInvalidArgument) for an unknown backend,
// Error(kConfig) for an invalid config, Error(kUnavailable) when binding or
// (rdma) opening a device fails.
std::unique_ptr<Transport> make_transport(std::string_view backend,
                                          const TransportConfig& config);
inline std::unique_ptr<Transport> make_transport(const TransportConfig& config) {
  return make_transport(config.backend, config);
}

}  // namespace bytecomp::transport
