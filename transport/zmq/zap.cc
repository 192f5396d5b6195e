#include "transport/zmq/zap.h"

#include <zmq.h>

#include <algorithm>
#include <array>
#include <cstdint>

#include "common/record.h"

namespace bytecomp::transport::zmq {

ZapVerdict check_zap_request(const std::vector<std::string>& frames,
                             const std::set<std::string>& authorized_keys) {
  if (recording_inputs()) {
    // In tests/fuzz/zap_fuzz.cc's format: each frame as u16 length + bytes.
    std::string rec;
    for (size_t i = 0; i < frames.size() && i < 16; ++i) {
      const size_t n = std::min<size_t>(frames[i].size(), 0xFFFF);
      rec.push_back(static_cast<char>(n & 0xFF));
      rec.push_back(static_cast<char>(n >> 8));
      rec.append(frames[i], 0, n);
    }
    record_input_always("zap", rec.data(), rec.size());
  }
  ZapVerdict v;
  v.request_id = frames.size() > 1 ? frames[1] : "";
  v.from = frames.size() > 3 ? frames[3] : "?";
  v.reason = "not a CURVE request";
  if (frames.size() >= 7 && frames[5] == "CURVE" && frames[6].size() == 32) {
    v.curve = true;
    v.ok = authorized_keys.count(frames[6]) > 0;
    std::array<char, 41> z85{};
    zmq_z85_encode(z85.data(), reinterpret_cast<const uint8_t*>(frames[6].data()), 32);
    v.reason = v.ok ? "" : std::string("client key ") + z85.data() + " is not the cluster key";
    v.refusal_key = "zap " + v.from + " " + z85.data();
  } else {
    v.refusal_key = "zap " + v.from + " " + (frames.size() > 5 ? frames[5] : "?");
  }
  return v;
}

}  // namespace bytecomp::transport::zmq
