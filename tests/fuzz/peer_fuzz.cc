// libFuzzer target for the peer-allgather payload header between daemons
// (daemon::decode_peer_header). Input: payload 0 of a kPeerData request.
// Error(kMalformed) is a correct rejection; a crash, a sanitizer report,
// another exception, or an accepted header that does not re-encode to the
// same bytes is a bug.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "daemon/peer_allgather.h"
#include "common/error.h"
#include "fuzz_common.h"

namespace bd = bytecomp::daemon;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::byte> bytes(size);
  if (size) std::memcpy(bytes.data(), data, size);
  bd::PeerHeader h;
  try {
    h = bd::decode_peer_header(bytes);
  } catch (const bytecomp::Error& e) {
    if (e.code() != bytecomp::ErrorCode::kMalformed) bcfuzz::broken("peer", e.what());
    return 0;
  }
  const auto again = bd::encode_peer_header(h);
  if (again.size() != bytes.size() || std::memcmp(again.data(), bytes.data(), size) != 0)
    bcfuzz::broken("peer", "accepted header does not re-encode");
  return 0;
}
