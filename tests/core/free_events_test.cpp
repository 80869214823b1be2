// FreeEvents (core/src/free_events.h): whether the device has run past a stream-ordered free.
// What the pool relies on: "completed" only once the device really ran past that free (never for
// a free still running, on any path: a slot overwritten, another stream's record, a failed
// record, a backend without events), and every event it created destroyed with it.
#include <gtest/gtest.h>

#include "free_events.h"
#include "gpustitch/sim_backend.h"

using namespace gpustitch;
using gpustitch::detail::FreeEvents;

namespace {

// A backend with no events at all (as an old driver): everything else is out of reach here.
class NoEventsBackend final : public Backend {
 public:
  const char* name() const noexcept override { return "none"; }
  int device_count() noexcept override { return 1; }
  std::size_t granularity(int) noexcept override { return 2 * MiB; }
  bool supports_map_offset(int) noexcept override { return false; }
  Status mem_info(int, std::size_t*, std::size_t*) noexcept override { return Status::error; }
  Status reserve(int, std::size_t, DevPtr*) noexcept override { return Status::error; }
  Status unreserve(DevPtr, std::size_t) noexcept override { return Status::error; }
  Status create(int, std::size_t, PhysHandle*) noexcept override { return Status::error; }
  Status release(PhysHandle) noexcept override { return Status::error; }
  Status map(DevPtr, std::size_t, PhysHandle, std::size_t) noexcept override {
    return Status::error;
  }
  Status unmap(DevPtr, std::size_t) noexcept override { return Status::error; }
  Status set_access(DevPtr, std::size_t, std::span<const int>) noexcept override {
    return Status::error;
  }
  Status synchronize(int) noexcept override { return Status::ok; }
};

constexpr Stream kA = 0x1000, kB = 0x2000;

}  // namespace

TEST(FreeEvents, AFreeIsCompletedOnlyOnceTheDeviceRanPastIt) {
  SimBackend sim;
  FreeEvents events(sim, 0);
  sim.hold_device(true);  // kernels before the frees still run
  const std::uint64_t a1 = events.record(kA);
  const std::uint64_t b1 = events.record(kB);
  ASSERT_NE(a1, 0u);
  ASSERT_GT(b1, a1);
  EXPECT_FALSE(events.completed(kA, a1));
  EXPECT_FALSE(events.completed(kB, b1));
  sim.hold_device(false);
  sim.hold_device(true);  // later work: the device is busy, but past both frees
  const std::uint64_t a2 = events.record(kA);
  EXPECT_TRUE(events.completed(kA, a1));
  EXPECT_TRUE(events.completed(kB, b1));
  EXPECT_FALSE(events.completed(kA, a2)) << "a free recorded during the work still running";
  EXPECT_FALSE(events.completed(kA, 0)) << "0: no event was recorded";
  EXPECT_FALSE(events.completed(kA, a2 + 1)) << "a number never handed out";
  EXPECT_FALSE(events.completed(kB, a1)) << "another stream's free";
  sim.hold_device(false);
  EXPECT_TRUE(events.completed(kA, a2));
}

// The ring holds kSlots records: an older free's slot is reused, and then a later record of the
// same stream answers for it (stream order), never another stream's.
TEST(FreeEvents, AnOverwrittenFreeIsAnsweredByItsStreamsLaterRecordOnly) {
  SimBackend sim;
  FreeEvents events(sim, 0);
  sim.hold_device(true);
  const std::uint64_t old_a = events.record(kA);
  for (std::size_t i = 0; i < FreeEvents::kSlots; ++i) events.record(kB);
  sim.hold_device(false);
  sim.hold_device(true);
  // old_a's slot now holds a record of B, which completed; A has no later record: unknown.
  EXPECT_FALSE(events.completed(kA, old_a)) << "another stream's record answered";
  const std::uint64_t later_a = events.record(kA);  // during the work still running
  EXPECT_FALSE(events.completed(kA, old_a)) << "answered by a later free still running";
  sim.hold_device(false);
  EXPECT_TRUE(events.completed(kA, old_a));
  EXPECT_TRUE(events.completed(kA, later_a));
  EXPECT_EQ(events.records(), FreeEvents::kSlots + 2);
}

TEST(FreeEvents, EventsAreCreatedOncePerSlotAndDestroyedWithTheLedger) {
  SimBackend sim;
  {
    FreeEvents events(sim, 0);
    for (std::size_t i = 0; i < 3 * FreeEvents::kSlots; ++i) ASSERT_NE(events.record(kA), 0u);
    EXPECT_EQ(sim.live_events(), FreeEvents::kSlots);
    EXPECT_EQ(events.record(kAnyStream), 0u) << "cudaFree semantics have no stream to mark";
  }
  EXPECT_EQ(sim.live_events(), 0u);
}

TEST(FreeEvents, WithoutEventsNothingIsEverCompleted) {
  NoEventsBackend none;
  FreeEvents events(none, 0);
  EXPECT_EQ(events.record(kA), 0u);
  EXPECT_EQ(events.record(kA), 0u);
  EXPECT_FALSE(events.completed(kA, 1));
  EXPECT_EQ(events.records(), 0u);
  SimBackend sim(SimOptions{.devices = 1});
  FreeEvents bad_device(sim, 7);  // creating its events fails
  EXPECT_EQ(bad_device.record(kA), 0u);
  EXPECT_EQ(sim.live_events(), 0u);
}
