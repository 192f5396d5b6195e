// The RDMA backend's registered memory: the protection domain, the pool of
// registered regions rendezvous receives land in, the cache of registrations
// of callers' payloads, and the slabs of a queue pair's eager slots.
// Internal to transport/rdma/.
#pragma once

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace bytecomp::transport::rdma {

// Protection domain + registered memory, shared with Buffers handed to users
// (they may outlive the transport).
struct VerbsDevice {
  ibv_context* context = nullptr;  // owned by librdmacm
  ibv_pd* pd = nullptr;
  VerbsDevice() = default;
  VerbsDevice(const VerbsDevice&) = delete;
  VerbsDevice& operator=(const VerbsDevice&) = delete;
  ~VerbsDevice();
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
  RegisteredPool(std::shared_ptr<VerbsDevice> dev, uint64_t cache_bytes)
      : dev_(std::move(dev)), cache_bytes_(cache_bytes) {}
  ~RegisteredPool();
  // Returns nullopt (and sets error) when registration fails.
  std::optional<Region> take(size_t bytes, std::string& error);
  void give_back(Region r);
  // A Buffer over the first `bytes` of the region that returns it when released.
  Buffer wrap(Region r, size_t bytes);

 private:
  static void destroy(Region& r);
  std::shared_ptr<VerbsDevice> dev_;
  uint64_t cache_bytes_;
  std::mutex mu_;
  uint64_t cached_ = 0;
  std::map<size_t, std::vector<Region>> free_;
};

// Registrations of callers' payload memory, valid while the Buffer's owner
// lives (so the pages cannot have been freed and reused). Loop thread only.
class RegistrationCache {
 public:
  RegistrationCache(std::shared_ptr<VerbsDevice> dev, uint64_t limit) : dev_(std::move(dev)), limit_(limit) {}
  ~RegistrationCache();
  ibv_mr* get(const Buffer& b, std::string& error);
  void hold(ibv_mr* mr, int delta);

 private:
  struct Entry {
    std::weak_ptr<const void> owner;
    const std::byte* addr;
    size_t len;
    ibv_mr* mr;
    int in_use = 0;
  };
  void sweep();
  std::shared_ptr<VerbsDevice> dev_;
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

}  // namespace bytecomp::transport::rdma
