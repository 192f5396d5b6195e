// A job's shared-memory segment, owned by the daemon (Boost.Interprocess).
//
// Names are "bytecomp.<instance>.<daemon pid>.<sequence>": the instance
// separates daemons on one machine (derived from the control socket's path
// unless configured), the pid separates a restarted daemon from its crashed
// predecessor, the sequence separates jobs. remove_stale() deletes segments
// of this instance whose daemon pid is no longer alive (or is our own pid,
// reused after a crash); run at start-up.
//
// Thread-safety: Segment is neither thread-safe nor thread-bound; the job
// that owns it serialises access. The mapped bytes are shared with clients.
#pragma once

#include <sys/types.h>

#include <boost/interprocess/mapped_region.hpp>
#include <cstdint>
#include <string>

namespace bytecomp::daemon {

class Segment {
 public:
  // Creates (exclusively), sizes, reserves the pages (so a full /dev/shm is
  // an error now rather than a SIGBUS later), maps and zero-fills. `owner`
  // gets the segment when the daemon runs as root. Throws Error naming the
  // segment and the cause.
  Segment(std::string name, uint64_t bytes, uid_t owner_uid, gid_t owner_gid);
  // Unmaps and unlinks. Clients keep their own mappings until they close.
  ~Segment();
  // Removes the name from /dev/shm now; the mapping stays valid until the
  // object goes (the transport may still be sending from it). Idempotent.
  void unlink() noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  const std::string& name() const { return name_; }
  void* data() const { return region_.get_address(); }
  uint64_t size() const { return region_.get_size(); }

 private:
  std::string name_;
  boost::interprocess::mapped_region region_;
  bool unlinked_ = false;
};

// Segment name prefix of an instance: "bytecomp.<instance>.".
std::string segment_prefix(const std::string& instance);

// A short stable name derived from the socket path (FNV-1a, 12 hex digits).
std::string instance_from_socket(const std::string& socket_path);

// Removes stale segments of `instance` from /dev/shm; returns how many.
int remove_stale(const std::string& instance);

}  // namespace bytecomp::daemon
