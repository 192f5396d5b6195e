// Header-only C++ RAII wrapper over the C ABI in bytecomp.h.
//
//   bytecomp::Client client({.job_id = "run7", .local_rank = r, .local_size = n});
//   uint32_t w = client.declare("fc.weight", 1 << 20, BYTECOMP_FLOAT32);
//   client.start();
//   std::span<float> grad = client.buffer<float>(w);
//   ... fill grad ...
//   client.push_pull(w, iteration).wait();
//
// Errors are thrown as bytecomp::ClientError carrying the C status and the
// library's message. A timed-out wait() throws ClientError with status
// BYTECOMP_ERR_TIMEOUT and leaves the operation waitable; try_wait() returns
// false instead of throwing on timeout.
//
// Thread-safety: Client is as thread-safe as the C library (every method may
// be called concurrently, except destruction/close). Operation is a
// thread-bound value: wait on one Operation from one thread at a time.
#pragma once

#include <bytecomp/bytecomp.h>

#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>

namespace bytecomp {

class ClientError : public std::runtime_error {
 public:
  ClientError(bytecomp_status status, const std::string& message)
      : std::runtime_error(std::string(bytecomp_status_name(status)) + ": " + message),
        status_(status) {}
  bytecomp_status status() const noexcept { return status_; }

 private:
  bytecomp_status status_;
};

namespace detail {
inline void check(bytecomp_status s) {
  if (s != BYTECOMP_OK) throw ClientError(s, bytecomp_last_error());
}
}  // namespace detail

// Settings of a client; mirrors bytecomp_connect_options with C++ strings.
struct ClientOptions {
  std::string job_id;
  uint32_t local_rank = 0;
  uint32_t local_size = 1;
  uint32_t node_rank = 0;
  uint32_t num_nodes = 1;
  std::string socket_path;  // empty: $BYTECOMP_SOCKET or the default
  uint32_t connect_timeout_ms = 10000;
};

// One outstanding push_pull. Move-only; dropping it without waiting leaves
// the operation running (the tensor cannot be pushed again until a wait).
class Operation {
 public:
  Operation() = default;
  Operation(bytecomp_client* client, bytecomp_handle handle)
      : client_(client), handle_(handle) {}
  Operation(Operation&& o) noexcept
      : client_(std::exchange(o.client_, nullptr)), handle_(std::exchange(o.handle_, 0)) {}
  Operation& operator=(Operation&& o) noexcept {
    client_ = std::exchange(o.client_, nullptr);
    handle_ = std::exchange(o.handle_, 0);
    return *this;
  }
  Operation(const Operation&) = delete;
  Operation& operator=(const Operation&) = delete;

  bool valid() const noexcept { return handle_ != 0; }
  bytecomp_handle handle() const noexcept { return handle_; }

  // Throws ClientError (also on timeout; the operation then stays waitable).
  void wait(uint32_t timeout_ms = 60000) {
    if (!try_wait(timeout_ms)) {
      throw ClientError(BYTECOMP_ERR_TIMEOUT, bytecomp_last_error());
    }
  }
  // false on timeout; throws on failure.
  bool try_wait(uint32_t timeout_ms) {
    if (handle_ == 0) throw ClientError(BYTECOMP_ERR_STATE, "wait on an empty Operation");
    bytecomp_status s = bytecomp_wait(client_, handle_, timeout_ms);
    if (s == BYTECOMP_ERR_TIMEOUT) return false;
    handle_ = 0;
    detail::check(s);
    return true;
  }
  bool done() const {
    int d = 0;
    detail::check(bytecomp_poll(client_, handle_, &d));
    return d != 0;
  }

 private:
  bytecomp_client* client_ = nullptr;
  bytecomp_handle handle_ = 0;
};

class Client {
 public:
  explicit Client(const ClientOptions& o) {
    bytecomp_connect_options c;
    bytecomp_connect_options_init(&c);
    c.socket_path = o.socket_path.empty() ? nullptr : o.socket_path.c_str();
    c.job_id = o.job_id.c_str();
    c.local_rank = o.local_rank;
    c.local_size = o.local_size;
    c.node_rank = o.node_rank;
    c.num_nodes = o.num_nodes;
    c.connect_timeout_ms = o.connect_timeout_ms;
    detail::check(bytecomp_connect(&c, &client_));
  }
  ~Client() { bytecomp_close(client_); }  // never throws
  Client(Client&& o) noexcept : client_(std::exchange(o.client_, nullptr)) {}
  Client& operator=(Client&& o) noexcept {
    if (this != &o) {
      bytecomp_close(client_);
      client_ = std::exchange(o.client_, nullptr);
    }
    return *this;
  }
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  uint32_t declare(const std::string& name, uint64_t count, bytecomp_dtype dtype,
                   bytecomp_device_type device = BYTECOMP_DEVICE_CPU,
                   int32_t device_index = 0) {
    uint32_t id = 0;
    detail::check(bytecomp_declare_tensor(client_, name.c_str(), count, dtype, device,
                                          device_index, &id));
    return id;
  }
  void start(uint32_t timeout_ms = 30000) { detail::check(bytecomp_start(client_, timeout_ms)); }

  uint32_t tensor_id(const std::string& name) const {
    uint32_t id = 0;
    detail::check(bytecomp_tensor_id(client_, name.c_str(), &id));
    return id;
  }
  std::span<std::byte> bytes(uint32_t tensor) const {
    void* p = nullptr;
    uint64_t n = 0;
    detail::check(bytecomp_tensor_buffer(client_, tensor, &p, &n));
    return {static_cast<std::byte*>(p), static_cast<size_t>(n)};
  }
  // The caller picks T to match the declared dtype.
  template <class T>
  std::span<T> buffer(uint32_t tensor) const {
    std::span<std::byte> b = bytes(tensor);
    return {reinterpret_cast<T*>(b.data()), b.size() / sizeof(T)};
  }

  Operation push_pull(uint32_t tensor, uint64_t iteration) {
    bytecomp_handle h = 0;
    detail::check(bytecomp_push_pull(client_, tensor, iteration, &h));
    return Operation(client_, h);
  }

  // bytecomp_broadcast / bytecomp_barrier (ABI 1.2).
  Operation broadcast(uint32_t tensor, uint64_t iteration, uint32_t root_rank, uint64_t nbytes,
                      uint64_t tag = 0) {
    bytecomp_handle h = 0;
    detail::check(bytecomp_broadcast(client_, tensor, iteration, root_rank, nbytes, tag, &h));
    return Operation(client_, h);
  }
  Operation barrier() {
    bytecomp_handle h = 0;
    detail::check(bytecomp_barrier(client_, &h));
    return Operation(client_, h);
  }

  // Leaves the job now; reports how it ended. The Client is empty afterwards.
  void close() { detail::check(bytecomp_close(std::exchange(client_, nullptr))); }

  bytecomp_client* get() const noexcept { return client_; }

 private:
  bytecomp_client* client_ = nullptr;
};

}  // namespace bytecomp
