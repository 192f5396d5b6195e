// Built when the CUDA toolkit is absent or disabled (-Dcuda=disabled).
#include "common/gpu.h"

namespace bytecomp::gpu {

bool built_with_cuda() noexcept { return false; }
bool built_with_nccl() noexcept { return false; }
int device_count() noexcept { return 0; }
std::string describe() { return "built without CUDA (meson option cuda disabled or toolkit absent)"; }
std::string nccl_version() { return ""; }

}  // namespace bytecomp::gpu
