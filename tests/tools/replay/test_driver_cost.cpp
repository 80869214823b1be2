// Replay's driver-cost model: what each call through CostedBackend is charged (the figures of
// driver_cost.h, measured on an idle H200), above all that cuMemSetAccess is charged per handle
// mapped in its range, not per call; and the split of the driver counters into the trace's second
// half, a training trace's later steps, where most of the pool's growth is behind it; and the
// pool's fences, which replay's idle device makes free but whose number tells their cost on a GPU.
#include <gtest/gtest.h>

#include <gpustitch/sim_backend.h>

#include <memory>

#include "driver_cost.h"
#include "gpustitch/trace/trace_reader.h"
#include "policy.h"
#include "replay_test_util.h"
#include "replayer.h"

using namespace gpustitch;
using namespace gpustitch::replay;
using trace::TraceAction;

using gpustitch::replay::test::counter;
using gpustitch::replay::test::event;

namespace {

ReplayResult replay_with(const std::string& name, const trace::Trace& t) {
  return gpustitch::replay::test::replay_with(name, t, 8 * GiB);
}

}  // namespace

TEST(CostedBackend, ChargesSetAccessPerHandleMappedInTheRange) {
  CostedBackend backend(std::make_unique<SimBackend>());
  DevPtr base = 0;
  ASSERT_EQ(backend.reserve(0, 64 * MiB, &base), Status::ok);
  PhysHandle small = 0, large = 0, outside = 0;
  ASSERT_EQ(backend.create(0, 2 * MiB, &small), Status::ok);
  ASSERT_EQ(backend.create(0, 20 * MiB, &large), Status::ok);
  ASSERT_EQ(backend.create(0, 2 * MiB, &outside), Status::ok);
  ASSERT_EQ(backend.map(base, 2 * MiB, small, 0), Status::ok);
  ASSERT_EQ(backend.map(base + 2 * MiB, 20 * MiB, large, 0), Status::ok);
  ASSERT_EQ(backend.map(base + 32 * MiB, 2 * MiB, outside, 0), Status::ok);
  const DriverCost before = backend.cost();
  EXPECT_EQ(before.creates, 3u);
  EXPECT_EQ(before.maps, 3u);
  // 3 creates (12 us + 0.086 us/MiB) and 3 maps (1.5 us).
  EXPECT_NEAR(before.us, 3 * 12.0 + 0.086 * 24 + 3 * 1.5, 1e-6);

  const int devices[] = {0};
  ASSERT_EQ(backend.set_access(base, 22 * MiB, devices), Status::ok);
  const DriverCost after = backend.cost();
  // One call over two handles costs what two calls do; the handle outside the range is not
  // charged.
  EXPECT_EQ(after.access_handles, 2u);
  EXPECT_NEAR(after.us - before.us, 2 * 27.0 + 0.063 * 22, 1e-6);

  ASSERT_EQ(backend.unmap(base + 2 * MiB, 20 * MiB), Status::ok);
  ASSERT_EQ(backend.release(large), Status::ok);
  const DriverCost end = backend.cost();
  EXPECT_EQ(end.unmaps, 1u);
  EXPECT_EQ(end.releases, 1u);
  EXPECT_NEAR(end.us - after.us, 18.0 + 14.0 + 0.47 * 20, 1e-6);
  // A failed call is not charged.
  EXPECT_NE(backend.unmap(base + 2 * MiB, 20 * MiB), Status::ok);
  EXPECT_EQ(backend.cost().unmaps, 1u);

  ASSERT_EQ(backend.unmap(base, 2 * MiB), Status::ok);
  ASSERT_EQ(backend.unmap(base + 32 * MiB, 2 * MiB), Status::ok);
  ASSERT_EQ(backend.release(small), Status::ok);
  ASSERT_EQ(backend.release(outside), Status::ok);
  ASSERT_EQ(backend.unreserve(base, 64 * MiB), Status::ok);
}

TEST(ReplaySecondHalf, IsTheDriverCountersAtTheEndLessAtTheMidpoint) {
  const auto half = second_half_driver_counters(
      {{"driver_us", 900}, {"driver_creates", 10}, {"driver_unmaps", 4}, {"stitches", 7}},
      {{"driver_us", 600}, {"driver_creates", 10}, {"stitches", 3}});
  ASSERT_EQ(half.size(), 3u);  // the driver counters only
  EXPECT_EQ(counter(half, "driver_us_second_half"), 300u);
  EXPECT_EQ(counter(half, "driver_creates_second_half"), 0u);
  EXPECT_EQ(counter(half, "driver_unmaps_second_half"), 4u);  // none at the midpoint
}

TEST(ReplaySecondHalf, CountsOnlyTheLaterEventsDriverCalls) {
  // First half: four 64 MiB blocks allocated and freed (fresh memory). Second half: the same
  // sizes again, which the policies serve from what they hold, then one larger block that needs
  // fresh memory.
  trace::Trace t;
  for (std::uint64_t i = 0; i < 4; ++i)
    t.events.push_back(event(TraceAction::allocate, 0x1000 + i, 64 * MiB));
  for (std::uint64_t i = 0; i < 4; ++i)
    t.events.push_back(event(TraceAction::free, 0x1000 + i, 64 * MiB));
  for (std::uint64_t i = 0; i < 4; ++i)
    t.events.push_back(event(TraceAction::allocate, 0x2000 + i, 64 * MiB));
  for (std::uint64_t i = 0; i < 4; ++i)
    t.events.push_back(event(TraceAction::free, 0x2000 + i, 64 * MiB));
  for (const char* name : {"gpustitch", "expandable-segments"}) {
    ReplayResult again = replay_with(name, t);
    EXPECT_GT(counter(again.counters, "driver_creates"), 0u) << name;
    EXPECT_GT(counter(again.counters, "driver_us"), 0u) << name;
    EXPECT_EQ(counter(again.second_half, "driver_creates_second_half"), 0u) << name;
    EXPECT_EQ(counter(again.second_half, "driver_us_second_half"), 0u) << name;

    trace::Trace grows = t;
    grows.events.insert(grows.events.end() - 4, event(TraceAction::allocate, 0x3000, 1 * GiB));
    grows.events.push_back(event(TraceAction::free, 0x3000, 1 * GiB));
    ReplayResult more = replay_with(name, grows);
    EXPECT_GT(counter(more.second_half, "driver_creates_second_half"), 0u) << name;
    EXPECT_GT(counter(more.second_half, "driver_us_second_half"), 0u) << name;
    EXPECT_LT(counter(more.second_half, "driver_us_second_half"),
              counter(more.counters, "driver_us"))
        << name;
  }
}

TEST(ReplayFences, ACudaFreesMemoryIsReusedAfterAFenceAStreamsOwnAtOnce) {
  // Allocate, free, allocate the same size again: with cudaFree semantics the freed block waits
  // for a fence before the second allocation can reuse it; on one stream it is reused at once.
  auto run = [](Stream stream) {
    trace::Trace t;
    for (std::uint64_t ptr : {0xA000u, 0xB000u}) {
      trace::TraceEvent a = event(TraceAction::allocate, ptr, 64 * MiB);
      trace::TraceEvent f = event(TraceAction::free, ptr, 64 * MiB);
      a.stream = f.stream = stream;
      t.events.push_back(a);
      t.events.push_back(f);
    }
    return replay_with("gpustitch", t);
  };
  const ReplayResult freed = run(kAnyStream);
  EXPECT_GE(counter(freed.counters, "fences"), 1u);
  EXPECT_LT(freed.peak_reserved, 2 * 64 * MiB) << "the second allocation reused the first's memory";
  const ReplayResult streamed = run(0x10);
  EXPECT_EQ(counter(streamed.counters, "fences"), 0u);
  EXPECT_LT(streamed.peak_reserved, 2 * 64 * MiB);
}

TEST(CachingModelCost, ChargesACudaMallocPerSegmentAndACudaFreePerSegmentGivenBack) {
  // PyTorch's caching allocator calls cudaMalloc for a new segment only, and cudaFree only when
  // it gives segments back (here: before retrying a request that does not fit beside its cache).
  auto run = [](std::initializer_list<std::pair<std::uint64_t, std::uint64_t>> allocs) {
    trace::Trace t;
    for (const auto& [ptr, size] : allocs) {
      t.events.push_back(event(TraceAction::allocate, ptr, size));
      t.events.push_back(event(TraceAction::free, ptr, size));
    }
    PolicyEnv env;
    env.capacity = 2 * GiB;
    std::string why;
    auto policy = find_policy("pytorch")->make(env, &why);
    return replay_trace(t, *policy);
  };
  const ReplayResult reused = run({{0xA000, 100 * MiB}, {0xB000, 100 * MiB}});
  EXPECT_EQ(counter(reused.counters, "driver_mallocs"), 1u) << "the second is served by the cache";
  EXPECT_EQ(counter(reused.counters, "driver_frees"), 0u);
  EXPECT_EQ(counter(reused.counters, "driver_us"), 61u);  // 47 us + 0.14 us/MiB

  const ReplayResult given_back = run({{0xA000, 1536 * MiB}, {0xB000, 1843 * MiB}});
  EXPECT_EQ(given_back.ooms, 0u);
  EXPECT_EQ(counter(given_back.counters, "driver_mallocs"), 2u);
  EXPECT_EQ(counter(given_back.counters, "driver_frees"), 1u) << "the cached 1.5 GiB given back";
  EXPECT_GT(counter(given_back.counters, "driver_us"), 1000u);  // cudaFree of 1.5 GiB ~1.1 ms
}
