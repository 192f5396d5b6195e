// libFuzzer target for the ZAP requests of CURVE authentication
// (transport::zmq::check_zap_request, what ZmqTransport::handle_zap calls
// with the frames libzmq hands over for a connecting peer). Input: frames,
// each a u16 length and its bytes (at most 16). One authorized key: the
// 32 bytes 0x01..0x20.
// Properties: accepted only for a CURVE request whose key is that key;
// a refusal names its reason; the request id is frame 1; refusals of the
// same peer and key (or mechanism) share one log key.
#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "transport/zmq/zap.h"

namespace tz = bytecomp::transport::zmq;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::set<std::string> keys = [] {
    std::string k;
    for (int i = 1; i <= 32; ++i) k.push_back(static_cast<char>(i));
    return std::set<std::string>{k};
  }();
  bcfuzz::Bytes in(data, size);
  std::vector<std::string> frames;
  while (in.left() > 0 && frames.size() < 16) {
    const uint16_t n = in.u16();
    const std::vector<uint8_t> f = in.take(n);
    frames.emplace_back(f.begin(), f.end());
  }
  const tz::ZapVerdict v = tz::check_zap_request(frames, keys);
  if (v.ok && !(frames.size() >= 7 && frames[5] == "CURVE" && keys.count(frames[6])))
    bcfuzz::broken("zap", "accepted a request without the cluster key");
  if (!v.ok && v.reason.empty()) bcfuzz::broken("zap", "refused without a reason");
  if (v.request_id != (frames.size() > 1 ? frames[1] : ""))
    bcfuzz::broken("zap", "request id is not frame 1");
  if (v.refusal_key != tz::check_zap_request(frames, keys).refusal_key)
    bcfuzz::broken("zap", "refusal key is not a function of the request");
  return 0;
}
