// THE place where the shim's pool observers are created from Config.
//
// Every layer that watches the pool (shared-memory statistics for gpustitchd, the allocation
// trace, allocation-site sampling, the ring of recent events behind snapshots' timelines) is a
// gpustitch::PoolObserver. The pool is created with one ObserverFanout as its observer; each
// enabled observer is constructed here, from the config and the pool, and fanout.add()ed.
// Constructors must not call into CUDA through the hooks or allocate from the pool, must not throw
// out of here (a failure is logged once and the observer left out), and must be cheap on the
// allocation path (callbacks run on the allocating thread).
#include "observers.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <new>

#include "coop.h"
#include "gpustitch/shm/publisher.h"
#include "gpustitch/sites/site_sampler.h"
#include "gpustitch/trace/recent_events.h"
#include "gpustitch/trace/snapshot.h"
#include "gpustitch/trace/trace_writer.h"
#include "program_memory.h"

namespace gpustitch::preload {
namespace {

// Set once here, read by the publisher's thread on each tick. Never destroyed: the pool and its
// observers live until the process ends (CUDA's own teardown may still free memory at exit).
std::atomic<shm::StatsPublisher*> g_publisher{nullptr};
std::atomic<sites::SiteSampler*> g_sites{nullptr};
std::atomic<Pool*> g_snapshot_pool{nullptr};
std::atomic<trace::RecentEvents*> g_recent{nullptr};

// The record's site table from the sampler's top sites.
void publish_sites(shm::StatsPublisher& publisher, sites::SiteSampler& sampler) {
  auto top = sampler.top(shm::kMaxSites);
  std::vector<shm::Site> out(top.size());
  for (std::size_t i = 0; i < top.size(); ++i) {
    shm::Site& s = out[i];
    s = {};
    s.live_bytes = top[i].live_bytes;
    s.count = top[i].live_count;
    s.device = -1;
    s.frame_count =
        static_cast<std::uint32_t>(std::min<std::size_t>(top[i].frames.size(), shm::kMaxFrames));
    for (std::uint32_t k = 0; k < s.frame_count; ++k) {
      const auto& f = top[i].frames[k];
      std::snprintf(s.frames[k].function, sizeof s.frames[k].function, "%s", f.function.c_str());
      std::snprintf(s.frames[k].library, sizeof s.frames[k].library, "%s", f.library.c_str());
      s.frames[k].offset = f.offset;
    }
  }
  publisher.publish_sites(out);
}

// The record name prefix: "gpustitch", or $GPUSTITCH_SHM_PREFIX (as the CLI reads it) so that a
// test or a second, private gpustitchd (record_prefix) can keep its processes apart. Letters,
// digits, '_' and '-' only: the prefix becomes part of a file name in /dev/shm. An invalid one
// turns publishing off (empty): falling back to the production prefix would put a process meant
// to stay apart into the node's daemon's view.
std::string record_prefix(spdlog::logger& log) {
  const char* env = std::getenv("GPUSTITCH_SHM_PREFIX");
  if (env == nullptr || *env == '\0') return std::string(shm::kDefaultPrefix);
  std::string prefix(env);
  bool valid = prefix.size() <= 64 && std::all_of(prefix.begin(), prefix.end(), [](char c) {
                 return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                        (c >= '0' && c <= '9') || c == '_' || c == '-';
               });
  if (valid) return prefix;
  log.warn(
      "GPUSTITCH_SHM_PREFIX: '{}' is not letters, digits, '_' or '-'; statistics not published",
      prefix.substr(0, 64));
  return {};
}

std::vector<trace::SnapshotFrame> snapshot_frames(const std::vector<sites::SiteFrame>& frames) {
  std::vector<trace::SnapshotFrame> out;
  out.reserve(frames.size());
  for (const auto& f : frames) out.push_back({f.library, 0, f.function});
  return out;
}

}  // namespace

// For `gpustitch snapshot PID` and gpustitch_snapshot() (PyTorch memory_viz format): the pool's
// memory map, with the stacks of live blocks when sites are sampled, and the recent events as
// device_traces. The map is built only when asked for; the allocation path keeps only the ring.
trace::SnapshotData snapshot_of(const Pool& pool) {
  std::vector<MappedSegment> segments;
  for (int d = 0; d < pool.device_count(); ++d) {
    if (pool.memory_map(d, &segments) == Status::out_of_memory) throw std::bad_alloc();
  }
  // Read the ring after the map: an allocation that lands in between is in the timeline and
  // missing from the segments, which memory_viz shows as live to the end; nothing is lost.
  std::vector<trace::RecentEvent> events;
  if (const trace::RecentEvents* recent = g_recent.load()) events = recent->read();
  sites::SiteSampler* sampler = g_sites.load();
  std::function<std::vector<trace::SnapshotFrame>(DevPtr)> block_frames;
  std::function<std::vector<trace::SnapshotFrame>(std::uint64_t)> site_frames;
  if (sampler != nullptr) {
    block_frames = [sampler](DevPtr p) { return snapshot_frames(sampler->frames_of(p)); };
    site_frames = [sampler](std::uint64_t id) {
      return snapshot_frames(sampler->frames_of_site(id));
    };
  }
  trace::SnapshotData data =
      trace::build_snapshot_from_segments(segments, pool.device_count(), block_frames);
  trace::append_device_traces(events, site_frames, &data);
  return data;
}

namespace {

// Once per statistics interval, on the publisher's thread.
void on_publisher_tick() {
  if (const Pool* pool = g_snapshot_pool.load()) {
    trace::SnapshotRequests::poll([pool] { return snapshot_of(*pool); });
  }
  shm::StatsPublisher* publisher = g_publisher.load();
  sites::SiteSampler* sampler = g_sites.load();
  if (publisher != nullptr && sampler != nullptr) publish_sites(*publisher, *sampler);
}

}  // namespace

void add_configured_observers(const Config& config, Pool& pool, ObserverFanout& fanout,
                              spdlog::logger& log) {
  // Allocation trace (trace:PATH), in RAPIDS RMM's CSV format.
  if (auto writer = trace::make_trace_writer(config)) {
    if (!writer->ok()) log.warn("not tracing to {}", config.trace_path);  // reason on stderr
    fanout.add(std::move(writer));
  }
  // Allocation sites (sites_min_mb / sites_sample).
  trace::SiteOfAllocation site_of = nullptr;
  if (auto sampler = sites::make_site_sampler(config)) {
    g_sites.store(sampler.get());
    fanout.add(std::move(sampler));
    site_of = &sites::SiteSampler::last_sampled_site;
  }
  // Recent events for snapshots' timelines (trace_events). After the sampler: its on_allocate
  // runs first on the same thread, so the ring can take the site it just captured.
  std::string why;
  if (auto recent = trace::make_recent_events(config, site_of, &why)) {
    g_recent.store(recent.get());
    fanout.add(std::move(recent));
  } else if (!why.empty()) {
    log.warn("snapshots will have no timeline: {}", why);
  }
  // Shared-memory statistics for gpustitchd and `gpustitch ps/top/show`.
  std::string prefix = config.publish ? record_prefix(log) : std::string();
  if (!prefix.empty()) {
    shm::PublisherOptions options;
    options.prefix = std::move(prefix);
    options.on_tick = on_publisher_tick;
    options.augment = [](int device, shm::DeviceCounters& counters) {
      fill_coop_counters(device, counters);
      fill_program_counters(device, counters);
    };
    auto publisher = std::make_unique<shm::StatsPublisher>(pool, config, std::move(options));
    if (!publisher->active()) {
      log.debug("statistics not published: {}", publisher->error());
    } else {
      // Device UUIDs: what tells processes (and gpustitchd) which of them share a GPU.
      for (int d = 0; d < pool.device_count() && d < shm::kMaxDevices; ++d) {
        DeviceUuid uuid{};
        if (pool.backend().device_uuid(d, &uuid) != Status::ok) continue;
        std::uint8_t raw[shm::kUuidBytes];
        std::copy(uuid.begin(), uuid.end(), raw);
        publisher->set_device_uuid(d, raw);
      }
      g_publisher.store(publisher.get());
      g_snapshot_pool.store(&pool);  // snapshots are served on the publisher's thread
      fanout.add(std::move(publisher));
    }
  }
}

shm::StatsPublisher* configured_publisher() noexcept {
  return g_publisher.load();
}

}  // namespace gpustitch::preload
