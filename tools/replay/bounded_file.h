// Reading an input file the user named, without letting the file decide how much is read or how
// long the read waits. `gpustitch replay /dev/zero` used to grow to 4 GB of memory in 10 s, and a
// FIFO with no writer would wait forever: every file the CLI reads whole (traces, snapshots,
// configuration) goes through read_bounded_file(), which
//   - opens with O_NONBLOCK (a FIFO without a writer cannot block the open) and refuses anything
//     that is not a regular file (FIFO, device, socket, directory) with a clear message;
//   - refuses a file larger than max_bytes before reading it, and stops at max_bytes + 1 should
//     the file grow while it is read.
#pragma once

#include <cstdint>
#include <string>

namespace gpustitch::replay {

enum class BoundedRead { ok, cannot_open, refused };

// The largest trace or snapshot the CLI reads: 4 GiB (about 60 million trace lines).
inline constexpr std::uint64_t kMaxTraceFileBytes = 4ull << 30;

// Reads path into *bytes. cannot_open: the file does not exist or cannot be opened (*why says
// why); refused: it is not a regular file or is larger than max_bytes (*why says which).
BoundedRead read_bounded_file(const std::string& path, std::uint64_t max_bytes, std::string* bytes,
                              std::string* why);

}  // namespace gpustitch::replay
