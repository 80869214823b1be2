// Which processes are really on which GPU, from something a user cannot forge: the statistics
// records say which GPU (UUID) a process uses, but a record is written by its process, so a user
// can make one up. The cooperative-release relay and floor (coop_relay.h) ask this instead.
//
// Evidence, best first:
//   1. NVML (libnvidia-ml.so.1, loaded at run time where installed): the driver's list of compute
//      processes on that GPU. A process is there only if it holds a context on it.
//   2. /proc/<pid>/fd: the process holds the GPU's device file (/dev/nvidia<minor>, the minor
//      from /proc/driver/nvidia/gpus/*/information) open. Weaker: any user allowed to open the
//      device file can open it without using the GPU; it proves access to that GPU (which is what
//      device cgroups and CUDA_VISIBLE_DEVICES-free containers grant), not use. Needs the right to
//      read other users' /proc/<pid>/fd (root or CAP_SYS_PTRACE).
//   3. Neither: unknown, and the callers refuse what would act on other users' processes.
#pragma once

#include <sys/types.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "gpustitch/coop/channel.h"

namespace gpustitch::daemon {

using Uuid = std::array<std::uint8_t, coop::kUuidBytes>;

class GpuMembership {
 public:
  virtual ~GpuMembership() = default;
  // true: pid is on the GPU uuid; false: it is not; nullopt: cannot tell on this node.
  virtual std::optional<bool> on_gpu(pid_t pid, const Uuid& uuid) = 0;
};

struct DriverPaths {
  std::string gpus_dir = "/proc/driver/nvidia/gpus";  // <bus id>/information per GPU
  std::string device_prefix = "/dev/nvidia";          // + minor
  std::string proc_dir = "/proc";
  bool use_nvml = true;
};

// The driver's view (NVML, else open device files), with short-lived caches: the relay and the
// floor ask a few times per second at most.
class DriverMembership : public GpuMembership {
 public:
  explicit DriverMembership(DriverPaths paths = {});
  ~DriverMembership() override;
  std::optional<bool> on_gpu(pid_t pid, const Uuid& uuid) override;

 private:
  struct Nvml;
  void refresh_minors(std::uint64_t now);
  DriverPaths paths_;
  std::unique_ptr<Nvml> nvml_;
  std::map<Uuid, unsigned> minors_;  // GPU UUID -> device minor
  std::uint64_t minors_ns_ = 0;
  struct FdScan {
    std::uint64_t time_ns = 0;
    bool readable = false;
    std::set<unsigned> minors;  // of the /dev/nvidia<minor> files the process holds open
  };
  std::map<pid_t, FdScan> scans_;
};

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (as in the records' JSON and NVML) -> bytes.
std::optional<Uuid> parse_uuid(std::string_view text);
std::string uuid_text(const Uuid& uuid);

}  // namespace gpustitch::daemon
