// libFuzzer target for the control-socket protocol between libbytecomp and
// bytecompd (ipc::decode; both sides decode with it). Input: one datagram.
// Error(kMalformed) (VersionMismatch included) is a correct rejection; a
// crash, a sanitizer report, another exception, or an accepted message
// whose re-encoding does not decode back to the same message is a bug.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "client/ipc/protocol.h"
#include "common/error.h"
#include "fuzz_common.h"

namespace ipc = bytecomp::ipc;

namespace {

std::vector<uint8_t> reencode(const ipc::Decoded& d) {
  return std::visit(
      [&](const auto& m) -> std::vector<uint8_t> {
        using T = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<T, ipc::ErrorMsg>) {
          return ipc::encode(m, d.type);
        } else {
          return ipc::encode(m);
        }
      },
      d.msg);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<uint8_t> bytes(data, data + size);
  ipc::Decoded d;
  try {
    d = ipc::decode(bytes);
  } catch (const bytecomp::Error& e) {
    if (e.code() != bytecomp::ErrorCode::kMalformed) bcfuzz::broken("ipc", e.what());
    return 0;
  }
  if (d.type == ipc::MsgType::kHello && !ipc::check_job_id(std::get<ipc::Hello>(d.msg).job_id).empty())
    return 0;  // the daemon refuses it by its job id (check_job_id) next
  std::vector<uint8_t> once;
  try {
    once = reencode(d);
  } catch (const bytecomp::Error& e) {
    bcfuzz::broken("ipc", std::string("decoded message does not re-encode: ") + e.what());
  }
  try {
    if (reencode(ipc::decode(once)) != once) bcfuzz::broken("ipc", "re-encoding is not stable");
  } catch (const bytecomp::Error& e) {
    bcfuzz::broken("ipc", std::string("re-encoded message does not decode: ") + e.what());
  }
  return 0;
}
