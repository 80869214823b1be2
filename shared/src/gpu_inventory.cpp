// The driver's list of GPUs. See gpustitch/shm/gpu_inventory.h.
#include "gpustitch/shm/gpu_inventory.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace gpustitch::shm {
namespace {

constexpr std::size_t kMaxInformationBytes = 64 << 10;
constexpr std::size_t kMaxGpus = 256;  // a directory of made-up entries cannot grow us further

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r'))
    s.remove_suffix(1);
  return s;
}

// At most limit bytes of a regular file, never blocking on a FIFO (procfs files report size 0,
// so read until end of file).
bool read_small_file(const std::string& path, std::size_t limit, std::string* out) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return false;
  struct stat st;
  bool ok = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  out->clear();
  char buf[4096];
  while (ok) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ok = n == 0;
      break;
    }
    if (out->size() + static_cast<std::size_t>(n) > limit)
      ok = false;
    else
      out->append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return ok;
}

// Printable ASCII only: a model name goes into terminal output and Prometheus labels.
std::string clean(std::string_view s, std::size_t max) {
  std::string out;
  for (char c : s.substr(0, max)) out += (c >= 0x20 && c < 0x7f) ? c : '?';
  return out;
}

}  // namespace

bool parse_uuid_text(std::string_view text, std::array<std::uint8_t, kUuidBytes>* out) {
  if (text.rfind("GPU-", 0) == 0) text.remove_prefix(4);
  std::array<std::uint8_t, kUuidBytes> u{};
  std::size_t n = 0;
  int half = -1;
  for (char c : text) {
    if (c == '-') continue;
    int v = c >= '0' && c <= '9'   ? c - '0'
            : c >= 'a' && c <= 'f' ? c - 'a' + 10
            : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                   : -1;
    if (v < 0 || n >= u.size()) return false;
    if (half < 0) {
      half = v;
    } else {
      u[n++] = static_cast<std::uint8_t>(half * 16 + v);
      half = -1;
    }
  }
  if (n != u.size() || half >= 0) return false;
  *out = u;
  return true;
}

bool GpuInventory::parse_information(std::string_view text, GpuInfo* out) {
  GpuInfo g;
  bool have_uuid = false;
  while (!text.empty()) {
    std::size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view{} : text.substr(nl + 1);
    std::size_t colon = line.find(':');
    if (colon == std::string_view::npos) continue;
    std::string_view key = trim(line.substr(0, colon)), value = trim(line.substr(colon + 1));
    if (key == "Model") {
      g.name = clean(value, 96);
    } else if (key == "GPU UUID") {
      have_uuid = parse_uuid_text(value, &g.uuid);
    } else if (key == "Bus Location") {
      g.bus_id = clean(value, 32);
    } else if (key == "Device Minor") {
      char* end = nullptr;
      std::string v(value);
      long m = std::strtol(v.c_str(), &end, 10);
      if (end != v.c_str() && *end == '\0' && m >= 0 && m < 1 << 20) g.minor = static_cast<int>(m);
    }
  }
  if (!have_uuid) return false;
  *out = std::move(g);
  return true;
}

GpuInventory GpuInventory::read(const std::string& dir) {
  GpuInventory inv;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return inv;
  std::vector<std::string> entries;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    if (entries.size() >= kMaxGpus) break;
    entries.emplace_back(e->d_name);
  }
  ::closedir(d);
  // The directory names are the PCI bus ids ("0000:3b:00.0", lower-case hex, fixed width), so
  // their byte order is the bus order.
  std::sort(entries.begin(), entries.end());
  for (const auto& name : entries) {
    std::string text;
    GpuInfo g;
    if (!read_small_file(dir + "/" + name + "/information", kMaxInformationBytes, &text) ||
        !parse_information(text, &g))
      continue;
    if (g.bus_id.empty()) g.bus_id = clean(name, 32);
    if (inv.find(g.uuid)) continue;  // one entry per GPU
    g.index = static_cast<int>(inv.gpus_.size());
    inv.gpus_.push_back(std::move(g));
  }
  return inv;
}

const GpuInfo* GpuInventory::find(const std::array<std::uint8_t, kUuidBytes>& uuid) const {
  if (std::all_of(uuid.begin(), uuid.end(), [](std::uint8_t b) { return b == 0; })) return nullptr;
  for (const auto& g : gpus_)
    if (g.uuid == uuid) return &g;
  return nullptr;
}

const GpuInfo* GpuInventory::find(const std::uint8_t (&uuid)[kUuidBytes]) const {
  std::array<std::uint8_t, kUuidBytes> u;
  std::memcpy(u.data(), uuid, kUuidBytes);
  return find(u);
}

std::string gpus_dir_from_environment() {
  const char* v = std::getenv("GPUSTITCH_NVIDIA_GPUS_DIR");
  return v && *v ? std::string(v) : std::string(kDriverGpusDir);
}

}  // namespace gpustitch::shm
