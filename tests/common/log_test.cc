#include "common/log.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include "common/error.h"

namespace bl = bytecomp::log;

namespace {

TEST(Log, SpecSetsDefaultAndPerCategoryLevels) {
  bl::Category& a = bl::category("test-a");
  bl::Category& b = bl::category("test-b");
  bl::configure("warn,test-b=debug");
  EXPECT_FALSE(a.enabled(bl::Level::kInfo));
  EXPECT_TRUE(a.enabled(bl::Level::kWarn));
  EXPECT_TRUE(b.enabled(bl::Level::kDebug));
  EXPECT_FALSE(b.enabled(bl::Level::kTrace));
  // A category created later picks up the spec.
  EXPECT_EQ(bl::category("test-b").level(), bl::Level::kDebug);
  EXPECT_EQ(bl::category("test-late").level(), bl::Level::kWarn);
}

TEST(Log, BadSpecChangesNothing) {
  bl::configure("info,test-c=error");
  EXPECT_THROW(bl::configure("debug,test-c=loud"), bytecomp::Error);
  EXPECT_EQ(bl::category("test-c").level(), bl::Level::kError);
  EXPECT_EQ(bl::category("test-other").level(), bl::Level::kInfo);
}

TEST(Log, EnvironmentWinsAndNamesItself) {
  bl::configure("info");
  setenv("BYTECOMP_LOG", "test-d=trace", 1);
  bl::configure_from_env();
  EXPECT_TRUE(bl::category("test-d").enabled(bl::Level::kTrace));
  setenv("BYTECOMP_LOG", "nonsense", 1);
  try {
    bl::configure_from_env();
    FAIL() << "expected an error";
  } catch (const bytecomp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("BYTECOMP_LOG"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("'nonsense'"), std::string::npos);
  }
  unsetenv("BYTECOMP_LOG");
}

int side_effects = 0;
int touch() { return ++side_effects; }

TEST(Log, DisabledStatementDoesNotEvaluate) {
  bl::configure("info,test-e=error");
  BC_LOG(bl::category("test-e"), kDebug) << touch();
  EXPECT_EQ(side_effects, 0);
  testing::internal::CaptureStderr();
  BC_LOG(bl::category("test-e"), kError) << "value=" << touch();
  std::string out = testing::internal::GetCapturedStderr();
  EXPECT_EQ(side_effects, 1);
  EXPECT_NE(out.find("ERROR test-e: value=1\n"), std::string::npos) << out;
  EXPECT_EQ(out[4], '-');  // starts with an ISO-8601 timestamp
}

}  // namespace
