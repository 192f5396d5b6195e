// The compressor catalogue against the real compressors: every entry is
// enumerated, so a new compressor is checked here without editing this file.
#include "compress/catalogue.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "compress/cuda/cuda.h"
#include "testutil.h"

using namespace bctest;
using bytecomp::Error;

namespace {

// Specs that exercise the wire-size model: the defaults, then each
// parameter the model reads at its bounds and in between.
std::vector<bc::CompressorSpec> sizing_specs(const bc::CatalogueEntry& e) {
  std::vector<bc::CompressorSpec> out = {{e.name, {}}};
  for (const bc::ParamDef& p : e.params) {
    if (!p.sizes_wire) continue;
    std::vector<std::string> values;
    switch (p.kind) {
      case bc::ParamKind::kRatio: values = {"0.001", "0.3", "1"}; break;
      case bc::ParamKind::kUnit: values = {"0", "0.5"}; break;
      case bc::ParamKind::kInt: {
        const double hi = std::min(p.hi, 1000.0);
        values = {std::to_string(static_cast<long long>(p.lo)),
                  std::to_string(static_cast<long long>((p.lo + hi) / 2)),
                  std::to_string(static_cast<long long>(hi))};
        break;
      }
      case bc::ParamKind::kBool: values = {"true", "false"}; break;
    }
    for (const std::string& v : values) out.push_back({e.name, {{p.name, v}}});
  }
  return out;
}

}  // namespace

TEST(Catalogue, IsWhatTheFactoryBuilds) {
  const auto& cat = bc::catalogue();
  ASSERT_FALSE(cat.empty());
  const auto& infos = bc::list_compressors();
  ASSERT_EQ(infos.size(), cat.size());
  for (size_t i = 0; i < cat.size(); ++i) {
    const bc::CatalogueEntry& e = cat[i];
    SCOPED_TRACE(e.name);
    EXPECT_EQ(infos[i].name, e.name);
    EXPECT_EQ(bc::find_compressor(e.name), &e);
    auto c = bc::make_compressor({e.name, {}});
    EXPECT_EQ(c->name(), e.name);
    EXPECT_EQ(c->additive(), e.additive);
    EXPECT_EQ(c->deterministic_size(), e.deterministic_size);
    EXPECT_EQ(infos[i].additive, e.additive);
    // Built-in feedback: no "ef" switch, and the state carries a residual.
    if (e.builtin_feedback) {
      EXPECT_FALSE(e.has_param("ef"));
      EXPECT_TRUE(c->make_state(16)->has_residual());
    }
    // Every canonical parameter is a declared one, and the reverse.
    EXPECT_EQ(c->spec().params.size(), e.params.size());
    for (const bc::ParamDef& p : e.params) EXPECT_EQ(c->spec().params.count(p.name), 1u) << p.name;
    // CPU kernels for every compressor; CUDA kernels for every one too
    // (compress/cuda/; whether this build has them: CudaDevicesMatch... below).
    EXPECT_TRUE(e.supports(bytecomp::Device::kCpu));
    EXPECT_TRUE(e.supports(bytecomp::Device::kCuda));
  }
  EXPECT_EQ(bc::find_compressor("none"), nullptr);
  EXPECT_EQ(bc::find_compressor("nope"), nullptr);
}

TEST(Catalogue, ParameterRangesAreWhatTheFactoryAccepts) {
  for (const bc::CatalogueEntry& e : bc::catalogue()) {
    for (const bc::ParamDef& p : e.params) {
      SCOPED_TRACE(std::string(e.name) + "." + p.name);
      EXPECT_NO_THROW(bc::make_compressor({e.name, {{p.name, p.default_value}}}));
      std::vector<std::string> bad;
      switch (p.kind) {
        case bc::ParamKind::kRatio: bad = {"0", std::to_string(p.hi * 2), "-0.5"}; break;
        case bc::ParamKind::kUnit:
          bad = {std::to_string(p.lo - 0.5), std::to_string(p.hi + 0.5)};
          break;
        case bc::ParamKind::kInt:
          bad = {std::to_string(static_cast<long long>(p.lo) - 1),
                 std::to_string(static_cast<long long>(p.hi) + 1), "1.5"};
          break;
        case bc::ParamKind::kBool: bad = {"maybe"}; break;
      }
      for (const std::string& v : bad) {
        try {
          bc::make_compressor({e.name, {{p.name, v}}});
          ADD_FAILURE() << "accepted " << p.name << "=" << v;
        } catch (const Error& err) {
          EXPECT_NE(std::string(err.what()).find(p.name), std::string::npos) << err.what();
        }
      }
    }
  }
}

TEST(Catalogue, WireSizeModelMatchesCompressOutput) {
  const size_t sizes[] = {1, 7, 63, 64, 65, 1000, 4097, 65536};
  for (const bc::CatalogueEntry& e : bc::catalogue()) {
    for (const bc::CompressorSpec& spec : sizing_specs(e)) {
      auto c = bc::make_compressor(spec);
      const bc::ParamValues v = bc::param_values(spec);
      for (size_t n : sizes) {
        SCOPED_TRACE(bc::to_string(spec) + " n=" + std::to_string(n));
        const uint64_t model = e.wire_bytes(n, v);
        EXPECT_EQ(bc::wire_bytes(spec, n), model);
        EXPECT_EQ(c->max_compressed_bytes(n), model);
        auto st = c->make_state(n);
        for (uint64_t it = 0; it < 3; ++it) {
          const auto x = gaussian(n, static_cast<uint32_t>(n * 7 + it));
          const size_t got = compress(*c, *st, x, {.iteration = it, .shared_seed = 9}).size();
          if (e.deterministic_size)
            EXPECT_EQ(got, model) << "iteration " << it;
          else
            EXPECT_LE(got, model) << "iteration " << it;
        }
      }
    }
  }
}

TEST(Catalogue, BytesPerElementIsTheModelsSlope) {
  const size_t n = size_t{1} << 20;
  for (const bc::CatalogueEntry& e : bc::catalogue()) {
    for (const bc::CompressorSpec& spec : sizing_specs(e)) {
      SCOPED_TRACE(bc::to_string(spec));
      const double slope = bc::bytes_per_element(spec);
      EXPECT_GT(slope, 0.0);
      if (e.deterministic_size) {
        // Fixed bytes (header, parameters) and rounding stay under 64 bytes.
        const double model = static_cast<double>(bc::wire_bytes(spec, n));
        EXPECT_NEAR(model, slope * static_cast<double>(n), 64.0);
      } else {
        // The model is a bound; the slope is what it sends on average.
        auto c = bc::make_compressor(spec);
        auto st = c->make_state(n);
        const auto x = gaussian(n, 3);
        const double got = static_cast<double>(compress(*c, *st, x).size());
        EXPECT_GE(got, 0.5 * slope * static_cast<double>(n));
        EXPECT_LE(got, static_cast<double>(bc::wire_bytes(spec, n)));
      }
    }
  }
}

TEST(Catalogue, AdditiveEntriesAggregate) {
  const size_t n = 1000;
  for (const bc::CatalogueEntry& e : bc::catalogue()) {
    SCOPED_TRACE(e.name);
    auto c = bc::make_compressor({e.name, {}});
    auto s1 = c->make_state(n), s2 = c->make_state(n);
    const auto a = compress(*c, *s1, gaussian(n, 1), {.shared_seed = 4});
    const auto b = compress(*c, *s2, gaussian(n, 2), {.shared_seed = 4});
    std::vector<std::span<const std::byte>> in = {a, b};
    std::vector<std::byte> out(c->max_compressed_bytes(n));
    if (e.additive)
      EXPECT_GT(c->aggregate(in, out, {.shared_seed = 4}), 0u);
    else
      EXPECT_THROW(c->aggregate(in, out, {.shared_seed = 4}), Error);
  }
}

TEST(Catalogue, ValuesAndNames) {
  std::string names = bc::compressor_names(",");
  size_t count = 1;
  for (char ch : names) count += ch == ',';
  EXPECT_EQ(count, bc::catalogue().size());
  for (const bc::CatalogueEntry& e : bc::catalogue()) {
    bc::ParamValues v = bc::param_values({e.name, {}});
    EXPECT_EQ(v.v.size(), e.params.size()) << e.name;
  }
  EXPECT_THROW(bc::param_values({"nope", {}}), Error);
  EXPECT_THROW(bc::wire_bytes({"topk", {{"ratio", "7"}}}, 10), Error);
}

// The catalogue's device list is what the CUDA library really builds: in a
// build with CUDA every entry marked cuda has kernels, and none without.
TEST(Catalogue, CudaDevicesMatchTheKernelsOfThisBuild) {
  for (const bc::CatalogueEntry& e : bc::catalogue()) {
    EXPECT_EQ(e.supports(bytecomp::Device::kCuda) && bc::cuda::built(), bc::cuda::supported(e.name))
        << e.name;
  }
}
