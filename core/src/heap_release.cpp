// Physical memory going back to the driver: spare handles first, then handles lying wholly
// inside free blocks, only on trim (empty cache, release threshold, out-of-memory retry,
// cooperative release); and how much idle memory moving could reuse now. Part of LargeHeap
// (large_heap.h).
#include <algorithm>

#include "large_heap.h"

namespace gpustitch::detail {

std::size_t LargeHeap::idle_bytes() const noexcept {
  std::size_t total = backing_.spare_bytes();
  for (const Handle& h : backing_.mapped()) {
    if (idle(&h)) total += h.size;
  }
  return total;
}

std::size_t LargeHeap::idle_bound() const noexcept {
  const std::size_t g = options_.granularity;
  std::size_t total = backing_.spare_bytes();
  for (const Block& b : free_) {
    const DevPtr lo = align_up(b.ptr, g), hi = align_down(b.end(), g);
    if (hi > lo) total += hi - lo;
  }
  return total;
}

std::size_t LargeHeap::release_one(std::size_t wanted) noexcept {
  // Spares first: they cost a release only.
  if (!backing_.spares().empty()) {
    auto& spares = backing_.spares();
    Handle probe;
    probe.size = wanted;
    auto it = spares.lower_bound(probe);
    Handle* h = const_cast<Handle*>(it != spares.end() ? &*it : &*spares.rbegin());
    const std::size_t size = h->size;
    const std::size_t before = backing_.held_bytes();
    backing_.release(h);
    ++handles_released_;
    return before - backing_.held_bytes() == 0 ? 0 : size;
  }
  Handle* best = nullptr;
  for (const Handle& ch : backing_.mapped()) {
    if (!idle(&ch)) continue;
    auto* h = const_cast<Handle*>(&ch);
    if (best == nullptr) {
      best = h;
    } else if (h->size >= wanted) {
      if (best->size < wanted || h->size < best->size) best = h;
    } else if (best->size < wanted && h->size > best->size) {
      best = h;
    }
  }
  if (best == nullptr) return 0;
  // A coarse handle well above what is wanted is refined first, so that what leaves the cache is
  // close to what was asked (a release threshold, a cooperative release of a few MiB).
  if (best->size > fine_cap_ && best->size >= wanted + fine_cap_ && refine(best)) {
    return release_one(wanted);  // the handles in its place are ordinary ones now
  }
  return release_mapped(best);
}

std::size_t LargeHeap::release_mapped(Handle* h) noexcept {
  if (!space_.reserve_nodes(4)) return 0;
  Handle probe;
  probe.at = h->at;
  probe.size = h->size;
  if (backing_.unmap(h) != Status::ok) return 0;
  carve(&probe);
  note_segment(probe.at, probe.size, false);
  const std::size_t before = backing_.held_bytes();
  backing_.release(h);
  ++handles_released_;
  return before - backing_.held_bytes();
}

std::size_t LargeHeap::release(std::size_t wanted) noexcept {
  // Moved handles' old places go too (retired_mappings.h): a trim leaves the driver nothing of
  // the pool's but what backs its blocks.
  backing_.settle_retired();
  std::size_t released = 0;
  while (released < wanted) {
    const std::size_t got = release_one(wanted - released);
    if (got == 0) break;
    released += got;
  }
  return released;
}

}  // namespace gpustitch::detail
