// Fault injection on the paths that give memory back: a failure of unmap, release or unreserve
// in the middle of Pool::trim (or of the release a threshold triggers on free) must leave the
// pool consistent: its statistics match what the device really holds, a later trim gives
// everything back, the memory can be allocated again, and nothing leaks when the pool goes.
#include <gtest/gtest.h>

#include <vector>

#include "gpustitch/pool.h"
#include "test_device.h"

using namespace gpustitch;

namespace {

struct Case {
  SimOp op;
  const char* name;
};

class PoolTrimFault : public ::testing::TestWithParam<Case> {};

// Fills the pool's cache with plain views and one stitched view (built from eight freed 64 MiB
// blocks), all idle, so that a trim tears down both kinds.
void fill_cache(Pool& pool) {
  std::vector<DevPtr> blocks(16);
  for (auto& b : blocks) ASSERT_EQ(pool.allocate(0, 64 * MiB, kAnyStream, &b), Status::ok);
  for (std::size_t i = 0; i < blocks.size(); i += 2)
    ASSERT_EQ(pool.deallocate(blocks[i]), Status::ok);
  pool.drain_pending(0);
  DevPtr big = 0;
  ASSERT_EQ(pool.allocate(0, 512 * MiB, kAnyStream, &big), Status::ok);
  ASSERT_EQ(pool.stats(0).stitches, 1u);
  ASSERT_EQ(pool.deallocate(big), Status::ok);
  for (std::size_t i = 1; i < blocks.size(); i += 2)
    ASSERT_EQ(pool.deallocate(blocks[i]), Status::ok);
  pool.drain_pending(0);
}

TEST_P(PoolTrimFault, TrimStaysConsistentAndRecovers) {
  const SimOp op = GetParam().op;
  for (std::uint64_t nth = 1; nth <= 8; ++nth) {
    SCOPED_TRACE(std::string(GetParam().name) + " nth " + std::to_string(nth));
    TestDevice dev = make_test_device({.capacity = 1 * GiB});
    if (dev.sim == nullptr) GTEST_SKIP();
    Config cfg;
    cfg.background_reclaim = false;
    {
      Pool pool(*dev.backend, cfg);
      fill_cache(pool);
      ASSERT_EQ(dev.sim->used(0), 1 * GiB);

      dev.sim->fail_nth(op, nth, Status::error);
      std::size_t released = pool.trim(0);
      dev.sim->fail_nth(op, 0);
      // What the pool reports as held is what the device holds, and what it says it released
      // was released.
      EXPECT_EQ(pool.stats(0).bytes_reserved, dev.sim->used(0));
      EXPECT_EQ(released, 1 * GiB - dev.sim->used(0));

      // A later trim (no fault) gives back everything that is left.
      pool.trim(0);
      EXPECT_EQ(dev.sim->used(0), 0u);
      EXPECT_EQ(pool.stats(0).bytes_reserved, 0u);
      EXPECT_EQ(dev.sim->live_mappings(), 0u);
      EXPECT_EQ(dev.sim->live_reservations(), pool.stats(0).views);  // the address space

      // And the whole device can be allocated again, bytes intact.
      DevPtr all = 0;
      ASSERT_EQ(pool.allocate(0, 1 * GiB, kAnyStream, &all), Status::ok);
      std::uint64_t tag = 0x5eed, got = 0;
      dev.write(all + 1 * GiB - 8, &tag, 8);
      dev.read(all + 1 * GiB - 8, &got, 8);
      EXPECT_EQ(got, tag);
      ASSERT_EQ(pool.deallocate(all), Status::ok);
    }
    EXPECT_EQ(dev.sim->live_handles(), 0u);
    EXPECT_EQ(dev.sim->live_mappings(), 0u);
    EXPECT_EQ(dev.sim->live_reservations(), 0u);
  }
}

// release_threshold_mb: a free that takes the cache over the threshold releases memory inline.
// A failure there is invisible to the caller of free (the free itself succeeded), and the pool
// stays consistent.
TEST_P(PoolTrimFault, ThresholdReleaseOnFree) {
  const SimOp op = GetParam().op;
  for (std::uint64_t nth = 1; nth <= 4; ++nth) {
    SCOPED_TRACE(std::string(GetParam().name) + " nth " + std::to_string(nth));
    TestDevice dev = make_test_device({.capacity = 1 * GiB});
    if (dev.sim == nullptr) GTEST_SKIP();
    Config cfg;
    cfg.background_reclaim = false;
    cfg.release_threshold = 0;
    {
      Pool pool(*dev.backend, cfg);
      std::vector<DevPtr> blocks(4);
      for (auto& b : blocks) ASSERT_EQ(pool.allocate(0, 128 * MiB, kAnyStream, &b), Status::ok);
      dev.sim->fail_nth(op, nth, Status::error);
      for (DevPtr b : blocks) EXPECT_EQ(pool.deallocate(b), Status::ok);
      pool.drain_pending(0);
      dev.sim->fail_nth(op, 0);
      EXPECT_EQ(pool.stats(0).bytes_reserved, dev.sim->used(0));
      pool.trim(0);
      EXPECT_EQ(dev.sim->used(0), 0u);
      EXPECT_EQ(pool.stats(0).bytes_reserved, 0u);
      DevPtr all = 0;
      ASSERT_EQ(pool.allocate(0, 1 * GiB, kAnyStream, &all), Status::ok);
      ASSERT_EQ(pool.deallocate(all), Status::ok);
    }
    EXPECT_EQ(dev.sim->live_handles(), 0u);
    EXPECT_EQ(dev.sim->live_mappings(), 0u);
    EXPECT_EQ(dev.sim->live_reservations(), 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(TeardownCalls, PoolTrimFault,
                         ::testing::Values(Case{SimOp::unmap, "unmap"},
                                           Case{SimOp::release, "release"},
                                           Case{SimOp::unreserve, "unreserve"}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
