// libFuzzer target for a server's kStats reply as a client reads it
// (server::proto::decode_stats; bytecompctl and the tests ask servers for
// it). Input: the reply's payload. Error(kMalformed) is a correct
// rejection; a crash, a sanitizer report, another exception, or an accepted
// reply that does not re-encode to the same bytes is a bug.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "common/error.h"
#include "fuzz_common.h"
#include "server/protocol.h"

namespace proto = bytecomp::server::proto;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  proto::Stats s;
  try {
    s = proto::decode_stats(bytes);
  } catch (const bytecomp::Error& e) {
    if (e.code() != bytecomp::ErrorCode::kMalformed) bcfuzz::broken("stats", e.what());
    return 0;
  }
  const auto again = proto::encode(s);
  if (again.size() != size || std::memcmp(again.data(), data, size) != 0)
    bcfuzz::broken("stats", "accepted reply does not re-encode");
  return 0;
}
