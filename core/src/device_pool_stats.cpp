// DevicePool's statistics: the figures stats() reports, peak tracking (lifetime peaks, and the
// resettable high-water marks PyTorch's reset_peak_memory_stats restarts), and the events handed to
// the observer after the device lock is released (statistics observe the pool; nothing flows
// back from them).
#include "device_pool.h"

#include <algorithm>

#include "device_pool_internal.h"

namespace gpustitch::detail {

void DevicePool::sync_physical() noexcept {
  stats_.bytes_reserved = heap_.reserved_bytes() + chunks_.reserved_bytes();
  stats_.bytes_mapped = heap_.mapped_bytes() + chunks_.mapped_bytes();
  stats_.handles = heap_.handle_count() + chunks_.handle_count();
  stats_.views = heap_.span_count() + chunks_.span_count();
  if (stats_.bytes_reserved > stats_.peak_reserved) {
    stats_.peak_reserved = stats_.bytes_reserved;
    stats_.peak_reserved_pending = stats_.bytes_pending;
    stats_.peak_reserved_allocated = stats_.bytes_allocated + arena_allocated();
  }
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
  const std::uint64_t now =
      peak_.device_allocated.load(std::memory_order_relaxed) + arena_allocated();
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
  s.driver_calls = heap_.backing().driver_calls() + chunks_.backing().driver_calls();
  s.driver_ns = heap_.backing().driver_ns() + chunks_.backing().driver_ns();
  s.driver_background_calls = heap_.backing().background_calls();
  s.driver_background_ns = heap_.backing().background_ns();
  heap_.backing().add_op_counts(s.driver_op_calls, s.driver_op_ns);
  chunks_.backing().add_op_counts(s.driver_op_calls, s.driver_op_ns);
  s.largest_possible = usable_ ? largest_possible_locked(device_free, false) : 0;
  return s;
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

}  // namespace gpustitch::detail
