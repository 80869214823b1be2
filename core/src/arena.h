// A small-object arena: a SmallPool with its own lock, live table and counters.
//
// Threads are spread over a device's arenas (round-robin at a thread's first small allocation),
// so small allocations and frees on different threads do not contend for one lock. A free goes
// to the calling thread's arena first (the common case: the allocating thread frees), then to the
// large pool, then to the other arenas. Chunks come from, and go back to, the device's large pool
// (lock order: arena, then device; never the reverse).
#pragma once

#include <atomic>
#include <mutex>

#include "gpustitch/stats.h"
#include "hybrid_lock.h"
#include "small_pool.h"

namespace gpustitch::detail {

struct alignas(64) Arena {
  Arena(std::size_t limit, std::size_t granularity, std::uint16_t arena_id)
      : small(limit, granularity), id(arena_id) {}

  HybridLock mu;
  SmallPool small;
  const std::uint16_t id;
  // Counters, under mu, merged into the device's statistics on a snapshot.
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
};

}  // namespace gpustitch::detail
