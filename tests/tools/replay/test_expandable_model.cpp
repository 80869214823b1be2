// The expandable-segments model makes PyTorch's expandable_segments:True decisions: whole pages
// mapped per pool, blocks cut at 512 B, merging over the whole range, best fit that keeps the
// growable tail, the lowest place on a miss, no sharing between streams, and unmapping free
// pages only when an allocation would otherwise fail.
#include <gtest/gtest.h>

#include "expandable_policy.h"
#include "policy.h"

using namespace gpustitch;
using namespace gpustitch::replay;

namespace {
constexpr Stream kS = 1;
}

TEST(ExpandableModel, FreedNeighboursMergeAndServeTheirCombinedSizeWithoutMapping) {
  ExpandableSegmentsModel m(1 * GiB);
  std::uint64_t a = m.allocate(6 * MiB, kS);
  std::uint64_t b = m.allocate(6 * MiB, kS);
  std::uint64_t c = m.allocate(6 * MiB, kS);
  ASSERT_EQ(b, a + 6 * MiB);
  ASSERT_EQ(c, b + 6 * MiB);
  ASSERT_EQ(m.reserved(), 20 * MiB);
  const std::uint64_t maps = m.maps();
  m.free(a);
  m.free(b);
  // Only the merged 12 MiB block holds the request; without merging it would go to the 2 MiB
  // tail and map another page.
  EXPECT_EQ(m.allocate(12 * MiB, kS), a);
  EXPECT_EQ(m.reserved(), 20 * MiB);
  EXPECT_EQ(m.maps(), maps);
}

TEST(ExpandableModel, BlocksAreCutAt512BytesNotRoundedToPages) {
  ExpandableSegmentsModel m(1 * GiB);
  std::uint64_t a = m.allocate(19 * MiB + 512 * KiB, kS);
  ASSERT_NE(a, 0u);
  // The default allocator would hand out the whole 20 MiB segment (remainder <= 1 MiB).
  EXPECT_EQ(m.allocated(), 19 * MiB + 512 * KiB);
  EXPECT_EQ(m.reserved(), 20 * MiB);
  // The free 512 KiB tail and one new page hold the next request, right after the first.
  EXPECT_EQ(m.allocate(2 * MiB, kS), a + 19 * MiB + 512 * KiB);
  EXPECT_EQ(m.reserved(), 40 * MiB);
  // Small requests are rounded to 512 B and packed back to back in 2 MiB pages.
  std::uint64_t s = m.allocate(1000, kS);
  EXPECT_EQ(m.allocate(1, kS), s + 1024);
  EXPECT_EQ(ExpandableSegmentsModel::round_size(1), 512u);
  EXPECT_EQ(ExpandableSegmentsModel::round_size(513), 1024u);
  EXPECT_EQ(m.reserved(), 42 * MiB);
}

TEST(ExpandableModel, ReservedGrowsByWhole20MiBPages) {
  ExpandableSegmentsModel m(1 * GiB);
  std::uint64_t a = m.allocate(50 * MiB, kS);
  ASSERT_NE(a, 0u);
  EXPECT_EQ(m.reserved(), 60 * MiB);  // three pages, not the 50 MiB the default would take
  EXPECT_EQ(m.allocate(10 * MiB, kS), a + 50 * MiB);  // the rest of the third page
  EXPECT_EQ(m.reserved(), 60 * MiB);
  EXPECT_NE(m.allocate(1 * MiB, kS), 0u);  // the small pool maps 2 MiB pages
  EXPECT_EQ(m.reserved(), 62 * MiB);
  EXPECT_EQ(m.peak_reserved(), 62 * MiB);
  EXPECT_EQ(m.segments(), 2u);  // one range per pool
}

TEST(ExpandableModel, BestFitPassesOverTheTailThatCanGrow) {
  ExpandableSegmentsModel m(1 * GiB);
  std::uint64_t a = m.allocate(8 * MiB, kS);
  ASSERT_NE(m.allocate(2 * MiB, kS), 0u);
  ASSERT_NE(m.allocate(6 * MiB, kS), 0u);
  m.free(a);  // free: a at 8 MiB, and the 4 MiB tail before the unmapped space
  // Plain best fit would take the 4 MiB tail; PyTorch ranks the tail by what it could grow to.
  EXPECT_EQ(m.allocate(3 * MiB, kS), a);
  EXPECT_EQ(m.reserved(), 20 * MiB);
}

TEST(ExpandableModel, StreamsDoNotShareFreeSpace) {
  ExpandableSegmentsModel m(1 * GiB);
  std::uint64_t a = m.allocate(5 * MiB, 1);
  m.free(a);
  std::uint64_t b = m.allocate(5 * MiB, 2);
  ASSERT_NE(b, 0u);
  EXPECT_NE(b, a);
  EXPECT_EQ(m.reserved(), 40 * MiB);
  EXPECT_EQ(m.segments(), 2u);
  EXPECT_EQ(m.allocate(5 * MiB, 1), a);  // stream 1's own free block is still there
  EXPECT_EQ(m.reserved(), 40 * MiB);
}

TEST(ExpandableModel, AtCapacityFreePagesAreUnmappedAndTheRequestSucceeds) {
  ExpandableSegmentsModel m(80 * MiB);
  std::uint64_t a = m.allocate(30 * MiB, 1);
  ASSERT_NE(m.allocate(10 * MiB, 1), 0u);  // pages 0-1; page 1 holds a's end and this block
  ASSERT_EQ(m.reserved(), 40 * MiB);
  m.free(a);
  // 40 + 60 MiB would exceed the device: page 0 (wholly free) is unmapped, page 1 is not.
  EXPECT_NE(m.allocate(60 * MiB, 2), 0u);
  EXPECT_EQ(m.reserved(), 80 * MiB);
  EXPECT_EQ(m.unmaps(), 1u);
  EXPECT_EQ(m.peak_reserved(), 80 * MiB);
}

TEST(ExpandableModel, AnUnmappedGapIsTheLowestPlaceAndIsMappedAgain) {
  ExpandableSegmentsModel m(100 * MiB);
  std::uint64_t a = m.allocate(20 * MiB, 1);
  std::uint64_t b = m.allocate(20 * MiB, 1);
  ASSERT_NE(m.allocate(20 * MiB, 1), 0u);
  m.free(b);
  std::uint64_t other = m.allocate(60 * MiB, 2);  // unmaps b's page
  ASSERT_NE(other, 0u);
  ASSERT_EQ(m.reserved(), 100 * MiB);
  m.free(other);
  // The gap at b is lower than the end of stream 1's range; stream 2's free pages make room.
  EXPECT_EQ(m.allocate(20 * MiB, 1), a + 20 * MiB);
  EXPECT_EQ(m.reserved(), 60 * MiB);
}

TEST(ExpandableModel, DemandBeyondCapacityIsOutOfMemory) {
  ExpandableSegmentsModel m(100 * MiB);
  std::uint64_t a = m.allocate(60 * MiB, kS);
  ASSERT_NE(a, 0u);
  EXPECT_EQ(m.allocate(50 * MiB, kS), 0u);  // 60 + 60 MiB of pages, nothing free to unmap
  EXPECT_EQ(m.reserved(), 60 * MiB);
  EXPECT_EQ(m.allocated(), 60 * MiB);
  m.free(a);
  // The free 60 MiB and 40 MiB mapped after them make one 100 MiB block at the range's start.
  EXPECT_EQ(m.allocate(100 * MiB, kS), a);
  EXPECT_EQ(m.reserved(), 100 * MiB);
  EXPECT_EQ(m.unmaps(), 0u);
  EXPECT_EQ(m.allocate(1 * MiB, kS), 0u);  // the small pool has no page left either
}

TEST(ExpandableModel, PolicyIsRegisteredDefaultOnAndHonoursTheEnvironment) {
  const PolicySpec* spec = find_policy("expandable-segments");
  ASSERT_NE(spec, nullptr);
  EXPECT_TRUE(spec->default_on);
  PolicyEnv env;
  env.devices = 2;
  env.capacity = 100 * MiB;
  std::string why;
  auto p = spec->make(env, &why);
  ASSERT_NE(p, nullptr) << why;
  EXPECT_EQ(p->name(), "expandable-segments");
  std::uint64_t h0 = 0, h1 = 0;
  ASSERT_TRUE(p->allocate(0, 70 * MiB, kS, &h0));
  ASSERT_TRUE(p->allocate(1, 70 * MiB, kS, &h1));  // its own 100 MiB
  EXPECT_EQ(p->reserved(0), 80 * MiB);
  EXPECT_EQ(p->reserved(1), 80 * MiB);
  std::uint64_t h = 0;
  EXPECT_FALSE(p->allocate(0, 40 * MiB, kS, &h));  // would need 120 MiB on device 0
  EXPECT_FALSE(p->allocate(2, 1 * MiB, kS, &h));   // no third device
  p->deallocate(0, h0, 70 * MiB, kS);
  EXPECT_EQ(p->reserved(0), 80 * MiB);  // cached, not unmapped
  EXPECT_EQ(p->peak_reserved(0), 80 * MiB);
}
