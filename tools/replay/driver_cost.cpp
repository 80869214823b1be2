// DriverCost and CostedBackend: see driver_cost.h for the costs and where they were measured.
#include "driver_cost.h"

namespace gpustitch::replay {

namespace {
// A call's modelled time: a fixed part and a part per MiB it creates, frees or maps.
double call_us(double fixed_us, double us_per_mib, std::size_t bytes) noexcept {
  return fixed_us + us_per_mib * static_cast<double>(bytes) / (1024.0 * 1024.0);
}
}  // namespace

void DriverCost::create(std::size_t bytes) noexcept {
  ++creates;
  us += call_us(12.0, 0.086, bytes);
}
void DriverCost::release(std::size_t bytes) noexcept {
  ++releases;
  us += call_us(14.0, 0.47, bytes);
}
void DriverCost::map() noexcept {
  ++maps;
  us += 1.5;
}
void DriverCost::unmap() noexcept {
  ++unmaps;
  us += 18.0;
}
void DriverCost::set_access_handle(std::size_t bytes) noexcept {
  ++access_handles;
  us += call_us(27.0, 0.063, bytes);
}

void DriverCost::cuda_malloc(std::size_t bytes) noexcept {
  ++mallocs;
  us += call_us(47.0, 0.14, bytes);
}
void DriverCost::cuda_free(std::size_t bytes) noexcept {
  ++frees;
  us += call_us(40.0, 0.7, bytes);
}

std::vector<std::pair<std::string, std::uint64_t>> DriverCost::counters() const {
  return {{"driver_us", static_cast<std::uint64_t>(us + 0.5)},
          {"driver_creates", creates},
          {"driver_maps", maps},
          {"driver_unmaps", unmaps},
          {"driver_releases", releases},
          {"driver_mallocs", mallocs},
          {"driver_frees", frees}};
}

Status CostedBackend::create(int device, std::size_t size, PhysHandle* out) noexcept {
  const Status s = inner_->create(device, size, out);
  if (s != Status::ok) return s;
  std::lock_guard lock(mutex_);
  cost_.create(size);
  try {
    handle_size_[*out] = size;
  } catch (...) {
  }
  return s;
}

Status CostedBackend::release(PhysHandle handle) noexcept {
  const Status s = inner_->release(handle);
  if (s != Status::ok) return s;
  std::lock_guard lock(mutex_);
  std::size_t size = 0;
  if (auto it = handle_size_.find(handle); it != handle_size_.end()) {
    size = it->second;
    handle_size_.erase(it);
  }
  cost_.release(size);
  return s;
}

Status CostedBackend::map(DevPtr ptr, std::size_t size, PhysHandle handle,
                          std::size_t offset) noexcept {
  const Status s = inner_->map(ptr, size, handle, offset);
  if (s != Status::ok) return s;
  std::lock_guard lock(mutex_);
  cost_.map();
  try {
    mapped_[ptr] = size;
  } catch (...) {
  }
  return s;
}

Status CostedBackend::unmap(DevPtr ptr, std::size_t size) noexcept {
  const Status s = inner_->unmap(ptr, size);
  if (s != Status::ok) return s;
  std::lock_guard lock(mutex_);
  cost_.unmap();
  mapped_.erase(ptr);
  return s;
}

Status CostedBackend::set_access(DevPtr ptr, std::size_t size,
                                 std::span<const int> devices) noexcept {
  const Status s = inner_->set_access(ptr, size, devices);
  if (s != Status::ok) return s;
  std::lock_guard lock(mutex_);
  // The driver's cost is per handle mapped in the range (and per device granted).
  const std::size_t grants = devices.empty() ? 1 : devices.size();
  auto it = mapped_.upper_bound(ptr);
  if (it != mapped_.begin() && std::prev(it)->first + std::prev(it)->second > ptr) --it;
  for (; it != mapped_.end() && it->first < ptr + size; ++it) {
    for (std::size_t g = 0; g < grants; ++g) cost_.set_access_handle(it->second);
  }
  return s;
}

}  // namespace gpustitch::replay
