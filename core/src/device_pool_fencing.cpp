// DevicePool's fence queue: frees of the large pool wait here, stamped with a fence epoch, until
// a device fence (the reclaimer thread's pass, or an allocation that needs the memory) covers
// them; the arenas fence their own queues (device_pool_arenas.cpp). See reclaimer.cpp for the
// thread.
#include "device_pool.h"

#include "device_pool_internal.h"

namespace gpustitch::detail {

bool DevicePool::has_pending() const noexcept {
  return fq_head_ != nullptr || arenas_pending();
}

void DevicePool::promote(std::uint64_t epoch) noexcept {
  while (fq_head_ != nullptr && fq_head_->epoch <= epoch) {
    Block* b = fq_head_;
    fq_remove(b);
    stats_.bytes_pending -= b->size;
    if (b->stream != kAnyStream) {
      auto it = stream_free_.find(b->stream);
      if (it != stream_free_.end() && b->free_hook.is_linked()) {
        it->second.erase(it->second.iterator_to(*b));
      }
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

}  // namespace gpustitch::detail
