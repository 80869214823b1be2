#include <gtest/gtest.h>

#include <chrono>
#include <cstring>

#include "gpustitch/sim_backend.h"

using namespace gpustitch;

TEST(SimBackend, StitchedRangeAliasesItsPhysicalPieces) {
  SimBackend sim({.capacity = 1 * GiB});
  PhysHandle a = 0, b = 0;
  ASSERT_EQ(sim.create(0, 4 * MiB, &a), Status::ok);
  ASSERT_EQ(sim.create(0, 2 * MiB, &b), Status::ok);
  DevPtr home = 0, stitched = 0;
  ASSERT_EQ(sim.reserve(0, 4 * MiB, &home), Status::ok);
  ASSERT_EQ(sim.map(home, 4 * MiB, a, 0), Status::ok);
  int dev0 = 0;
  ASSERT_EQ(sim.set_access(home, 4 * MiB, {&dev0, 1}), Status::ok);
  ASSERT_EQ(sim.reserve(0, 4 * MiB, &stitched), Status::ok);
  ASSERT_EQ(sim.map(stitched, 2 * MiB, b, 0), Status::ok);
  ASSERT_EQ(sim.map(stitched + 2 * MiB, 2 * MiB, a, 2 * MiB), Status::ok);  // offset into a
  ASSERT_EQ(sim.set_access(stitched, 4 * MiB, {&dev0, 1}), Status::ok);
  std::memcpy(reinterpret_cast<void*>(stitched + 2 * MiB + 100), "hello", 6);
  EXPECT_STREQ(reinterpret_cast<const char*>(home + 2 * MiB + 100), "hello");
  // unmap must name a whole mapping; unreserve refuses a mapped range.
  EXPECT_EQ(sim.unmap(stitched, 4 * MiB), Status::invalid_value);
  EXPECT_EQ(sim.unreserve(stitched, 4 * MiB), Status::invalid_value);
  ASSERT_EQ(sim.unmap(stitched, 2 * MiB), Status::ok);
  ASSERT_EQ(sim.unmap(stitched + 2 * MiB, 2 * MiB), Status::ok);
  ASSERT_EQ(sim.unreserve(stitched, 4 * MiB), Status::ok);
  EXPECT_EQ(sim.live_mappings(), 1u);
}

TEST(SimBackend, CapacityAndFaultsAreEnforced) {
  SimBackend sim({.capacity = 8 * MiB, .map_offset = false});
  PhysHandle h = 0, h2 = 0;
  EXPECT_EQ(sim.create(0, 10 * MiB, &h), Status::out_of_memory);
  ASSERT_EQ(sim.create(0, 8 * MiB, &h), Status::ok);
  EXPECT_EQ(sim.create(0, 2 * MiB, &h2), Status::out_of_memory);
  std::size_t free = 1, total = 0;
  ASSERT_EQ(sim.mem_info(0, &free, &total), Status::ok);
  EXPECT_EQ(free, 0u);
  EXPECT_EQ(total, 8 * MiB);
  DevPtr va = 0;
  ASSERT_EQ(sim.reserve(0, 8 * MiB, &va), Status::ok);
  EXPECT_EQ(va % (2 * MiB), 0u);
  EXPECT_EQ(sim.map(va, 2 * MiB, h, 2 * MiB), Status::invalid_value) << "offsets disabled";
  sim.fail_nth(SimOp::map, 2);
  EXPECT_EQ(sim.map(va, 2 * MiB, h, 0), Status::ok);
  EXPECT_EQ(sim.map(va + 2 * MiB, 2 * MiB, h, 0), Status::out_of_memory);
  EXPECT_EQ(sim.map(va + 2 * MiB, 2 * MiB, h, 0), Status::ok);
  EXPECT_EQ(sim.map(va + 2 * MiB, 2 * MiB, h, 0), Status::invalid_value) << "already mapped";
  ASSERT_EQ(sim.release(h), Status::ok);
  EXPECT_EQ(sim.used(0), 0u);
  EXPECT_EQ(sim.release(h), Status::invalid_value);
}

TEST(SimBackend, DeviceUuidsIdentifyEachSimulatedDevice) {
  gpustitch::SimOptions opts;
  opts.devices = 2;
  gpustitch::SimBackend a(opts), b(opts);
  gpustitch::DeviceUuid a0{}, a0_again{}, a1{}, b0{};
  ASSERT_EQ(a.device_uuid(0, &a0), gpustitch::Status::ok);
  ASSERT_EQ(a.device_uuid(0, &a0_again), gpustitch::Status::ok);
  ASSERT_EQ(a.device_uuid(1, &a1), gpustitch::Status::ok);
  ASSERT_EQ(b.device_uuid(0, &b0), gpustitch::Status::ok);
  EXPECT_EQ(a0, a0_again);  // stable
  EXPECT_NE(a0, a1);        // per device
  EXPECT_NE(a0, b0);        // per backend: two simulated devices are never one GPU
  EXPECT_EQ(a.device_uuid(2, &a0), gpustitch::Status::invalid_device);
  EXPECT_EQ(a.device_uuid(0, nullptr), gpustitch::Status::invalid_value);
}

// A configured call cost holds the caller at least that long (the cost model's premise); calls
// without one are not delayed by it, and the call still does its work.
TEST(SimBackend, ConfiguredCallCostHoldsTheCaller) {
  SimOptions o;
  o.call_ns[static_cast<std::size_t>(SimOp::synchronize)] = 2'000'000;  // 2 ms
  SimBackend sim(o);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(sim.synchronize(0), Status::ok);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(2));
  EXPECT_EQ(sim.calls(SimOp::synchronize), 1u);
  PhysHandle h = 0;
  EXPECT_EQ(sim.create(0, 2 * MiB, &h), Status::ok);
  EXPECT_EQ(sim.release(h), Status::ok);
}
