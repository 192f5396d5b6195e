// Builds without the CUDA toolkit (meson -Dcuda=disabled or no nvcc).
#include "compress/cuda/cuda.h"

namespace bytecomp::compress::cuda {

bool built() noexcept { return false; }
bool supported(std::string_view) noexcept { return false; }

std::unique_ptr<Compressor> make_compressor(const CompressorSpec& canonical, const ParamValues&) {
  throw Error(ErrorCode::kInvalidArgument,
              "compressor '" + canonical.name +
                  "' for device cuda: this build has no CUDA kernels (configure with -Dcuda=enabled "
                  "on a machine with the CUDA toolkit)");
}

AllocStats alloc_stats() noexcept { return {}; }

}  // namespace bytecomp::compress::cuda
