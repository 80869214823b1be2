// gpustitchd's part in cooperative release (docs/coop.md): the free-memory floor and the relay of
// requests across users.
//
// Floor. With coop_floor_mb set, after every sampling pass the daemon looks at each GPU (by UUID)
// in the records: when the freshest device_free reported for it is below the floor, it asks the
// processes on that GPU that hold cached memory, largest first, to release what brings it back
// to the floor. At most one round per GPU per second; each process's own rate limit applies too.
//
// Relay. Preloaded processes ask neighbours of their own user directly; other users' processes
// accept requests only from root, i.e. from the daemon. A process asks the daemon with
//   {"cmd":"coop_release","uuid":"GPU-...","bytes":N}
// on the daemon's socket. The daemon believes only SO_PEERCRED and the driver: the asker must be a
// tracked process with a device of that UUID in its record, and the driver must show it on that
// GPU (gpu_membership.h: NVML's compute processes, else the GPU's device file open in the asker);
// where the driver cannot tell (no NVIDIA driver), the relay refuses. A record alone proves
// nothing, since its process writes it. The daemon forwards the request, with the asker as
// origin, to other users' processes on that GPU with cached memory, and answers at once with
//   {"ok":true,"asked":K,"bytes":B}
// (the asker then watches the device's free memory). Relays are rate-limited per asking uid.
//
// The floor counts only the reports of processes the driver shows on the GPU, the same way.
//
// Replies from the processes come back to the daemon's socket and are only counted.
#pragma once

#include <sys/types.h>

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "daemon_config.h"
#include "gpu_membership.h"
#include "gpustitch/coop/channel.h"
#include "process_table.h"
#include "request.h"

namespace gpustitch::daemon {

struct CoopTarget {
  pid_t pid = 0;
  std::uint64_t start_time = 0;
  uid_t uid = 0;
  std::uint64_t bytes = 0;  // asked of this process
};

// Processes on the GPU `uuid` with cached memory, largest first, each asked for its share of
// `wanted` (none beyond it). exclude_uid: skip that user's processes (the relay's asker asks its
// own user's processes itself).
std::vector<CoopTarget> plan_release(const std::map<pid_t, TrackedProcess>& processes,
                                     const Uuid& uuid, std::uint64_t wanted,
                                     std::optional<uid_t> exclude_uid = std::nullopt,
                                     pid_t exclude_pid = 0);

// GPUs (by UUID) whose freshest reported free memory is below floor, with how much is missing.
// trusted (when set): whether a process's report counts, i.e. whether it really is on that GPU.
std::vector<std::pair<Uuid, std::uint64_t>> gpus_below_floor(
    const std::map<pid_t, TrackedProcess>& processes, std::uint64_t floor,
    const std::function<bool(pid_t, const Uuid&)>& trusted = {});

class CoopRelay {
 public:
  // membership: who really is on which GPU; nullptr = the driver's view (DriverMembership).
  explicit CoopRelay(std::unique_ptr<GpuMembership> membership = nullptr);
  // After a sampling pass: the floor (no-op when coop_floor_mb is 0).
  void after_sample(const ProcessTable& table, const DaemonConfig& config);
  // A request line that is a coop_release: the answer line. nullopt: not ours (handle_request).
  std::optional<std::string> handle(std::string_view line, const Peer& peer,
                                    const ProcessTable& table, const DaemonConfig& config);

  std::uint64_t floor_requests() const { return floor_requests_; }
  std::uint64_t relayed_requests() const { return relayed_requests_; }
  // Relays refused: the driver shows the asker elsewhere / cannot tell.
  std::uint64_t refused_requests() const { return refused_; }
  std::uint64_t unverified_requests() const { return unverified_; }

 private:
  int send(const std::vector<CoopTarget>& targets, const Uuid& uuid, pid_t origin);
  void drain_replies();
  std::optional<coop::Socket> socket_;
  std::unique_ptr<GpuMembership> membership_;
  std::uint64_t refused_ = 0, unverified_ = 0;
  std::map<Uuid, std::uint64_t> last_floor_ns_;
  std::map<uid_t, coop::TokenBucket> relay_buckets_;
  std::uint64_t next_id_ = 1;
  std::uint64_t floor_requests_ = 0, relayed_requests_ = 0, released_ = 0;
};

}  // namespace gpustitch::daemon
