#include "common/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <numeric>
#include <stdexcept>
#include <vector>

namespace {

class ThreadPoolTest : public testing::TestWithParam<size_t> {};

TEST_P(ThreadPoolTest, ParallelForCoversEveryIndexOnce) {
  bytecomp::ThreadPool pool(GetParam());
  for (size_t n : {0ul, 1ul, 7ul, 1000ul, 100003ul}) {
    std::vector<std::atomic<int>> hits(n);
    pool.parallel_for(n, 16, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) hits[i]++;
    });
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n=" << n << " i=" << i;
  }
}

TEST_P(ThreadPoolTest, ExceptionPropagatesAfterAllChunks) {
  bytecomp::ThreadPool pool(GetParam());
  std::atomic<size_t> done{0};
  EXPECT_THROW(pool.parallel_for(1000, 10, [&](size_t b, size_t e) {
    done += e - b;
    if (b == 0) throw std::runtime_error("boom");
  }, 8), std::runtime_error);
  EXPECT_EQ(done.load(), 1000u);
}

TEST_P(ThreadPoolTest, NestedParallelForDoesNotDeadlock) {
  bytecomp::ThreadPool pool(GetParam());
  std::atomic<long> sum{0};
  pool.parallel_for(8, 1, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i)
      pool.parallel_for(100, 10, [&](size_t b2, size_t e2) {
        sum += static_cast<long>(e2 - b2);
      });
  });
  EXPECT_EQ(sum.load(), 800);
}

INSTANTIATE_TEST_SUITE_P(Sizes, ThreadPoolTest, testing::Values(0u, 1u, 3u));

}  // namespace
