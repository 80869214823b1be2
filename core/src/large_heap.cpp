// LargeHeap: placement and backing of large blocks.
//
// The problem it solves. With cudaMalloc semantics a pool that gives every fresh allocation an
// address range of its own (gpustitch before this design, PyTorch's default) cannot merge blocks
// freed next to each other across ranges, and a pool that takes fresh memory whenever the device
// has some grows to the device's size under sizes that change every step. Both made reserved
// memory 1.28-1.63x the live bytes on the seeds' workloads, against 1.04x for expandable segments.
//
// The design:
//   - one address space per device (address_space.h): every block lives there, cut at 512 B, and
//     free neighbours merge across whatever allocations they came from;
//   - physical memory is a set of handles (backing.h), each mapped whole at one place; the
//     address space between them is "unbacked" blocks;
//   - a request is served, in order, (1) best fit among free blocks (DevicePool), no driver call;
//     (2) otherwise at the place that needs the least new physical memory (place()): typically a
//     free block whose unbacked neighbour makes up the difference, as expandable segments grow
//     the end of their range, or a hole that an earlier move left unbacked. The missing part
//     (the "gap", granule-aligned) is backed by, in order: spare handles; idle handles moved
//     from free blocks elsewhere (unmapped there, mapped here: the physically scattered free
//     memory stitched into one contiguous range); and only for what is still missing, fresh
//     handles. Reserved memory therefore grows only when the idle memory the pool holds cannot
//     make up the request, not whenever the device has free memory;
//   - cuMemSetAccess runs once per backed gap, not per handle;
//   - fresh memory for one gap comes in handles of max(min_handle, gap / max_fresh_handles),
//     none larger than max_handle (10 MiB by default, half expandable segments' page) or 1/1024
//     of the device; max_fresh_handles is 1 by default, so fresh gaps come in 10 MiB handles. The
//     trade-off: on an H200 a handle costs ~12 us to create, ~1-2 us to map and ~27-32 us of
//     cuMemSetAccess whatever its size (one call over a range costs what one call per handle
//     does; ../docs/address-space.md), and more while kernels run; handle count was the speed
//     cost on the GPU (64 handles per gap ran GPT training 2-20% slower than expandable
//     segments, 20 MiB handles as fast). But a live block pins the free rest of every handle it
//     touches (the driver maps handles whole), so large handles leave free memory that can
//     neither move nor serve a larger request: in replay 4 handles per gap held 1.018-1.083x of
//     demand on the recorded traces, 20 MiB handles 1.022-1.116x; without the 20 MiB cap
//     (2 GiB gaps got 32 MiB handles) hf_llama_train needed a 13.19 GiB device (12.62 with it;
//     expandable segments 12.69), and 20 MiB handles on a 1.90 GiB device failed a request that
//     fit (hence the 1/1024 cap). 10 MiB rather than 20: on the H200 (three and two interleaved
//     rounds) GPT training held 19.60-19.65 GB against 19.88-20.10 with 20 MiB (expandable
//     segments 19.92) and HF Llama 13.45-13.49 against 13.51-13.54, at tokens/s within the
//     runs' spread of both; in replay gpt_seqlen_b5 1.025x -> 1.011x of demand and its smallest
//     device 18.44 -> 18.25 GiB (expandable segments 18.38), for 1.7x the driver time (67 -> 114
//     ms, paid while the pool grows). 4-6 MiB held 1.007-1.010x for 2.6-3.8x;
//   - and none larger than 1/handle_share (128) of what the heap will hold, with at most 16 per
//     gap: a program holding 700 MiB gets handles of 2-6 MiB, one holding 1.25 GiB or more gets
//     10 MiB ones. What live blocks pin is then a small share of the heap at every size, and the
//     driver calls a large program makes barely change (the handles it creates while small are
//     few). In replay this took the small traces (0.7-1.9 GiB) from 1.044-1.116x of demand to
//     1.013-1.052x, the training traces stayed at 1.021x, for 15-25% more driver time
//     (gpt_seqlen_b5: 1,296 handles created against 1,067). Live blocks of 128 x the
//     largest handle (1.25 GiB by default) and more are left out of what the heap holds: alone
//     they would make every later handle as large as handles get, yet they pin nothing while
//     live and their own handles move once they are freed. A 115 GiB block allocated first (the
//     end-to-end benchmark's balloon; vLLM's KV cache, a flat parameter buffer) otherwise gave
//     every later block of gpt_seqlen_b5 10 MiB handles: 1.017x of demand in replay against
//     1.011x without it; left out, 1.011x (1.014x in stream order, as without it). Any threshold
//     from 1 to 16 GiB gave the same figures on every recorded trace;
//   - a fresh gap of fresh_coarse_mb (256 MiB) or more is the exception: at most 4 large handles,
//     split where a later cut needs it; a stream-ordered request's only from
//     stream_fresh_coarse_mb (2 GiB), since its stream's cuts of its own freed memory would wait
//     for the device to split them (coarse_handles.cpp: the design, its costs, the forms
//     measured);
//   - moving a handle costs a cuMemUnmap (~18 us idle, ~45 us while kernels run), a cuMemMap and
//     its share of one cuMemSetAccess (~170 us per gap on the GPU workloads), and no
//     create/release: reserved stays the same. Expandable segments instead release and re-create
//     pages, and only at out-of-memory. The unmap can be left to the reclaimer thread
//     (unmap:background, retired_mappings.h; measured in docs/address-space.md, "The allocating
//     thread's driver time": it halved that thread's driver time on HF, not on GPT);
//   - physical memory goes back to the driver only on trim (empty cache, release threshold,
//     out-of-memory retry, cooperative release): spares first, then handles lying wholly inside
//     free blocks (heap_release.cpp).
// What it does not do: memory inside a handle that a live block still touches cannot move (the
// driver maps handles whole); such free memory is reused in place by best fit. Where the driver
// maps at an offset, partial handles could move too; this design does not depend on it.
//
// Size ranges (size_ranges, off by default). What is left above demand at a small program's peak
// is mostly free memory in granules that live blocks share: at hf_llama_generate's, 31 of 41 MiB,
// between a KV cache's 1-8 MiB blocks and the large ones around them (no handle size can move
// it). With size_ranges:on, requests below 1 MiB, below 4 MiB and larger are placed in spans of
// their own (Block::size_range; the free set is ordered by range first, so best fit and place()
// look at the request's own range only), and small blocks pack among themselves; handles still move
// between ranges. It pays only with handles of one granule where the heap is small
// (handle_share:1024, and no bound per gap, gap_handles:0): with the default handles a small
// range's request finds no idle handle small enough and takes fresh memory. In replay
// (--whole-handles, 140 GiB; cudaFree order / stream order) that "memory-first" layout held
// gpt_seqlen_b5 at 1.011 / 1.014 of demand (default 1.013 / 1.016), hf_llama_train 1.006 / 1.004
// (1.012 / 1.015), hf_llama_generate 1.023 / 1.026 (1.052 / 1.055), transformer_bucketed 1.009
// / 1.009 (1.021 / 1.049), the dynseq traces 1.007 and 1.012 (1.012, 1.016), for 2-5x the driver
// time (gpt_seqlen_b5 272 / 244 ms against 133 / 93; hf_llama_train 290 / 251 against 82 / 47;
// the small traces 25-62 ms against 12-23). The handles alone (no ranges) held hf_llama_generate
// at 1.052 and transformer_bucketed at 1.018; the ranges alone 1.052 and 1.043. Limits tried
// with the same handles: {1, 4} MiB the best; {0.5, 4} 1.023 / 1.031 on generate (before the
// smaller small-slot caches of small_pool.cpp; {1, 4} 1.026 / 1.031 then) but 1.018 on
// bucketed; {1, 8}, {2, 8} and {1, 2} 1.034-1.064 on generate. An idealised model (2 MiB
// granules, free moves) had predicted 1.041 -> 1.020 on generate.
// On the GPU (an H100, 2026-12-06, two interleaved rounds, docs/address-space.md) it held what
// replay said: HF Llama training 1.019-1.020x of PyTorch's allocated bytes (the earlier layout
// 1.032-1.033x), GPT 1.017-1.024x (1.023-1.026x); but HF ran at 0.87-0.90x of PyTorch default's
// tokens/s (the earlier layout 0.98x) and GPT at 0.96x (0.98-1.00x). The allocating thread's
// driver time in the timed steps was the cause: HF 168-228 ms of 1.6-1.8 s against 40 ms, most
// of it cuMemSetAccess (94 ms for 3,321 handles mapped, ~28 us each whatever their size) and the
// unmaps the retired-mapping table (256 entries) had no room for. Where that time comes from, in
// replay (hf_llama_train in stream order): the ranges make the moves (unmaps 651 without them,
// 2,831 with, one-granule handles either way), the one-granule handles the creates (886 with the
// earlier handles, 2,531). On GPT most of the extra driver time is paid while the heap first
// grows (gpt_seqlen_b5's first of 8 steps 185 against 80 ms, steps 2-8 86 against 52), on HF
// most in the later steps (hf_llama_train 124 against 41, then 166 against 41). handle_share:512
// takes a fifth of it back but holds the training traces at 1.021 in stream order; the earlier
// handles in the largest requests' range alone (1/128 or 1/256, 16 per gap) gave
// bucketed 1.040-1.043; small idle handles released and created again at the heap's handle size
// instead of moved cut the maps by a fifth and the driver time by 3%. So the layout is a setting
// for programs whose limit is memory, not the default.
//
// The memory-first phase (memory_first_mb, 8 GiB by default; see the end of this paragraph for
// why not 4). The layout's gain is largest where
// the heap is small (a granule a small block shares is a larger share of it) and its cost grows
// with the heap (moves per step). So the heap uses it until it first holds memory_first_mb
// outside very large live blocks, then the layout the settings give (the earlier one by default)
// for every later placement: requests go to the largest requests' range, but one the phase would
// have placed in a smaller range looks for free memory there first (fit()), so what the phase
// left between small blocks is reused, not stranded (hf_llama_train in stream order 1.020 ->
// 1.019; only the moves took it before). In replay (--whole-handles, 140 GiB; cudaFree / stream
// order) the defaults then hold gpt_seqlen_b5 at 1.009 / 1.014 of demand (without the phase 1.013
// / 1.016), hf_llama_train 1.007 / 1.019 (1.012 / 1.015), hf_llama_generate 1.023 / 1.026 (1.052
// / 1.055), transformer_bucketed 1.009 / 1.009 (1.021 / 1.049), the dynseq traces 1.007 and 1.012
// (1.012, 1.016): the 1.03x target on every row. The driver time is paid mostly while the heap
// first grows: hf_llama_train 159 ms against 82, but 20 against 16 in the trace's second half;
// gpt_seqlen_b5 in stream order 175 against 93, 13 against 11 in the second half. After the
// phase, a miss gives the phase's small idle handles back and takes handles of its own size
// rather than moving them (grow(): consolidate), which took those second halves from 22 and 15 ms
// to 20 and 13, peak reserved the same on every trace. Bounds tried: hf_llama_train in stream
// order is the one trace they move, and not smoothly: 2 GiB 1.025 (1.038 before fit() looked in
// the small ranges), 3 GiB 1.036, 4 GiB 1.019, 5 GiB 1.017, 5.5-6 GiB 1.014, 6.5-8 GiB 1.023,
// for more driver time the higher the bound. Where the phase ends decides which blocks lie in
// the small ranges' spans and how the later ones pack around them, so that trace's peak is a
// chaotic function of the bound (and on the GPU of the reclaimer's timing: two HF runs of nine
// at 1.044x); 4 GiB was the round figure that no trace punished in that replay. A bound on
// handles per gap in the phase (32: bucketed 1.031;
// 64 or more: no change). On the GPU (an H100, 2026-12-06; docs/performance-history.md, "The
// memory-first phase"): GPT 1.018-1.023x of PyTorch's allocated bytes in four rounds (without the
// phase 1.021-1.025), HF Llama training 1.026-1.031x in seven runs of nine and 1.044-1.045x in two
// (without it 1.031-1.051x), a small generate() run 732 MB against 740; tokens/s not separable from
// the runs' noise that day. HF's recorded traces replay to 1.019x with the phase and 1.015x
// without: on the largest programs the phase is about level, not better.
// Those figures came from a replay that made every call from one thread. PyTorch's training
// traces come from two (the Python thread and autograd's device thread), and the pool gives each
// thread an arena of its own (small pool and chunks); replay now makes each trace thread's calls
// on a thread of its own (tools/replay/trace_threads.h), and with it hf_llama_train in stream order
// held 1.037x at the 4 GiB bound: what the GPU showed in its worst runs (six traced HF runs, all
// the same event sequence: 1.019-1.040x with the reclaimer thread, 1.034x in three runs with
// reclaim:inline, which replay models). With two threads, bounds of 0 (no phase), 2, 4, 6 and 8
// GiB held that trace at 1.020, 1.021, 1.037, 1.018 and 1.017, and 8 GiB was the lowest or level
// against 0, 4 and 6 GiB on every other trace and order (max 1.026x; gpt_seqlen_b5 in stream
// order 1.012 against 1.016 at 4 GiB)
// for 5-14% more driver time; on the H100, three interleaved rounds of HF: 1.015-1.025x against
// 1.018-1.034x at 4 GiB and 1.020-1.023x without the phase. Hence 8 GiB; where the phase ends
// still moves the peak chaotically, so this is the best of the bounds tried, not an optimum.
//
// Alternatives measured (docs/address-space.md): the previous per-allocation views with stitching
// by aliasing; fixed 20 MiB pages as expandable segments use (every fresh 1 GiB then costs 52
// handles, ~2 ms on an H200); and different max_handle values in replay and on the GPU.
#include "large_heap.h"

#include <algorithm>
#include <cstdio>

namespace gpustitch::detail {

namespace {
// Free blocks examined for idle handles per miss. 64 was too few: a 2 GiB request among
// scattered 32 MiB holes, each holding at most one idle 20 MiB handle, could not gather its
// handles and the pool gave its cache back instead (SeedsScenario in tests/core/pool_test.cpp);
// alloc_latency's 2 GiB among 1,024 holes of 2 MiB is past this bound (the pool trims and creates
// it afresh: 155 ms on the H200). A bound of 4,096 would gather them, but in replay it moved
// handles from more places and left hf_llama_train's layout more scattered (1.094x of demand
// against 1.082x at 140 GiB; its smallest device 13.06 GiB against 12.94), so the bound stays at
// 1,024.
constexpr std::size_t kMaxScanBlocks = 1024;
constexpr std::size_t kMaxCandidates = 1024;  // idle handles considered per miss
}  // namespace

LargeHeap::LargeHeap(Backend& backend, int device, const Options& options,
                     PoolObserver* observer) noexcept
    : options_(options),
      device_(device),
      observer_(observer),
      space_(backend, device, options.granularity),
      backing_(backend, device),
      memory_first_(options.memory_first_below != 0),
      ranges_in_use_(options.ranges_always || memory_first_) {
  try {
    candidates_.reserve(kMaxCandidates);
    chosen_.reserve(256);
  } catch (...) {
  }
}

Status LargeHeap::init(std::size_t device_total) noexcept {
  // Handles of at most 1/1024 of the device: what a live block can pin in the handles it
  // touches stays a small part of the device, whatever its size. On an H200 (141 GB) that is
  // above the 10 MiB cap; on a 2 GiB device it is 2 MiB handles (in replay of
  // transformer_dynseq at 1.90 GiB, 20 MiB handles pinned enough to fail a request that fit).
  const std::size_t g = options_.granularity;
  device_handle_cap_ = std::max(g, device_total / 1024 / g * g);
  coarse_cap_ = std::max(g, device_total / 64 / g * g);
  // A live block of 128 x the largest handle (1.25 GiB) or more would, alone, make every later
  // handle as large as handles get, while it pins nothing of them: it is left out of the share.
  // The bound does not follow handle_share: it also says which blocks are too large to count in
  // how much of the pool waits for a fence (DevicePool::working_reserved), where the memory-first
  // layout's 1024 x 10 MiB would have counted an 8 GiB block (pool_test:
  // StreamOrderedMissWaitsForPendingMemoryInsteadOfGrowing failed with it). In replay any bound
  // from 1 to 16 GiB gave the same figures on every recorded trace, with either layout.
  constexpr std::size_t kVeryLargeShare = 128;
  const std::size_t largest = std::min(align_down(options_.max_handle, g), device_handle_cap_);
  fine_cap_ = std::max(align_up(options_.min_handle, g), largest);
  if (largest <= SIZE_MAX / kVeryLargeShare) {
    share_exempt_ = kVeryLargeShare * largest;
  }
  std::size_t size = options_.span_size;
  if (size == 0) size = std::max<std::size_t>(2 * device_total, 4 * GiB);
  // One span per size range, the largest requests' first; the smaller ranges' spans are 1/8 as
  // large (address space only: another span follows where one runs out). A smaller reservation
  // where the driver (or the host, for the simulated device) refuses this. Only the first one is
  // needed: a size range without address space places its requests in the largest's (grow()).
  const std::uint8_t top = range_of(SIZE_MAX);
  for (int r = top; r >= 0; --r) {
    std::size_t want = r == top ? size : std::max(size / 8, 4 * options_.granularity);
    for (; want >= 4 * options_.granularity; want /= 2) {
      if (space_.add_span(want, static_cast<std::uint8_t>(r)) == Status::ok) break;
    }
    if (r == top && want < 4 * options_.granularity) return Status::out_of_memory;
  }
  return Status::ok;
}

std::size_t LargeHeap::largest_free() const noexcept {
  // Called whenever the free set changes (DevicePool::note_free_changed): without size ranges the
  // set's last block, as before them.
  const std::uint8_t top = range_of(SIZE_MAX);
  if (top == 0) return free_.empty() ? 0 : free_.rbegin()->size;
  // The last block of each size range in the set is that range's largest.
  std::size_t largest = 0;
  Block probe;
  probe.size = 0;
  probe.ptr = 0;
  for (int r = top; r >= 0; --r) {
    probe.size_range = static_cast<std::uint8_t>(r + 1);
    auto it = free_.lower_bound(probe);  // the first block of the ranges above r
    if (it == free_.begin()) continue;
    --it;
    if (it->size_range == r) largest = std::max(largest, it->size);
  }
  return largest;
}

std::size_t LargeHeap::fine_handle(std::size_t fresh) const noexcept {
  const std::size_t g = options_.granularity;
  // Handles of at least min_handle, at most max_handle, and as few as max_fresh_handles allow.
  const std::size_t per_gap = std::max<std::size_t>(options_.max_fresh_handles, 1);
  const std::size_t smallest = std::max(align_up(options_.min_handle, g), g);
  std::size_t cap = std::min(align_down(options_.max_handle, g), device_handle_cap_);
  // A small heap's handles are small: none above 1/handle_share of what the heap will hold, so
  // that what live blocks pin stays a small share of it; but a gap takes at most
  // max_handles_per_gap of them (0: no bound), which bounds what one fresh block costs.
  const std::size_t handle_share = memory_first_ ? kMemoryFirstShare : options_.handle_share;
  const std::size_t per_gap_bound = memory_first_ ? 0 : options_.max_handles_per_gap;
  if (handle_share != 0) {
    const std::size_t share = (working_held() + fresh) / handle_share;
    const std::size_t gap_bound = per_gap_bound == 0 ? g : align_up(fresh / per_gap_bound, g);
    cap = std::min(cap, std::max({g, align_down(share, g), gap_bound}));
  }
  return std::max(smallest, std::min(align_up(fresh / per_gap, g), cap));
}

void LargeHeap::make_free(Block* b) noexcept {
  b->state = BlockState::free;
  b->stream = kAnyStream;
  if (Block* p = b->prev; p != nullptr && p->state == BlockState::free) {
    free_.erase(free_.iterator_to(*p));
    space_.absorb_next(p);
    b = p;
  }
  if (Block* n = b->next; n != nullptr && n->state == BlockState::free) {
    free_.erase(free_.iterator_to(*n));
    space_.absorb_next(b);
  }
  free_.insert(*b);
}

bool LargeHeap::place(std::size_t rounded, std::uint8_t range, Window* w) const noexcept {
  const std::size_t g = options_.granularity;
  std::size_t best_need = SIZE_MAX, best_region = SIZE_MAX;
  for (const Block& cu : space_.unbacked()) {
    if (cu.size_range != range) continue;  // another size range's address space
    auto* u = const_cast<Block*>(&cu);
    auto usable = [&](Block* b) {
      return b != nullptr && b->state == BlockState::free && usable_for(b, rounded);
    };
    Block* p = usable(u->prev) ? u->prev : nullptr;
    Block* n = usable(u->next) ? u->next : nullptr;
    const DevPtr lo = p != nullptr ? p->ptr : u->ptr;
    const DevPtr hi = n != nullptr ? n->end() : u->end();
    if (hi - lo < rounded) continue;
    for (DevPtr s : {lo, hi - rounded}) {
      const DevPtr e = s + rounded;
      const DevPtr glo = align_down(std::max(s, u->ptr), g);
      const DevPtr ghi = std::min(align_up(std::min(e, u->end()), g), u->end());
      // Zero: the window lies in a free block, which best fit declined (max_split_size).
      if (ghi <= glo) continue;
      const std::size_t need = ghi - glo;
      const std::size_t region = hi - lo;
      if (need < best_need || (need == best_need && region < best_region)) {
        best_need = need;
        best_region = region;
        *w = Window{s, glo, ghi, u, p, n};
      }
    }
  }
  return best_need != SIZE_MAX;
}

bool LargeHeap::idle(const Handle* h) const noexcept {
  const Block* b = space_.block_at(h->at);
  return b != nullptr && b->state == BlockState::free && h->end() <= b->end();
}

void LargeHeap::collect_idle(const Window& w, std::size_t rounded, std::size_t want) noexcept {
  candidates_.clear();
  std::size_t found = 0, scanned = 0;
  // Takes b's idle handles; true when there are enough, or the scan's bound is reached.
  auto visit = [&](const Block* b) {
    if (++scanned > kMaxScanBlocks) return true;
    if (b == w.prev || b == w.next || b->size < options_.granularity || !usable_for(b, rounded)) {
      return false;
    }
    for (Handle* h = backing_.first_from(b->ptr); h != nullptr && h->end() <= b->end();
         h = backing_.next(h)) {
      if (candidates_.size() == candidates_.capacity()) break;
      candidates_.push_back(h);  // within the capacity reserved at construction
      found += h->size;
    }
    return found >= 2 * want || candidates_.size() == candidates_.capacity();
  };
  // Largest free blocks first; with size ranges, the request's own range's before the others'
  // (the free set is ordered by range first), so that a miss does not strip another range of
  // the memory its next request would take back: hf_llama_generate in replay 1.026 -> 1.023 with
  // the memory-first layout, the other traces the same or better.
  Block probe;
  probe.size = 0;
  probe.ptr = 0;
  probe.size_range = range_of(rounded);
  const auto own_lo = free_.lower_bound(probe);
  ++probe.size_range;
  const auto own_hi = free_.lower_bound(probe);
  auto scan = [&](FreeSet::const_iterator lo, FreeSet::const_iterator hi) {
    while (hi != lo) {
      if (visit(&*--hi)) return true;
    }
    return false;
  };
  if (!scan(own_lo, own_hi) && !scan(own_hi, free_.cend())) scan(free_.cbegin(), own_lo);
  std::sort(candidates_.begin(), candidates_.end(),
            [](const Handle* a, const Handle* b) { return a->size > b->size; });
}

bool LargeHeap::carve(Handle* h) noexcept {
  Block* b = space_.block_at(h->at);
  free_.erase(free_.iterator_to(*b));
  if (b->ptr < h->at) {
    Block* rest = space_.split(b, h->at - b->ptr);
    free_.insert(*b);
    b = rest;
  }
  if (b->size > h->size) free_.insert(*space_.split(b, h->size));
  space_.set_unbacked(b);
  space_.merge_unbacked(b);
  return true;
}

void LargeHeap::unmap_all(Handle* const* hs, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    if (backing_.unmap(hs[i]) == Status::ok) continue;
    // The driver keeps it mapped: its place becomes free memory rather than a mapping the block
    // list does not know of.
    Block* u = space_.block_at(hs[i]->at);
    if (u->ptr < hs[i]->at) u = space_.split(u, hs[i]->at - u->ptr);
    if (u->size > hs[i]->size) space_.split(u, hs[i]->size);
    space_.clear_unbacked(u);
    make_free(u);
    note_segment(hs[i]->at, hs[i]->size, true);
  }
}

Status LargeHeap::grow(std::size_t rounded, std::size_t fresh_allowance, Block** out,
                       Growth* growth, bool allow_move, bool stream_ordered) noexcept {
  const std::size_t g = options_.granularity;
  const bool move = options_.move && allow_move;
  if (memory_first_ && working_held() >= options_.memory_first_below) {
    memory_first_ = false;
    ranges_in_use_ = options_.ranges_always;
  }
  // After the memory-first phase, idle handles of half an ordinary handle or less (the phase's
  // one-granule handles, mostly) are not moved: the gap gets fresh handles of its own size for
  // them, and once those exist, as many small ones go back to the driver. Each is replaced once,
  // and later moves map fewer handles. In replay, driver time in the second half of
  // hf_llama_train 22 -> 20 ms (the earlier layout 16), gpt_seqlen_b5 in stream order 15 -> 12
  // (11), peak reserved the same on every trace. The creates come first, so that a driver with
  // no memory for them costs nothing: the miss is planned again with the small handles moved
  // (SeedsScenario: a full device, where releasing first gave back memory the request then did
  // not get).
  bool consolidate =
      move && options_.memory_first_below != 0 && !memory_first_ && !consolidate_off_;
  Window w;
  const std::uint8_t top = range_of(SIZE_MAX);
  std::uint8_t range = range_of(rounded);  // where it goes: its size range's spans
  for (;;) {
    if (!place(rounded, range, &w)) {
      // No unbacked region can hold it: another span (a request larger than the first one, or an
      // address space cut up by long-lived blocks).
      const std::size_t span =
          std::max(space_.span(0).size / (range == top ? 1 : 8), align_up(rounded, g) + g);
      if (space_.add_span(span, range) != Status::ok || !place(rounded, range, &w)) {
        // No address space for a small size range (the driver refused a reservation, or
        // kMaxSpans): the largest requests' range serves it, rather than an out-of-memory.
        if (range == top) return Status::out_of_memory;
        range = top;
        continue;
      }
    }
    // The window takes part of a free neighbour: an end of it inside a large handle splits that
    // handle first (split_for_cut), and the window is placed again (it ends as take_from's loop).
    if (!split_for_cut(w.start) && !split_for_cut(w.start + rounded)) break;
  }
  std::size_t need = w.gap_hi - w.gap_lo;
  // Plan: which handles fill the gap, spares first, then idle ones, then fresh.
  chosen_.clear();
  std::size_t remaining = need;
  std::size_t spares_used = 0, moved = 0;
  auto choose = [&](Handle* h) {
    if (chosen_.size() == chosen_.capacity()) return false;
    chosen_.push_back(h);  // within capacity
    remaining -= h->size;
    return true;
  };
  for (auto it = backing_.spares().rbegin(); it != backing_.spares().rend() && remaining != 0;
       ++it) {
    if (it->size <= remaining && choose(const_cast<Handle*>(&*it))) ++spares_used;
  }
  // candidates_ is this call's: the loops below must not see an earlier miss's idle handles,
  // which may have moved or gone back to the driver since (grow_slack_pct's fresh-only calls
  // collect none, and once released such a stale handle: PoolModel/GrowSlack).
  candidates_.clear();
  consolidate = consolidate && remaining <= fresh_allowance;  // within the pool's cap
  const std::size_t ordinary = consolidate ? fine_handle(remaining) : 0;
  std::size_t as_moved = remaining;  // what would remain had the small handles moved too
  if (move && remaining != 0) {
    collect_idle(w, rounded, remaining);
    for (Handle* h : candidates_) {
      if (as_moved == 0) break;
      if (h->size > as_moved) continue;
      if (consolidate && h->size * 2 <= ordinary) {
        as_moved -= h->size;  // replaced by fresh memory below, then given back
      } else if (choose(h)) {
        ++moved;
        as_moved -= h->size;
      }
    }
  }
  // Coarse handles lying idle that are too large to move here (they are split lazily:
  // split_for_cut) go back to the driver before fresh memory is taken, as many as the rest needs:
  // what the heap holds then shrinks, where moving their ordinary-size parts would have kept it
  // level.
  if (as_moved != 0 && coarse_created_ != 0) {
    std::size_t given_back = 0;
    for (Handle*& h : candidates_) {
      if (given_back >= as_moved) break;
      if (h == nullptr || h->size <= fine_cap_ ||
          std::find(chosen_.begin(), chosen_.end(), h) != chosen_.end()) {
        continue;
      }
      given_back += release_mapped(h);
      h = nullptr;  // gone (or, refused by the driver, no longer mapped here)
    }
    fresh_allowance =
        given_back > SIZE_MAX - fresh_allowance ? SIZE_MAX : fresh_allowance + given_back;
  }
  // Idle handles rarely add up to the gap exactly (20 MiB handles for 2,048 MiB leave 8 MiB). Where
  // the device has no fresh memory for the rest (the cap, or the driver refuses it below), the
  // smallest idle handle larger than it goes last and the gap grows into the unbacked region
  // beyond it by the excess, which becomes free memory after the block: the request is served
  // from what the pool holds, not by giving the cache back to the driver and creating it afresh
  // (SeedsScenario in tests/core/pool_test.cpp).
  auto overshoot = [&] {
    if (!move || remaining == 0 || chosen_.size() == chosen_.capacity()) return false;
    Handle* over = nullptr;
    for (Handle* h : candidates_) {
      if (h != nullptr && h->size > remaining && (over == nullptr || h->size < over->size) &&
          std::find(chosen_.begin(), chosen_.end(), h) == chosen_.end()) {
        over = h;
      }
    }
    if (over == nullptr || w.unbacked->end() - w.gap_hi < over->size - remaining) return false;
    chosen_.push_back(over);  // within capacity (checked above)
    ++moved;
    w.gap_hi += over->size - remaining;
    need = w.gap_hi - w.gap_lo;
    remaining = 0;
    return true;
  };
  if (remaining > fresh_allowance) overshoot();
  std::size_t fresh = remaining;
  if (fresh > fresh_allowance) return Status::out_of_memory;
  // The fresh handles go last in the gap (mapped in chosen_'s order): the first granule is theirs
  // only when nothing else backs the gap.
  const FreshPlan plan = plan_fresh(
      fresh, fine_handle(fresh), fresh == need && w.start > w.gap_lo, w.start + rounded < w.gap_hi,
      stream_ordered ? options_.coarse_min_stream : options_.coarse_min);
  const std::size_t fresh_count = plan.count();
  // Nodes for every split below (the window's, two per moved handle, two per handle a failed
  // rollback may leave mapped), so that no step fails half-way for want of host memory.
  if (!space_.reserve_nodes(8 + 2 * moved + 2 * (chosen_.size() + fresh_count + 1))) {
    return Status::out_of_memory;
  }
  if (chosen_.size() + fresh_count + 1 > chosen_.capacity()) {
    try {
      chosen_.reserve(chosen_.size() + fresh_count + 1);
    } catch (...) {
      return Status::out_of_memory;
    }
  }

  // Acquire: fresh handles first (nothing else has changed if the driver refuses). They go last
  // in chosen_, and `created` counts them.
  std::size_t created = 0;
  auto release_created = [&] {
    for (std::size_t i = chosen_.size() - created; i < chosen_.size(); ++i) {
      if (chosen_[i]->at == 0) backing_.release(chosen_[i]);  // else still mapped (unmap_all)
    }
    chosen_.resize(chosen_.size() - created);
    created = 0;
  };
  for (std::size_t done = 0; done < fresh;) {
    Handle* h = nullptr;
    const std::size_t size = plan.next(done);
    if (backing_.create(size, &h) != Status::ok) {
      release_created();
      if (consolidate) {  // nothing has moved or gone back: plan it again with moves only
        consolidate_off_ = true;
        const Status again =
            grow(rounded, fresh_allowance, out, growth, allow_move, stream_ordered);
        consolidate_off_ = false;
        return again;
      }
      if (!overshoot()) return Status::out_of_memory;
      fresh = 0;  // the excess of an idle handle stands in for it
      break;
    }
    chosen_.push_back(h);  // within the capacity reserved above
    ++created;
    done += size;
    if (size > fine_cap_) ++coarse_created_;
  }
  // The fresh handles exist: the small idle ones they stand in for go back (consolidate, above).
  if (consolidate) {
    const std::size_t replaced = remaining - as_moved;  // the small handles' share of fresh
    std::size_t released = 0;
    for (Handle* h : candidates_) {
      if (released >= replaced) break;
      if (h == nullptr || h->size * 2 > ordinary ||
          std::find(chosen_.begin(), chosen_.end(), h) != chosen_.end()) {
        continue;
      }
      released += release_mapped(h);
    }
  }
  // Move: unmap idle handles where they lie (or leave that to the reclaimer thread:
  // defer_unmap); their place becomes unbacked. One the driver will not unmap stays where it is,
  // and fresh memory stands in for it if the allowance permits.
  std::size_t covered = 0;
  const std::size_t moved_end = spares_used + moved;  // chosen_[spares_used, moved_end): idle ones
  DevPtr run_lo = 0, run_hi = 0;  // places unmapped side by side: one segment_unmap for them
  for (std::size_t i = 0; i < chosen_.size(); ++i) {
    Handle* h = chosen_[i];
    if (i >= spares_used && i < moved_end) {
      Handle old;  // carve needs the old place
      old.at = h->at;
      old.size = h->size;
      const Status unmapped = options_.defer_unmap ? backing_.retire(h) : backing_.unmap(h);
      if (unmapped != Status::ok) {
        chosen_[i] = nullptr;
        --moved;
        continue;
      }
      carve(&old);
      if (old.at != run_hi) {
        note_segment(run_lo, run_hi - run_lo, false);
        run_lo = old.at;
      }
      run_hi = old.at + old.size;
      growth->moved_bytes += h->size;
    } else if (i < spares_used) {
      growth->moved_bytes += h->size;
    }
    covered += h->size;
  }
  note_segment(run_lo, run_hi - run_lo, false);
  std::erase(chosen_, nullptr);
  if (covered < need) {
    const std::size_t missing = need - covered;
    Handle* h = nullptr;
    if (fresh + missing > fresh_allowance || backing_.create(missing, &h) != Status::ok) {
      release_created();
      return Status::out_of_memory;  // moved handles stay spares: reserved is unchanged
    }
    chosen_.push_back(h);  // a nullptr was erased above: within capacity
    ++created;
  }
  // Map side by side over the gap, then one cuMemSetAccess for all of it.
  DevPtr at = w.gap_lo;
  std::size_t mapped = 0;
  Status status = Status::ok;
  for (; mapped < chosen_.size(); ++mapped) {
    if ((status = backing_.map(chosen_[mapped], at)) != Status::ok) break;
    at += chosen_[mapped]->size;
  }
  if (status == Status::ok && need != 0) status = backing_.set_access(w.gap_lo, need);
  if (status != Status::ok) {
    unmap_all(chosen_.data(), mapped);
    release_created();
    return Status::out_of_memory;  // moved handles are spares now: kept, reserved unchanged
  }
  // The gap is backed: it becomes free and merges with its free neighbours; the window is cut
  // out of the merged block.
  if (need != 0) {
    Block* u = space_.block_at(w.gap_lo);
    if (u->ptr < w.gap_lo) u = space_.split(u, w.gap_lo - u->ptr);
    if (u->size > need) space_.split(u, need);
    space_.clear_unbacked(u);
    make_free(u);
    note_segment(w.gap_lo, need, true);
  }
  Block* b = space_.block_at(w.start);
  free_.erase(free_.iterator_to(*b));
  if (b->ptr < w.start) {
    Block* rest = space_.split(b, w.start - b->ptr);
    free_.insert(*b);
    b = rest;
  }
  if (b->size > rounded) free_.insert(*space_.split(b, rounded));
  mark_allocated(b);
  for (std::size_t i = chosen_.size() - created; i < chosen_.size(); ++i) {
    growth->fresh_bytes += chosen_[i]->size;
  }
  growth->fresh_handles = created;
  growth->moved_handles = moved;
  growth->spare_handles = spares_used;
  *out = b;
  return Status::ok;
}

std::string LargeHeap::validate() const {
  char buf[256];
  auto fail = [&](const char* what, const Block* b) {
    std::snprintf(buf, sizeof buf, "%s at block 0x%llx+%zu (state %d)", what,
                  static_cast<unsigned long long>(b->ptr), b->size, static_cast<int>(b->state));
    return std::string(buf);
  };
  std::size_t free_count = 0;
  std::size_t exempt_live = 0;
  for (std::size_t s = 0; s < space_.span_count(); ++s) {
    const AddressSpace::Span& span = space_.span(s);
    DevPtr at = span.base;
    for (const Block* b = space_.first_block(s); b != nullptr; b = b->next) {
      if (b->ptr != at) return fail("blocks do not tile the span", b);
      if (b->size == 0) return fail("empty block", b);
      if (b->next != nullptr && b->next->prev != b) return fail("broken links", b);
      if (b->size_range != space_.first_block(s)->size_range)
        return fail("size range not its span's", b);
      at = b->end();
      if (b->state == BlockState::allocated && b->size >= share_exempt_) {
        exempt_live += b->size;
      }
      const bool unbacked = b->state == BlockState::unbacked;
      if (b->next != nullptr && b->next->state == b->state &&
          (unbacked || b->state == BlockState::free)) {
        return fail("unmerged neighbours", b);
      }
      if (unbacked != b->unbacked_hook.is_linked()) return fail("unbacked index", b);
      if (b->state == BlockState::free) {
        ++free_count;
        if (!b->free_hook.is_linked() || free_.find(*b) == free_.end()) {
          return fail("free block not indexed", b);
        }
      }
      if (unbacked) {
        if (b->ptr % options_.granularity != 0 || b->size % options_.granularity != 0) {
          return fail("unaligned unbacked block", b);
        }
        Handle* h = backing_.first_from(b->ptr);
        if (h != nullptr && h->at < b->end()) return fail("handle mapped in an unbacked block", b);
        if (Handle* c = backing_.handle_at(b->ptr); c != nullptr) {
          return fail("handle overlaps an unbacked block", b);
        }
      } else {
        // Every byte mapped: walk the handles over the block.
        DevPtr p = b->ptr;
        while (p < b->end()) {
          Handle* h = backing_.handle_at(p);
          if (h == nullptr) return fail("unmapped byte in a backed block", b);
          p = h->end();
        }
      }
    }
    if (at != span.base + span.size) {
      std::snprintf(buf, sizeof buf, "span %zu not covered", s);
      return buf;
    }
  }
  if (free_count != free_.size()) return "free set holds blocks that are not free";
  if (exempt_live != exempt_live_) return "live bytes left out of handle_share";
  std::size_t mapped = 0;
  DevPtr last_end = 0;
  for (const Handle& h : backing_.mapped()) {
    if (h.at < last_end) return "mapped handles overlap";
    last_end = h.end();
    mapped += h.size;
  }
  if (mapped != backing_.mapped_bytes()) return "mapped byte count";
  // A place still mapped for a moved handle is address space no block uses.
  const char* retired_error = nullptr;
  backing_.for_each_retired([&](DevPtr at, std::size_t size) {
    const Block* b = space_.block_at(at);
    if (b == nullptr || b->state != BlockState::unbacked || at + size > b->end()) {
      retired_error = "a retired mapping lies outside unbacked address space";
    }
  });
  if (retired_error != nullptr) return retired_error;
  return {};
}

}  // namespace gpustitch::detail
