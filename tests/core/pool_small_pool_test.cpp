// The small-object pool's chunks (core/src/small_pool.h), through the Pool API on the simulated
// device: an emptied chunk serves any size class without the device pool, slots freed with
// cudaFree semantics are fenced in the arena before it asks for a chunk, the empty chunks an arena
// keeps are bounded, and trim takes them back.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>
#include <vector>

#include "gpustitch/pool.h"
#include "test_device.h"

using namespace gpustitch;

namespace {

// Sizes of four classes near the 1 MiB small limit: two slots per 2 MiB chunk each.
constexpr std::size_t kClassSizes[] = {600 * KiB, 700 * KiB, 800 * KiB, 1000 * KiB};

std::size_t small_segments(const Pool& pool) {
  std::vector<MappedSegment> map;
  EXPECT_EQ(pool.memory_map(0, &map), Status::ok);
  std::size_t n = 0;
  for (const MappedSegment& s : map) n += s.small;
  return n;
}

}  // namespace

// A cudaMalloc/cudaFree loop that changes size class at every step: each freed slot leaves its
// chunk with nothing live, the arena fences it (the device is idle), and the emptied chunk is
// carved for the next class. 1000 steps complete while every device lock is held, and a live
// slot of another class keeps its bytes throughout.
TEST(PoolSmallPool, CudaFreeLoopOverSizeClassesNeverWaitsForTheDeviceLock) {
  TestDevice dev = make_test_device();
  if (dev.sim == nullptr) GTEST_SKIP() << "needs the simulated device";
  Config c = inline_config();
  c.small_limit = 1 * MiB;  // classes near 1 MiB: two or three slots per chunk
  Pool pool(*dev.backend, c);
  std::promise<DevPtr> warmed;
  std::promise<void> locked;
  std::atomic<int> steps{0};
  std::atomic<bool> bytes_ok{true};
  std::thread loop([&] {  // one thread: one arena
    DevPtr keeper = 0;
    EXPECT_EQ(pool.allocate(0, 4 * KiB, kAnyStream, &keeper), Status::ok);
    stamp(dev, keeper, 4 * KiB, 0x5ca1ab1e);
    for (std::size_t size : kClassSizes) {  // one chunk, taken from the device pool unlocked
      DevPtr p = 0;
      EXPECT_EQ(pool.allocate(0, size, kAnyStream, &p), Status::ok);
      EXPECT_EQ(pool.deallocate(p), Status::ok);
    }
    warmed.set_value(keeper);
    locked.get_future().wait();
    for (int i = 0; i < 1000; ++i) {
      const std::size_t size = kClassSizes[i % 4];
      DevPtr p = 0;
      if (pool.allocate(0, size, kAnyStream, &p) != Status::ok) break;
      stamp(dev, p, size, 1000 + i);
      if (!check(dev, p, size, 1000 + i)) bytes_ok = false;
      if (pool.deallocate(p) != Status::ok) break;
      ++steps;
    }
  });
  const DevPtr keeper = warmed.get_future().get();
  pool.atfork_prepare();  // every device lock held
  locked.set_value();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (steps < 1000 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const int done = steps.load();
  pool.atfork_parent();
  loop.join();
  EXPECT_EQ(done, 1000) << "a small allocation waited for the device lock";
  EXPECT_TRUE(bytes_ok.load());
  EXPECT_TRUE(check(dev, keeper, 4 * KiB, 0x5ca1ab1e)) << "re-carving a chunk touched a live slot";
  EXPECT_EQ(pool.stats(0).allocs, 1000u + 5u);
  EXPECT_EQ(pool.deallocate(keeper), Status::ok);
}

// 32 chunks' worth of slots freed with cudaFree semantics: once fenced, the arena keeps a few
// empty chunks for any class (at most 8, 16 MiB) and gives the others back to the device pool;
// trim takes the rest. Memory reserved for small objects does not stay at its peak.
TEST(PoolSmallPool, EmptyChunksKeptByAnArenaAreBoundedAndTrimTakesThem) {
  TestDevice dev = make_test_device();
  if (dev.sim == nullptr) GTEST_SKIP() << "needs the simulated device";
  Config c = inline_config();
  c.small_limit = 1 * MiB;  // classes near 1 MiB: two or three slots per chunk
  Pool pool(*dev.backend, c);
  std::vector<DevPtr> slots(64);
  for (DevPtr& p : slots) ASSERT_EQ(pool.allocate(0, 800 * KiB, kAnyStream, &p), Status::ok);
  EXPECT_EQ(small_segments(pool), 32u);
  for (DevPtr p : slots) ASSERT_EQ(pool.deallocate(p), Status::ok);
  // Another class finds no chunk with a free slot: the arena fences the 64 frees first.
  DevPtr other = 0;
  ASSERT_EQ(pool.allocate(0, 4 * KiB, kAnyStream, &other), Status::ok);
  const std::size_t kept = small_segments(pool);
  EXPECT_GE(kept, 1u);
  EXPECT_LE(kept, 9u) << "an arena kept more than 8 empty chunks";
  EXPECT_EQ(pool.stats(0).bytes_pending, 0u) << "the arena's fence covered every free";
  // The chunk that serves `other` came from the empty ones: nothing new was reserved.
  const std::uint64_t reserved = pool.stats(0).bytes_reserved;
  EXPECT_LE(reserved, 64 * MiB);
  pool.trim(0);
  EXPECT_EQ(small_segments(pool), 1u) << "trim left empty chunks in the arena";
  EXPECT_EQ(pool.stats(0).bytes_reserved, 2 * MiB);
  EXPECT_EQ(pool.deallocate(other), Status::ok);
}

// Config::arenas sets how many arenas a device pool has, and Pool::bind_thread_to_arena which one a
// thread uses (index modulo that count), whatever the host's cores and the process's other
// threads: replay relies on both to give a trace the same arenas on every machine. Threads bound
// to one arena share its chunk; threads bound to two take a chunk each; and every object keeps
// its bytes.
TEST(PoolSmallPool, ArenasSettingAndThreadBindingDecideWhichChunkServesAThread) {
  TestDevice dev = make_test_device();
  if (dev.sim == nullptr) GTEST_SKIP() << "needs the simulated device";
  for (unsigned arenas : {1u, 2u}) {
    Config c = inline_config();
    c.arenas = arenas;
    Pool pool(*dev.backend, c);
    std::vector<DevPtr> objects(3);
    // Bound to arenas 0, 1 and 2 (= 0 modulo 2 and 1): one thread after another, so that the
    // order of their allocations is fixed.
    for (unsigned t = 0; t < objects.size(); ++t) {
      std::thread([&, t] {
        Pool::bind_thread_to_arena(t);
        ASSERT_EQ(pool.allocate(0, 4 * KiB, kAnyStream, &objects[t]), Status::ok);
        stamp(dev, objects[t], 4 * KiB, 100 + t);
      }).join();
    }
    EXPECT_EQ(small_segments(pool), arenas) << arenas << " arenas";
    for (unsigned t = 0; t < objects.size(); ++t) {
      EXPECT_TRUE(check(dev, objects[t], 4 * KiB, 100 + t)) << "object " << t;
      for (unsigned u = 0; u < t; ++u) EXPECT_NE(objects[t], objects[u]);
    }
    EXPECT_EQ(pool.validate(0), "");
    for (DevPtr p : objects) ASSERT_EQ(pool.deallocate(p), Status::ok);
  }
}

// A program with one live object in each of many size classes holds a few small chunks, not a
// 2 MiB chunk per class: each class's first chunk holds 16 slots (64 KiB at least), and the
// chunks share 2 MiB handles (small_pool.h). Twelve classes held 24 MiB before.
TEST(PoolSmallPool, AFewObjectsInManyClassesHoldLittleMemory) {
  TestDevice dev = make_test_device();
  if (dev.sim == nullptr) GTEST_SKIP() << "needs the simulated device";
  Pool pool(*dev.backend, inline_config());
  const std::size_t sizes[] = {512,     1 * KiB,  2 * KiB,  3 * KiB,  4 * KiB,  6 * KiB,
                               8 * KiB, 12 * KiB, 16 * KiB, 24 * KiB, 32 * KiB, 48 * KiB};
  std::vector<DevPtr> ptrs;
  for (std::size_t size : sizes) {
    DevPtr p = 0;
    ASSERT_EQ(pool.allocate(0, size, kAnyStream, &p), Status::ok);
    stamp(dev, p, size, p ^ size);
    ptrs.push_back(p);
  }
  for (std::size_t i = 0; i < ptrs.size(); ++i) {
    EXPECT_TRUE(check(dev, ptrs[i], sizes[i], ptrs[i] ^ sizes[i])) << sizes[i];
  }
  EXPECT_EQ(small_segments(pool), 12u);
  EXPECT_LE(pool.stats(0).bytes_reserved, 4 * MiB) << "3 MiB of chunks in 2 MiB handles";
  for (DevPtr p : ptrs) ASSERT_EQ(pool.deallocate(p), Status::ok);
  pool.trim(0);
  EXPECT_EQ(pool.validate(0), "");
}
