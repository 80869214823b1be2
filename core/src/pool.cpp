// Pool: routes calls to the pool of each device and reports them to the observer.
//
// Layering (RMM-like): Pool (this file, the public face) -> DevicePool (one per device: blocks,
// views, stitching, fencing; device_pool.cpp) -> SmallPool (size classes; small_pool.cpp) and
// Backend (driver operations). Statistics are kept per device and read by observers; nothing
// flows back up.
#include "gpustitch/pool.h"

#include <new>

#include "device_pool.h"
#include "device_pool_internal.h"

namespace gpustitch {

using detail::DevicePool;  // NOLINT
using detail::Outcome;

Pool::Pool(Backend& backend, Config config, PoolObserver* observer)
    : backend_(backend), config_(std::move(config)), observer_(observer) {
  int n = backend_.device_count();
  device_count_ = n < 0 ? 0 : n;
  devices_ = std::make_unique<std::unique_ptr<DevicePool>[]>(device_count_);
  for (int d = 0; d < device_count_; ++d) {
    devices_[d] = std::make_unique<DevicePool>(backend_, config_, d, observer_);
  }
}

Pool::~Pool() = default;

DevicePool* Pool::device(int device) const noexcept {
  return device >= 0 && device < device_count_ ? devices_[device].get() : nullptr;
}

Status Pool::allocate(int device, std::size_t size, Stream stream, DevPtr* out) noexcept {
  if (out == nullptr) return Status::invalid_value;
  DevicePool* dp = this->device(device);
  if (dp == nullptr) return Status::invalid_device;
  Outcome outcome;
  Status s = dp->allocate(size, stream, out, &outcome);
  if (s == Status::out_of_memory) {
    const OomHandler* h = oom_handler_.load(std::memory_order_acquire);
    if (h != nullptr && h->fn(device, size, h->context)) {
      outcome = Outcome{};
      s = dp->allocate(size, stream, out, &outcome);
    }
    if (s == Status::out_of_memory) dp->note_out_of_memory(size);
  }
  if (s == Status::ok && observer_ != nullptr) {
    observer_->on_allocate(device, *out, size, stream, outcome.how);
  }
  return s;
}

void Pool::set_out_of_memory_handler(OutOfMemoryHandler handler, void* context) noexcept {
  try {
    std::lock_guard lock(oom_handlers_mu_);
    const OomHandler* h = nullptr;
    if (handler != nullptr) {
      oom_handlers_.push_back(std::make_unique<const OomHandler>(OomHandler{handler, context}));
      h = oom_handlers_.back().get();
    }
    oom_handler_.store(h, std::memory_order_release);
  } catch (...) {
    // Out of host memory: the previous handler stays installed.
  }
}

Status Pool::deallocate(DevPtr ptr, Stream stream) noexcept {
  Status deferred = Status::ok;
  if (pinned_.load(std::memory_order_acquire) != 0 && defer_pinned_free(ptr, &deferred)) {
    return deferred;
  }
  return deallocate_now(ptr, stream);
}

Status Pool::deallocate_now(DevPtr ptr, Stream stream) noexcept {
  for (int d = 0; d < device_count_; ++d) {
    Outcome outcome;
    if (devices_[d]->deallocate(ptr, stream, &outcome) == Status::ok) {
      if (observer_ != nullptr) observer_->on_free(d, ptr, outcome.size, stream);
      return Status::ok;
    }
  }
  return Status::invalid_value;
}

bool Pool::find(DevPtr ptr, BlockInfo* out) const noexcept {
  for (int d = 0; d < device_count_; ++d) {
    BlockInfo info;
    if (devices_[d]->find(ptr, &info)) {
      if (pinned_.load(std::memory_order_acquire) != 0 && pinned_and_freed(info.base)) {
        return false;
      }
      if (out != nullptr) *out = info;
      return true;
    }
  }
  return false;
}

std::size_t Pool::trim(int device) noexcept {
  DevicePool* dp = this->device(device);
  if (dp == nullptr) return 0;
  Outcome outcome;
  return dp->trim(&outcome);
}

std::size_t Pool::release_idle(int device, std::size_t bytes) noexcept {
  DevicePool* dp = this->device(device);
  return dp == nullptr ? 0 : dp->release_idle(bytes);
}

Status Pool::grant_peer_access(int device, int peer) noexcept {
  DevicePool* dp = this->device(device);
  if (dp == nullptr || peer < 0 || peer >= device_count_) return Status::invalid_device;
  return dp->grant_peer_access(peer);
}

Status Pool::mem_info(int device, std::size_t* free, std::size_t* total) noexcept {
  DevicePool* dp = this->device(device);
  return dp == nullptr ? Status::invalid_device : dp->mem_info(free, total);
}

DeviceStats Pool::stats(int device) const noexcept {
  DevicePool* dp = this->device(device);
  if (dp == nullptr) return DeviceStats{};
  DeviceStats s = dp->stats();
  dp->add_lending_stats(&s);
  return s;
}

PeakWindow Pool::peaks_since_reset(int device) const noexcept {
  DevicePool* dp = this->device(device);
  return dp == nullptr ? PeakWindow{} : dp->peaks_since_reset();
}

void Pool::reset_peak_allocated(int device) noexcept {
  if (DevicePool* dp = this->device(device)) dp->reset_peak_allocated();
}

void Pool::reset_peak_reserved(int device) noexcept {
  if (DevicePool* dp = this->device(device)) dp->reset_peak_reserved();
}

std::string Pool::validate(int device) const {
  DevicePool* dp = this->device(device);
  return dp == nullptr ? "no such device" : dp->validate();
}

Status Pool::memory_map(int device, std::vector<MappedSegment>* out) const noexcept {
  DevicePool* dp = this->device(device);
  if (dp == nullptr) return Status::invalid_device;
  return out == nullptr ? Status::invalid_value : dp->memory_map(out);
}

void Pool::drain_pending(int device) noexcept {
  if (DevicePool* dp = this->device(device)) dp->drain_pending();
}

void Pool::bind_thread_to_arena(unsigned index) noexcept {
  detail::bind_thread_arena(index);
}

void Pool::atfork_prepare() noexcept {
  pins_mu_.lock();
  for (int d = 0; d < device_count_; ++d) devices_[d]->lock();
}

void Pool::atfork_parent() noexcept {
  for (int d = device_count_ - 1; d >= 0; --d) devices_[d]->unlock();
  pins_mu_.unlock();
}

void Pool::atfork_child() noexcept {
  for (int d = device_count_ - 1; d >= 0; --d) {
    devices_[d]->unlock();
    devices_[d]->after_fork_child();
  }
  pins_mu_.unlock();
}

}  // namespace gpustitch
