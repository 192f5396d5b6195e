// libFuzzer target for the checks the daemon's engine applies to every
// entry a client writes into its submit ring (daemon::check_tensor_id,
// daemon::check_round; Engine::drain calls them, then updates the round as
// below). A client may scribble anything into shared memory: tensor ids and
// iterations are the client's, the rank is the ring's.
// Input: byte 0: local ranks (1..4), byte 1: declared tensors (1..8), then
// steps: u8 op; op < 0x80: local rank op % ranks submits (u8 tensor id,
// u16 iteration); op >= 0x80: the running round of tensor op % tensors
// finishes (as when its pull is answered). The job fails at the first
// refused entry, as the engine does.
// Properties: a refusal has the documented code and a message naming the
// rank; an accepted entry never lets a rank into a round twice, a round take
// more ranks than exist, or an iteration at or before the last finished one.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "daemon/submit_check.h"
#include "fuzz_common.h"

namespace bd = bytecomp::daemon;
using bytecomp::ErrorCode;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  bcfuzz::Bytes in(data, size);
  const uint32_t ranks = 1 + in.u8() % 4;
  const uint32_t tensors = 1 + in.u8() % 8;
  std::vector<std::string> names;
  for (uint32_t t = 0; t < tensors; ++t) names.push_back("t" + std::to_string(t));
  std::vector<bd::SubmitRound> rounds(tensors);
  for (auto& r : rounds) r.from.assign(ranks, false);
  while (in.left() > 0) {
    const uint8_t op = in.u8();
    if (op >= 0x80) {
      bd::SubmitRound& r = rounds[op % tensors];
      if (r.running) {
        r.last_done = static_cast<int64_t>(r.iteration);
        r.running = false;
        r.arrived = 0;
        r.from.assign(ranks, false);
      }
      continue;
    }
    const uint32_t rank = op % ranks;
    bytecomp::ipc::RingEntry e{};
    e.tensor = in.u8();
    e.iteration = in.u16();
    if (const bd::SubmitError bad = bd::check_tensor_id(rank, e, tensors)) {
      if (bad->first != ErrorCode::kMalformed || bad->second.find("local rank") != 0)
        bcfuzz::broken("submit", "tensor id refusal: " + bad->second);
      if (e.tensor < tensors) bcfuzz::broken("submit", "refused a declared tensor id");
      return 0;
    }
    if (e.tensor >= tensors) bcfuzz::broken("submit", "accepted an undeclared tensor id");
    bd::SubmitRound& round = rounds[e.tensor];
    if (const bd::SubmitError bad = bd::check_round(rank, e, names[e.tensor], round)) {
      if (bad->first != ErrorCode::kInvalidArgument || bad->second.empty())
        bcfuzz::broken("submit", "round refusal: " + bad->second);
      return 0;
    }
    if (round.running || round.from[rank])
      bcfuzz::broken("submit", "a rank joined a round twice or a running round");
    if (static_cast<int64_t>(e.iteration) <= round.last_done)
      bcfuzz::broken("submit", "accepted an iteration not after the last finished one");
    if (round.arrived != 0 && round.iteration != e.iteration)
      bcfuzz::broken("submit", "accepted ranks of different iterations into one round");
    if (round.arrived == 0) round.iteration = e.iteration;
    round.from[rank] = true;
    if (++round.arrived == ranks) round.running = true;
    if (round.arrived > ranks) bcfuzz::broken("submit", "more arrivals than ranks");
  }
  return 0;
}
