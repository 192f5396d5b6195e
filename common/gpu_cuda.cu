// Built only when the CUDA toolkit is found (see common/meson.build).
#include <cuda_runtime.h>

#include <string>

#include "bytecomp_build_config.h"
#include "common/gpu.h"

#if BYTECOMP_HAVE_NCCL
#include <nccl.h>
#endif

namespace bytecomp::gpu {

bool built_with_cuda() noexcept { return true; }
bool built_with_nccl() noexcept { return BYTECOMP_HAVE_NCCL != 0; }

int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error for later callers
    return 0;
  }
  return n;
}

std::string describe() {
  int runtime = 0;
  cudaRuntimeGetVersion(&runtime);
  std::string s = "CUDA " + std::to_string(runtime / 1000) + "." +
                  std::to_string((runtime % 1000) / 10) + " runtime, ";
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return s + "no usable device (" + cudaGetErrorString(err) + ")";
  }
  s += std::to_string(n) + " device(s)";
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    s += (i == 0 ? ": " : ", ");
    s += std::string(prop.name) + " (sm_" + std::to_string(prop.major) +
         std::to_string(prop.minor) + ")";
  }
  return s;
}

std::string nccl_version() {
#if BYTECOMP_HAVE_NCCL
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "";
  // NCCL >= 2.9 encodes major*10000 + minor*100 + patch.
  return std::to_string(v / 10000) + "." + std::to_string((v % 10000) / 100) +
         "." + std::to_string(v % 100);
#else
  return "";
#endif
}

}  // namespace bytecomp::gpu
