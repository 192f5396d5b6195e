// Reserving the pages of a POSIX shared-memory object (a tmpfs file), shared
// by the daemon's job segments (daemon/shm_segment.h) and the PS client's
// segments for a colocated server (server/local_shm.h).
#pragma once

#include <cstdint>
#include <string>

namespace bytecomp {

// Reserves `bytes` of `fd` now (posix_fallocate): a full /dev/shm is then
// this error instead of a SIGBUS at the first write of an unbacked page.
// Throws Error(kResourceExhausted) on ENOSPC (the message says /dev/shm is
// full or too small), Error(kUnavailable) otherwise; the message is
// "<context>: <strerror>". Leaves the object's name and descriptor to the
// caller, whose ownership differs.
void reserve_tmpfs_pages(int fd, uint64_t bytes, const std::string& context);

}  // namespace bytecomp
