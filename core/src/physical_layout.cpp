// Pool::physical_layout: which physical handles lie behind a live block, for CUDA IPC on pool
// memory (preload/src/ipc_export.cpp exports them as file descriptors).
//
// A handle is mapped whole at one place (backing.h), so the handles behind a block are those of
// its heap's Backing that overlap it, side by side in address order; the first may begin before
// the block and the last end after it (a block cut from a larger free one). Read under the device
// lock from the heap's own bookkeeping; nothing is kept on the side. A small-pool slot lies in a
// chunk of the chunks' heap, so the same walk gives the chunk's handles and the slot's offset.
#include <new>

#include "device_pool.h"

namespace gpustitch {

Status Pool::physical_layout(DevPtr ptr, PhysicalLayout* out) const noexcept {
  if (out == nullptr) return Status::invalid_value;
  BlockInfo info;
  if (!find(ptr, &info)) return Status::invalid_value;
  detail::DevicePool* dp = device(info.device);
  if (dp == nullptr) return Status::invalid_value;
  return dp->physical_layout(info.base, info.rounded, out);
}

namespace detail {

Status DevicePool::physical_layout(DevPtr ptr, std::size_t size,
                                   PhysicalLayout* out) const noexcept {
  try {
    out->pieces.clear();
    out->device = device_;
    std::lock_guard lock(mu_);
    const LargeHeap* heap = heap_.contains(ptr)     ? &heap_
                            : chunks_.contains(ptr) ? &chunks_
                                                    : nullptr;
    if (heap == nullptr || size == 0) return Status::invalid_value;
    const Backing& backing = heap->backing();
    Handle* h = backing.handle_at(ptr);
    if (h == nullptr) return Status::invalid_value;
    out->base = h->at;
    out->offset = ptr - h->at;
    DevPtr end = h->at;
    for (; h != nullptr && h->at < ptr + size; h = backing.next(h)) {
      if (h->at != end) return Status::error;  // a hole: not a live block's memory
      out->pieces.push_back({h->id, h->size});
      end = h->end();
    }
    if (end < ptr + size) return Status::error;
    out->size = end - out->base;
  } catch (const std::bad_alloc&) {
    return Status::out_of_memory;
  }
  return Status::ok;
}

}  // namespace detail
}  // namespace gpustitch
