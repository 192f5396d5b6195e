#include "daemon/local_reduce.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "compress/reduce.h"

namespace bytecomp::daemon {
namespace {

constexpr uint64_t kBlockBytes = 32 * 1024;

template <class T>
void sum_block(std::span<char* const> bufs, uint64_t b, uint64_t e) {
  const uint64_t n = (e - b) / sizeof(T);
  T* dst = reinterpret_cast<T*>(bufs[0] + b);
  if constexpr (std::is_same_v<T, float>) {
    const float* srcs[64];
    std::vector<const float*> many;
    const float** s = srcs;
    if (bufs.size() - 1 > 64) {
      many.resize(bufs.size() - 1);
      s = many.data();
    }
    for (size_t r = 1; r < bufs.size(); ++r) s[r - 1] = reinterpret_cast<const float*>(bufs[r] + b);
    compress::sum_into(dst, std::span<const float* const>(s, bufs.size() - 1), n);
  } else {
    for (size_t r = 1; r < bufs.size(); ++r) {
      const T* src = reinterpret_cast<const T*>(bufs[r] + b);
      if constexpr (std::is_integral_v<T>) {
        using U = std::make_unsigned_t<T>;
        for (uint64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(U(dst[i]) + U(src[i]));
      } else {
        for (uint64_t i = 0; i < n; ++i) dst[i] += src[i];
      }
    }
  }
}

template <class T>
void reduce_typed(std::span<char* const> bufs, uint64_t begin, uint64_t end, bool copy_out) {
  for (uint64_t b = begin; b < end; b += kBlockBytes) {
    const uint64_t e = std::min(end, b + kBlockBytes);
    sum_block<T>(bufs, b, e);
    if (copy_out) {
      for (size_t r = 1; r < bufs.size(); ++r) std::memcpy(bufs[r] + b, bufs[0] + b, e - b);
    }
  }
}

void dispatch(ipc::DType dtype, std::span<char* const> bufs, uint64_t begin, uint64_t end,
              bool copy_out) {
  if (bufs.size() < 2) return;
  switch (dtype) {
    case ipc::DType::kFloat32: return reduce_typed<float>(bufs, begin, end, copy_out);
    case ipc::DType::kFloat64: return reduce_typed<double>(bufs, begin, end, copy_out);
    case ipc::DType::kInt32: return reduce_typed<int32_t>(bufs, begin, end, copy_out);
    case ipc::DType::kInt64: return reduce_typed<int64_t>(bufs, begin, end, copy_out);
    case ipc::DType::kFloat16:
    case ipc::DType::kBFloat16: return;  // no control-protocol code: never declared
  }
}

}  // namespace

void ShmSimdReducer::reduce(ipc::DType dtype, std::span<char* const> bufs, uint64_t begin,
                            uint64_t end) {
  dispatch(dtype, bufs, begin, end, true);
}

void ShmSimdReducer::sum_to_first(ipc::DType dtype, std::span<char* const> bufs, uint64_t begin,
                                  uint64_t end) {
  dispatch(dtype, bufs, begin, end, false);
}

void ShmSimdReducer::copy_from_first(std::span<char* const> bufs, uint64_t begin, uint64_t end) {
  for (size_t r = 1; r < bufs.size(); ++r) std::memcpy(bufs[r] + begin, bufs[0] + begin, end - begin);
}

}  // namespace bytecomp::daemon
