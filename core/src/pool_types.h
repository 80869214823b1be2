// Internal types of the pool: physical handles, views (mapped address ranges) and blocks.
//
//   Handle  one piece of physical memory from the backend (cuMemCreate).
//   View    one reserved address range with handles (or slices of them) mapped side by side.
//           A "home" view is made for a fresh allocation: one handle, mapped whole. A "stitched"
//           view is made by stitching: slices of handles whose memory was free in other views.
//   Block   a contiguous part of a view: free, pending (freed, waiting for a fence), allocated,
//           or lent (its physical memory is mapped into a stitched view and used from there).
//
// A handle may be mapped in several views at once (its home view and stitched views); the pool
// guarantees that each physical byte is reachable through at most one non-lent block.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "gpustitch/types.h"

namespace gpustitch::detail {

struct Handle {
  PhysHandle id = 0;
  std::size_t size = 0;
  int maps = 0;  // views this handle is mapped in
};

struct View;

enum class BlockState : std::uint8_t { free, pending, allocated, lent };

struct Block {
  DevPtr ptr = 0;
  std::size_t size = 0;
  View* view = nullptr;
  Block* prev = nullptr;  // address-ordered neighbours in the same view
  Block* next = nullptr;
  BlockState state = BlockState::free;
  bool small_chunk = false;  // allocated to the small-object pool as a chunk
  // Held by an arena's large cache (large_cache.h): live there or parked. Written under both the
  // arena's and the device's lock, so either lock suffices to read it.
  bool arena_owned = false;
  std::uint16_t arena = 0;  // small_chunk or arena_owned: the arena that owns it
  // Parked in its arena's large cache: freed, not allocated, although its state
  // stays `allocated` (the device pool does not touch it). Set and cleared under the arena's lock;
  // read anywhere (e.g. under the device lock, to report the block as pending).
  std::atomic<bool> parked{false};
  bool is_parked() const { return parked.load(std::memory_order_relaxed); }
  // allocated: what the caller asked for, and on which stream.
  std::size_t requested = 0;
  Stream stream = kAnyStream;
  // pending (and parked): the device's fence epoch at its free, and the fence queue links.
  std::uint64_t epoch = 0;
  // parked: its arena's fence count at its free (Arena::fences_started), so that a fence the
  // arena ran itself after the free also covers it (large_cache.h).
  std::uint64_t arena_fence = 0;
  Block* fq_prev = nullptr;
  Block* fq_next = nullptr;
  // lent: the stitched view that borrowed this block's memory.
  View* lent_to = nullptr;

  DevPtr end() const { return ptr + size; }
};

struct Piece {
  std::size_t offset = 0;  // within the view
  std::size_t size = 0;
  Handle* handle = nullptr;
  std::size_t handle_offset = 0;
};

struct View {
  DevPtr base = 0;
  std::size_t size = 0;
  bool stitched = false;
  std::vector<Piece> pieces;     // sorted by offset, covering [0, size)
  std::vector<Block*> borrowed;  // stitched: the blocks of other views lent to this one
  std::vector<Handle*> owned;    // stitched: handles created for it (released with it)
  Block* first = nullptr;        // first block in address order

  DevPtr end() const { return base + size; }
  bool wholly_free() const {
    return first != nullptr && first->next == nullptr && first->state == BlockState::free;
  }
};

}  // namespace gpustitch::detail
