#include <sys/mman.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

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

// Reservations come in ascending address order, as cuMemAddressReserve's do: the pool breaks ties
// between equal blocks by address, so replay matches a GPU run only if its ranges lie in the
// driver's order (a GPT trace recorded on an H100 replayed 0.85% low with mmap's top-down order).
// A range given back is not handed out again, and the ranges hold bytes.
TEST(SimBackend, ReservationsAscendAsTheDriversDoAndStayUsable) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer's runtime keeps the simulator's lane area from the program";
#endif
  SimBackend sim({.capacity = 1 * GiB});
  DevPtr first = 0, second = 0, third = 0;
  ASSERT_EQ(sim.reserve(0, 64 * MiB, &first), Status::ok);
  ASSERT_EQ(sim.reserve(0, 32 * MiB, &second), Status::ok);
  EXPECT_GE(second, first + 64 * MiB) << "the second range lies above the first";
  ASSERT_EQ(sim.unreserve(first, 64 * MiB), Status::ok);
  ASSERT_EQ(sim.reserve(0, 64 * MiB, &third), Status::ok);
  EXPECT_GE(third, second + 32 * MiB) << "a range given back is not handed out again";
  EXPECT_EQ(third % (2 * MiB), 0u);
  PhysHandle h = 0;
  ASSERT_EQ(sim.create(0, 2 * MiB, &h), Status::ok);
  ASSERT_EQ(sim.map(third + 62 * MiB, 2 * MiB, h, 0), Status::ok);
  int dev0 = 0;
  ASSERT_EQ(sim.set_access(third + 62 * MiB, 2 * MiB, {&dev0, 1}), Status::ok);
  std::memcpy(reinterpret_cast<void*>(third + 64 * MiB - 6), "bytes", 6);
  EXPECT_STREQ(reinterpret_cast<const char*>(third + 64 * MiB - 6), "bytes");
  ASSERT_EQ(sim.unmap(third + 62 * MiB, 2 * MiB), Status::ok);
  ASSERT_EQ(sim.release(h), Status::ok);
  ASSERT_EQ(sim.unreserve(third, 64 * MiB), Status::ok);
  ASSERT_EQ(sim.unreserve(second, 32 * MiB), Status::ok);
  EXPECT_EQ(sim.live_reservations(), 0u);
}

namespace {
// Whether [ptr, ptr+size) lies inside one mapping of this process (/proc/self/maps): a reserved
// range must be a mapping of ours, never an address the simulator merely computed.
bool mapped_by_this_process(DevPtr ptr, std::size_t size) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    unsigned long long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%llx-%llx", &lo, &hi) == 2 && lo <= ptr && ptr + size <= hi) {
      return true;
    }
  }
  return false;
}
}  // namespace

// Someone else's mapping where the next range would go is stepped over, never replaced, and the
// ranges still ascend.
TEST(SimBackend, ReservationsStepOverAForeignMappingWithoutTouchingIt) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer's runtime keeps the simulator's lane area from the program";
#endif
  SimBackend sim({.capacity = 1 * GiB});
  DevPtr first = 0;
  ASSERT_EQ(sim.reserve(0, 2 * MiB, &first), Status::ok);
  // The next range would start one granule above the first's end.
  void* want = reinterpret_cast<void*>(first + 4 * MiB);
  void* foreign = mmap(want, 8 * MiB, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
  ASSERT_EQ(foreign, want) << "the address above the first range was not free";
  std::memcpy(foreign, "theirs", 7);
  DevPtr second = 0;
  ASSERT_EQ(sim.reserve(0, 4 * MiB, &second), Status::ok);
  const auto f = reinterpret_cast<DevPtr>(foreign);
  EXPECT_TRUE(second + 4 * MiB <= f || second >= f + 8 * MiB) << "overlaps the foreign mapping";
  EXPECT_GT(second, first);
  EXPECT_TRUE(mapped_by_this_process(second, 4 * MiB));
  EXPECT_STREQ(static_cast<const char*>(foreign), "theirs");
  ASSERT_EQ(sim.unreserve(second, 4 * MiB), Status::ok);
  EXPECT_STREQ(static_cast<const char*>(foreign), "theirs");
  munmap(foreign, 8 * MiB);
  ASSERT_EQ(sim.unreserve(first, 2 * MiB), Status::ok);
}

// Two live backends never share addresses; a destroyed backend's addresses come back, so that a
// process replaying one trace after another gives each replay the same ranges.
TEST(SimBackend, BackendsKeepApartAndTheAreaComesBackWhenOneGoes) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer's runtime keeps the simulator's lane area from the program";
#endif
  DevPtr first_of_a = 0;
  {
    SimBackend a({.capacity = 1 * GiB});
    SimBackend b({.capacity = 1 * GiB});
    DevPtr ra = 0, rb = 0;
    ASSERT_EQ(a.reserve(0, 64 * MiB, &ra), Status::ok);
    ASSERT_EQ(b.reserve(0, 64 * MiB, &rb), Status::ok);
    EXPECT_TRUE(ra + 64 * MiB <= rb || rb + 64 * MiB <= ra) << "the two backends' ranges overlap";
    first_of_a = ra;
    ASSERT_EQ(a.unreserve(ra, 64 * MiB), Status::ok);
    ASSERT_EQ(b.unreserve(rb, 64 * MiB), Status::ok);
  }
  SimBackend c({.capacity = 1 * GiB});
  DevPtr rc = 0;
  ASSERT_EQ(c.reserve(0, 64 * MiB, &rc), Status::ok);
  EXPECT_EQ(rc, first_of_a);
  ASSERT_EQ(c.unreserve(rc, 64 * MiB), Status::ok);
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
