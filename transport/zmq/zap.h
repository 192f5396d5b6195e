// The ZAP (RFC 27) request check of the ZeroMQ backend's CURVE
// authentication: pure (no sockets), so that tests/fuzz/zap_fuzz.cc can
// feed it any frames a connecting peer's handshake makes libzmq hand over.
// Internal to transport/zmq/.
#pragma once

#include <set>
#include <string>
#include <vector>

namespace bytecomp::transport::zmq {

struct ZapVerdict {
  bool ok = false;
  std::string reason;      // why refused ("" when ok)
  std::string request_id;  // frame 1, echoed in the reply
  std::string from;        // frame 3 (peer address), "?" when missing
  // Tells refusals apart for logging once per peer: address and client key
  // (Z85) for CURVE requests, address and mechanism otherwise.
  std::string refusal_key;
  bool curve = false;      // a well-formed CURVE request (key known or not)
};

// Frames: version, request id, domain, address, identity, mechanism,
// credentials... `authorized_keys` holds raw 32-byte CURVE public keys.
ZapVerdict check_zap_request(const std::vector<std::string>& frames,
                             const std::set<std::string>& authorized_keys);

}  // namespace bytecomp::transport::zmq
