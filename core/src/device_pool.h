// The pool of one device: fencing, the arenas and statistics around the large-block heap
// (large_heap.h). See device_pool.cpp for the design.
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <memory_resource>
#include <mutex>
#include <set>
#include <unordered_map>
#include <vector>

#include "arena.h"
#include "block_table.h"
#include "free_events.h"
#include "gpustitch/backend.h"
#include "gpustitch/config.h"
#include "gpustitch/pool.h"
#include "gpustitch/stats.h"
#include "hybrid_lock.h"
#include "large_heap.h"
#include "pool_types.h"
#include "reclaimer.h"
#include "small_pool.h"

namespace gpustitch::detail {

// Events produced under the lock, delivered to the observer after it is released.
struct Outcome {
  ServedBy how = ServedBy::cache;
  std::size_t size = 0;  // allocate: rounded size; free: the size the caller had asked for
  bool has_event = false;
  PoolEvent event;  // left uninitialised (read only when has_event): off the hot path's stores
  bool has_event2 = false;
  PoolEvent event2;
  void add(const PoolEvent& e) {
    if (!has_event) {
      event = e, has_event = true;
    } else {
      event2 = e, has_event2 = true;
    }
  }
};

class DevicePool final {
 public:
  DevicePool(Backend& backend, const Config& config, int device, PoolObserver* observer);
  ~DevicePool();

  // Does not count out-of-memory: the caller reports the final failure with note_out_of_memory.
  Status allocate(std::size_t size, Stream stream, DevPtr* out, Outcome* outcome) noexcept;
  // Counts an out-of-memory the caller sees and emits its event (with the figures of the moment).
  void note_out_of_memory(std::size_t size) noexcept;
  // Returns invalid_value for pointers this device's pool did not hand out.
  Status deallocate(DevPtr ptr, Stream stream, Outcome* outcome) noexcept;
  bool find(DevPtr ptr, BlockInfo* out) const noexcept;
  std::size_t trim(Outcome* outcome) noexcept;
  std::size_t release_idle(std::size_t bytes) noexcept;
  Status grant_peer_access(int peer) noexcept;
  Status mem_info(std::size_t* free, std::size_t* total) noexcept;
  DeviceStats stats() const noexcept;
  // High-water marks since the last reset (Pool::peaks_since_reset).
  PeakWindow peaks_since_reset() const noexcept;
  void reset_peak_allocated() noexcept;
  void reset_peak_reserved() noexcept;
  Status memory_map(std::vector<MappedSegment>* out) const noexcept;  // memory_map.cpp
  // The handles behind [ptr, ptr+size) of a live block (physical_layout.cpp).
  Status physical_layout(DevPtr ptr, std::size_t size, PhysicalLayout* out) const noexcept;
  void drain_pending() noexcept;
  std::string validate() const;  // Pool::validate

  // Handle lending (handle_lending.cpp; Pool::lend_handle, Pool::take_back_handle).
  Status lend_handle(std::size_t size, const HandleProperties& wanted, PhysHandle* out) noexcept;
  bool take_back_handle(PhysHandle handle, std::size_t size,
                        const HandleProperties& created_with) noexcept;
  void add_lending_stats(DeviceStats* s) const noexcept;

  void lock() noexcept { mu_.lock(); }
  void unlock() noexcept { mu_.unlock(); }
  void after_fork_child() noexcept;

 private:
  using FreeSet = LargeHeap::FreeSet;
  // What an allocation that leaves its locks waits for: the reclaimer's fence of `epoch`, or,
  // sooner, the device running past the free of `event` (0: none), then it retries.
  struct FenceWait {
    std::uint64_t epoch = 0;  // 0: no wait
    Event event = 0;
  };

  // --- allocation paths (lock held) ---
  // owner: the calling thread's arena (its lock held) when the block will be registered there.
  // grow: skip fencing for memory that is about to come back (grow_rather_than_fence).
  // *wait_for_fence (if given) set, with out_of_memory: wait for the reclaimer's fence of that
  // epoch (or the event's completion) without the locks (wait_for_reclaimer), then retry.
  Status allocate_large(std::size_t size, std::size_t rounded, Stream stream, Block** out,
                        Outcome* outcome, Arena* owner = nullptr, bool grow = false,
                        FenceWait* wait_for_fence = nullptr) noexcept;
  Block* take_cached(std::size_t rounded, Stream stream) noexcept;
  // Whether take_cached would cut the stream's own pending block inside a coarse handle
  // (stream_cut_fence); *own: that block.
  bool own_cut_pins(std::size_t rounded, Stream stream, Block** own) noexcept;
  // Where the event of own's free has completed: own, and every block its stream freed before it
  // still pending, become free (as a fence would make them); returns whether it had.
  bool free_if_device_ran_past(Block* own) noexcept;
  // Whether the fenced free set has a smaller fit for `rounded` than the stream's own block `own`
  // (then best fit takes from the free set).
  bool free_fit_is_smaller(const Block& own, std::size_t rounded) noexcept;
  // Best fit in `set` (heap's free blocks, or a stream's pending ones), cut at the request.
  Block* take_from(LargeHeap& heap, FreeSet& set, std::size_t rounded, bool pending) noexcept;
  // A chunk for the small-object pool, from chunks_ (lock held).
  Status allocate_chunk(std::size_t size, Block** out, Outcome* outcome) noexcept;
  // The heap's miss path, with its bookkeeping: moved handles count as a stitch.
  // fresh false: only spare and moved handles, no fresh memory. stream: the request's
  // (kAnyStream: cudaMalloc semantics), which decides the fresh handles' sizes.
  bool grow_heap(std::size_t rounded, Stream stream, Block** out, Outcome* outcome,
                 bool fresh = true) noexcept;
  std::size_t fresh_allowance() const noexcept;  // bytes the cap still allows
  // What the pool holds outside very large live blocks (LargeHeap::mark_allocated): the base of the
  // "how much is waiting for a fence" ratios. A 115 GiB block allocated first (the end-to-end
  // benchmark's balloon) otherwise kept pending memory below 1/64 of reserved for the whole run,
  // so no miss waited for it and the pool grew instead: GPT training held 18.9-19.0 GiB on the
  // H200 where the same trace replays to 18.3 (replay fences at once, so it did not show there).
  std::size_t working_reserved() const noexcept {
    return stats_.bytes_reserved - std::min(stats_.bytes_reserved, heap_.exempt_live_bytes());
  }
  void sync_physical() noexcept;  // stats_ from the heap's figures
  void mark_allocated(Block* b, std::size_t requested, Stream stream) noexcept;

  // --- block bookkeeping ---
  void make_free(Block* b) noexcept;  // coalesce and insert into the free set
  void note_free_changed() noexcept;  // after the free set changed: refreshes largest_free_
  void fq_push(Block* b) noexcept;
  void fq_insert_after(Block* pos, Block* b) noexcept;
  void fq_remove(Block* b) noexcept;

  // --- fencing (see reclaimer.cpp) ---
  bool has_pending() const noexcept;  // lock held
  bool arenas_pending() const noexcept;
  // Lock held: frees that no completed fence covers yet (the pending ones, except with
  // reclaim:ordered, where covered memory stays pending until an allocation makes it free).
  bool has_unfenced() const noexcept;
  // Unlocked. promote_large: what the fence covered in the large pool becomes free here (not on
  // the reclaimer thread with reclaim:ordered).
  bool fence_pass(bool promote_large = true) noexcept;
  // Reclaimer thread: unmaps moved handles' old places (retired_mappings.h); returns whether
  // more wait.
  bool unmap_retired() noexcept;
  void fence_locked() noexcept;  // slow path: fence with the lock held
  // Fences with the lock held if memory waits for a fence and the last fence found the device
  // idle (fence_is_cheap); returns whether it fenced.
  bool fence_locked_if_cheap() noexcept;
  // Lock held: where reclaim:inline fences on the allocating thread. fenced: every free so far is
  // now free memory (fenced here where that is cheap, or, with reclaim:ordered, covered by the
  // reclaimer's fences); wait: with reclaim:ordered, *wait_for_fence is set and the caller waits
  // for that fence without the locks (wait_for_reclaimer), then retries; none: nothing done here.
  enum class FenceStep : std::uint8_t { none, fenced, wait };
  FenceStep fence_step(FenceWait* wait_for_fence) noexcept;
  void promote(std::uint64_t epoch) noexcept;
  // No lock held: waits, for kMaxFenceWait at most, until a completed fence covers wait.epoch
  // (or wait.event has completed), then promotes what the fences covered.
  void wait_for_reclaimer(const FenceWait& wait) noexcept;
  // False from a wait that ran out until its fence completes: no allocation waits meanwhile.
  bool may_wait_for_fence() const noexcept;
  void note_fence_completed(std::uint64_t epoch) noexcept;  // any lock: wakes the waiters
  static constexpr std::chrono::milliseconds kMaxFenceWait{200};
  // How often a wait with an event asks it (about a microsecond a query on the GPU).
  static constexpr std::chrono::microseconds kEventPoll{50};
  std::size_t trim_locked(std::size_t keep, Outcome* outcome) noexcept;
  std::size_t release_one_locked(std::size_t wanted) noexcept;
  bool release_wanted_locked() const noexcept;  // idle cached memory above release_threshold
  void maybe_release_locked(Outcome* outcome) noexcept;

  // --- small objects and the arenas' large caches (arena.h, large_cache.h) ---
  Arena& arena_for_thread() noexcept;
  Status allocate_small(std::size_t size, Stream stream, DevPtr* out, Outcome* outcome) noexcept;
  // Frees a small slot or a large block of a's live table (parking it within the bounds).
  bool free_in_arena(Arena& a, DevPtr ptr, Stream stream, Outcome* outcome) noexcept;
  bool free_in_arena_locked(Arena& a, DevPtr ptr, Stream stream, Outcome* outcome) noexcept;
  // Frees a large block of live_ (the arenas' large caches off; device lock NOT held).
  bool free_device_block(DevPtr ptr, Stream stream, Outcome* outcome) noexcept;
  // a's lock held: a parked block of stream for the request, moved to a's live table.
  // *grow: none was taken, and the device path should take more memory rather than fence for
  // the fitting ones (grow_rather_than_fence).
  bool take_parked(Arena& a, std::size_t size, std::size_t rounded, Stream stream, DevPtr* out,
                   Outcome* outcome, bool* grow) noexcept;
  // a's lock held: which of a's parked blocks a completed fence covers.
  LargeCache::Fenced fenced(const Arena& a) const noexcept;
  // a's lock held: fences the device for a's parked blocks, without the device lock, if the device
  // looked idle at the last fence (or the pool fences only on demand); false if it did not.
  bool fence_arena(Arena& a) noexcept;
  // Whether a request whose `unfenced` fitting parked blocks all wait for a fence should rather
  // take one more block, so that one later fence covers several (a's lock held).
  bool grow_rather_than_fence(const Arena& a, std::size_t unfenced,
                              std::size_t rounded) const noexcept;
  // a's lock held: fences as fence_arena does, unless a's fences cost more than the device path
  // and the device pool holds a fenced block of `bytes` (then the caller takes that instead).
  bool fence_rather_than_device(Arena& a, std::size_t bytes) noexcept;
  // Whether to fence inline after a fence that took last_fence_ns: the device looked idle, or the
  // pool fences only on demand.
  bool fence_is_cheap(std::uint64_t last_fence_ns) const noexcept;
  // a's lock and the device lock held: LargeCache::take_for_device into the fence queue.
  std::size_t unpark_to_device(Arena& a, Stream stream, std::size_t rounded) noexcept;
  void park(Arena& a, Block* b) noexcept;  // a's lock held
  // Device lock and b's arena lock (if any) held. at_free: called on the freeing thread at the
  // free, where the free's event is recorded (free_events.h).
  void to_device_pending(Block* b, bool at_free = false) noexcept;
  // b, pending on its stream, absorbs its neighbours pending on the same stream (out of `set`
  // and the fence queue) and its fenced free ones (out of the heap's free set); returns the
  // merged block, in neither.
  Block* merge_stream_pending(FreeSet& set, Block* b) noexcept;
  bool drain_large_caches() noexcept;  // device lock NOT held; true if any moved
  std::uint64_t parked_bytes() const noexcept;
  void promote_arenas(std::uint64_t epoch) noexcept;            // device lock NOT held
  void release_arena_chunks(bool drop_stream_caches) noexcept;  // device lock NOT held
  bool drop_arena_stream_caches() noexcept;        // device lock NOT held; true if slots now wait
  std::uint64_t arena_allocated() const noexcept;  // small slots and arena-held large blocks
  void note_peak() noexcept;                       // lock held
  void note_peak_arena(Arena& a) noexcept;         // a's lock held, device lock not needed

  // --- chunks for one arena's small pool: take the device lock themselves ---
  // The ChunkSource an arena's small pool draws on while the arena's lock is held: which arena
  // asks, and where the events of a fresh chunk go, travel with the call (no thread-locals).
  class ArenaChunks final : public ChunkSource {
   public:
    ArenaChunks(DevicePool& pool, Arena& arena, Outcome* outcome) noexcept
        : pool_(pool), arena_(arena), outcome_(outcome) {}
    Block* take_chunk(std::size_t size) noexcept override;
    void return_chunks(Block* const* blocks, std::size_t n) noexcept override;
    bool fence_for_chunk(std::size_t size) noexcept override;

   private:
    DevicePool& pool_;
    Arena& arena_;
    Outcome* outcome_;  // nullptr: events of the chunk path are dropped (promotion, release)
  };
  Block* take_chunk(Arena& a, std::size_t size, Outcome* outcome) noexcept;
  void return_chunks(Block* const* blocks, std::size_t n) noexcept;

  void emit(const Outcome& outcome) noexcept;
  PoolEvent make_event(EventKind kind, std::uint64_t size, std::uint64_t pieces) noexcept;
  // exact: count the idle handles (a walk over every handle: for events); else a bound from the
  // free blocks alone (for stats(), which the replay and the publisher read all the time).
  std::size_t largest_possible_locked(std::size_t device_free, bool exact) const noexcept;
  std::size_t cap_bytes() const noexcept;

  Backend& backend_;
  const Config& config_;
  const int device_;
  PoolObserver* observer_;
  // std::mutex, not HybridLock: with two threads hammering one device's large blocks, the
  // futex-parking mutex kept 2.2 M pairs/s on the H200 host where HybridLock fell to 1.55 M/s.
  mutable std::mutex mu_;
  bool usable_ = false;
  std::size_t granularity_ = 0;
  std::size_t total_ = 0;

  std::pmr::unsynchronized_pool_resource node_pool_;
  LargeHeap heap_;  // large blocks
  // The small-object pool's chunks, in an address space of their own: long-lived 2 MiB chunks
  // among large blocks would cut up the free space large blocks merge into (as expandable
  // segments keep a small pool apart). Its idle handles go back on trim like the heap's.
  LargeHeap chunks_;
  // Per stream, its pending blocks; an emptied set is kept for the stream's next free (trim
  // drops the empty ones).
  std::pmr::unordered_map<Stream, FreeSet> stream_free_{&node_pool_};
  FreeEvents free_events_;  // events of stream-ordered frees (stream_cut_fence)
  BlockTable live_;         // large blocks allocated outside the arenas
  // The largest free block (fenced, anyone's), readable without mu_: an arena whose fitting
  // parked block still waits for a fence asks the device pool first when it may have one.
  std::atomic<std::size_t> largest_free_{0};
  Block* fq_head_ = nullptr;
  Block* fq_tail_ = nullptr;
  std::atomic<std::uint64_t> epoch_{1};
  // The latest epoch a completed fence closed: every free stamped with it or before is safe for
  // anyone. Read without the device lock by the arenas (their parked blocks).
  std::atomic<std::uint64_t> completed_epoch_{0};
  std::atomic<std::uint64_t> last_fence_ns_{UINT64_MAX};  // how long the last fence waited
  // Allocations waiting for a fence (wait_for_reclaimer) sleep on fence_cv_; fence_wait_mu_ is
  // taken by nothing else (a leaf, below every other lock).
  std::mutex fence_wait_mu_;
  std::condition_variable fence_cv_;
  std::atomic<std::uint64_t> waits_given_up_until_{0};  // the epoch of a wait that ran out
  std::atomic<int> fence_waiters_{0};  // threads in wait_for_reclaimer (notified only if any)
  std::vector<std::unique_ptr<Arena>> arenas_;
  DeviceStats stats_;  // its peak_allocated is unused: peak_allocated_ below
  // Handles lent out (handle_lending.cpp), with their sizes; guarded by mu_. A node-based map:
  // a lend whose entry cannot be allocated is refused, never half done.
  std::unordered_map<PhysHandle, std::size_t> lent_;
  std::uint64_t lent_bytes_ = 0;
  std::uint64_t lends_ = 0;
  std::uint64_t taken_back_ = 0;
  // Peak tracking without the device lock (arena-served large allocations): stats_'s
  // bytes_allocated mirrored for readers without the lock, the peak, and a generation bumped at
  // every device-path allocation (see note_peak_arena). Own cache line: read on the arena path.
  struct alignas(64) Peak {
    std::atomic<std::uint64_t> device_allocated{0};
    std::atomic<std::uint64_t> allocated{0};
    std::atomic<std::uint64_t> gen{0};
    // The same peak since the last reset_peak_allocated (starts with the lifetime one).
    std::atomic<std::uint64_t> window{0};
  };
  Peak peak_;
  std::uint64_t window_reserved_ = 0;  // peak reserved since reset_peak_reserved (lock held)
  std::size_t last_device_free_ = 0;
  Reclaimer reclaimer_;
};

}  // namespace gpustitch::detail
