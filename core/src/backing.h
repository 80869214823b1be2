// The device's physical memory: the handles the pool holds, where each is mapped, and which are
// spares (held, not mapped).
//
// A handle is always mapped whole, at one place: the H200's driver (580) refuses cuMemMap at an
// offset into a handle (tools/gpu/vmm_probe), so whole handles are the unit of physical memory
// the pool can move. Moving a handle (unmap where it lies free, map where memory is needed) costs
// a cuMemUnmap, a cuMemMap and a cuMemSetAccess and no cuMemRelease/cuMemCreate; reserved memory
// does not change. The policy of where handles go is LargeHeap's (large_heap.h); this class only
// performs and books the operations, and keeps a release the driver refused for a retry, still
// counted as held, so that nothing leaks and bytes_reserved never under-counts.
//
// Unmapping a moved handle's old place can be left to the reclaimer thread (retire,
// retired_mappings.h: why, and what keeps it safe).
//
// Not thread-safe: the device lock guards it, but for unmap_claimed, which the reclaimer calls
// without it. No host allocation but the Handle node itself (new(std::nothrow): a failure is an
// out-of-memory like the driver's).
#pragma once

#include <atomic>
#include <boost/intrusive/set.hpp>
#include <chrono>
#include <span>
#include <vector>

#include "gpustitch/backend.h"
#include "gpustitch/stats.h"
#include "pool_types.h"
#include "retired_mappings.h"

namespace gpustitch::detail {

class Backing {
 public:
  struct ByAddress {
    bool operator()(const Handle& a, const Handle& b) const { return a.at < b.at; }
  };
  struct BySize {
    bool operator()(const Handle& a, const Handle& b) const {
      return a.size != b.size ? a.size < b.size : &a < &b;
    }
  };
  using Member = boost::intrusive::member_hook<Handle, AddressHook, &Handle::hook>;
  using MappedIndex = boost::intrusive::set<Handle, Member, boost::intrusive::compare<ByAddress>>;
  using SpareIndex = boost::intrusive::set<Handle, Member, boost::intrusive::compare<BySize>>;

  Backing(Backend& backend, int device) noexcept;
  ~Backing();  // unmaps and releases everything
  Backing(const Backing&) = delete;
  Backing& operator=(const Backing&) = delete;

  // A new spare handle of `size` bytes (cuMemCreate).
  Status create(std::size_t size, Handle** out) noexcept;
  // A spare handle mapped whole at `at` (cuMemMap; access is set by set_access, once per range).
  Status map(Handle* h, DevPtr at) noexcept;
  // A mapped handle unmapped: it becomes a spare.
  Status unmap(Handle* h) noexcept;
  // As unmap, but the driver's unmap is left for unmap_claimed (the reclaimer thread); inline
  // when the table of retired mappings is full. The handle is a spare at once, and can be mapped
  // elsewhere while its old place stays mapped.
  Status retire(Handle* h) noexcept;
  // Retired mappings not yet unmapped, and those no thread has taken yet.
  std::size_t retired() const noexcept { return retired_.live(); }
  std::size_t retired_waiting() const noexcept { return retired_.waiting(); }
  // Takes retired mappings to unmap (lock held), and unmaps them (no lock: the reclaimer).
  std::size_t claim_retired(std::span<RetiredMappings::Claim> out) noexcept {
    return retired_.claim(out);
  }
  void unmap_claimed(std::span<const RetiredMappings::Claim> claims) noexcept;
  // Unmaps every retired mapping now (a trim, teardown); returns the first failure.
  Status settle_retired() noexcept;
  // In a fork child: claims of the parent's reclaimer go back to waiting.
  void after_fork_child() noexcept { retired_.forget_claims(); }
  // Calls fn(at, size) for every retired place not yet unmapped (LargeHeap::validate).
  template <class Fn>
  void for_each_retired(Fn&& fn) const noexcept {
    retired_.for_each([&](DevPtr at, std::size_t size, PhysHandle) { fn(at, size); });
  }
  // A spare handle given back to the driver (cuMemRelease); a refused release is retried later.
  void release(Handle* h) noexcept;
  // Retries releases the driver refused; returns the bytes released.
  std::size_t retry_failed() noexcept;

  // Handle lending (defined in handle_lending.cpp): a spare of exactly `size` bytes taken out of
  // the books (nullptr: none), and a handle node put into them as a spare.
  Handle* detach_spare(std::size_t size) noexcept;
  void adopt_spare(Handle* h) noexcept;

  // Makes [ptr, ptr+size) accessible to this device and its peers (cuMemSetAccess).
  Status set_access(DevPtr ptr, std::size_t size) noexcept;
  // Adds a peer and makes every mapped range accessible to it (undone on failure).
  Status grant_peer(int peer) noexcept;
  bool has_peer(int device) const noexcept;

  // The mapped handle containing ptr; nullptr if none.
  Handle* handle_at(DevPtr ptr) const noexcept;
  // The first mapped handle starting at or after ptr, and the one after h (nullptr: none).
  Handle* first_from(DevPtr ptr) const noexcept;
  Handle* next(Handle* h) const noexcept;
  const SpareIndex& spares() const noexcept { return spares_; }
  const MappedIndex& mapped() const noexcept { return mapped_; }

  std::size_t held_bytes() const noexcept { return held_bytes_; }  // all handles: "reserved"
  std::size_t mapped_bytes() const noexcept { return mapped_bytes_; }
  std::size_t spare_bytes() const noexcept { return held_bytes_ - mapped_bytes_ - failed_bytes_; }
  std::size_t handle_count() const noexcept { return count_; }
  // The driver calls made through this class (create, map, set access, unmap, release) and the
  // time spent in them: what the pool's layout costs, next to what the program does. All of
  // them, and of those the reclaimer thread's (unmap_claimed), off the program's threads.
  std::uint64_t driver_calls() const noexcept {
    return sum(op_calls_) + background_calls_.load(std::memory_order_relaxed);
  }
  std::uint64_t driver_ns() const noexcept {
    return sum(op_ns_) + background_ns_.load(std::memory_order_relaxed);
  }
  std::uint64_t background_calls() const noexcept {
    return background_calls_.load(std::memory_order_relaxed);
  }
  std::uint64_t background_ns() const noexcept {
    return background_ns_.load(std::memory_order_relaxed);
  }
  // By kind, on the calling threads (the background's are all unmaps: background_*): adds them
  // to calls[] and ns[].
  void add_op_counts(std::uint64_t* calls, std::uint64_t* ns) const noexcept {
    for (int i = 0; i < kDriverOps; ++i) {
      calls[i] += op_calls_[i];
      ns[i] += op_ns_[i];
    }
  }

 private:
  Backend& backend_;
  const int device_;
  std::vector<int> access_;  // this device and its peers
  MappedIndex mapped_;
  SpareIndex spares_;
  std::vector<Handle*> failed_;  // releases the driver refused (still held)
  std::size_t held_bytes_ = 0;
  std::size_t mapped_bytes_ = 0;
  std::size_t failed_bytes_ = 0;
  std::size_t count_ = 0;
  std::atomic<std::uint64_t> background_calls_{0};
  std::atomic<std::uint64_t> background_ns_{0};
  RetiredMappings retired_;

  // The calling threads' driver calls and time by kind; their sums are the totals.
  std::uint64_t op_calls_[kDriverOps] = {};
  std::uint64_t op_ns_[kDriverOps] = {};
  static std::uint64_t sum(const std::uint64_t (&by_op)[kDriverOps]) noexcept {
    std::uint64_t total = 0;
    for (std::uint64_t v : by_op) total += v;
    return total;
  }

  template <class Call>
  Status timed(DriverOp op, Call&& call) noexcept;  // one backend call, counted and timed
  // Settles the retired mappings that `match(at, size, handle)` selects (retired_mappings.h).
  template <class Match>
  Status settle(Match&& match) noexcept;
};

template <class Call>
Status Backing::timed(DriverOp op, Call&& call) noexcept {
  const auto t0 = std::chrono::steady_clock::now();
  const Status s = call();
  const auto ns = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count());
  op_ns_[static_cast<int>(op)] += ns;
  ++op_calls_[static_cast<int>(op)];
  return s;
}

template <class Match>
Status Backing::settle(Match&& match) noexcept {
  return retired_.settle(match, [&](DevPtr at, std::size_t size) {
    return timed(DriverOp::unmap, [&] { return backend_.unmap(at, size); });
  });
}

}  // namespace gpustitch::detail
