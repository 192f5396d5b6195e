// The project's error model (DESIGN.md §5), one for every layer:
//
//  * Setup, configuration and broken-invariant errors are thrown as
//    bytecomp::Error (or a subclass). The message carries the values that were
//    wrong, so it can be shown to an operator as is.
//  * Asynchronous completions (a send finished, a push_pull failed, a peer
//    died) are reported as a copyable bytecomp::Status, never as an exception
//    crossing threads.
//  * Destructors never throw; after an I/O error a connection is rebuilt, never
//    reused.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace bytecomp {

enum class ErrorCode : int {
  kOk = 0,
  kInvalidArgument,   // bad API call or value
  kConfig,            // bad configuration file or environment override
  kMalformed,         // a wire message or buffer failed validation
  kTimeout,           // a wait ran past its deadline
  kPeerLost,          // a peer died or stopped answering heartbeats
  kAborted,           // the job (or round) was aborted by someone else
  kUnavailable,       // could not connect / resource missing
  kResourceExhausted, // bounded queue or memory limit hit
  kInternal,          // broken invariant: a bug
};

std::string_view to_string(ErrorCode code) noexcept;

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  explicit Error(const std::string& message)
      : Error(ErrorCode::kInternal, message) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

// Result of an asynchronous operation. Cheap to copy; ok() when code == kOk.
class Status {
 public:
  Status() = default;
  Status(ErrorCode code, std::string message)
      : code_(code), message_(std::move(message)) {}
  static Status Ok() { return {}; }
  static Status FromError(const Error& e) { return {e.code(), e.what()}; }

  bool ok() const noexcept { return code_ == ErrorCode::kOk; }
  ErrorCode code() const noexcept { return code_; }
  const std::string& message() const noexcept { return message_; }
  // "timeout: no reply from node 3 within 2000 ms"
  std::string to_string() const;
  // Turns a failed status back into an exception at a synchronous boundary.
  void throw_if_error() const;

 private:
  ErrorCode code_ = ErrorCode::kOk;
  std::string message_;
};

}  // namespace bytecomp
