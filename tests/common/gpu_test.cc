#include "common/gpu.h"

#include <gtest/gtest.h>

#include "bytecomp_build_config.h"

namespace {

TEST(Gpu, BuildFlagsMatchConfiguration) {
  EXPECT_EQ(bytecomp::gpu::built_with_cuda(), BYTECOMP_HAVE_CUDA != 0);
  EXPECT_EQ(bytecomp::gpu::built_with_nccl(), BYTECOMP_HAVE_NCCL != 0);
  EXPECT_FALSE(bytecomp::gpu::describe().empty());
}

TEST(Gpu, NcclLinksAndReportsVersion) {
  if (!bytecomp::gpu::built_with_nccl()) GTEST_SKIP() << "built without NCCL";
  std::string v = bytecomp::gpu::nccl_version();
  EXPECT_FALSE(v.empty());
  EXPECT_EQ(v[0] >= '2', true) << v;
}

TEST(Gpu, DeviceProperties) {
  if (bytecomp::gpu::device_count() == 0)
    GTEST_SKIP() << "no CUDA device: " << bytecomp::gpu::describe();
  EXPECT_NE(bytecomp::gpu::describe().find("sm_"), std::string::npos);
}

}  // namespace
