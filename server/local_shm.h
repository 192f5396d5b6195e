// Shared memory between a node's PS client (bytecompd) and the parameter
// server on the same host: the data path for the partitions that server
// owns, instead of loopback ZeroMQ (docs/server.md, "Local shared memory").
//
// The client creates one segment per job and colocated server, sends its
// name in a kShmAttach request, and unlinks the name as soon as the server
// answered (attached or not): from then on the memory lives exactly as long
// as the two mappings, so a job's end or either process's death releases it
// and /dev/shm keeps no name behind.
//
// Thread-safety: LocalShm is immutable after construction; data() may be
// read and written from any thread (callers order their accesses through
// the push/pull protocol).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>

namespace bytecomp::server {

// Segment names start with this; the server refuses others (it must never
// be talked into mapping a client's or another daemon's segment).
inline constexpr const char* kShmPrefix = "bytecomp-ps.";

// "<boot id>/<network namespace inode>": equal for two processes that share
// a kernel and a network stack. The network namespace counts too so that
// the emulated cluster (one namespace per node, one kernel) keeps its nodes
// apart, as the transport's ipc shortcut does.
const std::string& host_identity();

// "bytecomp-ps.<uid>.<node>.<server>.<pid>": the one name a node may attach
// for a job (the server checks uid and node against the sender).
std::string shm_segment_name(uint32_t uid, uint32_t node, uint32_t server, long pid);
// Whether `name` is what shm_segment_name(uid, node, ...) could return.
bool shm_name_matches(const std::string& name, uint32_t uid, uint32_t node);

class LocalShm {
 public:
  // Client side: creates (exclusively) and sizes `name`, sparse: a server
  // on another host refuses the attach, and reserving the pages for it
  // would zero-fill its share of the model for nothing. Throws
  // Error(kUnavailable) naming the segment and the cause.
  static std::shared_ptr<LocalShm> create(const std::string& name, uint64_t bytes);
  // Client side, once a server attached and before anything is written:
  // reserves the tmpfs pages (posix_fallocate), so a full /dev/shm is an
  // error here, not a SIGBUS at the first write of an unbacked page (pages
  // are still mapped as first touched: no populate). Throws
  // Error(kResourceExhausted) when /dev/shm has no room, else
  // Error(kUnavailable). Needs the name's descriptor: before unlink().
  void reserve();
  // Server side: maps an existing segment read-write; throws
  // Error(kUnavailable) naming it and the cause (absent, permission,
  // smaller than `bytes`).
  static std::shared_ptr<LocalShm> open(const std::string& name, uint64_t bytes);
  ~LocalShm();  // unmaps; unlinks the name if this side created it and did not yet
  LocalShm(const LocalShm&) = delete;
  LocalShm& operator=(const LocalShm&) = delete;

  // Removes the name (the creator does so once the server answered its
  // attach). Idempotent; never throws.
  void unlink() noexcept;

  const std::string& name() const { return name_; }
  std::byte* data() const { return static_cast<std::byte*>(region_.get_address()); }
  uint64_t size() const { return size_; }

 private:
  LocalShm(std::string name, bool owner) : name_(std::move(name)), owner_(owner) {}
  std::string name_;
  bool owner_ = false;
  bool unlinked_ = false;
  uint64_t size_ = 0;
  boost::interprocess::shared_memory_object object_;  // creator, until reserve() or unlink()
  boost::interprocess::mapped_region region_;
};

}  // namespace bytecomp::server
