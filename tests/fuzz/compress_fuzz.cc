// libFuzzer target for the compressed-buffer decoders (inspect, decompress,
// decompress-and-accumulate, aggregate). Any bytecomp::Error is a correct
// rejection; a crash, a sanitizer report, another exception type or a hang is
// a bug. Built and run by scripts/fuzz (clang, ASan+UBSan).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "compress/compressor.h"
#include "fuzz_common.h"

namespace bc = bytecomp::compress;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto compressors = [] {
    std::vector<std::unique_ptr<bc::Compressor>> v;
    for (const auto& s : bcfuzz::specs()) v.push_back(bc::make_compressor(bc::parse_compressor_spec(s)));
    return v;
  }();
  if (size < 1) return 0;
  const auto& c = *compressors[data[0] % compressors.size()];
  // Copy into an exactly-sized heap buffer so overreads hit ASan's redzone.
  std::vector<std::byte> buf(size - 1);
  if (!buf.empty()) std::memcpy(buf.data(), data + 1, size - 1);
  size_t n = 1000;
  try {
    n = bc::inspect(buf).count;
  } catch (const bytecomp::Error&) {
  }
  if (n > (size_t{1} << 22)) n = 1000;  // keep the output allocation bounded
  std::vector<float> out(n, 1.0f);
  for (bool acc : {false, true}) {
    try {
      c.decompress(buf, bc::TensorView::cpu(out.data(), n), acc, {});
    } catch (const bytecomp::Error&) {
    }
  }
  if (c.additive()) {
    std::vector<std::byte> agg(c.max_compressed_bytes(n));
    std::vector<std::span<const std::byte>> ins{buf, buf};
    try {
      c.aggregate(ins, agg, {});
    } catch (const bytecomp::Error&) {
    }
  }
  return 0;
}
