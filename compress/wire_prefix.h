// inspect() for a compressed buffer at the start of a larger region (a
// client-compressed partition written into its tensor's shared buffer,
// daemon/client_payload.h). Beside compressor.h rather than in it so that the
// few callers alone depend on it.
#pragma once

#include <span>

#include "compress/compressor.h"

namespace bytecomp::compress {

// The compressed buffer at the start of `in`, which may continue with other
// bytes: its length comes from the header (WireInfo::total_bytes), checked
// against in.size() before anything else is read; then validated as
// inspect() does. Throws Error(kMalformed).
WireInfo inspect_prefix(std::span<const std::byte> in);

}  // namespace bytecomp::compress
