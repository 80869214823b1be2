// What the files of DevicePool share (device_pool.cpp, device_pool_arenas.cpp,
// device_pool_fencing.cpp, device_pool_release.cpp, device_pool_stats.cpp): tuning constants
// and clocks. Internal to the core.
#pragma once

#include <atomic>
#include <cstdint>
#include <ctime>

#include "gpustitch/config.h"
#include "gpustitch/types.h"

namespace gpustitch::detail {

inline constexpr std::size_t kLargeBuffer = 20 * MiB;  // PyTorch's slack for oversize blocks
// size_ranges:on: requests below 1 MiB, below 4 MiB and larger each get address ranges of their
// own (large_heap.cpp: the limits measured).
inline constexpr std::size_t kSizeRangeLimits[2] = {1 * MiB, 4 * MiB};
inline constexpr std::uint64_t kCheapFenceNs = 50'000;  // a fence this fast means an idle device
inline constexpr std::uint64_t kFenceSample = 8;        // an arena times one fence in 8
inline constexpr std::uint64_t kInlineFenceNs = 300;  // an arena fence cheaper than the device path
inline constexpr std::size_t kFenceBatch = 8;  // blocks of one size an arena keeps for one fence
inline constexpr std::size_t kMinBlock = 512;  // large blocks are cut at 512 B, as PyTorch's

// Arenas per device pool without Config::arenas (device_pool_arenas.cpp): one per core, at most
// kMaxArenas.
unsigned arena_slots();
// Makes the calling thread use arena index % n of every pool of n arenas
// (Pool::bind_thread_to_arena).
void bind_thread_arena(unsigned index) noexcept;

inline void atomic_max(std::atomic<std::uint64_t>& a, std::uint64_t v) {
  std::uint64_t cur = a.load(std::memory_order_relaxed);
  while (cur < v && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}

inline std::uint64_t monotonic_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000ull +
         static_cast<std::uint64_t>(ts.tv_nsec);
}

inline std::uint64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000ull +
         static_cast<std::uint64_t>(ts.tv_nsec);
}

}  // namespace gpustitch::detail
