// The one vocabulary of devices and element types, shared by the client, the
// compressors, the daemon and the server. Header only (the thin client
// includes it without linking common/).
//
// The numeric values below are this header's own; they are no wire format.
// Formats that serialise a dtype keep their own codes through explicit
// conversions (docs/architecture.md, "Wire codes"): the client's control
// protocol (ipc::dtype_to_wire / dtype_from_wire) and the compressed buffer
// format, whose codes for float32, float16 and bfloat16 equal the values here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace bytecomp {

enum class Device : uint8_t { kCpu = 0, kCuda = 1 };

constexpr std::string_view to_string(Device d) noexcept {
  switch (d) {
    case Device::kCpu: return "cpu";
    case Device::kCuda: return "cuda";
  }
  return "unknown-device";
}

enum class DType : uint8_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat64 = 3,
  kInt32 = 4,
  kInt64 = 5,
};
inline constexpr int kNumDTypeValues = 6;

// Bytes per element; 0 for a value outside the enumeration.
constexpr size_t dtype_size(DType d) noexcept {
  switch (d) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kFloat64: return 8;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
  }
  return 0;
}

// "float32", "float16", "bfloat16", "float64", "int32", "int64".
constexpr const char* dtype_name(DType d) noexcept {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat64: return "float64";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
  }
  return "unknown-dtype";
}

constexpr std::string_view to_string(DType d) noexcept { return dtype_name(d); }

}  // namespace bytecomp
