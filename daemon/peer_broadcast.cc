#include "daemon/peer_broadcast.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "common/log.h"
#include "common/record.h"
#include "daemon/peer_allgather.h"

namespace bytecomp::daemon {

BC_LOG_CATEGORY(LogBcast, "daemon.broadcast");

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

}  // namespace

Buffer encode_bcast_header(const BcastHeader& h) {
  std::vector<std::byte> b(kBcastHeaderBytes);
  put<uint16_t>(&b[0], h.version);
  put<uint8_t>(&b[2], static_cast<uint8_t>(h.kind));
  put<uint8_t>(&b[3], 0);
  put<uint32_t>(&b[4], h.sender_rank);
  put<uint32_t>(&b[8], h.root);
  put<uint32_t>(&b[12], h.chunk);
  put<uint64_t>(&b[16], h.nbytes);
  put<uint64_t>(&b[24], h.tag);
  put<uint64_t>(&b[32], h.offset);
  put<uint64_t>(&b[40], h.data_bytes);
  return Buffer::take(std::move(b));
}

BcastHeader decode_bcast_header(std::span<const std::byte> b) {
  record_input("broadcast", b.data(), b.size());
  if (b.size() != kBcastHeaderBytes) {
    throw Error(ErrorCode::kMalformed, "broadcast data header is " + std::to_string(b.size()) +
                                           " bytes (expected " +
                                           std::to_string(kBcastHeaderBytes) + ")");
  }
  BcastHeader h;
  h.version = get<uint16_t>(&b[0]);
  if (h.version != kBcastVersion) {
    throw Error(ErrorCode::kMalformed, "broadcast protocol version " + std::to_string(h.version) +
                                           " (accepted: " + std::to_string(kBcastVersion) +
                                           "; run the same bytecompd release on every node)");
  }
  const auto kind = get<uint8_t>(&b[2]);
  if (kind != static_cast<uint8_t>(BcastKind::kData) &&
      kind != static_cast<uint8_t>(BcastKind::kDone)) {
    throw Error(ErrorCode::kMalformed,
                "broadcast message kind " + std::to_string(kind) + " (accepted: 1 data, 2 done)");
  }
  if (get<uint8_t>(&b[3]) != 0) throw Error(ErrorCode::kMalformed, "broadcast data: reserved byte set");
  h.kind = static_cast<BcastKind>(kind);
  h.sender_rank = get<uint32_t>(&b[4]);
  h.root = get<uint32_t>(&b[8]);
  h.chunk = get<uint32_t>(&b[12]);
  h.nbytes = get<uint64_t>(&b[16]);
  h.tag = get<uint64_t>(&b[24]);
  h.offset = get<uint64_t>(&b[32]);
  h.data_bytes = get<uint64_t>(&b[40]);
  return h;
}

std::string describe(const BcastCall& c) {
  char tag[24];
  std::snprintf(tag, sizeof tag, "0x%llx", static_cast<unsigned long long>(c.tag));
  return "root rank " + std::to_string(c.root) + ", " + std::to_string(c.nbytes) + " bytes, tag " +
         tag;
}

// ---------------------------------------------------------------------------
// BcastJob

BcastJob::BcastJob(PeerHub& hub, BcastJobSpec spec, ReadyFn ready, FailFn fail)
    : hub_(hub), spec_(std::move(spec)), ready_(std::move(ready)), fail_(std::move(fail)) {
  slots_.resize(spec_.tensor_names.size());
}

BcastJob::~BcastJob() { close(); }

uint64_t BcastJob::chunks(uint64_t nbytes) const {
  // Chunk 0 always goes (also for 0 bytes): it carries the call every node checks.
  return std::max<uint64_t>(1, (nbytes + spec_.chunk_bytes - 1) / spec_.chunk_bytes);
}

std::string BcastJob::who(uint32_t rank) const {
  return "node " + std::to_string(spec_.nodes.at(rank)) + " (rank " + std::to_string(rank) + ")";
}

std::string BcastJob::round_name(uint32_t tensor, uint64_t iteration) const {
  return "the broadcast of tensor '" + spec_.tensor_names.at(tensor) + "' (iteration " +
         std::to_string(iteration) + ")";
}

void BcastJob::close() {
  {
    std::lock_guard lock(mu_);
    if (closed_) return;
    closed_ = true;
    slots_.clear();
    outq_.clear();
  }
  std::vector<NodeId> peers;
  for (uint32_t r = 0; r < spec_.nodes.size(); ++r) {
    if (r != spec_.rank) peers.push_back(spec_.nodes[r]);
  }
  hub_.unregister_bcast(this, spec_.uid, peers);
}

void BcastJob::fail(const Status& s) {
  {
    std::lock_guard lock(mu_);
    if (closed_ || failed_) return;
    failed_ = true;
  }
  BC_LOG(LogBcast(), kWarn) << "job " << spec_.name << ": " << s.to_string();
  fail_(s);
}

Status BcastJob::disagree(uint32_t tensor, uint64_t iteration, const BcastCall& mine,
                          const BcastCall& theirs, uint32_t from) const {
  return Status(ErrorCode::kInvalidArgument,
                "the ranks disagree on " + round_name(tensor, iteration) + ": the ranks of " +
                    who(spec_.rank) + " passed " + describe(mine) + ", " + who(from) +
                    " sent the broadcast of " + describe(theirs) +
                    " (every rank must make the same call)");
}

void BcastJob::apply(Round& round, const Received& r) {
  if (r.data.empty()) return;
  for (char* d : round.dsts) std::memcpy(d + r.header.offset, r.data.data(), r.data.size());
}

bool BcastJob::take_if_done(Slot& slot, uint64_t iteration) {
  const auto it = slot.rounds.find(iteration);
  if (it == slot.rounds.end()) return false;
  Round& round = it->second;
  if (!round.started || round.sending != 0) return false;
  const BcastChain c = chain(round.call.root);
  const bool root = c.root_node == spec_.rank;
  if (!root && round.received != chunks(round.call.nbytes)) return false;
  if (!c.last(spec_.rank) && !round.downstream_done) return false;
  // Rounds start in order (start()), so this is the oldest one here.
  slot.finished = static_cast<int64_t>(iteration);
  slot.rounds.erase(it);
  return true;
}

void BcastJob::done(uint32_t tensor, uint64_t iteration, const BcastCall& call) {
  const BcastChain c = chain(call.root);
  if (c.root_node != spec_.rank) {
    const uint32_t up = c.upstream(spec_.rank);
    BcastHeader h;
    h.kind = BcastKind::kDone;
    h.sender_rank = spec_.rank;
    h.root = call.root;
    h.nbytes = call.nbytes;
    h.tag = call.tag;
    Message msg;
    msg.header.type = kBcastData;
    msg.header.aux = spec_.uid;
    msg.header.key = tensor;
    msg.header.arg = iteration;
    msg.payloads = {encode_bcast_header(h), Buffer()};
    std::weak_ptr<BcastJob> weak = self_;
    const std::string what = round_name(tensor, iteration);
    hub_.tp_->request(spec_.nodes[up], std::move(msg), spec_.timeout,
                      [weak, up, what](transport::Response resp) {
                        auto job = weak.lock();
                        if (!job) return;
                        Status s = resp.status;
                        if (s.ok() && resp.response.header.type != kBcastOk) {
                          std::string text;
                          for (const Buffer& b : resp.response.payloads) text.append(b.view());
                          s = Status(ErrorCode::kAborted, "refused: " + text);
                        }
                        if (!s.ok()) {
                          job->fail(Status(s.code() == ErrorCode::kOk ? ErrorCode::kAborted
                                                                       : s.code(),
                                           "reporting " + what + " done to the daemon of " +
                                               job->who(up) + " (upstream) failed: " +
                                               s.message()));
                        }
                      });
  }
  ready_(tensor, iteration);
}

void BcastJob::start(uint32_t tensor, uint64_t iteration, const BcastCall& call, const char* src,
                     std::vector<char*> dsts, std::shared_ptr<const void> keep) {
  bool finished = false;
  Status bad;
  {
    std::lock_guard lock(mu_);
    if (closed_) return;
    if (tensor >= slots_.size()) {
      throw Error(ErrorCode::kInternal, "broadcast chain: tensor " + std::to_string(tensor) +
                                            " out of range");
    }
    Slot& slot = slots_[tensor];
    if (static_cast<int64_t>(iteration) <= slot.finished) {
      throw Error(ErrorCode::kInternal,
                  "broadcast chain: " + round_name(tensor, iteration) + " already finished");
    }
    const BcastChain c = chain(call.root);
    const bool root = c.root_node == spec_.rank;
    const auto older = slot.rounds.begin();
    if (older != slot.rounds.end() && older->first < iteration) {
      if (older->second.started) {
        throw Error(ErrorCode::kInternal, "broadcast chain: " + round_name(tensor, iteration) +
                                              " started before " +
                                              round_name(tensor, older->first) + " finished");
      }
      // Chunks of an earlier iteration came from upstream: the nodes' ranks
      // passed other iterations. (Chunks of later ones are kept: see the
      // header on rounds with different roots.)
      bad = Status(ErrorCode::kInvalidArgument,
                   "the ranks disagree on the broadcast of tensor '" + spec_.tensor_names[tensor] +
                       "': the ranks of " + who(spec_.rank) + " passed iteration " +
                       std::to_string(iteration) + ", " + who(older->second.seen_from) +
                       " sent iteration " + std::to_string(older->first) +
                       " (every rank must make the same call)");
    } else {
      Round& round = slot.rounds[iteration];
      round.iteration = iteration;
      if (round.started) {
        throw Error(ErrorCode::kInternal,
                    "broadcast chain: " + round_name(tensor, iteration) + " started twice");
      }
      round.started = true;
      round.call = call;
      round.progress = Clock::now();
      if (round.seen && *round.seen != call) {
        bad = disagree(tensor, iteration, call, *round.seen, round.seen_from);
      } else if (root) {
        const uint64_t n = chunks(call.nbytes);
        for (uint64_t k = 0; k < n; ++k) {
          const uint64_t off = k * spec_.chunk_bytes;
          const uint64_t len = std::min(spec_.chunk_bytes, call.nbytes - std::min(call.nbytes, off));
          Out o;
          o.tensor = tensor;
          o.iteration = iteration;
          o.to = c.downstream(spec_.rank);
          o.header.sender_rank = spec_.rank;
          o.header.root = call.root;
          o.header.chunk = static_cast<uint32_t>(k);
          o.header.nbytes = call.nbytes;
          o.header.tag = call.tag;
          o.header.offset = off;
          o.header.data_bytes = len;
          // Zero-copy: the root's buffer is next written by its client
          // after this round completed, i.e. after every chunk was answered.
          if (len > 0) {
            o.data = keep ? Buffer::wrap(src + off, len, [keep] {}) : Buffer::copy_of(src + off, len);
          }
          outq_.push_back(std::move(o));
          ++round.sending;
        }
      } else {
        round.dsts = std::move(dsts);
        round.got.resize(chunks(call.nbytes), false);
        for (const Received& e : std::exchange(round.early, {})) apply(round, e);
      }
      finished = bad.ok() && take_if_done(slot, iteration);
    }
  }
  if (!bad.ok()) {
    fail(bad);
    throw Error(bad.code(), bad.message());
  }
  pump();
  if (finished) done(tensor, iteration, call);
}

Status BcastJob::receive(NodeId from, uint64_t key, uint64_t iteration, Received r) {
  const uint32_t m = static_cast<uint32_t>(spec_.nodes.size());
  const auto it = std::find(spec_.nodes.begin(), spec_.nodes.end(), from);
  if (it == spec_.nodes.end() || static_cast<uint32_t>(it - spec_.nodes.begin()) == spec_.rank) {
    return Status(ErrorCode::kInvalidArgument, "node " + std::to_string(from) +
                                                   " is not a peer of job '" + spec_.name + "'");
  }
  const auto rank = static_cast<uint32_t>(it - spec_.nodes.begin());
  const BcastHeader& h = r.header;
  // From here on the sender is a node of the job: a refusal also fails the
  // job here (the broadcast cannot complete without what was refused).
  auto refuse = [&](ErrorCode code, const std::string& why) {
    Status s(code, "bad broadcast data from " + who(rank) + ": " + why);
    fail(s);
    return s;
  };
  if (h.sender_rank != rank) {
    return refuse(ErrorCode::kMalformed, "it claims rank " + std::to_string(h.sender_rank));
  }
  if (key >= spec_.tensor_names.size()) {
    return refuse(ErrorCode::kInvalidArgument,
                  "job '" + spec_.name + "' has no tensor #" + std::to_string(key));
  }
  const auto tensor = static_cast<uint32_t>(key);
  const std::string what = round_name(tensor, iteration);
  if (h.root >= m * spec_.local_size) {
    return refuse(ErrorCode::kMalformed, what + ": root rank " + std::to_string(h.root) +
                                             " (the job has ranks 0.." +
                                             std::to_string(m * spec_.local_size - 1) + ")");
  }
  const BcastChain c = chain(h.root);
  const bool data = h.kind == BcastKind::kData;
  if (data ? (c.root_node == spec_.rank || c.upstream(spec_.rank) != rank)
           : (c.last(spec_.rank) || c.downstream(spec_.rank) != rank)) {
    return refuse(ErrorCode::kInvalidArgument,
                  what + ": " + (data ? "data" : "a report") + " from root rank " +
                      std::to_string(h.root) + "'s chain, in which " +
                      (data ? (c.root_node == spec_.rank ? std::string("this node is the root")
                                                         : who(c.upstream(spec_.rank)) +
                                                               " sends to this node")
                            : (c.last(spec_.rank) ? std::string("this node is the last")
                                                  : "this node sends to " +
                                                        who(c.downstream(spec_.rank)))));
  }
  const BcastCall theirs{h.root, h.nbytes, h.tag};
  if (data) {
    if (h.nbytes > spec_.tensor_bytes.at(tensor)) {
      return refuse(ErrorCode::kMalformed, what + ": " + std::to_string(h.nbytes) +
                                               " bytes, the tensor has " +
                                               std::to_string(spec_.tensor_bytes[tensor]));
    }
    const uint64_t off = uint64_t{h.chunk} * spec_.chunk_bytes;
    const uint64_t len = std::min(spec_.chunk_bytes, h.nbytes - std::min(h.nbytes, off));
    if (h.chunk >= chunks(h.nbytes) || h.offset != off || r.data.size() != len) {
      return refuse(ErrorCode::kMalformed,
                    what + ": chunk " + std::to_string(h.chunk) + " at byte " +
                        std::to_string(h.offset) + " with " + std::to_string(r.data.size()) +
                        " bytes (a broadcast of " + std::to_string(h.nbytes) + " bytes in chunks of " +
                        std::to_string(spec_.chunk_bytes) + ")");
    }
  } else if (!r.data.empty()) {
    return refuse(ErrorCode::kMalformed, what + ": a report with " +
                                             std::to_string(r.data.size()) + " bytes of data");
  }
  bool finished = false;
  BcastCall call;
  {
    std::unique_lock lock(mu_);
    if (closed_) return Status(ErrorCode::kUnavailable, "job '" + spec_.name + "' ended here");
    Slot& slot = slots_[tensor];
    std::string why;
    ErrorCode code = ErrorCode::kMalformed;
    if (static_cast<int64_t>(iteration) <= slot.finished) {
      why = what + ": stale, this node finished iteration " + std::to_string(slot.finished);
    } else if (!slot.rounds.count(iteration)) {
      if (!data) {
        why = what + ": reported done before any of its chunks came here";
      } else if (slot.rounds.size() >= m) {
        // At most M rounds of a tensor can be open on a node (header).
        code = ErrorCode::kInvalidArgument;
        std::string open;
        for (const auto& [i, round] : slot.rounds) {
          open += (open.empty() ? "" : ", ") + std::to_string(i);
          if (round.started) open += " (running)";
        }
        why = "the ranks disagree on the broadcast of tensor '" + spec_.tensor_names[tensor] +
              "': " + who(rank) + " sent iteration " + std::to_string(iteration) +
              ", this node has iterations " + open + " open (a job of " + std::to_string(m) +
              " nodes has at most " + std::to_string(m) +
              " rounds of a tensor open on a node; every rank must make the same calls in the "
              "same order)";
      }
    }
    if (why.empty()) {
      Round& round = slot.rounds[iteration];
      round.iteration = iteration;
      if (round.started && round.call != theirs) {
        lock.unlock();
        const Status s = disagree(tensor, iteration, round.call, theirs, rank);
        fail(s);
        return s;
      }
      if (round.seen && *round.seen != theirs) {
        why = what + ": " + describe(theirs) + ", its earlier chunks said " + describe(*round.seen);
      } else if (data) {
        if (!round.seen) {
          round.seen = theirs;
          round.seen_from = rank;
          if (!round.started) round.got.resize(chunks(h.nbytes), false);
        }
        if (round.got[h.chunk]) {
          why = what + ": chunk " + std::to_string(h.chunk) + " sent twice";
        } else {
          round.got[h.chunk] = true;
          ++round.received;
          round.progress = Clock::now();
          if (!c.last(spec_.rank)) {
            Out o;
            o.tensor = tensor;
            o.iteration = iteration;
            o.to = c.downstream(spec_.rank);
            o.header = h;
            o.header.sender_rank = spec_.rank;
            o.data = r.data;  // forwarded as it came (shared, no copy)
            outq_.push_back(std::move(o));
            ++round.sending;
          }
          if (round.started) {
            apply(round, r);
          } else {
            round.early.push_back(std::move(r));
          }
        }
      } else if (round.downstream_done) {
        why = what + ": reported done twice";
      } else {
        round.downstream_done = true;
        round.progress = Clock::now();
      }
    }
    if (!why.empty()) {
      lock.unlock();
      return refuse(code, why);
    }
    call = slot.rounds.at(iteration).call;
    finished = take_if_done(slot, iteration);
  }
  pump();
  if (finished) done(tensor, iteration, call);
  return Status::Ok();
}

void BcastJob::pump() {
  std::vector<Out> go;
  {
    std::lock_guard lock(mu_);
    if (closed_ || failed_) return;
    while (unanswered_ < spec_.window && !outq_.empty()) {
      go.push_back(std::move(outq_.front()));
      outq_.pop_front();
      ++unanswered_;
    }
  }
  std::weak_ptr<BcastJob> weak = self_;
  for (Out& o : go) {
    Message msg;
    msg.header.type = kBcastData;
    msg.header.aux = spec_.uid;
    msg.header.key = o.tensor;
    msg.header.arg = o.iteration;
    msg.payloads = {encode_bcast_header(o.header), std::move(o.data)};
    const std::string what =
        "chunk " + std::to_string(o.header.chunk) + " of " + round_name(o.tensor, o.iteration);
    BC_LOG(LogBcast(), kDebug) << "job " << spec_.name << ": sending " << what;
    hub_.tp_->request(
        spec_.nodes[o.to], std::move(msg), spec_.timeout,
        [weak, to = o.to, what, tensor = o.tensor, iteration = o.iteration](transport::Response resp) {
          auto job = weak.lock();
          if (!job) return;
          Status s = resp.status;
          if (s.ok() && resp.response.header.type != kBcastOk) {
            std::string text;
            for (const Buffer& b : resp.response.payloads) text.append(b.view());
            const uint32_t c = resp.response.header.aux;
            const bool refused = resp.response.header.type == kBcastError;
            const ErrorCode code = refused && c >= 1 && c <= static_cast<uint32_t>(ErrorCode::kInternal)
                                       ? static_cast<ErrorCode>(c)
                                       : ErrorCode::kMalformed;
            s = Status(code, refused ? "refused: " + text
                                     : "unexpected reply type " +
                                           std::to_string(resp.response.header.type));
          }
          if (!s.ok()) {
            job->fail(Status(s.code(), "sending " + what + " to the daemon of " + job->who(to) +
                                           " (downstream) failed: " + s.message()));
            return;
          }
          job->sent(tensor, iteration);
        });
  }
}

void BcastJob::sent(uint32_t tensor, uint64_t iteration) {
  bool finished = false;
  BcastCall call;
  {
    std::lock_guard lock(mu_);
    if (closed_) return;
    if (unanswered_ > 0) --unanswered_;
    Slot& slot = slots_.at(tensor);
    if (const auto it = slot.rounds.find(iteration); it != slot.rounds.end()) {
      Round& round = it->second;
      if (round.sending > 0) --round.sending;
      round.progress = Clock::now();
      call = round.call;
      finished = take_if_done(slot, iteration);
    }
  }
  pump();
  if (finished) done(tensor, iteration, call);
}

Status BcastJob::check_deadlines(Clock::time_point now) {
  Status late;
  {
    std::lock_guard lock(mu_);
    if (closed_ || failed_) return Status::Ok();
    for (uint32_t t = 0; t < slots_.size() && late.ok(); ++t) {
      // Only the oldest round of a tensor can be started (start()).
      if (slots_[t].rounds.empty()) continue;
      const Round& round = slots_[t].rounds.begin()->second;
      if (!round.started || now - round.progress <= spec_.timeout) continue;
      const BcastChain c = chain(round.call.root);
      const uint64_t n = chunks(round.call.nbytes);
      const std::string within = " within " + std::to_string(spec_.timeout.count()) + " ms";
      std::string why;
      if (c.root_node != spec_.rank && round.received < n) {
        why = "no broadcast data from the daemon of " + who(c.upstream(spec_.rank)) +
              " (upstream) for " + round_name(t, round.iteration) + within + " (" +
              std::to_string(round.received) + " of " + std::to_string(n) + " chunks came)";
      } else if (round.sending > 0) {
        why = "the daemon of " + who(c.downstream(spec_.rank)) + " (downstream) did not answer " +
              std::to_string(round.sending) + " chunks of " + round_name(t, round.iteration) + within;
      } else {
        why = "the daemon of " + who(c.downstream(spec_.rank)) + " (downstream) did not report " +
              round_name(t, round.iteration) + " done" + within +
              " (the ranks of a node further down the chain have not joined it)";
      }
      late = Status(ErrorCode::kTimeout, why);
    }
  }
  if (!late.ok()) fail(late);
  return late;
}

}  // namespace bytecomp::daemon
