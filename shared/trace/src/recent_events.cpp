// RecentEvents: the bounded ring of recent allocation events. See recent_events.h for the design.
#include "gpustitch/trace/recent_events.h"

#include <time.h>

#include <iterator>
#include <map>
#include <new>
#include <string>
#include <unordered_map>

namespace gpustitch::trace {

std::uint64_t epoch_microseconds() noexcept {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000u +
         static_cast<std::uint64_t>(ts.tv_nsec) / 1000u;
}

RecentEvents::RecentEvents(std::size_t capacity, SiteOfAllocation site_of)
    : capacity_(capacity < 1 ? 1 : (capacity > kMaxCapacity ? kMaxCapacity : capacity)),
      site_of_(site_of),
      slots_(new Slot[capacity_]) {}

RecentEvents::~RecentEvents() = default;

void RecentEvents::record(RecentEvent::Action action, int device, DevPtr addr, std::uint64_t size,
                          Stream stream, std::uint64_t extra, std::uint64_t time_us) noexcept {
  const std::uint64_t t = head_.fetch_add(1, std::memory_order_relaxed);
  Slot& s = slots_[t % capacity_];
  // Take the slot: only from an older, finished event. A slot another writer is in (a whole ring
  // of events ago, stalled mid-write) or that already holds a newer event keeps its content and
  // this event is dropped, so no two writers ever mix their fields.
  std::uint64_t cur = s.seq.load(std::memory_order_relaxed);
  do {
    if ((cur & 1) != 0 || cur > 2 * t) return;
  } while (!s.seq.compare_exchange_weak(cur, 2 * t + 1, std::memory_order_relaxed));
  // Readers that see any field below also see the odd mark (their acquire fence pairs with this).
  std::atomic_thread_fence(std::memory_order_release);
  s.meta.store(static_cast<std::uint64_t>(action) |
                   (static_cast<std::uint64_t>(static_cast<std::uint32_t>(device)) << 8),
               std::memory_order_relaxed);
  s.addr.store(addr, std::memory_order_relaxed);
  s.size.store(size, std::memory_order_relaxed);
  s.stream.store(stream, std::memory_order_relaxed);
  s.time_us.store(time_us, std::memory_order_relaxed);
  s.extra.store(extra, std::memory_order_relaxed);
  s.seq.store(2 * t + 2, std::memory_order_release);
}

void RecentEvents::on_allocate(int device, DevPtr ptr, std::size_t size, Stream stream,
                               ServedBy) noexcept {
  const std::uint64_t site = site_of_ != nullptr ? site_of_(ptr) : 0;
  record(RecentEvent::Action::alloc, device, ptr, size, stream, site, epoch_microseconds());
}

void RecentEvents::on_free(int device, DevPtr ptr, std::size_t size, Stream stream) noexcept {
  record(RecentEvent::Action::free, device, ptr, size, stream, 0, epoch_microseconds());
}

void RecentEvents::on_event(const PoolEvent& event) noexcept {
  if (event.kind != EventKind::oom) return;
  record(RecentEvent::Action::oom, event.device, 0, event.size, kAnyStream, event.device_free,
         event.time_ns / 1000u);
}

void RecentEvents::on_segment(int device, DevPtr ptr, std::size_t size, bool mapped) noexcept {
  record(mapped ? RecentEvent::Action::segment_map : RecentEvent::Action::segment_unmap, device,
         ptr, size, kAnyStream, 0, epoch_microseconds());
}

std::vector<RecentEvent> RecentEvents::read() const {
  const std::uint64_t head = head_.load(std::memory_order_acquire);
  const std::uint64_t first = head > capacity_ ? head - capacity_ : 0;
  std::vector<RecentEvent> out;
  out.reserve(static_cast<std::size_t>(head - first));
  for (std::uint64_t t = first; t < head; ++t) {
    const Slot& s = slots_[t % capacity_];
    const std::uint64_t want = 2 * t + 2;
    if (s.seq.load(std::memory_order_acquire) != want) continue;  // being written or overwritten
    const std::uint64_t meta = s.meta.load(std::memory_order_relaxed);
    RecentEvent e;
    e.addr = s.addr.load(std::memory_order_relaxed);
    e.size = s.size.load(std::memory_order_relaxed);
    e.stream = s.stream.load(std::memory_order_relaxed);
    e.time_us = s.time_us.load(std::memory_order_relaxed);
    const std::uint64_t extra = s.extra.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (s.seq.load(std::memory_order_relaxed) != want) continue;  // overwritten while read
    const auto action = static_cast<std::uint8_t>(meta & 0xff);
    if (action < 1 || action > 5) continue;
    e.action = static_cast<RecentEvent::Action>(action);
    e.device = static_cast<int>(static_cast<std::uint32_t>(meta >> 8));
    if (e.action == RecentEvent::Action::alloc) e.site = extra;
    if (e.action == RecentEvent::Action::oom) e.device_free = extra;
    out.push_back(e);
  }
  return out;
}

void RecentEvents::forget_unfinished() noexcept {
  for (std::size_t i = 0; i < capacity_; ++i) {
    if ((slots_[i].seq.load(std::memory_order_relaxed) & 1) != 0) {
      slots_[i].seq.store(0, std::memory_order_relaxed);
    }
  }
}

std::unique_ptr<RecentEvents> make_recent_events(const Config& config, SiteOfAllocation site_of,
                                                 std::string* why) {
  if (config.trace_events == 0) return nullptr;
  try {
    return std::make_unique<RecentEvents>(config.trace_events, site_of);
  } catch (const std::bad_alloc&) {
    if (why != nullptr) {
      *why = "cannot allocate the ring of " + std::to_string(config.trace_events) +
             " events (trace_events)";
    }
    return nullptr;
  }
}

namespace {

// The segment events that the snapshot's segments bear out: replayed backwards from them, as
// memory_viz's Allocator State History does, a segment_map must find its range mapped (it is
// taken out), a segment_unmap must find its range unmapped (it is put back). keep[i] says
// whether events[i] stays; events other than segment events always do.
std::vector<bool> consistent_segment_events(const std::vector<RecentEvent>& events,
                                            const SnapshotData& data) {
  std::vector<bool> keep(events.size(), true);
  std::unordered_map<int, std::map<std::uint64_t, std::uint64_t>> mapped;  // device: lo -> hi
  for (const SnapshotSegment& seg : data.segments) {
    if (seg.total_size != 0) mapped[seg.device][seg.address] = seg.address + seg.total_size;
  }
  for (std::size_t i = events.size(); i-- > 0;) {
    const RecentEvent& e = events[i];
    if (e.action != RecentEvent::Action::segment_map &&
        e.action != RecentEvent::Action::segment_unmap) {
      continue;
    }
    auto& m = mapped[e.device];
    const std::uint64_t lo = e.addr, hi = e.addr + e.size;
    if (e.size == 0 || hi < lo) {
      keep[i] = false;
      continue;
    }
    auto it = m.upper_bound(lo);  // first interval starting after lo
    if (e.action == RecentEvent::Action::segment_map) {
      // Backwards: the range was not mapped before this event.
      if (it == m.begin() || std::prev(it)->second < hi) {
        keep[i] = false;
        continue;
      }
      auto in = std::prev(it);
      const std::uint64_t ilo = in->first, ihi = in->second;
      m.erase(in);
      if (ilo < lo) m[ilo] = lo;
      if (hi < ihi) m[hi] = ihi;
    } else {
      // Backwards: the range was mapped before this event; it must not overlap what is mapped.
      if ((it != m.end() && it->first < hi) || (it != m.begin() && std::prev(it)->second > lo)) {
        keep[i] = false;
        continue;
      }
      std::uint64_t nlo = lo, nhi = hi;
      if (it != m.end() && it->first == hi) {
        nhi = it->second;
        it = m.erase(it);
      }
      if (it != m.begin() && std::prev(it)->second == lo) {
        nlo = std::prev(it)->first;
        m.erase(std::prev(it));
      }
      m[nlo] = nhi;
    }
  }
  return keep;
}

}  // namespace

void append_device_traces(
    const std::vector<RecentEvent>& events,
    const std::function<std::vector<SnapshotFrame>(std::uint64_t site)>& frames_of_site,
    SnapshotData* data) {
  const std::vector<bool> keep = consistent_segment_events(events, *data);
  std::unordered_map<std::uint64_t, std::vector<SnapshotFrame>> frames_cache;
  auto frames = [&](std::uint64_t site) -> std::vector<SnapshotFrame> {
    if (site == 0 || !frames_of_site) return {};
    auto it = frames_cache.find(site);
    if (it == frames_cache.end()) it = frames_cache.emplace(site, frames_of_site(site)).first;
    return it->second;
  };
  for (std::size_t i = 0; i < events.size(); ++i) {
    const RecentEvent& e = events[i];
    if (e.device < 0 || !keep[i]) continue;
    auto d = static_cast<std::size_t>(e.device);
    if (d >= data->device_traces.size()) data->device_traces.resize(d + 1);
    auto& out = data->device_traces[d];
    const std::uint64_t stream = snapshot_stream(e.stream);
    switch (e.action) {
      case RecentEvent::Action::alloc:
        out.push_back({"alloc", e.addr, e.size, stream, e.time_us, 0, frames(e.site)});
        break;
      case RecentEvent::Action::free:
        out.push_back({"free_requested", e.addr, e.size, stream, e.time_us, 0, {}});
        out.push_back({"free_completed", e.addr, e.size, stream, e.time_us, 0, {}});
        break;
      case RecentEvent::Action::oom:
        out.push_back({"oom", 0, e.size, stream, e.time_us, e.device_free, {}});
        break;
      case RecentEvent::Action::segment_map:
        out.push_back({"segment_map", e.addr, e.size, 0, e.time_us, 0, {}});
        break;
      case RecentEvent::Action::segment_unmap:
        out.push_back({"segment_unmap", e.addr, e.size, 0, e.time_us, 0, {}});
        break;
    }
  }
}

}  // namespace gpustitch::trace
