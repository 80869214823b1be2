// A lock-free "might this address be the pool's?" test, so that calls about memory the pool does
// not own (what the shim only passes through: cuMemGetAddressRange or cuPointerGetAttribute on
// managed memory, cudaFree of a native pointer) answer without taking the device lock.
//
// The address space is cut into 2 MiB regions (the allocation granularity of CUDA devices, so a
// region lies wholly inside or wholly outside every view the pool maps: the test is exact, not
// just conservative, for granularity-aligned views), and a counter per region counts the pool's
// views that touch it. The counters are direct-mapped into a table of 2^17 (256 GiB of address
// space pass before two regions share a counter). A zero counter means no view touches the
// region: the address is not the pool's. Non-zero means "maybe", and the caller looks under the
// lock as before. The table (512 KiB) comes from calloc, so its pages are committed only where
// views are; if it cannot be had, every answer is "maybe".
//
// Why relaxed atomics are enough: a view is added before any pointer into it is handed out and
// removed only after it is unmapped. A thread holding a pool pointer got it through some hand-over
// from the thread that allocated it (or is that thread), so the increment happens-before its load
// and the load sees it. A stale non-zero only costs the locked lookup.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "gpustitch/types.h"

namespace gpustitch::detail {

class AddressFilter {
 public:
  AddressFilter() noexcept
      : counts_(static_cast<std::uint32_t*>(std::calloc(kSlots, sizeof(std::uint32_t)))) {}
  ~AddressFilter() { std::free(counts_); }
  AddressFilter(const AddressFilter&) = delete;
  AddressFilter& operator=(const AddressFilter&) = delete;

  void add(DevPtr base, std::size_t size) noexcept { update(base, size, 1); }
  void remove(DevPtr base, std::size_t size) noexcept { update(base, size, UINT32_MAX); }

  bool may_contain(DevPtr p) const noexcept {
    if (counts_ == nullptr) return true;
    return std::atomic_ref<std::uint32_t>(counts_[slot(p >> kRegionShift)])
               .load(std::memory_order_relaxed) != 0;
  }

 private:
  static constexpr unsigned kRegionShift = 21;  // 2 MiB
  static constexpr std::size_t kSlots = std::size_t{1} << 17;

  static std::size_t slot(std::uint64_t region) noexcept { return region & (kSlots - 1); }

  // delta 1 adds, UINT32_MAX (-1 modulo 2^32) removes.
  void update(DevPtr base, std::size_t size, std::uint32_t delta) noexcept {
    if (counts_ == nullptr || size == 0) return;
    const std::uint64_t first = base >> kRegionShift;
    const std::uint64_t last = (base + size - 1) >> kRegionShift;
    for (std::uint64_t r = first; r <= last; ++r) {
      std::atomic_ref<std::uint32_t>(counts_[slot(r)]).fetch_add(delta, std::memory_order_relaxed);
    }
  }

  std::uint32_t* const counts_;
};

}  // namespace gpustitch::detail
