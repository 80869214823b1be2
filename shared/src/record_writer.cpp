// Creating a record with Boost.Interprocess and writing into it. See record.h for the layout and
// the concurrency rules each section follows.
#include "gpustitch/shm/record_writer.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <cstring>

#include "gpustitch/shm/seqlock.h"

namespace gpustitch::shm {
namespace bip = boost::interprocess;

struct RecordWriter::Impl {
  bip::shared_memory_object shm;
  bip::mapped_region region;
};

namespace {
void copy_string(char* dst, std::size_t cap, std::string_view src) {
  std::size_t n = std::min(cap - 1, src.size());
  std::memcpy(dst, src.data(), n);
  std::memset(dst + n, 0, cap - n);
}

// Copies the complete events of `source` into `dst` (a ring nobody writes or reads yet): each
// slot is copied under its own sequence check, so a slot being written at the time is left out
// rather than copied torn.
void copy_events(const Record& source, EventRing& dst) noexcept {
  auto& src = const_cast<EventRing&>(source.events);  // atomic_ref needs non-const; only loads
  for (int i = 0; i < kEventSlots; ++i) {
    std::uint64_t s1 =
        std::atomic_ref<std::uint64_t>(src.slots[i].seq).load(std::memory_order_acquire);
    if (s1 == 0 || (s1 & 1)) continue;
    EventSlot copy;
    std::memcpy(static_cast<void*>(&copy), &src.slots[i], sizeof copy);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (std::atomic_ref<std::uint64_t>(src.slots[i].seq).load(std::memory_order_relaxed) != s1)
      continue;
    copy.seq = 0;
    std::memcpy(static_cast<void*>(&dst.slots[i]), &copy, sizeof copy);
    std::atomic_ref<std::uint64_t>(dst.slots[i].seq).store(s1, std::memory_order_release);
  }
  std::atomic_ref<std::uint64_t>(dst.dropped)
      .store(std::atomic_ref<std::uint64_t>(src.dropped).load(std::memory_order_relaxed),
             std::memory_order_relaxed);
  std::atomic_ref<std::uint64_t>(dst.head).store(
      std::atomic_ref<std::uint64_t>(src.head).load(std::memory_order_acquire),
      std::memory_order_release);
}
}  // namespace

RecordName RecordWriter::self_name(std::string_view prefix) noexcept {
  RecordName name;
  try {
    name.prefix = std::string(prefix);
  } catch (...) {
  }
  name.uid = ::geteuid();
  name.pid = ::getpid();
  name.start_time = process_start_time(0).value_or(0);
  return name;
}

std::unique_ptr<RecordWriter> RecordWriter::create(const RecordName& name, std::string_view exe,
                                                   std::string_view cmdline,
                                                   unsigned publish_interval_ms, std::string* why,
                                                   const Record* carry_events_from) noexcept {
  try {
    std::unique_ptr<RecordWriter> w(new RecordWriter);
    w->name_ = name;
    std::string object = name.object_name();
    // A stale object of this exact name can only come from this same process (pid + start
    // time): replace it.
    bip::shared_memory_object::remove(object.c_str());
    bip::permissions perm(0600);
    bip::shared_memory_object shm(bip::create_only, object.c_str(), bip::read_write, perm);
    // Boost applies the mode with fchmod, so the umask cannot widen or narrow it; check anyway.
    int fd = shm.get_mapping_handle().handle;
    ::fchmod(fd, 0600);
    shm.truncate(sizeof(Record));
    bip::mapped_region region(shm, bip::read_write, 0, sizeof(Record));
    auto* r = static_cast<Record*>(region.get_address());
    std::memset(static_cast<void*>(r), 0, sizeof(Record));
    r->header.version = kLayoutVersion;
    r->header.record_size = sizeof(Record);
    r->header.created_ns = realtime_ns();
    r->header.max_devices = kMaxDevices;
    r->header.event_slots = kEventSlots;
    r->header.max_sites = kMaxSites;
    r->identity.pid = name.pid;
    r->identity.uid = name.uid;
    r->identity.start_time = name.start_time;
    r->identity.publish_interval_ms = publish_interval_ms;
    copy_string(r->identity.exe, sizeof r->identity.exe, exe);
    copy_string(r->identity.cmdline, sizeof r->identity.cmdline, cmdline);
    if (carry_events_from) copy_events(*carry_events_from, r->events);
    // The magic goes last: a reader that sees it sees a complete identity (and carried events).
    std::atomic_ref<std::uint64_t>(r->header.magic).store(kRecordMagic, std::memory_order_release);
    w->impl_ = std::make_unique<Impl>(Impl{std::move(shm), std::move(region)});
    w->record_ = r;
    return w;
  } catch (const std::exception& e) {
    if (why) *why = e.what();
  } catch (...) {
    if (why) *why = "unknown error creating the record";
  }
  return nullptr;
}

RecordWriter::~RecordWriter() = default;

int RecordWriter::fd() const noexcept {
  return impl_ ? impl_->shm.get_mapping_handle().handle : -1;
}

void RecordWriter::publish(std::span<const DeviceCounters> devices, std::uint64_t now_ns) noexcept {
  Snapshot& s = record_->snapshot;
  std::size_t n = std::min<std::size_t>(devices.size(), kMaxDevices);
  seqlock_write_begin(s.seq);
  s.heartbeat_ns = now_ns;
  s.publish_count += 1;
  s.device_count = static_cast<std::uint32_t>(n);
  s.events_head =
      std::atomic_ref<std::uint64_t>(record_->events.head).load(std::memory_order_relaxed);
  if (n) std::memcpy(s.devices, devices.data(), n * sizeof(DeviceCounters));
  seqlock_write_end(s.seq);
}

void RecordWriter::record_event(const RecordEvent& e) noexcept {
  EventRing& ring = record_->events;
  std::uint64_t index =
      std::atomic_ref<std::uint64_t>(ring.head).fetch_add(1, std::memory_order_relaxed);
  EventSlot& slot = ring.slots[index & (kEventSlots - 1)];
  std::atomic_ref<std::uint64_t> seq(slot.seq);
  std::uint64_t cur = seq.load(std::memory_order_relaxed);
  // Take the slot only if nobody is writing it (even sequence) and it holds an older event.
  if ((cur & 1) || cur > 2 * index + 2 ||
      !seq.compare_exchange_strong(cur, 2 * index + 1, std::memory_order_acquire,
                                   std::memory_order_relaxed)) {
    std::atomic_ref<std::uint64_t>(ring.dropped).fetch_add(1, std::memory_order_relaxed);
    return;
  }
  std::atomic_thread_fence(std::memory_order_release);
  slot.kind = static_cast<std::uint32_t>(e.kind);
  slot.device = e.device;
  slot.time_ns = e.time_ns ? e.time_ns : realtime_ns();
  slot.size = e.size;
  slot.device_free = e.device_free;
  slot.cached = e.cached;
  slot.largest_possible = e.largest_possible;
  slot.pieces = e.pieces;
  slot.fragmentation = e.fragmentation;
  slot.peer_pid = e.peer_pid;
  seq.store(2 * index + 2, std::memory_order_release);
}

void RecordWriter::publish_sites(std::span<const Site> sites, std::uint64_t now_ns) noexcept {
  SiteTable& t = record_->sites;
  std::size_t n = std::min<std::size_t>(sites.size(), kMaxSites);
  seqlock_write_begin(t.seq);
  t.updated_ns = now_ns;
  t.count = static_cast<std::uint32_t>(n);
  if (n) std::memcpy(t.sites, sites.data(), n * sizeof(Site));
  std::memset(static_cast<void*>(t.sites + n), 0, (kMaxSites - n) * sizeof(Site));
  seqlock_write_end(t.seq);
}

bool RecordWriter::unlinked() const noexcept {
  struct stat st;
  if (::fstat(fd(), &st) != 0) return false;
  return st.st_nlink == 0;
}

void RecordWriter::remove() noexcept {
  try {
    bip::shared_memory_object::remove(name_.object_name().c_str());
  } catch (...) {
  }
}

}  // namespace gpustitch::shm
