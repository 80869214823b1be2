// Record names, discovery in /dev/shm, and the /proc facts that tie a record to its process.
#include "gpustitch/shm/names.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <charconv>
#include <cstring>

namespace gpustitch::shm {
namespace {

template <typename T>
bool parse_decimal(std::string_view text, T* out) {
  if (text.empty() || text.size() > 20) return false;
  for (char c : text)
    if (c < '0' || c > '9') return false;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc{} && p == text.data() + text.size();
}

// Reads a small /proc file into buf (NUL-terminated); returns the byte count or -1. A relative
// path is opened relative to dir.
ssize_t read_small_file(const char* path, char* buf, std::size_t cap, int dir = AT_FDCWD) {
  int fd = ::openat(dir, path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  std::size_t n = 0;
  while (n + 1 < cap) {
    ssize_t r = ::read(fd, buf + n, cap - 1 - n);
    if (r < 0) {
      if (errno == EINTR) continue;
      ::close(fd);
      return -1;
    }
    if (r == 0) break;
    n += static_cast<std::size_t>(r);
  }
  ::close(fd);
  buf[n] = '\0';
  return static_cast<ssize_t>(n);
}

}  // namespace

std::string RecordName::object_name() const {
  return prefix + "." + std::to_string(uid) + "." + std::to_string(pid) + "." +
         std::to_string(start_time);
}

std::string RecordName::path() const {
  return std::string(kShmDir) + "/" + object_name();
}

std::optional<RecordName> parse_record_name(std::string_view entry, std::string_view prefix) {
  if (entry.size() <= prefix.size() + 1 || entry.substr(0, prefix.size()) != prefix ||
      entry[prefix.size()] != '.')
    return std::nullopt;
  std::string_view rest = entry.substr(prefix.size() + 1);
  std::string_view parts[3];
  for (int i = 0; i < 3; ++i) {
    std::size_t dot = rest.find('.');
    if (i < 2) {
      if (dot == std::string_view::npos) return std::nullopt;
      parts[i] = rest.substr(0, dot);
      rest = rest.substr(dot + 1);
    } else {
      if (dot != std::string_view::npos) return std::nullopt;
      parts[i] = rest;
    }
  }
  RecordName name;
  name.prefix = std::string(prefix);
  std::uint32_t uid = 0;
  std::int32_t pid = 0;
  if (!parse_decimal(parts[0], &uid) || !parse_decimal(parts[1], &pid) || pid <= 0 ||
      !parse_decimal(parts[2], &name.start_time))
    return std::nullopt;
  name.uid = uid;
  name.pid = pid;
  return name;
}

std::vector<RecordName> discover_records(std::string_view prefix, std::optional<uid_t> only_uid) {
  std::vector<RecordName> out;
  DIR* dir = ::opendir(kShmDir);
  if (!dir) return out;
  while (dirent* e = ::readdir(dir)) {
    if (e->d_type != DT_REG && e->d_type != DT_UNKNOWN) continue;
    auto name = parse_record_name(e->d_name, prefix);
    if (!name) continue;
    if (only_uid && name->uid != *only_uid) continue;
    name->inode = e->d_ino;
    out.push_back(std::move(*name));
  }
  ::closedir(dir);
  return out;
}

std::optional<std::uint64_t> process_start_time(pid_t pid) {
  // "self/stat" or "PID/stat" opened through a descriptor of /proc: the same file as the absolute
  // path. Why not the absolute path: qemu-user (the aarch64 tests) answers absolute paths naming
  // its own process (/proc/self/stat, /proc/<its pid>/stat) with a file of its own making, whose
  // start time is not the one the kernel gives every other process reading /proc/<pid>/stat, and
  // a record's start time must be the one its readers see.
  char path[64];
  if (pid == 0)
    std::snprintf(path, sizeof path, "self/stat");
  else
    std::snprintf(path, sizeof path, "%d/stat", static_cast<int>(pid));
  const int proc = ::open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (proc < 0) return std::nullopt;
  char buf[1024];
  ssize_t n = read_small_file(path, buf, sizeof buf, proc);
  ::close(proc);
  if (n <= 0) return std::nullopt;
  // comm (field 2) may contain spaces and parentheses: fields resume after the last ')'.
  const char* close = std::strrchr(buf, ')');
  if (!close) return std::nullopt;
  std::string_view rest(close + 1);
  // After ')' come fields 3..; start time is field 22, i.e. the 20th after the ')'.
  int field = 2;
  std::size_t i = 0;
  while (i < rest.size()) {
    while (i < rest.size() && rest[i] == ' ') ++i;
    std::size_t j = i;
    while (j < rest.size() && rest[j] != ' ') ++j;
    if (j == i) break;
    ++field;
    if (field == 22) {
      std::uint64_t v = 0;
      if (!parse_decimal(rest.substr(i, j - i), &v)) return std::nullopt;
      return v;
    }
    i = j;
  }
  return std::nullopt;
}

std::optional<uid_t> process_uid(pid_t pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d", static_cast<int>(pid));
  struct stat st;
  if (::stat(path, &st) != 0) return std::nullopt;
  return st.st_uid;
}

bool record_process_alive(const RecordName& name) {
  auto start = process_start_time(name.pid);
  if (!start || *start != name.start_time) return false;
  auto uid = process_uid(name.pid);
  return uid && *uid == name.uid;
}

std::string self_exe() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return {};
  return std::string(buf, static_cast<std::size_t>(n));
}

std::string self_cmdline() {
  char buf[4096];
  ssize_t n = read_small_file("/proc/self/cmdline", buf, sizeof buf);
  if (n <= 0) return {};
  std::string s(buf, static_cast<std::size_t>(n));
  while (!s.empty() && s.back() == '\0') s.pop_back();
  for (char& c : s)
    if (c == '\0') c = ' ';
  return s;
}

std::uint64_t realtime_ns() noexcept {
  timespec ts;
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000ull +
         static_cast<std::uint64_t>(ts.tv_nsec);
}

}  // namespace gpustitch::shm
