#include "server/local_shm.h"

#include <sys/stat.h>
#include <unistd.h>

#include <boost/interprocess/shared_memory_object.hpp>
#include <fstream>

#include "common/error.h"
#include "common/tmpfs.h"

namespace bytecomp::server {

namespace bi = boost::interprocess;

const std::string& host_identity() {
  static const std::string id = [] {
    std::string boot;
    std::ifstream f("/proc/sys/kernel/random/boot_id");
    std::getline(f, boot);
    struct stat st {};
    const std::string ns =
        ::stat("/proc/self/ns/net", &st) == 0 ? std::to_string(st.st_ino) : std::string("?");
    return (boot.empty() ? std::string("?") : boot) + "/" + ns;
  }();
  return id;
}

std::string shm_segment_name(uint32_t uid, uint32_t node, uint32_t server, long pid) {
  return std::string(kShmPrefix) + std::to_string(uid) + "." + std::to_string(node) + "." +
         std::to_string(server) + "." + std::to_string(pid);
}

bool shm_name_matches(const std::string& name, uint32_t uid, uint32_t node) {
  const std::string head =
      std::string(kShmPrefix) + std::to_string(uid) + "." + std::to_string(node) + ".";
  if (name.size() > 128 || name.rfind(head, 0) != 0) return false;
  // The rest: "<server>.<pid>", digits and one dot.
  int dots = 0;
  for (size_t i = head.size(); i < name.size(); ++i) {
    if (name[i] == '.') ++dots;
    else if (name[i] < '0' || name[i] > '9') return false;
  }
  return dots == 1 && name.back() != '.' && name[head.size()] != '.';
}

std::shared_ptr<LocalShm> LocalShm::create(const std::string& name, uint64_t bytes) {
  std::shared_ptr<LocalShm> s(new LocalShm(name, true));
  try {
    bi::permissions perm;
    perm.set_permissions(0600);  // the server runs as the daemon's user, or falls back
    bi::shared_memory_object obj(bi::create_only, name.c_str(), bi::read_write, perm);
    obj.truncate(static_cast<bi::offset_t>(bytes));
    s->region_ = bi::mapped_region(obj, bi::read_write);
    s->size_ = bytes;
    s->object_.swap(obj);
  } catch (const bi::interprocess_exception& e) {
    s->unlink();
    throw Error(ErrorCode::kUnavailable, "cannot create shared memory " + name + " of " +
                                             std::to_string(bytes) + " bytes: " + e.what());
  }
  return s;
}

std::shared_ptr<LocalShm> LocalShm::open(const std::string& name, uint64_t bytes) {
  std::shared_ptr<LocalShm> s(new LocalShm(name, false));
  try {
    bi::shared_memory_object obj(bi::open_only, name.c_str(), bi::read_write);
    bi::offset_t have = 0;
    if (!obj.get_size(have) || static_cast<uint64_t>(have) < bytes)
      throw Error(ErrorCode::kUnavailable, "shared memory " + name + " holds " +
                                               std::to_string(have) + " bytes, not the " +
                                               std::to_string(bytes) + " announced");
    s->region_ = bi::mapped_region(obj, bi::read_write, 0, static_cast<size_t>(bytes));
    s->size_ = bytes;
  } catch (const bi::interprocess_exception& e) {
    throw Error(ErrorCode::kUnavailable, "cannot open shared memory " + name + ": " + e.what());
  }
  return s;
}

void LocalShm::reserve() {
  const int fd = object_.get_mapping_handle().handle;
  if (!owner_ || unlinked_ || fd < 0)
    throw Error(ErrorCode::kInternal, "shared memory " + name_ + ": reserve() after unlink()");
  reserve_tmpfs_pages(
      fd, size_, "cannot reserve shared memory " + name_ + " of " + std::to_string(size_) + " bytes");
}

void LocalShm::unlink() noexcept {
  if (!owner_ || unlinked_) return;
  unlinked_ = true;
  bi::shared_memory_object::remove(name_.c_str());
  bi::shared_memory_object().swap(object_);  // the descriptor: the mapping holds the memory
}

LocalShm::~LocalShm() { unlink(); }

}  // namespace bytecomp::server
