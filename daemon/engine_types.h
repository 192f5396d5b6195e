// Small value types shared by the engine and the plan builder.
#pragma once

#include <cstdint>
#include <string>

#include "client/ipc/protocol.h"

namespace bytecomp::daemon {

struct TensorSpec {
  std::string name;
  uint64_t count = 0;
  ipc::DType dtype = ipc::DType::kFloat32;
  uint64_t bytes = 0;
};

}  // namespace bytecomp::daemon
