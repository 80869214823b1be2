// RetiredMappings (core/src/retired_mappings.h): the table of places a moved handle no longer
// backs but the driver still maps. What the pool relies on: a settle unmaps exactly the entries
// it selects, once; an entry the reclaimer is unmapping is waited for, never unmapped twice; a
// failed unmap is retried; a full table says so instead of allocating.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <thread>
#include <vector>

#include "retired_mappings.h"

using namespace gpustitch;
using gpustitch::detail::RetiredMappings;

namespace {

constexpr std::size_t kMiB = 1 << 20;

// The driver as the table sees it: unmap calls by place, and a failure to inject.
struct FakeDriver {
  std::map<DevPtr, int> unmaps;
  Status next = Status::ok;
  Status unmap(DevPtr at, std::size_t) {
    ++unmaps[at];
    const Status s = next;
    next = Status::ok;
    return s;
  }
};

Status settle_range(RetiredMappings& t, FakeDriver& d, DevPtr lo, std::size_t size) {
  return t.settle(
      [&](DevPtr at, std::size_t n, PhysHandle) { return at < lo + size && lo < at + n; },
      [&](DevPtr at, std::size_t n) { return d.unmap(at, n); });
}

}  // namespace

TEST(RetiredMappings, SettleUnmapsExactlyTheOverlappingPlacesOnce) {
  RetiredMappings t;
  FakeDriver d;
  ASSERT_TRUE(t.add(0x1000'0000, 10 * kMiB, 1));
  ASSERT_TRUE(t.add(0x2000'0000, 10 * kMiB, 2));
  ASSERT_TRUE(t.add(0x3000'0000, 10 * kMiB, 3));
  EXPECT_EQ(t.live(), 3u);
  // A range touching the last byte of the second place only.
  EXPECT_EQ(settle_range(t, d, 0x2000'0000 + 10 * kMiB - 2 * kMiB, 4 * kMiB), Status::ok);
  EXPECT_EQ(d.unmaps, (std::map<DevPtr, int>{{0x2000'0000, 1}}));
  EXPECT_EQ(t.live(), 2u);
  // Again: nothing left there.
  EXPECT_EQ(settle_range(t, d, 0x2000'0000, 10 * kMiB), Status::ok);
  EXPECT_EQ(d.unmaps.size(), 1u);
  // By handle, as a release does.
  EXPECT_EQ(t.settle([](DevPtr, std::size_t, PhysHandle h) { return h == 3; },
                     [&](DevPtr at, std::size_t n) { return d.unmap(at, n); }),
            Status::ok);
  EXPECT_EQ(d.unmaps[0x3000'0000], 1);
  EXPECT_EQ(t.live(), 1u);
  std::vector<DevPtr> left;
  t.for_each([&](DevPtr at, std::size_t, PhysHandle) { left.push_back(at); });
  EXPECT_EQ(left, std::vector<DevPtr>{0x1000'0000});
}

TEST(RetiredMappings, FailedUnmapStaysAndIsRetried) {
  RetiredMappings t;
  FakeDriver d;
  ASSERT_TRUE(t.add(0x1000'0000, 2 * kMiB, 1));
  d.next = Status::error;
  EXPECT_EQ(settle_range(t, d, 0x1000'0000, 2 * kMiB), Status::error);
  EXPECT_EQ(t.live(), 1u) << "a place the driver still maps was forgotten";
  EXPECT_EQ(t.waiting(), 1u);
  EXPECT_EQ(settle_range(t, d, 0x1000'0000, 2 * kMiB), Status::ok);
  EXPECT_EQ(d.unmaps[0x1000'0000], 2);
  EXPECT_EQ(t.live(), 0u);
}

TEST(RetiredMappings, FullTableRefusesAndFreedSlotsAreReused) {
  RetiredMappings t;
  FakeDriver d;
  for (std::size_t i = 0; i < RetiredMappings::kCapacity; ++i) {
    ASSERT_TRUE(t.add(0x1000'0000 + i * 2 * kMiB, 2 * kMiB, i + 1)) << i;
  }
  EXPECT_FALSE(t.add(0x9000'0000, 2 * kMiB, 999)) << "the caller must unmap inline";
  EXPECT_EQ(settle_range(t, d, 0x1000'0000, 2 * kMiB), Status::ok);
  EXPECT_TRUE(t.add(0x9000'0000, 2 * kMiB, 999));
  EXPECT_EQ(t.live(), RetiredMappings::kCapacity);
}

TEST(RetiredMappings, ClaimedEntryIsFinishedByTheReclaimerNotUnmappedAgain) {
  RetiredMappings t;
  FakeDriver d;
  ASSERT_TRUE(t.add(0x1000'0000, 2 * kMiB, 1));
  ASSERT_TRUE(t.add(0x2000'0000, 2 * kMiB, 2));
  std::array<RetiredMappings::Claim, 1> claims;
  ASSERT_EQ(t.claim(claims), 1u);  // one at a time: the batch bound
  EXPECT_EQ(t.waiting(), 1u);
  const RetiredMappings::Claim c = claims[0];
  // The reclaimer finishes its claim a little later, without the lock; a settle over that place
  // waits for it and must not unmap it a second time.
  std::atomic<bool> unmapped{false};
  std::thread reclaimer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    unmapped.store(true);
    t.finish(c, Status::ok);
  });
  EXPECT_EQ(settle_range(t, d, c.at, c.size), Status::ok);
  EXPECT_TRUE(unmapped.load()) << "settle returned before the reclaimer's unmap was done";
  reclaimer.join();
  EXPECT_EQ(d.unmaps.count(c.at), 0u);
  EXPECT_EQ(t.live(), 1u);
}

TEST(RetiredMappings, ReclaimerFailureLeavesTheEntryForTheNextSettle) {
  RetiredMappings t;
  FakeDriver d;
  ASSERT_TRUE(t.add(0x1000'0000, 2 * kMiB, 1));
  std::array<RetiredMappings::Claim, 4> claims;
  ASSERT_EQ(t.claim(claims), 1u);
  t.finish(claims[0], Status::error);
  EXPECT_EQ(t.waiting(), 1u);
  EXPECT_EQ(t.settle([](DevPtr, std::size_t, PhysHandle h) { return h == 1; },
                     [&](DevPtr at, std::size_t n) { return d.unmap(at, n); }),
            Status::ok);
  EXPECT_EQ(d.unmaps[0x1000'0000], 1);
  EXPECT_EQ(t.live(), 0u);
}

TEST(RetiredMappings, ClaimsOfAThreadLostInForkGoBackToWaiting) {
  RetiredMappings t;
  FakeDriver d;
  ASSERT_TRUE(t.add(0x1000'0000, 2 * kMiB, 1));
  std::array<RetiredMappings::Claim, 4> claims;
  ASSERT_EQ(t.claim(claims), 1u);
  EXPECT_EQ(t.waiting(), 0u);
  t.forget_claims();  // as in a fork child: no thread will finish it
  EXPECT_EQ(t.waiting(), 1u);
  EXPECT_EQ(settle_range(t, d, 0x1000'0000, 2 * kMiB), Status::ok);  // does not wait forever
  EXPECT_EQ(d.unmaps[0x1000'0000], 1);
}
