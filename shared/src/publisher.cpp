// StatsPublisher: see publisher.h for the cost model and the robustness rules.
#include "gpustitch/shm/publisher.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

namespace gpustitch::shm {

static_assert(kHistogramBuckets == gpustitch::kHistogramBuckets,
              "the record's histogram must match the core's; bump kLayoutVersion with it");
static_assert(gpustitch::kDriverOps == 5,
              "the record has a driver_<kind>_* pair per DriverOp; bump kLayoutVersion with it");

DeviceCounters to_counters(const gpustitch::DeviceStats& s, int ordinal) noexcept {
  DeviceCounters c;
  std::memset(static_cast<void*>(&c), 0, sizeof c);
#define GPUSTITCH_SHM_COPY(name) c.name = s.name;
  GPUSTITCH_SHM_DEVICE_COUNTERS(GPUSTITCH_SHM_COPY)
  GPUSTITCH_SHM_DRIVER_COUNTERS(GPUSTITCH_SHM_COPY)
  GPUSTITCH_SHM_WAIT_COUNTERS(GPUSTITCH_SHM_COPY)
#undef GPUSTITCH_SHM_COPY
  c.driver_background_calls = s.driver_background_calls;
  c.driver_background_ns = s.driver_background_ns;
  c.peak_reserved_allocated = s.peak_reserved_allocated;
  c.peak_reserved_pending = s.peak_reserved_pending;
  auto by_kind = [&](DriverOp op, std::uint64_t* calls, std::uint64_t* ns) {
    *calls = s.driver_op_calls[static_cast<int>(op)];
    *ns = s.driver_op_ns[static_cast<int>(op)];
  };
  by_kind(DriverOp::create, &c.driver_create_calls, &c.driver_create_ns);
  by_kind(DriverOp::map, &c.driver_map_calls, &c.driver_map_ns);
  by_kind(DriverOp::set_access, &c.driver_set_access_calls, &c.driver_set_access_ns);
  by_kind(DriverOp::unmap, &c.driver_unmap_calls, &c.driver_unmap_ns);
  by_kind(DriverOp::release, &c.driver_release_calls, &c.driver_release_ns);
  std::memcpy(c.hist_allocs, s.hist_allocs, sizeof c.hist_allocs);
  std::memcpy(c.hist_live, s.hist_live, sizeof c.hist_live);
  c.ordinal = ordinal;
  return c;
}

RecordEvent to_record_event(const gpustitch::PoolEvent& e) noexcept {
  RecordEvent r;
  switch (e.kind) {
    case gpustitch::EventKind::oom:
      r.kind = RecordEventKind::oom;
      break;
    case gpustitch::EventKind::stitch:
      r.kind = RecordEventKind::stitch;
      break;
    case gpustitch::EventKind::trim:
      r.kind = RecordEventKind::trim;
      break;
    case gpustitch::EventKind::release:
      r.kind = RecordEventKind::release;
      break;
  }
  r.device = e.device;
  r.time_ns = e.time_ns;
  r.size = e.size;
  r.device_free = e.device_free;
  r.cached = e.cached;
  r.largest_possible = e.largest_possible;
  r.pieces = e.pieces;
  r.fragmentation = e.fragmentation;
  return r;
}

namespace {
// Publishers to stop at exit(). Fixed slots: registration happens a handful of times per process.
constexpr int kExitSlots = 8;
std::atomic<StatsPublisher*> g_exit_slots[kExitSlots];
std::once_flag g_exit_once;

void stop_all_at_exit() {
  for (auto& slot : g_exit_slots)
    if (StatsPublisher* p = slot.exchange(nullptr)) p->stop();
}

void register_for_exit(StatsPublisher* p) noexcept {
  try {
    std::call_once(g_exit_once, [] { std::atexit(stop_all_at_exit); });
  } catch (...) {
    return;
  }
  for (auto& slot : g_exit_slots) {
    StatsPublisher* expected = nullptr;
    if (slot.compare_exchange_strong(expected, p)) return;
  }
}

void unregister_for_exit(StatsPublisher* p) noexcept {
  for (auto& slot : g_exit_slots) {
    StatsPublisher* expected = p;
    slot.compare_exchange_strong(expected, nullptr);
  }
}
}  // namespace

struct StatsPublisher::Impl {
  StatsSource source;
  unsigned interval_ms = 100;
  PublisherOptions options;
  pid_t owner_pid = 0;
  std::string error;

  // The record events go to. Replaced (never freed before stop) when the name is re-created.
  std::atomic<RecordWriter*> current{nullptr};
  std::vector<std::unique_ptr<RecordWriter>> writers;  // guarded by publish_mu

  std::mutex publish_mu;  // one snapshot writer at a time; guards writers and uuids
  std::uint8_t uuids[kMaxDevices][kUuidBytes] = {};
  std::vector<DeviceCounters> scratch;

  std::mutex sites_mu;
  std::vector<Site> sites;  // last table, carried over on re-creation

  std::mutex wake_mu;
  std::condition_variable wake;
  bool stopping = false;
  bool stopped = false;
  std::thread thread;

  void publish_locked() noexcept;
  void recreate_locked() noexcept;
  void remove_stale_records() noexcept;
  void run() noexcept;
};

void StatsPublisher::Impl::publish_locked() noexcept {
  RecordWriter* w = current.load(std::memory_order_relaxed);
  if (!w) return;
  int n = 0;
  try {
    n = std::clamp(source.device_count ? source.device_count() : 0, 0, kMaxDevices);
    scratch.resize(static_cast<std::size_t>(n));
    for (int d = 0; d < n; ++d) {
      scratch[d] = to_counters(source.stats(d), d);
      std::memcpy(scratch[d].uuid, uuids[d], kUuidBytes);
      if (options.augment) options.augment(d, scratch[d]);
    }
  } catch (...) {
    return;
  }
  w->publish(std::span<const DeviceCounters>(scratch.data(), static_cast<std::size_t>(n)),
             realtime_ns());
}

// The name vanished (RemoveIPC, rm): create a fresh object under the same name, carry the event
// ring and site table over, and point event writers at it. The old mapping stays mapped until
// stop(), so a thread still writing an event into it writes into valid memory.
void StatsPublisher::Impl::recreate_locked() noexcept {
  RecordWriter* old = current.load(std::memory_order_relaxed);
  if (!old) return;
  std::string why;
  auto fresh = RecordWriter::create(old->name(), self_exe(), self_cmdline(), interval_ms, &why,
                                    old->record());
  if (!fresh) return;  // try again next interval
  {
    std::lock_guard lk(sites_mu);
    fresh->publish_sites(sites, realtime_ns());
  }
  try {
    writers.push_back(std::move(fresh));
  } catch (...) {
    return;
  }
  current.store(writers.back().get(), std::memory_order_release);
  publish_locked();
}

void StatsPublisher::Impl::remove_stale_records() noexcept {
  try {
    for (const RecordName& name : discover_records(options.prefix, ::geteuid())) {
      if (name.pid == owner_pid) continue;
      if (!record_process_alive(name)) ::unlink(name.path().c_str());
    }
  } catch (...) {
  }
}

void StatsPublisher::Impl::run() noexcept {
  remove_stale_records();
  std::unique_lock lk(wake_mu);
  while (!stopping) {
    lk.unlock();
    {
      std::lock_guard plk(publish_mu);
      RecordWriter* w = current.load(std::memory_order_relaxed);
      if (w && w->unlinked()) recreate_locked();
      publish_locked();
    }
    if (options.on_tick) {
      try {
        options.on_tick();
      } catch (...) {
      }
    }
    lk.lock();
    wake.wait_for(lk, std::chrono::milliseconds(interval_ms), [this] { return stopping; });
  }
}

StatsPublisher::StatsPublisher(StatsSource source, const gpustitch::Config& config,
                               PublisherOptions options) noexcept {
  try {
    impl_ = std::make_unique<Impl>();
    impl_->source = std::move(source);
    impl_->interval_ms = std::max(1u, config.publish_interval_ms);
    impl_->options = std::move(options);
    impl_->owner_pid = ::getpid();
    if (!config.publish) {
      impl_->error = "publishing disabled (publish:off)";
      return;
    }
    std::string why;
    auto w = RecordWriter::create(RecordWriter::self_name(impl_->options.prefix), self_exe(),
                                  self_cmdline(), impl_->interval_ms, &why);
    if (!w) {
      impl_->error = "cannot create the statistics record: " + why;
      return;
    }
    impl_->writers.push_back(std::move(w));
    impl_->current.store(impl_->writers.back().get(), std::memory_order_release);
    // The thread must not take signals meant for the program: block them all before creating it
    // so that it starts with everything blocked.
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    try {
      impl_->thread = std::thread([impl = impl_.get()] {
        pthread_setname_np(pthread_self(), "gpustitch-pub");
        impl->run();
      });
    } catch (...) {
      impl_->error = "cannot start the publisher thread";
    }
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    if (!impl_->thread.joinable()) {
      impl_->writers.back()->remove();
      impl_->current.store(nullptr);
      impl_->writers.clear();
      return;
    }
    register_for_exit(this);
  } catch (...) {
    if (impl_) impl_->error = "cannot initialize the publisher";
  }
}

StatsPublisher::~StatsPublisher() {
  stop();
}

void StatsPublisher::stop() noexcept {
  unregister_for_exit(this);
  if (!impl_ || impl_->stopped) return;
  impl_->stopped = true;
  if (::getpid() != impl_->owner_pid) {
    // A forked child: the thread exists only in the parent and the record is the parent's, and
    // the parent's thread may have been waiting on `wake` or holding a mutex at the fork, so
    // destroying them here could block for ever (glibc's pthread_cond_destroy waits for the
    // waiters it remembers). Leak the whole state rather than join a thread that is not there,
    // remove the parent's record or touch those objects.
    impl_->current.store(nullptr);
    (void)impl_.release();
    left_in_child_ = true;
    return;
  }
  {
    std::lock_guard lk(impl_->wake_mu);
    impl_->stopping = true;
  }
  impl_->wake.notify_all();
  if (impl_->thread.joinable()) impl_->thread.join();
  std::lock_guard plk(impl_->publish_mu);
  RecordWriter* w = impl_->current.exchange(nullptr);
  if (w) w->remove();
  // Mappings stay until the publisher is destroyed: a thread may still be inside on_event.
}

bool StatsPublisher::active() const noexcept {
  return impl_ && impl_->current.load(std::memory_order_acquire) != nullptr;
}

std::string StatsPublisher::error() const {
  if (!impl_) return left_in_child_ ? "stopped in a forked child" : "out of memory";
  return impl_->error;
}

std::string StatsPublisher::record_name() const {
  if (!active()) return {};
  std::lock_guard plk(impl_->publish_mu);
  RecordWriter* w = impl_->current.load();
  return w ? w->name().object_name() : std::string();
}

void StatsPublisher::on_event(const gpustitch::PoolEvent& event) noexcept {
  record_event(to_record_event(event));
}

void StatsPublisher::record_event(const RecordEvent& event) noexcept {
  if (!impl_) return;
  RecordWriter* w = impl_->current.load(std::memory_order_acquire);
  if (!w || ::getpid() != impl_->owner_pid) return;
  w->record_event(event);
}

void StatsPublisher::publish_now() noexcept {
  if (!impl_ || ::getpid() != impl_->owner_pid) return;
  std::lock_guard plk(impl_->publish_mu);
  impl_->publish_locked();
}

void StatsPublisher::set_device_uuid(int device, const std::uint8_t (&uuid)[kUuidBytes]) noexcept {
  if (!impl_ || device < 0 || device >= kMaxDevices) return;
  std::lock_guard plk(impl_->publish_mu);
  std::memcpy(impl_->uuids[device], uuid, kUuidBytes);
}

void StatsPublisher::publish_sites(std::span<const Site> sites) noexcept {
  if (!impl_ || ::getpid() != impl_->owner_pid) return;
  std::lock_guard lk(impl_->sites_mu);
  try {
    impl_->sites.assign(sites.begin(),
                        sites.begin() + std::min<std::size_t>(sites.size(), kMaxSites));
  } catch (...) {
    return;
  }
  RecordWriter* w = impl_->current.load(std::memory_order_acquire);
  if (w) w->publish_sites(impl_->sites, realtime_ns());
}

}  // namespace gpustitch::shm
