// The engine's own collective operations, beside its execution paths:
// broadcast (per tensor) and barrier (docs/daemon.md "Broadcast and
// barrier"). Every local rank sends the same call; once all did, a
// single-node job copies from the root's buffer (or just completes the
// barrier). A multi-node one sends the broadcast down the chain of the
// job's daemons (daemon/peer_broadcast.h) when every daemon of the job has
// a peer endpoint, else each partition of it to the server that owns it
// (kBroadcast); the barrier goes to the coordinator. It finishes when the
// chain, the servers or the coordinator answer through the engine's Inbox.
//
// Threading: submit() is thread-safe (the control thread calls it); the rest
// runs on the engine thread. What the engine lends (CollectiveContext)
// outlives this object.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "client/ipc/protocol.h"
#include "common/error.h"
#include "daemon/engine_path.h"
#include "daemon/engine_peer.h"
#include "daemon/peer_broadcast.h"
#include "server/ps_client.h"

namespace bytecomp::daemon {

struct CollectiveContext {
  const std::vector<TensorSpec>* tensors = nullptr;
  uint32_t local_size = 1;
  uint32_t node_rank = 0;
  std::shared_ptr<Inbox> inbox;
  // Keeps the segment mapped while the transport sends from it (null: copy).
  std::shared_ptr<const void> keep_mapped;
  std::function<void(uint32_t tensor, std::vector<char*>& out)> buffers_of;
  // Posts (tensor, iteration) to every local rank; false after failing the job.
  std::function<bool(uint32_t tensor, uint64_t iteration)> notify_ranks;
  std::function<void(ErrorCode, const std::string&)> fail;
  // Whether a push_pull of the tensor is in flight (no broadcast then).
  std::function<bool(uint32_t tensor)> busy;
};

class Collectives {
 public:
  explicit Collectives(CollectiveContext ctx);

  ~Collectives();
  // Multi-node jobs, after the join: where broadcasts and barriers go.
  // partition_bytes: per tensor, its partitions' size (the job's cut into
  // its option's pieces): a broadcast through the servers is cut at the
  // tensor's partitions. `peers`: the daemon's peer endpoint, the chain's
  // timeout, chunk and window.
  void joined(std::shared_ptr<server::PsJob> ps, std::vector<uint64_t> partition_bytes,
              const PeerOptions& peers);
  // Local rank `rank`'s call; the engine rings its doorbell after it.
  void submit(uint32_t rank, const ipc::Collective& c);
  // The queued calls; false after failing the job.
  bool drain();
  // An answer of a broadcast partition or of the barrier; false after
  // failing the job.
  bool finish(const Inbox::Arrival& a);
  // Local rank `rank` left: fails the job (false) when a collective waits
  // for it or it left one in flight.
  bool check_left(uint32_t rank);
  // A broadcast on the chain that made no progress within its timeout
  // (the job's failure, also reported through the Inbox).
  Status check(std::chrono::steady_clock::time_point now);
  // Ends the chain: no byte is written into the buffers after it returns.
  void close();

 private:
  // A broadcast (per tensor) or the barrier, as the local ranks join it.
  struct CollRound {
    ipc::Collective first;  // the first rank's, which the others must equal
    uint32_t first_rank = 0;
    uint32_t arrived = 0;
    bool running = false;
    int64_t last_done = -1;
    std::vector<bool> from;
    size_t parts_left = 0;
  };

  // Every local rank joined: copies, or sends down the chain or to the
  // servers/coordinator.
  bool begin(CollRound& c);
  // Multi-node broadcasts over the chain of daemons.
  bool begin_chain(CollRound& c, std::vector<char*>& bufs);
  void complete(CollRound& c);
  CollRound& coll_of(uint32_t tensor) {
    return tensor == ipc::kBarrierTensor ? barrier_ : bcasts_[tensor];
  }

  CollectiveContext ctx_;
  std::shared_ptr<server::PsJob> ps_;
  std::vector<uint64_t> partition_bytes_;  // per tensor
  PeerOptions peers_;
  // Every daemon of the job has a peer endpoint (the same on every node:
  // the coordinator's addresses), so broadcasts take the chain.
  bool chain_ = false;
  std::shared_ptr<BcastJob> bcast_;  // opened at the first broadcast
  std::vector<CollRound> bcasts_;  // per tensor
  CollRound barrier_;
  std::mutex mu_;
  std::vector<std::pair<uint32_t, ipc::Collective>> pending_;  // guarded by mu_
};

}  // namespace bytecomp::daemon
