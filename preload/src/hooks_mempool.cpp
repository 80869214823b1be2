// Memory-pool hooks: the device's default memory pool answers with the pool's figures, so that
// PyTorch's statistics under backend:cudaMallocAsync describe the memory the shim really holds.
//
// PyTorch's CudaMallocAsync allocator keeps no statistics of its own. memory_stats(),
// memory_reserved(), max_memory_allocated() and memory_summary() read the default pool of the
// device (cudaDeviceGetDefaultMemPool) with cudaMemPoolGetAttribute: ReservedMemCurrent/High and
// UsedMemCurrent/High. reset_peak_memory_stats() sets the two High attributes to 0 (the driver's
// way of restarting them at the current figure), and empty_cache() calls cudaMemPoolTrimTo(pool, 0)
// after a device synchronisation. Under the shim those allocations never reach the driver's pool,
// which would report next to nothing.
//
// What is answered, for the default pool of a device the pool serves:
//   ReservedMemCurrent  driver's figure + the pool's bytes_reserved
//   UsedMemCurrent      driver's figure + the pool's bytes_allocated
//   ReservedMemHigh     driver's figure + the pool's reserved high-water mark since the last reset
//   UsedMemHigh         driver's figure + the pool's allocated high-water mark since the last reset
// The driver's own figure stays in the sum because allocations the shim passes through (those
// made while a stream is captured into a CUDA graph) do live in the driver's pool; for the highs
// the sum of two marks is an upper bound of the joint one. Setting a High attribute resets the
// pool's mark too. TrimTo(pool, 0) trims the pool as well (all idle cached memory, after its
// pending frees); with a non-zero minimum the pool is left alone, since a trim cannot promise to
// keep an exact number of bytes and the driver's contract is "at least minBytesToKeep stay".
//
// The release threshold (config driver_pool_release:on, the default). Some memory reaches the
// driver's default pool without passing any hook the shim can install (on the H200 under PyTorch's
// cudaMallocAsync backend: 32 MiB after an attention backward, and on HF Llama training
// 1,760 MiB reserved at the peak for at most 77-451 MiB live; the shim's pass-through count stays
// 0, so the calls do not come through the runtime or driver entry points it serves). PyTorch sets
// the default pool's release threshold to the maximum, because under it the pool is its cache; so
// the driver kept all of that reserved. While the pool serves the device, a
// SetAttribute(ReleaseThreshold) on its default pool goes to the driver as asked (its errors are
// the caller's) and then the threshold is put back to 0, the driver's default; the value the
// program set is remembered and is what GetAttribute(ReleaseThreshold) answers. The driver then
// gives that memory back at each synchronisation: the HF run's NVML peak went from 15,889-15,923
// MiB to 14,143-14,159 MiB (the pool's own peak unchanged). The cost lands on those allocations
// only (re-created after a synchronisation). Tokens/s, H200, HF Llama training, interleaved pairs:
// with the threshold set to 0 from the program, 45.9k/38.1k against 55.1k/41.7k (fewer in both);
// with this switch, three rounds, 55.5k/53.2k/52.5k against 46.7k/43.2k/43.4k (more in all
// three). Within the runs' noise either way, for 1.8 GB less on the device: on by default.
//
// Every call goes to the native function first, with the caller's arguments: a bad handle, a bad
// attribute or a null pointer gets exactly the native error, and nothing is added. Any other pool
// (cudaMemPoolCreate'd), any other attribute (ReleaseThreshold, the Reuse* flags) and any device
// the pool does not serve pass through untouched.
//
// cuMemAllocFromPoolAsync on a device's default pool is served as cuMemAllocAsync is (the
// allocation is the pool's, on that device, ordered on the stream; cuMemFreeAsync or cuMemFree
// frees it): what XLA's cuda_async allocator and TensorFlow's cuda_malloc_async call for every
// buffer (docs/frameworks.md), and the runtime's cudaMallocFromPoolAsync underneath. On a pool the
// program created (cuMemPoolCreate), whose properties and limits are its own, or while the stream
// is captured into a graph, the call goes to the driver.
//
// Which handle is a device's default pool: the handles cuDeviceGetDefaultMemPool /
// cudaDeviceGetDefaultMemPool return are remembered per device as they pass through the hooks;
// for a device not seen yet the real driver is asked once (a handle from cudaDeviceGetMemPool is
// the same handle while the default pool is current). Runtime hooks forward under the passthrough
// guard, so the driver hooks the runtime reaches underneath forward untouched and the pool's
// figures are added once.
#include <atomic>
#include <cstdint>
#include <cstring>

#include "hooks.h"
#include "real_api.h"
#include "shim.h"

using namespace gpustitch;
using namespace gpustitch::cuda;
using gpustitch::preload::Hook;
namespace pl = gpustitch::preload;

namespace {

constexpr int kMaxDevices = 64;
// Device d's default pool handle once known; null until then.
std::atomic<CUmemoryPool> g_default_pool[kMaxDevices];

void remember_default_pool(int device, CUmemoryPool pool) noexcept {
  if (device >= 0 && device < kMaxDevices && pool) {
    g_default_pool[device].store(pool, std::memory_order_release);
  }
}

// The device whose default pool `handle` is, among the devices the pool serves; -1 if none.
int served_default_pool_device(Pool& pool, CUmemoryPool handle) noexcept {
  if (!handle) return -1;
  const int n = pool.device_count() < kMaxDevices ? pool.device_count() : kMaxDevices;
  for (int d = 0; d < n; ++d) {
    CUmemoryPool known = g_default_pool[d].load(std::memory_order_acquire);
    if (!known) {
      auto get = pl::real_as<PFN_cuDeviceGetDefaultMemPool>(Hook::cuDeviceGetDefaultMemPool);
      CUmemoryPool h = nullptr;
      if (get && get(&h, d) == CUDA_SUCCESS && h) {
        remember_default_pool(d, h);
        known = h;
      }
    }
    if (known == handle) return d;
  }
  return -1;
}

// What the program set as device d's default pool's release threshold (0: the driver's default),
// while the driver's is held at 0.
std::atomic<std::uint64_t> g_program_threshold[kMaxDevices];

// The device whose default pool's release threshold the shim holds at 0; -1 if none.
int held_threshold_device(CUmemoryPool handle, int attr) noexcept {
  if (attr != CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) return -1;
  Pool* pool = pl::existing_pool();
  if (!pool || !pool->config().driver_pool_release) return -1;
  return served_default_pool_device(*pool, handle);
}

// After the native SetAttribute(ReleaseThreshold) succeeded: remembers the program's value and
// puts the driver's back to 0 with `set_zero`.
template <typename SetZero>
void hold_threshold_down(CUmemoryPool handle, int attr, const void* value,
                         SetZero set_zero) noexcept {
  const int d = held_threshold_device(handle, attr);
  if (d < 0 || d >= kMaxDevices || !value) return;
  std::uint64_t v = 0;
  std::memcpy(&v, value, sizeof v);
  g_program_threshold[d].store(v, std::memory_order_relaxed);
  if (v != 0) set_zero();
}

// After the native GetAttribute(ReleaseThreshold) succeeded: the program reads back its own value.
void answer_program_threshold(CUmemoryPool handle, int attr, void* value) noexcept {
  const int d = held_threshold_device(handle, attr);
  if (d < 0 || d >= kMaxDevices || !value) return;
  const std::uint64_t v = g_program_threshold[d].load(std::memory_order_relaxed);
  std::memcpy(value, &v, sizeof v);
}

bool is_answered(int attr) noexcept {
  return attr == CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT ||
         attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH || attr == CU_MEMPOOL_ATTR_USED_MEM_CURRENT ||
         attr == CU_MEMPOOL_ATTR_USED_MEM_HIGH;
}

// After the native GetAttribute succeeded: adds the pool's figure for attr to *value when the
// handle is the default pool of a device the pool serves.
void add_pool_figure(CUmemoryPool handle, int attr, void* value) noexcept {
  Pool* pool = pl::existing_pool();
  if (!pool || !value || !is_answered(attr)) return;
  const int d = served_default_pool_device(*pool, handle);
  if (d < 0) return;
  std::uint64_t figure = 0;
  switch (attr) {
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT:
      figure = pool->stats(d).bytes_reserved;
      break;
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT:
      figure = pool->stats(d).bytes_allocated;
      break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
      figure = pool->peaks_since_reset(d).reserved;
      break;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
      figure = pool->peaks_since_reset(d).allocated;
      break;
    default:
      return;
  }
  std::uint64_t v = 0;
  std::memcpy(&v, value, sizeof v);  // the caller's buffer need not be aligned
  v += figure;
  std::memcpy(value, &v, sizeof v);
}

// After the native SetAttribute succeeded (it accepts only 0 for the highs): restarts the pool's
// mark as the driver restarted its own.
void reset_pool_mark(CUmemoryPool handle, int attr) noexcept {
  if (attr != CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH && attr != CU_MEMPOOL_ATTR_USED_MEM_HIGH) return;
  Pool* pool = pl::existing_pool();
  if (!pool) return;
  const int d = served_default_pool_device(*pool, handle);
  if (d < 0) return;
  if (attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) {
    pool->reset_peak_reserved(d);
  } else {
    pool->reset_peak_allocated(d);
  }
}

// After the native TrimTo succeeded.
void trim_pool(CUmemoryPool handle, std::size_t min_bytes_to_keep) noexcept {
  if (min_bytes_to_keep != 0) return;
  Pool* pool = pl::existing_pool();
  if (!pool) return;
  const int d = served_default_pool_device(*pool, handle);
  if (d >= 0) pool->trim(d);
}

template <typename Fn, typename... Args>
CUresult forward_driver(Hook h, Args... args) {
  auto fn = pl::real_as<Fn>(h);
  return fn ? fn(args...) : CUDA_ERROR_NOT_INITIALIZED;
}

template <typename Fn, typename... Args>
cudaError forward_runtime(Hook h, Args... args) {
  auto fn = pl::real_as<Fn>(h);
  if (!fn) return cudaErrorInitializationError;
  pl::PassthroughScope guard;
  return fn(args...);
}

CUresult alloc_from_pool_async(CUdeviceptr* dptr, std::size_t size, CUmemoryPool mem_pool,
                               CUstream stream, bool per_thread) {
  const Hook h = per_thread ? Hook::cuMemAllocFromPoolAsync_ptsz : Hook::cuMemAllocFromPoolAsync;
  Pool* pool = pl::serving_pool();
  const int d = pool && dptr && size != 0 ? served_default_pool_device(*pool, mem_pool) : -1;
  if (d < 0) {
    return forward_driver<PFN_cuMemAllocFromPoolAsync>(h, dptr, size, mem_pool, stream);
  }
  if (!pl::stream_capturing(stream, per_thread)) {
    const int r = pl::serve_stream_ordered_driver(*pool, d, size, stream, per_thread, dptr);
    if (r >= 0) return static_cast<CUresult>(r);
  }
  pl::note_passthrough();
  return forward_driver<PFN_cuMemAllocFromPoolAsync>(h, dptr, size, mem_pool, stream);
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) CUresult cuMemAllocFromPoolAsync(CUdeviceptr* dptr,
                                                                        size_t bytesize,
                                                                        CUmemoryPool pool,
                                                                        CUstream stream) {
  return alloc_from_pool_async(dptr, bytesize, pool, stream, false);
}
__attribute__((visibility("default"))) CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr* dptr,
                                                                             size_t bytesize,
                                                                             CUmemoryPool pool,
                                                                             CUstream stream) {
  return alloc_from_pool_async(dptr, bytesize, pool, stream, true);
}

__attribute__((visibility("default"))) CUresult cuDeviceGetDefaultMemPool(CUmemoryPool* pool,
                                                                          int device) {
  CUresult r =
      forward_driver<PFN_cuDeviceGetDefaultMemPool>(Hook::cuDeviceGetDefaultMemPool, pool, device);
  if (r == CUDA_SUCCESS && pool) remember_default_pool(device, *pool);
  return r;
}

__attribute__((visibility("default"))) CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr,
                                                                      void* value) {
  CUresult r =
      forward_driver<PFN_cuMemPoolGetAttribute>(Hook::cuMemPoolGetAttribute, pool, attr, value);
  if (r == CUDA_SUCCESS) {
    add_pool_figure(pool, attr, value);
    answer_program_threshold(pool, attr, value);
  }
  return r;
}

__attribute__((visibility("default"))) CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr,
                                                                      void* value) {
  CUresult r =
      forward_driver<PFN_cuMemPoolSetAttribute>(Hook::cuMemPoolSetAttribute, pool, attr, value);
  if (r == CUDA_SUCCESS) {
    reset_pool_mark(pool, attr);
    hold_threshold_down(pool, attr, value, [&] {
      std::uint64_t zero = 0;
      forward_driver<PFN_cuMemPoolSetAttribute>(Hook::cuMemPoolSetAttribute, pool, attr, &zero);
    });
  }
  return r;
}

__attribute__((visibility("default"))) CUresult cuMemPoolTrimTo(CUmemoryPool pool,
                                                                size_t min_bytes_to_keep) {
  CUresult r = forward_driver<PFN_cuMemPoolTrimTo>(Hook::cuMemPoolTrimTo, pool, min_bytes_to_keep);
  if (r == CUDA_SUCCESS) trim_pool(pool, min_bytes_to_keep);
  return r;
}

__attribute__((visibility("default"))) cudaError cudaDeviceGetDefaultMemPool(CUmemoryPool* pool,
                                                                             int device) {
  cudaError r = forward_runtime<PFN_cudaDeviceGetDefaultMemPool>(Hook::cudaDeviceGetDefaultMemPool,
                                                                 pool, device);
  if (r == cudaSuccess && pool) remember_default_pool(device, *pool);
  return r;
}

__attribute__((visibility("default"))) cudaError cudaMemPoolGetAttribute(CUmemoryPool pool,
                                                                         int attr, void* value) {
  cudaError r = forward_runtime<PFN_cudaMemPoolGetAttribute>(Hook::cudaMemPoolGetAttribute, pool,
                                                             attr, value);
  if (r == cudaSuccess) {
    add_pool_figure(pool, attr, value);
    answer_program_threshold(pool, attr, value);
  }
  return r;
}

__attribute__((visibility("default"))) cudaError cudaMemPoolSetAttribute(CUmemoryPool pool,
                                                                         int attr, void* value) {
  cudaError r = forward_runtime<PFN_cudaMemPoolSetAttribute>(Hook::cudaMemPoolSetAttribute, pool,
                                                             attr, value);
  if (r == cudaSuccess) {
    reset_pool_mark(pool, attr);
    hold_threshold_down(pool, attr, value, [&] {
      std::uint64_t zero = 0;
      forward_runtime<PFN_cudaMemPoolSetAttribute>(Hook::cudaMemPoolSetAttribute, pool, attr,
                                                   &zero);
    });
  }
  return r;
}

__attribute__((visibility("default"))) cudaError cudaMemPoolTrimTo(CUmemoryPool pool,
                                                                   size_t min_bytes_to_keep) {
  cudaError r =
      forward_runtime<PFN_cudaMemPoolTrimTo>(Hook::cudaMemPoolTrimTo, pool, min_bytes_to_keep);
  if (r == cudaSuccess) trim_pool(pool, min_bytes_to_keep);
  return r;
}

}  // extern "C"
