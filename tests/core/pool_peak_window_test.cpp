// Pool::peaks_since_reset and its resets: the high-water marks PyTorch reads as
// max_memory_allocated/max_memory_reserved and restarts with reset_peak_memory_stats, beside the
// lifetime peaks that never reset.
#include <gtest/gtest.h>

#include "gpustitch/pool.h"
#include "test_device.h"

using namespace gpustitch;

TEST(PoolPeakWindow, ResetRestartsAtTheCurrentFigureAndKeepsTheLifetimePeak) {
  TestDevice dev = make_test_device();
  Pool pool(*dev.backend, inline_config());
  DevPtr big = 0, small = 0;
  ASSERT_EQ(pool.allocate(0, 256 * MiB, kAnyStream, &big), Status::ok);
  ASSERT_EQ(pool.allocate(0, 4 * MiB, kAnyStream, &small), Status::ok);
  const DeviceStats at_peak = pool.stats(0);
  PeakWindow w = pool.peaks_since_reset(0);
  EXPECT_EQ(w.allocated, at_peak.bytes_allocated);
  EXPECT_EQ(w.reserved, at_peak.bytes_reserved);
  ASSERT_EQ(pool.deallocate(big), Status::ok);
  // Freed but not reset: the marks stay at the peak.
  w = pool.peaks_since_reset(0);
  EXPECT_EQ(w.allocated, at_peak.bytes_allocated);
  EXPECT_GE(w.reserved, at_peak.bytes_reserved);

  pool.reset_peak_allocated(0);
  const DeviceStats after_free = pool.stats(0);
  w = pool.peaks_since_reset(0);
  EXPECT_EQ(w.allocated, after_free.bytes_allocated);
  EXPECT_LT(w.allocated, at_peak.bytes_allocated);
  EXPECT_GE(w.reserved, at_peak.bytes_reserved);  // only the allocated mark was reset

  pool.trim(0);
  pool.reset_peak_reserved(0);
  const DeviceStats trimmed = pool.stats(0);
  EXPECT_LT(trimmed.bytes_reserved, at_peak.bytes_reserved);
  w = pool.peaks_since_reset(0);
  EXPECT_EQ(w.reserved, trimmed.bytes_reserved);
  // The lifetime peaks are untouched by either reset.
  EXPECT_EQ(trimmed.peak_allocated, at_peak.peak_allocated);
  EXPECT_GE(trimmed.peak_reserved, at_peak.bytes_reserved);

  // A new allocation after the reset raises the window again, to exactly the new high.
  DevPtr again = 0;
  ASSERT_EQ(pool.allocate(0, 64 * MiB, kAnyStream, &again), Status::ok);
  const DeviceStats now = pool.stats(0);
  w = pool.peaks_since_reset(0);
  EXPECT_EQ(w.allocated, now.bytes_allocated);
  EXPECT_EQ(w.reserved, now.bytes_reserved);
  EXPECT_LT(w.allocated, at_peak.bytes_allocated);
  ASSERT_EQ(pool.deallocate(again), Status::ok);
  ASSERT_EQ(pool.deallocate(small), Status::ok);

  EXPECT_EQ(pool.peaks_since_reset(99).allocated, 0u);  // no such device
}

// Small allocations are served by the calling thread's arena without the device lock: a reset
// must still see them, and the window must follow them up again.
TEST(PoolPeakWindow, ArenaServedAllocationsCount) {
  TestDevice dev = make_test_device();
  Pool pool(*dev.backend, inline_config());
  DevPtr p[64] = {};
  for (DevPtr& x : p) ASSERT_EQ(pool.allocate(0, 4096, 1, &x), Status::ok);
  const std::uint64_t high = pool.stats(0).bytes_allocated;
  EXPECT_EQ(pool.peaks_since_reset(0).allocated, high);
  for (int i = 0; i < 32; ++i) ASSERT_EQ(pool.deallocate(p[i], 1), Status::ok);
  pool.reset_peak_allocated(0);
  const std::uint64_t half = pool.stats(0).bytes_allocated;
  EXPECT_LT(half, high);
  EXPECT_EQ(pool.peaks_since_reset(0).allocated, half);
  for (int i = 0; i < 32; ++i) ASSERT_EQ(pool.allocate(0, 4096, 1, &p[i]), Status::ok);
  EXPECT_EQ(pool.peaks_since_reset(0).allocated, high);
  for (DevPtr x : p) ASSERT_EQ(pool.deallocate(x, 1), Status::ok);
}
