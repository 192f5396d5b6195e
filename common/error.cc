#include "common/error.h"

namespace bytecomp {

std::string_view to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kOk: return "ok";
    case ErrorCode::kInvalidArgument: return "invalid argument";
    case ErrorCode::kConfig: return "configuration error";
    case ErrorCode::kMalformed: return "malformed input";
    case ErrorCode::kTimeout: return "timeout";
    case ErrorCode::kPeerLost: return "peer lost";
    case ErrorCode::kAborted: return "aborted";
    case ErrorCode::kUnavailable: return "unavailable";
    case ErrorCode::kResourceExhausted: return "resource exhausted";
    case ErrorCode::kInternal: return "internal error";
  }
  return "unknown error";
}

std::string Status::to_string() const {
  if (ok()) return "ok";
  std::string s(bytecomp::to_string(code_));
  if (!message_.empty()) {
    s += ": ";
    s += message_;
  }
  return s;
}

void Status::throw_if_error() const {
  if (!ok()) throw Error(code_, message_);
}

}  // namespace bytecomp
