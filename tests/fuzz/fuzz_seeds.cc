// Writes one valid input per compressor for compress_fuzz's corpus:
//   compress_fuzz_seeds DIR
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "compress/compressor.h"
#include "fuzz_common.h"

namespace bc = bytecomp::compress;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  std::mt19937 g(1);
  std::normal_distribution<float> d;
  for (size_t i = 0; i < bcfuzz::specs().size(); ++i) {
    for (size_t n : {1ul, 70ul, 300ul}) {
      auto c = bc::make_compressor(bc::parse_compressor_spec(bcfuzz::specs()[i]));
      std::vector<float> x(n);
      for (auto& v : x) v = d(g);
      auto st = c->make_state(n);
      std::vector<std::byte> buf(c->max_compressed_bytes(n));
      buf.resize(c->compress(bc::ConstTensorView::cpu(x.data(), n), buf, *st, {.iteration = 3}));
      std::ofstream f(std::string(argv[1]) + "/seed-" + std::to_string(i) + "-" + std::to_string(n),
                      std::ios::binary);
      char sel = static_cast<char>(i);
      f.write(&sel, 1);
      f.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(buf.size()));
    }
  }
  return 0;
}
