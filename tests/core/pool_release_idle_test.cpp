// Pool::release_idle: what another process's request for memory may take from this pool (idle,
// fenced cache only) and what it must never touch (live blocks, their bytes).
#include <gtest/gtest.h>

#include <vector>

#include "gpustitch/pool.h"
#include "test_device.h"

using namespace gpustitch;

namespace {

struct TrimCounter : PoolObserver {
  std::vector<PoolEvent> trims;
  void on_event(const PoolEvent& e) noexcept override {
    if (e.kind == EventKind::trim) trims.push_back(e);
  }
};

void fill(TestDevice& d, DevPtr p, std::size_t size, unsigned char v) {
  std::vector<unsigned char> buf(size, v);
  d.write(p, buf.data(), size);
}
bool holds(TestDevice& d, DevPtr p, std::size_t size, unsigned char v) {
  std::vector<unsigned char> buf(size);
  d.read(p, buf.data(), size);
  for (unsigned char c : buf)
    if (c != v) return false;
  return true;
}

}  // namespace

TEST(PoolReleaseIdle, ReleasesAboutWhatIsAskedAndKeepsLiveBytes) {
  TestDevice dev = make_test_device();
  if (dev.sim == nullptr) GTEST_SKIP() << "needs the simulated device's usage accounting";
  TrimCounter obs;
  Config config = inline_config();
  config.fresh_handles = 0;  // handles of 2 MiB, so that "about" is within one handle
  Pool pool(*dev.backend, config, &obs);
  // Four idle 64 MiB blocks and two live ones.
  std::vector<DevPtr> idle, live;
  for (int i = 0; i < 6; ++i) {
    DevPtr p = 0;
    ASSERT_EQ(pool.allocate(0, 64 * MiB, kAnyStream, &p), Status::ok);
    (i < 4 ? idle : live).push_back(p);
  }
  fill(dev, live[0], 1 * MiB, 0xA5);
  fill(dev, live[1] + 63 * MiB, 1 * MiB, 0x5A);
  for (DevPtr p : idle) ASSERT_EQ(pool.deallocate(p), Status::ok);
  pool.drain_pending(0);
  const std::size_t used_before = dev.sim->used(0);
  const DeviceStats before = pool.stats(0);

  // 100 MiB wanted: about that goes (whole handles of 2 MiB), not all 256 MiB.
  const std::size_t got = pool.release_idle(0, 100 * MiB);
  EXPECT_GE(got, 100 * MiB);
  EXPECT_LE(got, 100 * MiB + 2 * MiB);
  EXPECT_EQ(dev.sim->used(0), used_before - got);
  const DeviceStats after = pool.stats(0);
  EXPECT_EQ(after.bytes_reserved, before.bytes_reserved - got);
  EXPECT_EQ(after.bytes_allocated, before.bytes_allocated);
  EXPECT_EQ(after.trims, before.trims + 1);
  EXPECT_EQ(after.trimmed_bytes, before.trimmed_bytes + got);
  ASSERT_EQ(obs.trims.size(), 1u);
  EXPECT_EQ(obs.trims[0].size, got);
  EXPECT_EQ(pool.validate(0), "");
  EXPECT_TRUE(holds(dev, live[0], 1 * MiB, 0xA5));
  EXPECT_TRUE(holds(dev, live[1] + 63 * MiB, 1 * MiB, 0x5A));

  // More than is idle: the rest of the cache, and never a live block.
  EXPECT_EQ(pool.release_idle(0, 10 * GiB), 256 * MiB - got);
  EXPECT_EQ(pool.release_idle(0, 10 * GiB), 0u);
  EXPECT_EQ(pool.stats(0).bytes_reserved, 128 * MiB);
  EXPECT_TRUE(holds(dev, live[0], 1 * MiB, 0xA5));
  EXPECT_TRUE(holds(dev, live[1] + 63 * MiB, 1 * MiB, 0x5A));
  EXPECT_TRUE(pool.find(live[0]));
  EXPECT_TRUE(pool.find(live[1]));
  for (DevPtr p : live) EXPECT_EQ(pool.deallocate(p), Status::ok);
}

// Whole handles go, the smallest that covers what is still wanted, so little more than asked
// leaves the cache.
TEST(PoolReleaseIdle, ReleasesLittleMoreThanAsked) {
  TestDevice dev = make_test_device();
  if (dev.sim == nullptr) GTEST_SKIP() << "needs the simulated device's usage accounting";
  Config config = inline_config();
  config.fresh_handles = 64;  // the layout below: 1/64 of each block, at least 2 MiB
  config.handle_share = 0;
  Pool pool(*dev.backend, config);
  std::vector<DevPtr> ptrs;
  for (std::size_t mb : {256, 32, 64}) {
    DevPtr p = 0;
    ASSERT_EQ(pool.allocate(0, mb * MiB, kAnyStream, &p), Status::ok);
    ptrs.push_back(p);
  }
  for (DevPtr p : ptrs) ASSERT_EQ(pool.deallocate(p), Status::ok);
  pool.drain_pending(0);
  // 352 MiB idle in handles of 2 MiB (the 32 and 64 MiB blocks) and 4 MiB (the 256 MiB one).
  const std::size_t first = pool.release_idle(0, 40 * MiB);
  EXPECT_GE(first, 40 * MiB);
  EXPECT_LE(first, 44 * MiB);
  const std::size_t second = pool.release_idle(0, 300 * MiB);
  EXPECT_GE(second, 300 * MiB);
  EXPECT_LE(second, 304 * MiB);
  EXPECT_EQ(pool.stats(0).bytes_reserved, 352 * MiB - first - second);
}

TEST(PoolReleaseIdle, ZeroOrNothingIdleReleasesNothing) {
  TestDevice dev = make_test_device();
  Pool pool(*dev.backend, inline_config());
  DevPtr p = 0;
  ASSERT_EQ(pool.allocate(0, 32 * MiB, kAnyStream, &p), Status::ok);
  const DeviceStats before = pool.stats(0);
  EXPECT_EQ(pool.release_idle(0, 0), 0u);
  EXPECT_EQ(pool.release_idle(0, 1 * GiB), 0u);  // the only block is live
  EXPECT_EQ(pool.release_idle(7, 1 * GiB), 0u);  // no such device
  EXPECT_EQ(pool.stats(0).trims, before.trims);
  EXPECT_EQ(pool.stats(0).bytes_reserved, before.bytes_reserved);
  EXPECT_EQ(pool.deallocate(p), Status::ok);
}

TEST(PoolReleaseIdle, PendingFreesAreReleasedOnlyAfterTheirFence) {
  TestDevice dev = make_test_device();
  if (dev.sim == nullptr) GTEST_SKIP() << "needs hold_device";
  Pool pool(*dev.backend, inline_config());
  DevPtr p = 0;
  ASSERT_EQ(pool.allocate(0, 64 * MiB, kAnyStream, &p), Status::ok);
  ASSERT_EQ(pool.deallocate(p), Status::ok);  // pending: device work may still use it
  EXPECT_EQ(pool.stats(0).bytes_pending, 64 * MiB);
  // The fence completes (the simulated device is idle): then the memory may go.
  EXPECT_EQ(pool.release_idle(0, 64 * MiB), 64 * MiB);
  EXPECT_EQ(dev.sim->used(0), 0u);
}
