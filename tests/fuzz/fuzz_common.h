// Shared by the libFuzzer target and its seed writer: input byte 0 picks the
// compressor, the rest is the buffer handed to its decoder.
#pragma once

#include <string>
#include <vector>

namespace bcfuzz {

inline const std::vector<std::string>& specs() {
  static const std::vector<std::string> s = {
      "fp16", "bf16", "randomk:0.05,ef=false", "topk:0.05,ef=false", "dgc:0.05", "signsgd",
      "signum", "efsignsgd", "onebit", "qsgd:16", "qsgd:3", "terngrad"};
  return s;
}

}  // namespace bcfuzz
