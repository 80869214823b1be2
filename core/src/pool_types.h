// Internal types of the pool: physical handles and blocks of the device's address space.
//
//   Handle  one piece of physical memory from the backend (cuMemCreate). It is mapped whole at one
//           place of the device's address space, or held unmapped as a spare (backing.h).
//   Block   a contiguous part of the address space (address_space.h): free (mapped, fenced,
//           reusable), pending (freed, waiting for a fence), allocated, or unbacked (address
//           space with no physical memory behind it).
//
// Invariants (LargeHeap::validate checks them): the blocks of a span tile it in address order; no
// two free or two unbacked blocks are neighbours; an unbacked block starts and ends on a
// granularity boundary and no handle is mapped inside it; every byte of a free, pending or
// allocated block is mapped by exactly one handle.
#pragma once

#include <atomic>
#include <boost/intrusive/set_hook.hpp>
#include <cstdint>

#include "gpustitch/types.h"

namespace gpustitch::detail {

using AddressHook =
    boost::intrusive::set_member_hook<boost::intrusive::link_mode<boost::intrusive::safe_link>>;

struct Handle {
  PhysHandle id = 0;
  std::size_t size = 0;
  DevPtr at = 0;     // where it is mapped; 0: a spare (held, not mapped)
  AddressHook hook;  // Backing's index of mapped handles, by address
  DevPtr end() const { return at + size; }
};

enum class BlockState : std::uint8_t { free, pending, allocated, unbacked };

struct Block {
  DevPtr ptr = 0;
  std::size_t size = 0;
  Block* prev = nullptr;  // address-ordered neighbours in the same span
  Block* next = nullptr;
  AddressHook addr_hook;      // AddressSpace's index of every block, by address
  AddressHook unbacked_hook;  // AddressSpace's index of unbacked blocks, by address
  // In at most one free set (LargeHeap::FreeSet): its heap's free blocks, or, pending, its
  // stream's set of blocks that stream may reuse at once.
  AddressHook free_hook;
  std::uint16_t span = 0;  // which reservation of the address space
  // Its span's size range (LargeHeap::Options::range_limits): which requests it may serve.
  std::uint8_t size_range = 0;
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
  // pending on a stream: the event of its free (FreeEvents' sequence number; 0: none recorded).
  // A split's rest keeps it, as it keeps the epoch.
  std::uint64_t free_event = 0;
  Block* fq_prev = nullptr;
  Block* fq_next = nullptr;

  DevPtr end() const { return ptr + size; }
};

}  // namespace gpustitch::detail
