#include "transport/rdma/rdma_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "transport/rdma/rdma_transport_impl.h"

namespace bytecomp::transport {
namespace rdma {

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
  dev_ = std::make_shared<VerbsDevice>();
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

void RdmaTransport::backend_stop() {
  stop_.store(true);
  backend_wakeup();
  if (thread_.joinable()) thread_.join();
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

}  // namespace rdma

using rdma::RdmaTransport;

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
