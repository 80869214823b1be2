// The consumer side: opens a record and copies consistent snapshots out of it, treating every
// byte as hostile input.
//
// A reader never maps the record: it copies with pread(2), so a writer that truncates its object
// cannot raise SIGBUS in the reader, and a copy is validated before anything in it is used.
// open() rejects, without reading further: names that are not regular files (a FIFO planted in
// /dev/shm would block an ordinary open; O_NONBLOCK|O_NOFOLLOW prevent that), objects whose
// owner differs from the uid in the name or from the expected owner, objects writable by group or
// others, sizes of no readable layout (record.h, kReadableLayouts: this one and the previous), and
// headers with a wrong magic, version or size. Every
// seqlock read gives up after kMaxReadRetries attempts (a writer that keeps its sequence odd
// cannot hang the reader). Strings are cut at their array bound and counts are clamped.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "gpustitch/shm/names.h"
#include "gpustitch/shm/record.h"

namespace gpustitch::shm {

enum class ReadError {
  none = 0,
  not_found,     // no such object
  access,        // permission denied
  not_regular,   // not a regular file
  wrong_owner,   // owner is not the uid in the name / the expected uid
  bad_mode,      // writable by group or others
  bad_size,      // object size differs from the record size
  bad_magic,     // magic mismatch (or the writer has not finished creating it)
  bad_version,   // another layout version
  bad_header,    // sizes in the header disagree with this layout
  bad_identity,  // identity disagrees with the name
  busy,          // seqlock retries exhausted
  io,            // read failed
};
const char* to_string(ReadError e) noexcept;

// Identity, validated and with strings made safe.
struct ProcessIdentity {
  pid_t pid = 0;
  uid_t uid = 0;
  std::uint64_t start_time = 0;
  std::uint64_t created_ns = 0;
  std::uint32_t publish_interval_ms = 0;
  std::uint32_t layout_version = 0;
  std::string exe;
  std::string cmdline;
};

struct SnapshotCopy {
  std::uint64_t heartbeat_ns = 0;
  std::uint64_t publish_count = 0;
  std::uint64_t events_head = 0;  // events claimed as of this snapshot
  // The record's layout: counters newer than it (program_* before 3) are zero, not measured.
  std::uint32_t layout_version = kLayoutVersion;
  std::vector<DeviceCounters> devices;
};

struct EventCopy {
  std::uint64_t index = 0;  // event number in the process
  RecordEventKind kind = RecordEventKind::oom;
  bool known_kind = false;
  int device = -1;
  std::uint64_t time_ns = 0, size = 0, device_free = 0, cached = 0, largest_possible = 0,
                pieces = 0, peer_pid = 0;
  double fragmentation = 0.0;
};

struct SiteCopy {
  std::uint64_t live_bytes = 0, count = 0;
  int device = -1;
  struct Frame {
    std::string function, library;
    std::uint64_t offset = 0;
  };
  std::vector<Frame> frames;
};

// Pure validation of a header + identity image against a name (used by open() and the fuzzer).
ReadError validate_prefix(std::span<const std::uint8_t> bytes, const RecordName* name,
                          ProcessIdentity* out) noexcept;
// Pure decoding of a snapshot image (the Snapshot struct bytes, possibly short): validates
// device_count and clamps; returns false when the image is inconsistent.
bool decode_snapshot(std::span<const std::uint8_t> bytes, SnapshotCopy* out);
// The same for a snapshot of a given readable layout (device stride).
bool decode_snapshot(std::span<const std::uint8_t> bytes, SnapshotCopy* out,
                     const LayoutInfo& layout);
// Pure decoding of an event ring image: complete, in-range slots, oldest first, at most
// kEventSlots; slots torn or reused during the copy are skipped.
std::vector<EventCopy> decode_events(std::span<const std::uint8_t> bytes);
// Pure decoding of a site table image.
std::vector<SiteCopy> decode_sites(std::span<const std::uint8_t> bytes);

class RecordReader {
 public:
  // Opens /dev/shm/<name>. expected_uid: when set, the object must belong to that uid too.
  static std::optional<RecordReader> open(const RecordName& name, std::optional<uid_t> expected_uid,
                                          ReadError* err);
  // Opens an arbitrary path (tests, fuzzer); the owner must equal expected_uid when set.
  static std::optional<RecordReader> open_path(const std::string& path, const RecordName* name,
                                               std::optional<uid_t> expected_uid, ReadError* err);

  RecordReader(RecordReader&& other) noexcept;
  RecordReader& operator=(RecordReader&& other) noexcept;
  ~RecordReader();

  const ProcessIdentity& identity() const noexcept { return identity_; }
  const RecordName& name() const noexcept { return name_; }
  // Inode of the object (a re-created record with the same name has another one).
  ino_t inode() const noexcept { return inode_; }

  // A consistent snapshot, or busy/io.
  ReadError read_snapshot(SnapshotCopy* out) const;
  // Number of events ever claimed (cheap: one 8-byte read).
  std::optional<std::uint64_t> event_head() const;
  ReadError read_events(std::vector<EventCopy>* out, std::uint64_t* dropped = nullptr) const;
  ReadError read_sites(std::vector<SiteCopy>* out, std::uint64_t* updated_ns = nullptr) const;
  // Whether the object still has a name in /dev/shm (st_nlink > 0).
  bool linked() const noexcept;

 private:
  RecordReader() = default;
  bool pread_all(void* dst, std::size_t size, std::size_t offset) const noexcept;
  int fd_ = -1;
  ino_t inode_ = 0;
  mutable std::size_t device_guess_ = 1;  // devices copied by the last snapshot read
  const LayoutInfo* layout_ = &kReadableLayouts[0];
  RecordName name_;
  ProcessIdentity identity_;
};

}  // namespace gpustitch::shm
