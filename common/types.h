// Vocabulary shared by every layer: where data lives.
#pragma once

#include <cstdint>

namespace bytecomp {

enum class Device : uint8_t { kCpu = 0, kCuda = 1 };

inline const char* to_string(Device d) { return d == Device::kCuda ? "cuda" : "cpu"; }

}  // namespace bytecomp
