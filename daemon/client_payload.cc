#include "daemon/client_payload.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "compress/wire_prefix.h"

namespace bytecomp::daemon {

void check_forwardable(const Task& t, const std::string& tensor_name, bool plan_compresses,
                       size_t local_ranks) {
  if (!plan_compresses) {
    throw Error(ErrorCode::kInvalidArgument,
                compressed_refusal(t, tensor_name, "the plan in force does not compress it"));
  }
  if (local_ranks != 1) {
    throw Error(ErrorCode::kInvalidArgument,
                compressed_refusal(t, tensor_name,
                                   "a multi-node job takes compressed pushes from one local "
                                   "rank per node (" + std::to_string(local_ranks) +
                                       " here; docs/gpu.md: the NCCL shard flow)"));
  }
}

uint32_t planned_dense_partitions(const strategy::TensorPlan& plan, uint64_t partitions) {
  if (!plan.option || !(plan.option->cpu_share > 0.0) || partitions == 0) return 0;
  // cpu_share < 1 (Option::problem), so k <= partitions; k == partitions:
  // the client pushes the tensor dense (no GPU part left).
  return static_cast<uint32_t>(
      std::llround(plan.option->cpu_share * static_cast<double>(partitions)));
}

std::string check_split(const strategy::TensorPlan& plan, const std::string& tensor_name,
                        uint64_t iteration, uint64_t partitions, uint32_t dense) {
  const uint32_t want = planned_dense_partitions(plan, partitions);
  if (dense == want) return {};
  return "tensor '" + tensor_name + "' (iteration " + std::to_string(iteration) +
         ") was pushed with its first " + std::to_string(dense) + " of " +
         std::to_string(partitions) + " partitions dense for the CPU pool, but the plan in " +
         "force (cpu_share " + (plan.option ? std::to_string(plan.option->cpu_share) : "0") +
         ") puts " + std::to_string(want) + " there (a strategy change the client's placement "
         "does not follow?)";
}

std::string compressed_refusal(const Task& t, const std::string& tensor_name,
                               const std::string& why) {
  return "tensor '" + tensor_name + "' partition " + std::to_string(t.index) + " (iteration " +
         std::to_string(t.iteration) + ") was pushed compressed by the client: " + why;
}

std::span<const std::byte> client_payload(const Task& t, const std::string& tensor_name,
                                          uint32_t rank, const char* buf,
                                          const compress::Compressor& c) {
  const std::span<const std::byte> range(reinterpret_cast<const std::byte*>(buf + t.begin),
                                         static_cast<size_t>(t.bytes()));
  auto bad = [&](const std::string& what) {
    return Error(ErrorCode::kMalformed,
                 compressed_refusal(t, tensor_name, "local rank " + std::to_string(rank) + "'s " +
                                                        "payload " + what));
  };
  compress::WireInfo w;
  try {
    w = compress::inspect_prefix(range);
  } catch (const Error& e) {
    throw bad(std::string("is not a compressed buffer: ") + e.what());
  }
  if (w.algorithm != c.name()) {
    throw bad("is " + w.algorithm + " but the plan in force compresses with " + c.name());
  }
  if (w.count != t.count) {
    throw bad("decodes to " + std::to_string(w.count) + " elements, the partition has " +
              std::to_string(t.count));
  }
  if (w.dtype != compress::DType::kFloat32) throw bad("is not of float32 elements");
  if (w.total_bytes > range.size()) {
    throw bad("is " + std::to_string(w.total_bytes) + " bytes, more than the partition's " +
              std::to_string(range.size()));
  }
  return range.first(w.total_bytes);
}

void decode_sum_to_first(const Task& t, const std::string& tensor_name,
                         std::span<char* const> bufs, const compress::Compressor& c,
                         const compress::CompressContext& cctx) {
  const auto n = static_cast<size_t>(t.count);
  // Rank 0's payload lives where the sum goes: decode into scratch first.
  std::vector<float> sum(n);
  for (uint32_t r = 0; r < bufs.size(); ++r) {
    const std::span<const std::byte> p = client_payload(t, tensor_name, r, bufs[r], c);
    try {
      c.decompress(p, compress::TensorView::cpu(sum.data(), n), r > 0, cctx);
    } catch (const Error& e) {
      throw Error(ErrorCode::kMalformed,
                  compressed_refusal(t, tensor_name, "local rank " + std::to_string(r) +
                                                         "'s payload: " + e.what()));
    }
  }
  std::memcpy(bufs[0] + t.begin, sum.data(), n * sizeof(float));
}

}  // namespace bytecomp::daemon
