#include "transport/transport.h"

#include <sched.h>

#include <future>

#include "transport/zmq/zmq_transport.h"
#if BYTECOMP_TRANSPORT_RDMA
#include "transport/rdma/rdma_transport.h"
#endif

namespace bytecomp::transport {
namespace {

// The bounded spin of TransportConfig::wait_spin for a blocking wrapper
// (see there for what it buys and what it costs). Yields between looks.
template <class T>
void spin_until_ready(std::future<T>& f, std::chrono::microseconds spin) {
  if (spin.count() <= 0) return;
  auto until = Clock::now() + spin;
  while (f.wait_for(std::chrono::seconds(0)) != std::future_status::ready &&
         Clock::now() < until)
    sched_yield();
}

}  // namespace

std::vector<std::string> available_backends() {
  std::vector<std::string> b{"zmq"};
#if BYTECOMP_TRANSPORT_RDMA
  b.push_back("rdma");
#endif
  return b;
}

std::unique_ptr<Transport> make_transport(std::string_view backend, const TransportConfig& config) {
  TransportConfig c = config;
  c.backend = std::string(backend);
  if (backend == "zmq") return make_zmq_transport(c);
#if BYTECOMP_TRANSPORT_RDMA
  if (backend == "rdma") return make_rdma_transport(c);
#endif
  std::string accepted;
  for (const std::string& b : available_backends()) accepted += (accepted.empty() ? "" : ", ") + b;
  throw Error(ErrorCode::kInvalidArgument, "transport: backend '" + std::string(backend) +
                                               "' is not available in this build (accepted: " +
                                               accepted + ")");
}

bool backend_usable(std::string_view backend, std::string* reason) {
  if (backend == "zmq") return true;
#if BYTECOMP_TRANSPORT_RDMA
  if (backend == "rdma") return rdma_device_usable(reason);
#endif
  if (reason) *reason = "backend '" + std::string(backend) + "' is not built in";
  return false;
}

Status Transport::send_wait(NodeId to, Message message) {
  if (on_io_thread())
    return {ErrorCode::kInvalidArgument,
            "send_wait() from an inline handler would wait for its own thread; use send()"};
  auto promise = std::make_shared<std::promise<Status>>();
  std::future<Status> result = promise->get_future();
  send(to, std::move(message), [promise](const Status& s) { promise->set_value(s); });
  spin_until_ready(result, wait_spin());
  if (result.wait_for(wait_bound()) != std::future_status::ready)
    return {ErrorCode::kTimeout, "send to node " + std::to_string(to) + " did not complete within " +
                                     std::to_string(wait_bound().count()) + " ms"};
  return result.get();
}

Response Transport::call(NodeId to, Message message, Millis timeout) {
  if (on_io_thread())
    return {Status(ErrorCode::kInvalidArgument,
                   "call() from an inline handler would wait for its own thread; use request()"),
            to, {}};
  auto promise = std::make_shared<std::promise<Response>>();
  std::future<Response> result = promise->get_future();
  request_for_call(to, std::move(message), timeout,
                   [promise](Response r) { promise->set_value(std::move(r)); });
  spin_until_ready(result, wait_spin());
  if (result.wait_for(wait_bound() + timeout) != std::future_status::ready)
    return {Status(ErrorCode::kTimeout, "request to node " + std::to_string(to) +
                                            " did not complete within its bound"),
            to, {}};
  return result.get();
}

}  // namespace bytecomp::transport
