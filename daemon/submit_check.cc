#include "daemon/submit_check.h"

#include <cstdio>

namespace bytecomp::daemon {

SubmitError check_tensor_id(uint32_t rank, const ipc::RingEntry& e, size_t tensors) {
  if (e.tensor < tensors) return std::nullopt;
  return std::make_pair(ErrorCode::kMalformed,
                        "local rank " + std::to_string(rank) + " pushed tensor id " +
                            std::to_string(e.tensor) + " but only " + std::to_string(tensors) +
                            " were declared");
}

SubmitError check_flags(uint32_t rank, const ipc::RingEntry& e) {
  if (ipc::submit_dense_partitions(e.flags) != 0 && (e.flags & ipc::kSubmitCompressed) == 0) {
    return std::make_pair(ErrorCode::kMalformed,
                          "local rank " + std::to_string(rank) + " pushed tensor id " +
                              std::to_string(e.tensor) +
                              " dense with a count of dense partitions (only a compressed push "
                              "splits)");
  }
  if ((e.flags & ~ipc::kSubmitKnownFlags) == 0) return std::nullopt;
  return std::make_pair(ErrorCode::kMalformed,
                        "local rank " + std::to_string(rank) + " pushed tensor id " +
                            std::to_string(e.tensor) + " with unknown submit flags 0x" +
                            [&] {
                              char b[16];
                              std::snprintf(b, sizeof b, "%x", e.flags);
                              return std::string(b);
                            }());
}

SubmitError check_round(uint32_t rank, const ipc::RingEntry& e, const std::string& name,
                        const SubmitRound& round) {
  const std::string r = std::to_string(rank);
  if (round.running || (rank < round.from.size() && round.from[rank])) {
    return std::make_pair(ErrorCode::kInvalidArgument,
                          "local rank " + r + " pushed tensor '" + name + "' (iteration " +
                              std::to_string(e.iteration) +
                              ") again before its previous push_pull finished");
  }
  if (static_cast<int64_t>(e.iteration) <= round.last_done) {
    return std::make_pair(ErrorCode::kInvalidArgument,
                          "local rank " + r + " pushed tensor '" + name + "' for iteration " +
                              std::to_string(e.iteration) + ", not after the last finished one (" +
                              std::to_string(round.last_done) + ")");
  }
  if (round.arrived != 0 && round.iteration != e.iteration) {
    return std::make_pair(ErrorCode::kInvalidArgument,
                          "local ranks disagree on the iteration of tensor '" + name + "': rank " +
                              r + " pushed iteration " + std::to_string(e.iteration) +
                              ", another rank " + std::to_string(round.iteration));
  }
  const bool compressed = (e.flags & ipc::kSubmitCompressed) != 0;
  if (round.arrived != 0 && round.compressed != compressed) {
    return std::make_pair(ErrorCode::kInvalidArgument,
                          "local ranks disagree on the form of tensor '" + name + "' (iteration " +
                              std::to_string(e.iteration) + "): rank " + r + " pushed it " +
                              (compressed ? "compressed" : "dense") + ", another rank " +
                              (round.compressed ? "compressed" : "dense"));
  }
  const uint32_t dense = ipc::submit_dense_partitions(e.flags);
  if (round.arrived != 0 && round.dense != dense) {
    return std::make_pair(ErrorCode::kInvalidArgument,
                          "local ranks disagree on the CPU share of tensor '" + name +
                              "' (iteration " + std::to_string(e.iteration) + "): rank " + r +
                              " left " + std::to_string(dense) +
                              " leading partitions dense, another rank " +
                              std::to_string(round.dense));
  }
  return std::nullopt;
}

}  // namespace bytecomp::daemon
