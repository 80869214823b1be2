// The pool of one device.
//
// Where an allocation comes from, in order:
//   1. small requests (< small_limit) go to the small-object pool (small_pool.h), which takes
//      whole chunks from here;
//   2. a block the thread's arena parked (large_cache.h), without the device lock;
//   3. a cached block: best fit among fenced free blocks of the device's address space (or among
//      blocks the same stream freed, which stream order makes safe at once), cut at 512 B;
//      max_split_size keeps oversize blocks for large requests, as PYTORCH_CUDA_ALLOC_CONF's
//      max_split_size_mb does;
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
// Thread safety: one lock per device (a std::mutex; the arenas use HybridLock) guards everything
// here but the arenas (lock order: arena, then device); backend calls on the slow paths (create,
// map, move) run under it, as cudaMalloc does in PyTorch's allocator. Observer callbacks run
// after the mutex is released.
#include "device_pool.h"

#include <algorithm>
#include <ctime>
#include <thread>

namespace gpustitch::detail {
namespace {

// The arena whose allocate_small is asking for a chunk, and where to report its events.
thread_local Arena* tl_arena = nullptr;
thread_local Outcome* tl_chunk_outcome = nullptr;

// Arena choice: a thread takes, at its first small allocation, the arena index with the fewest
// threads, and gives it back at exit, so that two threads on two cores never share one arena while
// another sits unused (round-robin did, once threads come and go). The index is the same for every
// device pool; each pool has arena_slots() arenas.
constexpr unsigned kMaxArenas = 8;
unsigned arena_slots() {
  static const unsigned n = std::max(1u, std::min(kMaxArenas, std::thread::hardware_concurrency()));
  return n;
}
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

constexpr std::size_t kLargeBuffer = 20 * MiB;   // PyTorch's slack for oversize blocks
constexpr std::uint64_t kCheapFenceNs = 50'000;  // a fence this fast means an idle device
constexpr std::uint64_t kFenceSample = 8;        // an arena times one fence in 8
constexpr std::uint64_t kInlineFenceNs = 300;    // an arena fence cheaper than the device path
constexpr std::size_t kFenceBatch = 8;           // blocks of one size an arena keeps for one fence
constexpr std::size_t kMinBlock = 512;           // large blocks are cut at 512 B, as PyTorch's

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
  o.move = config.stitching;
  o.max_split_size = config.max_split_size;
  return o;
}

void atomic_max(std::atomic<std::uint64_t>& a, std::uint64_t v) {
  std::uint64_t cur = a.load(std::memory_order_relaxed);
  while (cur < v && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}

std::uint64_t monotonic_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000ull +
         static_cast<std::uint64_t>(ts.tv_nsec);
}

std::uint64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000ull +
         static_cast<std::uint64_t>(ts.tv_nsec);
}

}  // namespace

DevicePool::DevicePool(Backend& backend, const Config& config, int device, PoolObserver* observer)
    : backend_(backend),
      config_(config),
      device_(device),
      observer_(observer),
      heap_(backend, device, heap_options(backend, config, device), &node_pool_),
      chunks_(backend, device, chunk_heap_options(backend, device), &node_pool_),
      reclaimer_([this] { return fence_pass(); }) {
  granularity_ = backend_.granularity(device_);
  std::size_t free = 0, total = 0;
  usable_ = granularity_ != 0 && backend_.mem_info(device_, &free, &total) == Status::ok &&
            heap_.init(total) == Status::ok && chunks_.init(total / 2) == Status::ok;
  total_ = total;
  last_device_free_ = free;
  for (unsigned i = 0; i < arena_slots(); ++i) {
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

void DevicePool::sync_physical() noexcept {
  stats_.bytes_reserved = heap_.reserved_bytes() + chunks_.reserved_bytes();
  stats_.bytes_mapped = heap_.mapped_bytes() + chunks_.mapped_bytes();
  stats_.handles = heap_.handle_count() + chunks_.handle_count();
  stats_.views = heap_.span_count() + chunks_.span_count();
  stats_.peak_reserved = std::max(stats_.peak_reserved, stats_.bytes_reserved);
  window_reserved_ = std::max(window_reserved_, stats_.bytes_reserved);
}

std::size_t DevicePool::fresh_allowance() const noexcept {
  const std::size_t cap = cap_bytes();
  const std::size_t held = heap_.reserved_bytes() + chunks_.reserved_bytes();
  return held >= cap ? 0 : cap - held;
}

std::size_t DevicePool::cap_bytes() const noexcept {
  std::size_t cap = SIZE_MAX;
  if (config_.cap != 0) cap = config_.cap;
  if (config_.cap_fraction > 0.0 && total_ != 0) {
    cap =
        std::min(cap, static_cast<std::size_t>(config_.cap_fraction * static_cast<double>(total_)));
  }
  return cap;
}

// ---------------------------------------------------------------------------------------------
// Allocation
//
// allocate() does not count an out-of-memory itself: the Pool may still retry (its out-of-memory
// handler, e.g. cooperative release), and only the failure the caller finally sees counts, once,
// through note_out_of_memory().

void DevicePool::note_out_of_memory(std::size_t size) noexcept {
  Outcome outcome;
  {
    std::lock_guard lock(mu_);
    ++stats_.ooms;
    backend_.mem_info(device_, &last_device_free_, nullptr);
    outcome.add(make_event(EventKind::oom, size, 0));
  }
  emit(outcome);
}

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
  for (int attempt = 0; attempt < 2; ++attempt) {
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
                                : allocate_large(size, rounded, stream, &b, outcome, owner, grow);
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
      if (status != Status::out_of_memory || attempt == 1) break;
    }
    // Out of memory with the large pool alone: fence small frees and take back empty chunks
    // (the arena locks come before the device lock, so this happens outside it), then retry.
    release_arena_chunks(true);
  }
  emit(*outcome);
  return status;
}

void DevicePool::note_peak() noexcept {
  const std::uint64_t now = stats_.bytes_allocated + arena_allocated();
  atomic_max(peak_.allocated, now);
  atomic_max(peak_.window, now);
  // Written under the device lock only: a plain increment, no locked instruction.
  peak_.gen.store(peak_.gen.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
}

// An arena-served allocation adds to the total without the device lock. Summing every arena's
// counter on each one would pull the other threads' cache lines on the hot path, so the sum is
// taken only when this arena holds more than when it last summed, or when the device pool has
// allocated since (peak_.gen). Between two device-path allocations the device's share only
// shrinks, so with one allocating thread at a time this finds every peak; with threads racing it
// may miss a momentary one (as a snapshot of per-thread counters can anyway).
void DevicePool::note_peak_arena(Arena& a) noexcept {
  const std::uint64_t mine = a.bytes_allocated.load(std::memory_order_relaxed);
  const std::uint64_t gen = peak_.gen.load(std::memory_order_relaxed);
  if (gen == a.peak_gen && mine <= a.peak_high) return;
  a.peak_gen = gen;
  a.peak_high = mine;
  const std::uint64_t now = peak_.device_allocated.load(std::memory_order_relaxed) + arena_allocated();
  atomic_max(peak_.allocated, now);
  atomic_max(peak_.window, now);
}

// A reset restarts the window at what is allocated now and bumps the generation, so that every
// arena sums again at its next allocation (its own high mark belongs to the old window).
void DevicePool::reset_peak_allocated() noexcept {
  std::lock_guard lock(mu_);
  peak_.window.store(stats_.bytes_allocated + arena_allocated(), std::memory_order_relaxed);
  peak_.gen.store(peak_.gen.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
}

void DevicePool::reset_peak_reserved() noexcept {
  std::lock_guard lock(mu_);
  window_reserved_ = stats_.bytes_reserved;
}

// No driver query (unlike stats()): PyTorch reads these on every memory_stats().
PeakWindow DevicePool::peaks_since_reset() const noexcept {
  std::lock_guard lock(mu_);
  PeakWindow w;
  w.allocated = std::max(peak_.window.load(std::memory_order_relaxed),
                         stats_.bytes_allocated + arena_allocated());
  w.reserved = std::max(window_reserved_, stats_.bytes_reserved);
  return w;
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

bool DevicePool::has_pending() const noexcept {
  return fq_head_ != nullptr || arenas_pending();
}

Arena& DevicePool::arena_for_thread() noexcept {
  if (tl_arena_index == UINT32_MAX) tl_arena_index = assign_arena_index();
  return *arenas_[tl_arena_index % arenas_.size()];
}

Status DevicePool::allocate_small(std::size_t size, Stream stream, DevPtr* out,
                                  Outcome* outcome) noexcept {
  Arena& a = arena_for_thread();
  std::lock_guard lock(a.mu);
  tl_arena = &a;
  tl_chunk_outcome = outcome;
  SmallAlloc s = a.small.allocate(size, stream, *this);
  tl_arena = nullptr;
  tl_chunk_outcome = nullptr;
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
      to_device_pending(b);
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
void DevicePool::to_device_pending(Block* b) noexcept {
  b->arena_owned = false;
  b->state = BlockState::pending;
  fq_push(b);
  stats_.bytes_pending += b->size;
  if (b->stream != kAnyStream) stream_free_[b->stream].insert(b);
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
    tl_arena = a.get();
    a->small.promote(epoch, *this);
    tl_arena = nullptr;
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
    if (backend_.synchronize(device_) != Status::ok) return;
    atomic_max(completed_epoch_, target);
    promote(target);
  }
  for (auto& a : arenas_) {
    std::lock_guard lock(a->mu);
    if (drop_stream_caches) a->small.drop_stream_caches();
    tl_arena = a.get();
    a->small.promote(target, *this);
    a->small.release_empty(*this);
    tl_arena = nullptr;
    a->refresh_pending(target);
  }
}

Status DevicePool::allocate_large(std::size_t size, std::size_t rounded, Stream stream, Block** out,
                                  Outcome* outcome, Arena* owner, bool grow) noexcept {
  (void)size;
  auto cached = [&] {
    Block* b = take_cached(rounded, stream);
    if (b == nullptr) return false;
    ++stats_.cache_hits;
    outcome->how = ServedBy::cache;
    *out = b;
    return true;
  };
  if (cached()) return Status::ok;
  // The three steps below fence rather than grow. A request that comes to grow
  // (grow_rather_than_fence) skips them, and fences only if the device has no memory left.
  if (!grow) {
    // Memory waiting for its fence: fence here instead of taking more memory if that is cheap,
    // i.e. the last fence found the device idle (a tight allocate/free loop with cudaFree
    // semantics), or if the pool fences only on demand. A busy device is left to the reclaimer.
    if (fq_head_ != nullptr && fence_is_cheap(last_fence_ns_.load(std::memory_order_relaxed))) {
      fence_locked();
      if (cached()) return Status::ok;
    }
    // Much memory waiting for its fence (the program runs ahead of the device, freeing as it goes):
    // wait for the device rather than grow the pool by what is about to come back anyway.
    // Stream-ordered allocations (cudaMallocAsync) never make the host wait.
    if (stream == kAnyStream && fq_head_ != nullptr && stats_.bytes_pending >= rounded &&
        stats_.bytes_pending * 8 >= stats_.bytes_reserved) {
      fence_locked();
      if (cached()) return Status::ok;
    }
    // Blocks this thread parked with cudaFree semantics that are too small for the request: before
    // the heap maps anything, they join the fence queue (and, on an idle device, come back
    // fenced), so that they merge with their neighbours and their handles can move.
    if (owner != nullptr && stream == kAnyStream && owner->large.parked_count() != 0 &&
        unpark_to_device(*owner, kAnyStream, 0) != 0 &&
        fence_is_cheap(last_fence_ns_.load(std::memory_order_relaxed))) {
      fence_locked();
      if (cached()) return Status::ok;
    }
  }
  // Before fresh memory is taken for a cudaMalloc, memory waiting for its fence that could
  // cover it is waited for, once it is more than 1/64 of the pool: on the H200, GPT training with
  // PyTorch's cache off held 0.5-1.5 GiB more at its peak when it grew instead (18.6 GiB with
  // every miss fenced, 19.1-19.8 GiB without). Idle memory elsewhere is moved first (no fresh
  // memory, no wait); a stream-ordered allocation never waits.
  if (stream == kAnyStream && fq_head_ != nullptr && stats_.bytes_pending >= rounded / 2 &&
      stats_.bytes_pending * 64 >= stats_.bytes_reserved) {
    if (grow_heap(rounded, out, outcome, /*fresh=*/false)) return Status::ok;
    fence_locked();
    if (cached()) return Status::ok;
  }
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (grow_heap(rounded, out, outcome)) return Status::ok;
    // No memory to back it: memory still waiting for its fence is the cheapest to get back.
    if (has_pending()) {
      fence_locked();
      if (cached() || grow_heap(rounded, out, outcome)) return Status::ok;
    }
    // Give idle handles back to the driver and retry: handles too large to fit the gap (or, with
    // stitching off, any idle handle) come back as fresh memory of the right size. PyTorch's
    // free-cache-and-retry.
    if (attempt == 0 && trim_locked(0, outcome) == 0) break;
  }
  return Status::out_of_memory;
}

bool DevicePool::grow_heap(std::size_t rounded, Block** out, Outcome* outcome,
                           bool fresh) noexcept {
  LargeHeap::Growth g;
  const Status s = heap_.grow(rounded, fresh ? fresh_allowance() : 0, out, &g);
  sync_physical();  // a failed grow may still have moved handles (they stay spares)
  note_free_changed();
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
      if (Block* b = take_from(heap_, it->second, rounded, true)) return b;
    }
  }
  return take_from(heap_, heap_.free_blocks(), rounded, false);
}

Block* DevicePool::take_from(LargeHeap& heap, FreeSet& set, std::size_t rounded,
                             bool pending) noexcept {
  Block probe;
  probe.size = rounded;
  probe.ptr = 0;
  const std::size_t max_split = config_.max_split_size;
  auto it = set.lower_bound(&probe);
  if (it == set.end()) return nullptr;
  Block* b = *it;
  if (rounded < max_split && b->size >= max_split) return nullptr;
  if (rounded >= max_split && b->size >= rounded + kLargeBuffer) return nullptr;
  // Oversize blocks are used whole (max_split_size); others are cut at the request.
  const std::size_t cut = b->size >= max_split ? b->size : rounded;
  set.erase(it);
  Block* rest = b->size > cut ? heap.split(b, cut) : nullptr;  // nullptr: used whole
  if (rest != nullptr) {
    if (pending) {
      // The remainder stays queued for its fence, right where b was, and reusable by the stream.
      fq_insert_after(b, rest);
      set.insert(rest);
    } else {
      heap.free_blocks().insert(rest);
    }
  }
  if (pending) {
    stats_.bytes_pending -= b->size;  // b's share; the remainder stays pending
    fq_remove(b);
  }
  b->state = BlockState::allocated;
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
  to_device_pending(b);
  return true;
}

// ---------------------------------------------------------------------------------------------
// Fencing

void DevicePool::promote(std::uint64_t epoch) noexcept {
  while (fq_head_ != nullptr && fq_head_->epoch <= epoch) {
    Block* b = fq_head_;
    fq_remove(b);
    stats_.bytes_pending -= b->size;
    if (b->stream != kAnyStream) {
      auto it = stream_free_.find(b->stream);
      if (it != stream_free_.end()) it->second.erase(b);
    }
    make_free(b);
  }
}

// Fences the large pool only: the arenas' locks come before the device lock.
void DevicePool::fence_locked() noexcept {
  const std::uint64_t target = epoch_.fetch_add(1);
  const std::uint64_t start = monotonic_ns();
  if (backend_.synchronize(device_) == Status::ok) {
    atomic_max(completed_epoch_, target);
    promote(target);
  }
  last_fence_ns_.store(monotonic_ns() - start, std::memory_order_relaxed);
}

bool DevicePool::fence_pass() noexcept {
  std::uint64_t target;
  {
    std::lock_guard lock(mu_);
    if (!has_pending()) return false;
    target = epoch_.fetch_add(1);
  }
  // The device is waited for without the lock: allocations and frees go on meanwhile.
  const std::uint64_t start = monotonic_ns();
  if (backend_.synchronize(device_) != Status::ok) return false;
  last_fence_ns_.store(monotonic_ns() - start, std::memory_order_relaxed);
  atomic_max(completed_epoch_, target);
  promote_arenas(target);
  Outcome outcome;
  bool more = false;
  // Returns whether idle memory above the release threshold sits parked in the arenas.
  auto settle = [&] {
    std::lock_guard lock(mu_);
    promote(target);
    maybe_release_locked(&outcome);
    more = has_pending();
    return release_wanted_locked() && parked_bytes() != 0;
  };
  // Parked memory above the threshold is brought here (the arena locks come first, so outside
  // the device lock) and what the fence covered is released.
  if (settle() && drain_large_caches()) settle();
  emit(outcome);
  return more;
}

void DevicePool::drain_pending() noexcept {
  // Under the locks nothing new is freed before the fence, so one fence covers every free.
  release_arena_chunks(true);
}

bool DevicePool::release_wanted_locked() const noexcept {
  return config_.release_threshold != SIZE_MAX &&
         stats_.bytes_reserved - stats_.bytes_allocated - arena_allocated() >
             config_.release_threshold;
}

void DevicePool::maybe_release_locked(Outcome* outcome) noexcept {
  if (release_wanted_locked()) trim_locked(config_.release_threshold, outcome);
}

std::size_t DevicePool::trim_locked(std::size_t keep, Outcome* outcome) noexcept {
  const std::size_t reserved_before = stats_.bytes_reserved;
  const std::size_t handles_before = stats_.handles;
  auto cached = [&] {
    const std::size_t held = heap_.reserved_bytes() + chunks_.reserved_bytes();
    const std::size_t used = stats_.bytes_allocated + arena_allocated();
    return held > used ? held - used : 0;
  };
  heap_.retry_failed();
  chunks_.retry_failed();
  std::erase_if(stream_free_, [](const auto& entry) { return entry.second.empty(); });
  // Spares first, then idle handles (wholly inside free blocks), until `keep` is left.
  while (cached() > keep &&
         (chunks_.release_one(cached() - keep) != 0 || heap_.release_one(cached() - keep) != 0)) {
  }
  sync_physical();
  note_free_changed();
  const std::size_t released = reserved_before - stats_.bytes_reserved;
  if (released != 0) {
    ++stats_.trims;
    stats_.trimmed_bytes += released;
    outcome->add(make_event(EventKind::trim, released, handles_before - stats_.handles));
  }
  return released;
}

std::size_t DevicePool::trim(Outcome* outcome) noexcept {
  release_arena_chunks(true);
  std::size_t released;
  {
    std::lock_guard lock(mu_);
    released = trim_locked(0, outcome);
  }
  emit(*outcome);
  return released;
}

// Cooperative release (another process is about to run out of memory on this GPU): unlike trim,
// which empties the whole cache under one lock hold, this gives back about `bytes`, one handle per
// lock hold, choosing the smallest idle handle that covers what is still wanted (else the
// largest), so that little more than asked leaves the cache and the program's own allocations
// never wait for more than one unmap+release. Pending memory is fenced once, without the lock,
// only when fenced memory is not enough.
std::size_t DevicePool::release_one_locked(std::size_t wanted) noexcept {
  heap_.retry_failed();
  chunks_.retry_failed();
  std::size_t got = chunks_.release_one(wanted);
  if (got == 0) got = heap_.release_one(wanted);
  sync_physical();
  note_free_changed();
  return got;
}

std::size_t DevicePool::release_idle(std::size_t bytes) noexcept {
  if (bytes == 0) return 0;
  std::size_t released = 0;
  std::size_t handles_released = 0;
  bool fenced = false;
  while (released < bytes) {
    std::size_t got;
    bool pending;
    {
      std::lock_guard lock(mu_);
      if (!usable_) break;
      const std::size_t handles_before = stats_.handles;
      got = release_one_locked(bytes - released);
      handles_released += handles_before - stats_.handles;
      pending = has_pending();
    }
    released += got;
    if (got != 0) continue;
    if (fenced) break;
    // Slots held in streams' small caches are reusable by their stream alone: queue them for the
    // fence too, so that the pass below can give their chunks back.
    pending = drop_arena_stream_caches() || pending;
    if (!pending) break;
    fenced = true;
    fence_pass();  // waits for the device without the lock, then makes fenced memory free
  }
  if (released != 0) {
    Outcome outcome;
    {
      std::lock_guard lock(mu_);
      ++stats_.trims;
      stats_.trimmed_bytes += released;
      outcome.add(make_event(EventKind::trim, released, handles_released));
    }
    emit(outcome);
  }
  return released;
}

// ---------------------------------------------------------------------------------------------
// Chunks for the small pool

Block* DevicePool::take_chunk(std::size_t size) noexcept {
  std::lock_guard lock(mu_);
  Block* b = nullptr;
  Outcome scratch;
  Outcome* outcome = tl_chunk_outcome != nullptr ? tl_chunk_outcome : &scratch;
  if (allocate_chunk(size, &b, outcome) != Status::ok) return nullptr;
  b->small_chunk = true;
  b->arena = tl_arena != nullptr ? tl_arena->id : 0;
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
bool DevicePool::fence_for_chunk(std::size_t) noexcept {
  return tl_arena != nullptr && fence_arena(*tl_arena);
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

std::size_t DevicePool::largest_possible_locked(std::size_t device_free,
                                                bool exact) const noexcept {
  const std::size_t cap = cap_bytes();
  std::size_t headroom = stats_.bytes_reserved >= cap ? 0 : cap - stats_.bytes_reserved;
  headroom = std::min(headroom, device_free) / granularity_ * granularity_;
  // Idle handles serve a request by moving (stitching on) or by being released and created
  // again at the right size (trim and retry); pending and parked memory once fenced.
  std::size_t idle =
      exact ? heap_.idle_bytes() + chunks_.idle_bytes() : heap_.idle_bound() + chunks_.idle_bound();
  if (config_.stitching) idle += stats_.bytes_pending + parked_bytes();
  return std::max(heap_.largest_free(), headroom + idle);
}

DeviceStats DevicePool::stats() const noexcept {
  std::size_t device_free = 0, device_total = 0;
  const bool have_info = backend_.mem_info(device_, &device_free, &device_total) == Status::ok;
  DeviceStats s;
  std::uint64_t arena_bytes = 0, parked = 0;
  for (const auto& a : arenas_) {
    std::lock_guard lock(a->mu);
    parked += a->large.parked_bytes();
    s.allocs += a->allocs;
    s.frees += a->frees;
    s.cache_hits += a->cache_hits;
    s.bytes_requested += a->bytes_requested;
    s.live_blocks += a->live_blocks;
    arena_bytes += a->bytes_allocated.load(std::memory_order_relaxed);
    for (int i = 0; i < kHistogramBuckets; ++i) {
      s.hist_allocs[i] += a->hist_allocs[i];
      s.hist_live[i] += a->hist_live[i];
    }
  }
  std::lock_guard lock(mu_);
  const DeviceStats small = s;
  s = stats_;
  s.allocs += small.allocs;
  s.frees += small.frees;
  s.cache_hits += small.cache_hits;
  s.bytes_requested += small.bytes_requested;
  s.live_blocks += small.live_blocks;
  s.bytes_allocated += arena_bytes;
  s.bytes_pending += parked;  // parked large blocks: freed, reusable by their stream alone
  for (int i = 0; i < kHistogramBuckets; ++i) {
    s.hist_allocs[i] += small.hist_allocs[i];
    s.hist_live[i] += small.hist_live[i];
  }
  s.peak_allocated = std::max(peak_.allocated.load(std::memory_order_relaxed), s.bytes_allocated);
  if (!have_info) device_free = last_device_free_;
  s.device_free = device_free;
  s.device_total = have_info ? device_total : total_;
  s.bytes_cached = s.bytes_reserved - s.bytes_allocated;
  s.largest_free_block = heap_.largest_free();
  s.largest_possible = usable_ ? largest_possible_locked(device_free, false) : 0;
  return s;
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
    for (const Block* b : set) {
      if (b->state != BlockState::pending || b->stream != stream) {
        return "a stream's pending set holds a block that is not its pending block";
      }
    }
  }
  return {};
}

PoolEvent DevicePool::make_event(EventKind kind, std::uint64_t size,
                                 std::uint64_t pieces) noexcept {
  PoolEvent e{};
  e.kind = kind;
  e.device = device_;
  e.time_ns = now_ns();
  e.size = size;
  e.device_free = last_device_free_;
  e.cached = stats_.bytes_reserved - stats_.bytes_allocated - arena_allocated();
  e.largest_possible = usable_ ? largest_possible_locked(last_device_free_, true) : 0;
  e.pieces = pieces;
  e.fragmentation = stats_.bytes_reserved == 0
                        ? 0.0
                        : 1.0 - static_cast<double>(stats_.bytes_allocated + arena_allocated()) /
                                    static_cast<double>(stats_.bytes_reserved);
  return e;
}

void DevicePool::emit(const Outcome& outcome) noexcept {
  if (observer_ == nullptr) return;
  if (outcome.has_event) observer_->on_event(outcome.event);
  if (outcome.has_event2) observer_->on_event(outcome.event2);
}

void DevicePool::after_fork_child() noexcept {
  reclaimer_.forget_after_fork();
}

}  // namespace gpustitch::detail
