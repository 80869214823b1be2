// Virtual memory management hooks: cuMemCreate, cuMemRelease, cuMemRetainAllocationHandle,
// cuMemMap, cuMemUnmap, cuMemAddressReserve and cuMemAddressFree, as a program calls them itself
// (XLA, PyTorch's expandable segments, NCCL, vLLM), reached by symbol, dlsym, cuGetProcAddress or
// cudaGetDriverEntryPoint like every other hook (hooks.h).
//
// Two calls may be served by the pool (program_lending.h): a cuMemCreate the pool's idle handles
// can answer gets one of them, and the last cuMemRelease of a handle the pool keeps is not
// forwarded (the handle goes to the pool's cache once the program maps it nowhere). Everything
// else goes to the real driver with its arguments untouched, and the caller gets the driver's
// answer, errors included (NULL pointers, unknown handles and bad ranges are the driver's to
// judge). Successful calls are counted as memory the program maps itself (program_memory.h). The
// pool's own VMM calls never arrive here: its backend holds the real entry points (real_api.h,
// resolve_real_driver).
#include "hooks.h"
#include "program_memory.h"
#include "real_api.h"

using namespace gpustitch::cuda;
using gpustitch::preload::Hook;
namespace pl = gpustitch::preload;

extern "C" {

__attribute__((visibility("default"))) CUresult cuMemCreate(CUmemGenericAllocationHandle* handle,
                                                            size_t size, const void* prop,
                                                            unsigned long long flags) {
  auto fn = pl::real_as<PFN_cuMemCreate>(Hook::cuMemCreate);
  if (!fn) return CUDA_ERROR_NOT_INITIALIZED;
  pl::PoolTerms terms;
  CUmemGenericAllocationHandle lent = 0;
  if (pl::lend_to_program(size, prop, flags, &lent, &terms)) {
    *handle = lent;
    pl::note_program_create(lent, size, prop, terms, true);
    return CUDA_SUCCESS;
  }
  const CUresult r = fn(handle, size, prop, flags);
  if (r == CUDA_SUCCESS && handle) pl::note_program_create(*handle, size, prop, terms);
  return r;
}

__attribute__((visibility("default"))) CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  auto fn = pl::real_as<PFN_cuMemRelease>(Hook::cuMemRelease);
  if (!fn) return CUDA_ERROR_NOT_INITIALIZED;
  return pl::program_release(fn, handle);
}

__attribute__((visibility("default"))) CUresult cuMemRetainAllocationHandle(
    CUmemGenericAllocationHandle* handle, void* addr) {
  auto fn = pl::real_as<PFN_cuMemRetainAllocationHandle>(Hook::cuMemRetainAllocationHandle);
  if (!fn) return CUDA_ERROR_NOT_INITIALIZED;
  const CUresult r = fn(handle, addr);
  if (r == CUDA_SUCCESS && handle) pl::note_program_retain(*handle);
  return r;
}

__attribute__((visibility("default"))) CUresult cuMemMap(CUdeviceptr ptr, size_t size,
                                                         size_t offset,
                                                         CUmemGenericAllocationHandle handle,
                                                         unsigned long long flags) {
  auto fn = pl::real_as<PFN_cuMemMap>(Hook::cuMemMap);
  if (!fn) return CUDA_ERROR_NOT_INITIALIZED;
  const CUresult r = fn(ptr, size, offset, handle, flags);
  if (r == CUDA_SUCCESS) pl::note_program_map(ptr, size, handle);
  return r;
}

__attribute__((visibility("default"))) CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  auto fn = pl::real_as<PFN_cuMemUnmap>(Hook::cuMemUnmap);
  if (!fn) return CUDA_ERROR_NOT_INITIALIZED;
  return pl::program_unmap(fn, ptr, size);
}

// An exported handle may be imported by another process, which then keeps its memory alive and
// mapped after this program releases it: such a handle must never become the pool's (the pool
// would hand out memory someone else still maps), so it goes back to the driver when done.
__attribute__((visibility("default"))) CUresult cuMemExportToShareableHandle(
    void* shareable, CUmemGenericAllocationHandle handle, int type, unsigned long long flags) {
  auto fn = pl::real_as<PFN_cuMemExportToShareableHandle>(Hook::cuMemExportToShareableHandle);
  if (!fn) return CUDA_ERROR_NOT_INITIALIZED;
  pl::note_program_export(handle);  // before the driver: no window in which it is kept
  return fn(shareable, handle, type, flags);
}

// Address ranges hold no memory, so reserving and freeing them is only forwarded; they are hooked
// so that a program holds the shim's entry point for every VMM call it makes.
__attribute__((visibility("default"))) CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size,
                                                                    size_t alignment,
                                                                    CUdeviceptr addr,
                                                                    unsigned long long flags) {
  auto fn = pl::real_as<PFN_cuMemAddressReserve>(Hook::cuMemAddressReserve);
  return fn ? fn(ptr, size, alignment, addr, flags) : CUDA_ERROR_NOT_INITIALIZED;
}

__attribute__((visibility("default"))) CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  auto fn = pl::real_as<PFN_cuMemAddressFree>(Hook::cuMemAddressFree);
  return fn ? fn(ptr, size) : CUDA_ERROR_NOT_INITIALIZED;
}

}  // extern "C"
