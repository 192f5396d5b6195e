#include "daemon/shm_segment.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <boost/interprocess/shared_memory_object.hpp>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "common/error.h"
#include "common/log.h"
#include "common/tmpfs.h"

namespace bi = boost::interprocess;

namespace bytecomp::daemon {

BC_LOG_CATEGORY(LogShm, "daemon.shm");

Segment::Segment(std::string name, uint64_t bytes, uid_t owner_uid, gid_t owner_gid)
    : name_(std::move(name)) {
  try {
    bi::permissions perm(0600);
    bi::shared_memory_object shm(bi::create_only, name_.c_str(), bi::read_write, perm);
    const int fd = shm.get_mapping_handle().handle;
    // Boost applies the mode through the umask-free fchmod on Linux; make
    // sure regardless, then hand the segment to the job's user.
    if (::fchmod(fd, 0600) != 0 ||
        (::geteuid() == 0 && owner_uid != 0 && ::fchown(fd, owner_uid, owner_gid) != 0)) {
      const int err = errno;
      bi::shared_memory_object::remove(name_.c_str());
      throw Error(ErrorCode::kUnavailable,
                  "shared memory '" + name_ + "': setting mode/owner failed: " + std::strerror(err));
    }
    try {
      reserve_tmpfs_pages(fd, bytes,
                          "shared memory '" + name_ + "': reserving " + std::to_string(bytes) +
                              " bytes failed");
    } catch (const Error&) {
      bi::shared_memory_object::remove(name_.c_str());
      throw;
    }
    bi::mapped_region region(shm, bi::read_write, 0, bytes);
    region_.swap(region);
  } catch (const bi::interprocess_exception& e) {
    bi::shared_memory_object::remove(name_.c_str());
    throw Error(ErrorCode::kUnavailable,
                "shared memory '" + name_ + "' of " + std::to_string(bytes) +
                    " bytes: " + e.what());
  }
  BC_LOG(LogShm(), kDebug) << "created " << name_ << " (" << bytes << " bytes)";
}

Segment::~Segment() {
  bi::mapped_region().swap(region_);
  unlink();
}

void Segment::unlink() noexcept {
  if (unlinked_) return;
  unlinked_ = true;
  if (!bi::shared_memory_object::remove(name_.c_str())) {
    BC_LOG(LogShm(), kWarn) << "could not remove shared memory " << name_;
  }
  BC_LOG(LogShm(), kDebug) << "removed " << name_;
}

std::string segment_prefix(const std::string& instance) { return "bytecomp." + instance + "."; }

std::string instance_from_socket(const std::string& socket_path) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : socket_path) {
    h ^= ch;
    h *= 1099511628211ull;
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return std::string(buf, 12);
}

int remove_stale(const std::string& instance) {
  const std::string prefix = segment_prefix(instance);
  int removed = 0;
  std::error_code ec;
  // Boost names POSIX shared memory objects /dev/shm/<name> on Linux.
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const std::string rest = name.substr(prefix.size());
    const auto dot = rest.find('.');
    pid_t pid = 0;
    try {
      pid = static_cast<pid_t>(std::stol(rest.substr(0, dot)));
    } catch (...) {
      continue;  // not one of ours
    }
    const bool alive = pid > 0 && pid != ::getpid() && (::kill(pid, 0) == 0 || errno == EPERM);
    if (alive) continue;
    if (bi::shared_memory_object::remove(name.c_str())) {
      ++removed;
      BC_LOG(LogShm(), kInfo) << "removed stale shared memory " << name << " of dead daemon pid "
                              << pid;
    }
  }
  return removed;
}

}  // namespace bytecomp::daemon
