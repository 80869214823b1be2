// Pool::memory_map: what `gpustitch snapshot PID` shows must be the pool's real state. Every
// mapped physical byte appears once, live blocks are exactly the program's allocations (address,
// size asked for), and the totals agree with the pool's statistics.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <vector>

#include "gpustitch/pool.h"
#include "test_device.h"

using namespace gpustitch;

namespace {

using State = MappedBlock::State;

std::vector<MappedSegment> map_of(const Pool& pool) {
  std::vector<MappedSegment> segments;
  EXPECT_EQ(pool.memory_map(0, &segments), Status::ok);
  return segments;
}

// Segments tile themselves with their blocks and never overlap one another.
void expect_well_formed(const std::vector<MappedSegment>& segments) {
  std::vector<std::pair<DevPtr, DevPtr>> ranges;
  for (const auto& s : segments) {
    ASSERT_FALSE(s.blocks.empty());
    DevPtr at = s.base;
    for (const auto& b : s.blocks) {
      EXPECT_EQ(b.ptr, at) << "blocks of a segment must be contiguous";
      EXPECT_GT(b.size, 0u);
      at = b.ptr + b.size;
    }
    EXPECT_EQ(at, s.base + s.size);
    ranges.emplace_back(s.base, s.base + s.size);
  }
  std::sort(ranges.begin(), ranges.end());
  for (std::size_t i = 1; i < ranges.size(); ++i) {
    EXPECT_LE(ranges[i - 1].second, ranges[i].first) << "two segments overlap";
  }
}

struct Totals {
  std::size_t mapped = 0, live_bytes = 0, requested = 0, live_blocks = 0;
  std::map<DevPtr, std::size_t> live;  // ptr -> requested
};
Totals totals_of(const std::vector<MappedSegment>& segments) {
  Totals t;
  for (const auto& s : segments) {
    t.mapped += s.size;
    for (const auto& b : s.blocks) {
      if (b.state != State::live) continue;
      t.live_bytes += b.size;
      t.requested += b.requested;
      ++t.live_blocks;
      t.live[b.ptr] = b.requested;
    }
  }
  return t;
}

}  // namespace

// Memory moved to serve a request (its handles unmapped where they lay free and mapped where the
// request goes) shows once, at its new place: the map covers each physical byte exactly once.
TEST(PoolMemoryMap, MovedMemoryShowsOnceAtItsNewPlace) {
  TestDevice dev = make_test_device({.capacity = 64 * MiB, .map_offset = false});
  if (dev.sim == nullptr) GTEST_SKIP();
  Config c = inline_config();
  c.segment_size = 8 * MiB;  // each block one handle
  Pool pool(*dev.backend, c);
  // Eight 8 MiB blocks fill the device; free every other one and ask for 24 MiB: it can only be
  // served by moving the freed blocks' handles.
  std::vector<DevPtr> blocks(8);
  for (auto& b : blocks) ASSERT_EQ(pool.allocate(0, 8 * MiB, kAnyStream, &b), Status::ok);
  for (std::size_t i = 1; i < blocks.size(); i += 2)
    ASSERT_EQ(pool.deallocate(blocks[i]), Status::ok);
  pool.drain_pending(0);
  DevPtr big = 0;
  ASSERT_EQ(pool.allocate(0, 24 * MiB - 100, kAnyStream, &big), Status::ok);
  ASSERT_EQ(pool.stats(0).stitches, 1u);
  ASSERT_EQ(pool.validate(0), "");

  const auto segments = map_of(pool);
  expect_well_formed(segments);
  const Totals t = totals_of(segments);
  const DeviceStats s = pool.stats(0);
  EXPECT_EQ(t.mapped, s.bytes_reserved) << "each physical byte once";
  EXPECT_EQ(t.mapped, 64 * MiB);
  EXPECT_EQ(t.live_bytes, s.bytes_allocated);
  EXPECT_EQ(t.live_blocks, 5u);
  ASSERT_TRUE(t.live.count(big));
  EXPECT_EQ(t.live.at(big), 24 * MiB - 100);
  for (std::size_t i = 0; i < blocks.size(); i += 2) EXPECT_EQ(t.live.at(blocks[i]), 8 * MiB);
  std::size_t free_bytes = 0;
  for (const auto& seg : segments) {
    for (const auto& b : seg.blocks) free_bytes += b.state == State::free ? b.size : 0;
  }
  EXPECT_EQ(free_bytes, 64 * MiB - 4 * 8 * MiB - 24 * MiB);  // the one freed block not moved
}

TEST(PoolMemoryMap, SmallChunksShowTheirSlotsAndPendingFrees) {
  TestDevice dev = make_test_device();
  if (dev.sim == nullptr) GTEST_SKIP();
  Pool pool(*dev.backend, inline_config());
  DevPtr a = 0, b = 0, c = 0;
  ASSERT_EQ(pool.allocate(0, 1000, kAnyStream, &a), Status::ok);
  ASSERT_EQ(pool.allocate(0, 1000, kAnyStream, &b), Status::ok);
  ASSERT_EQ(pool.allocate(0, 3 * MiB, kAnyStream, &c), Status::ok);
  ASSERT_EQ(pool.deallocate(b), Status::ok);  // pending: no fence yet (inline fencing)
  ASSERT_EQ(pool.deallocate(c), Status::ok);

  const auto segments = map_of(pool);
  expect_well_formed(segments);
  const MappedSegment* chunk = nullptr;
  for (const auto& s : segments) {
    if (s.small) chunk = &s;
  }
  ASSERT_NE(chunk, nullptr);
  EXPECT_EQ(chunk->size, 64 * KiB) << "a class's first chunk is small (small_pool.h)";
  std::map<DevPtr, const MappedBlock*> by_ptr;
  for (const auto& blk : chunk->blocks) by_ptr[blk.ptr] = &blk;
  ASSERT_TRUE(by_ptr.count(a) && by_ptr.count(b));
  EXPECT_EQ(by_ptr[a]->state, State::live);
  EXPECT_EQ(by_ptr[a]->requested, 1000u);
  EXPECT_EQ(by_ptr[b]->state, State::pending);
  const Totals t = totals_of(segments);
  EXPECT_EQ(t.live_blocks, 1u);
  std::size_t pending_large = 0;
  for (const auto& s : segments) {
    for (const auto& blk : s.blocks) {
      if (!s.small && blk.state == State::pending) pending_large += blk.size;
    }
  }
  EXPECT_EQ(pending_large, pool.stats(0).bytes_pending);
  EXPECT_GE(pending_large, 3 * MiB);

  pool.drain_pending(0);  // fenced: the freed slot is free now
  for (const auto& s : map_of(pool)) {
    for (const auto& blk : s.blocks) {
      if (blk.ptr == b) {
        EXPECT_EQ(blk.state, State::free);
      }
    }
  }
}

// Random allocations and frees, large and small, stream-ordered and not, on a device small enough
// to stitch and trim: after every few steps the map agrees with the program's live set and the
// statistics.
TEST(PoolMemoryMap, AgreesWithTheLiveSetAndStatisticsThroughoutARandomRun) {
  TestDevice dev = make_test_device({.capacity = 512 * MiB, .map_offset = false});
  if (dev.sim == nullptr) GTEST_SKIP();
  Pool pool(*dev.backend, inline_config());
  std::mt19937_64 rng(7);
  std::map<DevPtr, std::size_t> live;
  std::map<DevPtr, Stream> stream_of;
  for (int step = 0; step < 3000; ++step) {
    const bool alloc = live.empty() || (live.size() < 80 && rng() % 3 != 0);
    if (alloc) {
      std::size_t size = rng() % 4 == 0 ? 1 + rng() % (48 * MiB) : 1 + rng() % (256 * 1024);
      Stream stream = rng() % 2 ? kAnyStream : 0x100 + rng() % 3;
      DevPtr p = 0;
      if (pool.allocate(0, size, stream, &p) == Status::ok) {
        live[p] = size;
        stream_of[p] = stream;
      }
    } else {
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      ASSERT_EQ(pool.deallocate(it->first, stream_of[it->first]), Status::ok);
      stream_of.erase(it->first);
      live.erase(it);
    }
    if (step % 50 == 0) pool.trim(0);
    if (step % 7 != 0) continue;
    const auto segments = map_of(pool);
    expect_well_formed(segments);
    const Totals t = totals_of(segments);
    const DeviceStats s = pool.stats(0);
    ASSERT_EQ(t.live, live) << "step " << step;
    EXPECT_EQ(t.live_bytes, s.bytes_allocated) << "step " << step;
    EXPECT_EQ(t.mapped, s.bytes_reserved) << "step " << step;
    EXPECT_EQ(t.requested, s.bytes_requested) << "step " << step;
  }
}

namespace {

// What the segment events (PoolObserver::on_segment) say is mapped: every map must be of unmapped
// address space, every unmap of mapped address space, in the order they come.
struct SegmentTracker : PoolObserver {
  std::map<DevPtr, DevPtr> mapped;  // lo -> hi, touching ranges merged
  std::size_t maps = 0, unmaps = 0;
  std::string error;
  void on_segment(int device, DevPtr ptr, std::size_t size, bool is_map) noexcept override {
    if (device != 0 || size == 0) error = "segment event of device " + std::to_string(device);
    const DevPtr lo = ptr, hi = ptr + size;
    auto it = mapped.upper_bound(lo);
    if (is_map) {
      ++maps;
      if ((it != mapped.end() && it->first < hi) ||
          (it != mapped.begin() && std::prev(it)->second > lo)) {
        error = "segment_map of a mapped range";
        return;
      }
      DevPtr nlo = lo, nhi = hi;
      if (it != mapped.end() && it->first == hi) {
        nhi = it->second;
        it = mapped.erase(it);
      }
      if (it != mapped.begin() && std::prev(it)->second == lo) {
        nlo = std::prev(it)->first;
        mapped.erase(std::prev(it));
      }
      mapped[nlo] = nhi;
    } else {
      ++unmaps;
      if (it == mapped.begin() || std::prev(it)->second < hi) {
        error = "segment_unmap of a range not mapped";
        return;
      }
      auto in = std::prev(it);
      const DevPtr ilo = in->first, ihi = in->second;
      mapped.erase(in);
      if (ilo < lo) mapped[ilo] = lo;
      if (hi < ihi) mapped[hi] = ihi;
    }
  }
};

// The union of the memory map's segments, touching ones merged.
std::map<DevPtr, DevPtr> ranges_of(const std::vector<MappedSegment>& segments) {
  std::map<DevPtr, DevPtr> r;
  for (const auto& s : segments) r[s.base] = s.base + s.size;
  std::map<DevPtr, DevPtr> merged;
  for (const auto& [lo, hi] : r) {
    if (!merged.empty() && std::prev(merged.end())->second == lo) {
      std::prev(merged.end())->second = hi;
    } else {
      merged[lo] = hi;
    }
  }
  return merged;
}

}  // namespace

// A snapshot's timeline replays the segment events backwards from the memory map (memory_viz's
// Allocator State History): they must add up, at every step, to exactly what the map shows as
// mapped, through growth, moves (stitching), small-object chunks and trims.
TEST(PoolMemoryMap, SegmentEventsAddUpToWhatIsMapped) {
  for (const bool map_offset : {false, true}) {
    SCOPED_TRACE(map_offset ? "driver maps at an offset" : "whole handles");
    TestDevice dev = make_test_device({.capacity = 1 * GiB, .map_offset = map_offset});
    if (dev.sim == nullptr) GTEST_SKIP();
    SegmentTracker tracker;
    Config c = inline_config();
    c.segment_size = 8 * MiB;
    Pool pool(*dev.backend, c, &tracker);
    std::mt19937_64 rng(7);
    std::map<DevPtr, std::size_t> live;
    std::map<DevPtr, Stream> stream_of;
    std::size_t stitches_seen = 0;
    for (int step = 0; step < 2000; ++step) {
      const bool alloc = live.empty() || (live.size() < 60 && rng() % 3 != 0);
      if (alloc) {
        std::size_t size = rng() % 3 == 0 ? 1 + rng() % (96 * MiB) : 1 + rng() % (512 * 1024);
        Stream stream = rng() % 2 ? kAnyStream : 0x100 + rng() % 3;
        DevPtr p = 0;
        if (pool.allocate(0, size, stream, &p) == Status::ok) {
          live[p] = size;
          stream_of[p] = stream;
        }
      } else {
        auto it = live.begin();
        std::advance(it, static_cast<long>(rng() % live.size()));
        ASSERT_EQ(pool.deallocate(it->first, stream_of[it->first]), Status::ok);
        stream_of.erase(it->first);
        live.erase(it);
      }
      if (step % 97 == 0) pool.trim(0);
      ASSERT_EQ(tracker.error, "") << "step " << step;
      if (step % 5 != 0) continue;
      ASSERT_EQ(tracker.mapped, ranges_of(map_of(pool))) << "step " << step;
      stitches_seen = pool.stats(0).stitches;
    }
    pool.trim(0);
    ASSERT_EQ(tracker.mapped, ranges_of(map_of(pool)));
    EXPECT_GT(tracker.unmaps, 0u);
    EXPECT_GT(stitches_seen, 0u) << "the workload must move memory for the test to mean much";
  }
}
