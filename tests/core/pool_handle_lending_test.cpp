// Pool::lend_handle / Pool::take_back_handle: a program that maps memory itself (its own
// cuMemCreate, cuMemMap, cuMemRelease, as XLA does) served from the pool's idle handles, and its
// released handles kept in the pool's cache for the pool's own allocations. The "program" here
// calls the backend directly, as the preload library's hooks call the driver.
#include <gtest/gtest.h>

#include <memory>

#include "gpustitch/pool.h"
#include "test_device.h"

using namespace gpustitch;

namespace {

// The program's side: a handle mapped into an address range of its own, readable and writable.
struct ProgramMapping {
  Backend& backend;
  DevPtr va = 0;
  std::size_t size = 0;
  Status map(PhysHandle h, std::size_t bytes) {
    size = bytes;
    if (Status s = backend.reserve(0, bytes, &va); s != Status::ok) return s;
    if (Status s = backend.map(va, bytes, h, 0); s != Status::ok) return s;
    const int devices[] = {0};
    return backend.set_access(va, bytes, devices);
  }
  void unmap() {
    EXPECT_EQ(backend.unmap(va, size), Status::ok);
    EXPECT_EQ(backend.unreserve(va, size), Status::ok);
  }
};

HandleProperties pool_properties(Backend& backend) {
  HandleProperties p;
  EXPECT_EQ(backend.handle_properties(0, &p), Status::ok);
  return p;
}

// Every test's start: a test device, the properties of the pool's handles on it, and a pool.
class PoolHandleLending : public ::testing::Test {
 protected:
  // The pool on dev, and props read after it started (as the preload library reads them).
  Pool& make_pool(const Config& config = inline_config()) {
    pool_ = std::make_unique<Pool>(*dev.backend, config);
    props = pool_properties(*dev.backend);
    return *pool_;
  }

  TestDevice dev = make_test_device();
  HandleProperties props;  // set by make_pool

 private:
  std::unique_ptr<Pool> pool_;  // destroyed before dev
};

}  // namespace

TEST_F(PoolHandleLending, ReleasedHandleIsKeptAndLentAgainWithItsBytes) {
  Pool& pool = make_pool();
  const std::size_t size = 4 * MiB;

  // Nothing is idle yet: the program's first cuMemCreate goes to the driver.
  PhysHandle lent = 0;
  EXPECT_EQ(pool.lend_handle(0, size, props, &lent), Status::out_of_memory);
  PhysHandle own = 0;
  ASSERT_EQ(dev.backend->create(0, size, &own), Status::ok);
  ProgramMapping m{*dev.backend};
  ASSERT_EQ(m.map(own, size), Status::ok);
  stamp(dev, m.va, size, 0x1111);
  m.unmap();

  // Its release goes to the pool's cache instead of the driver.
  const DeviceStats before = pool.stats(0);
  ASSERT_TRUE(pool.take_back_handle(0, own, size, props));
  DeviceStats s = pool.stats(0);
  EXPECT_EQ(s.bytes_reserved, before.bytes_reserved + size);
  EXPECT_EQ(s.bytes_cached, before.bytes_cached + size);
  EXPECT_EQ(s.handles, before.handles + 1);
  EXPECT_EQ(s.handles_taken_back, 1u);
  EXPECT_EQ(pool.validate(0), "");

  // The next cuMemCreate of that size gets that handle, with the program's bytes still in it.
  ASSERT_EQ(pool.lend_handle(0, size, props, &lent), Status::ok);
  EXPECT_EQ(lent, own);
  s = pool.stats(0);
  EXPECT_EQ(s.bytes_reserved, before.bytes_reserved);  // the program's now, not the pool's
  EXPECT_EQ(s.handles_lent, 1u);
  EXPECT_EQ(s.bytes_lent, size);
  EXPECT_EQ(s.lends, 1u);
  ASSERT_EQ(m.map(lent, size), Status::ok);
  EXPECT_TRUE(check(dev, m.va, size, 0x1111));
  stamp(dev, m.va, size, 0x2222);
  m.unmap();

  // Back again: no longer lent, and a pool allocation reuses that very memory without asking the
  // driver for more.
  ASSERT_TRUE(pool.take_back_handle(0, lent, size, props));
  s = pool.stats(0);
  EXPECT_EQ(s.handles_lent, 0u);
  EXPECT_EQ(s.bytes_lent, 0u);
  EXPECT_EQ(s.handles_taken_back, 2u);
  const std::uint64_t fresh = s.fresh;
  DevPtr p = 0;
  ASSERT_EQ(pool.allocate(0, size, kAnyStream, &p), Status::ok);
  s = pool.stats(0);
  EXPECT_EQ(s.fresh, fresh);
  EXPECT_EQ(s.bytes_reserved, before.bytes_reserved + size);
  EXPECT_TRUE(check(dev, p, size, 0x2222)) << "the pool's block is the handle the program wrote";
  EXPECT_EQ(pool.validate(0), "");
  ASSERT_EQ(pool.deallocate(p), Status::ok);
}

TEST_F(PoolHandleLending, RefusesWhatItDoesNotHoldOrCannotMatch) {
  Pool& pool = make_pool();
  PhysHandle own = 0;
  ASSERT_EQ(dev.backend->create(0, 4 * MiB, &own), Status::ok);
  ASSERT_TRUE(pool.take_back_handle(0, own, 4 * MiB, props));

  PhysHandle h = 0;
  // A size the pool does not hold (larger, smaller), or not a multiple of the granularity.
  EXPECT_EQ(pool.lend_handle(0, 8 * MiB, props, &h), Status::out_of_memory);
  EXPECT_EQ(pool.lend_handle(0, 2 * MiB, props, &h), Status::out_of_memory);
  EXPECT_EQ(pool.lend_handle(0, 4 * MiB + 4096, props, &h), Status::invalid_value);
  // Properties the pool's handles lack: another kind of handle, a handle type, RDMA, compression.
  HandleProperties other = props;
  other.driver_handles = !props.driver_handles;
  EXPECT_EQ(pool.lend_handle(0, 4 * MiB, other, &h), Status::not_supported);
  other = props;
  other.handle_types |= 0x8;  // CU_MEM_HANDLE_TYPE_FABRIC
  EXPECT_EQ(pool.lend_handle(0, 4 * MiB, other, &h), Status::not_supported);
  other = props;
  other.compression = 1;
  EXPECT_EQ(pool.lend_handle(0, 4 * MiB, other, &h), Status::not_supported);
  if (!props.rdma_capable) {
    other = props;
    other.rdma_capable = true;
    EXPECT_EQ(pool.lend_handle(0, 4 * MiB, other, &h), Status::not_supported);
  }
  EXPECT_EQ(pool.lend_handle(7, 4 * MiB, props, &h), Status::invalid_device);
  EXPECT_EQ(pool.lend_handle(0, 4 * MiB, props, nullptr), Status::invalid_value);
  EXPECT_EQ(pool.stats(0).lends, 0u);
  // Fewer properties than the pool's handles have is fine (asked for none, gets the pool's).
  std::uint64_t taken_back = 1;
  if (props.handle_types != 0) {  // the CUDA backend's (IPC): the sim's handles have none
    other = props;
    other.handle_types = 0;
    EXPECT_EQ(pool.lend_handle(0, 4 * MiB, other, &h), Status::ok);
    EXPECT_TRUE(pool.take_back_handle(0, h, 4 * MiB, props));
    ++taken_back;
  }

  // A handle whose properties differ from the pool's own is not taken: the caller releases it.
  PhysHandle foreign = 0;
  ASSERT_EQ(dev.backend->create(0, 2 * MiB, &foreign), Status::ok);
  other = props;
  other.handle_types ^= 0x1;
  EXPECT_FALSE(pool.take_back_handle(0, foreign, 2 * MiB, other));
  EXPECT_FALSE(pool.take_back_handle(0, foreign, 2 * MiB + 4096, props));
  EXPECT_FALSE(pool.take_back_handle(9, foreign, 2 * MiB, props));
  EXPECT_EQ(pool.stats(0).handles_taken_back, taken_back);
  EXPECT_EQ(dev.backend->release(foreign), Status::ok);
  EXPECT_EQ(pool.validate(0), "");
}

TEST_F(PoolHandleLending, CapLeavesNoRoomForMoreThanItAllows) {
  Config config = inline_config();
  config.cap = 8 * MiB;
  Pool& pool = make_pool(config);
  DevPtr p = 0;
  ASSERT_EQ(pool.allocate(0, 6 * MiB, kAnyStream, &p), Status::ok);
  PhysHandle own = 0;
  ASSERT_EQ(dev.backend->create(0, 4 * MiB, &own), Status::ok);
  EXPECT_FALSE(pool.take_back_handle(0, own, 4 * MiB, props)) << "6 + 4 MiB is over the cap";
  EXPECT_EQ(pool.stats(0).bytes_reserved, 6 * MiB);
  EXPECT_EQ(dev.backend->release(own), Status::ok);
  ASSERT_EQ(pool.deallocate(p), Status::ok);
}

// Trim gives a taken-back handle to the driver like any other idle memory (what cooperative
// release relies on for the program's released handles).
TEST_F(PoolHandleLending, TakenBackHandlesAreReleasedByTrim) {
  Pool& pool = make_pool();
  PhysHandle own = 0;
  ASSERT_EQ(dev.backend->create(0, 4 * MiB, &own), Status::ok);
  ASSERT_TRUE(pool.take_back_handle(0, own, 4 * MiB, props));
  EXPECT_EQ(pool.release_idle(0, 4 * MiB), 4 * MiB);
  EXPECT_EQ(pool.stats(0).bytes_reserved, 0u);
  PhysHandle h = 0;
  EXPECT_EQ(pool.lend_handle(0, 4 * MiB, props, &h), Status::out_of_memory);
}
