// Where records live and how they are named, and the /proc facts that tie a record to a live
// process.
//
// A record is the POSIX shared-memory object "/<prefix>.<uid>.<pid>.<start_time>" (so the file
// /dev/shm/<prefix>.<uid>.<pid>.<start_time>), mode 0600, owned by the process's user. The name
// alone lets a reader skip other users' records without opening them and detect a dead or
// recycled pid without reading the record: a process is the record's writer only while
// /proc/<pid>/stat shows the same start time (pid + start time is unique until reboot) and
// /proc/<pid> belongs to uid. The prefix is "gpustitch" everywhere except tests, which use their
// own so that parallel test runs do not see each other.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace gpustitch::shm {

inline constexpr std::string_view kDefaultPrefix = "gpustitch";
inline constexpr const char* kShmDir = "/dev/shm";

struct RecordName {
  std::string prefix;
  uid_t uid = 0;
  pid_t pid = 0;
  std::uint64_t start_time = 0;
  ino_t inode = 0;  // from the directory entry when discovered (0 = unknown)

  // "<prefix>.<uid>.<pid>.<start_time>" (no leading slash, as Boost.Interprocess takes it).
  std::string object_name() const;
  // "/dev/shm/<object_name>".
  std::string path() const;
};

// Parses a directory entry name; nullopt unless it is exactly prefix.uid.pid.start_time with
// decimal fields in range (no signs, no leading junk, no overflow).
std::optional<RecordName> parse_record_name(std::string_view entry, std::string_view prefix);

// Lists /dev/shm entries that parse as record names with this prefix. When only_uid is set, only
// that user's names (by name: the owner is checked again when a record is opened).
std::vector<RecordName> discover_records(std::string_view prefix = kDefaultPrefix,
                                         std::optional<uid_t> only_uid = std::nullopt);

// Field 22 of /proc/<pid>/stat (start time in clock ticks after boot), or nullopt when the
// process does not exist or the file cannot be parsed. pid 0 means the calling process.
std::optional<std::uint64_t> process_start_time(pid_t pid);

// Owner of /proc/<pid> (the process's effective uid in practice), or nullopt.
std::optional<uid_t> process_uid(pid_t pid);

// Whether the process named by the record is still the one that wrote it: same pid, same start
// time, same owner.
bool record_process_alive(const RecordName& name);

// /proc/self/exe and /proc/self/cmdline (NULs as spaces); empty on failure.
std::string self_exe();
std::string self_cmdline();

// CLOCK_REALTIME in nanoseconds.
std::uint64_t realtime_ns() noexcept;

}  // namespace gpustitch::shm
