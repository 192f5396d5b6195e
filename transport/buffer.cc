#include <cstring>

#include "transport/transport.h"

namespace bytecomp::transport {
namespace {

// Runs the caller's release function when the last reference goes.
struct Releaser {
  Releaser() = default;
  Releaser(const Releaser&) = delete;
  Releaser& operator=(const Releaser&) = delete;
  std::function<void()> release;
  ~Releaser() {
    if (release) release();
  }
};

}  // namespace

Buffer Buffer::wrap(const void* data, size_t size, std::function<void()> release) {
  auto owner = std::make_shared<Releaser>();
  owner->release = std::move(release);
  return Buffer(std::move(owner), static_cast<const std::byte*>(data), size, false);
}

Buffer Buffer::take(std::vector<std::byte> bytes) {
  auto owner = std::make_shared<std::vector<std::byte>>(std::move(bytes));
  const std::byte* p = owner->data();
  size_t n = owner->size();
  return Buffer(std::move(owner), p, n, false);
}

Buffer Buffer::take(std::string bytes) {
  auto owner = std::make_shared<std::string>(std::move(bytes));
  const std::byte* p = reinterpret_cast<const std::byte*>(owner->data());
  size_t n = owner->size();
  return Buffer(std::move(owner), p, n, false);
}

Buffer Buffer::copy_of(const void* data, size_t size) {
  Buffer b = allocate_for_overwrite(size);
  if (size > 0) std::memcpy(b.mutable_data(), data, size);
  b.writable_ = false;
  return b;
}

Buffer Buffer::allocate(size_t size) {
  Buffer b = allocate_for_overwrite(size);
  if (size > 0) std::memset(b.mutable_data(), 0, size);  // reads of unwritten bytes stay defined
  return b;
}

Buffer Buffer::allocate_for_overwrite(size_t size) {
  std::shared_ptr<std::byte[]> owner(new std::byte[size == 0 ? 1 : size]);
  const std::byte* p = owner.get();
  return Buffer(std::shared_ptr<const void>(owner, p), p, size, true);
}

std::byte* Buffer::mutable_data() {
  if (!writable_)
    throw Error(ErrorCode::kInvalidArgument,
                "transport: Buffer::mutable_data() on a buffer not made by allocate()");
  return const_cast<std::byte*>(data_);
}

Buffer Buffer::slice(size_t offset, size_t size) const {
  if (offset > size_ || size > size_ - offset)
    throw Error(ErrorCode::kInvalidArgument,
                "transport: Buffer::slice(" + std::to_string(offset) + ", " +
                    std::to_string(size) + ") of a " + std::to_string(size_) + "-byte buffer");
  return Buffer(owner_, data_ + offset, size, false);
}

}  // namespace bytecomp::transport
