// Client-compressed partitions (ipc::kSubmitCompressed, docs/gpu.md §2): a
// local rank that compressed its gradient itself (on its GPU, or with any
// implementation of the same wire format) writes, at the start of each
// partition's byte range of its tensor buffer, that partition's compressed
// payload. The paths read those payloads here instead of summing dense
// buffers and compressing:
//   local  decodes every rank's payload and sums them (one node: the
//          aggregate of the compressed gradients);
//   ps     pushes rank 0's payload as is (one local rank per node);
//   peer   contributes rank 0's payload as is (one local rank per node).
// Everything a client wrote is checked before use (it may scribble anything
// into shared memory): a valid header of the plan's algorithm, decoding to the
// partition's element count, ending within the partition's bytes.
//
// Thread-safety: stateless functions; distinct partitions may be handled
// concurrently.
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "compress/compressor.h"
#include "daemon/scheduler.h"
#include "planner/strategy/plan.h"

namespace bytecomp::daemon {

// Local rank `rank`'s payload for task `t` in `buf` (its buffer of tensor
// `tensor_name`), checked against compressor `c`. Throws Error(kMalformed)
// naming tensor, partition, rank and what was wrong.
std::span<const std::byte> client_payload(const Task& t, const std::string& tensor_name,
                                          uint32_t rank, const char* buf,
                                          const compress::Compressor& c);

// Decodes every local rank's payload of task `t` and writes their sum (rank
// 0's, then rank 1's added, ...) densely over rank 0's partition range.
// Throws like client_payload().
void decode_sum_to_first(const Task& t, const std::string& tensor_name,
                         std::span<char* const> bufs, const compress::Compressor& c,
                         const compress::CompressContext& cctx);

// The job-failing message for a compressed submission a path cannot take.
std::string compressed_refusal(const Task& t, const std::string& tensor_name,
                               const std::string& why);

// A multi-node path's preconditions for forwarding a client-compressed
// partition as is: the plan in force compresses it, and one local rank
// (whose payload is then the node's) pushed it. Throws
// Error(kInvalidArgument) naming the task otherwise.
void check_forwardable(const Task& t, const std::string& tensor_name, bool plan_compresses,
                       size_t local_ranks);

// The strategy's cpu_share executed (docs/gpu.md §4): of a tensor's
// `partitions`, the leading ones the daemon's CPU pool compresses, the rest
// the client (comp_device: gpu): llround(cpu_share * partitions) (0 without
// an option; all of them: the client pushes dense).
uint32_t planned_dense_partitions(const strategy::TensorPlan& plan, uint64_t partitions);

// Empty when a compressed round whose client left its first `dense`
// partitions dense matches `plan` (planned_dense_partitions); else the
// job-failing reason naming tensor, iteration and both counts.
std::string check_split(const strategy::TensorPlan& plan, const std::string& tensor_name,
                        uint64_t iteration, uint64_t partitions, uint32_t dense);

}  // namespace bytecomp::daemon
