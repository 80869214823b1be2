// DevicePool's fence queue: frees of the large pool wait here, stamped with a fence epoch, until
// a device fence (the reclaimer thread's pass, or an allocation that needs the memory) covers
// them; the arenas fence their own queues (device_pool_arenas.cpp). See reclaimer.cpp for the
// thread.
#include "device_pool.h"

#include <algorithm>
#include <array>
#include <span>

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
    note_fence_completed(target);
    promote(target);
  }
  const std::uint64_t took = monotonic_ns() - start;
  last_fence_ns_.store(took, std::memory_order_relaxed);
  ++stats_.fence_syncs;
  stats_.fence_sync_ns += took;
}

bool DevicePool::fence_locked_if_cheap() noexcept {
  if (fq_head_ == nullptr || !fence_is_cheap(last_fence_ns_.load(std::memory_order_relaxed))) {
    return false;
  }
  fence_locked();
  return true;
}

bool DevicePool::has_unfenced() const noexcept {
  if (!config_.ordered_fences) return has_pending();
  return (fq_tail_ != nullptr &&
          fq_tail_->epoch > completed_epoch_.load(std::memory_order_acquire)) ||
         arenas_pending();
}

// reclaim:ordered gives inline's decisions without its device wait under the lock. Inline mode
// makes freed large blocks free only here (and at the out-of-memory fences), so what a request
// finds depends on the program's calls alone; the default mode also lets the reclaimer thread
// make them free between two calls, whenever its fence completes, which on the GPU moved peak
// reserved from run to run (docs/address-space.md, "Ordered fences"). Ordered mode keeps the
// device wait on the reclaimer thread but the promotion here: covered frees become free at
// once; otherwise the allocation leaves the locks and waits, bounded as a stream miss waits, for
// the fence of the newest free, and retries. Where it may not wait (once per allocation, and not
// after a wait ran out until that fence completes), what is covered becomes free and the rest
// waits, as in the default mode.
DevicePool::FenceStep DevicePool::fence_step(FenceWait* wait_for_fence) noexcept {
  if (fence_locked_if_cheap()) return FenceStep::fenced;
  if (fq_head_ == nullptr || !config_.ordered_fences) return FenceStep::none;
  const std::uint64_t done = completed_epoch_.load(std::memory_order_acquire);
  if (done < fq_tail_->epoch && wait_for_fence != nullptr) {
    wait_for_fence->epoch = fq_tail_->epoch;
    return FenceStep::wait;
  }
  const bool all = done >= fq_tail_->epoch;
  promote(done);
  return all ? FenceStep::fenced : FenceStep::none;
}

void DevicePool::note_fence_completed(std::uint64_t epoch) noexcept {
  atomic_max(completed_epoch_, epoch);
  // Fences come on the allocation path too (a cudaFree loop fences per reuse): without waiters
  // this costs a fence, not a lock. The two fences pair with the waiter's: either it counted
  // itself before this load, or its check after counting sees the new epoch.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (fence_waiters_.load(std::memory_order_relaxed) == 0) return;
  // The waiters' mutex is taken so that a waiter between its check and its sleep cannot miss
  // this notification.
  { std::lock_guard lock(fence_wait_mu_); }
  fence_cv_.notify_all();
}

bool DevicePool::may_wait_for_fence() const noexcept {
  return waits_given_up_until_.load(std::memory_order_relaxed) <=
         completed_epoch_.load(std::memory_order_acquire);
}

void DevicePool::wait_for_reclaimer(const FenceWait& wait) noexcept {
  // The wait ends when the fence completes or after kMaxFenceWait, after which the allocation
  // takes fresh memory as it would have: never a hang, whatever the program's streams wait for.
  // A wait that ran out means the device may be waiting for the host (a stream waiting on a
  // value this thread writes later, a peer's NCCL kernel): no allocation waits again until that
  // fence completes, so such a program pays the bound once, not per allocation.
  //
  // The bound is long because a training step's queue is: the first form (an unbounded fence)
  // held HF Llama training at 1.02x of live bytes on the H200; bounded at 1-20 ms it held
  // 1.02-1.11x from run to run, as waits ran out behind long queues.
  //
  // With an event (a stream's cut waiting for its own free: free_events.h) the wait also ends as
  // soon as the device has run past that free, which is sooner than a fence of everything queued
  // up to now: it is polled every kEventPoll, outside every lock. Only a hint (the event may have
  // been recorded again since): the retry asks again under the device lock.
  const std::uint64_t epoch = wait.epoch;
  reclaimer_.kick();
  const std::uint64_t start = monotonic_ns();
  auto fenced = [&] { return completed_epoch_.load(std::memory_order_acquire) >= epoch; };
  bool done = false;
  {
    std::unique_lock lock(fence_wait_mu_);
    fence_waiters_.fetch_add(1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (wait.event == 0) {
      done = fence_cv_.wait_for(lock, kMaxFenceWait, fenced);
    } else {
      const auto deadline = std::chrono::steady_clock::now() + kMaxFenceWait;
      for (;;) {
        if (fenced()) {
          done = true;
          break;
        }
        lock.unlock();
        bool ran_past = false;
        ran_past = backend_.query_event(wait.event, &ran_past) == Status::ok && ran_past;
        lock.lock();
        if (ran_past) {
          done = true;
          break;
        }
        if (std::chrono::steady_clock::now() >= deadline) break;
        fence_cv_.wait_for(lock, kEventPoll, fenced);
      }
    }
    fence_waiters_.fetch_sub(1, std::memory_order_relaxed);
  }
  if (!done) atomic_max(waits_given_up_until_, epoch);
  const std::uint64_t took = monotonic_ns() - start;
  std::lock_guard lock(mu_);
  ++stats_.fence_waits;
  stats_.fence_wait_ns += took;
  if (!done) ++stats_.fence_waits_timed_out;
  promote(completed_epoch_.load(std::memory_order_acquire));
}

bool DevicePool::unmap_retired() noexcept {
  // A batch at a time, so that an allocation waiting for one of them (Backing::map over its
  // place) waits for a few driver calls at most.
  if (config_.unmap != Config::Unmap::background) return false;
  std::array<RetiredMappings::Claim, 16> claims;
  std::size_t n;
  {
    std::lock_guard lock(mu_);
    n = heap_.backing().claim_retired(claims);
  }
  if (n == 0) return false;
  heap_.backing().unmap_claimed(std::span(claims.data(), n));  // without the lock
  std::lock_guard lock(mu_);
  return heap_.backing().retired_waiting() != 0;
}

bool DevicePool::fence_pass(bool promote_large) noexcept {
  // Moved handles' old places first (retired_mappings.h): no device wait, and the allocating
  // thread may need their address space.
  const bool more_unmaps = unmap_retired();
  std::uint64_t target;
  {
    std::lock_guard lock(mu_);
    if (!(promote_large ? has_pending() : has_unfenced())) return more_unmaps;
    target = epoch_.fetch_add(1);
  }
  // The device is waited for without the lock: allocations and frees go on meanwhile.
  const std::uint64_t start = monotonic_ns();
  if (backend_.synchronize(device_) != Status::ok) return false;
  last_fence_ns_.store(monotonic_ns() - start, std::memory_order_relaxed);
  note_fence_completed(target);
  promote_arenas(target);
  Outcome outcome;
  bool more = false;
  // Returns whether idle memory above the release threshold sits parked in the arenas.
  auto settle = [&] {
    std::lock_guard lock(mu_);
    if (promote_large) promote(target);
    maybe_release_locked(&outcome);
    more = promote_large ? has_pending() : has_unfenced();
    return release_wanted_locked() && parked_bytes() != 0;
  };
  // Parked memory above the threshold is brought here (the arena locks come first, so outside
  // the device lock) and what the fence covered is released.
  if (settle() && drain_large_caches()) settle();
  emit(outcome);
  return more || more_unmaps;
}

void DevicePool::drain_pending() noexcept {
  // Under the locks nothing new is freed before the fence, so one fence covers every free.
  release_arena_chunks(true);
}

}  // namespace gpustitch::detail
