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
