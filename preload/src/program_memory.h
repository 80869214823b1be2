// Device memory a program maps itself with the CUDA virtual memory management API (cuMemCreate,
// cuMemMap, ...): what XLA (JAX), PyTorch's expandable segments, NCCL's cuMem buffers and vLLM do
// instead of calling cuMemAlloc. The pool does not serve these calls (hooks_vmm.cpp forwards each
// one to the driver unchanged); this only counts what the program holds that way, per device, so
// that every byte on the GPU is accounted for: the statistics record (program_* fields), `gpustitch
// ps/show`, Prometheus, and the shim's cuMemGetInfo/cudaMemGetInfo answers.
//
// What is counted, per device (the device a handle's allocation properties name):
//   * created: bytes of handles the program created and has not released, and their number;
//   * mapped: bytes of address range the program mapped and has not unmapped;
//   * held: physical bytes the program still holds, which is what the driver (and NVML) charges
//     it: a handle counts from cuMemCreate until it is both released and unmapped everywhere (as
//     in CUDA, a released handle stays alive while it is mapped).
// Host-located allocations (cuMemCreate on host NUMA memory) are not device memory and are not
// counted. Mapping a handle the program did not create here (imported from another process) counts
// as mapped on the current context's device, and not as held.
//
// Of the held bytes, those of handles the pool lent (program_lending.h: a cuMemCreate answered
// with an idle handle of the pool) are also counted as served by the pool, and a kept handle
// (lent, or created with the pool's properties) goes to the pool's cache instead of the driver
// when the program is done with it: its last release is not forwarded, and once it is mapped
// nowhere it is retired (retire_kept_handle), under the table lock.
//
// Only successful calls are counted. The pool's own driver calls never pass through the hooks (the
// backend gets the real entry points, see real_api.h), so they are never counted here.
//
// Cost: the counters are atomics read without a lock. A mutex guards two small tables (handle ->
// size, device, references, mappings; mapped address -> size, handle). cuMemRelease and cuMemUnmap
// are forwarded while it is held, so a handle value or an address that the driver gives out again
// right after it was freed is never confused with the old one. Table updates never throw (a host
// allocation failure loses that entry, never the program's call). Fork handlers keep the mutex
// usable in a child.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda_abi.h"
#include "gpustitch/pool.h"
#include "program_lending.h"

namespace gpustitch::shm {
struct DeviceCounters;
}

namespace gpustitch::preload {

struct ProgramMemory {
  std::uint64_t held_bytes = 0;
  std::uint64_t created_bytes = 0;
  std::uint64_t handles = 0;
  std::uint64_t mapped_bytes = 0;
  std::uint64_t served_bytes = 0;  // of held_bytes: handles the pool lent
  std::uint64_t served_handles = 0;
};

// Figures for device (zero for devices never used this way, or out of range).
ProgramMemory program_memory(int device) noexcept;

// After a successful cuMemCreate with these properties: by the driver, or (lent) answered with a
// handle of the pool; terms says whether the pool keeps the handle once the program is done.
void note_program_create(cuda::CUmemGenericAllocationHandle handle, std::size_t size,
                         const void* prop, const PoolTerms& terms = {}, bool lent = false) noexcept;
// Before cuMemExportToShareableHandle: the handle is never the pool's (program_lending.h).
void note_program_export(cuda::CUmemGenericAllocationHandle handle) noexcept;
// After a successful cuMemRetainAllocationHandle.
void note_program_retain(cuda::CUmemGenericAllocationHandle handle) noexcept;
// After a successful cuMemMap.
void note_program_map(cuda::CUdeviceptr ptr, std::size_t size,
                      cuda::CUmemGenericAllocationHandle handle) noexcept;
// Forwards cuMemRelease / cuMemUnmap through fn and counts the result, under the table lock (the
// last release of a kept handle is not forwarded; a kept handle mapped nowhere and released is
// retired).
cuda::CUresult program_release(cuda::PFN_cuMemRelease fn,
                               cuda::CUmemGenericAllocationHandle handle) noexcept;
cuda::CUresult program_unmap(cuda::PFN_cuMemUnmap fn, cuda::CUdeviceptr ptr,
                             std::size_t size) noexcept;

// The record's program_* fields of device (the publisher's augment hook), and the largest
// possible allocation bounded by what the program's own memory leaves (see bound_free_memory).
void fill_program_counters(int device, shm::DeviceCounters& counters) noexcept;

// The bound program memory puts on a free-memory figure: at most total - held - pool_in_use.
// On a real GPU the driver's free memory, which the pool's figures start from, already excludes
// the program's own memory, so the bound changes nothing there; it matters where the figure is
// not the driver's (a per-device cap, cap_mb/cap_fraction, or the simulated backend).
std::size_t bound_free_memory(std::size_t free, std::size_t total, std::uint64_t held,
                              std::uint64_t pool_in_use) noexcept;

// The pool's free-memory answer for device (cuMemGetInfo, cudaMemGetInfo) with that bound
// applied; free unchanged (and no work done) while the program holds no memory of its own there.
std::size_t program_bounded_free(Pool& pool, int device, std::size_t free,
                                 std::size_t total) noexcept;

}  // namespace gpustitch::preload
