// Validating reader of records. Everything read from a record is untrusted: see record_reader.h.
#include "gpustitch/shm/record_reader.h"

#include "gpustitch/shm/seqlock.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>

namespace gpustitch::shm {
namespace {

// The seqlock reader's fences (seqlock.h) between its copies. Each pread(2) is the kernel loading
// on this thread's behalf, and a system call is not a barrier: x86 never reorders loads with
// loads, but aarch64 may, and without the fence a payload copy could hold bytes older than the
// first sequence read or newer than the second, which the sequence check would then accept.
inline void order_copies() noexcept {
  std::atomic_thread_fence(std::memory_order_acquire);
}

std::string bounded_string(const char* s, std::size_t cap) {
  std::size_t n = ::strnlen(s, cap);
  std::string out(s, n);
  // Control characters would let a record rewrite a terminal (escape sequences): replace them.
  for (char& c : out)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  return out;
}

template <typename T>
bool load(std::span<const std::uint8_t> bytes, std::size_t offset, T* out) {
  if (offset > bytes.size() || bytes.size() - offset < sizeof(T)) return false;
  std::memcpy(static_cast<void*>(out), bytes.data() + offset, sizeof(T));
  return true;
}

}  // namespace

const char* to_string(ReadError e) noexcept {
  switch (e) {
    case ReadError::none:
      return "ok";
    case ReadError::not_found:
      return "not found";
    case ReadError::access:
      return "permission denied";
    case ReadError::not_regular:
      return "not a regular file";
    case ReadError::wrong_owner:
      return "owned by another user";
    case ReadError::bad_mode:
      return "writable by others";
    case ReadError::bad_size:
      return "wrong size";
    case ReadError::bad_magic:
      return "bad magic";
    case ReadError::bad_version:
      return "unsupported layout version";
    case ReadError::bad_header:
      return "inconsistent header";
    case ReadError::bad_identity:
      return "identity does not match the name";
    case ReadError::busy:
      return "writer busy (retries exhausted)";
    case ReadError::io:
      return "read error";
  }
  return "unknown";
}

const char* to_string(RecordEventKind kind) noexcept {
  switch (kind) {
    case RecordEventKind::oom:
      return "oom";
    case RecordEventKind::stitch:
      return "stitch";
    case RecordEventKind::trim:
      return "trim";
    case RecordEventKind::release:
      return "release";
    case RecordEventKind::coop_give:
      return "coop_give";
    case RecordEventKind::coop_receive:
      return "coop_receive";
  }
  return "unknown";
}

ReadError validate_prefix(std::span<const std::uint8_t> bytes, const RecordName* name,
                          ProcessIdentity* out) noexcept {
  RecordHeader h;
  if (!load(bytes, 0, &h)) return ReadError::bad_size;
  if (h.magic != kRecordMagic) return ReadError::bad_magic;
  const LayoutInfo* layout = find_layout(h.version);
  if (layout == nullptr) return ReadError::bad_version;
  if (h.record_size != layout->record_size || h.max_devices != kMaxDevices ||
      h.event_slots != kEventSlots || h.max_sites != kMaxSites)
    return ReadError::bad_header;
  Identity id;
  if (!load(bytes, offsetof(Record, identity), &id)) return ReadError::bad_size;
  if (id.pid <= 0) return ReadError::bad_identity;
  if (name && (id.pid != name->pid || id.uid != name->uid || id.start_time != name->start_time))
    return ReadError::bad_identity;
  if (out) {
    try {
      out->pid = id.pid;
      out->uid = id.uid;
      out->start_time = id.start_time;
      out->created_ns = h.created_ns;
      out->publish_interval_ms = id.publish_interval_ms;
      out->layout_version = h.version;
      out->exe = bounded_string(id.exe, sizeof id.exe);
      out->cmdline = bounded_string(id.cmdline, sizeof id.cmdline);
    } catch (...) {
      return ReadError::io;
    }
  }
  return ReadError::none;
}

bool decode_snapshot(std::span<const std::uint8_t> bytes, SnapshotCopy* out) {
  return decode_snapshot(bytes, out, kReadableLayouts[0]);
}

bool decode_snapshot(std::span<const std::uint8_t> bytes, SnapshotCopy* out,
                     const LayoutInfo& layout) {
  Snapshot head;  // only the fields before devices[] are loaded here
  if (bytes.size() < offsetof(Snapshot, devices)) return false;
  std::memcpy(static_cast<void*>(&head), bytes.data(), offsetof(Snapshot, devices));
  if (head.device_count > kMaxDevices) return false;
  const std::size_t stride = std::min<std::size_t>(layout.device_stride, sizeof(DeviceCounters));
  std::size_t need = offsetof(Snapshot, devices) + head.device_count * layout.device_stride;
  if (bytes.size() < need) return false;
  out->heartbeat_ns = head.heartbeat_ns;
  out->publish_count = head.publish_count;
  out->events_head = head.events_head;
  out->layout_version = layout.version;
  out->devices.assign(head.device_count, DeviceCounters{});
  // Counters an older layout lacks stay zero.
  for (std::uint32_t i = 0; i < head.device_count; ++i) {
    std::memcpy(static_cast<void*>(&out->devices[i]),
                bytes.data() + offsetof(Snapshot, devices) + i * layout.device_stride, stride);
  }
  return true;
}

std::vector<EventCopy> decode_events(std::span<const std::uint8_t> bytes) {
  std::vector<EventCopy> out;
  std::uint64_t head = 0;
  if (!load(bytes, offsetof(EventRing, head), &head)) return out;
  for (int i = 0; i < kEventSlots; ++i) {
    EventSlot s;
    if (!load(bytes, offsetof(EventRing, slots) + i * sizeof(EventSlot), &s)) break;
    if (s.seq == 0 || (s.seq & 1)) continue;  // empty or being written
    std::uint64_t index = s.seq / 2 - 1;
    // A complete event must sit in its own slot and not claim to be from the future.
    if ((index & (kEventSlots - 1)) != static_cast<std::uint64_t>(i) || index >= head) continue;
    EventCopy e;
    e.index = index;
    e.known_kind = s.kind >= 1 && s.kind <= 6;
    e.kind = static_cast<RecordEventKind>(s.kind);
    e.device = s.device;
    e.time_ns = s.time_ns;
    e.size = s.size;
    e.device_free = s.device_free;
    e.cached = s.cached;
    e.largest_possible = s.largest_possible;
    e.pieces = s.pieces;
    e.fragmentation = s.fragmentation;
    e.peer_pid = s.peer_pid;
    out.push_back(e);
  }
  std::sort(out.begin(), out.end(),
            [](const EventCopy& a, const EventCopy& b) { return a.index < b.index; });
  return out;
}

std::vector<SiteCopy> decode_sites(std::span<const std::uint8_t> bytes) {
  std::vector<SiteCopy> out;
  std::uint32_t count = 0;
  if (!load(bytes, offsetof(SiteTable, count), &count)) return out;
  count = std::min<std::uint32_t>(count, kMaxSites);
  for (std::uint32_t i = 0; i < count; ++i) {
    Site s;
    if (!load(bytes, offsetof(SiteTable, sites) + i * sizeof(Site), &s)) break;
    SiteCopy c;
    c.live_bytes = s.live_bytes;
    c.count = s.count;
    c.device = s.device;
    std::uint32_t frames = std::min<std::uint32_t>(s.frame_count, kMaxFrames);
    for (std::uint32_t f = 0; f < frames; ++f) {
      c.frames.push_back({bounded_string(s.frames[f].function, sizeof s.frames[f].function),
                          bounded_string(s.frames[f].library, sizeof s.frames[f].library),
                          s.frames[f].offset});
    }
    out.push_back(std::move(c));
  }
  return out;
}

std::optional<RecordReader> RecordReader::open(const RecordName& name,
                                               std::optional<uid_t> expected_uid, ReadError* err) {
  return open_path(name.path(), &name, expected_uid, err);
}

std::optional<RecordReader> RecordReader::open_path(const std::string& path, const RecordName* name,
                                                    std::optional<uid_t> expected_uid,
                                                    ReadError* err) {
  ReadError dummy;
  if (!err) err = &dummy;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    *err = errno == ENOENT                       ? ReadError::not_found
           : (errno == EACCES || errno == EPERM) ? ReadError::access
                                                 : ReadError::not_regular;
    return std::nullopt;
  }
  RecordReader r;
  r.fd_ = fd;  // closed by r's destructor on every early return
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    *err = ReadError::io;
    return std::nullopt;
  }
  if (!S_ISREG(st.st_mode)) {
    *err = ReadError::not_regular;
    return std::nullopt;
  }
  if ((name && st.st_uid != name->uid) || (expected_uid && st.st_uid != *expected_uid)) {
    *err = ReadError::wrong_owner;
    return std::nullopt;
  }
  if (st.st_mode & (S_IWGRP | S_IWOTH)) {
    *err = ReadError::bad_mode;
    return std::nullopt;
  }
  const LayoutInfo* sized = nullptr;
  for (const LayoutInfo& l : kReadableLayouts) {
    if (st.st_size == static_cast<off_t>(l.record_size)) sized = &l;
  }
  if (sized == nullptr) {
    *err = ReadError::bad_size;
    return std::nullopt;
  }
  std::uint8_t prefix[offsetof(Record, snapshot)];
  if (!r.pread_all(prefix, sizeof prefix, 0)) {
    *err = ReadError::io;
    return std::nullopt;
  }
  *err = validate_prefix(prefix, name, &r.identity_);
  if (*err != ReadError::none) return std::nullopt;
  r.layout_ = find_layout(r.identity_.layout_version);
  if (r.layout_ != sized) {  // a header of one layout in an object of another's size
    *err = ReadError::bad_size;
    return std::nullopt;
  }
  if (name) {
    r.name_ = *name;
  } else {
    r.name_.pid = r.identity_.pid;
    r.name_.uid = r.identity_.uid;
    r.name_.start_time = r.identity_.start_time;
  }
  r.inode_ = st.st_ino;
  return std::optional<RecordReader>(std::move(r));
}

RecordReader::RecordReader(RecordReader&& o) noexcept
    : fd_(o.fd_),
      inode_(o.inode_),
      device_guess_(o.device_guess_),
      layout_(o.layout_),
      name_(std::move(o.name_)),
      identity_(std::move(o.identity_)) {
  o.fd_ = -1;
}

RecordReader& RecordReader::operator=(RecordReader&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    o.fd_ = -1;
    inode_ = o.inode_;
    device_guess_ = o.device_guess_;
    layout_ = o.layout_;
    name_ = std::move(o.name_);
    identity_ = std::move(o.identity_);
  }
  return *this;
}

RecordReader::~RecordReader() {
  if (fd_ >= 0) ::close(fd_);
}

bool RecordReader::pread_all(void* dst, std::size_t size, std::size_t offset) const noexcept {
  auto* p = static_cast<std::uint8_t*>(dst);
  while (size) {
    ssize_t n = ::pread(fd_, p, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;  // error, or the object shrank under us
    p += n;
    size -= static_cast<std::size_t>(n);
    offset += static_cast<std::size_t>(n);
  }
  return true;
}

ReadError RecordReader::read_snapshot(SnapshotCopy* out) const {
  constexpr std::size_t base = offsetof(Record, snapshot);
  alignas(8) std::uint8_t buf[sizeof(Snapshot)];  // the largest readable snapshot
  const std::size_t stride = layout_->device_stride;
  for (int attempt = 0; attempt < kMaxReadRetries; ++attempt) {
    if (attempt >= 8) ::sched_yield();
    std::uint64_t s1 = 0, s2 = 0;
    if (!pread_all(&s1, 8, base + offsetof(Snapshot, seq))) return ReadError::io;
    if (s1 & 1) continue;
    order_copies();
    // One copy of the fixed part plus as many devices as last time; more only if the count grew.
    // device_count is re-validated on decode.
    std::size_t guess = std::min<std::size_t>(device_guess_, kMaxDevices);
    std::size_t head = offsetof(Snapshot, devices);
    if (!pread_all(buf, head + guess * stride, base)) return ReadError::io;
    std::uint32_t count;
    std::memcpy(&count, buf + offsetof(Snapshot, device_count), 4);
    std::size_t n = std::min<std::uint32_t>(count, kMaxDevices);
    std::size_t len = head + n * stride;
    if (n > guess &&
        !pread_all(buf + head + guess * stride, (n - guess) * stride, base + head + guess * stride))
      return ReadError::io;
    order_copies();
    if (!pread_all(&s2, 8, base + offsetof(Snapshot, seq))) return ReadError::io;
    std::uint64_t copied_seq;
    std::memcpy(&copied_seq, buf + offsetof(Snapshot, seq), 8);
    if (s1 != s2 || copied_seq != s1) continue;
    if (!decode_snapshot(std::span<const std::uint8_t>(buf, len), out, *layout_))
      return ReadError::bad_header;
    device_guess_ = n;
    return ReadError::none;
  }
  return ReadError::busy;
}

std::optional<std::uint64_t> RecordReader::event_head() const {
  std::uint64_t head;
  if (!pread_all(&head, 8, layout_->events_offset + offsetof(EventRing, head))) return std::nullopt;
  return head;
}

ReadError RecordReader::read_events(std::vector<EventCopy>* out, std::uint64_t* dropped) const {
  // Each slot carries its own sequence; decode_events drops slots caught mid-write. A slot
  // rewritten between the header check and the copy would show the new event's index, which is
  // still a complete event; a copy torn across two writes is caught by re-reading the slot seqs.
  std::vector<std::uint8_t> buf(sizeof(EventRing));
  for (int attempt = 0; attempt < kMaxReadRetries; ++attempt) {
    if (!pread_all(buf.data(), buf.size(), layout_->events_offset)) return ReadError::io;
    order_copies();
    std::vector<std::uint8_t> again(sizeof(EventRing));
    if (!pread_all(again.data(), again.size(), layout_->events_offset)) return ReadError::io;
    // Keep only slots whose sequence did not move between the two copies.
    bool stable = true;
    for (int i = 0; i < kEventSlots; ++i) {
      std::size_t off = offsetof(EventRing, slots) + i * sizeof(EventSlot);
      if (std::memcmp(buf.data() + off, again.data() + off, sizeof(EventSlot)) != 0) {
        stable = false;
        break;
      }
    }
    if (!stable) continue;
    *out = decode_events(buf);
    if (dropped) std::memcpy(dropped, buf.data() + offsetof(EventRing, dropped), 8);
    return ReadError::none;
  }
  return ReadError::busy;
}

ReadError RecordReader::read_sites(std::vector<SiteCopy>* out, std::uint64_t* updated_ns) const {
  const std::size_t base = layout_->sites_offset;
  std::vector<std::uint8_t> buf(sizeof(SiteTable));
  for (int attempt = 0; attempt < kMaxReadRetries; ++attempt) {
    if (attempt >= 8) ::sched_yield();
    std::uint64_t s1 = 0, s2 = 0;
    if (!pread_all(&s1, 8, base)) return ReadError::io;
    if (s1 & 1) continue;
    order_copies();
    if (!pread_all(buf.data(), buf.size(), base)) return ReadError::io;
    order_copies();
    if (!pread_all(&s2, 8, base)) return ReadError::io;
    std::uint64_t copied;
    std::memcpy(&copied, buf.data(), 8);
    if (s1 != s2 || copied != s1) continue;
    *out = decode_sites(buf);
    if (updated_ns) std::memcpy(updated_ns, buf.data() + offsetof(SiteTable, updated_ns), 8);
    return ReadError::none;
  }
  return ReadError::busy;
}

bool RecordReader::linked() const noexcept {
  struct stat st;
  return ::fstat(fd_, &st) == 0 && st.st_nlink > 0;
}

}  // namespace gpustitch::shm
