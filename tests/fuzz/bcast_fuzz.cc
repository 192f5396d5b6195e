// libFuzzer target for the broadcast chain's header between daemons
// (daemon::decode_bcast_header). Input: payload 0 of a kBcastData request.
// Error(kMalformed) is a correct rejection; a crash, a sanitizer report,
// another exception, or an accepted header that does not re-encode to the
// same bytes is a bug.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "daemon/peer_broadcast.h"
#include "common/error.h"
#include "fuzz_common.h"

namespace bd = bytecomp::daemon;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::byte> bytes(size);
  if (size) std::memcpy(bytes.data(), data, size);
  bd::BcastHeader h;
  try {
    h = bd::decode_bcast_header(bytes);
  } catch (const bytecomp::Error& e) {
    if (e.code() != bytecomp::ErrorCode::kMalformed) bcfuzz::broken("bcast", e.what());
    return 0;
  }
  const auto again = bd::encode_bcast_header(h);
  if (again.size() != bytes.size() || std::memcmp(again.data(), bytes.data(), size) != 0)
    bcfuzz::broken("bcast", "accepted header does not re-encode");
  return 0;
}
