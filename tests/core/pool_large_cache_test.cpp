// The arenas' cache of large frees (core/src/large_cache.h), through the Pool API on the
// simulated device: same-stream reuse without the device lock, no reuse by another stream (or of a
// cudaFree-semantics free by anyone) before a fence, frees from another thread, out-of-memory,
// trim and the release threshold draining parked memory, exact statistics, and no overlapping live
// blocks under concurrent frees.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "gpustitch/pool.h"
#include "test_device.h"

using namespace gpustitch;

namespace {

// The cache is off by default (config.h: why); these tests turn it on at the size it had.
Config cache_on(Config c) {
  c.large_cache = 256 * MiB;
  return c;
}

// A thread that stays alive (so it keeps its arena) and runs what it is given, in order.
class Worker {
 public:
  Worker() : thread_([this] { loop(); }) {}
  ~Worker() {
    post([this] { stop_ = true; });
    thread_.join();
  }
  template <class F>
  auto run(F f) -> decltype(f()) {
    std::packaged_task<decltype(f())()> task(std::move(f));
    auto result = task.get_future();
    post([&task] { task(); });
    return result.get();
  }

 private:
  void post(std::function<void()> f) {
    {
      std::lock_guard lock(mu_);
      queue_.push_back(std::move(f));
    }
    cv_.notify_one();
  }
  void loop() {
    while (!stop_) {
      std::function<void()> f;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return !queue_.empty(); });
        f = std::move(queue_.front());
        queue_.pop_front();
      }
      f();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

constexpr Stream kS1 = 0x1001, kS2 = 0x1002, kS3 = 0x1003;

// On one thread: an allocate/free pair of 8 MiB on `stream` (kAnyStream: cudaFree semantics), then
// 1000 more while every device lock is held (what fork preparation does).
struct LockedLoop {
  DevPtr first = 0;
  int same = 0;           // pairs that got `first` back
  bool finished = false;  // whether the loop completed while the locks were held
};
LockedLoop loop_while_device_locked(Pool& pool, Stream stream) {
  Worker w;
  LockedLoop r;
  r.first = w.run([&] {
    DevPtr p = 0;
    EXPECT_EQ(pool.allocate(0, 8 * MiB, stream, &p), Status::ok);
    EXPECT_EQ(pool.deallocate(p, stream), Status::ok);
    return p;
  });
  pool.atfork_prepare();
  std::atomic<bool> done{false};
  std::atomic<int> same{0};
  std::thread loop([&] {
    w.run([&] {
      for (int i = 0; i < 1000; ++i) {
        DevPtr p = 0;
        if (pool.allocate(0, 8 * MiB, stream, &p) != Status::ok) break;
        same += p == r.first;
        if (pool.deallocate(p, stream) != Status::ok) break;
      }
      return 0;
    });
    done = true;
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  r.finished = done;
  pool.atfork_parent();
  loop.join();
  r.same = same.load();
  return r;
}

}  // namespace

TEST(PoolLargeCache, SameStreamGetsItsBlockBackAtOnceWithItsBytes) {
  TestDevice dev = make_test_device();
  if (dev.sim == nullptr) GTEST_SKIP() << "needs a controllable device";
  Pool pool(*dev.backend, cache_on(Config{}));
  dev.sim->hold_device(true);  // nothing freed can be fenced: only stream order allows reuse
  DevPtr a = 0;
  ASSERT_EQ(pool.allocate(0, 48 * MiB, kS1, &a), Status::ok);
  stamp(dev, a, 48 * MiB, 0xABCD);
  ASSERT_EQ(pool.deallocate(a, kS1), Status::ok);
  EXPECT_FALSE(pool.find(a)) << "a parked block is freed";
  const DeviceStats before = pool.stats(0);
  DevPtr b = 0;
  ASSERT_EQ(pool.allocate(0, 48 * MiB, kS1, &b), Status::ok);
  EXPECT_EQ(a, b);
  // Stream order: the stream's own later work sees what its earlier work wrote.
  EXPECT_TRUE(check(dev, b, 48 * MiB, 0xABCD));
  ASSERT_EQ(pool.deallocate(b, kS1), Status::ok);
  // A request up to 1/8 smaller takes the parked block whole.
  DevPtr c = 0;
  ASSERT_EQ(pool.allocate(0, 44 * MiB, kS1, &c), Status::ok);
  EXPECT_EQ(a, c);
  BlockInfo info{};
  ASSERT_TRUE(pool.find(c + 44 * MiB - 1, &info));
  EXPECT_EQ(info.base, a);
  EXPECT_EQ(info.rounded, 48 * MiB);
  EXPECT_EQ(info.size, 44 * MiB);
  EXPECT_EQ(info.stream, kS1);
  const DeviceStats after = pool.stats(0);
  EXPECT_EQ(after.cache_hits, before.cache_hits + 2);
  EXPECT_EQ(after.fresh, before.fresh) << "no new physical memory for a parked block's stream";
  EXPECT_EQ(after.bytes_reserved, before.bytes_reserved);
  ASSERT_EQ(pool.deallocate(c, kS1), Status::ok);
  dev.sim->hold_device(false);
}

TEST(PoolLargeCache, SteadyStateLoopNeverWaitsForTheDeviceLock) {
  TestDevice dev = make_test_device();
  if (dev.sim == nullptr) GTEST_SKIP() << "needs the simulated device";
  Pool pool(*dev.backend, cache_on(inline_config()));
  const LockedLoop r = loop_while_device_locked(pool, kS1);
  ASSERT_NE(r.first, 0u);
  EXPECT_TRUE(r.finished) << "a stream's allocate/free loop waited for the device lock";
  EXPECT_EQ(r.same, 1000);
}

TEST(PoolLargeCache, AnotherStreamNeverGetsAParkedBlockBeforeItsFence) {
  TestDevice dev = make_test_device();
  if (dev.sim == nullptr) GTEST_SKIP() << "needs a controllable device";
  Pool pool(*dev.backend, cache_on(Config{}));
  dev.sim->hold_device(true);
  DevPtr a = 0, b = 0, c = 0;
  ASSERT_EQ(pool.allocate(0, 48 * MiB, kS1, &a), Status::ok);
  ASSERT_EQ(pool.deallocate(a, kS1), Status::ok);
  ASSERT_EQ(pool.allocate(0, 48 * MiB, kS2, &b), Status::ok);
  EXPECT_NE(a, b) << "another stream got memory its owner's stream may still use";
  ASSERT_EQ(pool.allocate(0, 48 * MiB, kAnyStream, &c), Status::ok);
  EXPECT_NE(a, c) << "a cudaMalloc got memory a stream may still use";
  ASSERT_EQ(pool.deallocate(b, kS2), Status::ok);
  ASSERT_EQ(pool.deallocate(c), Status::ok);
  dev.sim->hold_device(false);
  // Once drained and fenced, parked memory is anybody's: no new memory for a third stream.
  pool.drain_pending(0);
  const std::uint64_t reserved = pool.stats(0).bytes_reserved;
  EXPECT_EQ(pool.stats(0).bytes_pending, 0u);
  DevPtr d = 0;
  ASSERT_EQ(pool.allocate(0, 48 * MiB, kS3, &d), Status::ok);
  EXPECT_EQ(pool.stats(0).bytes_reserved, reserved);
  EXPECT_TRUE(d == a || d == b || d == c);
}

// cudaFree semantics: the freed block waits for a fence that began after the free. While the device
// is busy (held), the next allocation of that size must not get it; it may wait for the device (as
// native cudaFree does) or take other memory.
TEST(PoolLargeCache, CudaFreeSemanticsBlockIsNotReusedBeforeAFence) {
  TestDevice dev = make_test_device();
  if (dev.sim == nullptr) GTEST_SKIP() << "needs a controllable device";
  for (const bool background : {false, true}) {
    SCOPED_TRACE(background ? "background reclaim" : "fence on demand");
    Config c = cache_on(inline_config());
    c.background_reclaim = background;
    Pool pool(*dev.backend, c);
    Worker w;
    // Warm: one fenced round trip, so that the arena has measured an idle device's fence.
    w.run([&] {
      for (int i = 0; i < 3; ++i) {
        DevPtr p = 0;
        EXPECT_EQ(pool.allocate(0, 48 * MiB, kAnyStream, &p), Status::ok);
        EXPECT_EQ(pool.deallocate(p), Status::ok);
      }
      return 0;
    });
    const DevPtr a = w.run([&] {
      DevPtr p = 0;
      EXPECT_EQ(pool.allocate(0, 48 * MiB, kAnyStream, &p), Status::ok);
      return p;
    });
    dev.sim->hold_device(true);  // a kernel still uses a
    w.run([&] { return pool.deallocate(a); });
    std::atomic<DevPtr> got{0};
    std::thread t([&] {
      w.run([&] {
        DevPtr p = 0;
        EXPECT_EQ(pool.allocate(0, 48 * MiB, kAnyStream, &p), Status::ok);
        got = p;
        return 0;
      });
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const DevPtr early = got.load();
    EXPECT_NE(early, a) << "a cudaMalloc got memory a kernel may still use";
    dev.sim->hold_device(false);
    t.join();
    ASSERT_NE(got.load(), 0u);
    w.run([&] { return pool.deallocate(got.load()); });
  }
}

// A cudaMalloc/cudaFree loop of one size on an idle device reuses its block through its arena,
// fencing there, with every device lock held by someone else.
TEST(PoolLargeCache, CudaMallocFreeLoopFencesInItsArenaWithoutTheDeviceLock) {
  TestDevice dev = make_test_device();
  if (dev.sim == nullptr) GTEST_SKIP() << "needs the simulated device";
  Pool pool(*dev.backend, cache_on(inline_config()));
  const std::uint64_t syncs = dev.sim->calls(SimOp::synchronize);
  const LockedLoop r = loop_while_device_locked(pool, kAnyStream);
  ASSERT_NE(r.first, 0u);
  EXPECT_TRUE(r.finished) << "a cudaMalloc/cudaFree loop waited for the device lock";
  EXPECT_EQ(r.same, 1000);
  EXPECT_GE(dev.sim->calls(SimOp::synchronize), syncs + 1000) << "every reuse needs a fence";
  const DeviceStats st = pool.stats(0);
  EXPECT_EQ(st.live_blocks, 0u);
  EXPECT_EQ(st.bytes_allocated, 0u);
  EXPECT_EQ(st.bytes_cached, st.bytes_reserved);
}

// Where a fence costs more than the device pool's path, a cudaMalloc/cudaFree loop of one size
// does not fence for every reuse: its arena keeps a few blocks of the size (at most 8, and 1/16 of
// large_cache_mb) and one fence covers them all. Every pair still gets intact bytes.
TEST(PoolLargeCache, CudaMallocFreeLoopWithCostlyFencesSharesOneFenceAmongAFewBlocks) {
  // A fence that costs what a real one does (20 us: more than the device pool's path, less than
  // a busy device's).
  SimOptions costly;
  costly.call_ns[static_cast<std::size_t>(SimOp::synchronize)] = 20'000;
  TestDevice dev = make_test_device(costly);
  if (dev.sim == nullptr) GTEST_SKIP() << "needs the simulated device";
  Pool pool(*dev.backend, cache_on(Config{}));
  Worker w;
  std::set<DevPtr> seen;
  const std::uint64_t fences_before = dev.sim->calls(SimOp::synchronize);
  const bool bytes_ok = w.run([&] {
    bool ok = true;
    for (int i = 0; i < 800; ++i) {
      DevPtr p = 0;
      EXPECT_EQ(pool.allocate(0, 2 * MiB, kAnyStream, &p), Status::ok);
      seen.insert(p);
      stamp(dev, p, 2 * MiB, 7000 + i);
      ok = ok && check(dev, p, 2 * MiB, 7000 + i);
      EXPECT_EQ(pool.deallocate(p), Status::ok);
    }
    return ok;
  });
  const std::uint64_t fences = dev.sim->calls(SimOp::synchronize) - fences_before;
  EXPECT_TRUE(bytes_ok);
  EXPECT_GE(seen.size(), 2u) << "every reuse waited for a fence of its own";
  EXPECT_LE(seen.size(), 8u) << "the loop kept more blocks than one fence needs";
  EXPECT_LE(fences, 800u / 4) << "fences: " << fences;
  EXPECT_LE(pool.stats(0).bytes_reserved, 8 * 2 * MiB);
}

// The reclaimer's fence covers blocks parked with cudaFree semantics: once it has run, the next
// allocation of that size takes the block without a fence of its own.
TEST(PoolLargeCache, ReclaimerFenceCoversBlocksParkedWithCudaFreeSemantics) {
  TestDevice dev = make_test_device();
  if (dev.sim == nullptr) GTEST_SKIP() << "needs the simulated device";
  Pool pool(*dev.backend, cache_on(Config{}));
  Worker w;
  const DevPtr a = w.run([&] {
    DevPtr p = 0;
    EXPECT_EQ(pool.allocate(0, 16 * MiB, kAnyStream, &p), Status::ok);
    EXPECT_EQ(pool.deallocate(p), Status::ok);
    return p;
  });
  // Wait until the reclaimer has fenced and gone quiet (no synchronize for 50 ms).
  std::uint64_t syncs = dev.sim->calls(SimOp::synchronize);
  for (int quiet = 0, i = 0; quiet < 5 && i < 500; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    const std::uint64_t now = dev.sim->calls(SimOp::synchronize);
    quiet = now == syncs && now != 0 ? quiet + 1 : 0;
    syncs = now;
  }
  ASSERT_GT(syncs, 0u) << "the reclaimer never fenced the parked block";
  const DeviceStats before = pool.stats(0);
  const DevPtr b = w.run([&] {
    DevPtr p = 0;
    EXPECT_EQ(pool.allocate(0, 16 * MiB, kAnyStream, &p), Status::ok);
    return p;
  });
  EXPECT_EQ(b, a);
  EXPECT_EQ(dev.sim->calls(SimOp::synchronize), syncs) << "fenced again for a covered block";
  EXPECT_EQ(pool.stats(0).cache_hits, before.cache_hits + 1);
  EXPECT_EQ(pool.stats(0).fresh, before.fresh);
  w.run([&] { return pool.deallocate(b); });
}

// cudaMalloc of another size: blocks parked with cudaFree semantics go back to the device pool,
// where they serve it, rather than sit in the arena while fresh memory is taken. Without size
// ranges they merge with their neighbours into one free block; with them (size_ranges:on) the 2 MiB
// blocks lie in another size range's addresses than an 8 MiB request, and their handles move.
TEST(PoolLargeCache, CudaMallocOfAnotherSizeGetsTheSmallerParkedBlocks) {
  for (bool ranges : {false, true}) {
    SCOPED_TRACE(ranges ? "size_ranges:on" : "size_ranges:off");
    TestDevice dev = make_test_device({.map_offset = false});
    if (dev.sim == nullptr) GTEST_SKIP() << "needs the simulated device";
    Config c = cache_on(inline_config());
    c.size_ranges = ranges;
    if (!ranges) c.memory_first = 0;  // nor size ranges while the heap is small
    Pool pool(*dev.backend, c);
    Worker w;
    w.run([&] {
      std::vector<DevPtr> small(4);
      for (auto& p : small) EXPECT_EQ(pool.allocate(0, 2 * MiB, kAnyStream, &p), Status::ok);
      for (auto p : small) EXPECT_EQ(pool.deallocate(p), Status::ok);
      return 0;
    });
    const DeviceStats before = pool.stats(0);
    ASSERT_EQ(before.bytes_reserved, 8 * MiB);
    const DevPtr big = w.run([&] {
      DevPtr p = 0;
      EXPECT_EQ(pool.allocate(0, 8 * MiB, kAnyStream, &p), Status::ok);
      return p;
    });
    ASSERT_NE(big, 0u);
    stamp(dev, big, 8 * MiB, 0xb16);
    EXPECT_TRUE(check(dev, big, 8 * MiB, 0xb16));
    const DeviceStats after = pool.stats(0);
    EXPECT_EQ(after.fresh, before.fresh) << "fresh memory while 8 MiB sat parked";
    EXPECT_EQ(after.bytes_reserved, 8 * MiB);
    if (!ranges) {
      EXPECT_EQ(after.cache_hits, before.cache_hits + 1)
          << "the four neighbours merged into one block";
    }
    w.run([&] { return pool.deallocate(big); });
    EXPECT_EQ(pool.validate(0), "");
  }
}

TEST(PoolLargeCache, FreeOnAnotherThreadIsNeitherLostNorHandedOutTwice) {
  TestDevice dev = make_test_device();
  if (dev.sim == nullptr) GTEST_SKIP() << "needs the simulated device";
  Pool pool(*dev.backend, cache_on(inline_config()));
  {
    Worker a, b;
    // Allocated on thread a (registered in a's arena), freed on thread b on another stream.
    const DevPtr p = a.run([&] {
      DevPtr q = 0;
      EXPECT_EQ(pool.allocate(0, 48 * MiB, kS1, &q), Status::ok);
      return q;
    });
    stamp(dev, p, 48 * MiB, 1);
    EXPECT_EQ(b.run([&] { return pool.deallocate(p, kS2); }), Status::ok);
    EXPECT_FALSE(pool.find(p));
    EXPECT_EQ(b.run([&] { return pool.deallocate(p, kS2); }), Status::invalid_value)
        << "a second free of a parked block must be refused";
    EXPECT_EQ(a.run([&] { return pool.deallocate(p, kS1); }), Status::invalid_value);
    DeviceStats s = pool.stats(0);
    EXPECT_EQ(s.live_blocks, 0u);
    EXPECT_EQ(s.frees, 1u);
    EXPECT_EQ(s.bytes_allocated, 0u);
    // Whoever gets it next, one live block at a time: two allocations on the freeing stream.
    const DevPtr q1 = a.run([&] {
      DevPtr q = 0;
      EXPECT_EQ(pool.allocate(0, 48 * MiB, kS2, &q), Status::ok);
      return q;
    });
    const DevPtr q2 = b.run([&] {
      DevPtr q = 0;
      EXPECT_EQ(pool.allocate(0, 48 * MiB, kS2, &q), Status::ok);
      return q;
    });
    EXPECT_NE(q1, q2);
    EXPECT_TRUE(q1 + 48 * MiB <= q2 || q2 + 48 * MiB <= q1);
    stamp(dev, q1, 48 * MiB, 11);
    stamp(dev, q2, 48 * MiB, 22);
    EXPECT_TRUE(check(dev, q1, 48 * MiB, 11));
    EXPECT_TRUE(check(dev, q2, 48 * MiB, 22));
    // A cudaMalloc block of this thread freed on a stream by another thread: parked in this
    // thread's arena, which registered it, for the freeing stream.
    DevPtr m = 0;
    ASSERT_EQ(pool.allocate(0, 20 * MiB, kAnyStream, &m), Status::ok);
    EXPECT_EQ(b.run([&] { return pool.deallocate(m, kS3); }), Status::ok);
    DevPtr again = 0;
    ASSERT_EQ(pool.allocate(0, 20 * MiB, kS3, &again), Status::ok);
    EXPECT_EQ(again, m) << "the freeing stream reuses its free at once";
    EXPECT_EQ(pool.stats(0).live_blocks, 3u);
    // Freed from the main thread, with cudaFree semantics.
    EXPECT_EQ(pool.deallocate(m), Status::ok);
    EXPECT_EQ(pool.deallocate(q1), Status::ok);
    EXPECT_EQ(b.run([&] { return pool.deallocate(q2, kS2); }), Status::ok);
  }
  DeviceStats s = pool.stats(0);
  EXPECT_EQ(s.allocs, s.frees);
  EXPECT_EQ(s.live_blocks, 0u);
  EXPECT_EQ(s.bytes_allocated, 0u);
  EXPECT_EQ(s.bytes_requested, 0u);
  pool.trim(0);
  EXPECT_EQ(pool.stats(0).bytes_reserved, 0u);
  EXPECT_EQ(dev.sim->used(0), 0u) << "parked memory leaked";
}

TEST(PoolLargeCache, OutOfMemoryDrainsBlocksParkedInAnotherThreadsArena) {
  TestDevice dev = make_test_device({.capacity = 512 * MiB});
  if (dev.sim == nullptr) GTEST_SKIP() << "needs a small simulated device";
  Config cfg = inline_config();
  cfg.large_cache = 512 * MiB;
  Pool pool(*dev.backend, cfg);
  Worker other;
  other.run([&] {
    DevPtr p = 0;
    EXPECT_EQ(pool.allocate(0, 400 * MiB, kS1, &p), Status::ok);
    EXPECT_EQ(pool.deallocate(p, kS1), Status::ok);
    return 0;
  });
  DeviceStats s = pool.stats(0);
  EXPECT_EQ(s.bytes_reserved, 400 * MiB);
  EXPECT_EQ(s.bytes_allocated, 0u);
  EXPECT_EQ(s.bytes_cached, 400 * MiB);
  EXPECT_EQ(s.bytes_pending, 400 * MiB) << "parked bytes are freed, waiting for their stream";
  EXPECT_EQ(s.live_blocks, 0u);
  // The device has 112 MiB left; the rest is parked in the other thread's arena.
  DevPtr a = 0, b = 0;
  ASSERT_EQ(pool.allocate(0, 300 * MiB, kS2, &a), Status::ok);
  ASSERT_EQ(pool.allocate(0, 200 * MiB, kAnyStream, &b), Status::ok);
  EXPECT_LE(pool.stats(0).bytes_reserved, 512 * MiB);
  EXPECT_EQ(pool.stats(0).ooms, 0u);
  stamp(dev, a, 300 * MiB, 5);
  stamp(dev, b, 200 * MiB, 6);
  EXPECT_TRUE(check(dev, a, 300 * MiB, 5));
  EXPECT_TRUE(check(dev, b, 200 * MiB, 6));
}

TEST(PoolLargeCache, TrimAndReleaseIdleGiveParkedMemoryBack) {
  TestDevice dev = make_test_device();
  if (dev.sim == nullptr) GTEST_SKIP() << "needs the simulated device";
  Pool pool(*dev.backend, cache_on(inline_config()));
  DevPtr a = 0;
  ASSERT_EQ(pool.allocate(0, 64 * MiB, kS1, &a), Status::ok);
  ASSERT_EQ(pool.deallocate(a, kS1), Status::ok);
  EXPECT_EQ(pool.stats(0).bytes_reserved, 64 * MiB);
  EXPECT_EQ(pool.release_idle(0, 64 * MiB), 64 * MiB);
  EXPECT_EQ(pool.stats(0).bytes_reserved, 0u);
  ASSERT_EQ(pool.allocate(0, 32 * MiB, kS2, &a), Status::ok);
  ASSERT_EQ(pool.deallocate(a, kS2), Status::ok);
  EXPECT_EQ(pool.stats(0).bytes_reserved, 32 * MiB);
  EXPECT_EQ(pool.trim(0), 32 * MiB);
  EXPECT_EQ(pool.stats(0).bytes_reserved, 0u);
  EXPECT_EQ(pool.stats(0).bytes_pending, 0u);
  EXPECT_EQ(dev.sim->used(0), 0u);
}

TEST(PoolLargeCache, StatisticsCountParkedMemoryAsCachedNotAllocated) {
  TestDevice dev = make_test_device();
  if (dev.sim == nullptr) GTEST_SKIP() << "needs the simulated device";
  Pool pool(*dev.backend, cache_on(inline_config()));
  DevPtr a = 0, b = 0, small = 0;
  ASSERT_EQ(pool.allocate(0, 30 * MiB, kS1, &a), Status::ok);
  ASSERT_EQ(pool.allocate(0, 32 * MiB, kS1, &b), Status::ok);
  ASSERT_EQ(pool.allocate(0, 4 * KiB, kS1, &small), Status::ok);
  ASSERT_EQ(pool.deallocate(a, kS1), Status::ok);
  DeviceStats s = pool.stats(0);
  EXPECT_EQ(s.allocs, 3u);
  EXPECT_EQ(s.frees, 1u);
  EXPECT_EQ(s.live_blocks, 2u);
  EXPECT_EQ(s.bytes_requested, 32 * MiB + 4 * KiB);
  EXPECT_EQ(s.bytes_allocated, 32 * MiB + 4 * KiB);
  EXPECT_EQ(s.bytes_cached, s.bytes_reserved - s.bytes_allocated);
  EXPECT_GE(s.bytes_cached, 30 * MiB);
  EXPECT_EQ(s.bytes_pending, 30 * MiB);
  EXPECT_EQ(s.hist_allocs[histogram_bucket(30 * MiB)], 1u);
  EXPECT_EQ(s.hist_live[histogram_bucket(30 * MiB)], 0u);
  EXPECT_EQ(s.hist_live[histogram_bucket(32 * MiB)], 1u);
  EXPECT_FALSE(pool.find(a + 5));
  BlockInfo info{};
  ASSERT_TRUE(pool.find(b + 5, &info));
  EXPECT_EQ(info.base, b);
  EXPECT_EQ(info.size, 32 * MiB);
  EXPECT_EQ(info.stream, kS1);
  // Served from the parked block: counted like any allocation, and as a cache hit.
  DevPtr again = 0;
  ASSERT_EQ(pool.allocate(0, 29 * MiB, kS1, &again), Status::ok);
  EXPECT_EQ(again, a);
  DeviceStats t = pool.stats(0);
  EXPECT_EQ(t.allocs, 4u);
  EXPECT_EQ(t.cache_hits, s.cache_hits + 1);
  EXPECT_EQ(t.live_blocks, 3u);
  EXPECT_EQ(t.bytes_requested, 32 * MiB + 4 * KiB + 29 * MiB);
  EXPECT_EQ(t.bytes_allocated, 62 * MiB + 4 * KiB);
  EXPECT_EQ(t.bytes_pending, 0u);
  EXPECT_EQ(t.hist_allocs[histogram_bucket(29 * MiB)], 2u);
  EXPECT_EQ(t.hist_live[histogram_bucket(29 * MiB)], 1u);
  for (DevPtr p : {again, b, small}) ASSERT_EQ(pool.deallocate(p, kS1), Status::ok);
  t = pool.stats(0);
  EXPECT_EQ(t.live_blocks, 0u);
  EXPECT_EQ(t.bytes_allocated, 0u);
  EXPECT_EQ(t.bytes_requested, 0u);
  EXPECT_EQ(t.frees, 4u);
}

TEST(PoolLargeCache, PeakAllocatedCountsBlocksServedFromTheArena) {
  TestDevice dev = make_test_device();
  if (dev.sim == nullptr) GTEST_SKIP() << "needs the simulated device";
  Pool pool(*dev.backend, cache_on(inline_config()));
  DevPtr a = 0, b = 0, c = 0;
  ASSERT_EQ(pool.allocate(0, 8 * MiB, kS1, &a), Status::ok);
  ASSERT_EQ(pool.deallocate(a, kS1), Status::ok);                     // parked
  ASSERT_EQ(pool.allocate(0, 16 * MiB, kAnyStream, &b), Status::ok);  // the device pool's
  ASSERT_EQ(pool.allocate(0, 8 * MiB, kS1, &c), Status::ok);  // the parked block: 24 MiB live
  EXPECT_EQ(c, a);
  ASSERT_EQ(pool.deallocate(b), Status::ok);
  ASSERT_EQ(pool.deallocate(c, kS1), Status::ok);
  ASSERT_EQ(pool.allocate(0, 8 * MiB, kS1, &c), Status::ok);
  ASSERT_EQ(pool.allocate(0, 8 * MiB, kS1, &a), Status::ok);
  ASSERT_EQ(pool.deallocate(a, kS1), Status::ok);
  ASSERT_EQ(pool.deallocate(c, kS1), Status::ok);
  const DeviceStats s = pool.stats(0);
  EXPECT_EQ(s.bytes_allocated, 0u);
  EXPECT_EQ(s.peak_allocated, 24 * MiB);
}

TEST(PoolLargeCache, BoundsSendTheOldestParkedBlocksToTheDevicePool) {
  TestDevice dev = make_test_device();
  if (dev.sim == nullptr) GTEST_SKIP() << "needs a controllable device";
  Config cfg = Config{};
  cfg.large_cache = 64 * MiB;
  Pool pool(*dev.backend, cfg);
  dev.sim->hold_device(true);
  // Four 24 MiB blocks freed on one stream: at most 64 MiB stay parked; the others wait for the
  // fence in the device pool, still reusable at once by their stream.
  std::vector<DevPtr> blocks(4);
  for (auto& p : blocks) ASSERT_EQ(pool.allocate(0, 24 * MiB, kS1, &p), Status::ok);
  for (DevPtr p : blocks) ASSERT_EQ(pool.deallocate(p, kS1), Status::ok);
  const DeviceStats s = pool.stats(0);
  EXPECT_EQ(s.bytes_pending, 96 * MiB);
  EXPECT_EQ(s.live_blocks, 0u);
  std::vector<DevPtr> again(4);
  for (auto& p : again) ASSERT_EQ(pool.allocate(0, 24 * MiB, kS1, &p), Status::ok);
  std::sort(blocks.begin(), blocks.end());
  std::sort(again.begin(), again.end());
  EXPECT_EQ(again, blocks) << "the stream gets all its frees back, parked or not";
  EXPECT_EQ(pool.stats(0).bytes_reserved, s.bytes_reserved);
  for (DevPtr p : again) ASSERT_EQ(pool.deallocate(p, kS1), Status::ok);
  // Another stream gets none of them while the device is busy.
  DevPtr other = 0;
  ASSERT_EQ(pool.allocate(0, 24 * MiB, kS2, &other), Status::ok);
  EXPECT_FALSE(std::binary_search(blocks.begin(), blocks.end(), other));
  dev.sim->hold_device(false);
}

TEST(PoolLargeCache, ZeroBudgetTurnsTheCacheOff) {
  TestDevice dev = make_test_device();
  if (dev.sim == nullptr) GTEST_SKIP() << "needs the simulated device";
  Config cfg = inline_config();
  cfg.large_cache = 0;
  Pool pool(*dev.backend, cfg);
  DevPtr a = 0, b = 0;
  ASSERT_EQ(pool.allocate(0, 8 * MiB, kS1, &a), Status::ok);
  ASSERT_EQ(pool.deallocate(a, kS1), Status::ok);
  // Without the cache the same stream still reuses its free at once (the device pool's
  // per-stream pending set), but under the device lock: fork preparation blocks it.
  ASSERT_EQ(pool.allocate(0, 8 * MiB, kS1, &b), Status::ok);
  EXPECT_EQ(a, b);
  Worker w;
  pool.atfork_prepare();
  auto result = std::async(std::launch::async,
                           [&] { return w.run([&] { return pool.deallocate(b, kS1); }); });
  EXPECT_EQ(result.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
  pool.atfork_parent();
  EXPECT_EQ(result.get(), Status::ok);
}

// Threads allocate and free large blocks on their streams (and hand some to another thread to
// free), with trims, on a device small enough that out-of-memory drains happen: no two live blocks
// overlap, every block keeps its bytes, and nothing leaks.
TEST(PoolLargeCache, ConcurrentStreamOrderedFreesNeverOverlap) {
  TestDevice dev = make_test_device({.capacity = 1 * GiB});
  if (dev.sim == nullptr) GTEST_SKIP() << "needs a small simulated device";
  {
    Pool pool(*dev.backend, cache_on(Config{}));
    std::mutex mu;
    std::map<DevPtr, std::size_t> ranges;
    std::vector<std::pair<DevPtr, std::size_t>> handoff;  // freed by whichever thread takes them
    std::atomic<std::uint64_t> failures{0}, allocs{0}, ooms{0};
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    auto release = [&](DevPtr p, std::size_t size, Stream s, std::uint64_t tag) {
      std::uint64_t x = 0, y = 0;
      dev.read(p, &x, 8);
      dev.read(p + size - 8, &y, 8);
      if (x != tag || y != tag) ++failures;
      {
        std::lock_guard lock(mu);
        ranges.erase(p);
      }
      if (pool.deallocate(p, s) != Status::ok) ++failures;
    };
    auto worker = [&](int id) {
      std::mt19937_64 rng(id + 17);
      const Stream mine = 0x500 + static_cast<Stream>(id);
      std::vector<std::pair<DevPtr, std::size_t>> live;
      while (std::chrono::steady_clock::now() < deadline) {
        const unsigned op = rng() % 100;
        if (op < 48 && live.size() < 12) {
          const std::size_t size =
              rng() % 8 == 0 ? 512 + rng() % (256 * KiB) : 1 * MiB + rng() % (40 * MiB);
          DevPtr p = 0;
          const Stream s = rng() % 5 == 0 ? kAnyStream : mine;
          const Status st = pool.allocate(0, size, s, &p);
          if (st == Status::out_of_memory) {
            ++ooms;
            continue;
          }
          if (st != Status::ok) {
            ++failures;
            continue;
          }
          ++allocs;
          {
            std::lock_guard lock(mu);
            auto next = ranges.lower_bound(p);
            if (next != ranges.end() && p + size > next->first) ++failures;
            if (next != ranges.begin() && std::prev(next)->first + std::prev(next)->second > p) {
              ++failures;
            }
            ranges[p] = size;
          }
          dev.write(p, &p, 8);
          dev.write(p + size - 8, &p, 8);
          live.emplace_back(p, size);
        } else if (op < 92 && !live.empty()) {
          const std::size_t k = rng() % live.size();
          auto [p, size] = live[k];
          live[k] = live.back();
          live.pop_back();
          if (rng() % 4 == 0) {
            std::lock_guard lock(mu);
            handoff.emplace_back(p, size);
          } else {
            release(p, size, rng() % 6 == 0 ? kAnyStream : mine, p);
          }
        } else if (op < 99) {
          std::pair<DevPtr, std::size_t> h{0, 0};
          {
            std::lock_guard lock(mu);
            if (!handoff.empty()) {
              h = handoff.back();
              handoff.pop_back();
            }
          }
          if (h.first != 0) release(h.first, h.second, mine, h.first);
        } else {
          pool.trim(0);
        }
      }
      for (auto [p, size] : live) release(p, size, mine, p);
    };
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) threads.emplace_back(worker, t);
    for (auto& t : threads) t.join();
    for (auto [p, size] : handoff) release(p, size, kS1, p);
    EXPECT_EQ(failures.load(), 0u);
    EXPECT_GT(allocs.load(), 100u);
    const DeviceStats s = pool.stats(0);
    EXPECT_EQ(s.allocs, allocs.load());
    EXPECT_EQ(s.frees, allocs.load());
    EXPECT_EQ(s.ooms, ooms.load());
    EXPECT_EQ(s.live_blocks, 0u);
    EXPECT_EQ(s.bytes_allocated, 0u);
    EXPECT_EQ(s.bytes_requested, 0u);
    pool.trim(0);
    EXPECT_EQ(pool.stats(0).bytes_reserved, 0u);
    std::printf("large cache stress: %llu allocations, %llu OOMs\n",
                (unsigned long long)allocs.load(), (unsigned long long)ooms.load());
  }
  EXPECT_EQ(dev.sim->used(0), 0u);
  EXPECT_EQ(dev.sim->live_mappings(), 0u);
}
