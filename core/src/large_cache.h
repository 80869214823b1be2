// Per-arena cache of large blocks freed stream-ordered (cudaFreeAsync semantics).
//
// Why: large blocks (>= small_limit) are carved, stitched and fenced by the device pool under one
// lock per device, so two threads that each allocate and free a large block in a loop on their own
// stream take turns on that lock and together run slower than one thread alone (0.45-0.6x on two
// cores). The small-object path avoids this with per-thread arenas; this cache gives large blocks
// the same treatment for the case where stream order makes it safe.
//
// What it holds, per arena:
//   - parked blocks: large blocks freed on a stream, kept for that stream. The same stream may
//     reuse one at once, because stream order guarantees that the stream's work queued before the
//     free runs before any work queued after the next allocation (the rule the device pool's
//     per-stream pending sets and the small pool's stream caches follow). Another stream never
//     gets a parked block: it must first leave for the device pool as pending and be fenced.
//   - live blocks: the large blocks this arena handed out (from its parked blocks, or from the
//     device pool for a stream-ordered request on this arena's thread), so that their frees find
//     them without the device lock too. Nodes come from a pool, not malloc, in the steady state.
// A thread looping allocate/free of large blocks on its stream thus takes only its arena's lock.
//
// Rules:
//   - a parked block serves a request of its stream whose rounded size is its size or at most 1/8
//     smaller; it is never split (splitting changes the device's block list: device lock);
//   - bounded: at most kMaxParked blocks and `budget` bytes per arena (large_cache_mb; 0 turns the
//     cache off; a block larger than the budget is never parked). Parking past a bound sends the
//     oldest parked blocks to the device pool as pending on their streams, with the fence epoch of
//     their free, down to half the bounds at once: a thread whose large frees and allocations
//     alternate at random then takes the device lock about once per kMaxParked/2 frees past the
//     bound, not on every other free (measured on pool_bench's MixedRandom: 8 blocks, evicting one
//     at a time, sent 16% of its large operations through the device pool; 32 blocks, evicting
//     half, about 1-2%);
//   - an allocation of the stream that misses the cache and finds no cached block in the device
//     pool first hands that stream's larger parked blocks to the device pool (take_larger), where
//     they may be split for it, rather than take fresh memory;
//   - parked blocks are not aged out: an idle thread's arena keeps them (at most the budget per
//     arena) until a bound, a drain or that stream's next allocation moves them;
//   - wherever the pool empties the small pool's stream caches (out-of-memory retry, trim,
//     release_idle, drain_pending) it also drains every arena's parked blocks to the device pool,
//     so memory parked in another thread's arena never makes an allocation fail;
//   - to the device pool an arena-held block (parked or live) is simply allocated; it carries
//     Block::arena_owned and Block::arena (written under both locks) and, while parked,
//     Block::parked (see pool_types.h). Parked bytes count as cached and pending, not allocated.
//
// Not thread-safe: used under the owning Arena's lock. Moving a block between an arena and the
// device pool takes the device lock as well (arena first, then device; never the reverse).
#pragma once

#include <cstddef>
#include <memory_resource>
#include <unordered_map>

#include "pool_types.h"

namespace gpustitch::detail {

class LargeCache {
 public:
  static constexpr std::size_t kMaxParked = 32;  // a linear scan of 32 pointers is cheap

  explicit LargeCache(std::size_t budget);

  bool enabled() const { return budget_ != 0; }
  // Whether a block of this size may be parked at all (within the byte budget by itself).
  bool can_park(std::size_t size) const { return size <= budget_; }

  // A parked block of `stream` for an allocation of `rounded` bytes (best fit, at most 1/8
  // larger), taken out of the cache and unmarked; nullptr if none fits.
  Block* take(Stream stream, std::size_t rounded) noexcept;
  // Parks b (b->stream: the stream it was freed on; b->epoch: the fence epoch of its free).
  // Writes to `evicted` (room for kMaxParked) the oldest blocks that had to leave to keep the
  // bounds, unmarked, and returns their number.
  std::size_t park(Block* b, Block** evicted) noexcept;
  // Takes parked blocks of `stream` larger than `rounded` + 1/8, which cannot serve it (an
  // allocation missing the cache hands them to the device pool, where they may be split).
  std::size_t take_larger(Stream stream, std::size_t rounded, Block** out) noexcept;
  // Takes every parked block, oldest first (room for kMaxParked); returns their number.
  std::size_t drain(Block** out) noexcept;
  // The parked block starting at ptr; nullptr if none (memory snapshots).
  const Block* parked(DevPtr ptr) const noexcept;
  std::size_t parked_bytes() const { return parked_bytes_; }
  std::size_t parked_count() const { return count_; }

  void add_live(Block* b) { live_.emplace(b->ptr, b); }
  // The live block starting at ptr, removed from the live table; nullptr if none.
  Block* take_live(DevPtr ptr) noexcept;
  // The live block starting at ptr; nullptr if none.
  const Block* live(DevPtr ptr) const noexcept;
  bool has_live() const { return !live_.empty(); }

 private:
  Block* remove_at(std::size_t i) noexcept;

  std::size_t budget_;
  Block* parked_[kMaxParked] = {};  // oldest first
  std::size_t count_ = 0;
  std::size_t parked_bytes_ = 0;
  std::pmr::unsynchronized_pool_resource node_pool_;
  std::pmr::unordered_map<DevPtr, Block*> live_{&node_pool_};
};

}  // namespace gpustitch::detail
