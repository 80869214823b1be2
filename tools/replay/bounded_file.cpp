// read_bounded_file: see bounded_file.h.
#include "bounded_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace gpustitch::replay {

namespace {

std::string size_text(std::uint64_t bytes) {
  if (bytes >= (1ull << 30) && bytes % (1ull << 30) == 0)
    return std::to_string(bytes >> 30) + " GiB";
  if (bytes >= (1ull << 20) && bytes % (1ull << 20) == 0)
    return std::to_string(bytes >> 20) + " MiB";
  return std::to_string(bytes) + " bytes";
}

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

}  // namespace

BoundedRead read_bounded_file(const std::string& path, std::uint64_t max_bytes, std::string* bytes,
                              std::string* why) {
  bytes->clear();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    *why = "cannot open " + path + ": " + std::strerror(errno);
    return BoundedRead::cannot_open;
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    *why = "cannot open " + path + ": " + std::strerror(errno);
    ::close(fd);
    return BoundedRead::cannot_open;
  }
  if (!S_ISREG(st.st_mode)) {
    *why = path + ": " + kind_of(st.st_mode) + ", not a regular file; give a file";
    ::close(fd);
    return BoundedRead::refused;
  }
  const auto too_large = [&] {
    *why = path + ": larger than " + size_text(max_bytes) + "; not read";
    ::close(fd);
    bytes->clear();
    return BoundedRead::refused;
  };
  if (static_cast<std::uint64_t>(st.st_size) > max_bytes) return too_large();
  // Regular files ignore O_NONBLOCK; clear it all the same, so a read never reports EAGAIN.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  bytes->reserve(static_cast<std::size_t>(st.st_size));
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      *why = "cannot read " + path + ": " + std::strerror(errno);
      ::close(fd);
      bytes->clear();
      return BoundedRead::cannot_open;
    }
    if (n == 0) break;
    bytes->append(buf, static_cast<std::size_t>(n));
    if (bytes->size() > max_bytes) return too_large();  // it grew while we read it
  }
  ::close(fd);
  return BoundedRead::ok;
}

}  // namespace gpustitch::replay
