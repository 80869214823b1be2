// Concurrency stress: 32 threads allocate, free and trim at random for a bounded time on a small
// simulated device, so that fresh memory runs out and stitching is forced. Checked: no two live
// blocks overlap, every block keeps its bytes, nothing leaks, statistics add up.
// GPUSTITCH_STRESS_SECONDS sets the duration (default 5).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "gpustitch/pool.h"
#include "test_device.h"

using namespace gpustitch;

TEST(PoolStress, ThirtyTwoThreadsWithForcedStitching) {
  TestDevice dev = make_test_device({.capacity = 3 * GiB});
  if (dev.sim == nullptr) GTEST_SKIP() << "needs a small simulated device";
  const char* env = std::getenv("GPUSTITCH_STRESS_SECONDS");
  const double seconds = env != nullptr ? std::atof(env) : 5.0;
  std::uint64_t ooms_seen = 0, allocs_done = 0, frees_done = 0, trims_done = 0;
  {
    Pool pool(*dev.backend, Config{});
    std::mutex ranges_mu;
    std::map<DevPtr, std::size_t> ranges;  // every live block, for the overlap check
    std::atomic<std::uint64_t> ooms{0}, allocs{0}, frees{0}, trims{0}, failures{0};
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    auto worker = [&](int id) {
      std::mt19937_64 rng(id * 7919 + 1);
      std::vector<std::pair<DevPtr, std::size_t>> mine;
      const Stream stream = 0x100 + static_cast<Stream>(id % 4);
      while (std::chrono::steady_clock::now() < deadline) {
        const unsigned op = rng() % 100;
        if (op < 50 && mine.size() < 24) {
          std::size_t size = rng() % 3 ? 64 + rng() % (512 * KiB) : 2 * MiB + rng() % (96 * MiB);
          DevPtr p = 0;
          Status s = pool.allocate(0, size, rng() % 2 ? kAnyStream : stream, &p);
          if (s == Status::out_of_memory) {
            ++ooms;
            continue;
          }
          if (s != Status::ok) {
            ++failures;
            continue;
          }
          ++allocs;
          {
            std::lock_guard lock(ranges_mu);
            auto next = ranges.lower_bound(p);
            if (next != ranges.end() && p + size > next->first) ++failures;
            if (next != ranges.begin() && std::prev(next)->first + std::prev(next)->second > p) {
              ++failures;
            }
            ranges[p] = size;
          }
          std::uint64_t tag = p * 31 + id;
          dev.write(p, &tag, 8);
          dev.write(p + size - 8, &tag, 8);
          mine.emplace_back(p, size);
        } else if (op < 97 && !mine.empty()) {
          std::size_t k = rng() % mine.size();
          auto [p, size] = mine[k];
          std::uint64_t tag = p * 31 + id, a = 0, b = 0;
          dev.read(p, &a, 8);
          dev.read(p + size - 8, &b, 8);
          if (a != tag || b != tag) ++failures;
          {
            std::lock_guard lock(ranges_mu);
            ranges.erase(p);
          }
          if (pool.deallocate(p, rng() % 2 ? kAnyStream : stream) != Status::ok) ++failures;
          ++frees;
          mine[k] = mine.back();
          mine.pop_back();
        } else {
          pool.trim(0);
          ++trims;
        }
      }
      for (auto [p, size] : mine) {
        {
          std::lock_guard lock(ranges_mu);
          ranges.erase(p);
        }
        if (pool.deallocate(p) != Status::ok) ++failures;
        ++frees;
      }
    };
    std::vector<std::thread> threads;
    for (int t = 0; t < 32; ++t) threads.emplace_back(worker, t);
    for (auto& t : threads) t.join();
    EXPECT_EQ(failures.load(), 0u);
    DeviceStats s = pool.stats(0);
    EXPECT_EQ(s.allocs, allocs.load());
    EXPECT_EQ(s.frees, frees.load());
    EXPECT_EQ(s.ooms, ooms.load());
    EXPECT_EQ(s.live_blocks, 0u);
    EXPECT_EQ(s.bytes_requested, 0u);
    EXPECT_EQ(s.bytes_allocated, 0u);
    pool.trim(0);
    EXPECT_EQ(pool.stats(0).bytes_reserved, 0u);
    ooms_seen = ooms, allocs_done = allocs, frees_done = frees, trims_done = trims;
    std::printf(
        "stress: %.1f s, %llu allocations, %llu frees, %llu trims, %llu OOMs, %llu stitches\n",
        seconds, (unsigned long long)allocs_done, (unsigned long long)frees_done,
        (unsigned long long)trims_done, (unsigned long long)ooms_seen,
        (unsigned long long)s.stitches);
  }
  EXPECT_EQ(dev.sim->used(0), 0u);
  EXPECT_EQ(dev.sim->live_handles(), 0u);
  EXPECT_EQ(dev.sim->live_mappings(), 0u);
  EXPECT_EQ(dev.sim->live_reservations(), 0u);
}
