// What GPU support this build has and what the machine offers. Lets the
// daemon log its capabilities and lets GPU tests skip cleanly (GTEST_SKIP)
// on machines without a device.
//
// Thread-safety: all functions are thread-safe.
#pragma once

#include <string>

namespace bytecomp::gpu {

// True when built with the CUDA toolkit (meson option `cuda`).
bool built_with_cuda() noexcept;
// True when built with NCCL (meson option `nccl`).
bool built_with_nccl() noexcept;
// Number of usable CUDA devices; 0 without CUDA support, driver or device.
int device_count() noexcept;
// One line for logs: "CUDA 13.0 runtime, 1 device(s): NVIDIA H200 (sm_90)"
// or why there is none ("no CUDA driver: ...").
std::string describe();
// NCCL's version as "2.27.3", or "" when built without NCCL.
std::string nccl_version();

}  // namespace bytecomp::gpu
