#include "daemon/peer_allgather.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "common/log.h"
#include "common/record.h"
#include "planner/strategy/partition.h"

namespace bytecomp::daemon {

BC_LOG_CATEGORY(LogPeer, "daemon.peer");

using Clock = std::chrono::steady_clock;
using transport::Buffer;
using transport::Incoming;
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

std::string part_name(const PeerJobSpec& s, uint32_t tensor, uint32_t index, uint64_t iteration) {
  return "tensor '" + s.tensor_names.at(tensor) + "' partition " + std::to_string(index) +
         " (iteration " + std::to_string(iteration) + ")";
}

}  // namespace

Buffer encode_peer_header(const PeerHeader& h) {
  std::vector<std::byte> b(kPeerHeaderBytes);
  put<uint16_t>(&b[0], h.version);
  put<uint8_t>(&b[2], static_cast<uint8_t>(h.format));
  put<uint8_t>(&b[3], 0);
  put<uint32_t>(&b[4], h.sender_rank);
  put<uint64_t>(&b[8], h.count);
  put<uint64_t>(&b[16], h.plan_digest);
  put<uint64_t>(&b[24], h.data_bytes);
  return Buffer::take(std::move(b));
}

PeerHeader decode_peer_header(std::span<const std::byte> b) {
  record_input("peer", b.data(), b.size());
  if (b.size() != kPeerHeaderBytes) {
    throw Error(ErrorCode::kMalformed, "peer data header is " + std::to_string(b.size()) +
                                           " bytes (expected " +
                                           std::to_string(kPeerHeaderBytes) + ")");
  }
  PeerHeader h;
  h.version = get<uint16_t>(&b[0]);
  if (h.version != kPeerVersion) {
    throw Error(ErrorCode::kMalformed, "peer protocol version " + std::to_string(h.version) +
                                           " (accepted: " + std::to_string(kPeerVersion) +
                                           "; run the same bytecompd release on every node)");
  }
  const auto format = get<uint8_t>(&b[2]);
  if (format != static_cast<uint8_t>(PeerFormat::kRawFp32) &&
      format != static_cast<uint8_t>(PeerFormat::kCompressed)) {
    throw Error(ErrorCode::kMalformed, "peer data format " + std::to_string(format) +
                                           " (accepted: 1 raw fp32, 2 compressed)");
  }
  if (get<uint8_t>(&b[3]) != 0) throw Error(ErrorCode::kMalformed, "peer data: reserved byte set");
  h.format = static_cast<PeerFormat>(format);
  h.sender_rank = get<uint32_t>(&b[4]);
  h.count = get<uint64_t>(&b[8]);
  h.plan_digest = get<uint64_t>(&b[16]);
  h.data_bytes = get<uint64_t>(&b[24]);
  return h;
}

uint64_t plan_digest(const std::string& canonical_spec) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : canonical_spec) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// ---------------------------------------------------------------------------
// PeerJob

PeerJob::PeerJob(PeerHub& hub, PeerJobSpec spec, ReadyFn ready, FailFn fail)
    : hub_(hub), spec_(std::move(spec)), ready_(std::move(ready)), fail_(std::move(fail)) {
  parts_.resize(spec_.partitions.size());
  for (size_t t = 0; t < parts_.size(); ++t) parts_[t].resize(spec_.partitions[t]);
}

PeerJob::~PeerJob() { close(); }

std::string PeerJob::who(uint32_t rank) const {
  return "node " + std::to_string(spec_.nodes.at(rank)) + " (rank " + std::to_string(rank) + ")";
}

PeerJob::Part* PeerJob::part(uint32_t tensor, uint32_t index) {
  if (tensor >= parts_.size() || index >= parts_[tensor].size()) return nullptr;
  return &parts_[tensor][index];
}

void PeerJob::close() {
  {
    std::lock_guard lock(mu_);
    if (closed_) return;
    closed_ = true;
    parts_.clear();
  }
  std::vector<NodeId> peers;
  for (uint32_t r = 0; r < spec_.nodes.size(); ++r) {
    if (r != spec_.rank) peers.push_back(spec_.nodes[r]);
  }
  hub_.unregister(this, spec_.uid, peers);
}

void PeerJob::fail(const Status& s) {
  {
    std::lock_guard lock(mu_);
    if (closed_ || failed_) return;
    failed_ = true;
  }
  BC_LOG(LogPeer(), kWarn) << "job " << spec_.name << ": " << s.to_string();
  fail_(s);
}

void PeerJob::contribute(uint32_t tensor, uint32_t index, uint64_t iteration, PeerHeader header,
                         Buffer data, AckedFn acked) {
  header.sender_rank = spec_.rank;
  header.data_bytes = data.size();
  const uint32_t m = static_cast<uint32_t>(spec_.nodes.size());
  bool ready = false;
  {
    std::lock_guard lock(mu_);
    if (closed_) return;
    Part* p = part(tensor, index);
    if (p == nullptr || static_cast<int64_t>(iteration) <= p->finished) {
      throw Error(ErrorCode::kInternal, "peer allgather: " +
                                            part_name(spec_, tensor, index, iteration) +
                                            " is not an open round");
    }
    Slot& slot = p->open[iteration];
    if (slot.from.empty()) slot.from.resize(m);
    if (slot.from[spec_.rank]) {
      throw Error(ErrorCode::kInternal, "peer allgather: " +
                                            part_name(spec_, tensor, index, iteration) +
                                            " contributed twice");
    }
    slot.from[spec_.rank] = PeerPayload{header, data};
    slot.own_at = Clock::now();
    ready = ++slot.have == m;
  }
  Message msg;
  msg.header.type = kPeerData;
  msg.header.aux = spec_.uid;
  msg.header.key = strategy::partition_key(tensor, index);
  msg.header.arg = iteration;
  msg.payloads = {encode_peer_header(header), data};
  std::weak_ptr<PeerJob> weak = self_;
  // Peers that have not acknowledged yet; the last acknowledgement runs
  // `acked` (on the transport's completion thread).
  auto unacked = std::make_shared<std::atomic<uint32_t>>(m - 1);
  if (m == 1 && acked) acked();
  for (uint32_t r = 0; r < m; ++r) {
    if (r == spec_.rank) continue;
    hub_.tp_->request(
        spec_.nodes[r], msg, spec_.timeout,
        [weak, r, tensor, index, iteration, unacked, acked](transport::Response resp) {
          auto job = weak.lock();
          if (!job) return;
          Status s = resp.status;
          if (s.ok() && resp.response.header.type != kPeerOk) {
            std::string text;
            for (const Buffer& b : resp.response.payloads) text.append(b.view());
            const uint32_t c = resp.response.header.aux;
            const ErrorCode code =
                resp.response.header.type == kPeerError && c >= 1 &&
                        c <= static_cast<uint32_t>(ErrorCode::kInternal)
                    ? static_cast<ErrorCode>(c)
                    : ErrorCode::kMalformed;
            s = Status(code, resp.response.header.type == kPeerError
                                 ? "refused: " + text
                                 : "unexpected reply type " +
                                       std::to_string(resp.response.header.type));
          }
          if (!s.ok()) {
            job->fail(Status(s.code(), "sending " +
                                           part_name(job->spec_, tensor, index, iteration) +
                                           " to the daemon of " + job->who(r) +
                                           " failed: " + s.message()));
            return;
          }
          if (unacked->fetch_sub(1) == 1 && acked) acked();
        });
  }
  if (ready) ready_(tensor, index, iteration);
}

Status PeerJob::receive(NodeId from, uint64_t key, uint64_t iteration, PeerPayload payload) {
  const uint32_t m = static_cast<uint32_t>(spec_.nodes.size());
  const auto it = std::find(spec_.nodes.begin(), spec_.nodes.end(), from);
  if (it == spec_.nodes.end() || static_cast<uint32_t>(it - spec_.nodes.begin()) == spec_.rank) {
    return Status(ErrorCode::kInvalidArgument, "node " + std::to_string(from) +
                                                   " is not a peer of job '" + spec_.name + "'");
  }
  const auto rank = static_cast<uint32_t>(it - spec_.nodes.begin());
  if (payload.header.sender_rank != rank) {
    return Status(ErrorCode::kMalformed, "node " + std::to_string(from) + " claims rank " +
                                             std::to_string(payload.header.sender_rank) +
                                             " of job '" + spec_.name + "', it is rank " +
                                             std::to_string(rank));
  }
  const uint32_t tensor = strategy::partition_tensor(key);
  const uint32_t index = strategy::partition_index(key);
  bool ready = false;
  {
    std::lock_guard lock(mu_);
    if (closed_) return Status(ErrorCode::kUnavailable, "job '" + spec_.name + "' ended here");
    Part* p = part(tensor, index);
    if (p == nullptr) {
      return Status(ErrorCode::kInvalidArgument,
                    "job '" + spec_.name + "' has no allgather partition " +
                        std::to_string(index) + " of tensor #" + std::to_string(tensor));
    }
    const std::string what = part_name(spec_, tensor, index, iteration);
    const uint64_t count = spec_.partition_count(tensor, index);
    if (payload.header.count != count) {
      return Status(ErrorCode::kMalformed, what + ": " + std::to_string(payload.header.count) +
                                               " elements sent, the partition has " +
                                               std::to_string(count));
    }
    if (payload.header.format == PeerFormat::kRawFp32 && payload.data.size() != count * 4) {
      return Status(ErrorCode::kMalformed, what + ": raw fp32 data of " +
                                               std::to_string(payload.data.size()) +
                                               " bytes, expected " + std::to_string(count * 4));
    }
    if (payload.header.format == PeerFormat::kCompressed && payload.data.empty()) {
      return Status(ErrorCode::kMalformed, what + ": empty compressed data");
    }
    if (static_cast<int64_t>(iteration) <= p->finished) {
      return Status(ErrorCode::kInvalidArgument,
                    what + ": stale, this node finished iteration " + std::to_string(p->finished));
    }
    auto s = p->open.find(iteration);
    if (s == p->open.end()) {
      // A peer is at most one round ahead of this node's open one.
      if (p->open.size() >= 2) {
        return Status(ErrorCode::kInvalidArgument,
                      what + ": too far ahead (rounds " + std::to_string(p->open.begin()->first) +
                          " and " + std::to_string(p->open.rbegin()->first) + " are open)");
      }
      s = p->open.emplace(iteration, Slot{}).first;
      s->second.from.resize(m);
    }
    Slot& slot = s->second;
    if (slot.from[rank]) {
      return Status(ErrorCode::kInvalidArgument, what + ": sent twice by " + who(rank));
    }
    slot.from[rank] = std::move(payload);
    ready = ++slot.have == m;
  }
  if (ready) ready_(tensor, index, iteration);
  return Status::Ok();
}

std::vector<PeerPayload> PeerJob::take(uint32_t tensor, uint32_t index, uint64_t iteration) {
  std::lock_guard lock(mu_);
  if (closed_) throw Error(ErrorCode::kUnavailable, "job '" + spec_.name + "' ended");
  Part* p = part(tensor, index);
  auto s = p == nullptr ? decltype(p->open)::iterator{} : p->open.find(iteration);
  if (p == nullptr || s == p->open.end() || s->second.have != spec_.nodes.size()) {
    throw Error(ErrorCode::kInternal,
                "peer allgather: " + part_name(spec_, tensor, index, iteration) + " incomplete");
  }
  std::vector<PeerPayload> out;
  out.reserve(spec_.nodes.size());
  for (auto& f : s->second.from) out.push_back(std::move(*f));
  p->open.erase(s);
  p->finished = std::max(p->finished, static_cast<int64_t>(iteration));
  return out;
}

Status PeerJob::check_deadlines(Clock::time_point now) {
  Status late;
  {
    std::lock_guard lock(mu_);
    if (closed_ || failed_) return Status::Ok();
    for (uint32_t t = 0; t < parts_.size() && late.ok(); ++t) {
      for (uint32_t i = 0; i < parts_[t].size() && late.ok(); ++i) {
        for (const auto& [iteration, slot] : parts_[t][i].open) {
          if (!slot.own_at || now - *slot.own_at <= spec_.timeout) continue;
          std::string missing;
          for (uint32_t r = 0; r < slot.from.size(); ++r) {
            if (!slot.from[r]) missing += (missing.empty() ? "" : ", ") + who(r);
          }
          late = Status(ErrorCode::kTimeout,
                        "no data from " + missing + " for " + part_name(spec_, t, i, iteration) +
                            " within " + std::to_string(spec_.timeout.count()) + " ms");
          break;
        }
      }
    }
  }
  if (!late.ok()) fail(late);
  return late;
}

// ---------------------------------------------------------------------------
// PeerHub

PeerHub::PeerHub(const transport::TransportConfig& config, std::chrono::milliseconds park_timeout)
    : park_timeout_(park_timeout) {
  tp_ = transport::make_transport(config);
  const auto addrs = tp_->local_addresses();
  if (addrs.empty()) {
    throw Error(ErrorCode::kConfig, "the peer transport listens on nothing (set "
                                    "internode.peer_listen)");
  }
  address_ = addrs.front();
  tp_->set_handler(kPeerData, [this](Incoming in) { on_data(std::move(in)); });
  tp_->set_handler(kRingData, [this](Incoming in) { on_ring_data(std::move(in)); });
  tp_->set_handler(kBcastData, [this](Incoming in) { on_bcast_data(std::move(in)); });
  tp_->on_peer_failure([this](NodeId id, const Status& s) { on_peer_lost(id, s); });
  tp_->start();
  BC_LOG(LogPeer(), kInfo) << "peer endpoint " << address_ << " (node " << tp_->self() << ")";
}

PeerHub::~PeerHub() { tp_->shutdown(); }

NodeId PeerHub::self() const { return tp_->self(); }

void PeerHub::check_peers(const std::string& job, uint32_t rank, const std::vector<NodeId>& nodes,
                          const std::vector<std::string>& addresses, const char* inter) const {
  const size_t m = nodes.size();
  if (rank >= m || nodes[rank] != self()) {
    throw Error(ErrorCode::kInvalidArgument,
                "job '" + job + "': this daemon (node " + std::to_string(self()) +
                    ") is not rank " + std::to_string(rank) + " of its node list");
  }
  if (addresses.size() != m) {
    throw Error(ErrorCode::kInvalidArgument,
                "job '" + job + "': the coordinator gave " + std::to_string(addresses.size()) +
                    " peer addresses for " + std::to_string(m) +
                    " nodes (a server of another release?)");
  }
  for (size_t r = 0; r < m; ++r) {
    if (r != rank && addresses[r].empty()) {
      throw Error(ErrorCode::kInvalidArgument,
                  "job '" + job + "' uses inter: " + inter + ", but node " +
                      std::to_string(nodes[r]) + " (rank " + std::to_string(r) +
                      ") has no peer endpoint (set internode.peer_listen in its bytecompd "
                      "configuration)");
    }
  }
}

void PeerHub::connect_peers(uint32_t rank, const std::vector<NodeId>& nodes,
                            const std::vector<std::string>& addresses) {
  for (size_t r = 0; r < nodes.size(); ++r) {
    if (r == rank) continue;
    Peer& p = peers_[nodes[r]];
    if (p.jobs++ == 0 || p.address != addresses[r]) {
      p.address = addresses[r];
      tp_->add_peer(nodes[r], p.address);
    }
  }
}

std::shared_ptr<PeerJob> PeerHub::open(PeerJobSpec spec, PeerJob::ReadyFn ready,
                                       PeerJob::FailFn fail) {
  check_peers(spec.name, spec.rank, spec.nodes, spec.addresses, "allgather");
  std::shared_ptr<PeerJob> job(new PeerJob(*this, spec, std::move(ready), std::move(fail)));
  job->self_ = job;
  std::lock_guard lock(mu_);
  if (auto it = jobs_.find(spec.uid); it != jobs_.end() && !it->second.expired()) {
    job->closed_ = true;  // not registered: its destructor must not unregister the other
    throw Error(ErrorCode::kInvalidArgument,
                "job uid " + std::to_string(spec.uid) + " is already open here");
  }
  jobs_[spec.uid] = job;
  connect_peers(spec.rank, spec.nodes, spec.addresses);
  return job;
}

std::shared_ptr<RingJob> PeerHub::open_ring(RingJobSpec spec, RingJob::ReadyFn ready,
                                            RingJob::FailFn fail) {
  check_peers(spec.name, spec.rank, spec.nodes, spec.addresses, "allreduce");
  if (spec.chunk_bytes < 64 || spec.chunk_bytes > kRingMaxChunkBytes || spec.chunk_bytes % 4 != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                "job '" + spec.name + "': ring chunk of " + std::to_string(spec.chunk_bytes) +
                    " bytes (accepted: 64 B to 1 MiB, a multiple of 4)");
  }
  if (spec.window < 2) {
    throw Error(ErrorCode::kInvalidArgument,
                "job '" + spec.name + "': ring window " + std::to_string(spec.window) +
                    " (at least 2 chunks in flight)");
  }
  std::shared_ptr<RingJob> job(new RingJob(*this, spec, std::move(ready), std::move(fail)));
  job->self_ = job;
  std::lock_guard lock(mu_);
  if (auto it = rings_.find(spec.uid); it != rings_.end() && !it->second.expired()) {
    job->closed_ = true;  // not registered: its destructor must not unregister the other
    throw Error(ErrorCode::kInvalidArgument,
                "job uid " + std::to_string(spec.uid) + " already has a ring here");
  }
  rings_[spec.uid] = job;
  connect_peers(spec.rank, spec.nodes, spec.addresses);
  return job;
}

std::shared_ptr<BcastJob> PeerHub::open_bcast(BcastJobSpec spec, BcastJob::ReadyFn ready,
                                              BcastJob::FailFn fail) {
  check_peers(spec.name, spec.rank, spec.nodes, spec.addresses, "broadcast");
  if (spec.chunk_bytes < 1 || spec.chunk_bytes > kBcastMaxChunkBytes) {
    throw Error(ErrorCode::kInvalidArgument,
                "job '" + spec.name + "': broadcast chunk of " + std::to_string(spec.chunk_bytes) +
                    " bytes (accepted: 1 B to 1 MiB)");
  }
  if (spec.window < 2) {
    throw Error(ErrorCode::kInvalidArgument,
                "job '" + spec.name + "': broadcast window " + std::to_string(spec.window) +
                    " (at least 2 chunks in flight)");
  }
  if (spec.local_size == 0 || spec.tensor_bytes.size() != spec.tensor_names.size()) {
    throw Error(ErrorCode::kInternal, "job '" + spec.name + "': broadcast spec without ranks or "
                                      "with tensor sizes that do not match its names");
  }
  std::shared_ptr<BcastJob> job(new BcastJob(*this, spec, std::move(ready), std::move(fail)));
  job->self_ = job;
  std::vector<Parked> parked;
  std::vector<Incoming> expired;
  {
    std::lock_guard lock(mu_);
    if (auto it = bcasts_.find(spec.uid); it != bcasts_.end() && !it->second.expired()) {
      job->closed_ = true;  // not registered: its destructor must not unregister the other
      throw Error(ErrorCode::kInvalidArgument,
                  "job uid " + std::to_string(spec.uid) + " already has a broadcast chain here");
    }
    bcasts_[spec.uid] = job;
    std::erase_if(closed_bcasts_, [&](const Closed& c) { return c.uid == spec.uid; });
    connect_peers(spec.rank, spec.nodes, spec.addresses);
    expire_parked(Clock::now(), expired);
    if (auto it = parked_.find(spec.uid); it != parked_.end()) {
      parked = std::move(it->second);
      parked_.erase(it);
      for (const Parked& p : parked) parked_bytes_ -= p.in.message.payload_bytes();
    }
  }
  refuse_expired(expired);
  // In arrival order; the handler threads deliver what comes from now on.
  for (Parked& p : parked) deliver_bcast(job, std::move(p.in), p.header);
  return job;
}

void PeerHub::expire_parked(Clock::time_point now, std::vector<Incoming>& expired) {
  for (auto it = parked_.begin(); it != parked_.end();) {
    auto& v = it->second;
    auto keep = std::stable_partition(v.begin(), v.end(), [&](const Parked& p) {
      return now - p.at <= park_timeout_;
    });
    for (auto e = keep; e != v.end(); ++e) {
      parked_bytes_ -= e->in.message.payload_bytes();
      expired.push_back(std::move(e->in));
    }
    v.erase(keep, v.end());
    it = v.empty() ? parked_.erase(it) : std::next(it);
  }
}

void PeerHub::refuse_expired(std::vector<Incoming>& expired) {
  for (Incoming& in : expired) {
    refuse(in, ErrorCode::kUnavailable,
           "no job with uid " + std::to_string(in.message.header.aux) +
               " opened its broadcast on node " + std::to_string(self()) + " within " +
               std::to_string(park_timeout_.count()) + " ms",
           kBcastError);
  }
  expired.clear();
}

void PeerHub::tick(Clock::time_point now) {
  std::vector<Incoming> expired;
  {
    std::lock_guard lock(mu_);
    while (!closed_bcasts_.empty() && now - closed_bcasts_.front().at > park_timeout_)
      closed_bcasts_.pop_front();
    if (parked_.empty()) return;
    expire_parked(now, expired);
  }
  refuse_expired(expired);
}

void PeerHub::release_peers(const std::vector<NodeId>& peers) {
  // A peer stays connected after its last job ends: removing it would fail
  // this job's last replies and sends still queued for it, which the peer
  // may be waiting for. Only a peer that is lost and unused is forgotten.
  for (NodeId id : peers) {
    auto it = peers_.find(id);
    if (it == peers_.end()) continue;
    if (--it->second.jobs <= 0 && tp_->peer_state(id) == transport::PeerState::kLost) {
      peers_.erase(it);
      tp_->remove_peer(id);
    }
  }
}

void PeerHub::unregister(const PeerJob* job, uint32_t uid, const std::vector<NodeId>& peers) {
  std::lock_guard lock(mu_);
  // Only this job's entry (a restarted coordinator may reuse the uid).
  if (auto it = jobs_.find(uid); it != jobs_.end()) {
    auto current = it->second.lock();
    if (!current || current.get() == job) jobs_.erase(it);
  }
  release_peers(peers);
}

void PeerHub::unregister_ring(const RingJob* job, uint32_t uid, const std::vector<NodeId>& peers) {
  std::lock_guard lock(mu_);
  if (auto it = rings_.find(uid); it != rings_.end()) {
    auto current = it->second.lock();
    if (!current || current.get() == job) rings_.erase(it);
  }
  release_peers(peers);
}

void PeerHub::unregister_bcast(const BcastJob* job, uint32_t uid, const std::vector<NodeId>& peers) {
  std::lock_guard lock(mu_);
  if (auto it = bcasts_.find(uid); it != bcasts_.end()) {
    auto current = it->second.lock();
    if (!current || current.get() == job) {
      bcasts_.erase(it);
      // Its late data (a neighbour's last chunks, sends of a node that
      // failed later) is refused naming it rather than parked.
      closed_bcasts_.push_back({uid, job->spec().name, Clock::now()});
      if (closed_bcasts_.size() > kClosedRemembered) closed_bcasts_.pop_front();
    }
  }
  release_peers(peers);
}

void PeerHub::refuse(const Incoming& in, ErrorCode code, const std::string& why, uint16_t type) {
  BC_LOG(LogPeer(), kError) << (type == kRingError    ? "ring"
                                : type == kBcastError ? "broadcast"
                                                      : "peer")
                            << " data from node "
                            << in.from << " refused: " << why;
  if (!in.expects_reply) return;
  Message m;
  m.header.type = type;
  m.header.aux = static_cast<uint32_t>(code);
  m.payloads.push_back(Buffer::copy_of(why));
  try {
    tp_->reply(in, std::move(m), nullptr);
  } catch (const Error& e) {
    BC_LOG(LogPeer(), kError) << "reply to node " << in.from << ": " << e.what();
  }
}

void PeerHub::on_data(Incoming in) {
  if (!in.expects_reply) {
    return refuse(in, ErrorCode::kMalformed, "peer data sent one-way (a request is expected)");
  }
  if (in.message.payloads.size() != 2) {
    return refuse(in, ErrorCode::kMalformed,
                  "peer data with " + std::to_string(in.message.payloads.size()) +
                      " payloads (expected 2: header and data)");
  }
  PeerPayload p;
  try {
    p.header = decode_peer_header(in.message.payloads[0].span());
  } catch (const Error& e) {
    return refuse(in, e.code(), e.what());
  }
  p.data = in.message.payloads[1];
  if (p.header.data_bytes != p.data.size()) {
    return refuse(in, ErrorCode::kMalformed,
                  "peer data header says " + std::to_string(p.header.data_bytes) +
                      " bytes, " + std::to_string(p.data.size()) + " came");
  }
  std::shared_ptr<PeerJob> job;
  {
    std::lock_guard lock(mu_);
    auto it = jobs_.find(in.message.header.aux);
    if (it != jobs_.end()) job = it->second.lock();
  }
  if (!job) {
    return refuse(in, ErrorCode::kUnavailable,
                  "no job with uid " + std::to_string(in.message.header.aux) +
                      " is running on node " + std::to_string(self()));
  }
  const Status s = job->receive(in.from, in.message.header.key, in.message.header.arg, std::move(p));
  if (!s.ok()) return refuse(in, s.code(), s.message());
  Message ok;
  ok.header.type = kPeerOk;
  try {
    tp_->reply(in, std::move(ok), nullptr);
  } catch (const Error& e) {
    BC_LOG(LogPeer(), kError) << "reply to node " << in.from << ": " << e.what();
  }
}

void PeerHub::on_ring_data(Incoming in) {
  auto refuse_ring = [&](ErrorCode code, const std::string& why) {
    refuse(in, code, why, kRingError);
  };
  if (!in.expects_reply) {
    return refuse_ring(ErrorCode::kMalformed, "ring data sent one-way (a request is expected)");
  }
  if (in.message.payloads.size() != 2) {
    return refuse_ring(ErrorCode::kMalformed,
                       "ring data with " + std::to_string(in.message.payloads.size()) +
                           " payloads (expected 2: header and data)");
  }
  RingJob::Received r;
  try {
    r.header = decode_ring_header(in.message.payloads[0].span());
  } catch (const Error& e) {
    return refuse_ring(e.code(), e.what());
  }
  r.data = in.message.payloads[1];
  if (r.header.data_bytes != r.data.size()) {
    return refuse_ring(ErrorCode::kMalformed,
                       "ring data header says " + std::to_string(r.header.data_bytes) +
                           " bytes, " + std::to_string(r.data.size()) + " came");
  }
  std::shared_ptr<RingJob> job;
  {
    std::lock_guard lock(mu_);
    auto it = rings_.find(in.message.header.aux);
    if (it != rings_.end()) job = it->second.lock();
  }
  if (!job) {
    return refuse_ring(ErrorCode::kUnavailable,
                       "no ring job with uid " + std::to_string(in.message.header.aux) +
                           " is running on node " + std::to_string(self()));
  }
  const Status s =
      job->receive(in.from, in.message.header.key, in.message.header.arg, std::move(r));
  if (!s.ok()) return refuse_ring(s.code(), s.message());
  Message ok;
  ok.header.type = kRingOk;
  try {
    tp_->reply(in, std::move(ok), nullptr);
  } catch (const Error& e) {
    BC_LOG(LogPeer(), kError) << "reply to node " << in.from << ": " << e.what();
  }
}

void PeerHub::on_bcast_data(Incoming in) {
  auto refuse_bcast = [&](ErrorCode code, const std::string& why) {
    refuse(in, code, why, kBcastError);
  };
  if (!in.expects_reply) {
    return refuse_bcast(ErrorCode::kMalformed, "broadcast data sent one-way (a request is expected)");
  }
  if (in.message.payloads.size() != 2) {
    return refuse_bcast(ErrorCode::kMalformed,
                        "broadcast data with " + std::to_string(in.message.payloads.size()) +
                            " payloads (expected 2: header and data)");
  }
  BcastHeader h;
  try {
    h = decode_bcast_header(in.message.payloads[0].span());
  } catch (const Error& e) {
    return refuse_bcast(e.code(), e.what());
  }
  if (h.data_bytes != in.message.payloads[1].size()) {
    return refuse_bcast(ErrorCode::kMalformed,
                        "broadcast data header says " + std::to_string(h.data_bytes) +
                            " bytes, " + std::to_string(in.message.payloads[1].size()) + " came");
  }
  std::shared_ptr<BcastJob> job;
  std::vector<Incoming> expired;
  std::string full;
  std::string ended;
  {
    std::lock_guard lock(mu_);
    const uint32_t uid = in.message.header.aux;
    if (auto it = bcasts_.find(uid); it != bcasts_.end()) job = it->second.lock();
    const auto closed = std::find_if(closed_bcasts_.rbegin(), closed_bcasts_.rend(),
                                     [&](const Closed& c) { return c.uid == uid; });
    if (!job && closed != closed_bcasts_.rend() &&
        Clock::now() - closed->at <= park_timeout_) {
      ended = "job '" + closed->name + "' (uid " + std::to_string(uid) +
              ") ended its broadcasts on node " + std::to_string(self());
    } else if (!job) {
      // Its node has not broadcast yet: wait for it (answered when it opens).
      const auto now = Clock::now();
      expire_parked(now, expired);
      const size_t bytes = in.message.payload_bytes();
      if (parked_bytes_ + bytes > kMaxParkedBytes) {
        full = "broadcast data for job uid " + std::to_string(uid) + ", which has not opened "
               "its broadcast on node " + std::to_string(self()) + ": " +
               std::to_string(parked_bytes_) + " bytes wait already (at most " +
               std::to_string(kMaxParkedBytes) + ")";
      } else {
        parked_bytes_ += bytes;
        auto& waiting = parked_[uid];
        if (waiting.empty()) {
          BC_LOG(LogPeer(), kInfo) << "broadcast data from node " << in.from << " for job uid "
                                   << uid << " waits until that job's broadcasts open here";
        }
        waiting.push_back({std::move(in), h, now});
      }
    }
  }
  refuse_expired(expired);
  if (!ended.empty()) return refuse_bcast(ErrorCode::kUnavailable, ended);
  if (!full.empty()) return refuse_bcast(ErrorCode::kResourceExhausted, full);
  if (job) deliver_bcast(job, std::move(in), h);
}

void PeerHub::deliver_bcast(const std::shared_ptr<BcastJob>& job, Incoming in, BcastHeader header) {
  BcastJob::Received r;
  r.header = header;
  r.data = in.message.payloads[1];
  const Status s =
      job->receive(in.from, in.message.header.key, in.message.header.arg, std::move(r));
  if (!s.ok()) return refuse(in, s.code(), s.message(), kBcastError);
  Message ok;
  ok.header.type = kBcastOk;
  try {
    tp_->reply(in, std::move(ok), nullptr);
  } catch (const Error& e) {
    BC_LOG(LogPeer(), kError) << "reply to node " << in.from << ": " << e.what();
  }
}

void PeerHub::on_peer_lost(NodeId id, const Status& s) {
  std::vector<std::shared_ptr<PeerJob>> hit;
  std::vector<std::shared_ptr<RingJob>> rings_hit;
  std::vector<std::shared_ptr<BcastJob>> bcasts_hit;
  {
    std::lock_guard lock(mu_);
    if (auto it = peers_.find(id); it != peers_.end() && it->second.jobs <= 0) {
      // Unused: stop reconnecting to it (a later job adds it again).
      peers_.erase(it);
      tp_->remove_peer(id);
    }
    for (auto& [uid, weak] : jobs_) {
      auto job = weak.lock();
      if (!job) continue;
      const auto& nodes = job->spec().nodes;
      if (std::find(nodes.begin(), nodes.end(), id) != nodes.end()) hit.push_back(job);
    }
    for (auto& [uid, weak] : rings_) {
      auto ring = weak.lock();
      if (!ring) continue;
      const auto& nodes = ring->spec().nodes;
      if (std::find(nodes.begin(), nodes.end(), id) != nodes.end()) rings_hit.push_back(ring);
    }
    for (auto& [uid, weak] : bcasts_) {
      auto job = weak.lock();
      if (!job) continue;
      const auto& nodes = job->spec().nodes;
      if (std::find(nodes.begin(), nodes.end(), id) != nodes.end()) bcasts_hit.push_back(job);
    }
  }
  for (auto& job : hit) {
    const auto& nodes = job->spec().nodes;
    const auto rank = static_cast<uint32_t>(std::find(nodes.begin(), nodes.end(), id) -
                                            nodes.begin());
    job->fail(Status(ErrorCode::kPeerLost, "the daemon of " + job->who(rank) + " of job '" +
                                               job->spec().name +
                                               "' stopped answering (allgather peer): " +
                                               s.message()));
  }
  for (auto& ring : rings_hit) {
    const auto& nodes = ring->spec().nodes;
    const auto rank = static_cast<uint32_t>(std::find(nodes.begin(), nodes.end(), id) -
                                            nodes.begin());
    ring->fail(Status(ErrorCode::kPeerLost, "the daemon of " + ring->who(rank) + " of job '" +
                                                ring->spec().name +
                                                "' stopped answering (ring allreduce peer): " +
                                                s.message()));
  }
  for (auto& job : bcasts_hit) {
    const auto& nodes = job->spec().nodes;
    const auto rank = static_cast<uint32_t>(std::find(nodes.begin(), nodes.end(), id) -
                                            nodes.begin());
    job->fail(Status(ErrorCode::kPeerLost, "the daemon of " + job->who(rank) + " of job '" +
                                               job->spec().name +
                                               "' stopped answering (broadcast peer): " +
                                               s.message()));
  }
}

}  // namespace bytecomp::daemon
