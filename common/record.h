// Recording of decoder inputs, for the fuzz corpora (tests/fuzz/, docs/reliability.md).
//
// With BYTECOMP_RECORD_INPUTS=DIR in the environment, each decoder of bytes
// from outside the process hands what it is given to record_input(), which
// writes it to DIR/<target>/<FNV-1a of the bytes, hex>: real traffic of a
// test or demo run becomes seed inputs (scripts/fuzz-record turns them into
// each fuzz target's input format). Unset (always, in production), the cost
// is one load of a flag cached at the first call. Each target keeps at most
// kMaxRecordsPerTarget files, so a long run does not fill the disk.
//
// Thread-safety: thread-safe; failures to write are ignored (never throws).
#pragma once

#include <cstddef>
#include <string_view>

namespace bytecomp {

inline constexpr int kMaxRecordsPerTarget = 256;

bool recording_inputs() noexcept;
void record_input_always(std::string_view target, const void* data, size_t size) noexcept;

inline void record_input(std::string_view target, const void* data, size_t size) noexcept {
  if (recording_inputs()) record_input_always(target, data, size);
}

}  // namespace bytecomp
