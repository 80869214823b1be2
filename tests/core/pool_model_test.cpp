// Randomized model-based test: thousands of mixed allocations and frees from 512 B to GiB scale
// on a simulated device, checked after every step against a reference model. Calls use cudaMalloc
// semantics or one of two streams at random.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "gpustitch/pool.h"
#include "test_device.h"

using namespace gpustitch;

namespace {

struct Live {
  std::size_t size;
  std::uint64_t tag;
};

// cudaMalloc/cudaFree semantics and two streams (cudaMallocAsync/cudaFreeAsync: stream-ordered
// large frees are parked in the thread's arena), drawn at random for each call.
constexpr Stream kStreams[] = {kAnyStream, kAnyStream, 0x51, 0x52};

// Parameters: a driver that maps at an offset, the seed, fresh_coarse_mb at its default of 256
// (large fresh ranges in a few large handles, refined where a cut needs it) or 0, and whether moved
// handles' old places stay mapped until needed (unmap:lazy; the reclaimer thread's unmaps are not
// deterministic) or are unmapped at once, and the memory-first layout (size ranges of their own,
// handles of 1/1024 of the heap with no bound per range: README, "Configuration"; by default the
// heap uses it until it holds 8 GiB, which the model may or may not reach, so a third layout ends
// that phase at 256 MiB, early in every run: 0 defaults, 1 memory-first throughout, 2 early end),
// and grow_slack_pct:2 (misses take fresh memory instead of moving idle handles while the pool
// holds less than 2% above the peak: a path that once acted on the idle handles an earlier miss
// had looked at, since moved or given back).
class PoolModel
    : public ::testing::TestWithParam<std::tuple<bool, unsigned, bool, bool, unsigned, bool>> {};

TEST_P(PoolModel, MatchesReference) {
  const auto [map_offset, seed, coarse, lazy_unmap, layout, grow_slack] = GetParam();
  const std::size_t capacity = 24 * GiB;
  TestDevice dev = make_test_device({.capacity = capacity, .map_offset = map_offset});
  if (dev.sim == nullptr) GTEST_SKIP() << "the model needs a simulated device of known capacity";
  Config cfg;
  cfg.background_reclaim = false;
  if (!coarse) cfg.fresh_coarse = 0;
  if (lazy_unmap) cfg.unmap = Config::Unmap::lazy;
  if (layout == 1) {
    cfg.size_ranges = true;
    cfg.handle_share = 1024;
    cfg.gap_handles = 0;
  }
  if (layout == 2) cfg.memory_first = 256 * MiB;
  if (grow_slack) cfg.grow_slack_pct = 2;
  Pool pool(*dev.backend, cfg);
  std::map<DevPtr, Live> live;  // the reference model
  std::mt19937_64 rng(seed);
  std::uint64_t allocs = 0, frees = 0, requested = 0, large_rounded = 0, small_bytes = 0;
  std::uint64_t ooms = 0, must_fit_failures = 0, large_live = 0, largest_served = 0;
  auto write_tag = [&](DevPtr p, std::size_t size, std::uint64_t tag) {
    for (std::size_t off : {std::size_t{0}, size / 2 / 8 * 8, size - 8})
      dev.write(p + off, &tag, 8);
  };
  auto tag_ok = [&](DevPtr p, const Live& l) {
    for (std::size_t off : {std::size_t{0}, l.size / 2 / 8 * 8, l.size - 8}) {
      std::uint64_t got = 0;
      dev.read(p + off, &got, 8);
      if (got != l.tag) return false;
    }
    return true;
  };
  const int steps = 4000;
  for (int step = 0; step < steps; ++step) {
    const unsigned op = rng() % 100;
    if (op < 55 || live.empty()) {
      // log-uniform size from 512 B to 2 GiB
      double e = 9.0 + (rng() % 10000) / 10000.0 * 22.0;
      std::size_t size = static_cast<std::size_t>(std::exp2(e));
      size = std::max<std::size_t>(size, 16);
      DevPtr p = 0;
      Status s = pool.allocate(0, size, kStreams[rng() % 4], &p);
      const bool large = size >= cfg.small_limit;
      const std::size_t rounded = large ? align_up(size, 512) : size;
      // Physical memory the model knows is in use: large blocks exactly; small objects at most
      // their bytes plus two chunks per size class of slack.
      std::uint64_t in_use = large_rounded + small_bytes + 2 * 40 * 2 * MiB;
      // Only whole handles move: each live large block may pin the free rest of a handle at
      // either of its ends. Fresh memory comes in handles of segment_mb, or of 1/64 of the gap
      // it backs when that is larger.
      const std::uint64_t handle =
          std::max<std::uint64_t>(cfg.segment_size, align_up(largest_served / 64, 2 * MiB));
      in_use += 2 * handle * large_live;
      if (s != Status::ok) {
        ASSERT_EQ(s, Status::out_of_memory);
        ++ooms;
        // Only allowed when the request really exceeds free physical memory.
        if (in_use + rounded <= capacity) ++must_fit_failures;
        continue;
      }
      // No overlap with any live block.
      auto next = live.lower_bound(p);
      if (next != live.end()) {
        ASSERT_LE(p + size, next->first) << "step " << step;
      }
      if (next != live.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(prev->first + prev->second.size, p) << "step " << step;
      }
      std::uint64_t tag = rng();
      write_tag(p, size, tag);
      live[p] = {size, tag};
      ++allocs;
      requested += size;
      (large ? large_rounded : small_bytes) += large ? rounded : size;
      large_live += large ? 1 : 0;
      if (large) largest_served = std::max<std::uint64_t>(largest_served, rounded);
    } else if (op < 97) {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      ASSERT_TRUE(tag_ok(it->first, it->second)) << "bytes lost before free at step " << step;
      ASSERT_EQ(pool.deallocate(it->first, kStreams[rng() % 4]), Status::ok);
      const std::size_t size = it->second.size;
      if (size >= cfg.small_limit) {
        large_rounded -= align_up(size, 512);
        --large_live;
      } else {
        small_bytes -= size;
      }
      requested -= size;
      ++frees;
      live.erase(it);
    } else {
      pool.trim(0);
    }
    ASSERT_EQ(pool.validate(0), "") << "step " << step;
    DeviceStats st = pool.stats(0);
    ASSERT_EQ(st.allocs, allocs);
    ASSERT_EQ(st.frees, frees);
    ASSERT_EQ(st.live_blocks, live.size());
    ASSERT_EQ(st.bytes_requested, requested);
    ASSERT_EQ(st.ooms, ooms);
    ASSERT_LE(st.bytes_reserved, capacity);
    ASSERT_EQ(st.bytes_reserved, dev.sim->used(0)) << "pool and device disagree on memory held";
    ASSERT_GE(st.bytes_allocated, large_rounded + small_bytes);
    ASSERT_EQ(st.bytes_cached, st.bytes_reserved - st.bytes_allocated);
    ASSERT_GE(st.peak_allocated, st.bytes_allocated);
    if (step % 250 == 0) {
      for (auto& [p, l] : live) ASSERT_TRUE(tag_ok(p, l)) << "bytes lost at step " << step;
    }
  }
  EXPECT_EQ(must_fit_failures, 0u) << "allocations failed although free memory sufficed";
  for (auto& [p, l] : live) ASSERT_TRUE(tag_ok(p, l));
  for (auto& [p, l] : live) ASSERT_EQ(pool.deallocate(p), Status::ok);
  pool.trim(0);
  EXPECT_EQ(dev.sim->used(0), 0u);
  EXPECT_EQ(dev.sim->live_mappings(), 0u);
  EXPECT_EQ(dev.sim->live_reservations(), pool.stats(0).views);  // the address space
  std::printf(
      "model seed %u offset %d coarse %d lazy unmap %d layout %u grow slack %d: %llu "
      "allocs, %llu OOMs, %llu stitches\n",
      seed, map_offset, coarse, lazy_unmap, layout, grow_slack, (unsigned long long)allocs,
      (unsigned long long)ooms, (unsigned long long)pool.stats(0).stitches);
}

INSTANTIATE_TEST_SUITE_P(Seeds, PoolModel,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(1u, 2u, 3u),
                                            ::testing::Bool(), ::testing::Values(false),
                                            ::testing::Values(0u), ::testing::Values(false)));
INSTANTIATE_TEST_SUITE_P(LazyUnmap, PoolModel,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(4u),
                                            ::testing::Values(true), ::testing::Values(true),
                                            ::testing::Values(0u), ::testing::Values(false)));
INSTANTIATE_TEST_SUITE_P(MemoryFirst, PoolModel,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(5u, 6u),
                                            ::testing::Bool(), ::testing::Values(false),
                                            ::testing::Values(1u), ::testing::Values(false)));
INSTANTIATE_TEST_SUITE_P(MemoryFirstPhaseEnds, PoolModel,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(9u, 10u),
                                            ::testing::Bool(), ::testing::Values(false),
                                            ::testing::Values(2u), ::testing::Values(false)));
INSTANTIATE_TEST_SUITE_P(GrowSlack, PoolModel,
                         ::testing::Combine(::testing::Values(false), ::testing::Values(7u, 8u),
                                            ::testing::Values(true), ::testing::Values(false),
                                            ::testing::Values(0u, 1u), ::testing::Values(true)));

}  // namespace
