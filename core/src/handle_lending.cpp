// Handle lending: the pool serves a program that maps device memory itself with the VMM API.
//
// XLA (JAX 0.11), PyTorch's expandable segments, NCCL's cuMem buffers and vLLM never call
// cuMemAlloc: they create physical handles (cuMemCreate), map them into address ranges of their
// own and release them (cuMemRelease). The pool cannot hand such a program a pointer, but it can
// hand it a handle. A cuMemCreate of S bytes may be answered with an idle handle of exactly S bytes
// the pool holds (lend_handle), and the program's cuMemRelease of a handle returns it to the pool's
// cache instead of the driver (take_back_handle). Memory the program frees then stays in the
// process for the pool's own blocks and the program's next cuMemCreate of that size, and it is
// what cooperative release can give a neighbour, instead of going back to the driver and coming
// back from it.
//
// Which handles may be lent: spares only, handles the pool holds unmapped (backing.h). A spare
// was unmapped where it lay in a fenced free block, or was never mapped, so no work queued before
// can touch it: it is fenced as the pool fences. Handles mapped inside free blocks are not lent:
// taking one out would cut the block (LargeHeap's business), and the spares are what the
// program's own releases fill. Exactly the asked size, since a handle is mapped whole (a larger
// one would show the program a different size in cuMemGetAllocationPropertiesFromHandle and a
// cuMemMap of the whole handle would map more than it asked for).
//
// Which properties must match: a lent handle must have everything the program asked for (same
// kind of handle, every handle type it may export, RDMA when asked, the same compression); a
// handle the pool takes back must have exactly the pool's own properties, so that every handle
// the pool holds is one it could have created. The caller (the preload library) refuses anything
// else before asking (pinned memory on a device location, flags 0); this file checks the rest
// against Backend::handle_properties.
//
// Accounting: a lent handle leaves the pool's books (bytes_reserved, handles) while the program
// holds it, and shows in handles_lent/bytes_lent; the preload library counts it as memory the
// program maps itself and, of that, served by the pool, so no byte is counted twice. Taking a
// handle back adds it to bytes_reserved (as a spare, it is cached memory) unless the pool's cap
// leaves no room, in which case the caller releases it to the driver.
//
// Locks: the device lock, as every other change of the books; no backend call is made here (a
// lend and a take-back only move a handle between the program and the pool), but the unmap of a
// lent spare's old place if the reclaimer has not made it yet (retired_mappings.h).
#include <new>

#include "backing.h"
#include "device_pool.h"
#include "gpustitch/pool.h"

namespace gpustitch {
namespace detail {
namespace {

// Orders handles against a size alone (the spare index orders by size, then by node address).
struct SizeKey {
  bool operator()(const Handle& h, std::size_t size) const noexcept { return h.size < size; }
  bool operator()(std::size_t size, const Handle& h) const noexcept { return size < h.size; }
};

// Whether a handle with properties `have` has everything `wanted` asks for.
bool has_wanted(const HandleProperties& have, const HandleProperties& wanted) noexcept {
  return have.driver_handles == wanted.driver_handles &&
         (wanted.handle_types & ~have.handle_types) == 0 &&
         (!wanted.rdma_capable || have.rdma_capable) && have.compression == wanted.compression;
}

}  // namespace

Handle* Backing::detach_spare(std::size_t size) noexcept {
  auto it = spares_.lower_bound(size, SizeKey{});  // the first spare of at least `size`
  if (it == spares_.end() || it->size != size) return nullptr;
  Handle* h = &*it;
  // The program gets a handle the pool no longer maps anywhere (its old place unmapped now if the
  // reclaimer has not done it yet).
  if (settle([&](DevPtr, std::size_t, PhysHandle id) { return id == h->id; }) != Status::ok) {
    return nullptr;
  }
  spares_.erase(it);
  held_bytes_ -= h->size;
  --count_;
  return h;
}

void Backing::adopt_spare(Handle* h) noexcept {
  h->at = 0;
  spares_.insert(*h);
  held_bytes_ += h->size;
  ++count_;
}

Status DevicePool::lend_handle(std::size_t size, const HandleProperties& wanted,
                               PhysHandle* out) noexcept {
  HandleProperties have;
  if (backend_.handle_properties(device_, &have) != Status::ok || !has_wanted(have, wanted)) {
    return Status::not_supported;
  }
  std::lock_guard lock(mu_);
  if (!usable_) return Status::not_supported;
  if (size == 0 || size % granularity_ != 0) return Status::invalid_value;
  Backing& backing = heap_.backing();
  Handle* h = backing.detach_spare(size);
  if (h == nullptr) return Status::out_of_memory;
  try {
    lent_.emplace(h->id, size);
  } catch (...) {
    backing.adopt_spare(h);  // no host memory for the entry: lend nothing
    return Status::out_of_memory;
  }
  *out = h->id;
  delete h;
  lent_bytes_ += size;
  ++lends_;
  sync_physical();
  return Status::ok;
}

bool DevicePool::take_back_handle(PhysHandle handle, std::size_t size,
                                  const HandleProperties& created_with) noexcept {
  HandleProperties have;
  const bool same =
      backend_.handle_properties(device_, &have) == Status::ok && have == created_with;
  std::lock_guard lock(mu_);
  // A handle the pool lent is not the pool's any more, whether it comes back or goes to the driver.
  if (auto it = lent_.find(handle); it != lent_.end()) {
    lent_bytes_ -= it->second;
    lent_.erase(it);
  }
  if (!same || !usable_ || size == 0 || size % granularity_ != 0) return false;
  if (size > fresh_allowance()) return false;  // the cap: the pool may hold no more
  auto* h = new (std::nothrow) Handle;
  if (h == nullptr) return false;
  h->id = handle;
  h->size = size;
  heap_.backing().adopt_spare(h);
  ++taken_back_;
  sync_physical();
  return true;
}

void DevicePool::add_lending_stats(DeviceStats* s) const noexcept {
  std::lock_guard lock(mu_);
  s->handles_lent = lent_.size();
  s->bytes_lent = lent_bytes_;
  s->lends = lends_;
  s->handles_taken_back = taken_back_;
}

}  // namespace detail

Status Pool::lend_handle(int device, std::size_t size, const HandleProperties& wanted,
                         PhysHandle* out) noexcept {
  if (out == nullptr) return Status::invalid_value;
  detail::DevicePool* dp = this->device(device);
  return dp == nullptr ? Status::invalid_device : dp->lend_handle(size, wanted, out);
}

bool Pool::take_back_handle(int device, PhysHandle handle, std::size_t size,
                            const HandleProperties& created_with) noexcept {
  detail::DevicePool* dp = this->device(device);
  return dp != nullptr && dp->take_back_handle(handle, size, created_with);
}

}  // namespace gpustitch
