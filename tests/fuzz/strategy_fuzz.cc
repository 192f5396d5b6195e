// libFuzzer target for the strategy format (planner::Strategy::parse): the
// daemon reads it from its strategy file, from a client's STRATEGY message
// and from the coordinator's kStrategyUpdate. Input: the YAML text. Any
// bytecomp::Error is a correct rejection; a crash, a sanitizer report,
// another exception (e.g. one of yaml-cpp's), or an accepted strategy whose
// to_yaml() does not parse back to the same text is a bug.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/error.h"
#include "fuzz_common.h"
#include "planner/strategy/strategy.h"

namespace planner = bytecomp::planner;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::string once;
  try {
    once = planner::Strategy::parse(text, "fuzz.yaml").to_yaml();
  } catch (const bytecomp::Error&) {
    return 0;
  }
  try {
    if (planner::Strategy::parse(once, "again.yaml").to_yaml() != once)
      bcfuzz::broken("strategy", "to_yaml() does not parse back to the same text");
  } catch (const bytecomp::Error& e) {
    bcfuzz::broken("strategy", std::string("to_yaml() does not parse back: ") + e.what() +
                                   "\n--- to_yaml():\n" + once);
  }
  return 0;
}
