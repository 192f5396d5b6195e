// The parameter-server execution path of multi-node jobs: per partition,
// sum over the local ranks into rank 0's buffer, compress when the plan in
// force pushes compressed, push to the partition's server, pull the
// aggregate (fp32, fp16 or compressed, as the plan says), decode it and copy
// it to every local rank. The plan of each partition is the coordinator's
// (the job timeline, PsJob::timeline()), the same on every node and server at each iteration.
//
// Thread-safety: see ExecutionPath. The push/pull callbacks run on the
// transport's threads and only touch the Inbox.
#pragma once

#include <memory>
#include <vector>

#include "compress/compressor.h"
#include "daemon/engine_path.h"
#include "server/ps_client.h"

namespace bytecomp::daemon {

class PsPath final : public ExecutionPath {
 public:
  // `keep_mapped`, when given, owns the segment's mapping: uncompressed
  // pushes then send straight from shared memory, holding it past the
  // engine's end until the bytes left.
  PsPath(const PathContext& ctx, std::shared_ptr<server::PsJob> ps,
         std::shared_ptr<const void> keep_mapped);

  const char* name() const override { return "ps"; }
  bool synchronous() const override { return false; }
  void start(const Task& t, std::span<char* const> bufs) override;
  std::string finish(const Inbox::Arrival& a, std::span<char* const> bufs) override;
  // The partition's server, charged the most its push can put on the wire
  // (the tensor bytes uncompressed, the compressor's bound otherwise).
  std::optional<LinkCharge> link_charge(const Task& t) override;

 private:
  struct PsPart {  // per tensor partition: the plan in force and its state
    strategy::TensorPlan plan;
    std::unique_ptr<compress::Compressor> compressor;
    std::unique_ptr<compress::TensorState> state;
  };
  PsPart& ps_part(const Task& t);

  PathContext ctx_;
  std::shared_ptr<server::PsJob> ps_;
  std::shared_ptr<const void> keep_mapped_;
  std::vector<std::vector<PsPart>> ps_parts_;
};

}  // namespace bytecomp::daemon
