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
// on the daemon's socket. The daemon believes only SO_PEERCRED: the asker must be a tracked
// process with a device of that UUID in its record (so only a process really on that GPU can
// make others release, and only idle cache). It forwards the request, with the asker as origin,
// to other users' processes on that GPU with cached memory, and answers at once with
//   {"ok":true,"asked":K,"bytes":B}
// (the asker then watches the device's free memory). Relays are rate-limited per asking uid.
//
// Replies from the processes come back to the daemon's socket and are only counted.
#pragma once

#include <sys/types.h>

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "daemon_config.h"
#include "gpustitch/coop/channel.h"
#include "process_table.h"
#include "request.h"

namespace gpustitch::daemon {

using Uuid = std::array<std::uint8_t, coop::kUuidBytes>;

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
std::vector<std::pair<Uuid, std::uint64_t>> gpus_below_floor(
    const std::map<pid_t, TrackedProcess>& processes, std::uint64_t floor);

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (as in the records' JSON) -> bytes.
std::optional<Uuid> parse_uuid(std::string_view text);

class CoopRelay {
 public:
  CoopRelay();
  // After a sampling pass: the floor (no-op when coop_floor_mb is 0).
  void after_sample(const ProcessTable& table, const DaemonConfig& config);
  // A request line that is a coop_release: the answer line. nullopt: not ours (handle_request).
  std::optional<std::string> handle(std::string_view line, const Peer& peer,
                                    const ProcessTable& table, const DaemonConfig& config);

  std::uint64_t floor_requests() const { return floor_requests_; }
  std::uint64_t relayed_requests() const { return relayed_requests_; }

 private:
  int send(const std::vector<CoopTarget>& targets, const Uuid& uuid, pid_t origin);
  void drain_replies();
  std::optional<coop::Socket> socket_;
  std::map<Uuid, std::uint64_t> last_floor_ns_;
  std::map<uid_t, coop::TokenBucket> relay_buckets_;
  std::uint64_t next_id_ = 1;
  std::uint64_t floor_requests_ = 0, relayed_requests_ = 0, released_ = 0;
};

}  // namespace gpustitch::daemon
