// The driver's view of which processes are on which GPU. See gpu_membership.h.
#include "gpu_membership.h"

#include <dirent.h>
#include <dlfcn.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "daemon_config.h"
#include "gpustitch/shm/gpu_inventory.h"

namespace gpustitch::daemon {
namespace {

constexpr std::uint64_t kMinorsTtlNs = 10'000'000'000ull;  // GPUs do not come and go often
constexpr std::uint64_t kScanTtlNs = 2'000'000'000ull;     // a process's open device files
constexpr std::uint64_t kNvmlTtlNs = 1'000'000'000ull;     // a GPU's compute processes

std::uint64_t now_ns() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return std::uint64_t(ts.tv_sec) * 1000000000ull + std::uint64_t(ts.tv_nsec);
}

}  // namespace

std::optional<Uuid> parse_uuid(std::string_view text) {
  Uuid u{};
  if (!shm::parse_uuid_text(text, &u)) return std::nullopt;
  return u;
}

std::string uuid_text(const Uuid& u) {
  char buf[64];
  std::snprintf(buf, sizeof buf,
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
                u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13],
                u[14], u[15]);
  return buf;
}

// NVML, loaded at run time: the daemon does not depend on the driver being installed.
struct DriverMembership::Nvml {
  using Device = void*;
  struct ProcessInfo {  // nvmlProcessInfo_t (v2 and v3 of the query)
    unsigned int pid;
    unsigned long long used_gpu_memory;
    unsigned int gpu_instance_id;
    unsigned int compute_instance_id;
  };
  using GetByUuid = int (*)(const char*, Device*);
  using GetProcesses = int (*)(Device, unsigned int*, ProcessInfo*);
  static constexpr int kInsufficientSize = 7;  // NVML_ERROR_INSUFFICIENT_SIZE

  void* lib = nullptr;
  GetByUuid by_uuid = nullptr;
  GetProcesses processes = nullptr;
  struct Entry {
    std::uint64_t time_ns = 0;
    bool known = false;
    std::set<pid_t> pids;
  };
  std::map<Uuid, Entry> cache;

  static std::unique_ptr<Nvml> load() {
    void* lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return nullptr;
    auto init = reinterpret_cast<int (*)()>(::dlsym(lib, "nvmlInit_v2"));
    auto n = std::make_unique<Nvml>();
    n->lib = lib;
    n->by_uuid = reinterpret_cast<GetByUuid>(::dlsym(lib, "nvmlDeviceGetHandleByUUID"));
    n->processes =
        reinterpret_cast<GetProcesses>(::dlsym(lib, "nvmlDeviceGetComputeRunningProcesses_v3"));
    if (!n->processes)
      n->processes =
          reinterpret_cast<GetProcesses>(::dlsym(lib, "nvmlDeviceGetComputeRunningProcesses_v2"));
    if (!init || !n->by_uuid || !n->processes || init() != 0) {
      ::dlclose(lib);
      return nullptr;
    }
    return n;
  }
  ~Nvml() {
    if (auto shutdown = reinterpret_cast<int (*)()>(::dlsym(lib, "nvmlShutdown"))) shutdown();
    ::dlclose(lib);
  }
  // The compute processes on that GPU, or nullopt when NVML does not know it.
  const Entry& query(const Uuid& uuid, std::uint64_t now) {
    Entry& e = cache[uuid];
    if (e.time_ns != 0 && now - e.time_ns < kNvmlTtlNs) return e;
    e = Entry{now, false, {}};
    Device dev = nullptr;
    if (by_uuid(uuid_text(uuid).c_str(), &dev) != 0) return e;
    std::vector<ProcessInfo> infos(64);
    for (int attempt = 0; attempt < 4; ++attempt) {
      unsigned int count = static_cast<unsigned int>(infos.size());
      int rc = processes(dev, &count, infos.data());
      if (rc == kInsufficientSize) {
        infos.resize(std::max<std::size_t>(count, infos.size() * 2));
        continue;
      }
      if (rc != 0) return e;
      e.known = true;
      for (unsigned int i = 0; i < count && i < infos.size(); ++i)
        e.pids.insert(static_cast<pid_t>(infos[i].pid));
      return e;
    }
    return e;
  }
};

DriverMembership::DriverMembership(DriverPaths paths) : paths_(std::move(paths)) {
  if (paths_.use_nvml) nvml_ = Nvml::load();
}

DriverMembership::~DriverMembership() = default;

void DriverMembership::refresh_minors(std::uint64_t now) {
  if (minors_ns_ != 0 && now - minors_ns_ < kMinorsTtlNs) return;
  minors_ns_ = now;
  minors_.clear();
  const shm::GpuInventory gpus = shm::GpuInventory::read(paths_.gpus_dir);
  for (const auto& g : gpus.gpus())
    if (g.minor >= 0) minors_[g.uuid] = static_cast<unsigned>(g.minor);
}

std::optional<bool> DriverMembership::on_gpu(pid_t pid, const Uuid& uuid) {
  const std::uint64_t now = now_ns();
  if (nvml_) {
    const auto& e = nvml_->query(uuid, now);
    if (e.known) return e.pids.count(pid) > 0;
  }
  refresh_minors(now);
  if (minors_.empty()) return std::nullopt;  // no driver to ask
  auto m = minors_.find(uuid);
  if (m == minors_.end()) return false;  // not a GPU of this node
  FdScan& scan = scans_[pid];
  if (scan.time_ns == 0 || now - scan.time_ns >= kScanTtlNs) {
    scan = FdScan{now, false, {}};
    std::string fd_dir = paths_.proc_dir + "/" + std::to_string(pid) + "/fd";
    if (DIR* dir = ::opendir(fd_dir.c_str())) {
      scan.readable = true;
      while (dirent* e = ::readdir(dir)) {
        if (e->d_name[0] == '.') continue;
        char target[256];
        ssize_t n = ::readlink((fd_dir + "/" + e->d_name).c_str(), target, sizeof target - 1);
        if (n <= 0) continue;
        std::string_view t(target, static_cast<std::size_t>(n));
        if (t.rfind(paths_.device_prefix, 0) != 0) continue;
        t.remove_prefix(paths_.device_prefix.size());
        unsigned minor = 0;
        bool digits = !t.empty() && t.size() < 6;
        for (char c : t) {
          digits = digits && c >= '0' && c <= '9';
          minor = minor * 10 + static_cast<unsigned>(c - '0');
        }
        if (digits) scan.minors.insert(minor);
      }
      ::closedir(dir);
    }
    // Forget scans of processes not asked about for a while.
    std::erase_if(scans_,
                  [&](const auto& kv) { return now - kv.second.time_ns > 60 * kScanTtlNs; });
  }
  const FdScan& s = scans_[pid];
  if (!s.readable) return std::nullopt;
  return s.minors.count(m->second) > 0;
}

}  // namespace gpustitch::daemon
