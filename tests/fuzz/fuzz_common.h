// Shared by the libFuzzer targets, their replay driver and the seed writer.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace bcfuzz {

// compress_fuzz: input byte 0 picks the compressor, the rest is the buffer
// handed to its decoder.
inline const std::vector<std::string>& specs() {
  static const std::vector<std::string> s = {
      "fp16", "bf16", "randomk:0.05,ef=false", "topk:0.05,ef=false", "dgc:0.05", "signsgd",
      "signum", "efsignsgd", "onebit", "qsgd:16", "qsgd:3", "terngrad"};
  return s;
}

// A property a decoder must keep (e.g. decode(encode(decode(x))) is stable)
// did not hold: abort, so libFuzzer saves the input as a crash.
[[noreturn]] inline void broken(const char* target, const std::string& what) {
  std::fprintf(stderr, "%s: property violated: %s\n", target, what.c_str());
  std::abort();
}

// Little-endian reads from the fuzz input; past the end they yield zero.
class Bytes {
 public:
  Bytes(const uint8_t* data, size_t size) : d_(data), n_(size) {}
  uint8_t u8() { return at_ < n_ ? d_[at_++] : 0; }
  uint16_t u16() { return static_cast<uint16_t>(u8() | (u8() << 8)); }
  uint32_t u32() { return u16() | (static_cast<uint32_t>(u16()) << 16); }
  size_t left() const { return n_ - at_; }
  // The next `n` bytes (fewer at the end) as an exactly-sized heap copy, so
  // an overread hits ASan's redzone.
  std::vector<uint8_t> take(size_t n) {
    n = std::min(n, left());
    std::vector<uint8_t> v(d_ + at_, d_ + at_ + n);
    at_ += n;
    return v;
  }
  std::vector<uint8_t> rest() { return take(left()); }

 private:
  const uint8_t* d_;
  size_t n_;
  size_t at_ = 0;
};

}  // namespace bcfuzz
