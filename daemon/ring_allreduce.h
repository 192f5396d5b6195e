// Ring allreduce between daemons (`inter: allreduce` with compressor none,
// fp16 or bf16; planner/strategy/plan.h's Placement::kRing): after the
// intra-node reduce each partition's node sum goes round the ring of the
// job's M nodes (node rank r sends to r + 1 and receives from r - 1, mod M),
// reduce-scatter then allgather, without any parameter server.
//
// Geometry. A partition of n elements is cut into M segments (segment k is
// elements [k n / M, (k + 1) n / M)), each segment into chunks of at most
// chunk_bytes / 4 elements. There are G = 2 (M - 1) steps; at step g node s
// sends segment
//   (s - g) mod M              for g <  M - 1 (reduce-scatter),
//   (s + 1 - (g - M + 1)) mod M for g >= M - 1 (allgather),
// chunk by chunk. A node adds its own values to every reduce-scatter chunk it
// receives and forwards the sum (the next step); at step M - 2 the sum it
// holds is final: node k - 1 owns segment k. The owner sends the final chunk
// round the ring and every other node copies it (and forwards it unchanged),
// so every node ends with the owner's bits: the reduction order of segment k
// is fixed (x_k, then x_{k+1}, ..., x_{k-1}) and every node's result is
// bit-identical. Chunks pipeline: a chunk is forwarded as soon as it arrived,
// so there is no barrier over the nodes, one flow per direction and no
// fan-in.
//
// Formats. fp32: raw floats. fp16 / bf16: the wire carries 16-bit words; each
// hop converts the incoming partial sum to fp32, adds its own fp32 node sum
// (not rounded) and rounds once when it sends. The owner rounds the final
// sum once more, and keeps the rounded value, so its result equals the
// others'. Rounding per hop: at most one rounding per addition, i.e. no
// worse than summing in fp16 (where every input is rounded as well).
//
// Wire format (version 1). One request per (partition, iteration, step, chunk):
//   transport header: type kRingData, aux = job uid, key = partition key
//     (tensor << 32 | index), arg = iteration;
//   payload 0 (56 bytes, little-endian): u16 version | u8 format (1 fp32,
//     2 fp16, 3 bf16) | u8 zero | u32 sender rank | u32 step | u32 chunk |
//     u64 partition elements | u64 first element of the chunk in the
//     partition | u64 chunk elements | u64 plan digest | u64 data bytes;
//   payload 1: the chunk (elements x 4 or x 2 bytes).
// The receiver checks the version, format, reserved byte, both payload
// sizes, the job, that the sender is its left neighbour at the rank it
// claims, the tensor (a ring tensor) and partition, the partition's element
// count, the step, that chunk, offset and element count are exactly that
// step's chunk, that the iteration is neither finished nor beyond the two
// rounds a partition may have open, and refuses duplicates; the reply is
// kRingOk or kRingError (aux = ErrorCode, payload = the reason, which the
// sender's job aborts with). Format and plan digest are checked against the
// round this node runs (at the receipt, or at start() for chunks that came
// early): a disagreement fails the job naming both.
//
// Flow control: each job keeps one queue of chunks for its right neighbour
// and at most `window` (>= 2) of them unanswered (the link's credit); a
// receiver answers as soon as it stored or summed a chunk, so nothing waits
// on anything but the neighbour's receipt. The queue is ordered by
// iteration, then by tensor id (declaration order: the first layers, which
// the next forward pass needs first, before the later ones that backward
// produced earlier), then in queueing order; so at every hop a partition
// of an earlier tensor overtakes the queued chunks of later ones, behind at
// most `window` chunks already on the link.
//
// Memory: per partition at most two rounds are open (a neighbour is at most
// one round ahead: finishing round i needs every node's contribution to it).
// A round reduces in the caller's buffer (start()'s `sum`) and holds the
// chunks that came before it started (each (step, chunk) at most once: at
// most the 2 (M - 1) segments of the steps, under 8 n bytes for n
// elements) and this node's queued sends for it (each step's chunks at most
// once: under 8 n bytes). So a job holds at most 2 x 16 n = 32 n bytes per
// partition, plus `window` chunks of at most chunk_bytes in the transport.
//
// Timeouts: a started round that receives nothing for spec.timeout fails the
// job naming the silent neighbour (check_deadlines()); each send waits at
// most spec.timeout for its answer; a neighbour the transport's heartbeats
// lose fails the job (PeerHub).
//
// Thread-safety: RingJob is thread-safe. Its callbacks (ready, failure,
// acked) run on the transport's threads or on the thread that called
// start(); they must not block.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "common/error.h"
#include "transport/transport.h"

namespace bytecomp::daemon {

class PeerHub;

inline constexpr uint16_t kRingData = 0x5202;
inline constexpr uint16_t kRingOk = 0x52F2;
inline constexpr uint16_t kRingError = 0x52F3;
inline constexpr uint16_t kRingVersion = 1;
inline constexpr size_t kRingHeaderBytes = 56;
inline constexpr uint64_t kRingMaxChunkBytes = 1u << 20;

enum class RingFormat : uint8_t { kFp32 = 1, kFp16 = 2, kBf16 = 3 };
// Bytes of one element on the wire.
inline size_t ring_wire_size(RingFormat f) { return f == RingFormat::kFp32 ? 4 : 2; }
const char* to_string(RingFormat f);

struct RingHeader {
  uint16_t version = kRingVersion;
  RingFormat format = RingFormat::kFp32;
  uint32_t sender_rank = 0;
  uint32_t step = 0;
  uint32_t chunk = 0;
  uint64_t partition_count = 0;  // elements of the partition
  uint64_t offset = 0;           // first element of the chunk within the partition
  uint64_t count = 0;            // elements of the chunk
  uint64_t plan_digest = 0;      // plan_digest() of the sender's plan
  uint64_t data_bytes = 0;       // size of payload 1
};

transport::Buffer encode_ring_header(const RingHeader& h);
// Throws Error(kMalformed) naming the problem (size, version, format, reserved byte).
RingHeader decode_ring_header(std::span<const std::byte> bytes);

// The ring's geometry for M nodes and partitions of n elements.
struct RingGeometry {
  uint32_t nodes = 1;
  uint64_t chunk_elements = kRingMaxChunkBytes / 4;

  uint32_t steps() const { return 2 * (nodes - 1); }
  // Segment node `sender` sends at `step`.
  uint32_t segment_sent(uint32_t sender, uint32_t step) const;
  uint64_t segment_begin(uint64_t n, uint32_t segment) const;
  uint64_t segment_end(uint64_t n, uint32_t segment) const { return segment_begin(n, segment + 1); }
  uint64_t chunks(uint64_t n, uint32_t segment) const;
  // Elements [first, first + count) of chunk `chunk` of `segment`.
  std::pair<uint64_t, uint64_t> chunk(uint64_t n, uint32_t segment, uint64_t chunk) const;
};

struct RingJobSpec {
  std::string name;
  uint32_t uid = 0;
  uint32_t rank = 0;                     // this node's rank
  std::vector<transport::NodeId> nodes;  // by rank
  std::vector<std::string> addresses;    // by rank (this node's ignored)
  std::vector<std::string> tensor_names;
  // Partitions per tensor: 0 for tensors that do not go round the ring.
  std::vector<uint32_t> partitions;
  // Elements of partition `index` of `tensor` (only for ring tensors).
  std::function<uint64_t(uint32_t tensor, uint32_t index)> partition_count;
  uint64_t chunk_bytes = kRingMaxChunkBytes;  // 64 .. kRingMaxChunkBytes, multiple of 4
  uint32_t window = 4;                        // chunks unanswered per neighbour, >= 2
  std::chrono::milliseconds timeout{30000};
};

class RingJob {
 public:
  // Round (tensor, index, iteration) is complete: every chunk of it came and
  // every chunk this node sent for it was answered. take() its result.
  using ReadyFn = std::function<void(uint32_t tensor, uint32_t index, uint64_t iteration)>;
  // The job cannot go on (neighbour lost, send refused or timed out, bad
  // message). At most once.
  using FailFn = std::function<void(const Status&)>;
  // Every chunk of this node's own first step was answered by the right
  // neighbour (the engine's bytes-in-flight bound is released there).
  using AckedFn = std::function<void()>;

  ~RingJob();
  RingJob(const RingJob&) = delete;
  RingJob& operator=(const RingJob&) = delete;

  const RingJobSpec& spec() const { return spec_; }
  const RingGeometry& geometry() const { return geo_; }

  // Starts this node's part of the round over `sum`, its sum of the
  // partition (count elements of fp32), reduced in place: when the round is
  // complete `sum` holds the result (every node's bits alike). `sum` must
  // stay valid and untouched by the caller until take() or close() (the
  // engine passes rank 0's partition in shared memory: no copy in or out).
  // Throws Error(kInternal) when the round is not open for it (started
  // twice, finished), Error(kInvalidArgument) when the chunks that came
  // early disagree with `format` / `digest` (the job fails too).
  void start(uint32_t tensor, uint32_t index, uint64_t iteration, RingFormat format,
             uint64_t digest, float* sum, uint64_t count, AckedFn acked = nullptr);
  // Finishes a complete round (its result is in start()'s `sum`); the
  // round's later chunks are refused as stale. Throws Error(kInternal) when
  // it is not complete.
  void take(uint32_t tensor, uint32_t index, uint64_t iteration);
  // Fails the job (and returns the status) when a started round received
  // nothing for spec().timeout.
  Status check_deadlines(std::chrono::steady_clock::time_point now);
  // Unregisters from the hub and drops every buffer; callbacks stop. Idempotent.
  void close();

 private:
  friend class PeerHub;
  RingJob(PeerHub& hub, RingJobSpec spec, ReadyFn ready, FailFn fail);

  struct Received {
    RingHeader header;
    transport::Buffer data;
  };
  struct Round {
    bool started = false;
    RingFormat format = RingFormat::kFp32;
    uint64_t digest = 0;
    uint64_t count = 0;
    float* acc = nullptr;  // start()'s sum, reduced in place
    std::vector<std::vector<bool>> got;  // [step][chunk]
    uint64_t expected = 0;
    uint64_t received = 0;
    std::vector<Received> early;  // before start()
    // This node's chunks of the round queued or unanswered: the round is
    // complete only once they are answered too, or a node whose own result
    // is complete could end the job with forwards its neighbour still needs.
    uint64_t sending = 0;
    bool notified = false;  // ready_ ran
    std::chrono::steady_clock::time_point progress;
  };
  struct Part {
    int64_t finished = -1;
    std::map<uint64_t, Round> open;  // by iteration, at most 2
  };
  struct Out {
    uint32_t tensor = 0;
    uint32_t index = 0;
    uint64_t key = 0;
    uint64_t iteration = 0;
    RingHeader header;
    transport::Buffer data;
    std::shared_ptr<std::function<void()>> own_done;  // step 0: counts down to `acked`
  };

  uint32_t left() const;
  uint32_t right() const;
  std::string who(uint32_t rank) const;
  std::string part_name(uint32_t tensor, uint32_t index, uint64_t iteration) const;
  Part* part(uint32_t tensor, uint32_t index);  // mu_ held; null when out of range
  Round& open_round(Part& p, uint64_t iteration, uint64_t count);  // mu_ held
  // From the hub's handler: Ok or the reason to refuse.
  Status receive(transport::NodeId from, uint64_t key, uint64_t iteration, Received r);
  // Sums / copies one chunk into a started round and queues what follows;
  // Ok or the reason the job fails (mu_ held).
  Status apply(uint32_t tensor, uint32_t index, uint64_t iteration, Round& round,
               const Received& r);
  // mu_ held: true once when the round is complete (ready_ is then due).
  static bool newly_complete(Round& round);
  void queue(uint32_t tensor, uint32_t index, uint64_t iteration, Round& round,
             uint32_t step, uint32_t chunk, transport::Buffer data,
             std::shared_ptr<std::function<void()>> own_done = nullptr);  // mu_ held
  void pump();  // sends what the window allows (mu_ not held)
  // A chunk of the round was answered: the window has room.
  void sent(uint32_t tensor, uint32_t index, uint64_t iteration);
  void fail(const Status& s);

  PeerHub& hub_;
  const RingJobSpec spec_;
  const RingGeometry geo_;
  ReadyFn ready_;
  FailFn fail_;
  std::mutex mu_;
  bool closed_ = false;  // guarded by mu_
  bool failed_ = false;  // guarded by mu_
  std::vector<std::vector<Part>> parts_;  // guarded by mu_
  // By (iteration, tensor, partition, queueing sequence): see "Flow control".
  std::map<std::tuple<uint64_t, uint32_t, uint32_t, uint64_t>, Out> outq_;  // guarded by mu_
  uint64_t out_seq_ = 0;                  // guarded by mu_
  uint32_t unanswered_ = 0;               // guarded by mu_
  std::weak_ptr<RingJob> self_;
};

}  // namespace bytecomp::daemon
