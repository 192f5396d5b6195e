// The RDMA backend's transport class, shared by its parts (internal; see
// rdma_transport.h for the design):
//   rdma_transport.cc  device and listener setup, the event loop, teardown
//   connection.cc      connection setup and loss: CM events, queue pairs,
//                      the hello handshake, reconnects
//   datapath.cc        send/receive: eager and rendezvous sends, control
//                      messages, credits, completions
//   memory.{h,cc}      registered memory (pool, registration cache, slabs)
//   control.{h,cc}     control header, hello, wr ids, endpoints (no verbs)
#pragma once

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/core.h"
#include "transport/rdma/control.h"
#include "transport/rdma/memory.h"

namespace bytecomp::transport::rdma {

BC_LOG_CATEGORY(LogRdma, "transport.rdma");

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
  std::shared_ptr<VerbsDevice> dev_;
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

}  // namespace bytecomp::transport::rdma
