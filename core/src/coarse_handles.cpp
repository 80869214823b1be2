// Large fresh handles: how a fresh range of fresh_coarse_mb or more is backed, and how its large
// handles are cut down later. Part of LargeHeap (large_heap.h; its placement and backing policy
// are at the top of large_heap.cpp).
//
// A fresh gap of fresh_coarse_mb (256 MiB) or more is the exception (plan_fresh; for a
// stream-ordered request only from stream_fresh_coarse_mb, 2 GiB: see the end): at most 4
// handles of fresh_coarse_mb or more (none above 1/64 of the device), plus one granule at an
// end the block only partly covers, where it would otherwise pin a large handle's free rest.
// A fresh 256 MiB block is then one create, one map and one cuMemSetAccess, 2 GiB four,
// instead of 26 and 205: on the H200 (alloc_latency --quick, four runs) 0.09-0.14 ms
// against 1.2-2.1 ms with ordinary handles and 0.12-0.19 ms for cudaMalloc (0.7-0.8x), 2 GiB
// 0.26-0.42 ms against 8.0-12.0 ms and 0.16-0.28 ms (1.5-2.0x). Large handles pin what live
// blocks leave free in them, so they are cut down where that matters and not before (an
// earlier form replaced every large handle by ordinary ones at the fence of its block's first
// free: 3.5-12.8 ms per free on the H200, under the device lock, and HF training 2-12% slower):
//   - a block cut out of fenced free memory with its end inside a large handle (split_for_cut,
//     from DevicePool's best fit and from grow()'s window) splits that handle in three
//     (split_at): before the granule the cut lies in, that granule, after it. The live block
//     pins at most a granule of free memory and the rest stays one idle handle, for one
//     release, three creates and maps and one cuMemSetAccess whatever the handle's size:
//     0.28 ms at 256 MiB and 0.48 ms at 2 GiB on the H200 (replacing it by ordinary handles
//     instead took 1.2-3.6 ms and held replay within 0.4% of the split). The release comes
//     first, so that this never needs more device memory than the pool holds. A block freed
//     and taken again at its own size costs no driver call; memory waiting for its fence (a
//     stream reusing its own block) is never split: the GPU may still use it;
//   - a miss whose idle candidates include a large handle too large for what is missing: it
//     goes back to the driver before fresh memory is taken, so the pool shrinks rather than
//     holding it beside the new memory;
//   - a release (trim, release threshold, cooperative release) well below a large handle:
//     it is replaced by ordinary ones first (refine), so that what leaves the cache is close
//     to what was asked.
// In replay (--whole-handles, 140 GiB) every recorded trace stays within 0.4% of ordinary
// handles (gpt_seqlen_b5 1.011 -> 1.013, hf_llama_train 1.016 -> 1.012; in stream order
// 1.014 -> 1.016 and 1.016 -> 1.015), driver time 114 -> 133 ms and 86 -> 82 (stream order
// 113 -> 93 and 86 -> 47). With ordinary handles at both ends instead of one granule, 128
// MiB held gpt_seqlen_b5 at 1.022 in stream order and 64 MiB bucketed sizes at 1.12. On the
// H200 the pool's driver time fell from 867 to 164-174 ms on GPT training under the balloon
// and from 116-120 to 99-118 ms on HF training, at the same peak reserved; tokens/s medians
// over seven paired rounds were 4-6% below ordinary handles, inside single runs' spread
// (docs/performance-history.md, "A fresh block now costs about what `cudaMalloc` does").
//
// A stream's fresh gap below stream_fresh_coarse_mb comes in ordinary handles. The stream reuses
// what it freed before the device has run past the free (stream order makes that safe), and a
// large handle under such a cut can be split only once the device is done with it: the cut either
// waits (stream_cut_fence, stream_cut_wait; on an H100 61-220 ms of waits per timed run and twice
// the allocating thread's driver time in splits) or pins the handle's free rest. Ordinary handles
// make neither necessary, for a fresh 256 MiB-2 GiB block at 6-64x cudaMalloc instead of 0.7-2.0x;
// from 2 GiB up (a KV cache, a balloon) the handle count would cost more than the waits
// (docs/address-space.md, "A stream's fresh range in ordinary handles below 2 GiB").
#include <algorithm>

#include "large_heap.h"

namespace gpustitch::detail {

LargeHeap::FreshPlan LargeHeap::plan_fresh(std::size_t fresh, std::size_t handle, bool head,
                                           bool tail, std::size_t coarse_min) const noexcept {
  FreshPlan plan{fresh, 0, handle, 0};
  const std::size_t g = options_.granularity;
  if (coarse_min == 0 || fresh < coarse_min) return plan;
  // One granule where the block leaves part of it free: the live block pins no more than an
  // ordinary handle would there (the smallest one), and the large handles lie wholly inside it.
  plan.head = head ? g : 0;
  plan.tail = tail ? g : 0;
  if (plan.head + plan.tail >= fresh) return FreshPlan{fresh, 0, handle, 0};
  const std::size_t inner = fresh - plan.head - plan.tail;
  // Handles of coarse_min or more, at most coarse_handles of them: a 256 MiB block is one handle
  // and a 2 GiB one four. A cut inside one later splits it in three (split_for_cut).
  const std::size_t per = std::clamp<std::size_t>(
      inner / coarse_min, 1, std::max<std::size_t>(options_.coarse_handles, 1));
  plan.inner = std::max(g, std::min(align_up((inner + per - 1) / per, g), coarse_cap_));
  return plan;
}

bool LargeHeap::split_for_cut(DevPtr boundary, std::size_t free_size) noexcept {
  // An idle large handle lies wholly inside the free block that holds the boundary: a free block
  // no larger than an ordinary handle holds none, and the lookup below is skipped.
  if (coarse_created_ == 0 || free_size <= fine_cap_) return false;
  Handle* h = backing_.handle_at(boundary);
  if (h == nullptr || h->at == boundary || h->size <= fine_cap_ || !idle(h)) return false;
  return split_at(h, boundary);
}

bool LargeHeap::pending_cut_pins(const Block* b, DevPtr boundary) const noexcept {
  if (coarse_created_ == 0 || b->size <= fine_cap_) return false;
  const Handle* h = backing_.handle_at(boundary);
  return h != nullptr && h->at != boundary && h->size > fine_cap_ && h->at >= b->ptr &&
         h->end() <= b->end();
}

bool LargeHeap::refine(Handle* h) noexcept {
  const std::size_t fine = std::min(fine_handle(h->size), fine_cap_);
  return rebuild(
      h, [fine](std::size_t done, std::size_t size) { return std::min(fine, size - done); });
}

bool LargeHeap::split_at(Handle* h, DevPtr boundary) noexcept {
  // Three handles: before the granule the cut lies in, that granule, and after it.
  const std::size_t g = options_.granularity;
  const std::size_t lo = align_down(boundary, g) - h->at;
  return rebuild(h, [lo, g](std::size_t done, std::size_t size) {
    if (done < lo) return lo - done;
    if (done == lo) return std::min(g, size - done);
    return size - done;
  });
}

template <class NextPart>
bool LargeHeap::rebuild(Handle* h, NextPart next_part) noexcept {
  std::size_t count = 0;
  for (std::size_t done = 0; done < h->size; ++count) done += next_part(done, h->size);
  if (!space_.reserve_nodes(4 + 2 * count)) return false;
  try {
    chosen_.reserve(count);
  } catch (...) {
    return false;
  }
  const DevPtr at = h->at;
  const std::size_t size = h->size;
  // Released before the new handles are created, so that this never needs more device memory
  // than the pool holds; what the driver will not give back again becomes unbacked.
  if (backing_.unmap(h) != Status::ok) return false;
  backing_.release(h);
  chosen_.clear();
  std::size_t done = 0;
  while (done < size) {
    Handle* n = nullptr;
    const std::size_t part = next_part(done, size);
    if (backing_.create(part, &n) != Status::ok) break;
    if (backing_.map(n, at + done) != Status::ok) {
      backing_.release(n);
      break;
    }
    chosen_.push_back(n);  // within the capacity reserved above
    done += part;
    if (part > fine_cap_) ++coarse_created_;
  }
  Handle rest;
  if (done != 0 && backing_.set_access(at, done) != Status::ok) {
    rest.at = at;  // nothing of it is usable: all of it becomes unbacked
    rest.size = size;
    carve(&rest);
    note_segment(at, size, false);
    unmap_all(chosen_.data(), chosen_.size());
    for (Handle* n : chosen_) {
      if (n->at == 0) backing_.release(n);
    }
  } else if (done < size) {
    rest.at = at + done;
    rest.size = size - done;
    carve(&rest);
    note_segment(rest.at, rest.size, false);
  }
  chosen_.clear();
  return true;
}

}  // namespace gpustitch::detail
