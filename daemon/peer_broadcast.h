// Broadcast between daemons over the peer hub (bytecomp_broadcast of a
// multi-node job whose daemons all have a peer endpoint; docs/daemon.md
// "Broadcast and barrier"). The root's bytes go down a chain of the job's M
// nodes in ring order from the root's node (root, root + 1, ..., root - 1,
// mod M) in chunks of at most chunk_bytes: each node forwards a chunk to the
// next as soon as it stored it, so the chunks pipeline along the chain, one
// flow per link, and the root sends the bytes once (no fan-out from the
// root, no server on the data path). A broadcast of n bytes over a link of
// rate B takes about n / B + (M - 1) chunk / B, against n (M - 1) / M / B
// for the root's upload alone.
//
// Completion. A round (tensor, iteration) is done on a node once its local
// ranks joined it, every chunk came (and was written into every local
// rank's buffer), every chunk it forwarded was answered, and its downstream
// neighbour reported the round done (kDone, sent upstream by each node once
// it is done; the last node of the chain needs none). So the root finishes
// last, after every node: like the servers' broadcast, a round completes
// only once every node's ranks joined, which bounds what a node holds.
// Consecutive rounds of a tensor may have different roots, so a node can get
// chunks of later rounds while its own round is still open: the root of
// round i + 1 only finished round i, which needs just the nodes after it in
// round i's chain to have finished (e.g. nodes A, B, C, round i from B
// (B, C, A): A finishes at once, its ranks start round i + 1 from A and A's
// chunks reach B while B still waits for C's report). Among the nodes that
// finished round i those that also finished round i + 1 are fewer (the
// root of round i + 1 finished i but finishes i + 1 last), so while one
// node lags at round i, rounds up to i + M - 1 can exist, never i + M. Each
// node therefore keeps, per tensor, its oldest open round and the chunks of
// up to M - 1 later ones (the chain's M nodes): at most M times the
// tensor's bytes, and only while its own ranks lag; data of a round beyond
// that is refused.
//
// Wire format (version 1). One request per (tensor, iteration, chunk) and
// one per (tensor, iteration) for the report upstream:
//   transport header: type kBcastData, aux = job uid, key = tensor id,
//     arg = iteration;
//   payload 0 (48 bytes, little-endian): u16 version | u8 kind (1 data,
//     2 done) | u8 zero | u32 sender node rank | u32 root (the job's
//     global rank) | u32 chunk | u64 broadcast bytes | u64 tag | u64 offset
//     of the chunk | u64 data bytes;
//   payload 1: the chunk's bytes (empty for done).
// The receiver checks the version, kind, reserved byte, both payload sizes,
// the job, that the sender is a node of the job at the rank it claims and
// its neighbour in the chain of the root it names (upstream for data,
// downstream for done), the tensor and that the bytes fit it, that chunk
// and offset are exactly that chunk of the broadcast, that the iteration is
// neither finished nor beyond the M rounds a node holds (above), and
// refuses duplicates;
// the reply is kBcastOk or kBcastError (aux = ErrorCode, payload = the
// reason, which the sender's job aborts with). Root, bytes and tag are
// compared with this node's call (at receipt, or at start() for chunks that
// came early) and between the chunks: a disagreement fails the job naming
// both ("the ranks disagree on the broadcast of tensor ...").
//
// Flow control: each job keeps one FIFO of chunks to send and at most
// `window` (>= 2) of them unanswered; a receiver answers as soon as it
// stored a chunk (into the ranks' buffers, or kept until they join).
//
// Timeouts: a started round that makes no progress (no chunk, answer or
// report) for spec.timeout fails the job naming the neighbour it waits for
// (check_deadlines()); each send waits at most spec.timeout for its answer;
// a neighbour the transport's heartbeats lose fails the job (PeerHub).
//
// Thread-safety: BcastJob is thread-safe. Its callbacks (ready, failure)
// run on the transport's threads or on the thread that called start(); they
// must not block.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/error.h"
#include "transport/transport.h"

namespace bytecomp::daemon {

class PeerHub;

inline constexpr uint16_t kBcastData = 0x5203;
inline constexpr uint16_t kBcastOk = 0x52F4;
inline constexpr uint16_t kBcastError = 0x52F5;
inline constexpr uint16_t kBcastVersion = 1;
inline constexpr size_t kBcastHeaderBytes = 48;
inline constexpr uint64_t kBcastMaxChunkBytes = 1u << 20;

enum class BcastKind : uint8_t { kData = 1, kDone = 2 };

struct BcastHeader {
  uint16_t version = kBcastVersion;
  BcastKind kind = BcastKind::kData;
  uint32_t sender_rank = 0;  // node rank
  uint32_t root = 0;         // the job's global rank of the root process
  uint32_t chunk = 0;
  uint64_t nbytes = 0;  // of the whole broadcast
  uint64_t tag = 0;
  uint64_t offset = 0;      // first byte of the chunk
  uint64_t data_bytes = 0;  // size of payload 1
};

transport::Buffer encode_bcast_header(const BcastHeader& h);
// Throws Error(kMalformed) naming the problem (size, version, kind, reserved byte).
BcastHeader decode_bcast_header(std::span<const std::byte> bytes);

// What the local ranks of a node passed to a broadcast (every rank the same).
struct BcastCall {
  uint32_t root = 0;  // global rank
  uint64_t nbytes = 0;
  uint64_t tag = 0;
  bool operator==(const BcastCall&) const = default;
};
std::string describe(const BcastCall& c);

// Position of the nodes in the chain of a broadcast from `root_node`.
struct BcastChain {
  uint32_t nodes = 1;
  uint32_t root_node = 0;
  uint32_t position(uint32_t node) const { return (node + nodes - root_node) % nodes; }
  uint32_t node_at(uint32_t position) const { return (root_node + position) % nodes; }
  bool last(uint32_t node) const { return position(node) + 1 == nodes; }
  uint32_t upstream(uint32_t node) const { return node_at(position(node) - 1); }
  uint32_t downstream(uint32_t node) const { return node_at(position(node) + 1); }
};

struct BcastJobSpec {
  std::string name;
  uint32_t uid = 0;
  uint32_t rank = 0;                     // this node's rank
  uint32_t local_size = 1;               // ranks per node (global rank / local_size = node)
  std::vector<transport::NodeId> nodes;  // by rank
  std::vector<std::string> addresses;    // by rank (this node's ignored)
  std::vector<std::string> tensor_names;
  std::vector<uint64_t> tensor_bytes;  // the most a broadcast of each may carry
  uint64_t chunk_bytes = kBcastMaxChunkBytes;  // 1 .. kBcastMaxChunkBytes
  uint32_t window = 4;                         // chunks unanswered, >= 2
  std::chrono::milliseconds timeout{30000};
};

class BcastJob {
 public:
  // Round (tensor, iteration) is done on this node (see above).
  using ReadyFn = std::function<void(uint32_t tensor, uint64_t iteration)>;
  // The job cannot go on (neighbour lost, send refused or timed out, bad
  // message, disagreeing nodes). At most once.
  using FailFn = std::function<void(const Status&)>;

  ~BcastJob();
  BcastJob(const BcastJob&) = delete;
  BcastJob& operator=(const BcastJob&) = delete;

  const BcastJobSpec& spec() const { return spec_; }

  // This node's ranks joined round (tensor, iteration). On the root's node
  // `src` holds the call.nbytes bytes to send (sent from there, no copy:
  // they must stay untouched until ready; `keep` is held while the
  // transport refers to them); elsewhere every chunk is copied into each of
  // `dsts` (which must stay valid until ready or close()). Throws
  // Error(kInternal) when the round is not open for it (started twice,
  // finished), Error(kInvalidArgument) when chunks that came early disagree
  // with `call` (the job fails too).
  void start(uint32_t tensor, uint64_t iteration, const BcastCall& call, const char* src,
             std::vector<char*> dsts, std::shared_ptr<const void> keep);
  // Fails the job (and returns the status) when a started round made no
  // progress for spec().timeout.
  Status check_deadlines(std::chrono::steady_clock::time_point now);
  // Unregisters from the hub; no callback runs and no byte is written after
  // it returns. Idempotent.
  void close();

 private:
  friend class PeerHub;
  BcastJob(PeerHub& hub, BcastJobSpec spec, ReadyFn ready, FailFn fail);

  struct Received {
    BcastHeader header;
    transport::Buffer data;
  };
  struct Round {
    uint64_t iteration = 0;
    bool started = false;
    BcastCall call;                    // this node's, once started
    std::optional<BcastCall> seen;     // the first chunk's
    uint32_t seen_from = 0;            // its sender's rank
    std::vector<char*> dsts;
    std::vector<bool> got;             // by chunk (non-root nodes)
    uint64_t received = 0;
    std::vector<Received> early;       // before start()
    uint64_t sending = 0;              // queued or unanswered chunks sent from here
    bool downstream_done = false;
    std::chrono::steady_clock::time_point progress;
  };
  struct Slot {
    int64_t finished = -1;
    // Open rounds by iteration: the oldest (the one this node's ranks are
    // in or join next) and the early chunks of at most M - 1 later ones.
    std::map<uint64_t, Round> rounds;
  };
  struct Out {
    uint32_t tensor = 0;
    uint64_t iteration = 0;
    uint32_t to = 0;  // node rank
    BcastHeader header;
    transport::Buffer data;
  };

  uint64_t chunks(uint64_t nbytes) const;
  std::string who(uint32_t rank) const;
  std::string round_name(uint32_t tensor, uint64_t iteration) const;
  BcastChain chain(uint32_t root) const {
    return {static_cast<uint32_t>(spec_.nodes.size()), root / spec_.local_size};
  }
  // From the hub's handler: Ok or the reason to refuse.
  Status receive(transport::NodeId from, uint64_t tensor, uint64_t iteration, Received r);
  // mu_ held: the chunk's bytes into the round's buffers.
  void apply(Round& round, const Received& r);
  // mu_ held: round `iteration` is done here (see above); finishes it and
  // drops it from the slot (the caller then reports upstream and runs
  // ready_).
  bool take_if_done(Slot& slot, uint64_t iteration);
  // mu_ not held: report upstream (non-root), ready_.
  void done(uint32_t tensor, uint64_t iteration, const BcastCall& call);
  // mu_ held: the disagreement between this node's call and a sender's.
  Status disagree(uint32_t tensor, uint64_t iteration, const BcastCall& mine,
                  const BcastCall& theirs, uint32_t from) const;
  void pump();  // sends what the window allows (mu_ not held)
  void sent(uint32_t tensor, uint64_t iteration);
  void fail(const Status& s);

  PeerHub& hub_;
  const BcastJobSpec spec_;
  ReadyFn ready_;
  FailFn fail_;
  std::mutex mu_;
  bool closed_ = false;            // guarded by mu_
  bool failed_ = false;            // guarded by mu_
  std::vector<Slot> slots_;        // by tensor; guarded by mu_
  std::deque<Out> outq_;           // guarded by mu_
  uint32_t unanswered_ = 0;        // guarded by mu_
  std::weak_ptr<BcastJob> self_;
};

}  // namespace bytecomp::daemon
