// DevicePool's arenas (arena.h): small objects and the large blocks parked per thread, served
// under an arena's own lock rather than the device's, and the chunks their small pools take
// from the device pool (through ArenaChunks, which carries the asking arena with the call).
// Lock order: an arena's lock, then the device's; never the reverse.
#include "device_pool.h"

#include <algorithm>
#include <thread>

#include "device_pool_internal.h"

namespace gpustitch::detail {

// Arena choice: a thread takes, at its first small allocation, the arena index with the fewest
// threads, and gives it back at exit, so that two threads on two cores never share one arena while
// another sits unused (round-robin did, once threads come and go). The index is the same for every
// device pool; a pool of n arenas (Config::arenas, else arena_slots()) gives the thread arena
// index % n. A thread may instead be bound to an index (bind_thread_arena): replay's threads stand
// for a trace's, and must get the same arenas whatever else the process runs.
unsigned arena_slots() {
  static const unsigned n = std::max(1u, std::min(kMaxArenas, std::thread::hardware_concurrency()));
  return n;
}

namespace {

std::atomic<unsigned> g_arena_threads[kMaxArenas];
thread_local unsigned tl_arena_index = UINT32_MAX;  // trivial: read on the hot path
struct ArenaRelease {                               // touched once per thread, at assignment
  bool armed = false;
  ~ArenaRelease() {
    if (tl_arena_index < kMaxArenas) g_arena_threads[tl_arena_index].fetch_sub(1);
    tl_arena_index = UINT32_MAX;
  }
};
thread_local ArenaRelease tl_arena_release;

unsigned assign_arena_index() {
  const unsigned n = arena_slots();
  unsigned best = 0;
  for (unsigned i = 1; i < n; ++i) {
    if (g_arena_threads[i].load(std::memory_order_relaxed) <
        g_arena_threads[best].load(std::memory_order_relaxed)) {
      best = i;
    }
  }
  g_arena_threads[best].fetch_add(1);
  tl_arena_release.armed = true;  // constructs it: its destructor runs at thread exit
  return best;
}

}  // namespace

void bind_thread_arena(unsigned index) noexcept {
  index %= kMaxArenas;
  if (tl_arena_index < kMaxArenas) g_arena_threads[tl_arena_index].fetch_sub(1);
  g_arena_threads[index].fetch_add(1);
  tl_arena_release.armed = true;  // as in assign_arena_index: given back at thread exit
  tl_arena_index = index;
}

std::uint64_t DevicePool::arena_allocated() const noexcept {
  std::uint64_t total = 0;
  for (const auto& a : arenas_) total += a->bytes_allocated.load(std::memory_order_relaxed);
  return total;
}

std::uint64_t DevicePool::parked_bytes() const noexcept {
  std::uint64_t total = 0;
  for (const auto& a : arenas_) total += a->parked_bytes.load(std::memory_order_relaxed);
  return total;
}

bool DevicePool::arenas_pending() const noexcept {
  for (const auto& a : arenas_) {
    if (a->has_pending.load(std::memory_order_relaxed)) return true;
  }
  return false;
}

Arena& DevicePool::arena_for_thread() noexcept {
  if (tl_arena_index == UINT32_MAX) tl_arena_index = assign_arena_index();
  return *arenas_[tl_arena_index % arenas_.size()];
}

Status DevicePool::allocate_small(std::size_t size, Stream stream, DevPtr* out,
                                  Outcome* outcome) noexcept {
  Arena& a = arena_for_thread();
  std::lock_guard lock(a.mu);
  ArenaChunks chunks(*this, a, outcome);
  SmallAlloc s = a.small.allocate(size, stream, chunks);
  if (s.fenced) a.refresh_pending(completed_epoch_.load(std::memory_order_acquire));
  if (s.ptr == 0) return Status::out_of_memory;
  a.count_alloc(s.chunk->slot_size, size);
  if (!s.from_new_chunk) ++a.cache_hits;
  outcome->how = ServedBy::small;
  outcome->size = s.chunk->slot_size;
  *out = s.ptr;
  return Status::ok;
}

bool DevicePool::free_in_arena(Arena& a, DevPtr ptr, Stream stream, Outcome* outcome) noexcept {
  std::lock_guard lock(a.mu);
  return free_in_arena_locked(a, ptr, stream, outcome);
}

bool DevicePool::free_in_arena_locked(Arena& a, DevPtr ptr, Stream stream,
                                      Outcome* outcome) noexcept {
  // The slot's chunk, found by address; the pointer must be a live slot's start.
  Chunk* c = a.small.chunk_of(ptr);
  if (c == nullptr) {
    Block* b = a.large.take_live(ptr);
    if (b == nullptr) return false;
    a.count_free(b->size, b->requested);
    outcome->size = b->requested;
    b->stream = stream;
    b->epoch = epoch_.load();
    if (a.large.can_park(b->size)) {
      park(a, b);
    } else {
      std::lock_guard lock(mu_);
      to_device_pending(b, /*at_free=*/true);
    }
    return true;
  }
  if ((ptr - c->base) % c->slot_size != 0) return false;
  const auto slot = static_cast<std::uint32_t>((ptr - c->base) / c->slot_size);
  if (slot >= c->nslots || !c->allocated[slot]) return false;
  const std::size_t requested = c->requested[slot];
  a.count_free(c->slot_size, requested);
  a.small.free(c, slot, stream, epoch_.load());
  // Stream-ordered frees stay in their stream's cache: only the fence queue needs the reclaimer.
  if (!a.has_pending.load(std::memory_order_relaxed) && a.small.has_pending()) {
    a.has_pending.store(true, std::memory_order_relaxed);
  }
  outcome->size = requested;
  return true;
}

bool DevicePool::take_parked(Arena& a, std::size_t size, std::size_t rounded, Stream stream,
                             DevPtr* out, Outcome* outcome, bool* grow) noexcept {
  if (a.large.parked_count() == 0) return false;
  std::size_t unfenced = 0;
  Block* b = a.large.take(stream, rounded, fenced(a), &unfenced);
  if (b == nullptr && unfenced != 0) {
    if (grow_rather_than_fence(a, unfenced, rounded)) {
      *grow = true;
      return false;
    }
    if (!fence_rather_than_device(a, rounded)) return false;
    b = a.large.take(stream, rounded, fenced(a), &unfenced);
    a.refresh_pending(completed_epoch_.load(std::memory_order_acquire));
  }
  if (b == nullptr) return false;
  a.parked_bytes.store(a.large.parked_bytes(), std::memory_order_relaxed);
  b->requested = size;
  a.large.add_live(b);
  a.count_alloc(b->size, size);
  ++a.cache_hits;
  outcome->how = ServedBy::cache;
  outcome->size = b->size;
  *out = b->ptr;
  note_peak_arena(a);
  return true;
}

LargeCache::Fenced DevicePool::fenced(const Arena& a) const noexcept {
  return LargeCache::Fenced{completed_epoch_.load(std::memory_order_acquire), a.fences_done};
}

bool DevicePool::grow_rather_than_fence(const Arena& a, std::size_t unfenced,
                                        std::size_t rounded) const noexcept {
  // A fence costs more here than the device path (an idle H200: about 0.7 us against a few
  // hundred ns), so a cudaMalloc/cudaFree loop that fenced for every reuse would pay it on every
  // pair. Up to kFenceBatch blocks of the size (within 1/16 of large_cache_mb) are taken instead,
  // and one fence then covers all of them: on the GPU host a 2 MiB loop cost about 1 us per
  // pair when it fenced every time. Not with reclaim:inline, whose fences are all on demand.
  return config_.background_reclaim && a.last_fence_ns > kInlineFenceNs && unfenced < kFenceBatch &&
         (unfenced + 1) * rounded <= config_.large_cache / 16;
}

bool DevicePool::fence_rather_than_device(Arena& a, std::size_t bytes) noexcept {
  // Fence here when that costs less than the device path (a few hundred ns, under the device
  // lock), or when the device pool has no fenced memory to offer. On an idle H200 a fence costs
  // about 0.7 us, so there a cudaMalloc/cudaFree loop takes fenced memory from the device pool
  // while the device pool has some, and fences here once its blocks all live in the arena.
  if (a.last_fence_ns > kInlineFenceNs && largest_free_.load(std::memory_order_relaxed) >= bytes) {
    return false;
  }
  return fence_arena(a);
}

bool DevicePool::fence_is_cheap(std::uint64_t last_fence_ns) const noexcept {
  return !config_.background_reclaim || last_fence_ns < kCheapFenceNs;
}

std::size_t DevicePool::unpark_to_device(Arena& a, Stream stream, std::size_t rounded) noexcept {
  Block* moved[LargeCache::kMaxParked];
  const std::size_t n = a.large.take_for_device(stream, rounded, moved);
  for (std::size_t i = 0; i < n; ++i) to_device_pending(moved[i]);
  a.parked_bytes.store(a.large.parked_bytes(), std::memory_order_relaxed);
  return n;
}

bool DevicePool::fence_arena(Arena& a) noexcept {
  if (!fence_is_cheap(std::min(a.last_fence_ns, last_fence_ns_.load(std::memory_order_relaxed)))) {
    return false;
  }
  const std::uint64_t ticket = ++a.fences_started;  // covers every block parked before it
  // Timed one fence in kFenceSample: two clock reads cost about as much as the rest of a
  // cudaMalloc/cudaFree pair here (30-45 ns each on the GPU host). An untimed fence that meets a
  // device that has just turned busy waits for it, as every native cudaFree does, and the next
  // timed one (or the reclaimer's) stops the inline fences.
  const bool timed = ticket % kFenceSample == 0 || a.last_fence_ns == UINT64_MAX;
  const std::uint64_t start = timed ? monotonic_ns() : 0;
  if (backend_.synchronize(device_) != Status::ok) return false;
  if (timed) a.last_fence_ns = monotonic_ns() - start;
  a.fences_done = ticket;
  return true;
}

void DevicePool::park(Arena& a, Block* b) noexcept {
  Block* evicted[LargeCache::kMaxParked];
  b->arena_fence = a.fences_started;
  const std::size_t n = a.large.park(b, evicted);
  a.parked_bytes.store(a.large.parked_bytes(), std::memory_order_relaxed);
  // A block freed with cudaFree semantics waits for a fence: the reclaimer's work.
  if (b->stream == kAnyStream && !a.has_pending.load(std::memory_order_relaxed)) {
    a.has_pending.store(true, std::memory_order_relaxed);
  }
  if (n == 0) return;
  std::lock_guard lock(mu_);
  for (std::size_t i = 0; i < n; ++i) to_device_pending(evicted[i]);
}

// A block leaving an arena (unparked, or freed where it cannot be parked) joins the fence queue
// with the epoch of its free, and its stream's pending set: reusable by that stream at once, by any
// once fenced, and splittable and stitchable like any pending block.
void DevicePool::to_device_pending(Block* b, bool at_free) noexcept {
  b->arena_owned = false;
  heap_.note_dead(b);
  b->state = BlockState::pending;
  stats_.bytes_pending += b->size;
  // A stream-ordered free records its event only where a cut could pin a large handle (the heap
  // made one); a block parked first has none (recorded later, on another thread, it would not
  // mark the free).
  b->free_event =
      at_free && b->stream != kAnyStream && config_.stream_cut_fence && heap_.made_coarse_handles()
          ? free_events_.record(b->stream)
          : 0;
  if (b->stream == kAnyStream) {
    fq_push(b);
    return;
  }
  // A stream's first pending block makes its set (one map node; the sets are intrusive). Without
  // host memory for it the block waits for its fence like a cudaFree-semantics one.
  FreeSet* set = nullptr;
  try {
    set = &stream_free_[b->stream];
  } catch (...) {
  }
  if (set != nullptr) b = merge_stream_pending(*set, b);
  fq_push(b);
  if (set != nullptr) set->insert(*b);
}

Block* DevicePool::merge_stream_pending(FreeSet& set, Block* b) noexcept {
  // Blocks freed on one stream merge as soon as they are freed, as PyTorch's blocks of one stream
  // do: the stream may reuse all of them at once, so the merged block is as reusable as its
  // parts, and a request larger than any one of them is served without a miss. (Left apart until
  // their fence, the training traces replayed on stream order reserved 3-14% more, and missed
  // into the heap more often.) The merged block waits for the later fence of the two.
  auto same_stream = [&](const Block* n) {
    return n != nullptr && n->state == BlockState::pending && n->stream == b->stream &&
           n->free_hook.is_linked();
  };
  // Fenced free neighbours join too, as they would merge under cudaFree semantics: the stream
  // may use them at once like its own, and the merged block serves a request larger than either.
  // Until the fence the merged block is the stream's alone, and its handles do not move; the
  // reclaimer's pass (or a cheap fence on a miss) gives it back to everyone. Left apart, freed
  // blocks fragmented the free space: in replay of the training traces in stream order this took
  // gpt_seqlen_b5 from 1.042x of demand to 1.024x and hf_llama_train from 1.070x to 1.023x, with
  // best fit over both sets (take_cached).
  auto fenced_free = [&](const Block* n) {
    return n != nullptr && n->state == BlockState::free && n->free_hook.is_linked();
  };
  bool took_free = false;
  if (Block* p = b->prev; same_stream(p)) {
    set.erase(set.iterator_to(*p));
    fq_remove(p);
    p->epoch = std::max(p->epoch, b->epoch);
    p->free_event = FreeEvents::later(p->free_event, b->free_event);
    heap_.absorb_next(p);
    b = p;
  } else if (fenced_free(p)) {
    heap_.free_blocks().erase(heap_.free_blocks().iterator_to(*p));
    stats_.bytes_pending += p->size;
    p->state = BlockState::pending;
    p->stream = b->stream;
    p->epoch = b->epoch;
    p->free_event = b->free_event;  // fenced: only b's free is still running
    heap_.absorb_next(p);
    b = p;
    took_free = true;
  }
  if (Block* n = b->next; same_stream(n)) {
    set.erase(set.iterator_to(*n));
    fq_remove(n);
    b->epoch = std::max(b->epoch, n->epoch);
    b->free_event = FreeEvents::later(b->free_event, n->free_event);
    heap_.absorb_next(b);
  } else if (fenced_free(n)) {
    heap_.free_blocks().erase(heap_.free_blocks().iterator_to(*n));
    stats_.bytes_pending += n->size;
    heap_.absorb_next(b);
    took_free = true;
  }
  if (took_free) note_free_changed();
  return b;
}

bool DevicePool::drain_large_caches() noexcept {
  if (config_.large_cache == 0) return false;
  bool moved = false;
  for (auto& a : arenas_) {
    std::lock_guard arena_lock(a->mu);
    Block* blocks[LargeCache::kMaxParked];
    const std::size_t n = a->large.drain(blocks);
    if (n == 0) continue;
    a->parked_bytes.store(0, std::memory_order_relaxed);
    std::lock_guard lock(mu_);
    for (std::size_t i = 0; i < n; ++i) to_device_pending(blocks[i]);
    moved = true;
  }
  return moved;
}

void DevicePool::promote_arenas(std::uint64_t epoch) noexcept {
  for (auto& a : arenas_) {
    if (!a->has_pending.load(std::memory_order_relaxed)) continue;
    std::lock_guard lock(a->mu);
    ArenaChunks chunks(*this, *a, nullptr);
    a->small.promote(epoch, chunks);
    a->refresh_pending(epoch);
  }
}

bool DevicePool::drop_arena_stream_caches() noexcept {
  bool pending = drain_large_caches();
  for (auto& a : arenas_) {
    std::lock_guard lock(a->mu);
    a->small.drop_stream_caches();
    a->refresh_pending(completed_epoch_.load(std::memory_order_acquire));
    pending = pending || a->has_pending.load(std::memory_order_relaxed);
  }
  return pending;
}

void DevicePool::release_arena_chunks(bool drop_stream_caches) noexcept {
  // Parked large blocks join the fence queue first, so that the fence below covers them.
  if (drop_stream_caches) drain_large_caches();
  std::uint64_t target;
  {
    std::lock_guard lock(mu_);
    target = epoch_.fetch_add(1);
    const std::uint64_t start = monotonic_ns();
    const Status synced = backend_.synchronize(device_);
    ++stats_.fence_syncs;
    stats_.fence_sync_ns += monotonic_ns() - start;
    if (synced != Status::ok) return;
    note_fence_completed(target);
    promote(target);
  }
  for (auto& a : arenas_) {
    std::lock_guard lock(a->mu);
    if (drop_stream_caches) a->small.drop_stream_caches();
    ArenaChunks chunks(*this, *a, nullptr);
    a->small.promote(target, chunks);
    a->small.release_empty(chunks);
    a->refresh_pending(target);
  }
}

Block* DevicePool::ArenaChunks::take_chunk(std::size_t size) noexcept {
  return pool_.take_chunk(arena_, size, outcome_);
}

void DevicePool::ArenaChunks::return_chunks(Block* const* blocks, std::size_t n) noexcept {
  pool_.return_chunks(blocks, n);
}

Block* DevicePool::take_chunk(Arena& a, std::size_t size, Outcome* outcome) noexcept {
  std::lock_guard lock(mu_);
  Block* b = nullptr;
  Outcome scratch;
  if (allocate_chunk(size, &b, outcome != nullptr ? outcome : &scratch) != Status::ok) {
    return nullptr;
  }
  b->small_chunk = true;
  b->arena = a.id;
  b->requested = size;
  b->stream = kAnyStream;
  return b;
}

Status DevicePool::allocate_chunk(std::size_t size, Block** out, Outcome* outcome) noexcept {
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (Block* b = take_from(chunks_, chunks_.free_blocks(), size, false)) {
      ++stats_.cache_hits;
      *out = b;
      return Status::ok;
    }
    // The chunk's memory comes fresh, in an address space of its own; if the large heap holds a
    // handle lying idle, that handle goes back to the driver first, so that the chunk takes its
    // place rather than adding to what the pool holds. In replay of hf_llama_generate the small
    // pool took 2 MiB chunks fresh while the large heap held 230 MiB free, and each raised peak
    // reserved. A handle cannot move between the two heaps (chunks are one granule each); giving
    // back a larger one costs its release and a later create if the large heap misses again,
    // which then holds no more than it would have.
    // Memory waiting for its fence is fenced first when that is cheap, so that it can be idle.
    fence_locked_if_cheap();
    if (heap_.idle_bound() >= size) heap_.release_one(size);
    LargeHeap::Growth g;
    const Status s = chunks_.grow(size, fresh_allowance(), out, &g);
    sync_physical();
    if (s == Status::ok) {
      ++stats_.fresh;
      outcome->how = ServedBy::fresh;
      return Status::ok;
    }
    // No fresh memory: the large heap's idle handles go back to the driver, then retry.
    if (attempt == 0 && trim_locked(0, outcome) == 0) break;
  }
  return Status::out_of_memory;
}

void DevicePool::return_chunks(Block* const* blocks, std::size_t n) noexcept {
  std::lock_guard lock(mu_);
  for (std::size_t i = 0; i < n; ++i) {
    blocks[i]->small_chunk = false;
    chunks_.make_free(blocks[i]);  // every slot was fenced before the chunk came back
  }
  // A chunk the arenas no longer keep goes back to the driver at once (one handle, about 14 us
  // on an H200): held idle in the chunks' own address space it could serve no large block, and
  // the large heap creates what it needs instead.
  if (n != 0) {
    chunks_.release(chunks_.idle_bytes());
    sync_physical();
  }
}

// The device path for a chunk is fresh memory: chunks_ gives its idle handles back as soon as a
// chunk returns (return_chunks), so it holds no fenced chunk to offer, and the large heap's free
// blocks live in another address space. Measured in replay before this rule (when the large
// heap's free blocks counted as an offer): hf_llama_generate's growing KV-cache sizes took a
// fresh 2 MiB chunk for each new size while 4 MiB of small objects were live, and reserved rose
// to 1.57x of demand.
bool DevicePool::ArenaChunks::fence_for_chunk(std::size_t) noexcept {
  return pool_.fence_arena(arena_);
}

}  // namespace gpustitch::detail
