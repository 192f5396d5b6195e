#include "common/tmpfs.h"

#include <fcntl.h>

#include <cerrno>
#include <cstring>

#include "common/error.h"

namespace bytecomp {

void reserve_tmpfs_pages(int fd, uint64_t bytes, const std::string& context) {
  // posix_fallocate returns the error instead of setting errno.
  const int err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (err == 0) return;
  throw Error(err == ENOSPC ? ErrorCode::kResourceExhausted : ErrorCode::kUnavailable,
              context + ": " + std::strerror(err) +
                  (err == ENOSPC ? " (/dev/shm is full or too small)" : ""));
}

}  // namespace bytecomp
