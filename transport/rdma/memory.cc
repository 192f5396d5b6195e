#include "transport/rdma/memory.h"

#include <cstdlib>

#include "transport/rdma/control.h"

namespace bytecomp::transport::rdma {

VerbsDevice::~VerbsDevice() {
  if (pd) ibv_dealloc_pd(pd);
}

RegisteredPool::~RegisteredPool() {
  for (auto& [size, list] : free_)
    for (Region& r : list) destroy(r);
}

std::optional<RegisteredPool::Region> RegisteredPool::take(size_t bytes, std::string& error) {
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

void RegisteredPool::give_back(Region r) {
  std::lock_guard lock(mu_);
  if (cached_ + r.size > cache_bytes_) {
    destroy(r);
    return;
  }
  cached_ += r.size;
  free_[r.size].push_back(r);
}

Buffer RegisteredPool::wrap(Region r, size_t bytes) {
  auto self = shared_from_this();
  return Buffer::wrap(r.mem, bytes, [self, r] { self->give_back(r); });
}

void RegisteredPool::destroy(Region& r) {
  if (r.mr) ibv_dereg_mr(r.mr);
  std::free(r.mem);
}

RegistrationCache::~RegistrationCache() {
  for (Entry& e : entries_) ibv_dereg_mr(e.mr);
}

ibv_mr* RegistrationCache::get(const Buffer& b, std::string& error) {
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

void RegistrationCache::hold(ibv_mr* mr, int delta) {
  for (Entry& e : entries_)
    if (e.mr == mr) e.in_use += delta;
}

void RegistrationCache::sweep() {
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

}  // namespace bytecomp::transport::rdma
