// Fault injection: a failure at any backend call in the middle of a fresh allocation, a stitch or
// a trim rolls back: the pool stays consistent, nothing leaks, the caller gets out-of-memory.
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

class PoolFault : public ::testing::TestWithParam<Case> {};

TEST_P(PoolFault, StitchAndFreshRollBack) {
  const SimOp op = GetParam().op;
  for (std::uint64_t nth = 1; nth <= 6; ++nth) {
    TestDevice dev = make_test_device({.capacity = 1 * GiB});
    if (dev.sim == nullptr) GTEST_SKIP();
    Config cfg = inline_config();
    {
      Pool pool(*dev.backend, cfg);
      std::vector<DevPtr> blocks(16);
      for (auto& b : blocks) ASSERT_EQ(pool.allocate(0, 64 * MiB, kAnyStream, &b), Status::ok);
      for (std::size_t i = 0; i < blocks.size(); i += 2)
        ASSERT_EQ(pool.deallocate(blocks[i]), Status::ok);
      for (std::size_t i = 1; i < blocks.size(); i += 2) {
        std::uint64_t tag = i;
        dev.write(blocks[i], &tag, 8);
      }
      pool.drain_pending(0);
      // The device is full; 512 MiB can only come from stitching the 8 free blocks.
      dev.sim->fail_nth(op, nth, Status::error);
      DevPtr big = 0;
      Status s = pool.allocate(0, 512 * MiB, kAnyStream, &big);
      dev.sim->fail_nth(op, 0);
      if (s != Status::ok) {
        EXPECT_EQ(s, Status::out_of_memory) << GetParam().name << " nth " << nth;
      }
      // Consistent: the pool's view of held memory matches the device's, bytes are intact, and
      // the failed allocation can be retried.
      DeviceStats st = pool.stats(0);
      EXPECT_EQ(st.bytes_reserved, dev.sim->used(0));
      EXPECT_EQ(pool.validate(0), "") << GetParam().name << " nth " << nth;
      for (std::size_t i = 1; i < blocks.size(); i += 2) {
        std::uint64_t got = 0;
        dev.read(blocks[i], &got, 8);
        EXPECT_EQ(got, i);
      }
      if (s != Status::ok) {
        ASSERT_EQ(pool.allocate(0, 512 * MiB, kAnyStream, &big), Status::ok)
            << GetParam().name << " nth " << nth << ": the pool did not recover";
      }
      std::uint64_t tag = 99;
      dev.write(big + 300 * MiB, &tag, 8);
      ASSERT_EQ(pool.deallocate(big), Status::ok);
      for (std::size_t i = 1; i < blocks.size(); i += 2)
        ASSERT_EQ(pool.deallocate(blocks[i]), Status::ok);
      pool.trim(0);
      EXPECT_EQ(st.ooms, s == Status::ok ? 0u : 1u);
    }
    EXPECT_EQ(dev.sim->live_handles(), 0u) << GetParam().name << " nth " << nth;
    EXPECT_EQ(dev.sim->live_mappings(), 0u);
    EXPECT_EQ(dev.sim->live_reservations(), 0u);
  }
}

TEST_P(PoolFault, FreshAllocationRollsBack) {
  const SimOp op = GetParam().op;
  TestDevice dev = make_test_device({.capacity = 1 * GiB});
  if (dev.sim == nullptr) GTEST_SKIP();
  Config cfg;
  cfg.background_reclaim = false;
  cfg.stitching = false;
  {
    Pool pool(*dev.backend, cfg);
    dev.sim->fail_always(op, true, Status::error);
    DevPtr p = 0;
    Status s = pool.allocate(0, 100 * MiB, kAnyStream, &p);
    dev.sim->fail_always(op, false);
    // The address space was reserved with the pool: a fresh block reserves nothing.
    if (op == SimOp::create || op == SimOp::map || op == SimOp::set_access) {
      EXPECT_EQ(s, Status::out_of_memory);
      EXPECT_EQ(dev.sim->used(0), 0u);
      EXPECT_EQ(dev.sim->live_mappings(), 0u);
      EXPECT_EQ(dev.sim->live_reservations(), pool.stats(0).views);  // the address space
      ASSERT_EQ(pool.allocate(0, 100 * MiB, kAnyStream, &p), Status::ok);
    } else {
      ASSERT_EQ(s, Status::ok);
    }
    ASSERT_EQ(pool.deallocate(p), Status::ok);
  }
}

// A fresh block's large handles (fresh_coarse_mb) are split in three when a later block is cut
// inside one. A failure at any call of that split leaves the pool consistent
// (what it holds is what the device holds, nothing mapped that the books do not know of), the
// request is served or fails with out-of-memory and nothing changed, the memory serves the next
// request with its bytes intact, and nothing leaks.
TEST_P(PoolFault, SplitOfAFreedFreshBlockRollsBack) {
  const SimOp op = GetParam().op;
  for (std::uint64_t nth = 1; nth <= 6; ++nth) {
    TestDevice dev = make_test_device({.capacity = 1 * GiB});
    if (dev.sim == nullptr) GTEST_SKIP();
    {
      Pool pool(*dev.backend, inline_config());
      DevPtr keep = 0, big = 0;
      ASSERT_EQ(pool.allocate(0, 64 * MiB, kAnyStream, &keep), Status::ok);
      ASSERT_EQ(pool.allocate(0, 512 * MiB, kAnyStream, &big), Status::ok);
      std::uint64_t tag = 7;
      dev.write(keep, &tag, 8);
      ASSERT_EQ(pool.deallocate(big), Status::ok);
      pool.drain_pending(0);
      // 300 MiB of the freed 512 end inside one of its 16 MiB handles: the split runs here.
      DevPtr cut = 0;
      dev.sim->fail_nth(op, nth, Status::error);
      const Status s = pool.allocate(0, 300 * MiB, kAnyStream, &cut);
      dev.sim->fail_nth(op, 0);
      EXPECT_TRUE(s == Status::ok || s == Status::out_of_memory) << GetParam().name << " " << nth;
      EXPECT_EQ(pool.stats(0).bytes_reserved, dev.sim->used(0)) << GetParam().name << " " << nth;
      EXPECT_EQ(pool.validate(0), "") << GetParam().name << " nth " << nth;
      if (s != Status::ok) {
        ASSERT_EQ(pool.allocate(0, 300 * MiB, kAnyStream, &cut), Status::ok)
            << GetParam().name << " nth " << nth;
      }
      ASSERT_EQ(pool.allocate(0, 200 * MiB, kAnyStream, &big), Status::ok)
          << GetParam().name << " nth " << nth;
      std::uint64_t mark = 99, mark2 = 98, got = 0;
      dev.write(cut + 290 * MiB, &mark, 8);
      dev.write(big + 190 * MiB, &mark2, 8);
      dev.read(cut + 290 * MiB, &got, 8);
      EXPECT_EQ(got, mark);
      dev.read(big + 190 * MiB, &got, 8);
      EXPECT_EQ(got, mark2);
      dev.read(keep, &got, 8);
      EXPECT_EQ(got, tag);
      EXPECT_TRUE(cut + 300 * MiB <= big || big + 200 * MiB <= cut) << "live blocks overlap";
      ASSERT_EQ(pool.deallocate(big), Status::ok);
      ASSERT_EQ(pool.deallocate(cut), Status::ok);
      ASSERT_EQ(pool.deallocate(keep), Status::ok);
      pool.trim(0);
      EXPECT_EQ(pool.validate(0), "");
    }
    EXPECT_EQ(dev.sim->live_handles(), 0u) << GetParam().name << " nth " << nth;
    EXPECT_EQ(dev.sim->live_mappings(), 0u);
    EXPECT_EQ(dev.sim->live_reservations(), 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(EveryCall, PoolFault,
                         ::testing::Values(Case{SimOp::create, "create"},
                                           Case{SimOp::reserve, "reserve"}, Case{SimOp::map, "map"},
                                           Case{SimOp::set_access, "set_access"},
                                           Case{SimOp::unmap, "unmap"},
                                           Case{SimOp::release, "release"},
                                           Case{SimOp::unreserve, "unreserve"}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace

// An idle handle the driver will not unmap stays where it is and is not mapped a second time:
// fresh memory stands in for it, every mapping the device holds is one the pool knows, and the
// live blocks keep their bytes.
TEST(PoolFaultMove, AnIdleHandleThatWillNotUnmapStaysWhereItIs) {
  TestDevice dev = make_test_device({.capacity = 1 * GiB + 64 * MiB, .map_offset = false});
  if (dev.sim == nullptr) GTEST_SKIP();
  Config cfg;
  cfg.background_reclaim = false;
  cfg.segment_size = 64 * MiB;  // each 64 MiB block one handle
  {
    Pool pool(*dev.backend, cfg);
    std::vector<DevPtr> blocks(16);
    for (auto& b : blocks) {
      ASSERT_EQ(pool.allocate(0, 64 * MiB, kAnyStream, &b), Status::ok);
      stamp(dev, b, 64 * MiB, b);
    }
    for (std::size_t i : {0, 2, 4, 6}) ASSERT_EQ(pool.deallocate(blocks[i]), Status::ok);
    pool.drain_pending(0);
    // 192 MiB: three idle handles move; the first unmap fails, the 64 MiB left on the device
    // stands in for it.
    dev.sim->fail_nth(SimOp::unmap, 1, Status::error);
    DevPtr big = 0;
    ASSERT_EQ(pool.allocate(0, 192 * MiB, kAnyStream, &big), Status::ok);
    dev.sim->fail_nth(SimOp::unmap, 0);
    stamp(dev, big, 192 * MiB, 0xb19);
    EXPECT_EQ(pool.validate(0), "");
    const DeviceStats st = pool.stats(0);
    EXPECT_EQ(st.bytes_reserved, dev.sim->used(0));
    EXPECT_EQ(dev.sim->live_mappings() * 64 * MiB, st.bytes_mapped)
        << "a mapping the pool does not know of";
    EXPECT_TRUE(check(dev, big, 192 * MiB, 0xb19));
    for (std::size_t i : {1, 3, 5, 7, 8, 15})
      EXPECT_TRUE(check(dev, blocks[i], 64 * MiB, blocks[i]));
    ASSERT_EQ(pool.deallocate(big), Status::ok);
    for (std::size_t i = 1; i < 8; i += 2) ASSERT_EQ(pool.deallocate(blocks[i]), Status::ok);
    for (std::size_t i = 8; i < 16; ++i) ASSERT_EQ(pool.deallocate(blocks[i]), Status::ok);
    pool.trim(0);
    EXPECT_EQ(dev.sim->live_mappings(), 0u);
  }
  EXPECT_EQ(dev.sim->live_handles(), 0u);
}
