#include "process_table.h"

#include <dirent.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include <spdlog/spdlog.h>

#include "gpustitch/shm/json.h"

namespace gpustitch::daemon {
namespace {
// glibc 2.36's <sys/pidfd.h> lacks extern "C"; call the system call directly (Linux >= 5.3).
int open_pidfd(pid_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
#else
  (void)pid;
  return -1;
#endif
}

std::uint64_t cpu_now_ns() {
  timespec ts;
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return std::uint64_t(ts.tv_sec) * 1000000000ull + std::uint64_t(ts.tv_nsec);
}
// How long a "its process is not there" verdict on a name that could not be removed holds. The
// name's pid and start time cannot come back to life, but a pid namespace or a clock step could
// fool the judgement, so it is looked at again now and then (50,000 such names: a few hundred ms
// each time, not every pass).
constexpr std::uint64_t kRecheckNs = 60'000'000'000ull;

std::uint64_t mono_now_ns() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return std::uint64_t(ts.tv_sec) * 1000000000ull + std::uint64_t(ts.tv_nsec);
}
}  // namespace

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) ::close(fd_);
}

void History::push(const HistoryPoint& p) {
  if (points_.size() < capacity_) {
    points_.push_back(p);
    return;
  }
  points_[next_] = p;
  next_ = (next_ + 1) % capacity_;
}

void History::set_capacity(std::size_t capacity) {
  auto all = points();
  capacity_ = std::max<std::size_t>(1, capacity);
  if (all.size() > capacity_) all.erase(all.begin(), all.end() - static_cast<long>(capacity_));
  points_ = std::move(all);
  next_ = 0;
}

std::vector<HistoryPoint> History::points(std::uint64_t since_ns) const {
  std::vector<HistoryPoint> out;
  out.reserve(points_.size());
  std::size_t n = points_.size();
  std::size_t start = n < capacity_ ? 0 : next_;
  for (std::size_t i = 0; i < n; ++i) {
    const auto& p = points_[(start + i) % n];
    if (p.time_ns >= since_ns) out.push_back(p);
  }
  return out;
}

ProcessTable::ProcessTable(DaemonConfig config) : config_(std::move(config)) {
  reconfigure(config_);
}

void ProcessTable::reconfigure(const DaemonConfig& config) {
  bool capacity_changed = config.history_capacity() != config_.history_capacity();
  bool prefix_changed = config.record_prefix != config_.record_prefix;
  config_ = config;
  refresh_gpus(mono_now_ns(), /*force=*/true);
  std::size_t gpus = config_.max_devices ? config_.max_devices : gpus_.gpus().size();
  device_limit_ = std::clamp<std::size_t>(gpus ? gpus : shm::kMaxDevices, 1, shm::kMaxDevices);
  quota_logged_.clear();
  max_logged_ = false;
  if (prefix_changed) {
    processes_.clear();
    rejected_.clear();
  }
  if (capacity_changed)
    for (auto& [pid, p] : processes_)
      for (auto& h : p.history) h.set_capacity(config_.history_capacity());
}

void ProcessTable::refresh_gpus(std::uint64_t mono_ns, bool force) {
  // GPUs do not come and go often; a hot-plugged one shows within kGpusTtlNs.
  constexpr std::uint64_t kGpusTtlNs = 10'000'000'000ull;
  if (!force && gpus_read_ns_ != 0 && mono_ns - gpus_read_ns_ < kGpusTtlNs) return;
  gpus_read_ns_ = mono_ns;
  gpus_ = shm::GpuInventory::read(config_.nvidia_gpus_dir);
}

const TrackedProcess* ProcessTable::find(pid_t pid) const {
  auto it = processes_.find(pid);
  return it == processes_.end() ? nullptr : &it->second;
}

void ProcessTable::reap(const shm::RecordName& name, ino_t inode, PassStats* stats) {
  if (!config_.reap) return;
  // Remove the name only if it still is the object we judged (compare inodes).
  struct stat st;
  std::string path = name.path();
  if (::lstat(path.c_str(), &st) != 0) return;
  if (inode != 0 && st.st_ino != inode) return;
  if (::unlink(path.c_str()) == 0) {
    ++stats->reaped;
    spdlog::debug("removed the record of exited process {} ({})", name.pid, name.object_name());
  } else {
    spdlog::debug("cannot remove {}: {}", path, std::strerror(errno));
  }
}

bool ProcessTable::within_quota(uid_t uid) {
  if (processes_.size() >= config_.max_records) {
    if (!max_logged_)
      spdlog::warn("tracking {} processes, max_records: not tracking new ones until some exit",
                   processes_.size());
    max_logged_ = true;
    return false;
  }
  max_logged_ = false;
  auto it = tracked_by_uid_.find(uid);
  if (uid != 0 && it != tracked_by_uid_.end() && it->second >= config_.max_records_per_uid) {
    if (quota_logged_.insert(uid).second)
      spdlog::warn(
          "uid {} ({}) has {} processes tracked, max_records_per_uid: not tracking its new ones "
          "until some exit",
          uid, shm::user_name(uid), it->second);
    return false;
  }
  quota_logged_.erase(uid);
  return true;
}

void ProcessTable::add(const shm::RecordName& name, PassStats* stats) {
  // Limits first, from the uid in the name: a name that claims another user's uid fails
  // validation below anyway, and only validated records count towards a quota.
  if (!within_quota(name.uid)) {
    ++stats->over_quota;
    return;
  }
  ++stats->examined;
  // Open the pidfd first: if the start time matches afterwards, the pidfd is that process's.
  UniqueFd pidfd(open_pidfd(name.pid));
  if (!shm::record_process_alive(name)) {
    ++stats->exited;
    struct stat st;
    bool found = ::lstat(name.path().c_str(), &st) == 0;
    if (found && S_ISREG(st.st_mode) && st.st_uid == name.uid) reap(name, st.st_ino, stats);
    // Still there (not its owner's, or reap off): remember the verdict for this object, so that
    // it costs no /proc lookups every pass.
    if (found && ::lstat(name.path().c_str(), &st) == 0) {
      Rejected& r = rejected_[name.object_name()];
      r = Rejected{st.st_ino, shm::ReadError::none, true,       false,
                   true,      shm::realtime_ns(),   passes_ + 1};
    }
    return;
  }
  shm::ReadError err;
  auto reader = shm::RecordReader::open(name, name.uid, &err);
  if (!reader) {
    ++stats->rejected;
    struct stat st;
    bool found = ::lstat(name.path().c_str(), &st) == 0;
    ino_t ino = found ? st.st_ino : 0;
    // A record can be seen while its writer creates it: before it is sized (an empty object:
    // bad_size) or before the store of its magic (bad_magic). Such a record is looked at again
    // next pass and logged only if it stays that way. Any other rejection is final for that
    // object (same inode) and logged once.
    bool transient = err == shm::ReadError::bad_magic ||
                     (err == shm::ReadError::bad_size && found && st.st_size == 0);
    Rejected& r = rejected_[name.object_name()];
    r.dead = false;
    r.seen_pass = passes_ + 1;
    bool same = r.inode == ino && r.error == err;
    r.transient = transient;
    if (!transient ? !same : (same && !r.logged)) {
      spdlog::warn("ignoring record {}: {}", name.object_name(), shm::to_string(err));
      r.logged = true;
    } else if (!same) {
      r.logged = false;
    }
    r.inode = ino;
    r.error = err;
    return;
  }
  rejected_.erase(name.object_name());
  TrackedProcess p{std::move(*reader)};
  p.pidfd = std::move(pidfd);
  p.user = shm::user_name(name.uid);
  p.first_seen_ns = shm::realtime_ns();
  // Read once: a process does not move between pods. The pidfd above was taken before the
  // record's start time was checked against /proc, so this is the record's process.
  p.kube = read_kube_identity(name.pid);
  auto [it, inserted] = processes_.insert_or_assign(name.pid, std::move(p));
  (void)inserted;
  ++tracked_by_uid_[name.uid];
  ++stats->added;
  spdlog::info("tracking pid {} ({}, {})", name.pid, it->second.user,
               it->second.reader.identity().exe);
}

void ProcessTable::sample_one(TrackedProcess& p, std::uint64_t now, PassStats* stats) {
  shm::SnapshotCopy snap;
  shm::ReadError err = p.reader.read_snapshot(&snap);
  if (err != shm::ReadError::none) {
    ++stats->busy;
    ++p.busy_passes;
    return;
  }
  p.busy_passes = 0;
  p.snapshot = std::move(snap);
  p.have_snapshot = true;
  p.last_sample_ns = now;
  // The snapshot carries the event ring's head: copy the ring only when it moved.
  if (p.snapshot.events_head != p.event_head) {
    std::vector<shm::EventCopy> events;
    if (p.reader.read_events(&events, &p.events_dropped) == shm::ReadError::none) {
      p.events = std::move(events);
      p.event_head = p.snapshot.events_head;
    }
  }
  // History for the devices the node has, whatever the record claims: it is the daemon's largest
  // memory (history_capacity() points per device), and a record can claim 16 devices.
  std::size_t devices = std::min(p.snapshot.devices.size(), device_limit_);
  if (devices < p.snapshot.devices.size() && !p.devices_logged) {
    p.devices_logged = true;
    spdlog::warn("pid {} claims {} devices; history kept for the first {} (max_devices)",
                 p.name().pid, p.snapshot.devices.size(), devices);
  }
  if (p.history.size() < devices) p.history.resize(devices, History(config_.history_capacity()));
  for (std::size_t d = 0; d < devices; ++d) {
    const auto& c = p.snapshot.devices[d];
    p.history[d].push({now, c.bytes_allocated, c.bytes_reserved, c.largest_free_block});
  }
}

std::set<pid_t> ProcessTable::exited_processes() {
  std::set<pid_t> gone;
  std::vector<pollfd> fds;
  std::vector<pid_t> pids;
  fds.reserve(processes_.size());
  for (const auto& [pid, p] : processes_) {
    if (p.pidfd.get() < 0) {
      if (!shm::record_process_alive(p.name())) gone.insert(pid);
      continue;
    }
    fds.push_back({p.pidfd.get(), POLLIN, 0});
    pids.push_back(pid);
  }
  if (!fds.empty() && ::poll(fds.data(), fds.size(), 0) > 0)
    for (std::size_t i = 0; i < fds.size(); ++i)
      if (fds[i].revents) gone.insert(pids[i]);
  return gone;
}

PassStats ProcessTable::sample() {
  PassStats stats;
  std::uint64_t cpu0 = cpu_now_ns(), wall0 = mono_now_ns();
  std::uint64_t now = shm::realtime_ns();
  refresh_gpus(wall0, /*force=*/false);
  std::vector<shm::RecordName> names = shm::discover_records(config_.record_prefix);
  stats.discovered = names.size();
  const std::uint64_t pass = passes_ + 1;
  tracked_by_uid_.clear();
  for (const auto& [pid, p] : processes_) ++tracked_by_uid_[p.name().uid];
  std::set<pid_t> seen;
  for (const auto& name : names) {
    seen.insert(name.pid);
    auto it = processes_.find(name.pid);
    const bool tracked_name = it != processes_.end() &&
                              it->second.name().start_time == name.start_time &&
                              it->second.name().uid == name.uid;
    if (!tracked_name && !rejected_.empty()) {
      // A name already judged, unchanged since (same inode): not examined again every pass.
      if (auto r = rejected_.find(name.object_name()); r != rejected_.end()) {
        r->second.seen_pass = pass;
        if (name.inode != 0 && r->second.inode == name.inode && !r->second.transient &&
            (!r->second.dead || now - r->second.judged_ns < kRecheckNs)) {
          ++stats.rejected;
          continue;
        }
      }
    }
    if (it == processes_.end()) {
      add(name, &stats);
      continue;
    }
    const auto& cur = it->second.name();
    if (!tracked_name) {
      // Another record for the same pid: either the pid was reused (the tracked process is gone)
      // or a stale/forged name. The liveness checks below and add() sort it out.
      if (!shm::record_process_alive(cur)) {
        processes_.erase(it);
        ++stats.exited;
        add(name, &stats);
      } else if (++stats.examined, !shm::record_process_alive(name)) {
        ++stats.exited;
        struct stat st;
        if (::lstat(name.path().c_str(), &st) == 0 && st.st_uid == name.uid)
          reap(name, st.st_ino, &stats);
        if (::lstat(name.path().c_str(), &st) == 0)
          rejected_[name.object_name()] = Rejected{st.st_ino, shm::ReadError::none, true, false,
                                                   true,      shm::realtime_ns(),   pass};
      }
      continue;
    }
    // Same name: if the publisher re-created it (new inode), switch to the new object.
    if (name.inode != 0 && name.inode != it->second.reader.inode()) {
      shm::ReadError err;
      if (auto fresh = shm::RecordReader::open(name, name.uid, &err)) {
        it->second.reader = std::move(*fresh);
        it->second.event_head = 0;
      }
    }
  }
  std::set<pid_t> gone = exited_processes();
  for (auto it = processes_.begin(); it != processes_.end();) {
    TrackedProcess& p = it->second;
    if (gone.count(it->first)) {
      spdlog::info("pid {} exited", p.name().pid);
      ++stats.exited;
      if (seen.count(it->first)) reap(p.name(), p.reader.inode(), &stats);
      it = processes_.erase(it);
      continue;
    }
    sample_one(p, now, &stats);
    ++it;
  }
  // Forget the verdicts on names that are gone (not listed this pass).
  std::erase_if(rejected_, [&](const auto& kv) { return kv.second.seen_pass != pass; });
  stats.tracked = processes_.size();
  stats.cpu_ns = cpu_now_ns() - cpu0;
  stats.wall_ns = mono_now_ns() - wall0;
  last_pass_ = stats;
  ++passes_;
  return stats;
}

}  // namespace gpustitch::daemon
