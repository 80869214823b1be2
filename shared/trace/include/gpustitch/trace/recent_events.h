// The recent allocation events of a live process, for the timeline of its PyTorch memory snapshot
// (`device_traces`, which pytorch.org/memory_viz's "Active Memory Timeline" and torch's
// _memory_viz.trace() read).
//
// RecentEvents is a PoolObserver holding the last `capacity` allocate / free / out-of-memory
// events in a ring preallocated when it is created (GPUSTITCH_CONF=trace_events:N, 10,000 by
// default, 0 = off: not created, nothing paid). Each event keeps what a snapshot entry needs:
// device, address, size as asked, stream, time in microseconds since the epoch (CLOCK_REALTIME,
// as PyTorch's time_us), and for allocations the call site the allocation-site sampler captured
// (0 when it did not sample it). A snapshot converts them with append_device_traces(); a free
// becomes PyTorch's free_requested + free_completed pair (the pool frees at once; memory waiting
// for device work shows in the segments as active_pending_free).
//
// Segment events: physical memory mapped into or unmapped from the device's address space
// (PoolObserver::on_segment: a gap backed on growth, the old places of moved handles, handles
// given back) become PyTorch's segment_map / segment_unmap, as expandable segments write them:
// memory_viz's "Allocator State History" replays them backwards from the snapshot's segments,
// merging neighbours. The pool reports them under its device lock, so they reach the ring in the
// order the mappings changed; append_device_traces() still drops any that the snapshot's segments
// contradict (a mapping changed between the memory map's copy and the ring's read), because
// memory_viz's page stops drawing at the first one that does not fit.
//
// Cost on the allocating thread: one atomic fetch-add for a ticket, one compare-and-swap on a
// 64-byte slot of its own, one clock_gettime (vDSO) and seven relaxed stores; no lock, no
// allocation. The observer runs outside the pool's locks (PoolObserver's contract).
//
// Concurrency: every slot is a seqlock. A writer takes ticket t, marks the slot odd (2t + 1) by a
// compare-and-swap that only succeeds on an older, finished event, stores the fields and
// publishes 2t + 2; a reader keeps an entry only when the slot holds its ticket's even value
// before and after reading the fields, so it never returns a half-written event (entries still
// being written, or overwritten while read, are left out). All fields are atomics, so there is
// no data race for a reader to trip over. Two writers a whole ring apart meet in one slot only
// when one of them stalls for `capacity` events mid-write; the later one then drops its event
// rather than mix fields with it.
//
// fork(): nothing to unlock (there is no lock), so a child can always read the ring. A slot left
// mid-write by a thread that does not exist in the child stays odd: readers skip it, writers
// leave it alone. A child that goes on recording calls forget_unfinished() first to free such
// slots. (The preload library's child stops using the inherited pool, so it records nothing.)
//
// Order: entries are in ticket order, which is the order the events reached the observer. A free
// racing with the next allocation of the same address on another thread may be ticketed after it
// (the same holds for the CSV trace); memory_viz then ends that block early, nothing worse.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "gpustitch/config.h"
#include "gpustitch/stats.h"
#include "gpustitch/trace/snapshot.h"
#include "gpustitch/types.h"

namespace gpustitch::trace {

struct RecentEvent {
  enum class Action : std::uint8_t {
    alloc = 1,
    free = 2,
    oom = 3,
    segment_map = 4,
    segment_unmap = 5
  };
  Action action = Action::alloc;
  int device = 0;
  DevPtr addr = 0;         // oom: 0
  std::uint64_t size = 0;  // bytes as asked (oom: requested)
  Stream stream = kAnyStream;
  std::uint64_t time_us = 0;      // microseconds since the epoch
  std::uint64_t site = 0;         // alloc: the sampler's site id, 0 = not sampled
  std::uint64_t device_free = 0;  // oom: the driver's free memory at the time
};

// The sampled call site of the allocation of ptr that the calling thread is reporting right now,
// or 0. Called on the allocating thread, inside on_allocate; must be cheap and noexcept.
using SiteOfAllocation = std::uint64_t (*)(DevPtr ptr) noexcept;

class RecentEvents final : public PoolObserver {
 public:
  static constexpr std::size_t kMaxCapacity = 10'000'000;  // 640 MB of ring: past any sane use

  // capacity in [1, kMaxCapacity]. Allocates the whole ring now (64 bytes an event); throws
  // std::bad_alloc when it cannot.
  explicit RecentEvents(std::size_t capacity, SiteOfAllocation site_of = nullptr);
  ~RecentEvents() override;
  RecentEvents(const RecentEvents&) = delete;
  RecentEvents& operator=(const RecentEvents&) = delete;

  void on_allocate(int device, DevPtr ptr, std::size_t size, Stream stream,
                   ServedBy how) noexcept override;
  void on_free(int device, DevPtr ptr, std::size_t size, Stream stream) noexcept override;
  void on_event(const PoolEvent& event) noexcept override;  // records out-of-memory events
  void on_segment(int device, DevPtr ptr, std::size_t size, bool mapped) noexcept override;

  // The whole events in the ring, oldest first (at most capacity()). Any thread; never blocks
  // writers. Throws std::bad_alloc only.
  std::vector<RecentEvent> read() const;
  // In a forked child, before recording: empties the slots that threads of the parent were
  // writing at fork(). Only while no other thread records.
  void forget_unfinished() noexcept;

  std::size_t capacity() const noexcept { return capacity_; }
  // Events recorded since creation (kept or since overwritten).
  std::uint64_t recorded() const noexcept { return head_.load(std::memory_order_relaxed); }

 private:
  struct alignas(64) Slot {
    std::atomic<std::uint64_t> seq{0};   // 0: never written; 2t+1: ticket t being written;
                                         // 2t+2: holds ticket t
    std::atomic<std::uint64_t> meta{0};  // action | device << 8
    std::atomic<std::uint64_t> addr{0};
    std::atomic<std::uint64_t> size{0};
    std::atomic<std::uint64_t> stream{0};
    std::atomic<std::uint64_t> time_us{0};
    std::atomic<std::uint64_t> extra{0};  // alloc: site; oom: device_free
  };
  void record(RecentEvent::Action action, int device, DevPtr addr, std::uint64_t size,
              Stream stream, std::uint64_t extra, std::uint64_t time_us) noexcept;

  std::size_t capacity_;
  SiteOfAllocation site_of_;
  std::unique_ptr<Slot[]> slots_;
  alignas(64) std::atomic<std::uint64_t> head_{0};  // next ticket
};

// A ring as configured (trace_events), or null when off (0) or when the ring cannot be allocated
// (*why says so then).
std::unique_ptr<RecentEvents> make_recent_events(const Config& config,
                                                 SiteOfAllocation site_of = nullptr,
                                                 std::string* why = nullptr);

// Appends events to data->device_traces as PyTorch's entries (alloc; free -> free_requested and
// free_completed; oom; segment_map; segment_unmap), growing the per-device list as needed.
// frames_of_site, if set, gives the stack of a sampled site (asked once per site). Segment events
// are checked against data->segments, replayed backwards as memory_viz does: a segment_map whose
// range is not mapped at that point, or a segment_unmap whose range is, is left out.
void append_device_traces(
    const std::vector<RecentEvent>& events,
    const std::function<std::vector<SnapshotFrame>(std::uint64_t site)>& frames_of_site,
    SnapshotData* data);

// Microseconds since the epoch, as the ring stamps events.
std::uint64_t epoch_microseconds() noexcept;

}  // namespace gpustitch::trace
