// The pool of one device.
//
// Where an allocation comes from, in order:
//   1. small requests (< small_limit) go to the small-object pool (small_pool.h), which takes
//      whole chunks from here;
//   2. a block the thread's arena parked (large_cache.h), without the device lock;
//   3. a cached block: best fit among fenced free blocks of the device's address space (or among
//      blocks the same stream freed, which stream order makes safe at once), cut at 512 B;
//      max_split_size keeps oversize blocks for large requests, as PYTORCH_CUDA_ALLOC_CONF's
//      max_split_size_mb does. A cut of the stream's own block inside a large handle first asks
//      the event of the block's free, else fences or waits (stream_cut_fence, stream_cut_wait),
//      so that the cut can split the handle (the GPU may use unfenced memory);
//   4. the large-block heap's miss path (large_heap.cpp): the place in the address space that
//      needs the least new physical memory, backed by spare and idle handles moved from free
//      blocks elsewhere (stitching), and fresh handles only for what they cannot cover;
//   5. fence pending frees, trim (give idle handles back to the driver) and try 4 again; only
//      then out-of-memory.
// An allocation therefore fails only when the request exceeds device free + pool idle memory.
//
// Frees never wait for the device: memory is queued with a fence epoch (reclaimer.cpp).
//
// Large blocks bypass the device lock in the steady state: a block is registered in the allocating
// thread's arena, its free parks it there, and the next allocation of that size takes it back, all
// under the arena's lock (large_cache.h): at once on the stream that freed it (cudaFreeAsync), and
// otherwise once a fence covers the free, which the arena runs itself if the device was idle at the
// last fence (a cudaMalloc/cudaFree loop). Parked blocks go back to this pool as pending when an
// arena's bound is exceeded, when an allocation needs another size or the device is busy, and
// wherever the small pool's stream caches are dropped (out-of-memory retry, trim, release_idle,
// drain_pending), so the out-of-memory guarantee above still holds.
//
// Files, one concept each: this one (allocation, free, queries), device_pool_arenas.cpp (the
// thread arenas and their chunks), device_pool_fencing.cpp (the fence queue), free_events.h (the
// events of stream-ordered frees, which a stream's cut asks before it fences),
// device_pool_release.cpp (giving memory back: trim, cooperative release), device_pool_stats.cpp
// (statistics and events, an observer of the pool), large_heap.cpp (placement and backing of
// large blocks), memory_map.cpp (the memory map for snapshots).
//
// Thread safety: one lock per device (a std::mutex; the arenas use HybridLock) guards everything
// here but the arenas (lock order: arena, then device); backend calls on the slow paths (create,
// map, move) run under it, as cudaMalloc does in PyTorch's allocator. Observer callbacks run
// after the mutex is released.
#include "device_pool.h"

#include "device_pool_internal.h"

#include <algorithm>

namespace gpustitch::detail {
namespace {

// Chunks are all of one size (the granularity): each is one handle, and one never needs to move.
LargeHeap::Options chunk_heap_options(Backend& backend, int device) {
  LargeHeap::Options o;
  o.granularity = std::max<std::size_t>(backend.granularity(device), 1);
  o.move = false;
  return o;
}

LargeHeap::Options heap_options(Backend& backend, const Config& config, int device) {
  LargeHeap::Options o;
  o.granularity = std::max<std::size_t>(backend.granularity(device), 1);
  o.min_handle = config.segment_size;
  o.max_fresh_handles = config.fresh_handles == 0 ? SIZE_MAX : config.fresh_handles;
  o.max_handle = config.max_handle == 0 ? SIZE_MAX : config.max_handle;
  o.handle_share = config.handle_share;
  o.coarse_min = config.fresh_coarse;
  o.coarse_min_stream =
      config.fresh_coarse == 0 ? 0 : std::max(config.fresh_coarse, config.stream_fresh_coarse);
  o.move = config.stitching;
  o.defer_unmap = config.unmap == Config::Unmap::lazy ||
                  (config.unmap == Config::Unmap::background && config.background_reclaim);
  o.max_split_size = config.max_split_size;
  if (config.size_ranges || config.memory_first != 0) {
    o.range_limits[0] = kSizeRangeLimits[0];
    o.range_limits[1] = kSizeRangeLimits[1];
  }
  o.max_handles_per_gap = config.gap_handles;
  o.ranges_always = config.size_ranges;
  o.memory_first_below = config.memory_first;
  return o;
}

}  // namespace

DevicePool::DevicePool(Backend& backend, const Config& config, int device, PoolObserver* observer)
    : backend_(backend),
      config_(config),
      device_(device),
      observer_(observer),
      heap_(backend, device, heap_options(backend, config, device), observer),
      chunks_(backend, device, chunk_heap_options(backend, device), observer),
      free_events_(backend, device),
      reclaimer_([this] { return fence_pass(/*promote_large=*/!config_.ordered_fences); }) {
  granularity_ = backend_.granularity(device_);
  std::size_t free = 0, total = 0;
  usable_ = granularity_ != 0 && backend_.mem_info(device_, &free, &total) == Status::ok &&
            heap_.init(total) == Status::ok && chunks_.init(total / 2) == Status::ok;
  total_ = total;
  last_device_free_ = free;
  const unsigned arenas =
      config_.arenas != 0 ? std::min(config_.arenas, kMaxArenas) : arena_slots();
  for (unsigned i = 0; i < arenas; ++i) {
    arenas_.push_back(std::make_unique<Arena>(config_.small_limit,
                                              std::max<std::size_t>(granularity_, 1),
                                              config_.large_cache, static_cast<std::uint16_t>(i)));
  }
  stats_.device_total = total;
  stats_.device_free = free;
  sync_physical();
}

DevicePool::~DevicePool() {
  reclaimer_.stop();     // no fence pass may run while the heap goes away
  drain_large_caches();  // the arenas must not keep pointers to blocks deleted with the heap
  // Everything is given back, live blocks included, by the heap's destructor: the pool dies with
  // its process (or test).
  std::lock_guard lock(mu_);
  stream_free_.clear();
}

// ---------------------------------------------------------------------------------------------
// Allocation
//
// allocate() does not count an out-of-memory itself: the Pool may still retry (its out-of-memory
// handler, e.g. cooperative release), and only the failure the caller finally sees counts, once,
// through note_out_of_memory().

Status DevicePool::allocate(std::size_t size, Stream stream, DevPtr* out,
                            Outcome* outcome) noexcept {
  if (!usable_) return Status::not_initialized;
  if (size < config_.small_limit) {
    Status s = allocate_small(size, stream, out, outcome);
    if (s == Status::out_of_memory) {
      // Empty chunks held by the arenas may be what the large pool lacks: give them back, retry.
      release_arena_chunks(true);
      Outcome retry;
      s = allocate_small(size, stream, out, &retry);
      if (retry.has_event) outcome->add(retry.event);
    }
    emit(*outcome);
    return s;
  }
  const std::size_t rounded = align_up(size, kMinBlock);
  // The thread's arena serves from its parked blocks, and otherwise registers the block the device
  // pool serves, so that its free needs no device lock either.
  Arena* owner = config_.large_cache != 0 && rounded >= size ? &arena_for_thread() : nullptr;
  Status status = Status::ok;
  bool may_wait = (config_.ordered_fences || (stream != kAnyStream && config_.stream_miss_fence)) &&
                  may_wait_for_fence();
  for (int attempt = 0; attempt < 2; ++attempt) {
    FenceWait wait;  // what to wait for, if the device path asks
    {
      std::unique_lock<HybridLock> arena_lock;
      bool grow = false;  // take more memory: the arena's fitting blocks wait for one fence
      if (owner != nullptr) {
        arena_lock = std::unique_lock(owner->mu);
        if (take_parked(*owner, size, rounded, stream, out, outcome, &grow)) {
          status = Status::ok;
          break;
        }
      }
      std::lock_guard lock(mu_);
      Block* b = nullptr;
      if (owner != nullptr && owner->large.parked_count() != 0) {
        // Before taking fresh memory, parked blocks that cannot serve the request here go to the
        // device pool (LargeCache::take_for_device): larger ones of this stream, where they may be
        // split, and for a cudaMalloc fitting ones a fence did not cover yet.
        b = take_cached(rounded, stream);
        if (b != nullptr) {
          ++stats_.cache_hits;
          outcome->how = ServedBy::cache;
        } else if (!grow) {
          unpark_to_device(*owner, stream, rounded);
        }
      }
      status = b != nullptr     ? Status::ok
               : rounded < size ? Status::out_of_memory
                                : allocate_large(size, rounded, stream, &b, outcome, owner, grow,
                                                 may_wait ? &wait : nullptr);
      if (status == Status::ok) {
        b->requested = size;
        b->stream = stream;
        outcome->size = b->size;
        *out = b->ptr;
        if (owner != nullptr) {
          b->arena_owned = true;
          b->arena = owner->id;
          owner->large.add_live(b);
          owner->count_alloc(b->size, size);
        } else {
          live_.insert(b);
          stats_.bytes_allocated += b->size;
          peak_.device_allocated.store(stats_.bytes_allocated, std::memory_order_relaxed);
          const int bucket = histogram_bucket(size);
          ++stats_.allocs;
          ++stats_.live_blocks;
          stats_.bytes_requested += size;
          ++stats_.hist_allocs[bucket];
          ++stats_.hist_live[bucket];
        }
        note_peak();
        break;
      }
      if (wait.epoch == 0 && (status != Status::out_of_memory || attempt == 1)) break;
    }
    if (wait.epoch != 0) {  // once per allocation, then it grows
      wait_for_reclaimer(wait);
      may_wait = false;
      --attempt;
      continue;
    }
    // Out of memory with the large pool alone: fence small frees and take back empty chunks
    // (the arena locks come before the device lock, so this happens outside it), then retry.
    release_arena_chunks(true);
  }
  emit(*outcome);
  return status;
}

Status DevicePool::allocate_large(std::size_t size, std::size_t rounded, Stream stream, Block** out,
                                  Outcome* outcome, Arena* owner, bool grow,
                                  FenceWait* wait_for_fence) noexcept {
  (void)size;
  auto cached = [&] {
    Block* b = take_cached(rounded, stream);
    if (b == nullptr) return false;
    ++stats_.cache_hits;
    outcome->how = ServedBy::cache;
    *out = b;
    return true;
  };
  // With cudaFree semantics, memory waiting for its fence is fenced before best fit when fencing
  // is cheap (the last fence found the device idle; native cudaFree waits for the device anyway):
  // best fit then sees every freed block, merged with its neighbours. Fenced only after a miss,
  // the training traces replayed to 1-4% more reserved memory and more misses, as requests went
  // to other free blocks while the best one waited.
  if (!grow && stream == kAnyStream && fence_step(wait_for_fence) == FenceStep::wait) {
    return Status::out_of_memory;
  }
  // A stream's cut out of its own memory waiting for its fence cannot split a coarse handle (the
  // GPU may still use it), so the live block would pin the handle's free rest while it lives:
  // fence first (or wait for the reclaimer's fence, as a stream-ordered miss does), and the cut
  // splits the handle.
  //
  // Before any fence, the event of the block's free (free_events.h) may say the device has run
  // past it: then the block is free as a fence would make it, and nothing waits. Where it has not,
  // stream_cut_wait off cuts at once (the live block pins the handle's rest).
  Block* own = nullptr;
  if (!grow && config_.stream_cut_fence && own_cut_pins(rounded, stream, &own)) {
    // (Not with reclaim:ordered, whose decisions are inline mode's, whatever the device's pace.)
    if (fence_locked_if_cheap() || (!config_.ordered_fences && free_if_device_ran_past(own))) {
      // fenced: the cut below splits the handle
    } else if (!config_.stream_cut_wait) {
      // cut without waiting
    } else if (config_.ordered_fences) {
      if (fence_step(wait_for_fence) == FenceStep::wait) return Status::out_of_memory;
    } else if (wait_for_fence != nullptr) {
      wait_for_fence->epoch = own->epoch;  // the fence that lets the cut split the handle
      wait_for_fence->event = free_events_.event_of(own->stream, own->free_event);
      return Status::out_of_memory;
    }
  }
  if (cached()) return Status::ok;
  // The three steps below fence rather than grow. A request that comes to grow
  // (grow_rather_than_fence) skips them, and fences only if the device has no memory left.
  if (!grow) {
    // Memory waiting for its fence: fence here instead of taking more memory if that is cheap,
    // i.e. the last fence found the device idle (a tight allocate/free loop with cudaFree
    // semantics), or if the pool fences only on demand. A busy device is left to the reclaimer.
    switch (fence_step(wait_for_fence)) {
      case FenceStep::fenced:
        if (cached()) return Status::ok;
        break;
      case FenceStep::wait:
        return Status::out_of_memory;
      case FenceStep::none:
        break;
    }
    // Much memory waiting for its fence (the program runs ahead of the device, freeing as it goes):
    // wait for the device rather than grow the pool by what is about to come back anyway.
    // Stream-ordered allocations (cudaMallocAsync) never make the host wait.
    if (stream == kAnyStream && fq_head_ != nullptr && stats_.bytes_pending >= rounded &&
        stats_.bytes_pending * 8 >= working_reserved()) {
      fence_locked();
      if (cached()) return Status::ok;
    }
    // Blocks this thread parked with cudaFree semantics that are too small for the request: before
    // the heap maps anything, they join the fence queue (and, on an idle device, come back
    // fenced), so that they merge with their neighbours and their handles can move.
    if (owner != nullptr && stream == kAnyStream && owner->large.parked_count() != 0 &&
        unpark_to_device(*owner, kAnyStream, 0) != 0 && fence_locked_if_cheap() && cached()) {
      return Status::ok;
    }
  }
  // Before fresh memory is taken for a cudaMalloc, memory waiting for its fence that could
  // cover it is waited for, once it is more than 1/64 of the pool (outside very large live
  // blocks: working_reserved): on the H200, GPT training with
  // PyTorch's cache off held 0.5-1.5 GiB more at its peak when it grew instead (18.6 GiB with
  // every miss fenced, 19.1-19.8 GiB without). Idle memory elsewhere is moved first (no fresh
  // memory, no wait); a stream-ordered allocation never waits.
  //
  // A stream-ordered allocation (stream_miss_fence) waits too, but never with the lock held on a
  // busy device, and only for a bounded time: a program that orders its streams by hand (an
  // NCCL kernel waiting for a peer that waits for this allocation) must not deadlock. The caller
  // waits for the reclaimer's fence without the locks (wait_for_reclaimer) and retries.
  if ((stream == kAnyStream || config_.stream_miss_fence) && fq_head_ != nullptr &&
      stats_.bytes_pending >= rounded / 2 && stats_.bytes_pending * 64 >= working_reserved()) {
    if (grow_heap(rounded, stream, out, outcome, /*fresh=*/false)) return Status::ok;
    if (stream == kAnyStream || fence_is_cheap(last_fence_ns_.load(std::memory_order_relaxed))) {
      fence_locked();
      if (cached()) return Status::ok;
    } else if (wait_for_fence != nullptr) {
      wait_for_fence->epoch = fq_tail_->epoch;  // the newest free: a fence of it covers them all
      return Status::out_of_memory;
    }
  }
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (grow_heap(rounded, stream, out, outcome)) return Status::ok;
    // No memory to back it: memory still waiting for its fence is the cheapest to get back.
    if (has_pending()) {
      fence_locked();
      if (cached() || grow_heap(rounded, stream, out, outcome)) return Status::ok;
    }
    // Give idle handles back to the driver and retry: handles too large to fit the gap (or, with
    // stitching off, any idle handle) come back as fresh memory of the right size. PyTorch's
    // free-cache-and-retry.
    if (attempt == 0 && trim_locked(0, outcome) == 0) break;
  }
  return Status::out_of_memory;
}

bool DevicePool::grow_heap(std::size_t rounded, Stream stream, Block** out, Outcome* outcome,
                           bool fresh) noexcept {
  const bool stream_ordered = stream != kAnyStream;
  LargeHeap::Growth g;
  Status s = Status::out_of_memory;
  // grow_slack_pct: while the pool holds less than that much above the program's peak, a miss
  // takes fresh memory rather than moving idle handles (fewer driver calls per step once the
  // pool has grown, for more memory held).
  if (fresh && config_.grow_slack_pct != 0) {
    const std::size_t peak = peak_.allocated.load(std::memory_order_relaxed);
    const std::size_t limit = peak + peak / 100 * config_.grow_slack_pct;
    const std::size_t held = heap_.reserved_bytes() + chunks_.reserved_bytes();
    if (held < limit) {
      s = heap_.grow(rounded, std::min(fresh_allowance(), limit - held), out, &g, false,
                     stream_ordered);
    }
  }
  if (s != Status::ok) {
    s = heap_.grow(rounded, fresh ? fresh_allowance() : 0, out, &g, true, stream_ordered);
  }
  sync_physical();  // a failed grow may still have moved handles (they stay spares)
  note_free_changed();
  // Moved handles' old places wait for the reclaimer's unmap (retired_mappings.h).
  if (config_.unmap == Config::Unmap::background && heap_.backing().retired() != 0) {
    reclaimer_.kick();
  }
  if (s != Status::ok) return false;
  if (g.fresh_bytes != 0) ++stats_.fresh;
  if (g.moved_handles + g.spare_handles != 0) {
    ++stats_.stitches;
    stats_.stitched_bytes += rounded;
    outcome->add(make_event(EventKind::stitch, rounded, g.moved_handles + g.spare_handles));
  }
  outcome->how = g.fresh_bytes != 0                       ? ServedBy::fresh
                 : g.moved_handles + g.spare_handles != 0 ? ServedBy::stitched
                                                          : ServedBy::cache;
  if (outcome->how == ServedBy::cache) ++stats_.cache_hits;
  return true;
}

Block* DevicePool::take_cached(std::size_t rounded, Stream stream) noexcept {
  if (stream != kAnyStream && !stream_free_.empty()) {
    auto it = stream_free_.find(stream);
    if (it != stream_free_.end()) {
      auto own = heap_.fit(it->second, rounded);
      if (own != it->second.end() && free_fit_is_smaller(*own, rounded)) {
        if (Block* b = take_from(heap_, heap_.free_blocks(), rounded, false)) return b;
      }
      if (Block* b = take_from(heap_, it->second, rounded, true)) return b;
    }
  }
  return take_from(heap_, heap_.free_blocks(), rounded, false);
}

bool DevicePool::free_fit_is_smaller(const Block& own, std::size_t rounded) noexcept {
  // Best fit over all a stream may use: its own pending blocks and the fenced free ones. (Its
  // own first left the smaller free block to others and cut a larger one of its own.)
  auto any = heap_.fit(heap_.free_blocks(), rounded);
  return any != heap_.free_blocks().end() && any->size < own.size;
}

bool DevicePool::own_cut_pins(std::size_t rounded, Stream stream, Block** own_out) noexcept {
  if (stream == kAnyStream || stream_free_.empty() || !heap_.made_coarse_handles()) return false;
  auto it = stream_free_.find(stream);
  if (it == stream_free_.end()) return false;
  // The choice take_cached makes, and take_from's cut.
  auto own = heap_.fit(it->second, rounded);
  if (own == it->second.end() || free_fit_is_smaller(*own, rounded)) return false;
  const std::size_t max_split = config_.max_split_size;
  if (own->size >= max_split) return false;  // used whole, or not at all
  if (rounded >= own->size || !heap_.pending_cut_pins(&*own, own->ptr + rounded)) return false;
  *own_out = &*own;
  return true;
}

bool DevicePool::free_if_device_ran_past(Block* own) noexcept {
  const std::uint64_t seq = own->free_event;
  const Stream stream = own->stream;
  if (seq == 0) return false;
  if (!free_events_.completed(stream, seq)) {
    ++stats_.cuts_event_running;
    return false;
  }
  ++stats_.cuts_after_event;
  // The stream's work runs in order: what it freed before this free is done with too.
  auto it = stream_free_.find(stream);
  if (it == stream_free_.end()) return false;  // cannot be: own is in its stream's set
  FreeSet& set = it->second;
  for (auto b = set.begin(); b != set.end();) {
    Block* block = &*b;
    ++b;  // make_free may merge block, never the set's other blocks (pending, not free)
    if (block->free_event == 0 || block->free_event > seq) continue;
    set.erase(set.iterator_to(*block));
    fq_remove(block);
    stats_.bytes_pending -= block->size;
    make_free(block);
  }
  return true;
}

Block* DevicePool::take_from(LargeHeap& heap, FreeSet& set, std::size_t rounded,
                             bool pending) noexcept {
  const std::size_t max_split = config_.max_split_size;
  Block* b = nullptr;
  std::size_t cut = 0;
  for (;;) {
    auto it = heap.fit(set, rounded);
    if (it == set.end()) return nullptr;
    b = &*it;
    if (rounded < max_split && b->size >= max_split) return nullptr;
    if (rounded >= max_split && b->size >= rounded + kLargeBuffer) return nullptr;
    // Oversize blocks are used whole (max_split_size); others are cut at the request.
    cut = b->size >= max_split ? b->size : rounded;
    // A cut inside a large handle of fenced memory splits that handle first (its handles change,
    // not its addresses), then the lookup runs again, since a split the driver cut short left
    // part of the block unbacked. After a split the cut lies in a one-granule handle, and each
    // split cut short backs less memory, so this ends.
    if (pending || cut == b->size || !heap.split_for_cut(b->ptr + cut, b->size)) break;
    sync_physical();
  }
  auto it = set.iterator_to(*b);
  set.erase(it);
  Block* rest = b->size > cut ? heap.split(b, cut) : nullptr;  // nullptr: used whole
  if (rest != nullptr) {
    if (pending) {
      // The remainder stays queued for its fence, right where b was, and reusable by the stream.
      fq_insert_after(b, rest);
      set.insert(*rest);
    } else {
      heap.free_blocks().insert(*rest);
    }
  }
  if (pending) {
    stats_.bytes_pending -= b->size;  // b's share; the remainder stays pending
    fq_remove(b);
  }
  heap.mark_allocated(b);
  note_free_changed();
  return b;
}

// ---------------------------------------------------------------------------------------------
// Block bookkeeping

void DevicePool::make_free(Block* b) noexcept {
  heap_.make_free(b);
  note_free_changed();
}

void DevicePool::note_free_changed() noexcept {
  largest_free_.store(heap_.largest_free(), std::memory_order_relaxed);
}

void DevicePool::fq_push(Block* b) noexcept {
  b->fq_prev = fq_tail_;
  b->fq_next = nullptr;
  if (fq_tail_ != nullptr) fq_tail_->fq_next = b;
  fq_tail_ = b;
  if (fq_head_ == nullptr) fq_head_ = b;
}

void DevicePool::fq_insert_after(Block* pos, Block* b) noexcept {
  b->fq_prev = pos;
  b->fq_next = pos->fq_next;
  if (pos->fq_next != nullptr) pos->fq_next->fq_prev = b;
  pos->fq_next = b;
  if (fq_tail_ == pos) fq_tail_ = b;
}

void DevicePool::fq_remove(Block* b) noexcept {
  if (b->fq_prev != nullptr) b->fq_prev->fq_next = b->fq_next;
  if (b->fq_next != nullptr) b->fq_next->fq_prev = b->fq_prev;
  if (fq_head_ == b) fq_head_ = b->fq_next;
  if (fq_tail_ == b) fq_tail_ = b->fq_prev;
  b->fq_prev = b->fq_next = nullptr;
}

// ---------------------------------------------------------------------------------------------
// Free

Status DevicePool::deallocate(DevPtr ptr, Stream stream, Outcome* outcome) noexcept {
  if (!usable_ || (!heap_.contains(ptr) && !chunks_.contains(ptr))) return Status::invalid_value;
  // This thread's arena first (its small slots and the large blocks it registered), then the
  // device pool's live blocks (large blocks when the arenas' large caches are off), then the
  // other arenas (frees from another thread than the allocating one: the block is parked in the
  // arena that registered it).
  Arena& mine = arena_for_thread();
  bool done = free_in_arena(mine, ptr, stream, outcome);
  if (!done && !mine.large.enabled()) done = free_device_block(ptr, stream, outcome);
  for (std::size_t i = 0; !done && i < arenas_.size(); ++i) {
    if (arenas_[i].get() != &mine) done = free_in_arena(*arenas_[i], ptr, stream, outcome);
  }
  if (!done) return Status::invalid_value;
  if (config_.background_reclaim) reclaimer_.kick();
  return Status::ok;
}

bool DevicePool::free_device_block(DevPtr ptr, Stream stream, Outcome* outcome) noexcept {
  std::lock_guard lock(mu_);
  Block* b = live_.take(ptr);
  if (b == nullptr) return false;
  stats_.bytes_requested -= b->requested;
  --stats_.live_blocks;
  --stats_.hist_live[histogram_bucket(b->requested)];
  ++stats_.frees;
  outcome->size = b->requested;
  stats_.bytes_allocated -= b->size;
  peak_.device_allocated.store(stats_.bytes_allocated, std::memory_order_relaxed);
  b->epoch = epoch_.load();
  b->stream = stream;
  to_device_pending(b, /*at_free=*/true);
  return true;
}

// ---------------------------------------------------------------------------------------------
// Queries

bool DevicePool::find(DevPtr ptr, BlockInfo* out) const noexcept {
  if (!heap_.contains(ptr) && !chunks_.contains(ptr)) return false;  // not the pool's: no lock
  std::uint16_t arena = 0;
  DevPtr large_base = 0;  // an arena-owned large block: its start
  {
    std::lock_guard lock(mu_);
    Block* b = heap_.contains(ptr) ? heap_.block_at(ptr) : chunks_.block_at(ptr);
    if (b == nullptr || b->state != BlockState::allocated) return false;
    if (!b->small_chunk && !b->arena_owned) {
      if (out != nullptr) *out = BlockInfo{b->ptr, b->requested, b->size, device_, b->stream};
      return true;
    }
    arena = b->arena;
    if (b->arena_owned) large_base = b->ptr;
  }
  if (arena >= arenas_.size()) return false;
  Arena& a = *arenas_[arena];
  std::lock_guard lock(a.mu);
  if (large_base != 0) {  // live in the arena's table, or parked (freed) if absent
    const Block* b = a.large.live(large_base);
    if (b == nullptr || ptr >= b->end()) return false;
    if (out != nullptr) *out = BlockInfo{b->ptr, b->requested, b->size, device_, b->stream};
    return true;
  }
  Chunk* c = a.small.chunk_of(ptr);
  if (c == nullptr) return false;
  const std::size_t slot = (ptr - c->base) / c->slot_size;
  if (slot >= c->nslots || !c->allocated[slot]) return false;
  if (out != nullptr) {
    *out = BlockInfo{c->base + slot * c->slot_size, c->requested[slot], c->slot_size, device_,
                     kAnyStream};
  }
  return true;
}

Status DevicePool::grant_peer_access(int peer) noexcept {
  std::lock_guard lock(mu_);
  if (Status s = heap_.grant_peer(peer); s != Status::ok) return s;
  return chunks_.grant_peer(peer);
}

Status DevicePool::mem_info(std::size_t* free, std::size_t* total) noexcept {
  std::size_t device_free = 0, device_total = 0;
  Status s = backend_.mem_info(device_, &device_free, &device_total);
  if (s != Status::ok) return s;
  std::lock_guard lock(mu_);
  last_device_free_ = device_free;
  const std::size_t cap = cap_bytes();
  std::size_t headroom = stats_.bytes_reserved >= cap ? 0 : cap - stats_.bytes_reserved;
  if (free != nullptr) {
    *free = std::min(device_free, headroom) +
            (stats_.bytes_reserved - stats_.bytes_allocated - arena_allocated());
  }
  if (total != nullptr) *total = std::min(device_total, cap);
  return Status::ok;
}

std::string DevicePool::validate() const {
  std::lock_guard lock(mu_);
  if (!usable_) return {};
  if (std::string why = heap_.validate(); !why.empty()) return why;
  if (std::string why = chunks_.validate(); !why.empty()) return "chunks: " + why;
  std::uint64_t pending = 0;
  for (const Block* b = fq_head_; b != nullptr; b = b->fq_next) {
    if (b->state != BlockState::pending) return "a block in the fence queue is not pending";
    pending += b->size;
  }
  if (pending != stats_.bytes_pending) return "bytes_pending is not the fence queue's sum";
  if (stats_.bytes_reserved != heap_.reserved_bytes() + chunks_.reserved_bytes()) {
    return "bytes_reserved is not the heaps'";
  }
  for (const auto& [stream, set] : stream_free_) {
    for (const Block& b : set) {
      if (b.state != BlockState::pending || b.stream != stream) {
        return "a stream's pending set holds a block that is not its pending block";
      }
    }
  }
  return {};
}

void DevicePool::after_fork_child() noexcept {
  reclaimer_.forget_after_fork();
  heap_.backing().after_fork_child();
}

}  // namespace gpustitch::detail
