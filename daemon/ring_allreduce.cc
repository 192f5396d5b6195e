#include "daemon/ring_allreduce.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "common/log.h"
#include "common/record.h"
#include "compress/reduce.h"
#include "daemon/peer_allgather.h"
#include "planner/strategy/partition.h"

namespace bytecomp::daemon {

BC_LOG_CATEGORY(LogRing, "daemon.ring");

using Clock = std::chrono::steady_clock;
using transport::Buffer;
using transport::Message;
using transport::NodeId;

namespace {

template <class T>
void put(std::byte* at, T v) {
  std::memcpy(at, &v, sizeof v);
}
template <class T>
T get(const std::byte* at) {
  T v;
  std::memcpy(&v, at, sizeof v);
  return v;
}

// `n` elements of fp32 as they go on the wire in format `f`.
Buffer encode(RingFormat f, const float* src, uint64_t n) {
  if (f == RingFormat::kFp32) return Buffer::copy_of(src, n * 4);
  Buffer b = Buffer::allocate_for_overwrite(n * 2);
  auto* dst = reinterpret_cast<uint16_t*>(b.mutable_data());
  if (f == RingFormat::kFp16) {
    compress::fp32_to_fp16(dst, src, n);
  } else {
    compress::fp32_to_bf16(dst, src, n);
  }
  return b;
}

// dst = (add ? dst : 0) + the chunk's values, in fp32. The data may be
// unaligned (it is where the transport put it).
void merge(RingFormat f, float* dst, const Buffer& data, uint64_t n, bool add) {
  if (f == RingFormat::kFp32 && !add) {
    std::memcpy(dst, data.data(), n * 4);  // any alignment: no staging copy
    return;
  }
  const size_t align = f == RingFormat::kFp32 ? alignof(float) : alignof(uint16_t);
  std::vector<std::byte> aligned;
  const std::byte* src = data.data();
  if (reinterpret_cast<uintptr_t>(src) % align != 0) {
    aligned.assign(src, src + data.size());
    src = aligned.data();
  }
  if (f == RingFormat::kFp32) {
    compress::sum_into(dst, reinterpret_cast<const float*>(src), n);
    return;
  }
  const auto* h = reinterpret_cast<const uint16_t*>(src);
  if (add) {
    f == RingFormat::kFp16 ? compress::accumulate_fp16(dst, h, n)
                           : compress::accumulate_bf16(dst, h, n);
  } else {
    f == RingFormat::kFp16 ? compress::fp16_to_fp32(dst, h, n) : compress::bf16_to_fp32(dst, h, n);
  }
}

}  // namespace

const char* to_string(RingFormat f) {
  switch (f) {
    case RingFormat::kFp32: return "fp32";
    case RingFormat::kFp16: return "fp16";
    case RingFormat::kBf16: return "bf16";
  }
  return "?";
}

Buffer encode_ring_header(const RingHeader& h) {
  std::vector<std::byte> b(kRingHeaderBytes);
  put<uint16_t>(&b[0], h.version);
  put<uint8_t>(&b[2], static_cast<uint8_t>(h.format));
  put<uint8_t>(&b[3], 0);
  put<uint32_t>(&b[4], h.sender_rank);
  put<uint32_t>(&b[8], h.step);
  put<uint32_t>(&b[12], h.chunk);
  put<uint64_t>(&b[16], h.partition_count);
  put<uint64_t>(&b[24], h.offset);
  put<uint64_t>(&b[32], h.count);
  put<uint64_t>(&b[40], h.plan_digest);
  put<uint64_t>(&b[48], h.data_bytes);
  return Buffer::take(std::move(b));
}

RingHeader decode_ring_header(std::span<const std::byte> b) {
  record_input("ring", b.data(), b.size());
  if (b.size() != kRingHeaderBytes) {
    throw Error(ErrorCode::kMalformed, "ring data header is " + std::to_string(b.size()) +
                                           " bytes (expected " +
                                           std::to_string(kRingHeaderBytes) + ")");
  }
  RingHeader h;
  h.version = get<uint16_t>(&b[0]);
  if (h.version != kRingVersion) {
    throw Error(ErrorCode::kMalformed, "ring protocol version " + std::to_string(h.version) +
                                           " (accepted: " + std::to_string(kRingVersion) +
                                           "; run the same bytecompd release on every node)");
  }
  const auto format = get<uint8_t>(&b[2]);
  if (format < static_cast<uint8_t>(RingFormat::kFp32) ||
      format > static_cast<uint8_t>(RingFormat::kBf16)) {
    throw Error(ErrorCode::kMalformed, "ring data format " + std::to_string(format) +
                                           " (accepted: 1 fp32, 2 fp16, 3 bf16)");
  }
  if (get<uint8_t>(&b[3]) != 0) throw Error(ErrorCode::kMalformed, "ring data: reserved byte set");
  h.format = static_cast<RingFormat>(format);
  h.sender_rank = get<uint32_t>(&b[4]);
  h.step = get<uint32_t>(&b[8]);
  h.chunk = get<uint32_t>(&b[12]);
  h.partition_count = get<uint64_t>(&b[16]);
  h.offset = get<uint64_t>(&b[24]);
  h.count = get<uint64_t>(&b[32]);
  h.plan_digest = get<uint64_t>(&b[40]);
  h.data_bytes = get<uint64_t>(&b[48]);
  return h;
}

// ---------------------------------------------------------------------------
// RingGeometry

uint32_t RingGeometry::segment_sent(uint32_t sender, uint32_t step) const {
  const uint32_t m = nodes;
  if (step < m - 1) return (sender + m - step % m) % m;
  const uint32_t h = step - (m - 1);
  return (sender + 1 + m - h % m) % m;
}

uint64_t RingGeometry::segment_begin(uint64_t n, uint32_t segment) const {
  // floor(n * segment / nodes) without overflow: n = q nodes + r.
  return n / nodes * segment + n % nodes * segment / nodes;
}

uint64_t RingGeometry::chunks(uint64_t n, uint32_t segment) const {
  const uint64_t len = segment_end(n, segment) - segment_begin(n, segment);
  return (len + chunk_elements - 1) / chunk_elements;
}

std::pair<uint64_t, uint64_t> RingGeometry::chunk(uint64_t n, uint32_t segment,
                                                  uint64_t c) const {
  const uint64_t first = segment_begin(n, segment) + c * chunk_elements;
  return {first, std::min(chunk_elements, segment_end(n, segment) - first)};
}

// ---------------------------------------------------------------------------
// RingJob

RingJob::RingJob(PeerHub& hub, RingJobSpec spec, ReadyFn ready, FailFn fail)
    : hub_(hub),
      spec_(std::move(spec)),
      geo_{static_cast<uint32_t>(spec_.nodes.size()), spec_.chunk_bytes / 4},
      ready_(std::move(ready)),
      fail_(std::move(fail)) {
  parts_.resize(spec_.partitions.size());
  for (size_t t = 0; t < parts_.size(); ++t) parts_[t].resize(spec_.partitions[t]);
}

RingJob::~RingJob() { close(); }

uint32_t RingJob::left() const { return (spec_.rank + geo_.nodes - 1) % geo_.nodes; }
uint32_t RingJob::right() const { return (spec_.rank + 1) % geo_.nodes; }

std::string RingJob::who(uint32_t rank) const {
  return "node " + std::to_string(spec_.nodes.at(rank)) + " (rank " + std::to_string(rank) + ")";
}

std::string RingJob::part_name(uint32_t tensor, uint32_t index, uint64_t iteration) const {
  return "tensor '" + spec_.tensor_names.at(tensor) + "' partition " + std::to_string(index) +
         " (iteration " + std::to_string(iteration) + ")";
}

RingJob::Part* RingJob::part(uint32_t tensor, uint32_t index) {
  if (tensor >= parts_.size() || index >= parts_[tensor].size()) return nullptr;
  return &parts_[tensor][index];
}

RingJob::Round& RingJob::open_round(Part& p, uint64_t iteration, uint64_t count) {
  auto [it, fresh] = p.open.try_emplace(iteration);
  Round& r = it->second;
  if (fresh) {
    r.count = count;
    r.got.resize(geo_.steps());
    for (uint32_t g = 0; g < geo_.steps(); ++g) {
      r.got[g].assign(geo_.chunks(count, geo_.segment_sent(left(), g)), false);
      r.expected += r.got[g].size();
    }
  }
  return r;
}

void RingJob::close() {
  {
    std::lock_guard lock(mu_);
    if (closed_) return;
    closed_ = true;
    parts_.clear();
    outq_.clear();
  }
  std::vector<NodeId> peers;
  for (uint32_t r = 0; r < spec_.nodes.size(); ++r) {
    if (r != spec_.rank) peers.push_back(spec_.nodes[r]);
  }
  hub_.unregister_ring(this, spec_.uid, peers);
}

void RingJob::fail(const Status& s) {
  {
    std::lock_guard lock(mu_);
    if (closed_ || failed_) return;
    failed_ = true;
  }
  BC_LOG(LogRing(), kWarn) << "job " << spec_.name << ": " << s.to_string();
  fail_(s);
}

bool RingJob::newly_complete(Round& round) {
  if (round.notified || !round.started || round.received != round.expected || round.sending != 0)
    return false;
  round.notified = true;
  return true;
}

void RingJob::queue(uint32_t tensor, uint32_t index, uint64_t iteration, Round& round,
                    uint32_t step, uint32_t chunk, Buffer data,
                    std::shared_ptr<std::function<void()>> own_done) {
  const uint32_t seg = geo_.segment_sent(spec_.rank, step);
  const auto [first, n] = geo_.chunk(round.count, seg, chunk);
  Out o;
  o.tensor = tensor;
  o.index = index;
  o.key = strategy::partition_key(tensor, index);
  o.iteration = iteration;
  o.header.format = round.format;
  o.header.sender_rank = spec_.rank;
  o.header.step = step;
  o.header.chunk = chunk;
  o.header.partition_count = round.count;
  o.header.offset = first;
  o.header.count = n;
  o.header.plan_digest = round.digest;
  o.header.data_bytes = data.size();
  o.data = std::move(data);
  o.own_done = std::move(own_done);
  outq_.emplace(std::make_tuple(iteration, tensor, index, out_seq_++), std::move(o));
  ++round.sending;
}

Status RingJob::apply(uint32_t tensor, uint32_t index, uint64_t iteration, Round& round,
                      const Received& r) {
  const RingHeader& h = r.header;
  if (h.format != round.format || h.plan_digest != round.digest) {
    return Status(ErrorCode::kInvalidArgument,
                  who(left()) + " sent " + part_name(tensor, index, iteration) + " as " +
                      to_string(h.format) + " under plan digest " +
                      std::to_string(h.plan_digest) + ", this node runs it as " +
                      to_string(round.format) + " under " + std::to_string(round.digest) +
                      " (the nodes disagree on the tensor's strategy at this iteration)");
  }
  const uint32_t m = geo_.nodes;
  float* dst = round.acc + h.offset;
  if (h.step < m - 1) {
    // Reduce-scatter: the partial sum from the left plus this node's values.
    merge(round.format, dst, r.data, h.count, true);
    Buffer out = encode(round.format, dst, h.count);
    // At step m - 2 the sum is final here: keep exactly what the others get.
    if (h.step == m - 2 && round.format != RingFormat::kFp32) {
      merge(round.format, dst, out, h.count, false);
    }
    queue(tensor, index, iteration, round, h.step + 1, h.chunk, std::move(out));
  } else {
    // Allgather: the owner's final values, forwarded as they came.
    merge(round.format, dst, r.data, h.count, false);
    if (h.step + 1 < geo_.steps()) queue(tensor, index, iteration, round, h.step + 1, h.chunk, r.data);
  }
  round.progress = Clock::now();
  ++round.received;
  return Status::Ok();
}

void RingJob::start(uint32_t tensor, uint32_t index, uint64_t iteration, RingFormat format,
                    uint64_t digest, float* sum, uint64_t count, AckedFn acked) {
  bool complete = false;
  bool acked_now = false;
  Status bad;
  {
    std::lock_guard lock(mu_);
    if (closed_) return;
    Part* p = part(tensor, index);
    if (p == nullptr || static_cast<int64_t>(iteration) <= p->finished) {
      throw Error(ErrorCode::kInternal,
                  "ring allreduce: " + part_name(tensor, index, iteration) + " is not an open round");
    }
    const uint64_t expect = spec_.partition_count(tensor, index);
    if (count != expect) {
      throw Error(ErrorCode::kInternal, "ring allreduce: " + part_name(tensor, index, iteration) +
                                            " started with " + std::to_string(count) +
                                            " elements, it has " + std::to_string(expect));
    }
    if (p->open.size() >= 2 && p->open.find(iteration) == p->open.end()) {
      throw Error(ErrorCode::kInternal, "ring allreduce: " + part_name(tensor, index, iteration) +
                                            " started with two rounds open");
    }
    Round& round = open_round(*p, iteration, count);
    if (round.started) {
      throw Error(ErrorCode::kInternal,
                  "ring allreduce: " + part_name(tensor, index, iteration) + " started twice");
    }
    round.started = true;
    round.format = format;
    round.digest = digest;
    round.acc = sum;
    round.progress = Clock::now();
    // This node's own segment is the first step's.
    const uint32_t own = geo_.segment_sent(spec_.rank, 0);
    const uint64_t chunks = geo_.nodes > 1 ? geo_.chunks(count, own) : 0;
    if (chunks == 0) {
      acked_now = true;
    } else {
      auto left_to_ack = std::make_shared<std::atomic<uint64_t>>(chunks);
      auto done = std::make_shared<std::function<void()>>([left_to_ack, acked] {
        if (left_to_ack->fetch_sub(1) == 1 && acked) acked();
      });
      for (uint64_t c = 0; c < chunks; ++c) {
        const auto [first, n] = geo_.chunk(count, own, c);
        queue(tensor, index, iteration, round, 0, static_cast<uint32_t>(c),
              encode(format, round.acc + first, n), done);
      }
    }
    for (const Received& e : std::exchange(round.early, {})) {
      bad = apply(tensor, index, iteration, round, e);
      if (!bad.ok()) break;
    }
    complete = bad.ok() && newly_complete(round);
  }
  if (acked_now && acked) acked();
  if (!bad.ok()) {
    fail(bad);
    throw Error(bad.code(), bad.message());
  }
  pump();
  if (complete) ready_(tensor, index, iteration);
}

Status RingJob::receive(NodeId from, uint64_t key, uint64_t iteration, Received r) {
  const auto it = std::find(spec_.nodes.begin(), spec_.nodes.end(), from);
  if (it == spec_.nodes.end() || static_cast<uint32_t>(it - spec_.nodes.begin()) == spec_.rank) {
    return Status(ErrorCode::kInvalidArgument, "node " + std::to_string(from) +
                                                   " is not a peer of job '" + spec_.name + "'");
  }
  const auto rank = static_cast<uint32_t>(it - spec_.nodes.begin());
  if (rank != left()) {
    return Status(ErrorCode::kInvalidArgument,
                  who(rank) + " is not the left neighbour of rank " + std::to_string(spec_.rank) +
                      " in the ring of job '" + spec_.name + "' (" + who(left()) + " is)");
  }
  const RingHeader& h = r.header;
  // From here on the sender is this node's neighbour: a refusal also fails
  // the job here (the ring cannot complete without the refused chunk).
  auto refuse = [&](ErrorCode code, const std::string& why) {
    Status s(code, "bad ring data from " + who(rank) + ": " + why);
    fail(s);
    return s;
  };
  if (h.sender_rank != rank) {
    return refuse(ErrorCode::kMalformed, "it claims rank " + std::to_string(h.sender_rank));
  }
  const uint32_t tensor = strategy::partition_tensor(key);
  const uint32_t index = strategy::partition_index(key);
  bool complete = false;
  Status bad;
  {
    std::unique_lock lock(mu_);
    if (closed_) return Status(ErrorCode::kUnavailable, "job '" + spec_.name + "' ended here");
    Part* p = part(tensor, index);
    if (p == nullptr) {
      lock.unlock();
      return refuse(ErrorCode::kInvalidArgument,
                    "job '" + spec_.name + "' has no ring partition " + std::to_string(index) +
                        " of tensor #" + std::to_string(tensor));
    }
    const std::string what = part_name(tensor, index, iteration);
    const uint64_t count = spec_.partition_count(tensor, index);
    std::string why;
    if (h.partition_count != count) {
      why = what + ": " + std::to_string(h.partition_count) + " elements sent, the partition has " +
            std::to_string(count);
    } else if (h.step >= geo_.steps()) {
      why = what + ": step " + std::to_string(h.step) + " (a ring of " +
            std::to_string(geo_.nodes) + " nodes has " + std::to_string(geo_.steps()) + ")";
    } else {
      const uint32_t seg = geo_.segment_sent(rank, h.step);
      const uint64_t chunks = geo_.chunks(count, seg);
      const auto [first, n] = h.chunk < chunks ? geo_.chunk(count, seg, h.chunk)
                                               : std::pair<uint64_t, uint64_t>{0, 0};
      if (h.chunk >= chunks) {
        why = what + ": chunk " + std::to_string(h.chunk) + " of step " + std::to_string(h.step) +
              " (segment " + std::to_string(seg) + " has " + std::to_string(chunks) + ")";
      } else if (h.offset != first || h.count != n) {
        why = what + ": chunk " + std::to_string(h.chunk) + " of step " + std::to_string(h.step) +
              " is elements [" + std::to_string(first) + ", " + std::to_string(first + n) +
              "), not [" + std::to_string(h.offset) + ", +" + std::to_string(h.count) + ")";
      } else if (r.data.size() != n * ring_wire_size(h.format)) {
        why = what + ": " + std::to_string(r.data.size()) + " bytes of " + to_string(h.format) +
              " for " + std::to_string(n) + " elements";
      }
    }
    if (why.empty() && static_cast<int64_t>(iteration) <= p->finished) {
      why = what + ": stale, this node finished iteration " + std::to_string(p->finished);
    }
    if (why.empty() && p->open.find(iteration) == p->open.end() && p->open.size() >= 2) {
      why = what + ": too far ahead (rounds " + std::to_string(p->open.begin()->first) + " and " +
            std::to_string(p->open.rbegin()->first) + " are open)";
    }
    Round* round = why.empty() ? &open_round(*p, iteration, count) : nullptr;
    if (round != nullptr && round->got[h.step][h.chunk]) {
      why = what + ": step " + std::to_string(h.step) + " chunk " + std::to_string(h.chunk) +
            " sent twice";
    }
    if (!why.empty()) {
      lock.unlock();
      return refuse(ErrorCode::kMalformed, why);
    }
    round->got[h.step][h.chunk] = true;
    BC_LOG(LogRing(), kDebug) << "job " << spec_.name << ": received step " << h.step << " chunk "
                              << h.chunk << " of " << what << (round->started ? "" : " (early)");
    if (!round->started) {
      round->early.push_back(std::move(r));
      return Status::Ok();
    }
    bad = apply(tensor, index, iteration, *round, r);
    complete = bad.ok() && newly_complete(*round);
  }
  if (!bad.ok()) {
    fail(bad);
    return bad;
  }
  pump();
  if (complete) ready_(tensor, index, iteration);
  return Status::Ok();
}

void RingJob::pump() {
  std::vector<Out> go;
  {
    std::lock_guard lock(mu_);
    if (closed_ || failed_) return;
    while (unanswered_ < spec_.window && !outq_.empty()) {
      auto first = outq_.begin();
      go.push_back(std::move(first->second));
      outq_.erase(first);
      ++unanswered_;
    }
  }
  const uint32_t to = right();
  std::weak_ptr<RingJob> weak = self_;
  for (Out& o : go) {
    Message msg;
    msg.header.type = kRingData;
    msg.header.aux = spec_.uid;
    msg.header.key = o.key;
    msg.header.arg = o.iteration;
    msg.payloads = {encode_ring_header(o.header), std::move(o.data)};
    const std::string what = "step " + std::to_string(o.header.step) + " chunk " +
                             std::to_string(o.header.chunk) + " of " +
                             part_name(strategy::partition_tensor(o.key),
                                       strategy::partition_index(o.key), o.iteration);
    BC_LOG(LogRing(), kDebug) << "job " << spec_.name << ": sending " << what;
    hub_.tp_->request(
        spec_.nodes[to], std::move(msg), spec_.timeout,
        [weak, to, what, tensor = o.tensor, index = o.index, iteration = o.iteration,
         done = std::move(o.own_done)](transport::Response resp) {
          auto job = weak.lock();
          if (!job) return;
          Status s = resp.status;
          if (s.ok() && resp.response.header.type != kRingOk) {
            std::string text;
            for (const Buffer& b : resp.response.payloads) text.append(b.view());
            const uint32_t c = resp.response.header.aux;
            const bool refused = resp.response.header.type == kRingError;
            const ErrorCode code = refused && c >= 1 && c <= static_cast<uint32_t>(ErrorCode::kInternal)
                                       ? static_cast<ErrorCode>(c)
                                       : ErrorCode::kMalformed;
            s = Status(code, refused ? "refused: " + text
                                     : "unexpected reply type " +
                                           std::to_string(resp.response.header.type));
          }
          if (!s.ok()) {
            job->fail(Status(s.code(), "sending " + what + " to the daemon of " + job->who(to) +
                                           " (the ring's right neighbour) failed: " + s.message()));
            return;
          }
          BC_LOG(LogRing(), kDebug) << "job " << job->spec_.name << ": answered " << what;
          if (done) (*done)();
          job->sent(tensor, index, iteration);
        });
  }
}

void RingJob::sent(uint32_t tensor, uint32_t index, uint64_t iteration) {
  bool complete = false;
  {
    std::lock_guard lock(mu_);
    if (closed_) return;
    if (unanswered_ > 0) --unanswered_;
    if (Part* p = part(tensor, index)) {
      if (auto it = p->open.find(iteration); it != p->open.end()) {
        if (it->second.sending > 0) --it->second.sending;
        complete = newly_complete(it->second);
      }
    }
  }
  pump();
  if (complete) ready_(tensor, index, iteration);
}

void RingJob::take(uint32_t tensor, uint32_t index, uint64_t iteration) {
  std::lock_guard lock(mu_);
  if (closed_) throw Error(ErrorCode::kUnavailable, "job '" + spec_.name + "' ended");
  Part* p = part(tensor, index);
  auto s = p == nullptr ? decltype(p->open)::iterator{} : p->open.find(iteration);
  if (p == nullptr || s == p->open.end() || !s->second.notified) {
    throw Error(ErrorCode::kInternal,
                "ring allreduce: " + part_name(tensor, index, iteration) + " incomplete");
  }
  p->open.erase(s);
  p->finished = std::max(p->finished, static_cast<int64_t>(iteration));
}

Status RingJob::check_deadlines(Clock::time_point now) {
  Status late;
  {
    std::lock_guard lock(mu_);
    if (closed_ || failed_) return Status::Ok();
    for (uint32_t t = 0; t < parts_.size() && late.ok(); ++t) {
      for (uint32_t i = 0; i < parts_[t].size() && late.ok(); ++i) {
        for (const auto& [iteration, round] : parts_[t][i].open) {
          if (!round.started || round.received == round.expected ||
              now - round.progress <= spec_.timeout) {
            continue;
          }
          late = Status(ErrorCode::kTimeout,
                        "no ring data from " + who(left()) + " (the left neighbour) for " +
                            part_name(t, i, iteration) + " within " +
                            std::to_string(spec_.timeout.count()) + " ms (" +
                            std::to_string(round.received) + " of " +
                            std::to_string(round.expected) + " chunks came)");
          break;
        }
      }
    }
  }
  if (!late.ok()) fail(late);
  return late;
}

}  // namespace bytecomp::daemon
