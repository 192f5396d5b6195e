// Peer allgather between daemons (`inter: allgather` in the strategy): after
// the intra-node reduce each node's daemon sends its (compressed) partition
// to every other node's daemon, and every daemon decompresses and sums all M
// payloads, its own included, in node-rank order, so every node computes a
// bit-identical result without any parameter server on the data path.
//
// PeerHub is the daemon's side of it: one transport (internode.peer_listen)
// shared by every job, a handler for peer data and the routing to the open
// PeerJobs by job uid (the coordinator's cluster-unique job number); the
// same for the ring allreduce (RingJob) and the broadcast chain (BcastJob). Peers
// are the other daemons of a job, learnt from the coordinator at admission
// (JobInfo::peer_addresses); the transport's heartbeats watch them, and a
// peer lost fails every job it is part of. A peer stays connected after its
// jobs ended (their last replies may still be queued) until it is lost.
//
// Wire format (version 1). One request per (partition, iteration, receiver):
//   transport header: type kPeerData, aux = job uid, key = partition key
//     (tensor << 32 | index), arg = iteration;
//   payload 0 (32 bytes, little-endian): u16 version | u8 format (1 raw
//     fp32, 2 compressed) | u8 zero | u32 sender rank | u64 element count |
//     u64 plan digest | u64 data bytes;
//   payload 1: the data (raw: count * 4 bytes of fp32; compressed: one
//     buffer of the tensor's compressor, self-describing, checked again when
//     decompressed).
// The receiver checks the version, both payload sizes, the job, that the
// sender is a node of the job at the rank it claims, the tensor (an
// allgather tensor), the partition index and its element count, and that
// the iteration is neither finished nor beyond the two rounds a partition
// may have open, and refuses duplicates; the reply is kPeerOk or kPeerError
// (aux = ErrorCode, payload = the reason, which the sender's job aborts
// with). Whether the payload was made by the plan this node runs at that
// iteration (format and digest of the compressor spec) is checked when the
// round is summed: a disagreement fails the job naming both.
//
// Memory: a peer's payload is acknowledged as soon as it is stored, so what
// a node holds for a job is bounded by the protocol, not by the senders'
// bytes-in-flight bound: per partition at most two open rounds (a peer is at
// most one round ahead) of M payloads each, i.e. at most 2 x M x the largest
// payload of each partition (its compressor's max_compressed_bytes, raw: 4
// bytes per element). Acknowledging only once this node has contributed to
// the round would bound it tighter but deadlocks nodes that start partitions
// in different orders, the very pattern the engine's bound must avoid.
//
// Thread-safety: PeerHub and PeerJob are thread-safe. Their callbacks
// (ready, failure, acked) run on the transport's handler or completion threads, or
// on the thread that called contribute(); they must not block.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/error.h"
#include "daemon/peer_broadcast.h"
#include "daemon/ring_allreduce.h"
#include "transport/transport.h"

namespace bytecomp::daemon {

inline constexpr uint16_t kPeerData = 0x5201;
inline constexpr uint16_t kPeerOk = 0x52F0;
inline constexpr uint16_t kPeerError = 0x52F1;
inline constexpr uint16_t kPeerVersion = 1;
inline constexpr size_t kPeerHeaderBytes = 32;

enum class PeerFormat : uint8_t { kRawFp32 = 1, kCompressed = 2 };

struct PeerHeader {
  uint16_t version = kPeerVersion;
  PeerFormat format = PeerFormat::kRawFp32;
  uint32_t sender_rank = 0;
  uint64_t count = 0;        // elements of the partition
  uint64_t plan_digest = 0;  // plan_digest() of the sender's plan
  uint64_t data_bytes = 0;   // size of payload 1
};

transport::Buffer encode_peer_header(const PeerHeader& h);
// Throws Error(kMalformed) naming the problem (size, version, format).
PeerHeader decode_peer_header(std::span<const std::byte> bytes);

// Stable across processes and builds (FNV-1a of the canonical spec text;
// "" = uncompressed).
uint64_t plan_digest(const std::string& canonical_spec);

struct PeerPayload {
  PeerHeader header;
  transport::Buffer data;
};

// What a job's peers are (from the coordinator's admission).
struct PeerJobSpec {
  std::string name;
  uint32_t uid = 0;
  uint32_t rank = 0;                    // this node's rank
  std::vector<transport::NodeId> nodes; // by rank
  std::vector<std::string> addresses;   // by rank (this node's ignored)
  std::vector<std::string> tensor_names;
  // Partitions per tensor: 0 for tensors that do not go to the peers.
  std::vector<uint32_t> partitions;
  // Elements of partition `index` of `tensor` (only for peer tensors).
  std::function<uint64_t(uint32_t tensor, uint32_t index)> partition_count;
  // Bound on waiting for the other nodes' payloads of a round once this
  // node's is in, and on each send's reply.
  std::chrono::milliseconds timeout{30000};
};

class PeerHub;

class PeerJob {
 public:
  // A round of (tensor, index, iteration) has all M payloads: take() them.
  using ReadyFn = std::function<void(uint32_t tensor, uint32_t index, uint64_t iteration)>;
  // The job cannot go on (peer lost, send refused or timed out, ...). At most once.
  using FailFn = std::function<void(const Status&)>;

  ~PeerJob();
  PeerJob(const PeerJob&) = delete;
  PeerJob& operator=(const PeerJob&) = delete;

  const PeerJobSpec& spec() const { return spec_; }
  // Every peer acknowledged receipt of one payload sent by contribute().
  using AckedFn = std::function<void()>;
  // This node's payload of a round: kept as its own contribution and sent to
  // every other node. header.sender_rank is filled in. `acked` (may be null)
  // runs once, when every peer has acknowledged receipt (with one node: at
  // once), whether or not the round is complete; never when a send fails
  // (the job fails instead). The engine releases its bytes-in-flight bound
  // there: holding it until the round completes deadlocks nodes that start
  // partitions in different orders (daemon.md, "bytes in flight").
  void contribute(uint32_t tensor, uint32_t index, uint64_t iteration, PeerHeader header,
                  transport::Buffer data, AckedFn acked = nullptr);
  // The M payloads of a complete round, by rank; the round is then finished
  // (later payloads for it are refused as stale). Throws Error(kInternal)
  // when the round is not complete.
  std::vector<PeerPayload> take(uint32_t tensor, uint32_t index, uint64_t iteration);
  // Fails the job (and returns the status) when a round this node
  // contributed to waited longer than spec().timeout for the others.
  Status check_deadlines(std::chrono::steady_clock::time_point now);
  // Unregisters from the hub and drops every buffer; callbacks stop. Idempotent.
  void close();

 private:
  friend class PeerHub;
  PeerJob(PeerHub& hub, PeerJobSpec spec, ReadyFn ready, FailFn fail);
  // From the hub's handler: Ok or the reason to refuse.
  Status receive(transport::NodeId from, uint64_t key, uint64_t iteration, PeerPayload payload);
  void fail(const Status& s);
  std::string who(uint32_t rank) const;

  struct Slot {
    std::vector<std::optional<PeerPayload>> from;  // by rank
    uint32_t have = 0;
    std::optional<std::chrono::steady_clock::time_point> own_at;
  };
  struct Part {
    int64_t finished = -1;             // latest iteration taken
    std::map<uint64_t, Slot> open;     // by iteration (at most 2)
  };
  Part* part(uint32_t tensor, uint32_t index);  // null when out of range

  PeerHub& hub_;
  const PeerJobSpec spec_;
  ReadyFn ready_;
  FailFn fail_;
  std::mutex mu_;
  bool closed_ = false;  // guarded by mu_
  bool failed_ = false;  // guarded by mu_
  std::vector<std::vector<Part>> parts_;  // guarded by mu_
  std::weak_ptr<PeerJob> self_;
};

class PeerHub {
 public:
  // Creates the transport (config.listen holds internode.peer_listen,
  // config.node_id this daemon's id) and starts dispatch. `park_timeout`:
  // how long broadcast data for a job not open here yet waits for it
  // (open_bcast()). Throws Error.
  explicit PeerHub(const transport::TransportConfig& config,
                   std::chrono::milliseconds park_timeout = std::chrono::milliseconds(30000));
  ~PeerHub();
  PeerHub(const PeerHub&) = delete;
  PeerHub& operator=(const PeerHub&) = delete;

  // This daemon's peer endpoint as other daemons reach it.
  const std::string& address() const { return address_; }
  transport::NodeId self() const;

  // Registers a job (connecting to its peers). Throws Error(kInvalidArgument)
  // when the spec does not fit (a peer without an address, this node not at
  // its rank, the uid already open).
  std::shared_ptr<PeerJob> open(PeerJobSpec spec, PeerJob::ReadyFn ready, PeerJob::FailFn fail);
  // The same for a job's ring allreduce (daemon/ring_allreduce.h); also
  // refuses a chunk size or window out of range.
  std::shared_ptr<RingJob> open_ring(RingJobSpec spec, RingJob::ReadyFn ready,
                                     RingJob::FailFn fail);
  // The same for a job's broadcasts (daemon/peer_broadcast.h), opened by
  // each node at its first broadcast: a node's chunks may reach another
  // before that node opened the job. Such data is parked here unanswered
  // (at most park_timeout, and kMaxParkedBytes in all: beyond, refused) and
  // handed to the job when it opens, on the caller's thread.
  std::shared_ptr<BcastJob> open_bcast(BcastJobSpec spec, BcastJob::ReadyFn ready,
                                       BcastJob::FailFn fail);

  // Refuses the parked broadcast data that waited longer than
  // park_timeout (else data of a job that never opens here would wait
  // unanswered until more broadcast data came). The daemon's run loop calls
  // it at least 4 times a second.
  void tick(std::chrono::steady_clock::time_point now);

  static constexpr size_t kMaxParkedBytes = size_t{64} << 20;
  // How many closed broadcast jobs a hub remembers (each for park_timeout),
  // to refuse their late data at once, naming the job, instead of parking
  // it. Not for longer: a restarted coordinator may reuse a uid.
  static constexpr size_t kClosedRemembered = 256;

 private:
  friend class PeerJob;
  friend class RingJob;
  friend class BcastJob;
  void on_data(transport::Incoming in);
  void on_ring_data(transport::Incoming in);
  void on_bcast_data(transport::Incoming in);
  // Hands a checked broadcast message to its job and answers it.
  void deliver_bcast(const std::shared_ptr<BcastJob>& job, transport::Incoming in,
                     BcastHeader header);
  void on_peer_lost(transport::NodeId id, const Status& s);
  // Checks a job's rank and peer addresses (`inter`: what needs them).
  void check_peers(const std::string& job, uint32_t rank,
                   const std::vector<transport::NodeId>& nodes,
                   const std::vector<std::string>& addresses, const char* inter) const;
  // mu_ held: counts the job's peers in, connecting the new ones.
  void connect_peers(uint32_t rank, const std::vector<transport::NodeId>& nodes,
                     const std::vector<std::string>& addresses);
  // mu_ held: counts the job's peers out, forgetting lost, unused ones.
  void release_peers(const std::vector<transport::NodeId>& peers);
  void unregister(const PeerJob* job, uint32_t uid, const std::vector<transport::NodeId>& peers);
  void unregister_ring(const RingJob* job, uint32_t uid,
                       const std::vector<transport::NodeId>& peers);
  void unregister_bcast(const BcastJob* job, uint32_t uid,
                        const std::vector<transport::NodeId>& peers);
  // mu_ held: refuses (after unlocking: into `expired`) what waited too long.
  void expire_parked(std::chrono::steady_clock::time_point now,
                     std::vector<transport::Incoming>& expired);
  // mu_ not held: refuses what expire_parked() took.
  void refuse_expired(std::vector<transport::Incoming>& expired);
  void refuse(const transport::Incoming& in, ErrorCode code, const std::string& why,
              uint16_t type = kPeerError);

  std::unique_ptr<transport::Transport> tp_;
  std::string address_;
  std::mutex mu_;
  std::map<uint32_t, std::weak_ptr<PeerJob>> jobs_;  // by uid; guarded by mu_
  std::map<uint32_t, std::weak_ptr<RingJob>> rings_;  // by uid; guarded by mu_
  std::map<uint32_t, std::weak_ptr<BcastJob>> bcasts_;  // by uid; guarded by mu_
  struct Parked {
    transport::Incoming in;
    BcastHeader header;
    std::chrono::steady_clock::time_point at;
  };
  const std::chrono::milliseconds park_timeout_;
  std::map<uint32_t, std::vector<Parked>> parked_;  // by uid; guarded by mu_
  size_t parked_bytes_ = 0;                          // guarded by mu_
  struct Closed {
    uint32_t uid = 0;
    std::string name;
    std::chrono::steady_clock::time_point at;
  };
  // Recently closed broadcast jobs, oldest first, at most kClosedRemembered,
  // none older than park_timeout; guarded by mu_.
  std::deque<Closed> closed_bcasts_;
  struct Peer {
    std::string address;
    int jobs = 0;
  };
  std::map<transport::NodeId, Peer> peers_;  // guarded by mu_
};

}  // namespace bytecomp::daemon
