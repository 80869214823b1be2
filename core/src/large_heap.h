// The large-block heap of one device: where in the device's address space a block goes, and
// which physical memory backs it. This file owns the pool's memory layout; see the comment at the
// top of large_heap.cpp for the design, its costs and the alternatives measured. Its parts:
// large_heap.cpp (placement, the miss path, ordinary handle sizes, invariants), coarse_handles.cpp
// (large fresh handles and how they are split later), heap_release.cpp (memory back to the
// driver).
//
// Layers (data flows one way): DevicePool (fencing, arenas, statistics) -> LargeHeap (placement,
// backing policy) -> AddressSpace (blocks) + Backing (handles) -> Backend.
#pragma once

#include <boost/intrusive/set.hpp>

#include <memory_resource>
#include <set>
#include <string>
#include <vector>

#include "address_space.h"
#include "backing.h"
#include "gpustitch/stats.h"

namespace gpustitch::detail {

class LargeHeap {
 public:
  struct Options {
    std::size_t granularity = 2 * MiB;
    std::size_t span_size = 0;  // the first reservation; 0: twice the device's memory
    // Fresh memory for one gap: handles of min_handle, or of 1/max_fresh_handles of the gap when
    // that is larger, but none above max_handle (large_heap.cpp: the trade-off).
    std::size_t min_handle = 2 * MiB;
    std::size_t max_fresh_handles = 64;
    std::size_t max_handle = SIZE_MAX;
    // And none above 1/handle_share of the physical memory the heap holds outside very large
    // live blocks (0: no such bound; large_heap.cpp: which blocks, and why).
    std::size_t handle_share = 0;
    // But at most this many handles per gap where that bound makes them small (0: no bound).
    std::size_t max_handles_per_gap = 16;
    // Fresh memory of at least coarse_min bytes (0: never) comes in at most coarse_handles
    // handles of coarse_min or more, with one granule at an end the block only partly covers
    // (large_heap.cpp: fresh-block cost).
    std::size_t coarse_min = 0;
    // The same for a stream-ordered request's fresh memory (0: never; config.h: why it differs).
    std::size_t coarse_min_stream = 0;
    std::size_t coarse_handles = 4;
    bool move = true;  // back requests with idle handles moved from elsewhere
    // A moved handle's old place is unmapped by the reclaimer thread, not the allocating one
    // (retired_mappings.h); false: inline, as without that thread.
    bool defer_unmap = false;
    // PyTorch's max_split_size_mb: free blocks at least this large serve only requests at least
    // this large, and their handles do not move for smaller ones.
    std::size_t max_split_size = SIZE_MAX;
    // Size ranges with address ranges of their own (large_heap.cpp: why): a request below
    // range_limits[0] is placed among blocks of range 0 only, one below range_limits[1] among
    // those of range 1, others among those of the last range (0: no such limit). Physical memory
    // moves between them freely.
    std::size_t range_limits[2] = {0, 0};
    // The memory-first phase (large_heap.cpp: why): until the heap first holds this many bytes
    // outside very large live blocks, requests are placed by size range (range_limits) and fresh
    // handles are of 1/kMemoryFirstShare of the heap, with no bound per gap (0: no such phase).
    std::size_t memory_first_below = 0;
    // Size ranges after that phase too (size_ranges:on); otherwise every request is placed in
    // the largest requests' range once it ends.
    bool ranges_always = false;
  };
  // handle_share during the memory-first phase.
  static constexpr std::size_t kMemoryFirstShare = 1024;
  // How grow() served a request.
  struct Growth {
    std::size_t fresh_bytes = 0;  // created for it
    std::size_t fresh_handles = 0;
    std::size_t moved_handles = 0;  // unmapped where they lay free and mapped here
    std::size_t spare_handles = 0;  // held unmapped, mapped here
    std::size_t moved_bytes = 0;    // moved and spare
  };

  // By size range first: best fit for a request looks at its own range's blocks only.
  struct BySize {
    bool operator()(const Block& a, const Block& b) const {
      if (a.size_range != b.size_range) return a.size_range < b.size_range;
      return a.size != b.size ? a.size < b.size : a.ptr < b.ptr;
    }
  };
  // Intrusive (Block::free_hook): inserting and erasing allocate nothing, so the free and
  // allocation paths, all noexcept, cannot fail for want of host memory here.
  using FreeSet =
      boost::intrusive::set<Block,
                            boost::intrusive::member_hook<Block, AddressHook, &Block::free_hook>,
                            boost::intrusive::compare<BySize>>;

  // observer, if set, hears of every change to what is mapped (PoolObserver::on_segment), under
  // the caller's lock; it is the only thing the heap tells anyone.
  LargeHeap(Backend& backend, int device, const Options& options,
            PoolObserver* observer = nullptr) noexcept;
  Status init(std::size_t device_total) noexcept;  // reserves the first span

  bool contains(DevPtr ptr) const noexcept { return space_.contains(ptr); }
  Block* block_at(DevPtr ptr) const noexcept { return space_.block_at(ptr); }

  // Fenced free blocks, by size range and size (DevicePool's best fit reads and cuts them).
  FreeSet& free_blocks() noexcept { return free_; }
  std::size_t largest_free() const noexcept;
  // The size range of a request of `rounded` bytes (Options::range_limits): the last one for
  // every request while ranges are not in use (after the memory-first phase).
  std::uint8_t range_of(std::size_t rounded) const noexcept {
    std::uint8_t r = 0;
    for (std::size_t limit : options_.range_limits) {
      if (limit != 0 && (rounded >= limit || !ranges_in_use_)) ++r;
    }
    return r;
  }
  // The smallest free block of set that can serve a request of `rounded` bytes (best fit), or
  // set.end(). After the memory-first phase, a request that phase would have placed in a smaller
  // size range looks there first, so the free memory the phase left between small blocks is
  // reused rather than reached only by moving its idle handles (replay: hf_llama_train in stream
  // order 1.020 -> 1.019 of demand, and 1.038 -> 1.025 with the phase ending at 2 GiB).
  FreeSet::iterator fit(FreeSet& set, std::size_t rounded) const noexcept {
    const std::uint8_t range = range_of(rounded);
    if (!ranges_in_use_ && options_.memory_first_below != 0) {
      std::uint8_t home = 0;
      for (std::size_t limit : options_.range_limits) {
        if (limit != 0 && rounded >= limit) ++home;
      }
      if (home != range) {
        auto it = best_fit(set, rounded, home);
        if (it != set.end()) return it;
      }
    }
    return best_fit(set, rounded, range);
  }
  // The smallest block of set in rounded's size range holding at least `rounded` bytes (best
  // fit), or set.end().
  static FreeSet::iterator best_fit(FreeSet& set, std::size_t rounded,
                                    std::uint8_t range) noexcept {
    Block probe;
    probe.size = rounded;
    probe.ptr = 0;
    probe.size_range = range;
    auto it = set.lower_bound(probe);
    return it != set.end() && it->size_range == range ? it : set.end();
  }
  // b keeps [0,size), the rest is returned (b's state); nullptr: no host memory, nothing changed.
  Block* split(Block* b, std::size_t size) noexcept { return space_.split(b, size); }
  // b absorbs its next neighbour (in no free set; the caller took it out of its own sets).
  void absorb_next(Block* b) noexcept { space_.absorb_next(b); }
  // b becomes free: merged with free neighbours and indexed by size.
  void make_free(Block* b) noexcept;
  // A block is about to be cut out of free memory with one end at `boundary`. If that end falls
  // inside a coarse handle (Options::coarse_min) lying wholly idle, the handle is first split in
  // three (split_at), so that the live block pins at most the one granule it shares with the free
  // rest. Only fenced free memory may be split (the GPU may still use a block waiting for its
  // fence). `free_size`: the size of the free block holding the boundary, where known. True: the
  // layout changed; the caller looks its block up again.
  bool split_for_cut(DevPtr boundary, std::size_t free_size = SIZE_MAX) noexcept;
  // Whether cutting the pending block b at `boundary` would leave a coarse handle lying wholly in
  // b split by the cut: what split_for_cut would split once b's fence has come.
  bool pending_cut_pins(const Block* b, DevPtr boundary) const noexcept;
  // Whether any coarse handle was ever created: pending_cut_pins's callers skip their lookups.
  bool made_coarse_handles() const noexcept { return coarse_created_ != 0; }
  // b becomes allocated (mark_allocated) or is about to stop being allocated (note_dead, where
  // the caller changes its state): what handle_share leaves out follows the very large live
  // blocks.
  void mark_allocated(Block* b) noexcept {
    b->state = BlockState::allocated;
    if (b->size >= share_exempt_) exempt_live_ += b->size;
  }
  void note_dead(const Block* b) noexcept {
    if (b->size >= share_exempt_) exempt_live_ -= b->size;
  }
  std::size_t exempt_live_bytes() const noexcept { return exempt_live_; }

  // The miss path: a block of `rounded` bytes placed where it needs the least new physical
  // memory, backed by spare handles, idle handles moved from free blocks elsewhere (Options::move)
  // and, for the rest, at most `fresh_allowance` bytes of fresh handles. out_of_memory changes
  // nothing but what it could not undo (handles it moved stay where they went, as spares).
  // allow_move false: no idle handle moves for this request (spares and fresh memory only).
  // stream_ordered: the request is a stream's (cudaMallocAsync), whose fresh memory comes in
  // large handles only from Options::coarse_min_stream.
  Status grow(std::size_t rounded, std::size_t fresh_allowance, Block** out, Growth* growth,
              bool allow_move = true, bool stream_ordered = false) noexcept;

  // Gives idle physical memory back to the driver: spare handles, then handles lying wholly
  // inside free blocks. release_one gives back one handle (the smallest covering `wanted`, else
  // the largest), release gives back handles until `wanted` bytes are gone. Return the bytes.
  std::size_t release_one(std::size_t wanted) noexcept;
  std::size_t release(std::size_t wanted) noexcept;
  std::size_t handles_released() const noexcept { return handles_released_; }
  std::size_t retry_failed() noexcept { return backing_.retry_failed(); }
  // Physical memory that moving can reuse now: spares and handles wholly inside free blocks (a
  // walk over every handle), and a bound of it from the free blocks alone (a walk over those).
  std::size_t idle_bytes() const noexcept;
  std::size_t idle_bound() const noexcept;

  Status grant_peer(int peer) noexcept { return backing_.grant_peer(peer); }

  std::size_t reserved_bytes() const noexcept { return backing_.held_bytes(); }
  // What the heap holds outside very large live blocks (those handle_share leaves out).
  std::size_t working_held() const noexcept {
    const std::size_t held = backing_.held_bytes();
    return held - std::min(held, exempt_live_);
  }
  std::size_t mapped_bytes() const noexcept { return backing_.mapped_bytes(); }
  std::size_t handle_count() const noexcept { return backing_.handle_count(); }
  std::size_t span_count() const noexcept { return space_.span_count(); }
  const AddressSpace& space() const noexcept { return space_; }
  const Backing& backing() const noexcept { return backing_; }
  Backing& backing() noexcept { return backing_; }  // handle lending (handle_lending.cpp)

  // Checks the invariants of pool_types.h and that the free set holds exactly the free blocks.
  // `extra_free`: blocks indexed elsewhere by the caller are not expected here. Empty: all hold.
  std::string validate() const;

 private:
  struct Window {
    DevPtr start = 0;   // the block goes at [start, start + rounded)
    DevPtr gap_lo = 0;  // the unbacked part of it to back, granule-aligned
    DevPtr gap_hi = 0;
    Block* unbacked = nullptr;
    Block* prev = nullptr;  // free neighbours the window may use
    Block* next = nullptr;
  };
  // The sizes of the fresh handles for one gap, in mapping order: `head` bytes first and `tail`
  // bytes last where set (0: none), `inner` bytes per handle between them (the last one smaller).
  struct FreshPlan {
    std::size_t total = 0, head = 0, inner = 0, tail = 0;
    std::size_t next(std::size_t done) const noexcept {
      const std::size_t left = total - done;
      if (done < head) return std::min(head - done, left);
      if (left <= tail) return left;
      return std::min(inner, left - tail);
    }
    std::size_t count() const noexcept {
      std::size_t n = 0;
      for (std::size_t done = 0; done < total; ++n) done += next(done);
      return n;
    }
  };
  // `handle`: the ordinary size. head/tail: the block leaves part of the fresh range's first/last
  // granule free, which it would pin with the handle there. coarse_min: Options::coarse_min or
  // coarse_min_stream, as the request is.
  FreshPlan plan_fresh(std::size_t fresh, std::size_t handle, bool head, bool tail,
                       std::size_t coarse_min) const noexcept;
  // The ordinary size of a fresh handle when the heap grows by `fresh` bytes.
  std::size_t fine_handle(std::size_t fresh) const noexcept;
  bool refine(Handle* h) noexcept;
  // h replaced by three handles: before the granule `boundary` lies in, that granule, the rest.
  bool split_at(Handle* h, DevPtr boundary) noexcept;
  // h (mapped, wholly idle) released and its place backed by new handles of next_part(done, size)
  // bytes each; what the driver refuses becomes unbacked. False: nothing changed.
  template <class NextPart>
  bool rebuild(Handle* h, NextPart next_part) noexcept;
  // A handle lying wholly idle is unmapped, its place made unbacked, and given back; the bytes
  // given back (0: the driver kept it, nothing changed).
  std::size_t release_mapped(Handle* h) noexcept;
  // The window for a request of `rounded` bytes in size range `range`'s spans; false: none.
  bool place(std::size_t rounded, std::uint8_t range, Window* w) const noexcept;
  // Idle handles that can be moved for a window, largest first, into candidates_.
  void collect_idle(const Window& w, std::size_t rounded, std::size_t want) noexcept;
  // Whether free block b may hold (part of) a request of `rounded` bytes (max_split_size).
  bool usable_for(const Block* b, std::size_t rounded) const noexcept {
    return rounded >= options_.max_split_size || b->size < options_.max_split_size;
  }
  // The handle's extent, inside a free block, becomes unbacked (after it was unmapped).
  bool carve(Handle* h) noexcept;
  // Blocks and handles to undo a partly mapped window.
  void unmap_all(Handle* const* hs, std::size_t n) noexcept;
  bool idle(const Handle* h) const noexcept;
  void note_segment(DevPtr ptr, std::size_t size, bool mapped) const noexcept {
    if (observer_ != nullptr && size != 0) observer_->on_segment(device_, ptr, size, mapped);
  }

  Options options_;
  int device_;
  PoolObserver* observer_;
  AddressSpace space_;
  Backing backing_;
  FreeSet free_;
  std::vector<Handle*> candidates_;  // scratch, capacity kept
  std::vector<Handle*> chosen_;      // scratch, capacity kept
  std::size_t handles_released_ = 0;
  std::size_t share_exempt_ = SIZE_MAX;       // live blocks this large are left out of handle_share
  std::size_t exempt_live_ = 0;               // bytes in allocated blocks of share_exempt_ and more
  std::size_t device_handle_cap_ = SIZE_MAX;  // 1/1024 of the device (init)
  std::size_t coarse_cap_ = SIZE_MAX;         // 1/64 of the device (init)
  std::size_t fine_cap_ = SIZE_MAX;           // no ordinary handle is larger (init)
  std::size_t coarse_created_ = 0;            // coarse handles ever created: split_for_cut's guard
  bool memory_first_ = false;     // in the memory-first phase (it ends once, never restarts)
  bool consolidate_off_ = false;  // grow() planning a miss again after a refused create
  bool ranges_in_use_ = false;
};

}  // namespace gpustitch::detail
