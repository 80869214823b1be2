// The stitching pool: the public face of the allocator core. See pool.cpp for the design.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "gpustitch/backend.h"
#include "gpustitch/config.h"
#include "gpustitch/memory_map.h"
#include "gpustitch/stats.h"
#include "gpustitch/types.h"

namespace gpustitch {

struct BlockInfo {
  DevPtr base = 0;          // start of the live allocation
  std::size_t size = 0;     // size the caller asked for
  std::size_t rounded = 0;  // size reserved for it
  int device = -1;
  Stream stream = kAnyStream;  // stream it was allocated on (kAnyStream for cudaMalloc)
};

// High-water marks of allocated and reserved bytes since the last reset (what PyTorch's
// max_memory_allocated/max_memory_reserved read, and reset_peak_memory_stats restarts). The
// lifetime peaks in DeviceStats are never reset.
struct PeakWindow {
  std::uint64_t allocated = 0;
  std::uint64_t reserved = 0;
};

namespace detail {
class DevicePool;
}

// Called when the pool cannot serve an allocation even after trimming its own cache, before the
// failure is reported (RMM's failure_callback_resource_adaptor, one retry). It may free memory
// elsewhere (cooperative release asks other processes on the GPU); returning true makes the pool
// retry once. Runs on the allocating thread with no pool lock held, so it may take time and call
// into the pool (trim, stats) but must not allocate from it.
using OutOfMemoryHandler = bool (*)(int device, std::size_t size, void* context) noexcept;

// The physical memory behind a live block, for sharing it with another process (CUDA IPC): the
// handles mapped side by side over it, each mapped whole (backing.h), from `base` on. The block
// itself starts `offset` bytes into that range.
struct PhysicalLayout {
  struct Piece {
    PhysHandle handle = 0;
    std::size_t size = 0;
  };
  int device = -1;
  DevPtr base = 0;            // where the first handle is mapped
  std::size_t size = 0;       // the pieces' sizes summed
  std::size_t offset = 0;     // block - base
  std::vector<Piece> pieces;  // in address order
};

// Called by deallocate() for a block that is pinned (Pool::pin), after its free was deferred, on
// the freeing thread with no pool lock held. It may call unpin() (which may then free the block).
using PinnedFreeHandler = void (*)(DevPtr base, void* context) noexcept;

class Pool {
 public:
  // backend must outlive the pool. observer may be null; it must outlive the pool.
  Pool(Backend& backend, Config config, PoolObserver* observer = nullptr);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // Allocates size bytes (size 0 gives a unique non-null pointer of the smallest class) on device.
  // stream = kAnyStream for cudaMalloc semantics, a stream for cudaMallocAsync semantics.
  // Returns ok, out_of_memory (only when free physical memory is really short), invalid_device,
  // or not_initialized.
  Status allocate(int device, std::size_t size, Stream stream, DevPtr* out) noexcept;

  // Installs (or, with null, removes) the out-of-memory handler. Set it before serving: a call
  // racing with allocations may see the old handler or the new one, never half of each.
  void set_out_of_memory_handler(OutOfMemoryHandler handler, void* context) noexcept;

  // Frees a pointer allocate() returned. stream = kAnyStream for cudaFree semantics (reusable
  // after device work queued so far completes), a stream for cudaFreeAsync semantics (reusable at
  // once by that stream). Returns invalid_value for a pointer the pool does not own.
  Status deallocate(DevPtr ptr, Stream stream = kAnyStream) noexcept;

  // Whether ptr lies in a live allocation of the pool; fills out if so (interior pointers too).
  bool find(DevPtr ptr, BlockInfo* out = nullptr) const noexcept;

  // Pins: keep a block's memory out of reuse while another process maps it (CUDA IPC, see
  // preload/src/ipc_export.cpp). pin(base) counts one more pin on the live block that starts at
  // base (invalid_value if there is none). While a block is pinned, deallocate() of it succeeds
  // but only defers the free: the block stays allocated (its bytes count as allocated, find() no
  // longer sees it, a second free of it is invalid_value) and the pinned-free handler runs. The
  // last unpin() of a freed block frees it then, with cudaFree semantics (reusable after a fence).
  // Cost when nothing is pinned: one atomic load in deallocate() and find().
  Status pin(DevPtr base) noexcept;
  void unpin(DevPtr base) noexcept;
  void set_pinned_free_handler(PinnedFreeHandler handler, void* context) noexcept;

  // The physical memory behind the live block containing ptr (PhysicalLayout). The handles stay
  // valid while the block is live or pinned. invalid_value for a pointer the pool does not own.
  Status physical_layout(DevPtr ptr, PhysicalLayout* out) const noexcept;

  // Releases idle cached physical memory of device back to the driver (all of it, after waiting
  // for pending frees). Returns the bytes released.
  std::size_t trim(int device) noexcept;

  // Releases idle cached physical memory of device, at least bytes when that much is idle, for
  // another process that needs it (cooperative release). Only wholly free, fenced memory goes:
  // never a live block, never memory still waiting for its fence (one fence is waited for,
  // without the lock, when fenced memory is not enough). The device lock is taken once per
  // released range, so the process's own allocations wait at most one release. Counts as a
  // trim in the statistics. Returns the bytes released.
  std::size_t release_idle(int device, std::size_t bytes) noexcept;

  // Handle lending (handle_lending.cpp): serving a program that maps memory itself with the VMM
  // API (cuMemCreate / cuMemRelease, as XLA does) from the pool's idle physical memory.
  //
  // lend_handle gives the caller an idle handle of exactly `size` bytes that has at least the
  // properties `wanted` asks for (the same driver_handles, every wanted handle type, RDMA when
  // wanted, the same compression), taken out of the pool: from then on it is the caller's, not
  // counted in bytes_reserved but in handles_lent/bytes_lent. Only spare handles are lent (held
  // unmapped, so no pending work can touch them). out_of_memory when no such handle is idle,
  // not_supported when the backend's handles cannot have those properties, invalid_value for a
  // size that is not a multiple of the granularity.
  Status lend_handle(int device, std::size_t size, const HandleProperties& wanted,
                     PhysHandle* out) noexcept;
  // Takes back a handle the caller is done with (released and mapped nowhere): one lent_handle
  // gave, or one the caller created itself with exactly the pool's handle properties
  // (`created_with`). The pool keeps it as an idle spare (its own allocations reuse it, trim and
  // cooperative release give it back to the driver). Returns false, keeping nothing, when the
  // properties differ, the size is not a multiple of the granularity, or the pool's cap leaves
  // no room; the caller then releases the handle to the driver itself.
  bool take_back_handle(int device, PhysHandle handle, std::size_t size,
                        const HandleProperties& created_with) noexcept;

  // Makes every present and future mapping of device's pool accessible from peer too.
  Status grant_peer_access(int device, int peer) noexcept;

  // What an allocation can really get: free = driver free (within the cap) + pool cached.
  Status mem_info(int device, std::size_t* free, std::size_t* total) noexcept;

  // Snapshot of device's statistics (refreshes device_free/largest_possible).
  DeviceStats stats(int device) const noexcept;

  // Peaks since the last reset (zeros for a device the pool does not have), and the resets: each
  // restarts its mark at the current figure, as the driver's memory pools do.
  PeakWindow peaks_since_reset(int device) const noexcept;
  void reset_peak_allocated(int device) noexcept;
  void reset_peak_reserved(int device) noexcept;

  // Checks the pool's invariants on device (every physical byte mapped once and owned by one
  // block, free neighbours merged, the pending sum): empty when they hold, else what broke. For
  // tests; costs a walk over every block.
  std::string validate(int device) const;

  // Appends device's mapped ranges and their blocks to *out (memory_map.h), for memory snapshots.
  // Takes each lock once, briefly; off every allocation path. Returns invalid_device, or
  // out_of_memory when host memory for the copy runs out (*out then holds what was copied).
  Status memory_map(int device, std::vector<MappedSegment>* out) const noexcept;

  // Waits until every pending free has been fenced and is reusable (tests, trim, shutdown).
  void drain_pending(int device) noexcept;

  // Makes the calling thread use arena index (modulo the arenas of each device pool:
  // Config::arenas) of every pool from now on, rather than the least used one it would get at its
  // first small allocation. For threads that stand for another program's (replay's, one per trace
  // thread), which must get the same arenas whatever else runs in the process (tune's replays side
  // by side).
  static void bind_thread_to_arena(unsigned index) noexcept;

  int device_count() const noexcept { return device_count_; }
  const Config& config() const noexcept { return config_; }
  Backend& backend() const noexcept { return backend_; }

  // fork() support: prepare takes every lock, parent/child release them; the child also stops
  // using the reclaimer thread (it does not exist there).
  void atfork_prepare() noexcept;
  void atfork_parent() noexcept;
  void atfork_child() noexcept;

 private:
  detail::DevicePool* device(int device) const noexcept;

  Backend& backend_;
  Config config_;
  PoolObserver* observer_;
  struct OomHandler {
    OutOfMemoryHandler fn;
    void* context;
  };
  std::atomic<const OomHandler*> oom_handler_{nullptr};
  // Every handler ever installed, freed with the pool: a replaced one may still be running on an
  // allocating thread. Guarded by oom_handlers_mu_ (set_out_of_memory_handler is rare).
  std::mutex oom_handlers_mu_;
  std::vector<std::unique_ptr<const OomHandler>> oom_handlers_;
  int device_count_ = 0;
  std::unique_ptr<std::unique_ptr<detail::DevicePool>[]> devices_;

  // Pins (pool_pins.cpp). pinned_ counts the blocks in pins_, read without the lock on the free
  // path; pins_mu_ (shared for lookups, so that frees on many threads do not take turns while
  // something is pinned) is never held while calling into a device pool.
  struct Pin {
    unsigned count = 0;
    bool freed = false;  // deallocate() was called: free it at the last unpin
  };
  std::atomic<std::size_t> pinned_{0};
  mutable std::shared_mutex pins_mu_;
  std::unordered_map<DevPtr, Pin> pins_;
  std::atomic<PinnedFreeHandler> pinned_free_handler_{nullptr};
  std::atomic<void*> pinned_free_context_{nullptr};
  // deallocate()'s check: true when ptr is pinned and its free was deferred (*status says how).
  bool defer_pinned_free(DevPtr ptr, Status* status) noexcept;
  bool pinned_and_freed(DevPtr ptr) const noexcept;
  Status deallocate_now(DevPtr ptr, Stream stream) noexcept;
};

}  // namespace gpustitch
