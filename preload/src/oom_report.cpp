// The out-of-memory line: the figures, a verdict, and who holds the GPU.
//
// A user who meets an out-of-memory first wants to know which of two things happened:
// - a real shortage: the request is larger than everything this process could get, the device's
//   free memory and the pool's cached memory together (Pool::mem_info's free). Only freeing
//   memory, here or in another process, helps;
// - it would have fit: that much memory is free or cached, but the pool could not put one range
//   of that size together (the cap, or pieces it cannot stitch). The line then names the largest
//   allocation that can succeed now.
// and, since memory on a shared GPU is often held by someone else, which processes hold the most
// of it. Those come from the statistics records every gpustitch process publishes
// (shared/include/gpustitch/shm): the calling user's own processes on the GPU with this UUID,
// largest reserved first, this process included (from its live figures). Other users' records are
// not readable by design (mode 0600); `gpustitch ps` through the daemon shows them to an admin.
//
// Reading the records costs a directory scan and one pread per record, so it runs at most once a
// second: a framework probing sizes by repeated failures (PyTorch's cudnn workspace guess halves
// its request until one succeeds) gets the figures and the verdict on every line and the holders
// on the first. Nothing here throws; on any failure the line is simply shorter.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "gpustitch/shm/names.h"
#include "gpustitch/shm/record_reader.h"
#include "shim.h"

namespace gpustitch::preload {
namespace {

constexpr std::size_t kMaxHolders = 3;
constexpr std::size_t kMaxRecordsRead = 256;
constexpr std::uint64_t kHoldersIntervalNs = 1'000'000'000;
constexpr std::size_t kMaxCommand = 48;

std::atomic<std::uint64_t> g_last_holders_ns{0};

std::string human(std::uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024.0 && u < 4) v /= 1024.0, ++u;
  return u == 0 ? fmt::format("{} B", b) : fmt::format("{:.2f} {}", v, units[u]);
}

struct Holder {
  pid_t pid;
  std::uint64_t reserved;
  std::string command;
};

// The command a record names, short: its command line (NULs separate the words) with the program
// reduced to its file name, or its executable; never a control character.
std::string short_command(const shm::ProcessIdentity& id) {
  std::string c = id.cmdline.empty() ? id.exe : id.cmdline;
  std::replace(c.begin(), c.end(), '\0', ' ');
  while (!c.empty() && c.back() == ' ') c.pop_back();
  const std::size_t end = std::min(c.find(' '), c.size());
  const std::size_t slash = c.rfind('/', end == 0 ? 0 : end - 1);
  if (slash != std::string::npos && slash < end) c.erase(0, slash + 1);
  for (char& ch : c) {
    if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f) ch = '?';
  }
  if (c.size() > kMaxCommand) c = c.substr(0, kMaxCommand - 3) + "...";
  return c;
}

std::vector<Holder> holders(Pool& pool, int device) {
  std::vector<Holder> out;
  const pid_t self = ::getpid();
  const DeviceStats mine = pool.stats(device);
  out.push_back({self, mine.bytes_reserved, "this process"});
  DeviceUuid uuid{};
  if (pool.backend().device_uuid(device, &uuid) != Status::ok) return out;
  const uid_t uid = ::geteuid();
  std::size_t read = 0;
  for (const shm::RecordName& name : shm::discover_records(shm::kDefaultPrefix, uid)) {
    if (name.pid == self || read >= kMaxRecordsRead) continue;
    if (!shm::record_process_alive(name)) continue;
    ++read;
    shm::ReadError err{};
    auto reader = shm::RecordReader::open(name, uid, &err);
    if (!reader) continue;
    shm::SnapshotCopy snap;
    if (reader->read_snapshot(&snap) != shm::ReadError::none) continue;
    for (const auto& d : snap.devices) {
      if (std::memcmp(d.uuid, uuid.data(), shm::kUuidBytes) == 0 && d.bytes_reserved > 0) {
        out.push_back({name.pid, d.bytes_reserved, short_command(reader->identity())});
        break;
      }
    }
  }
  std::sort(out.begin(), out.end(),
            [](const Holder& a, const Holder& b) { return a.reserved > b.reserved; });
  if (out.size() > kMaxHolders) out.resize(kMaxHolders);
  return out;
}

bool holders_due() noexcept {
  const std::uint64_t now = shm::realtime_ns();
  std::uint64_t last = g_last_holders_ns.load(std::memory_order_relaxed);
  if (last != 0 && now >= last && now - last < kHoldersIntervalNs) return false;
  return g_last_holders_ns.compare_exchange_strong(last, now, std::memory_order_relaxed);
}

}  // namespace

std::string oom_message(Pool& pool, int device, std::size_t size, bool with_holders) {
  const DeviceStats s = pool.stats(device);
  std::size_t obtainable = 0, total = 0;
  if (pool.mem_info(device, &obtainable, &total) != Status::ok) {
    obtainable = s.device_free + s.bytes_cached;
  }
  std::string line = fmt::format(
      "out of memory on device {}: requested {}, device free {}, pool cached {}, largest "
      "possible {}, fragmentation {:.1f}%",
      device, human(size), human(s.device_free), human(s.bytes_cached), human(s.largest_possible),
      100.0 * s.fragmentation());
  if (size > obtainable) {
    line += fmt::format(
        "; verdict: real shortage, {} more than device free + pool cached ({}) together",
        human(size - obtainable), human(obtainable));
  } else {
    line += fmt::format(
        "; verdict: would have fit, device free + pool cached is {}, but no {} range could be "
        "put together (largest possible {})",
        human(obtainable), human(size), human(s.largest_possible));
  }
  if (with_holders) {
    std::vector<Holder> hs = holders(pool, device);
    if (!hs.empty()) {
      line += "; holding most on this GPU:";
      for (std::size_t i = 0; i < hs.size(); ++i) {
        line += fmt::format("{}pid {} ({}) {}", i == 0 ? " " : ", ", hs[i].pid, hs[i].command,
                            human(hs[i].reserved));
      }
    }
  }
  return line;
}

void log_oom(Pool& pool, int device, std::size_t size) noexcept {
  try {
    log().error("{}", oom_message(pool, device, size, holders_due()));
  } catch (...) {
  }
}

}  // namespace gpustitch::preload
