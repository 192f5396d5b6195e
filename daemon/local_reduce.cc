#include "daemon/local_reduce.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace bytecomp::daemon {
namespace {

constexpr uint64_t kBlockBytes = 32 * 1024;

// dst[i] += src[i]. The one place the element-wise sum lives in the daemon.
// Integers wrap (two's complement) instead of overflowing into UB.
template <class T>
void sum_into(T* __restrict dst, const T* __restrict src, uint64_t n) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    for (uint64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(U(dst[i]) + U(src[i]));
  } else {
    for (uint64_t i = 0; i < n; ++i) dst[i] += src[i];
  }
}

template <class T>
void reduce_typed(std::span<char* const> bufs, uint64_t begin, uint64_t end) {
  for (uint64_t b = begin; b < end; b += kBlockBytes) {
    const uint64_t e = std::min(end, b + kBlockBytes);
    const uint64_t n = (e - b) / sizeof(T);
    T* dst = reinterpret_cast<T*>(bufs[0] + b);
    for (size_t r = 1; r < bufs.size(); ++r) {
      sum_into(dst, reinterpret_cast<const T*>(bufs[r] + b), n);
    }
    for (size_t r = 1; r < bufs.size(); ++r) std::memcpy(bufs[r] + b, dst, e - b);
  }
}

}  // namespace

void reduce_range(ipc::DType dtype, std::span<char* const> bufs, uint64_t begin, uint64_t end) {
  if (bufs.size() < 2) return;
  switch (dtype) {
    case ipc::DType::kFloat32: return reduce_typed<float>(bufs, begin, end);
    case ipc::DType::kFloat64: return reduce_typed<double>(bufs, begin, end);
    case ipc::DType::kInt32: return reduce_typed<int32_t>(bufs, begin, end);
    case ipc::DType::kInt64: return reduce_typed<int64_t>(bufs, begin, end);
  }
}

}  // namespace bytecomp::daemon
