// A thread's arena: a SmallPool and a LargeCache (large_cache.h) with their own lock, live tables
// and counters.
//
// Threads are spread over a device's arenas (round-robin at a thread's first small allocation),
// so small allocations and frees on different threads do not contend for one lock. A free goes
// to the calling thread's arena first (the common case: the allocating thread frees), then to the
// large pool, then to the other arenas. Chunks come from, and go back to, the device's large pool
// (lock order: arena, then device; never the reverse). Freed large blocks are parked in the
// freeing thread's arena (large_cache.h), under the same lock.
#pragma once

#include <atomic>
#include <mutex>

#include "gpustitch/stats.h"
#include "hybrid_lock.h"
#include "large_cache.h"
#include "small_pool.h"

namespace gpustitch::detail {

struct alignas(64) Arena {
  Arena(std::size_t limit, std::size_t granularity, std::size_t large_budget,
        std::uint16_t arena_id)
      : small(limit, granularity), large(large_budget), id(arena_id) {}

  HybridLock mu;
  SmallPool small;
  LargeCache large;
  const std::uint16_t id;
  // Counters (small slots and the large cache's live blocks), under mu, merged into the device's
  // statistics on a snapshot.
  std::uint64_t allocs = 0;
  std::uint64_t frees = 0;
  std::uint64_t cache_hits = 0;
  std::uint64_t bytes_requested = 0;
  std::uint64_t live_blocks = 0;
  std::uint64_t hist_allocs[kHistogramBuckets] = {};
  std::uint64_t hist_live[kHistogramBuckets] = {};
  // Written under mu, read without it by the large path (peak tracking) and the reclaimer.
  std::atomic<std::uint64_t> bytes_allocated{0};
  std::atomic<bool> has_pending{false};
  std::atomic<std::uint64_t> parked_bytes{0};  // large.parked_bytes(), for readers without mu
  // Fences this arena ran itself (DevicePool::fence_arena), under mu: a parked block freed when
  // fences_started was s is covered once fences_done > s. last_fence_ns: how long the last one
  // waited (UINT64_MAX: none yet), to fence only an idle device inline.
  std::uint64_t fences_started = 0;
  std::uint64_t fences_done = 0;
  std::uint64_t last_fence_ns = UINT64_MAX;
  // Peak tracking (DevicePool::note_peak_arena), under mu: this arena's bytes_allocated when it
  // last summed the device's total, and the device's peak generation then.
  std::uint64_t peak_high = 0;
  std::uint64_t peak_gen = UINT64_MAX;

  // Whether the reclaimer has work here: small slots waiting for a fence, or parked blocks freed
  // with cudaFree semantics that no fence covers yet. Under mu.
  void refresh_pending(std::uint64_t device_epoch) noexcept {
    has_pending.store(
        small.has_pending() || large.has_unfenced(LargeCache::Fenced{device_epoch, fences_done}),
        std::memory_order_relaxed);
  }

  // One allocation served by this arena (bytes: what it takes; requested: what was asked for),
  // and one freed. Under mu.
  void count_alloc(std::uint64_t bytes, std::uint64_t requested) noexcept {
    bytes_allocated.store(bytes_allocated.load(std::memory_order_relaxed) + bytes,
                          std::memory_order_relaxed);
    const int bucket = histogram_bucket(requested);
    ++allocs;
    ++live_blocks;
    bytes_requested += requested;
    ++hist_allocs[bucket];
    ++hist_live[bucket];
  }
  void count_free(std::uint64_t bytes, std::uint64_t requested) noexcept {
    bytes_allocated.store(bytes_allocated.load(std::memory_order_relaxed) - bytes,
                          std::memory_order_relaxed);
    bytes_requested -= requested;
    --live_blocks;
    --hist_live[histogram_bucket(requested)];
    ++frees;
  }
};

}  // namespace gpustitch::detail
