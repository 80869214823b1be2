// What the driver calls a policy makes would cost on an H200, so that replay measures the
// pool's speed cost (its VMM calls) beside its memory, in CI, without a GPU.
//
// On the GPU, the pool's steady-state cost is its driver calls: GPT training under the pool ran
// at 97k tokens/s with stitching on, 124k with it off, and the difference was the handles mapped
// and unmapped while kernels ran. Each call's cost is per handle, barely per byte
// (tools/gpu/vmm_probe on an H200 with driver 580, idle device, docs/gpu.md; calls made
// while a kernel runs were 3-7x slower):
//   cuMemCreate   12 us (2-64 MiB), 188 us for 2 GiB        -> 12 us + 0.086 us/MiB
//   cuMemMap      1-2 us                                     -> 1.5 us
//   cuMemSetAccess 27 us per handle in the range, 155 us for one 2 GiB handle
//                                                            -> 27 us + 0.063 us/MiB per handle
//   cuMemUnmap    18 us per handle                           -> 18 us
//   cuMemRelease  14 us (2 MiB), 0.97 ms (2 GiB)             -> 14 us + 0.47 us/MiB
// and for the policies that model PyTorch's caching allocator, its segments' calls (the same H200
// and driver, idle device, 2026-11-29; the fits are within 1.5x of each point):
//   cudaMalloc    46-52 us (2 MiB), 84 us (512 MiB), 0.61 ms (4 GiB) -> 47 us + 0.14 us/MiB
//   cudaFree      38-44 us (2 MiB), 331 us (512 MiB), 2.9 ms (4 GiB) -> 40 us + 0.7 us/MiB
// DriverCost adds these up; CostedBackend is a Backend adaptor that counts what passes through
// it (set_access is charged per handle mapped in its range, as the driver charges it).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gpustitch/backend.h"

namespace gpustitch::replay {

struct DriverCost {
  std::uint64_t creates = 0, releases = 0, maps = 0, unmaps = 0, access_handles = 0;
  std::uint64_t mallocs = 0, frees = 0;  // cudaMalloc / cudaFree of whole segments
  double us = 0;                         // modelled time in driver calls, idle device

  void create(std::size_t bytes) noexcept;
  void release(std::size_t bytes) noexcept;
  void map() noexcept;
  void unmap() noexcept;
  void set_access_handle(std::size_t bytes) noexcept;  // once per handle in the range
  void cuda_malloc(std::size_t bytes) noexcept;
  void cuda_free(std::size_t bytes) noexcept;
  DriverCost& operator+=(const DriverCost& o) noexcept {
    creates += o.creates, releases += o.releases, maps += o.maps, unmaps += o.unmaps;
    access_handles += o.access_handles, mallocs += o.mallocs, frees += o.frees, us += o.us;
    return *this;
  }

  // Replay counters: driver_us and the call counts.
  std::vector<std::pair<std::string, std::uint64_t>> counters() const;
};

class CostedBackend final : public Backend {
 public:
  explicit CostedBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}

  DriverCost cost() const {
    std::lock_guard lock(mutex_);
    return cost_;
  }
  Backend& inner() noexcept { return *inner_; }

  const char* name() const noexcept override { return inner_->name(); }
  int device_count() noexcept override { return inner_->device_count(); }
  std::size_t granularity(int device) noexcept override { return inner_->granularity(device); }
  bool supports_map_offset(int device) noexcept override {
    return inner_->supports_map_offset(device);
  }
  Status device_uuid(int device, DeviceUuid* out) noexcept override {
    return inner_->device_uuid(device, out);
  }
  Status mem_info(int device, std::size_t* free, std::size_t* total) noexcept override {
    return inner_->mem_info(device, free, total);
  }
  Status reserve(int device, std::size_t size, DevPtr* out) noexcept override {
    return inner_->reserve(device, size, out);
  }
  Status unreserve(DevPtr ptr, std::size_t size) noexcept override {
    return inner_->unreserve(ptr, size);
  }
  Status create(int device, std::size_t size, PhysHandle* out) noexcept override;
  Status release(PhysHandle handle) noexcept override;
  Status map(DevPtr ptr, std::size_t size, PhysHandle handle, std::size_t offset) noexcept override;
  Status unmap(DevPtr ptr, std::size_t size) noexcept override;
  Status set_access(DevPtr ptr, std::size_t size, std::span<const int> devices) noexcept override;
  Status synchronize(int device) noexcept override { return inner_->synchronize(device); }

 private:
  std::unique_ptr<Backend> inner_;
  mutable std::mutex mutex_;
  DriverCost cost_;
  std::map<PhysHandle, std::size_t> handle_size_;
  std::map<DevPtr, std::size_t> mapped_;  // start -> size of each map() range
};

}  // namespace gpustitch::replay
