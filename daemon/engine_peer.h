// The peer-allgather execution path of multi-node jobs (daemon/
// peer_allgather.h): this node's (compressed) partition goes to every other
// node's daemon, and a complete round is decompressed and summed in
// node-rank order on every node. The plans of allgather tensors follow the
// coordinator's strategy announcements: each task carries its round's plan
// from the job's timeline (the PS client's).
//
// Thread-safety: see ExecutionPath.
#pragma once

#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "compress/compressor.h"
#include "daemon/engine_path.h"
#include "daemon/peer_allgather.h"
#include "daemon/plan.h"
#include "server/ps_client.h"

namespace bytecomp::daemon {

// Multi-node jobs with allgather or ring tensors: the daemon's peer endpoint
// (null: none configured; such jobs fail at join), the bound on a peer's
// answer and on waiting for the other nodes' data of a round, and the
// ring's chunk size and window (internode.ring_chunk_bytes; the window is
// the chunks a node has unanswered with its right neighbour).
struct PeerOptions {
  PeerHub* hub = nullptr;
  std::chrono::milliseconds timeout{30000};
  uint64_t ring_chunk_bytes = kRingMaxChunkBytes;
  uint32_t ring_window = 4;
};

// Shared by the daemon-to-daemon paths (peer allgather, ring):
// the digest nodes compare to agree on a tensor's plan at an iteration
// (plan_digest() of its canonical compressor spec, "" uncompressed), and
// which of the job's tensors its first iteration's plans place at `where`
// (empty: none).
uint64_t plan_digest_of(const TensorPlan& plan);
std::vector<bool> tensors_placed(const server::PsJob& ps, size_t tensors,
                                 strategy::Placement where);

class PeerPath final : public ExecutionPath {
 public:
  // After the join: null when no tensor of the job is placed on the peers;
  // otherwise opens the job on the hub and waits (barrier) until every node
  // did. Throws Error (its code fails the job) when the job cannot run.
  static std::unique_ptr<PeerPath> open(const PathContext& ctx,
                                        std::shared_ptr<server::PsJob> ps,
                                        const PeerOptions& opts);
  ~PeerPath() override;

  bool runs(uint32_t tensor) const { return peer_tensor_[tensor]; }

  const char* name() const override { return "peer"; }
  bool synchronous() const override { return false; }
  void start(const Task& t, std::span<char* const> bufs) override;
  std::string finish(const Inbox::Arrival& a, std::span<char* const> bufs) override;
  Status check(std::chrono::steady_clock::time_point now) override;
  void close() override;

 private:
  struct PeerPart {  // per-partition plan of the running round and error-feedback state
    std::shared_ptr<const TensorPlan> plan;
    uint64_t digest = 0;
    std::unique_ptr<compress::TensorState> state;
  };

  PeerPath(const PathContext& ctx, std::shared_ptr<server::PsJob> ps, std::vector<bool> peer_tensor);

  PathContext ctx_;
  std::shared_ptr<server::PsJob> ps_;
  std::vector<bool> peer_tensor_;
  std::shared_ptr<PeerJob> peer_;
  std::vector<std::vector<PeerPart>> peer_parts_;
};

}  // namespace bytecomp::daemon
