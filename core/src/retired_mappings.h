// Retired mappings: places a moved handle no longer backs, still mapped in the driver until the
// reclaimer thread unmaps them.
//
// Why. Moving an idle handle (large_heap.cpp) is an unmap where it lay free, a map where memory is
// needed and a share of one cuMemSetAccess, all on the thread that allocates: in PyTorch that is
// the thread that launches the kernels, so on the GPU the pool's driver calls inside training steps
// were 3-5% of the steps (docs/performance-history.md, "Where the speed goes"). Of a move's ~50 us
// on an H200, the unmap is ~18 us (more while kernels run), and nothing the caller gets depends on
// it: the driver lets a handle be mapped at two places at once, and the old place is address space
// the pool books as unbacked. So the allocating thread maps the handle at its new place and leaves
// the old mapping here; the reclaimer thread (reclaimer.cpp), already awake whenever frees come,
// unmaps it shortly after, outside the device lock.
//
// What must hold, and who makes it hold:
//   - nothing is mapped over a retired place until its unmap is done: Backing::map settles every
//     retired mapping its range overlaps first, unmapping it itself, or waiting for the reclaimer's
//     unmap in flight (a driver call's time, so the wait is bounded by the call);
//   - a handle leaves the pool's books (release to the driver, lent to the program) only when no
//     retired mapping of it is left: Backing settles the handle's entries first, so that a release
//     frees the memory at once and bytes_reserved never under-counts;
//   - the memory at a retired place is no block's, so no kernel the pool serves touches it; it was
//     fenced (idle in a free block) before it moved, as every moved handle is.
//
// The table has a fixed capacity: retiring allocates nothing (noexcept paths, README's host-memory
// gap), and a move that finds it full unmaps inline, as before. The device lock guards everything
// but the state of an entry the reclaimer has claimed: it unmaps without the lock and publishes
// the outcome through the entry's atomic state, so that a thread holding the lock can wait for it.
//
// Measured on the H200 (docs/address-space.md, "The allocating thread's driver time"): it halved
// the allocating thread's driver time on HF Llama training (median 43 against 86 ms in the timed
// steps) but not on the GPT workload, and tokens/s and peak reserved moved by less than the runs'
// spread; so it is a setting (unmap:background), not the default.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>

#include "gpustitch/types.h"

namespace gpustitch::detail {

class RetiredMappings {
 public:
  // Moves between two driver calls of a reclaimer pass are ~60 per training step on the GPU
  // workloads, and a pass runs every 0.5-1 ms while frees come: 256 is far more than ever waits.
  static constexpr std::size_t kCapacity = 256;

  // An entry the reclaimer took to unmap without the lock: which, and what to unmap.
  struct Claim {
    std::uint16_t index = 0;
    DevPtr at = 0;
    std::size_t size = 0;
  };

  RetiredMappings() noexcept = default;
  RetiredMappings(const RetiredMappings&) = delete;
  RetiredMappings& operator=(const RetiredMappings&) = delete;

  // --- device lock held ---
  // Records that `handle` is still mapped at [at, at+size); false if the table is full.
  bool add(DevPtr at, std::size_t size, PhysHandle handle) noexcept;
  // Entries not yet unmapped (waiting, claimed or failed).
  std::size_t live() const noexcept { return live_; }
  std::size_t waiting() const noexcept;  // not yet claimed
  // Settles every entry that `match(at, size, handle)` selects: waits for a claimed one's unmap,
  // and unmaps a waiting (or failed) one with `unmap(at, size)`. Returns the first failure; the
  // entries whose unmap failed stay.
  template <class Match, class Unmap>
  Status settle(Match&& match, Unmap&& unmap) noexcept;
  // Takes up to out.size() waiting entries for the reclaimer; returns how many.
  std::size_t claim(std::span<Claim> out) noexcept;
  // Calls fn(at, size, handle) for every entry not yet unmapped (validate).
  template <class Fn>
  void for_each(Fn&& fn) const noexcept;
  // In a fork child: the parent's reclaimer thread is not there to finish its claims.
  void forget_claims() noexcept;

  // --- no lock: the reclaimer, after unmapping a claimed entry ---
  void finish(const Claim& claim, Status unmapped) noexcept;

 private:
  enum State : std::uint8_t { kEmpty, kWaiting, kClaimed, kUnmapped, kFailed };
  struct Entry {
    DevPtr at = 0;
    std::size_t size = 0;
    PhysHandle handle = 0;
    std::atomic<std::uint8_t> state{kEmpty};
  };
  // Frees entries whose unmap the reclaimer finished (lock held).
  void collect(Entry& e) noexcept;
  void wait_for(Entry& e) const noexcept;

  std::array<Entry, kCapacity> entries_;
  std::size_t live_ = 0;  // entries not kEmpty
};

template <class Match, class Unmap>
Status RetiredMappings::settle(Match&& match, Unmap&& unmap) noexcept {
  if (live_ == 0) return Status::ok;
  Status result = Status::ok;
  for (Entry& e : entries_) {
    std::uint8_t s = e.state.load(std::memory_order_acquire);
    if (s == kEmpty || !match(e.at, e.size, e.handle)) continue;
    if (s == kClaimed) {
      wait_for(e);
      s = e.state.load(std::memory_order_acquire);
    }
    if (s == kWaiting || s == kFailed) {
      const Status u = unmap(e.at, e.size);
      if (u != Status::ok) {
        e.state.store(kFailed, std::memory_order_relaxed);
        if (result == Status::ok) result = u;
        continue;
      }
      e.state.store(kUnmapped, std::memory_order_relaxed);
    }
    collect(e);
  }
  return result;
}

template <class Fn>
void RetiredMappings::for_each(Fn&& fn) const noexcept {
  if (live_ == 0) return;
  for (const Entry& e : entries_) {
    const std::uint8_t s = e.state.load(std::memory_order_acquire);
    if (s != kEmpty && s != kUnmapped) fn(e.at, e.size, e.handle);
  }
}

}  // namespace gpustitch::detail
