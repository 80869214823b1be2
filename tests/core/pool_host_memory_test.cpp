// The pool when the host runs out of memory: every allocation and free of the pool is noexcept,
// so an allocation of host memory that throws inside one would terminate the program the pool
// lives in. This binary replaces the global operator new so that, on the test's thread and while
// a test says so, the k-th host allocation and every one after it fail (throwing new throws,
// nothrow new returns null). The pool must then answer with out_of_memory or carry on, keep its
// invariants (Pool::validate) and every live block's bytes, and work again once memory is back.
#include <gtest/gtest.h>

#include <cstdlib>
#include <new>
#include <random>
#include <vector>

#include "gpustitch/pool.h"
#include "test_device.h"

namespace {
thread_local long tl_allow = -1;  // host allocations left before they fail; -1: no limit

bool host_allocation_fails() noexcept {
  if (tl_allow < 0) return false;
  if (tl_allow == 0) return true;
  --tl_allow;
  return false;
}

void* allocate_or_null(std::size_t n) noexcept {
  if (host_allocation_fails()) return nullptr;
  return std::malloc(n == 0 ? 1 : n);
}

void* allocate_or_throw(std::size_t n) {
  void* p = allocate_or_null(n);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

// Host memory fails after `allow` more allocations on this thread, until the scope ends.
struct HostMemoryLimit {
  explicit HostMemoryLimit(long allow) { tl_allow = allow; }
  ~HostMemoryLimit() { tl_allow = -1; }
};
}  // namespace

void* operator new(std::size_t n) {
  return allocate_or_throw(n);
}
void* operator new[](std::size_t n) {
  return allocate_or_throw(n);
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  return allocate_or_null(n);
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  return allocate_or_null(n);
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete[](void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  std::free(p);
}

using namespace gpustitch;

namespace {

struct Live {
  DevPtr ptr;
  std::size_t size;
  Stream stream;
};

// One fixed mix of small and large allocations and frees on three streams and without one,
// with trims, as a program would make them.
void run_script(Pool& pool, TestDevice& dev, std::vector<Live>& live, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const Stream streams[] = {kAnyStream, 0x1000, 0x2000, 0x3000};
  for (int step = 0; step < 400; ++step) {
    const auto r = rng() % 16;
    if (r < 9 || live.empty()) {
      const std::size_t size =
          r % 3 == 0 ? 64 + rng() % (200 * KiB) : 256 * KiB + rng() % (24 * MiB);
      const Stream s = streams[rng() % 4];
      DevPtr p = 0;
      const Status st = pool.allocate(0, size, s, &p);
      ASSERT_TRUE(st == Status::ok || st == Status::out_of_memory) << static_cast<int>(st);
      if (st != Status::ok) continue;
      stamp(dev, p, size, p ^ size);
      live.push_back({p, size, s});
    } else if (r < 15) {
      const std::size_t k = rng() % live.size();
      ASSERT_TRUE(check(dev, live[k].ptr, live[k].size, live[k].ptr ^ live[k].size));
      ASSERT_EQ(pool.deallocate(live[k].ptr, live[k].stream), Status::ok);
      live[k] = live.back();
      live.pop_back();
    } else {
      pool.trim(0);
    }
  }
}

TEST(PoolHostMemory, RunningOutOfHostMemoryAnywhereLosesNoBlockAndBreaksNothing) {
  // Each run lets the pool make `allow` more host allocations, then refuses every one: the
  // failure lands at a different place of the pool's paths each time.
  for (long allow : {0L, 1L, 2L, 3L, 5L, 8L, 13L, 21L, 34L, 55L, 89L, 144L, 233L}) {
    TestDevice dev = make_test_device({.capacity = 4 * GiB});
    if (dev.sim == nullptr) GTEST_SKIP() << "needs the simulated device";
    Pool pool(*dev.backend, inline_config());
    std::vector<Live> live;
    live.reserve(1024);              // the test's own bookkeeping must not fail
    run_script(pool, dev, live, 1);  // warm: tables and caches exist
    {
      HostMemoryLimit limit(allow);
      run_script(pool, dev, live, 2 + static_cast<std::uint64_t>(allow));
    }
    ASSERT_EQ(pool.validate(0), "") << "allow " << allow;
    for (const Live& l : live) {
      ASSERT_TRUE(check(dev, l.ptr, l.size, l.ptr ^ l.size)) << "allow " << allow;
    }
    // Memory is back: the pool serves again, all sizes.
    run_script(pool, dev, live, 99);
    ASSERT_EQ(pool.validate(0), "") << "allow " << allow;
    for (const Live& l : live) ASSERT_EQ(pool.deallocate(l.ptr, l.stream), Status::ok);
  }
}

TEST(PoolHostMemory, AColdPoolWithoutHostMemoryFailsItsFirstAllocationsCleanly) {
  TestDevice dev = make_test_device({.capacity = 4 * GiB});
  if (dev.sim == nullptr) GTEST_SKIP() << "needs the simulated device";
  Pool pool(*dev.backend, inline_config());
  std::vector<Live> live;
  live.reserve(1024);
  {
    HostMemoryLimit limit(0);
    run_script(pool, dev, live, 7);
  }
  ASSERT_EQ(pool.validate(0), "");
  run_script(pool, dev, live, 8);
  EXPECT_FALSE(live.empty()) << "the pool serves once host memory is back";
  for (const Live& l : live) ASSERT_EQ(pool.deallocate(l.ptr, l.stream), Status::ok);
}

}  // namespace
