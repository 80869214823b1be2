// The producer side of one record: creates the shared-memory object with Boost.Interprocess
// (mode 0600, owned by the calling user), fills the identity, and writes snapshots, events and
// allocation sites into it. Nothing here throws; creation failures are reported through `why`.
//
// Threads: publish() and publish_sites() are single-writer (one thread each, or the caller
// serializes); record_event() may be called from any thread at any time and never waits.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "gpustitch/shm/names.h"
#include "gpustitch/shm/record.h"

namespace gpustitch::shm {

struct RecordEvent {
  RecordEventKind kind = RecordEventKind::oom;
  int device = -1;
  std::uint64_t time_ns = 0;  // 0 = now
  std::uint64_t size = 0;
  std::uint64_t device_free = 0;
  std::uint64_t cached = 0;
  std::uint64_t largest_possible = 0;
  std::uint64_t pieces = 0;
  double fragmentation = 0.0;
  std::uint64_t peer_pid = 0;
};

class RecordWriter {
 public:
  // Creates (replacing a stale object of the same name) and maps the record for `name`. The
  // identity's pid/uid/start time come from `name`; exe and cmdline from the arguments. With
  // `carry_events_from`, the new record starts with that record's complete events, copied before
  // the record becomes readable: a reader never sees a re-created record without them.
  static std::unique_ptr<RecordWriter> create(const RecordName& name, std::string_view exe,
                                              std::string_view cmdline,
                                              unsigned publish_interval_ms, std::string* why,
                                              const Record* carry_events_from = nullptr) noexcept;
  // The calling process's own record name for `prefix`.
  static RecordName self_name(std::string_view prefix = kDefaultPrefix) noexcept;

  ~RecordWriter();  // unmaps; does not remove the object (see remove()).
  RecordWriter(const RecordWriter&) = delete;
  RecordWriter& operator=(const RecordWriter&) = delete;

  // Single writer: copies count (<= kMaxDevices) device counters and the heartbeat.
  void publish(std::span<const DeviceCounters> devices, std::uint64_t now_ns) noexcept;
  // Any thread; never waits.
  void record_event(const RecordEvent& event) noexcept;
  // Single writer (serialize in-process): replaces the site table.
  void publish_sites(std::span<const Site> sites, std::uint64_t now_ns) noexcept;

  // Whether the object's name was removed behind our back (systemd-logind RemoveIPC, a user's
  // rm): the mapping still works but nobody can find it.
  bool unlinked() const noexcept;
  // Removes the name (the mapping stays valid until this writer is destroyed).
  void remove() noexcept;

  const RecordName& name() const noexcept { return name_; }
  Record* record() noexcept { return record_; }
  int fd() const noexcept;

 private:
  RecordWriter() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  RecordName name_;
  Record* record_ = nullptr;
};

}  // namespace gpustitch::shm
