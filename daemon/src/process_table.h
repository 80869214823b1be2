// The daemon's view of every publishing process: discovery, sampling, exit detection, history.
//
// Each sampling pass lists /dev/shm for record names, opens new ones (validating them, see
// record_reader.h) and keeps their descriptors open, then for every tracked process:
//   * checks that it still runs: /proc/<pid>/stat must show the start time in the record's name
//     and /proc/<pid> must belong to the record's owner. A pid reused by another process fails
//     the start-time check, so a recycled pid is never taken for the dead process;
//   * copies a snapshot under the seqlock (bounded retries; a busy record keeps its last good
//     snapshot) and the event ring when its head moved;
//   * appends a history sample per device (a ring of history_capacity() samples).
// A process that exited is dropped and its record removed (reap). A record whose name vanished
// while its process runs (systemd-logind RemoveIPC) stays tracked through the open descriptor
// until the publisher re-creates the name, whose new inode then replaces the old one.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "daemon_config.h"
#include "gpustitch/shm/gpu_inventory.h"
#include "gpustitch/shm/record_reader.h"
#include "kube_cgroup.h"

namespace gpustitch::daemon {

struct HistoryPoint {
  std::uint64_t time_ns;
  std::uint64_t allocated;
  std::uint64_t reserved;
  std::uint64_t largest_free;
};

// Fixed-capacity ring of samples.
class History {
 public:
  explicit History(std::size_t capacity = 1) : capacity_(capacity) {}
  void push(const HistoryPoint& p);
  void set_capacity(std::size_t capacity);
  // Oldest first, only points at or after since_ns.
  std::vector<HistoryPoint> points(std::uint64_t since_ns = 0) const;
  std::size_t size() const { return points_.size(); }

 private:
  std::size_t capacity_;
  std::size_t next_ = 0;  // where the next point goes once full
  std::vector<HistoryPoint> points_;
};

// An owned file descriptor.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  ~UniqueFd();
  int get() const { return fd_; }

 private:
  int fd_ = -1;
};

// Members default to empty, so that TrackedProcess{reader} names only the reader.
struct TrackedProcess {
  shm::RecordReader reader;
  // pidfd of the process (pidfd_open), taken before its start time was checked, so it refers to
  // the record's writer and not to a later process with the same pid. Exit = readable. -1 when
  // the kernel lacks pidfds: liveness then falls back to /proc on every pass.
  UniqueFd pidfd = {};
  shm::SnapshotCopy snapshot = {};
  bool have_snapshot = false;
  std::uint64_t event_head = 0;
  std::vector<shm::EventCopy> events = {};
  std::uint64_t events_dropped = 0;
  std::vector<History> history = {};  // per device
  std::string user = {};
  std::uint64_t first_seen_ns = 0;
  std::uint64_t last_sample_ns = 0;
  unsigned busy_passes = 0;               // consecutive passes without a consistent snapshot
  bool devices_logged = false;            // "claims more devices than the node has" was logged
  std::optional<KubeIdentity> kube = {};  // its pod and container, from its cgroup (kube_cgroup.h)

  const shm::RecordName& name() const { return reader.name(); }
};

struct PassStats {
  std::size_t discovered = 0;
  std::size_t tracked = 0;
  std::size_t added = 0;
  std::size_t exited = 0;
  std::size_t reaped = 0;
  std::size_t rejected = 0;
  std::size_t busy = 0;
  // Names validated or checked against /proc this pass (the costly part). A name already judged
  // (same inode) is not examined again, so stray files cost a directory entry each, not a
  // validation each pass.
  std::size_t examined = 0;
  std::size_t over_quota = 0;  // not tracked: their user's max_records_per_uid, or max_records
  std::uint64_t wall_ns = 0;
  std::uint64_t cpu_ns = 0;
};

class ProcessTable {
 public:
  explicit ProcessTable(DaemonConfig config);
  void reconfigure(const DaemonConfig& config);

  // One sampling pass (see the top of this file).
  PassStats sample();

  // Tracked processes by pid.
  const std::map<pid_t, TrackedProcess>& processes() const { return processes_; }
  const TrackedProcess* find(pid_t pid) const;
  const PassStats& last_pass() const { return last_pass_; }
  // Sampling passes completed since start: a process whose record existed before pass N began and
  // that ran until pass N ended is tracked from then on (the soak test relies on this).
  std::uint64_t passes() const { return passes_; }
  // The node's GPUs (config nvidia_gpus_dir), re-read every 10 s and on reconfigure().
  const shm::GpuInventory& gpus() const { return gpus_; }
  const DaemonConfig& config() const { return config_; }

 private:
  void add(const shm::RecordName& name, PassStats* stats);
  void reap(const shm::RecordName& name, ino_t inode, PassStats* stats);
  void sample_one(TrackedProcess& p, std::uint64_t now, PassStats* stats);
  // Pids of tracked processes that exited (one poll() over every pidfd).
  std::set<pid_t> exited_processes();
  // Whether a record of uid may be tracked now (max_records, max_records_per_uid); logs once when
  // a limit starts to bite.
  bool within_quota(uid_t uid);
  void forget(std::map<pid_t, TrackedProcess>::iterator it);
  void refresh_gpus(std::uint64_t mono_ns, bool force);

 public:
  // Devices per process that get a history (max_devices, or the driver's GPU count).
  std::size_t device_limit() const { return device_limit_; }

 private:
  std::size_t device_limit_ = 16;
  shm::GpuInventory gpus_;
  std::uint64_t gpus_read_ns_ = 0;
  std::map<uid_t, std::size_t> tracked_by_uid_;
  std::set<uid_t> quota_logged_;
  bool max_logged_ = false;

  DaemonConfig config_;
  std::map<pid_t, TrackedProcess> processes_;
  // Records rejected by validation, by object name, so that each is logged once and not
  // re-validated every pass while unchanged.
  struct Rejected {
    ino_t inode = 0;
    shm::ReadError error = shm::ReadError::none;
    bool logged = false;
    bool transient = false;  // caught while its writer creates it: look again next pass
    // Its process is not (or no longer) the one the name says, and the name could not be removed
    // (not its owner's file, or reap off): looked at again only after kRecheckNs.
    bool dead = false;
    std::uint64_t judged_ns = 0;
    std::uint64_t seen_pass = 0;  // the last pass that listed it (the others are forgotten)
  };
  std::map<std::string, Rejected> rejected_;
  PassStats last_pass_;
  std::uint64_t passes_ = 0;
};

}  // namespace gpustitch::daemon
