// Pool pins: a freed block kept out of reuse while another process still maps its memory.
//
// Why. CUDA IPC on pool memory (preload/src/ipc_export.cpp) hands another process the physical
// handles behind a block. CUDA keeps physical memory alive while anyone maps it, but the pool
// would reuse a freed block's memory for the next allocation of this process, and the importer
// would then read and write someone else's bytes. A pinned block's free is therefore deferred.
//
// How, without touching the device pools: a pin is a count per block base in a map of the Pool,
// guarded by pins_mu_. deallocate() of a pinned block only marks it freed and returns ok: the
// block stays allocated in its device pool (its memory can be neither reused nor released, its
// bytes count as allocated), find() hides it, and a second free of it is invalid_value as for any
// freed pointer. The last unpin() of a freed block performs the real free, with cudaFree semantics
// whatever stream the program freed it on: the importer's work is ordered on no stream of ours,
// and the stream may be gone by then. Nothing of this runs while nothing is pinned: deallocate()
// and find() read one atomic counter first.
//
// pins_mu_ is a shared mutex: lookups (every free and find while something is pinned) share it,
// only pin, unpin and a deferred free take it alone. Lock order: pins_mu_ is never held while
// calling into a device pool or the pinned-free handler, so the handler may unpin and an unpin may
// free.
#include <mutex>
#include <new>
#include <shared_mutex>

#include "gpustitch/pool.h"

namespace gpustitch {

Status Pool::pin(DevPtr base) noexcept {
  BlockInfo info;
  if (!find(base, &info) || info.base != base) return Status::invalid_value;
  try {
    std::lock_guard lock(pins_mu_);
    Pin& p = pins_[base];
    if (p.freed) return Status::invalid_value;  // freed since find(): not live any more
    if (p.count++ == 0) pinned_.fetch_add(1, std::memory_order_acq_rel);
  } catch (const std::bad_alloc&) {
    return Status::out_of_memory;
  }
  return Status::ok;
}

void Pool::unpin(DevPtr base) noexcept {
  bool free_now = false;
  {
    std::lock_guard lock(pins_mu_);
    auto it = pins_.find(base);
    if (it == pins_.end() || it->second.count == 0) return;
    if (--it->second.count != 0) return;
    free_now = it->second.freed;
    pins_.erase(it);
    pinned_.fetch_sub(1, std::memory_order_acq_rel);
  }
  if (free_now) deallocate_now(base, kAnyStream);
}

void Pool::set_pinned_free_handler(PinnedFreeHandler handler, void* context) noexcept {
  pinned_free_context_.store(context, std::memory_order_release);
  pinned_free_handler_.store(handler, std::memory_order_release);
}

bool Pool::defer_pinned_free(DevPtr ptr, Status* status) noexcept {
  {
    std::shared_lock look(pins_mu_);  // the common case: ptr is not pinned
    if (pins_.find(ptr) == pins_.end()) return false;
  }
  {
    std::lock_guard lock(pins_mu_);
    auto it = pins_.find(ptr);
    if (it == pins_.end()) return false;
    if (it->second.freed) {
      *status = Status::invalid_value;  // freed twice
      return true;
    }
    it->second.freed = true;
  }
  *status = Status::ok;
  if (PinnedFreeHandler h = pinned_free_handler_.load(std::memory_order_acquire)) {
    h(ptr, pinned_free_context_.load(std::memory_order_acquire));
  }
  return true;
}

bool Pool::pinned_and_freed(DevPtr ptr) const noexcept {
  std::shared_lock lock(pins_mu_);
  auto it = pins_.find(ptr);
  return it != pins_.end() && it->second.freed;
}

}  // namespace gpustitch
