// The ring-allreduce execution path of multi-node jobs (daemon/
// ring_allreduce.h): a partition's node sum goes round the ring of the
// job's daemons, reduce-scatter then allgather, and every node writes the
// same reduced bits to its local ranks. Tensors whose strategy is `inter:
// allreduce` with compressor none, fp16 or bf16 (strategy::Placement::kRing)
// run here; no parameter server sees their rounds. The format of a round
// (fp32, fp16, bf16 words on the wire) and whether the round goes round the
// ring at all (or to the servers, after a ring <-> ps switch) follow the
// plan each round takes from the job's timeline, so a strategy change
// between them applies at the coordinator's iteration on every node.
//
// Thread-safety: see ExecutionPath.
#pragma once

#include <memory>
#include <vector>

#include "daemon/engine_path.h"
#include "daemon/engine_peer.h"
#include "daemon/ring_allreduce.h"
#include "server/ps_client.h"

namespace bytecomp::daemon {

class RingPath final : public ExecutionPath {
 public:
  // After the join: null when no tensor of the job is placed on the ring
  // and some node has no peer endpoint (no strategy change may then move one
  // there); otherwise opens the job's ring on the hub, with a place for
  // every tensor that starts on it or may move to it, and waits (barrier)
  // until every node did. Throws Error (its code fails the job) when the job
  // cannot run.
  static std::unique_ptr<RingPath> open(const PathContext& ctx,
                                        std::shared_ptr<server::PsJob> ps,
                                        const PeerOptions& opts);
  ~RingPath() override;

  // The tensor has a place on the ring (the plan in force says whether a
  // round goes round it: Engine::path_for).
  bool may_run(uint32_t tensor) const { return ring_tensor_[tensor]; }

  const char* name() const override { return "ring"; }
  bool synchronous() const override { return false; }
  void start(const Task& t, std::span<char* const> bufs) override;
  std::string finish(const Inbox::Arrival& a, std::span<char* const> bufs) override;
  Status check(std::chrono::steady_clock::time_point now) override;
  void close() override;

 private:
  RingPath(const PathContext& ctx, std::shared_ptr<server::PsJob> ps, std::vector<bool> ring_tensor);

  PathContext ctx_;
  std::shared_ptr<server::PsJob> ps_;
  std::vector<bool> ring_tensor_;
  std::shared_ptr<RingJob> ring_;
};

// The wire format of a ring tensor's plan: fp32 uncompressed, fp16 / bf16
// for those compressors. Throws Error(kInvalidArgument) for any other.
RingFormat ring_format(const TensorPlan& plan, const std::string& tensor);

}  // namespace bytecomp::daemon
