// RetiredMappings: see retired_mappings.h for the design.
#include "retired_mappings.h"

#include <thread>

namespace gpustitch::detail {

bool RetiredMappings::add(DevPtr at, std::size_t size, PhysHandle handle) noexcept {
  for (Entry& e : entries_) {
    const std::uint8_t s = e.state.load(std::memory_order_acquire);
    if (s == kUnmapped) collect(e);
    if (e.state.load(std::memory_order_relaxed) != kEmpty) continue;
    e.at = at;
    e.size = size;
    e.handle = handle;
    e.state.store(kWaiting, std::memory_order_relaxed);
    ++live_;
    return true;
  }
  return false;
}

std::size_t RetiredMappings::waiting() const noexcept {
  std::size_t n = 0;
  if (live_ == 0) return 0;
  for (const Entry& e : entries_) {
    const std::uint8_t s = e.state.load(std::memory_order_relaxed);
    n += s == kWaiting || s == kFailed;
  }
  return n;
}

std::size_t RetiredMappings::claim(std::span<Claim> out) noexcept {
  std::size_t n = 0;
  if (live_ == 0) return 0;
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    Entry& e = entries_[i];
    const std::uint8_t s = e.state.load(std::memory_order_acquire);
    if (s == kUnmapped) {
      collect(e);
    } else if ((s == kWaiting || s == kFailed) && n < out.size()) {
      out[n++] = Claim{static_cast<std::uint16_t>(i), e.at, e.size};
      e.state.store(kClaimed, std::memory_order_relaxed);
    }
  }
  return n;
}

void RetiredMappings::finish(const Claim& claim, Status unmapped) noexcept {
  // Release: a thread that sees kUnmapped also sees the driver's unmap as done.
  entries_[claim.index].state.store(unmapped == Status::ok ? kUnmapped : kFailed,
                                    std::memory_order_release);
}

void RetiredMappings::forget_claims() noexcept {
  for (Entry& e : entries_) {
    if (e.state.load(std::memory_order_relaxed) == kClaimed) {
      e.state.store(kWaiting, std::memory_order_relaxed);
    }
  }
}

void RetiredMappings::collect(Entry& e) noexcept {
  e.state.store(kEmpty, std::memory_order_relaxed);
  e.at = 0;
  e.size = 0;
  e.handle = 0;
  --live_;
}

void RetiredMappings::wait_for(Entry& e) const noexcept {
  // The reclaimer holds no lock while it unmaps, and finishes each claim right after its call:
  // the wait is one driver call, or a few of a batch.
  while (e.state.load(std::memory_order_acquire) == kClaimed) std::this_thread::yield();
}

}  // namespace gpustitch::detail
