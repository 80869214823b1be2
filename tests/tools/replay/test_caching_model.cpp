// The PyTorch caching-allocator model makes PyTorch's decisions: segment sizes per pool, block
// splitting and merging, best fit per stream, max_split_size, and releasing cached segments
// before reporting out-of-memory -- which fails when a live block pins a segment.
#include <gtest/gtest.h>

#include "caching_policy.h"

using namespace gpustitch;
using namespace gpustitch::replay;

namespace {
constexpr Stream kS = 1;
}

TEST(CachingModel, SmallRequestsShareTwoMiBSegments) {
  CachingAllocatorModel m(1 * GiB);
  for (int i = 0; i < 11; ++i) ASSERT_NE(m.allocate(100 * KiB, kS), 0u);
  EXPECT_EQ(m.reserved(), 2 * MiB);
  EXPECT_EQ(m.segments(), 1u);
  EXPECT_EQ(m.allocated(), 11 * 100 * KiB);
  EXPECT_EQ(CachingAllocatorModel::round_size(1), 512u);
  EXPECT_EQ(CachingAllocatorModel::round_size(513), 1024u);
}

TEST(CachingModel, MediumRequestsSplitA20MiBSegment) {
  CachingAllocatorModel m(1 * GiB);
  for (int i = 0; i < 4; ++i) ASSERT_NE(m.allocate(5 * MiB, kS), 0u);
  EXPECT_EQ(m.reserved(), 20 * MiB);
  ASSERT_NE(m.allocate(5 * MiB, kS), 0u);
  EXPECT_EQ(m.reserved(), 40 * MiB);
  EXPECT_EQ(m.segments(), 2u);
}

TEST(CachingModel, LargeRequestsAreRoundedTo2MiB) {
  CachingAllocatorModel m(1 * GiB);
  ASSERT_NE(m.allocate(11 * MiB, kS), 0u);
  EXPECT_EQ(m.reserved(), 12 * MiB);
}

// A request of 2^64 - 1 bytes (a hostile or corrupt trace) used to wrap around in the rounding
// and be served from a 2 MiB segment.
TEST(CachingModel, RequestsLargerThanTheDeviceAreOutOfMemory) {
  for (std::size_t divisions : {0u, 4u}) {
    CachingAllocatorModel m(1 * GiB, CachingOptions{SIZE_MAX, divisions, 0});
    for (std::size_t request : {SIZE_MAX, SIZE_MAX - 511, SIZE_MAX / 2 + 1, 1 * GiB + 1}) {
      EXPECT_EQ(m.allocate(request, kS), 0u) << request << " divisions " << divisions;
      EXPECT_EQ(m.reserved(), 0u);
      EXPECT_EQ(m.allocated(), 0u);
    }
    EXPECT_NE(m.allocate(1 * GiB, kS), 0u) << "the whole device still fits";
  }
}

TEST(CachingModel, ALiveBlockPinsItsSegmentAndCausesOutOfMemory) {
  CachingAllocatorModel m(40 * MiB);
  std::uint64_t a = m.allocate(5 * MiB, kS);
  std::uint64_t b = m.allocate(5 * MiB, kS);
  ASSERT_NE(a, 0u);
  ASSERT_NE(b, 0u);
  m.free(a);
  // 35 MiB are not allocated, but the 20 MiB segment cannot go back while b lives in it.
  EXPECT_EQ(m.allocate(30 * MiB, kS), 0u);
  EXPECT_EQ(m.reserved(), 20 * MiB);
  m.free(b);
  // Now the whole segment is free: it is released and the retry succeeds.
  EXPECT_NE(m.allocate(30 * MiB, kS), 0u);
  EXPECT_EQ(m.reserved(), 30 * MiB);
}

TEST(CachingModel, FreedNeighboursMergeAndServeLargerRequests) {
  CachingAllocatorModel m(1 * GiB);
  std::uint64_t a = m.allocate(3 * MiB, kS);
  std::uint64_t b = m.allocate(3 * MiB, kS);
  std::uint64_t c = m.allocate(3 * MiB, kS);
  ASSERT_EQ(b, a + 3 * MiB);
  ASSERT_EQ(c, b + 3 * MiB);
  m.free(b);
  m.free(a);
  std::uint64_t d = m.allocate(6 * MiB, kS);
  EXPECT_EQ(d, a);  // best fit: the merged 6 MiB block, not the 11 MiB tail
  EXPECT_EQ(m.reserved(), 20 * MiB);
}

TEST(CachingModel, MaxSplitSizeKeepsOversizeBlocksForOversizeRequests) {
  CachingAllocatorModel m(1 * GiB, 8 * MiB);
  std::uint64_t big = m.allocate(16 * MiB, kS);
  ASSERT_NE(big, 0u);
  m.free(big);
  EXPECT_NE(m.allocate(2 * MiB, kS), 0u);  // not carved out of the cached 16 MiB block
  EXPECT_EQ(m.reserved(), 36 * MiB);
  EXPECT_EQ(m.allocate(16 * MiB, kS), big);  // that one is reused whole
  EXPECT_EQ(m.reserved(), 36 * MiB);
}

TEST(CachingModel, BlocksAreNotSharedAcrossStreams) {
  CachingAllocatorModel m(1 * GiB);
  std::uint64_t a = m.allocate(5 * MiB, 1);
  m.free(a);
  EXPECT_NE(m.allocate(5 * MiB, 2), 0u);
  EXPECT_EQ(m.reserved(), 40 * MiB);
}
