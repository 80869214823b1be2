// DevicePool giving physical memory back to the driver: trim (empty cache, the release
// threshold, the out-of-memory retry) and cooperative release, which hands idle memory to a
// neighbour process without dropping the caches.
#include "device_pool.h"

#include "device_pool_internal.h"

namespace gpustitch::detail {

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

}  // namespace gpustitch::detail
