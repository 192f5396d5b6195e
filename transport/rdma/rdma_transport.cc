#include "transport/rdma/rdma_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <netdb.h>
#include <poll.h>
#include <rdma/rdma_cma.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <optional>
#include <cerrno>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <thread>

#include "transport/core.h"

namespace bytecomp::transport {
namespace {

BC_LOG_CATEGORY(LogRdma, "transport.rdma");

static_assert(std::endian::native == std::endian::little,
              "the RDMA control header is written in host order; hosts must be little-endian");

// ---------------------------------------------------------------------------
// Control header in front of every SEND (wire header and eager payload follow
// for kEager and kRts).

constexpr uint32_t kCtlMagic = 0x44524342u;  // "BCRD"
constexpr uint8_t kCtlVersion = 1;

enum class Op : uint8_t { kEager = 1, kRts = 2, kCts = 3, kCredit = 4, kNack = 5 };

struct Ctl {
  uint32_t magic = kCtlMagic;
  uint8_t version = kCtlVersion;
  uint8_t op = 0;
  uint16_t credits = 0;   // receive slots re-posted since our last report
  uint64_t rdv_id = 0;    // sender's rendezvous id (RTS, CTS, NACK)
  uint64_t addr = 0;      // CTS: target address
  uint32_t rkey = 0;      // CTS: target key
  uint32_t slot = 0;      // CTS: receiver's region id, echoed as immediate data
  uint64_t length = 0;    // RTS/CTS: payload bytes
};
static_assert(sizeof(Ctl) == 40);

// Connection private data: who is calling, in which protocol version.
struct Hello {
  uint32_t magic = kCtlMagic;
  uint8_t version = kCtlVersion;
  uint8_t pad[3] = {};
  uint32_t node = kNoNode;
  uint32_t recv_slots = 0;  // how many receives the sender of this hello posted
};

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

// wr_id layout: connection serial (32 bits) | kind (8) | index (24).
// kWrSend: an eager message whose Outgoing completes with it; kWrCtl: RTS,
// CTS, NACK, credits, heartbeats (nothing to complete).
enum WrKind : uint64_t { kWrRecv = 1, kWrSend = 2, kWrWrite = 3, kWrCtl = 4 };
uint64_t wr_id(uint32_t serial, WrKind kind, uint32_t index) {
  return (static_cast<uint64_t>(serial) << 32) | (static_cast<uint64_t>(kind) << 24) | (index & 0xFFFFFF);
}
uint32_t wr_serial(uint64_t id) { return static_cast<uint32_t>(id >> 32); }
WrKind wr_kind(uint64_t id) { return static_cast<WrKind>((id >> 24) & 0xFF); }
uint32_t wr_index(uint64_t id) { return static_cast<uint32_t>(id & 0xFFFFFF); }

std::string errno_text(const std::string& what) { return what + ": " + std::strerror(errno); }

struct Endpoint {
  std::string host;
  std::string port;
};

Endpoint parse_endpoint(const std::string& address, const char* what) {
  const std::string scheme = "rdma://";
  auto colon = address.rfind(':');
  if (address.rfind(scheme, 0) != 0 || colon == std::string::npos || colon <= scheme.size() ||
      colon + 1 >= address.size())
    throw Error(ErrorCode::kInvalidArgument, std::string("transport rdma: ") + what + " '" + address +
                                                 "' is not an rdma endpoint (accepted: rdma://host:port)");
  return {address.substr(scheme.size(), colon - scheme.size()), address.substr(colon + 1)};
}

// ---------------------------------------------------------------------------
// Protection domain + registered memory, shared with Buffers handed to users
// (they may outlive the transport).

struct Device {
  ibv_context* context = nullptr;  // owned by librdmacm
  ibv_pd* pd = nullptr;
  ~Device() {
    if (pd) ibv_dealloc_pd(pd);
  }
};

// Registered regions for rendezvous receives, by power-of-two size class,
// reused after the user releases them. Thread-safe (release comes from any
// thread).
class RegisteredPool : public std::enable_shared_from_this<RegisteredPool> {
 public:
  struct Region {
    void* mem = nullptr;
    size_t size = 0;
    ibv_mr* mr = nullptr;
  };
  RegisteredPool(std::shared_ptr<Device> dev, uint64_t cache_bytes)
      : dev_(std::move(dev)), cache_bytes_(cache_bytes) {}
  ~RegisteredPool() {
    for (auto& [size, list] : free_)
      for (Region& r : list) destroy(r);
  }
  // Returns nullopt (and sets error) when registration fails.
  std::optional<Region> take(size_t bytes, std::string& error) {
    size_t cls = 65536;
    while (cls < bytes) cls <<= 1;
    {
      std::lock_guard lock(mu_);
      auto& list = free_[cls];
      if (!list.empty()) {
        Region r = list.back();
        list.pop_back();
        cached_ -= r.size;
        return r;
      }
    }
    Region r;
    r.size = cls;
    r.mem = std::aligned_alloc(4096, cls);
    if (!r.mem) {
      error = "cannot allocate " + std::to_string(cls) + " bytes";
      return std::nullopt;
    }
    r.mr = ibv_reg_mr(dev_->pd, r.mem, cls, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (!r.mr) {
      error = errno_text("ibv_reg_mr of " + std::to_string(cls) + " bytes");
      std::free(r.mem);
      return std::nullopt;
    }
    return r;
  }
  void give_back(Region r) {
    std::lock_guard lock(mu_);
    if (cached_ + r.size > cache_bytes_) {
      destroy(r);
      return;
    }
    cached_ += r.size;
    free_[r.size].push_back(r);
  }
  // A Buffer over the first `bytes` of the region that returns it when released.
  Buffer wrap(Region r, size_t bytes) {
    auto self = shared_from_this();
    return Buffer::wrap(r.mem, bytes, [self, r] { self->give_back(r); });
  }

 private:
  static void destroy(Region& r) {
    if (r.mr) ibv_dereg_mr(r.mr);
    std::free(r.mem);
  }
  std::shared_ptr<Device> dev_;
  uint64_t cache_bytes_;
  std::mutex mu_;
  uint64_t cached_ = 0;
  std::map<size_t, std::vector<Region>> free_;
};

// Registrations of callers' payload memory, valid while the Buffer's owner
// lives (so the pages cannot have been freed and reused). Loop thread only.
class RegistrationCache {
 public:
  RegistrationCache(std::shared_ptr<Device> dev, uint64_t limit) : dev_(std::move(dev)), limit_(limit) {}
  ~RegistrationCache() {
    for (Entry& e : entries_) ibv_dereg_mr(e.mr);
  }
  ibv_mr* get(const Buffer& b, std::string& error) {
    sweep();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      auto owner = it->owner.lock();
      if (owner.get() == b.owner().get() && it->addr <= b.data() &&
          b.data() + b.size() <= it->addr + it->len) {
        entries_.splice(entries_.begin(), entries_, it);  // most recent first
        return entries_.front().mr;
      }
    }
    // Register the whole span once; slices of the same owner reuse it.
    ibv_mr* mr = ibv_reg_mr(dev_->pd, const_cast<std::byte*>(b.data()), b.size(), 0);
    if (!mr) {
      error = errno_text("ibv_reg_mr of a " + std::to_string(b.size()) + "-byte payload");
      return nullptr;
    }
    entries_.push_front({b.owner(), b.data(), b.size(), mr});
    bytes_ += b.size();
    while (bytes_ > limit_ && entries_.size() > 1) {
      // In-flight writes hold the Outgoing (and so the owner) but not this
      // entry: deregistering under an in-flight write is avoided by only
      // trimming entries no send references (use_count of the MR).
      Entry& last = entries_.back();
      if (last.in_use > 0) break;
      bytes_ -= last.len;
      ibv_dereg_mr(last.mr);
      entries_.pop_back();
    }
    return mr;
  }
  void hold(ibv_mr* mr, int delta) {
    for (Entry& e : entries_)
      if (e.mr == mr) e.in_use += delta;
  }

 private:
  struct Entry {
    std::weak_ptr<const void> owner;
    const std::byte* addr;
    size_t len;
    ibv_mr* mr;
    int in_use = 0;
  };
  void sweep() {
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (it->owner.expired() && it->in_use == 0) {
        bytes_ -= it->len;
        ibv_dereg_mr(it->mr);
        it = entries_.erase(it);
      } else {
        ++it;
      }
    }
  }
  std::shared_ptr<Device> dev_;
  uint64_t limit_;
  uint64_t bytes_ = 0;
  std::list<Entry> entries_;
};

// A slab of equal registered slots (send or receive buffers of one QP).
struct Slab {
  std::vector<std::byte> mem;
  ibv_mr* mr = nullptr;
  size_t slot_bytes = 0;
  std::vector<uint32_t> free_slots;
  ~Slab() {
    if (mr) ibv_dereg_mr(mr);
  }
  std::byte* slot(uint32_t i) { return mem.data() + static_cast<size_t>(i) * slot_bytes; }
};

// ---------------------------------------------------------------------------

class RdmaTransport final : public TransportBase {
 public:
  explicit RdmaTransport(const TransportConfig& config);
  ~RdmaTransport() override;
  std::vector<std::string> local_addresses() const override { return bound_; }

 protected:
  void backend_wakeup() override;
  void backend_add_peer(NodeId id, const std::string& address) override;
  void backend_remove_peer(NodeId id) override;
  void backend_peer_lost(NodeId id, const Status& status) override;
  void backend_stop() override;

 private:
  enum class ConnState { kWaiting, kResolving, kConnecting, kReady };
  struct SendingRdv {
    Outgoing out;
    std::vector<ibv_mr*> mrs;
    bool writing = false;
  };
  struct ReceivingRdv {
    wire::WireHeader header;
    RegisteredPool::Region region;
  };
  struct Conn {
    uint32_t serial = 0;
    NodeId node = kNoNode;  // known at once for outbound, from the hello for inbound
    bool outbound = false;
    std::string address;
    rdma_cm_id* id = nullptr;
    ConnState state = ConnState::kResolving;
    std::unique_ptr<Slab> recv, send;
    int send_credits = 0;        // receives the peer has posted for us
    int credits_to_return = 0;   // receives we re-posted, not yet reported
    std::deque<Outgoing> fifo;
    std::map<uint64_t, SendingRdv> sending;
    std::map<uint32_t, ReceivingRdv> receiving;
    uint32_t next_slot = 1;
    // kWaiting outbound connections retry at reconnect_at, backing off.
    Clock::time_point reconnect_at{};
    int attempts = 0;
  };

  void loop();
  void handle_cm_event(rdma_cm_event* ev);
  void handle_completions();
  void handle_wc(const ibv_wc& wc);
  Conn* conn_by_serial(uint32_t serial);
  Conn* ready_conn(NodeId node);
  std::unique_ptr<Conn> new_conn();
  bool setup_qp(Conn& c, std::string& error);
  void connect_out(Conn& c);
  void close_conn(uint32_t serial, const Status& status);
  void post_recv(Conn& c, uint32_t slot);
  bool post_ctl(Conn& c, const Ctl& ctl, const std::vector<std::byte>& header,
                const std::vector<Buffer>& payloads, WrKind kind = kWrCtl);
  void destroy_doomed();
  void flush(Conn& c);
  int try_send(Conn& c, Outgoing& out);  // 1 handed over, 0 wait, -1 failed
  void on_recv(Conn& c, const std::byte* data, size_t len);
  void on_write_imm(Conn& c, uint32_t slot);
  void return_credits(Conn& c, bool force);
  void route_outgoing();
  void fail_conn_work(Conn& c, const Status& status);

  std::vector<std::string> bound_;
  std::shared_ptr<Device> dev_;
  std::shared_ptr<RegisteredPool> pool_;
  std::unique_ptr<RegistrationCache> regcache_;
  rdma_event_channel* cm_channel_ = nullptr;
  rdma_cm_id* listener_ = nullptr;
  ibv_comp_channel* comp_channel_ = nullptr;
  ibv_cq* cq_ = nullptr;
  int wake_fd_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::mutex control_mu_;
  std::deque<std::function<void()>> control_;

  // Loop-thread state.
  uint32_t next_serial_ = 1;
  uint64_t next_rdv_ = 1;
  std::map<uint32_t, std::unique_ptr<Conn>> conns_;  // by serial
  std::map<NodeId, uint32_t> by_node_;               // ready (or connecting outbound)
  std::map<NodeId, std::string> outbound_;           // add_peer()ed addresses
  // CM ids are destroyed only after their pending event was acknowledged
  // (rdma_destroy_id waits for that).
  std::vector<rdma_cm_id*> doomed_;
};

constexpr int kCqEntries = 16384;
constexpr int kReservedCredits = 1;  // kept for credit returns: never deadlock
// Keys of eager sends in Conn::sending (rendezvous ids never reach this bit).
constexpr uint64_t kEagerBit = 1ull << 63;

RdmaTransport::RdmaTransport(const TransportConfig& config) : TransportBase(config, "rdma") {
  std::string reason;
  if (!rdma_device_usable(&reason)) throw Error(ErrorCode::kUnavailable, "transport rdma: " + reason);
  for (const std::string& l : config.listen) parse_endpoint(l, "listen endpoint");
  if (config.listen.size() > 1)
    throw Error(ErrorCode::kInvalidArgument, "transport rdma: listens on one endpoint (got " +
                                                 std::to_string(config.listen.size()) + ")");
  auto fail = [&](const std::string& what) {
    throw Error(ErrorCode::kUnavailable, "transport rdma: " + errno_text(what));
  };
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  cm_channel_ = rdma_create_event_channel();
  if (wake_fd_ < 0 || !cm_channel_) fail("event channel");
  fcntl(cm_channel_->fd, F_SETFL, fcntl(cm_channel_->fd, F_GETFL) | O_NONBLOCK);

  // The device: the one named in config, else the first one.
  int n = 0;
  ibv_context** list = rdma_get_devices(&n);
  dev_ = std::make_shared<Device>();
  for (int i = 0; list && i < n; ++i)
    if (config.rdma.device.empty() || config.rdma.device == ibv_get_device_name(list[i]->device)) {
      dev_->context = list[i];
      break;
    }
  if (list) rdma_free_devices(list);
  if (!dev_->context)
    throw Error(ErrorCode::kUnavailable, "transport rdma: device '" + config.rdma.device + "' not found");
  dev_->pd = ibv_alloc_pd(dev_->context);
  if (!dev_->pd) fail("ibv_alloc_pd");
  comp_channel_ = ibv_create_comp_channel(dev_->context);
  if (!comp_channel_) fail("ibv_create_comp_channel");
  fcntl(comp_channel_->fd, F_SETFL, fcntl(comp_channel_->fd, F_GETFL) | O_NONBLOCK);
  cq_ = ibv_create_cq(dev_->context, kCqEntries, nullptr, comp_channel_, 0);
  if (!cq_) fail("ibv_create_cq");
  if (ibv_req_notify_cq(cq_, 0) != 0) fail("ibv_req_notify_cq");
  pool_ = std::make_shared<RegisteredPool>(dev_, config.rdma.registration_cache_bytes);
  regcache_ = std::make_unique<RegistrationCache>(dev_, config.rdma.registration_cache_bytes);

  for (const std::string& l : config.listen) {
    Endpoint ep = parse_endpoint(l, "listen endpoint");
    if (rdma_create_id(cm_channel_, &listener_, nullptr, RDMA_PS_TCP) != 0) fail("rdma_create_id");
    addrinfo hints{}, *ai = nullptr;
    hints.ai_family = AF_INET;
    hints.ai_flags = AI_PASSIVE;
    if (getaddrinfo(ep.host.c_str(), ep.port.c_str(), &hints, &ai) != 0 || !ai)
      throw Error(ErrorCode::kInvalidArgument, "transport rdma: cannot resolve '" + l + "'");
    int rc = rdma_bind_addr(listener_, ai->ai_addr);
    freeaddrinfo(ai);
    if (rc != 0) fail("rdma_bind_addr " + l);
    if (rdma_listen(listener_, 64) != 0) fail("rdma_listen " + l);
    bound_.push_back("rdma://" + ep.host + ":" + std::to_string(ntohs(rdma_get_src_port(listener_))));
    BC_LOG(LogRdma(), kInfo) << "node " << self() << " listening on " << bound_.back();
  }
  thread_ = std::thread([this] { loop(); });
}

RdmaTransport::~RdmaTransport() {
  shutdown();
  conns_.clear();
  regcache_.reset();
  if (listener_) rdma_destroy_id(listener_);
  if (cq_) ibv_destroy_cq(cq_);
  if (comp_channel_) ibv_destroy_comp_channel(comp_channel_);
  if (cm_channel_) rdma_destroy_event_channel(cm_channel_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

void RdmaTransport::backend_wakeup() {
  uint64_t one = 1;
  [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof one);
}

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

void RdmaTransport::backend_stop() {
  stop_.store(true);
  backend_wakeup();
  if (thread_.joinable()) thread_.join();
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

void RdmaTransport::post_recv(Conn& c, uint32_t slot) {
  ibv_sge sge{reinterpret_cast<uintptr_t>(c.recv->slot(slot)), static_cast<uint32_t>(c.recv->slot_bytes),
              c.recv->mr->lkey};
  ibv_recv_wr wr{}, *bad = nullptr;
  wr.wr_id = wr_id(c.serial, kWrRecv, slot);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  if (ibv_post_recv(c.id->qp, &wr, &bad) != 0)
    BC_LOG(LogRdma(), kError) << "node " << self() << ": " << errno_text("ibv_post_recv");
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
      const void* pd = ev->param.conn.private_data;
      std::string problem;
      if (!pd || ev->param.conn.private_data_len < sizeof(Hello)) {
        problem = "connection request without a ByteComp hello";
      } else {
        std::memcpy(&hello, pd, sizeof hello);
        if (hello.magic != kCtlMagic) problem = "connection request with a bad magic";
        else if (hello.version != kCtlVersion)
          problem = "connection request with protocol version " + std::to_string(hello.version);
        else if (hello.node == kNoNode || hello.node == self())
          problem = "connection request from invalid node id " + std::to_string(hello.node);
        else if (hello.recv_slots < 2)
          problem = "connection request offering " + std::to_string(hello.recv_slots) + " receive slots";
      }
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
        if (ev->param.conn.private_data && ev->param.conn.private_data_len >= sizeof(Hello)) {
          std::memcpy(&hello, ev->param.conn.private_data, sizeof hello);
        }
        if (hello.magic != kCtlMagic || hello.version != kCtlVersion || hello.node != c->node) {
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

bool RdmaTransport::post_ctl(Conn& c, const Ctl& ctl_in, const std::vector<std::byte>& header,
                             const std::vector<Buffer>& payloads, WrKind kind) {
  if (c.send->free_slots.empty()) return false;
  uint32_t slot = c.send->free_slots.back();
  c.send->free_slots.pop_back();
  Ctl ctl = ctl_in;
  ctl.credits = static_cast<uint16_t>(std::min(c.credits_to_return, 0xFFFF));
  c.credits_to_return -= ctl.credits;
  std::byte* p = c.send->slot(slot);
  std::memcpy(p, &ctl, sizeof ctl);
  size_t off = sizeof ctl;
  if (!header.empty()) std::memcpy(p + off, header.data(), header.size());
  off += header.size();
  for (const Buffer& b : payloads) {
    if (b.size()) std::memcpy(p + off, b.data(), b.size());
    off += b.size();
  }
  ibv_sge sge{reinterpret_cast<uintptr_t>(p), static_cast<uint32_t>(off), c.send->mr->lkey};
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = wr_id(c.serial, kind, slot);
  wr.opcode = IBV_WR_SEND;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.send_flags = IBV_SEND_SIGNALED;
  if (ibv_post_send(c.id->qp, &wr, &bad) != 0) {
    BC_LOG(LogRdma(), kError) << "node " << self() << ": " << errno_text("ibv_post_send");
    c.send->free_slots.push_back(slot);
    c.credits_to_return += ctl.credits;
    return false;
  }
  --c.send_credits;
  return true;
}

void RdmaTransport::return_credits(Conn& c, bool force) {
  // Without outgoing traffic to carry them, report freed receives once half
  // the window is back (or when asked).
  if (c.state != ConnState::kReady || c.credits_to_return == 0) return;
  if (!force && c.credits_to_return < static_cast<int>(config().rdma.recv_buffers / 2)) return;
  if (c.send_credits <= 0) return;  // the reserved credit is this message's
  Ctl ctl;
  ctl.op = static_cast<uint8_t>(Op::kCredit);
  post_ctl(c, ctl, {}, {});
}

// 1: handed to the HCA (eager) or rendezvous started; 0: wait for credits or
// slots; -1: failed (completed).
int RdmaTransport::try_send(Conn& c, Outgoing& out) {
  const uint64_t total = out.header.total_payload_bytes();
  std::vector<std::byte> header = wire::encode(out.header);
  const bool eager = total <= config().rdma.eager_limit &&
                     sizeof(Ctl) + header.size() + total <= c.send->slot_bytes;
  // One credit stays reserved for credit returns.
  if (c.send_credits <= kReservedCredits || c.send->free_slots.empty()) return 0;
  if (eager) {
    Ctl ctl;
    ctl.op = static_cast<uint8_t>(Op::kEager);
    if (!post_ctl(c, ctl, header, out.payloads, kWrSend)) return 0;
    // The bytes were copied into the slot: release the caller's buffers now,
    // report completion when the HCA finished the send (handle_wc).
    SendingRdv rdv;
    rdv.out = std::move(out);
    rdv.out.payloads.clear();
    c.sending.emplace(next_rdv_++ | kEagerBit, std::move(rdv));
    return 1;
  }
  // Rendezvous: register payload memory now so the write can start on CTS.
  SendingRdv rdv;
  for (const Buffer& b : out.payloads) {
    if (b.empty()) {
      rdv.mrs.push_back(nullptr);
      continue;
    }
    std::string error;
    ibv_mr* mr = regcache_->get(b, error);
    if (!mr) {
      for (ibv_mr* m : rdv.mrs)
        if (m) regcache_->hold(m, -1);
      complete_send(out, Status(ErrorCode::kResourceExhausted, error));
      return -1;
    }
    regcache_->hold(mr, +1);
    rdv.mrs.push_back(mr);
  }
  uint64_t id = next_rdv_++;
  Ctl ctl;
  ctl.op = static_cast<uint8_t>(Op::kRts);
  ctl.rdv_id = id;
  ctl.length = total;
  if (!post_ctl(c, ctl, header, {})) {
    for (ibv_mr* m : rdv.mrs)
      if (m) regcache_->hold(m, -1);
    return 0;
  }
  rdv.out = std::move(out);
  c.sending.emplace(id, std::move(rdv));
  return 1;
}

void RdmaTransport::flush(Conn& c) {
  if (c.state != ConnState::kReady) return;
  while (!c.fifo.empty()) {
    int r = try_send(c, c.fifo.front());
    if (r == 0) break;
    c.fifo.pop_front();
  }
  return_credits(c, false);
}

void RdmaTransport::route_outgoing() {
  Outgoing out;
  while (pop_outgoing(out)) {
    auto it = by_node_.find(out.to);
    Conn* c = it == by_node_.end() ? nullptr : conn_by_serial(it->second);
    if (!c) {
      complete_send(out, Status(ErrorCode::kUnavailable,
                                "no connection to node " + std::to_string(out.to) +
                                    " (not added with add_peer and not connected to us)"));
      continue;
    }
    c->fifo.push_back(std::move(out));
  }
  for (auto& [serial, c] : conns_) flush(*c);
}

void RdmaTransport::on_recv(Conn& c, const std::byte* data, size_t len) {
  const std::string origin = "node " + std::to_string(c.node) + " (rdma)";
  Ctl ctl;
  if (len < sizeof ctl) {
    log_malformed(origin, "control message of " + std::to_string(len) + " bytes");
    return;
  }
  std::memcpy(&ctl, data, sizeof ctl);
  if (ctl.magic != kCtlMagic || ctl.version != kCtlVersion) {
    log_malformed(origin, "control header with bad magic or version " + std::to_string(ctl.version));
    return;
  }
  c.send_credits += ctl.credits;
  const std::byte* rest = data + sizeof ctl;
  size_t rest_len = len - sizeof ctl;
  auto decode_header = [&](wire::WireHeader& h, size_t& header_len) {
    std::string error;
    if (rest_len < wire::kFixedBytes) {
      log_malformed(origin, "message shorter than a wire header");
      return false;
    }
    uint16_t count = static_cast<uint16_t>(std::to_integer<uint8_t>(rest[6]) |
                                           (std::to_integer<uint8_t>(rest[7]) << 8));
    header_len = wire::kFixedBytes + 8ull * count;
    if (header_len > rest_len) {
      log_malformed(origin, "wire header runs past the message");
      return false;
    }
    if (!wire::decode({rest, header_len}, limits(), h, error)) {
      log_malformed(origin, error);
      return false;
    }
    if (h.src != c.node || h.dst != self()) {
      log_malformed(origin, "header names source " + std::to_string(h.src) + " and destination " +
                                std::to_string(h.dst));
      return false;
    }
    return true;
  };
  switch (static_cast<Op>(ctl.op)) {
    case Op::kCredit:
      note_alive(c.node);
      return;
    case Op::kEager: {
      wire::WireHeader h;
      size_t hl = 0;
      if (!decode_header(h, hl)) return;
      if (h.total_payload_bytes() != rest_len - hl) {
        log_malformed(origin, "eager message carries " + std::to_string(rest_len - hl) +
                                  " payload bytes, header declares " + std::to_string(h.total_payload_bytes()));
        return;
      }
      std::vector<Buffer> payloads;
      const std::byte* p = rest + hl;
      for (uint64_t s : h.payload_sizes) {
        payloads.push_back(s ? Buffer::copy_of(p, s) : Buffer());
        p += s;
      }
      on_received(std::move(h), std::move(payloads));
      return;
    }
    case Op::kRts: {
      wire::WireHeader h;
      size_t hl = 0;
      if (!decode_header(h, hl)) return;
      note_alive(c.node);
      Ctl reply;
      reply.rdv_id = ctl.rdv_id;
      std::string error;
      std::optional<RegisteredPool::Region> region;
      if (h.total_payload_bytes() != ctl.length || ctl.length == 0) {
        log_malformed(origin, "RTS length " + std::to_string(ctl.length) + " disagrees with its header");
        error = "bad RTS";
      } else {
        region = pool_->take(ctl.length, error);
      }
      if (!region) {
        reply.op = static_cast<uint8_t>(Op::kNack);
      } else {
        uint32_t slot = c.next_slot++ & 0xFFFFFF;
        if (slot == 0) slot = c.next_slot++ & 0xFFFFFF;
        c.receiving[slot] = ReceivingRdv{std::move(h), *region};
        reply.op = static_cast<uint8_t>(Op::kCts);
        reply.addr = reinterpret_cast<uintptr_t>(region->mem);
        reply.rkey = region->mr->rkey;
        reply.slot = slot;
        reply.length = ctl.length;
      }
      // CTS/NACK use the reserved credit if need be: the peer is waiting.
      if (!post_ctl(c, reply, {}, {}))
        BC_LOG(LogRdma(), kError) << "node " << self() << ": no send slot for CTS to node " << c.node;
      return;
    }
    case Op::kCts:
    case Op::kNack: {
      auto it = c.sending.find(ctl.rdv_id);
      if (it == c.sending.end() || it->second.writing) {
        log_malformed(origin, "CTS/NACK for unknown rendezvous " + std::to_string(ctl.rdv_id));
        return;
      }
      SendingRdv& rdv = it->second;
      if (static_cast<Op>(ctl.op) == Op::kNack) {
        for (ibv_mr* m : rdv.mrs)
          if (m) regcache_->hold(m, -1);
        complete_send(rdv.out, Status(ErrorCode::kResourceExhausted,
                                      "node " + std::to_string(c.node) + " could not take a " +
                                          std::to_string(rdv.out.header.total_payload_bytes()) + "-byte message"));
        c.sending.erase(it);
        return;
      }
      if (ctl.length != rdv.out.header.total_payload_bytes()) {
        log_malformed(origin, "CTS length " + std::to_string(ctl.length) + " for a " +
                                  std::to_string(rdv.out.header.total_payload_bytes()) + "-byte message");
        return;
      }
      // RDMA-write the payloads back to back, in frames, the last one with
      // the receiver's slot as immediate data.
      std::vector<ibv_send_wr> wrs;
      std::vector<ibv_sge> sges;
      const uint64_t frame = config().max_frame_bytes;
      size_t frames = 0;
      for (const Buffer& b : rdv.out.payloads) frames += wire::frame_count(b.size(), frame);
      wrs.resize(frames);
      sges.resize(frames);
      uint64_t remote = ctl.addr;
      size_t k = 0;
      for (size_t i = 0; i < rdv.out.payloads.size(); ++i) {
        const Buffer& b = rdv.out.payloads[i];
        for (uint64_t off = 0; off < b.size(); off += frame, ++k) {
          uint32_t len32 = static_cast<uint32_t>(std::min<uint64_t>(frame, b.size() - off));
          sges[k] = {reinterpret_cast<uintptr_t>(b.data() + off), len32, rdv.mrs[i]->lkey};
          ibv_send_wr& w = wrs[k];
          w = {};
          w.wr_id = wr_id(c.serial, kWrWrite, 0);
          w.sg_list = &sges[k];
          w.num_sge = 1;
          w.opcode = IBV_WR_RDMA_WRITE;
          w.wr.rdma.remote_addr = remote;
          w.wr.rdma.rkey = ctl.rkey;
          remote += len32;
          if (k > 0) wrs[k - 1].next = &w;
        }
      }
      ibv_send_wr& last = wrs.back();
      last.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      last.imm_data = htonl(ctl.slot);
      last.send_flags = IBV_SEND_SIGNALED;
      last.wr_id = wr_id(c.serial, kWrWrite, static_cast<uint32_t>(ctl.rdv_id & 0xFFFFFF));
      ibv_send_wr* bad = nullptr;
      if (ibv_post_send(c.id->qp, wrs.data(), &bad) != 0) {
        for (ibv_mr* m : rdv.mrs)
          if (m) regcache_->hold(m, -1);
        complete_send(rdv.out, Status(ErrorCode::kInternal, errno_text("ibv_post_send (RDMA write)")));
        c.sending.erase(it);
        return;
      }
      --c.send_credits;  // the write-with-immediate consumes one receive
      rdv.writing = true;
      return;
    }
  }
  log_malformed(origin, "unknown control op " + std::to_string(ctl.op));
}

void RdmaTransport::on_write_imm(Conn& c, uint32_t slot) {
  auto it = c.receiving.find(slot);
  if (it == c.receiving.end()) {
    log_malformed("node " + std::to_string(c.node) + " (rdma)", "RDMA write for unknown region " +
                                                                    std::to_string(slot));
    return;
  }
  ReceivingRdv rdv = std::move(it->second);
  c.receiving.erase(it);
  Buffer whole = pool_->wrap(rdv.region, rdv.header.total_payload_bytes());
  std::vector<Buffer> payloads;
  size_t off = 0;
  for (uint64_t s : rdv.header.payload_sizes) {
    payloads.push_back(s ? whole.slice(off, s) : Buffer());
    off += s;
  }
  on_received(std::move(rdv.header), std::move(payloads));
}

void RdmaTransport::handle_wc(const ibv_wc& wc) {
  Conn* c = conn_by_serial(wr_serial(wc.wr_id));
  if (!c) return;  // flushed work of a closed connection
  const WrKind kind = wr_kind(wc.wr_id);
  const uint32_t index = wr_index(wc.wr_id);
  if (wc.status != IBV_WC_SUCCESS) {
    if (wc.status != IBV_WC_WR_FLUSH_ERR)
      BC_LOG(LogRdma(), kWarn) << "node " << self() << ": work completion from node " << c->node << ": "
                               << ibv_wc_status_str(wc.status);
    // The QP is in error: everything on it is lost. The heartbeat bound
    // reports the peer; rebuild happens through backend_peer_lost().
    if (kind == kWrSend || kind == kWrCtl) c->send->free_slots.push_back(index);
    return;
  }
  switch (kind) {
    case kWrRecv: {
      if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
        on_write_imm(*c, ntohl(wc.imm_data));
      } else {
        on_recv(*c, c->recv->slot(index), wc.byte_len);
      }
      // on_*() may have closed the connection.
      if ((c = conn_by_serial(wr_serial(wc.wr_id))) != nullptr) {
        post_recv(*c, index);
        c->credits_to_return++;
      }
      break;
    }
    case kWrCtl:
      c->send->free_slots.push_back(index);
      break;
    case kWrSend: {
      c->send->free_slots.push_back(index);
      // Eager sends complete in order of posting (RC, one QP).
      for (auto it = c->sending.begin(); it != c->sending.end(); ++it) {
        if (it->first & kEagerBit) {
          complete_send(it->second.out, Status());
          c->sending.erase(it);
          break;
        }
      }
      break;
    }
    case kWrWrite: {
      for (auto it = c->sending.begin(); it != c->sending.end(); ++it) {
        if (!(it->first & kEagerBit) && it->second.writing && (it->first & 0xFFFFFF) == index) {
          for (ibv_mr* m : it->second.mrs)
            if (m) regcache_->hold(m, -1);
          complete_send(it->second.out, Status());
          c->sending.erase(it);
          break;
        }
      }
      break;
    }
  }
  if ((c = conn_by_serial(wr_serial(wc.wr_id))) != nullptr) flush(*c);
}

void RdmaTransport::handle_completions() {
  ibv_cq* cq = nullptr;
  void* ctx = nullptr;
  while (ibv_get_cq_event(comp_channel_, &cq, &ctx) == 0) ibv_ack_cq_events(cq, 1);
  // Re-arm before draining so a completion arriving meanwhile wakes us.
  ibv_req_notify_cq(cq_, 0);
  ibv_wc wcs[64];
  for (;;) {
    int n = ibv_poll_cq(cq_, 64, wcs);
    if (n <= 0) break;
    for (int i = 0; i < n; ++i) handle_wc(wcs[i]);
  }
}

void RdmaTransport::loop() {
  set_io_thread();
  std::vector<NodeId> heartbeats;
  Clock::time_point next_tick = Clock::now();
  while (!stop_.load()) {
    std::deque<std::function<void()>> control;
    {
      std::lock_guard lock(control_mu_);
      control.swap(control_);
    }
    for (auto& fn : control) fn();
    destroy_doomed();  // closed by control or timers: no event of theirs is pending
    route_outgoing();
    Clock::time_point now = Clock::now();
    if (now >= next_tick) {
      heartbeats.clear();
      next_tick = tick(now, heartbeats);
      for (NodeId id : heartbeats) {
        Conn* c = ready_conn(id);
        if (!c || c->state != ConnState::kReady || c->send_credits <= kReservedCredits) continue;
        Ctl ctl;
        ctl.op = static_cast<uint8_t>(Op::kEager);
        post_ctl(*c, ctl, wire::encode(heartbeat_header(id)), {});
      }
      for (auto& [serial, c] : conns_) return_credits(*c, true);
      continue;
    }
    Clock::time_point wake_at = next_tick;
    for (auto& [serial, c] : conns_) {
      if (c->state != ConnState::kWaiting) continue;
      if (c->reconnect_at <= now) connect_out(*c);
      else wake_at = std::min(wake_at, c->reconnect_at);
    }
    pollfd fds[3] = {{wake_fd_, POLLIN, 0}, {cm_channel_->fd, POLLIN, 0}, {comp_channel_->fd, POLLIN, 0}};
    auto wait = std::chrono::duration_cast<Millis>(wake_at - now) + Millis{1};
    int rc = poll(fds, 3, static_cast<int>(wait.count()));
    if (rc < 0) {
      if (errno != EINTR) BC_LOG(LogRdma(), kError) << "node " << self() << ": " << errno_text("poll");
      continue;
    }
    if (fds[0].revents) {
      uint64_t v;
      [[maybe_unused]] ssize_t n = read(wake_fd_, &v, sizeof v);
    }
    if (fds[1].revents) {
      rdma_cm_event* ev = nullptr;
      while (rdma_get_cm_event(cm_channel_, &ev) == 0) {
        // Copy what handlers need, then ack (acking frees private data).
        handle_cm_event(ev);
        rdma_ack_cm_event(ev);
        destroy_doomed();
      }
    }
    if (fds[2].revents) handle_completions();
  }
  Status down(ErrorCode::kUnavailable, "transport shut down");
  route_outgoing();
  std::vector<uint32_t> serials;
  for (auto& [serial, c] : conns_) serials.push_back(serial);
  for (uint32_t s : serials) close_conn(s, down);
  destroy_doomed();
}

void RdmaTransport::destroy_doomed() {
  for (rdma_cm_id* id : doomed_) rdma_destroy_id(id);
  doomed_.clear();
}

}  // namespace

bool rdma_device_usable(std::string* reason) {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (!list || n == 0) {
    if (list) ibv_free_device_list(list);
    if (reason)
      *reason = "no RDMA device (ibv_get_device_list found none; no HCA and no soft-RoCE/rxe link)";
    return false;
  }
  bool active = false;
  std::string seen;
  for (int i = 0; i < n && !active; ++i) {
    ibv_context* ctx = ibv_open_device(list[i]);
    if (!ctx) continue;
    ibv_device_attr attr{};
    if (ibv_query_device(ctx, &attr) == 0)
      for (uint8_t p = 1; p <= attr.phys_port_cnt; ++p) {
        ibv_port_attr pa{};
        if (ibv_query_port(ctx, p, &pa) == 0 && pa.state == IBV_PORT_ACTIVE) active = true;
      }
    seen += std::string(seen.empty() ? "" : ", ") + ibv_get_device_name(list[i]);
    ibv_close_device(ctx);
  }
  ibv_free_device_list(list);
  if (!active && reason) *reason = "RDMA devices (" + seen + ") have no active port";
  return active;
}

std::unique_ptr<Transport> make_rdma_transport(const TransportConfig& config) {
  return std::make_unique<RdmaTransport>(config);
}

}  // namespace bytecomp::transport
