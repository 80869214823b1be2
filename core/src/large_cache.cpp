// Per-arena cache of large frees. See large_cache.h for the design.
#include "large_cache.h"

namespace gpustitch::detail {

LargeCache::LargeCache(std::size_t budget) : budget_(budget) {}

Block* LargeCache::remove_at(std::size_t i) noexcept {
  Block* b = parked_[i];
  for (std::size_t j = i + 1; j < count_; ++j) {
    parked_[j - 1] = parked_[j];
    sizes_[j - 1] = sizes_[j];
  }
  parked_[--count_] = nullptr;
  parked_bytes_ -= b->size;
  b->parked.store(false, std::memory_order_relaxed);
  return b;
}

Block* LargeCache::take(Stream stream, std::size_t rounded, Fenced fenced,
                        std::size_t* unfenced_fits) noexcept {
  *unfenced_fits = 0;
  std::size_t best = kMaxParked;
  for (std::size_t i = count_; i-- > 0;) {  // newest first: among equals, the warmest block
    const std::size_t size = sizes_[i];
    if (size < rounded || size - rounded > rounded / 8) continue;
    const Block* b = parked_[i];
    if ((stream == kAnyStream || b->stream != stream) && !fenced.covers(b)) {
      ++*unfenced_fits;
      continue;
    }
    if (best == kMaxParked || size < sizes_[best]) best = i;
    if (size == rounded) break;
  }
  return best == kMaxParked ? nullptr : remove_at(best);
}

std::size_t LargeCache::park(Block* b, Block** evicted) noexcept {
  std::size_t n = 0;
  if (count_ == kMaxParked || parked_bytes_ + b->size > budget_) {
    // Down to half the bounds at once: one device-lock hold per kMaxParked/2 frees past the bound
    // rather than one per free (a thread whose frees and allocations alternate at random would
    // otherwise sit at the bound, and take the device lock on every other free).
    while (count_ > 0 && (count_ >= kMaxParked / 2 || parked_bytes_ + b->size > budget_ / 2)) {
      evicted[n++] = remove_at(0);
    }
  }
  b->parked.store(true, std::memory_order_relaxed);
  sizes_[count_] = b->size;
  parked_[count_++] = b;
  parked_bytes_ += b->size;
  return n;
}

std::size_t LargeCache::take_for_device(Stream stream, std::size_t rounded, Block** out) noexcept {
  std::size_t n = 0;
  for (std::size_t i = 0; i < count_;) {
    const Block* b = parked_[i];
    const bool larger = b->size > rounded && b->size - rounded > rounded / 8;
    if (b->stream == stream && (larger || (stream == kAnyStream && b->size >= rounded))) {
      out[n++] = remove_at(i);
    } else {
      ++i;
    }
  }
  return n;
}

bool LargeCache::has_unfenced(Fenced fenced) const noexcept {
  for (std::size_t i = 0; i < count_; ++i) {
    if (parked_[i]->stream == kAnyStream && !fenced.covers(parked_[i])) return true;
  }
  return false;
}

std::size_t LargeCache::drain(Block** out) noexcept {
  std::size_t n = 0;
  while (count_ > 0) out[n++] = remove_at(0);
  return n;
}

const Block* LargeCache::parked(DevPtr ptr) const noexcept {
  for (std::size_t i = 0; i < count_; ++i) {
    if (parked_[i]->ptr == ptr) return parked_[i];
  }
  return nullptr;
}

Block* LargeCache::take_live(DevPtr ptr) noexcept {
  return live_.empty() ? nullptr : live_.take(ptr);
}

const Block* LargeCache::live(DevPtr ptr) const noexcept {
  return live_.find(ptr);
}

}  // namespace gpustitch::detail
