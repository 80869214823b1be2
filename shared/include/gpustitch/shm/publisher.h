// StatsPublisher: the PoolObserver that makes a process's pool visible to gpustitchd and the
// gpustitch CLI through its shared-memory record.
//
// Cost model: nothing happens on on_allocate/on_free (the base class's empty inline bodies), so
// the allocation path pays one virtual call through the observer fan-out. A background thread
// wakes every publish_interval_ms, takes Pool::stats(d) for every device and publishes it under
// the record's seqlock; events (oom, stitch, trim, release) go straight into the record's event
// ring from whichever thread raised them, lock-free.
//
// Robustness inside other people's processes: nothing throws; a failure to create the record
// leaves the publisher inactive (active() == false) and the program unaffected. The thread blocks
// all signals. After fork() the child neither writes the parent's record nor joins the parent's
// thread. If the record's name disappears (systemd-logind RemoveIPC when the user's last session
// ends, or rm), the thread re-creates it within one interval and carries the events over.
//
// Lifetime: the publisher must be destroyed (or stop()ped) before the pool it reads; the
// destructor stops the thread and removes the record. A publisher still alive when the process
// calls exit() is stopped by an atexit handler (the preload library never destroys its pool or
// observers), so a clean exit always removes the record; _exit() or a fatal signal leaves it for
// gpustitchd (or the user's next publisher) to remove.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "gpustitch/config.h"
#include "gpustitch/shm/record.h"
#include "gpustitch/shm/record_writer.h"
#include "gpustitch/stats.h"

namespace gpustitch {
class Pool;
}

namespace gpustitch::shm {

// Converts the core's statistics into the record's fixed layout.
DeviceCounters to_counters(const gpustitch::DeviceStats& stats, int ordinal) noexcept;
RecordEvent to_record_event(const gpustitch::PoolEvent& event) noexcept;

// Where the publisher's numbers come from: a Pool in production, anything in tests.
struct StatsSource {
  std::function<int()> device_count;
  std::function<gpustitch::DeviceStats(int)> stats;
};

// Every member has its default here, so that PublisherOptions{.prefix = p} names only what differs.
struct PublisherOptions {
  std::string prefix = std::string(kDefaultPrefix);  // tests use their own
  // Called on the publisher's thread once per interval, after publishing, without its locks held
  // (the preload library polls snapshot requests and refreshes the site table here). Empty: none.
  std::function<void()> on_tick = {};
  // Called while publishing, for each device's counters after they were filled from the pool's
  // statistics: layers above the core add theirs (the coop_* counters). Must be cheap, noexcept.
  // Empty: none.
  std::function<void(int device, DeviceCounters& counters)> augment = {};
};

class StatsPublisher final : public gpustitch::PoolObserver {
 public:
  // Reads pool.stats(d) for d < pool.device_count(). Publishes only when config.publish is on,
  // every config.publish_interval_ms (at least 1 ms).
  StatsPublisher(const gpustitch::Pool& pool, const gpustitch::Config& config,
                 PublisherOptions options = {}) noexcept;
  StatsPublisher(StatsSource source, const gpustitch::Config& config,
                 PublisherOptions options = {}) noexcept;
  ~StatsPublisher() override;
  StatsPublisher(const StatsPublisher&) = delete;
  StatsPublisher& operator=(const StatsPublisher&) = delete;

  void on_event(const gpustitch::PoolEvent& event) noexcept override;

  // Whether a record exists and the thread runs.
  bool active() const noexcept;
  // Why not active ("" when active).
  std::string error() const;
  // The record's object name ("" when inactive).
  std::string record_name() const;

  // Publishes a snapshot now, from the calling thread (serialized with the background thread).
  void publish_now() noexcept;
  // Device UUIDs (cuDeviceGetUuid) shown by the CLI and exported as the "uuid" label.
  void set_device_uuid(int device, const std::uint8_t (&uuid)[kUuidBytes]) noexcept;
  // Events of kinds the core does not raise (coop_give/coop_receive). Any thread.
  void record_event(const RecordEvent& event) noexcept;
  // Replaces the allocation-site table (the site sampler calls this). Any thread.
  void publish_sites(std::span<const Site> sites) noexcept;

  // Stops the thread and removes the record; idempotent. Called by the destructor.
  void stop() noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;  // null: out of memory at construction, or left by a forked child
  bool left_in_child_ = false;  // stop() ran in a forked child, which leaks the parent's state
};

}  // namespace gpustitch::shm
