// common/types.h: the one Device and DType vocabulary.
#include "common/types.h"

#include <gtest/gtest.h>

#include <iterator>
#include <set>
#include <string>

namespace bytecomp {
namespace {

TEST(Types, EveryDTypeHasANameAndASize) {
  struct Row {
    DType dtype;
    const char* name;
    size_t size;
  };
  const Row rows[] = {{DType::kFloat32, "float32", 4}, {DType::kFloat16, "float16", 2},
                      {DType::kBFloat16, "bfloat16", 2}, {DType::kFloat64, "float64", 8},
                      {DType::kInt32, "int32", 4},     {DType::kInt64, "int64", 8}};
  static_assert(std::size(rows) == kNumDTypeValues);
  std::set<std::string> names;
  for (const Row& r : rows) {
    EXPECT_STREQ(dtype_name(r.dtype), r.name);
    EXPECT_EQ(to_string(r.dtype), r.name);
    EXPECT_EQ(dtype_size(r.dtype), r.size) << r.name;
    names.insert(r.name);
  }
  EXPECT_EQ(names.size(), std::size(rows));
  // A value outside the enumeration (e.g. read from a corrupted buffer
  // without a check) is named, not undefined.
  EXPECT_EQ(dtype_size(static_cast<DType>(200)), 0u);
  EXPECT_STREQ(dtype_name(static_cast<DType>(200)), "unknown-dtype");
}

TEST(Types, Devices) {
  EXPECT_EQ(static_cast<int>(Device::kCpu), 0);
  EXPECT_EQ(static_cast<int>(Device::kCuda), 1);
  EXPECT_EQ(to_string(Device::kCpu), "cpu");
  EXPECT_EQ(to_string(Device::kCuda), "cuda");
  EXPECT_EQ(to_string(static_cast<Device>(9)), "unknown-device");
  static_assert(to_string(Device::kCuda) == "cuda");  // usable in constant expressions
}

}  // namespace
}  // namespace bytecomp
