// The checks of one submission (a ring entry a client wrote into shared
// memory: tensor id, iteration) against a job's rounds, as Engine::drain
// applies them. Pure, so that tests/fuzz/submit_fuzz.cc can feed it any
// sequence of entries a scribbling client could write. Thread-compatible.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "client/ipc/shm_layout.h"
#include "common/error.h"

namespace bytecomp::daemon {

// What the checks read of a tensor's current round.
struct SubmitRound {
  uint64_t iteration = 0;   // of the round, once a rank arrived
  uint32_t arrived = 0;     // local ranks that pushed it
  bool running = false;     // every rank arrived, the round executes
  int64_t last_done = -1;   // last finished iteration
  std::vector<bool> from;   // which local ranks pushed it
  bool compressed = false;  // the ranks that arrived pushed compressed payloads
  uint32_t dense = 0;       // of which the leading partitions left dense (cpu_share)
};

using SubmitError = std::optional<std::pair<ErrorCode, std::string>>;

// nullopt when local rank `rank`'s entry names one of the `tensors`
// declared tensors; else kMalformed naming both.
SubmitError check_tensor_id(uint32_t rank, const ipc::RingEntry& e, size_t tensors);
// nullopt when the entry's flags are known ones (ipc::kSubmitKnownFlags);
// else kMalformed naming the rank and the bits.
SubmitError check_flags(uint32_t rank, const ipc::RingEntry& e);
// nullopt when the entry may join its tensor's round (`round`, of the tensor
// named `name`); else kInvalidArgument naming rank, tensor and iterations:
// a second push before the round finished, an iteration not after the last
// finished one, one that differs from the other ranks', or a compressed
// push where the other ranks pushed dense (or the reverse).
SubmitError check_round(uint32_t rank, const ipc::RingEntry& e, const std::string& name,
                        const SubmitRound& round);

}  // namespace bytecomp::daemon
