// Entry points handed out by name: cuGetProcAddress (v1 and _v2) and the runtime's
// cudaGetDriverEntryPoint(ByVersion). The CUDA runtime, statically linked ones included, fetches
// every driver function this way, so these are how the shim reaches nvcc-built programs.
//
// Policy: ask the real driver first, with the caller's name, version and flags, and return its
// answer unchanged unless it is one of the entry points the shim hooks. Then substitute the hook
// of the same variant. The variant is decided by the rules the driver itself applies:
// - version: each hooked entry point has the CUDA version that introduced the variant the shim
//   hooks (cuMemAlloc_v2 since 3.2). A caller asking for an older version gets the driver's older
//   variant untouched.
// - stream flavour: with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM the _ptsz hook, with
//   LEGACY_STREAM the plain one; with DEFAULT, whichever the driver returned (compared with the
//   driver's exported _ptsz symbol), plain if that is inconclusive.
// The table of names and addresses shared with the dlsym hook lives here too.
#include <cstring>

#include "hooks.h"
#include "real_api.h"

using namespace gpustitch::cuda;
namespace pl = gpustitch::preload;
using pl::Hook;

namespace gpustitch::preload {
namespace {

struct HookEntry {
  const char* name;
  void* address;
};

const HookEntry kHooks[] = {
#define GPUSTITCH_HOOK_ENTRY(name, rt) {#name, reinterpret_cast<void*>(&::name)},
    GPUSTITCH_HOOKS(GPUSTITCH_HOOK_ENTRY)
#undef GPUSTITCH_HOOK_ENTRY
};
static_assert(sizeof(kHooks) / sizeof(kHooks[0]) == kHookCount);

// A driver entry point by base name, as cuGetProcAddress knows it.
struct ProcEntry {
  const char* base;
  int since;  // CUDA version that introduced the hooked variant
  Hook legacy;
  Hook per_thread;  // same as legacy when the call takes no stream
  bool has_stream;
};

const ProcEntry kProcs[] = {
    {"cuMemAlloc", 3020, Hook::cuMemAlloc_v2, Hook::cuMemAlloc_v2, false},
    {"cuMemFree", 3020, Hook::cuMemFree_v2, Hook::cuMemFree_v2, false},
    {"cuMemAllocPitch", 3020, Hook::cuMemAllocPitch_v2, Hook::cuMemAllocPitch_v2, false},
    {"cuMemGetInfo", 3020, Hook::cuMemGetInfo_v2, Hook::cuMemGetInfo_v2, false},
    {"cuMemGetAddressRange", 3020, Hook::cuMemGetAddressRange_v2, Hook::cuMemGetAddressRange_v2,
     false},
    {"cuMemAllocAsync", 11020, Hook::cuMemAllocAsync, Hook::cuMemAllocAsync_ptsz, true},
    {"cuMemFreeAsync", 11020, Hook::cuMemFreeAsync, Hook::cuMemFreeAsync_ptsz, true},
    {"cuPointerGetAttribute", 4000, Hook::cuPointerGetAttribute, Hook::cuPointerGetAttribute,
     false},
    {"cuPointerGetAttributes", 7000, Hook::cuPointerGetAttributes, Hook::cuPointerGetAttributes,
     false},
    {"cuIpcGetMemHandle", 4010, Hook::cuIpcGetMemHandle, Hook::cuIpcGetMemHandle, false},
    {"cuIpcOpenMemHandle", 11000, Hook::cuIpcOpenMemHandle_v2, Hook::cuIpcOpenMemHandle_v2, false},
    {"cuIpcCloseMemHandle", 4010, Hook::cuIpcCloseMemHandle, Hook::cuIpcCloseMemHandle, false},
    {"cuCtxEnablePeerAccess", 4000, Hook::cuCtxEnablePeerAccess, Hook::cuCtxEnablePeerAccess,
     false},
    {"cuDeviceGetDefaultMemPool", 11020, Hook::cuDeviceGetDefaultMemPool,
     Hook::cuDeviceGetDefaultMemPool, false},
    {"cuMemPoolGetAttribute", 11020, Hook::cuMemPoolGetAttribute, Hook::cuMemPoolGetAttribute,
     false},
    {"cuMemPoolSetAttribute", 11020, Hook::cuMemPoolSetAttribute, Hook::cuMemPoolSetAttribute,
     false},
    {"cuMemPoolTrimTo", 11020, Hook::cuMemPoolTrimTo, Hook::cuMemPoolTrimTo, false},
    {"cuMemAllocFromPoolAsync", 11020, Hook::cuMemAllocFromPoolAsync,
     Hook::cuMemAllocFromPoolAsync_ptsz, true},
    // Virtual memory management (CUDA 10.2), which programs call themselves (program_memory.h).
    {"cuMemCreate", 10020, Hook::cuMemCreate, Hook::cuMemCreate, false},
    {"cuMemRelease", 10020, Hook::cuMemRelease, Hook::cuMemRelease, false},
    {"cuMemRetainAllocationHandle", 11000, Hook::cuMemRetainAllocationHandle,
     Hook::cuMemRetainAllocationHandle, false},
    {"cuMemMap", 10020, Hook::cuMemMap, Hook::cuMemMap, false},
    {"cuMemUnmap", 10020, Hook::cuMemUnmap, Hook::cuMemUnmap, false},
    {"cuMemAddressReserve", 10020, Hook::cuMemAddressReserve, Hook::cuMemAddressReserve, false},
    {"cuMemAddressFree", 10020, Hook::cuMemAddressFree, Hook::cuMemAddressFree, false},
    {"cuMemExportToShareableHandle", 10020, Hook::cuMemExportToShareableHandle,
     Hook::cuMemExportToShareableHandle, false},
    // cuGetProcAddress itself: v2 from 12.0, v1 from 11.3 (handled below).
    {"cuGetProcAddress", 12000, Hook::cuGetProcAddress_v2, Hook::cuGetProcAddress_v2, false},
};

// Replaces *pfn, the real driver's answer for (symbol, version, flags), with the hook of the same
// variant when the shim hooks it.
void substitute(const char* symbol, void** pfn, int version, cuuint64 flags) {
  if (!symbol || !pfn || !*pfn || is_hook_address(*pfn)) return;
  if (symbol[0] != 'c' || symbol[1] != 'u') return;
  if (std::strcmp(symbol, "cuGetProcAddress") == 0 && version >= 11030 && version < 12000) {
    record_real(Hook::cuGetProcAddress, *pfn);
    *pfn = hook_address(Hook::cuGetProcAddress);
    return;
  }
  for (const ProcEntry& e : kProcs) {
    if (std::strcmp(symbol, e.base) != 0) continue;
    if (version < e.since) return;  // an older variant the shim does not hook
    bool per_thread = false;
    if (e.has_stream) {
      if (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) {
        per_thread = true;
      } else if (!(flags & CU_GET_PROC_ADDRESS_LEGACY_STREAM)) {
        per_thread = *pfn == real(e.per_thread);
      }
    }
    Hook h = per_thread ? e.per_thread : e.legacy;
    record_real(h, *pfn);
    *pfn = hook_address(h);
    return;
  }
}

}  // namespace

int find_hook(const char* symbol) noexcept {
  if (!symbol || symbol[0] != 'c' || symbol[1] != 'u') return -1;
  for (int i = 0; i < kHookCount; ++i) {
    if (std::strcmp(symbol, kHooks[i].name) == 0) return i;
  }
  return -1;
}

const char* hook_name(Hook h) noexcept {
  return kHooks[static_cast<int>(h)].name;
}
void* hook_address(Hook h) noexcept {
  return kHooks[static_cast<int>(h)].address;
}

bool is_hook_address(const void* fn) noexcept {
  if (!fn) return false;
  for (const HookEntry& e : kHooks) {
    if (e.address == fn) return true;
  }
  return false;
}

}  // namespace gpustitch::preload

extern "C" {

__attribute__((visibility("default"))) CUresult cuGetProcAddress_v2(const char* symbol, void** pfn,
                                                                    int cuda_version,
                                                                    cuuint64 flags, int* status) {
  auto real = pl::real_as<PFN_cuGetProcAddress_v2>(Hook::cuGetProcAddress_v2);
  if (!real) return CUDA_ERROR_NOT_INITIALIZED;
  CUresult r = real(symbol, pfn, cuda_version, flags, status);
  if (r == CUDA_SUCCESS) pl::substitute(symbol, pfn, cuda_version, flags);
  return r;
}

__attribute__((visibility("default"))) CUresult cuGetProcAddress(const char* symbol, void** pfn,
                                                                 int cuda_version, cuuint64 flags) {
  auto real = pl::real_as<PFN_cuGetProcAddress>(Hook::cuGetProcAddress);
  if (!real) return CUDA_ERROR_NOT_INITIALIZED;
  CUresult r = real(symbol, pfn, cuda_version, flags);
  if (r == CUDA_SUCCESS) pl::substitute(symbol, pfn, cuda_version, flags);
  return r;
}

}  // extern "C"

namespace {

// The runtime's entry-point queries. The dynamic runtime answers them through the driver's
// cuGetProcAddress, which is already hooked if it looked that up through dlsym; substituting again
// here is idempotent and covers runtimes that found the driver some other way.
cudaError entry_point(Hook h, const char* symbol, void** fn, unsigned version, bool by_version,
                      unsigned long long flags, int* status, bool ptsz_default) {
  cudaError r;
  if (by_version) {
    auto real = pl::real_as<PFN_cudaGetDriverEntryPointByVersion>(h);
    if (!real) return cudaErrorInitializationError;
    r = real(symbol, fn, version, flags, status);
  } else {
    auto real = pl::real_as<PFN_cudaGetDriverEntryPoint>(h);
    if (!real) return cudaErrorInitializationError;
    r = real(symbol, fn, flags, status);
    version = 1000000;  // "the runtime's own version": newer than every variant in the table
  }
  if (r == cudaSuccess) {
    cuuint64 f = flags;
    if (f == CU_GET_PROC_ADDRESS_DEFAULT && ptsz_default) {
      f = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    }
    pl::substitute(symbol, fn, static_cast<int>(version), f);
  }
  return r;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) cudaError cudaGetDriverEntryPoint(const char* symbol,
                                                                         void** fn,
                                                                         unsigned long long flags,
                                                                         int* status) {
  return entry_point(Hook::cudaGetDriverEntryPoint, symbol, fn, 0, false, flags, status, false);
}
__attribute__((visibility("default"))) cudaError cudaGetDriverEntryPoint_ptsz(
    const char* symbol, void** fn, unsigned long long flags, int* status) {
  return entry_point(Hook::cudaGetDriverEntryPoint_ptsz, symbol, fn, 0, false, flags, status, true);
}
__attribute__((visibility("default"))) cudaError cudaGetDriverEntryPointByVersion(
    const char* symbol, void** fn, unsigned version, unsigned long long flags, int* status) {
  return entry_point(Hook::cudaGetDriverEntryPointByVersion, symbol, fn, version, true, flags,
                     status, false);
}
__attribute__((visibility("default"))) cudaError cudaGetDriverEntryPointByVersion_ptsz(
    const char* symbol, void** fn, unsigned version, unsigned long long flags, int* status) {
  return entry_point(Hook::cudaGetDriverEntryPointByVersion_ptsz, symbol, fn, version, true, flags,
                     status, true);
}

}  // extern "C"
