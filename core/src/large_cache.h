// Per-arena cache of large blocks freed by this arena's threads.
//
// Why: large blocks (>= small_limit) are carved, stitched and fenced by the device pool under one
// lock per device, so two threads that each allocate and free a large block in a loop take turns
// on that lock and together run slower than one thread alone (0.45-0.6x on two cores). The
// small-object path avoids this with per-thread arenas; this cache gives large blocks the same
// treatment wherever the fence rules allow it.
//
// What it holds, per arena:
//   - parked blocks: large blocks freed on this arena's threads, kept for reuse. A block freed on
//     a stream (cudaFreeAsync semantics) serves that stream at once, because stream order
//     guarantees that the stream's work queued before the free runs before any work queued after
//     the next allocation (the rule the device pool's per-stream pending sets and the small pool's
//     stream caches follow). Any other allocation, and every allocation of a block freed without a
//     stream (cudaFree semantics), waits for a fence that began after the free: one the device
//     pool completed (its epoch, Block::epoch <= DevicePool's completed epoch) or one this arena
//     ran itself (Block::arena_fence < Arena::fences_done). A cudaMalloc/cudaFree loop on an idle
//     device thus fences in its own arena, with no device lock, as native cudaFree waits for the
//     device; on a busy device (the last fence was slow) the fitting block goes to the device
//     pool as pending instead, where the "much memory pending: wait rather than grow" rule sees
//     it (device_pool.cpp);
//   - live blocks: the large blocks this arena handed out (from its parked blocks, or from the
//     device pool for a request on this arena's thread), so that their frees find them without
//     the device lock too (block_table.h: no allocation in the steady state).
// A thread looping allocate/free of one large size thus takes only its arena's lock.
//
// Rules:
//   - a parked block serves a request whose rounded size is its size or at most 1/8 smaller; it
//     is never split (splitting changes the device's block list: device lock);
//   - bounded: at most kMaxParked blocks and `budget` bytes per arena (large_cache_mb; 0 turns the
//     cache off; a block larger than the budget is never parked). Parking past a bound sends the
//     oldest parked blocks to the device pool as pending on their streams, with the fence epoch of
//     their free, down to half the bounds at once: a thread whose large frees and allocations
//     alternate at random then takes the device lock about once per kMaxParked/2 frees past the
//     bound, not on every other free (measured on pool_bench's MixedRandom: 8 blocks, evicting one
//     at a time, sent 16% of its large operations through the device pool; 32 blocks, evicting
//     half, about 1-2%);
//   - an allocation that misses the cache and finds no cached block in the device pool first
//     hands parked blocks to the device pool (take_for_device): its stream's larger blocks, which
//     may be split there, and for a cudaMalloc the fitting ones still waiting for a fence, which
//     the device pool's fence rules then handle. A cudaMalloc that would next stitch or take
//     fresh memory also hands over the smaller ones (device_pool.cpp), which the device pool may
//     fence and stitch: a cudaMalloc/cudaFree mix of 1-4 MiB otherwise took fresh memory for most
//     4 MiB requests while 2 MiB frees sat here (56 us per allocation on an H200); handing every
//     parked block over at every miss instead made it stitch 2 MiB pairs 5,800 times (44 us);
//   - fence batching: where a fence costs more than the device pool's path (an H200), a request
//     whose fitting parked blocks all wait for a fence takes one more block instead, and keeps
//     them parked, while the arena holds fewer than 8 of them within 1/16 of the budget; one
//     fence then covers them all (DevicePool::grow_rather_than_fence);
//   - parked blocks are not aged out: an idle thread's arena keeps them (at most the budget per
//     arena) until a bound, a drain or a later allocation moves them. Blocks freed with cudaFree
//     semantics mark the arena as pending (Arena::has_pending) until a fence covers them, so the
//     reclaimer fences them as it fences the fence queue;
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

#include "block_table.h"
#include "pool_types.h"

namespace gpustitch::detail {

class LargeCache {
 public:
  static constexpr std::size_t kMaxParked = 32;  // a linear scan of 32 pointers is cheap

  explicit LargeCache(std::size_t budget);

  bool enabled() const { return budget_ != 0; }
  // Whether a block of this size may be parked at all (within the byte budget by itself).
  bool can_park(std::size_t size) const { return size <= budget_; }

  // Which parked blocks a completed fence covers: freed at or before the device pool's completed
  // epoch, or before the arena's own last completed fence.
  struct Fenced {
    std::uint64_t device_epoch = 0;  // DevicePool's completed epoch
    std::uint64_t arena_fences = 0;  // Arena::fences_done
    bool covers(const Block* b) const {
      return b->epoch <= device_epoch || b->arena_fence < arena_fences;
    }
  };
  // A parked block for an allocation of `rounded` bytes on `stream` (best fit, at most 1/8
  // larger) that it may use now: freed on that same stream, or covered by a fence. Taken out of
  // the cache and unmarked; nullptr if none. *unfenced_fits: how many blocks that fit wait for a
  // fence only (counted when none could be taken).
  Block* take(Stream stream, std::size_t rounded, Fenced fenced,
              std::size_t* unfenced_fits) noexcept;
  // Parks b (b->stream: the stream it was freed on; b->epoch: the fence epoch of its free).
  // Writes to `evicted` (room for kMaxParked) the oldest blocks that had to leave to keep the
  // bounds, unmarked, and returns their number.
  std::size_t park(Block* b, Block** evicted) noexcept;
  // Takes the parked blocks of `stream` that cannot serve an allocation of `rounded` bytes here
  // but may in the device pool: larger than `rounded` + 1/8 (split there), and for kAnyStream
  // (blocks freed with cudaFree semantics) fitting ones too (fenced there). For kAnyStream with
  // rounded 0: every block freed with cudaFree semantics.
  std::size_t take_for_device(Stream stream, std::size_t rounded, Block** out) noexcept;
  // Whether a block freed with cudaFree semantics waits for a fence (the reclaimer's work).
  bool has_unfenced(Fenced fenced) const noexcept;
  // Takes every parked block, oldest first (room for kMaxParked); returns their number.
  std::size_t drain(Block** out) noexcept;
  // The parked block starting at ptr; nullptr if none (memory snapshots).
  const Block* parked(DevPtr ptr) const noexcept;
  std::size_t parked_bytes() const { return parked_bytes_; }
  std::size_t parked_count() const { return count_; }

  void add_live(Block* b) { live_.insert(b); }
  // The live block starting at ptr, removed from the live table; nullptr if none.
  Block* take_live(DevPtr ptr) noexcept;
  // The live block starting at ptr; nullptr if none.
  const Block* live(DevPtr ptr) const noexcept;
  bool has_live() const { return !live_.empty(); }

 private:
  Block* remove_at(std::size_t i) noexcept;

  std::size_t budget_;
  Block* parked_[kMaxParked] = {};  // oldest first
  // parked_[i]->size, beside the pointers: take() rejects most blocks on size alone, and with
  // sizes cut at 512 B (they rarely repeat exactly) reading each Block cost a cache miss apiece:
  // take() was 18% of pool_bench's mixed-size run.
  std::size_t sizes_[kMaxParked] = {};
  std::size_t count_ = 0;
  std::size_t parked_bytes_ = 0;
  BlockTable live_{64};  // no growth while a thread keeps a few dozen blocks live
};

}  // namespace gpustitch::detail
