// The documented C API (include/gpustitch/gpustitch.h): PyTorch's pluggable-allocator entry points
// and the introspection calls tests and tools use.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "gpustitch/gpustitch.h"
#include "hooks.h"
#include "observers.h"
#include "real_api.h"
#include "shim.h"

using namespace gpustitch;
using namespace gpustitch::cuda;
using gpustitch::preload::Hook;
namespace pl = gpustitch::preload;

#ifndef GPUSTITCH_VERSION
#define GPUSTITCH_VERSION "unknown"
#endif

extern "C" {

__attribute__((visibility("default"))) void* gpustitch_malloc(ssize_t size, int device,
                                                              struct CUstream_st* stream) {
  if (size < 0) return nullptr;
  auto bytes = static_cast<std::size_t>(size);
  Pool* pool = pl::serving_pool();
  if (pool) {
    DevPtr out = 0;
    switch (pl::serve_allocation(*pool, device, bytes, pl::stream_key(stream, false), &out)) {
      case pl::Served::ok:
        return reinterpret_cast<void*>(out);
      case pl::Served::out_of_memory:
        return nullptr;
      case pl::Served::not_served:
        break;
    }
  }
  // Not served by the pool: the driver, on the caller's current context (PyTorch makes device
  // current before calling).
  auto alloc = pl::real_as<PFN_cuMemAlloc_v2>(Hook::cuMemAlloc_v2);
  CUdeviceptr p = 0;
  if (!alloc || bytes == 0) return nullptr;
  pl::PassthroughScope guard;
  return alloc(&p, bytes) == CUDA_SUCCESS ? reinterpret_cast<void*>(p) : nullptr;
}

__attribute__((visibility("default"))) void gpustitch_free(void* ptr, ssize_t /*size*/,
                                                           int /*device*/,
                                                           struct CUstream_st* stream) {
  if (!ptr) return;
  auto p = reinterpret_cast<DevPtr>(ptr);
  Pool* pool = pl::existing_pool();
  if (pool && pool->deallocate(p, pl::stream_key(stream, false)) == Status::ok) return;
  auto free_fn = pl::real_as<PFN_cuMemFree_v2>(Hook::cuMemFree_v2);
  if (!free_fn) return;
  pl::PassthroughScope guard;
  free_fn(p);
}

__attribute__((visibility("default"))) int gpustitch_active(void) {
  return pl::shim_active() ? 1 : 0;
}

__attribute__((visibility("default"))) int gpustitch_owns(const void* ptr) {
  Pool* pool = pl::existing_pool();
  return pool && ptr && pool->find(reinterpret_cast<DevPtr>(ptr)) ? 1 : 0;
}

__attribute__((visibility("default"))) int gpustitch_get_stats(int device,
                                                               gpustitch_device_stats* out,
                                                               size_t size) {
  Pool* pool = pl::shim_active() ? pl::existing_pool() : nullptr;
  if (!pool || !out || device < 0 || device >= pool->device_count()) return -1;
  DeviceStats s = pool->stats(device);
  gpustitch_device_stats r{};
  r.allocs = s.allocs;
  r.frees = s.frees;
  r.cache_hits = s.cache_hits;
  r.fresh = s.fresh;
  r.stitches = s.stitches;
  r.ooms = s.ooms;
  r.live_blocks = s.live_blocks;
  r.bytes_requested = s.bytes_requested;
  r.bytes_allocated = s.bytes_allocated;
  r.bytes_reserved = s.bytes_reserved;
  r.bytes_cached = s.bytes_cached;
  r.peak_allocated = s.peak_allocated;
  r.peak_reserved = s.peak_reserved;
  r.largest_possible = s.largest_possible;
  r.device_free = s.device_free;
  r.device_total = s.device_total;
  r.driver_calls = s.driver_calls;
  r.driver_ns = s.driver_ns;
  r.driver_background_calls = s.driver_background_calls;
  r.driver_background_ns = s.driver_background_ns;
  static_assert(sizeof r.driver_op_calls / sizeof r.driver_op_calls[0] == kDriverOps);
  for (int i = 0; i < kDriverOps; ++i) {
    r.driver_op_calls[i] = s.driver_op_calls[i];
    r.driver_op_ns[i] = s.driver_op_ns[i];
  }
  r.peak_reserved_pending = s.peak_reserved_pending;
  r.peak_reserved_allocated = s.peak_reserved_allocated;
  r.fence_syncs = s.fence_syncs;
  r.fence_sync_ns = s.fence_sync_ns;
  r.fence_waits = s.fence_waits;
  r.fence_wait_ns = s.fence_wait_ns;
  r.fence_waits_timed_out = s.fence_waits_timed_out;
  std::memcpy(out, &r, size < sizeof r ? size : sizeof r);
  return 0;
}

__attribute__((visibility("default"))) long long gpustitch_trim(int device) {
  Pool* pool = pl::shim_active() ? pl::existing_pool() : nullptr;
  if (!pool || device < 0 || device >= pool->device_count()) return -1;
  return static_cast<long long>(pool->trim(device));
}

__attribute__((visibility("default"))) int gpustitch_device_count(void) {
  Pool* pool = pl::shim_active() ? pl::existing_pool() : nullptr;
  return pool ? pool->device_count() : 0;
}

__attribute__((visibility("default"))) int gpustitch_snapshot(const char* path, char* error,
                                                              size_t error_size) {
  auto fail = [&](int code, const char* why) noexcept {
    if (error != nullptr && error_size > 0) std::snprintf(error, error_size, "%s", why);
    return code;
  };
  Pool* pool = pl::shim_active() ? pl::existing_pool() : nullptr;
  if (!pool) return fail(-1, "the pool is not active in this process");
  if (path == nullptr || *path == '\0') return fail(-2, "no output path");
  try {
    std::string why;
    if (!trace::write_pytorch_snapshot(pl::snapshot_of(*pool), path, &why)) {
      return fail(-2, why.c_str());
    }
  } catch (const std::exception& e) {
    return fail(-2, e.what());  // out of host memory
  } catch (...) {
    return fail(-2, "unexpected error");
  }
  if (error != nullptr && error_size > 0) error[0] = '\0';
  return 0;
}

__attribute__((visibility("default"))) const char* gpustitch_version(void) {
  return GPUSTITCH_VERSION;
}

}  // extern "C"
