// Statistics kept by the pool, per device, and the observer interface through which layers above
// (shared-memory publisher, tracer, allocation-site sampler) watch it.
//
// Counters are plain integers updated under the owning device's lock (or per thread cache and
// merged on snapshot), so keeping them always on costs a few adds per operation.
#pragma once

#include <cstdint>

#include "gpustitch/types.h"

namespace gpustitch {

// Bucket i holds sizes in [2^(i+9), 2^(i+10)) bytes: bucket 0 is < 1 KiB (512 B and below fall
// there too), bucket 31 is >= 1 TiB.
inline constexpr int kHistogramBuckets = 32;

// The pool's calls into the driver's physical-memory API, by kind (DeviceStats::driver_op_*).
enum class DriverOp : int { create = 0, map, set_access, unmap, release };
inline constexpr int kDriverOps = 5;
int histogram_bucket(std::size_t size) noexcept;

struct DeviceStats {
  // Live allocations.
  std::uint64_t bytes_requested = 0;  // as asked by callers
  std::uint64_t bytes_allocated = 0;  // after rounding ("allocated" in PyTorch's terms)
  std::uint64_t live_blocks = 0;
  // Physical memory held from the driver ("reserved"), and how it is used.
  std::uint64_t bytes_reserved = 0;
  std::uint64_t bytes_cached = 0;   // reserved but not allocated (includes pending)
  std::uint64_t bytes_pending = 0;  // freed, waiting for device work to finish before reuse
  std::uint64_t bytes_mapped = 0;   // virtual address space mapped (stitched views alias pieces)
  std::uint64_t handles = 0;        // physical handles held
  std::uint64_t views = 0;          // mapped address ranges (fresh + stitched)
  std::uint64_t largest_free_block = 0;  // largest cached block usable without stitching
  std::uint64_t largest_possible = 0;    // largest allocation that can succeed now
  std::uint64_t peak_allocated = 0;
  std::uint64_t peak_reserved = 0;
  // When reserved last rose to peak_reserved: the memory then waiting for its fence, and the
  // bytes then allocated (before the request that raised it). Memory freed but not yet fenced
  // cannot serve a request or move, so a large share here means the pool grew while the device
  // still ran work queued before frees (on a GPU, the program running ahead of the device).
  std::uint64_t peak_reserved_pending = 0;
  std::uint64_t peak_reserved_allocated = 0;
  std::uint64_t device_free = 0;  // driver's free memory at the last query
  std::uint64_t device_total = 0;
  // Event counts since start.
  std::uint64_t allocs = 0;
  std::uint64_t frees = 0;
  std::uint64_t cache_hits = 0;  // served from cached memory (large blocks and small chunks)
  std::uint64_t fresh = 0;       // served by creating a new physical handle
  std::uint64_t stitches = 0;    // served by stitching cached pieces into a new range
  std::uint64_t stitched_bytes = 0;
  std::uint64_t trims = 0;  // trim passes that released memory
  std::uint64_t trimmed_bytes = 0;
  std::uint64_t ooms = 0;
  // Handles lent to the program's own cuMemCreate (Pool::lend_handle): out now (not counted in
  // bytes_reserved while the program holds them), and since start; handles taken back into the
  // pool's cache when the program released them (lent ones and the program's own).
  std::uint64_t handles_lent = 0;
  std::uint64_t bytes_lent = 0;
  std::uint64_t lends = 0;
  std::uint64_t handles_taken_back = 0;
  // Physical-memory driver calls the pool made (create, map, set access, unmap, release) and the
  // time spent in them since start, whichever thread made them.
  std::uint64_t driver_calls = 0;
  std::uint64_t driver_ns = 0;
  // Of those, the ones the reclaimer thread made (moved handles' old places unmapped there,
  // unmap:background): the rest ran on the threads that allocate.
  std::uint64_t driver_background_calls = 0;
  std::uint64_t driver_background_ns = 0;
  // The allocating threads' share by kind (DriverOp): where the pool's driver time goes.
  std::uint64_t driver_op_calls[kDriverOps] = {};
  std::uint64_t driver_op_ns[kDriverOps] = {};
  // Time the program's threads spent waiting for the device inside the pool: fences run on the
  // calling thread (a miss or a trim fencing the frees it needs, an out-of-memory retry) and
  // allocations that waited for the reclaimer thread's fence (stream_miss_fence), with the waits
  // that ran out (kMaxFenceWait) apart. Not counted: the reclaimer's own fences (its thread), and
  // the fences a cudaFree loop's arena runs on an idle device (the wait native cudaFree makes).
  // With driver_ns minus driver_background_ns, the host time the pool added to the program's
  // threads beyond its bookkeeping.
  std::uint64_t fence_syncs = 0;
  std::uint64_t fence_sync_ns = 0;
  std::uint64_t fence_waits = 0;
  std::uint64_t fence_wait_ns = 0;
  std::uint64_t fence_waits_timed_out = 0;
  // Stream-ordered cuts that would pin a large handle (stream_cut_fence): those the event of the
  // block's free let split the handle with no fence, and those it found still running.
  std::uint64_t cuts_after_event = 0;
  std::uint64_t cuts_event_running = 0;
  std::uint64_t hist_allocs[kHistogramBuckets] = {};  // allocations since start, by size
  std::uint64_t hist_live[kHistogramBuckets] = {};    // live allocations now, by size

  // 1 - allocated/reserved: the figure users already quote from PyTorch.
  double fragmentation() const noexcept {
    return bytes_reserved == 0
               ? 0.0
               : 1.0 - static_cast<double>(bytes_allocated) / static_cast<double>(bytes_reserved);
  }
};

// How an allocation was served.
enum class ServedBy : std::uint8_t { cache = 0, fresh = 1, stitched = 2, small = 3 };
const char* to_string(ServedBy s) noexcept;

enum class EventKind : std::uint32_t { oom = 1, stitch = 2, trim = 3, release = 4 };

struct PoolEvent {
  EventKind kind;
  int device;
  std::uint64_t time_ns;           // CLOCK_REALTIME
  std::uint64_t size;              // oom: requested; stitch: stitched size; trim: bytes released
  std::uint64_t device_free;       // driver free memory at the time
  std::uint64_t cached;            // pool cached bytes at the time
  std::uint64_t largest_possible;  // oom: largest allocation that could have succeeded
  std::uint64_t pieces;            // stitch: pieces stitched; trim: handles released
  double fragmentation;
};

// Watches the pool. Callbacks run on the calling thread, outside the pool's locks, and must be
// cheap and must not call back into the pool's allocate/deallocate.
class PoolObserver {
 public:
  virtual ~PoolObserver() = default;
  virtual void on_allocate(int device, DevPtr ptr, std::size_t size, Stream stream,
                           ServedBy how) noexcept {
    (void)device, (void)ptr, (void)size, (void)stream, (void)how;
  }
  virtual void on_free(int device, DevPtr ptr, std::size_t size, Stream stream) noexcept {
    (void)device, (void)ptr, (void)size, (void)stream;
  }
  virtual void on_event(const PoolEvent& event) noexcept { (void)event; }
  // Physical memory was mapped into (mapped) or unmapped from (!mapped) [ptr, ptr + size) of the
  // device's address space: the segment_map / segment_unmap entries of a memory snapshot's
  // timeline. Unlike the callbacks above this one runs under the device's lock, so that the
  // order observers see is the order the mappings changed (a snapshot replays it backwards from
  // the pool's memory map, memory_map.h): it must be wait-free, allocate nothing and not call
  // into the pool. It comes only on growth, moves and releases, never on a cache hit.
  virtual void on_segment(int device, DevPtr ptr, std::size_t size, bool mapped) noexcept {
    (void)device, (void)ptr, (void)size, (void)mapped;
  }
};

}  // namespace gpustitch
