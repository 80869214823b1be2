// Where the real CUDA functions behind the hooks come from, found without ever passing through a
// hook.
//
// - dlsym itself: the shim overrides dlsym (hooks_dlsym.cpp), so its own lookups use glibc's,
//   obtained once with dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34") (or the first version, "GLIBC_2.2.5"
//   on x86_64, on glibc < 2.34).
// - Hooked functions: the first real address seen wins. It is recorded when the program's own
//   dlsym/cuGetProcAddress lookups pass through the shim (that also covers a libcudart loaded
//   RTLD_LOCAL, which RTLD_NEXT cannot see); otherwise driver symbols come from dlopen
//   ("libcuda.so.1") and runtime symbols from dlsym(RTLD_NEXT).
// - Driver functions the shim only calls (cuCtxGetDevice, cuStreamIsCapturing, ...) come from the
//   same libcuda handle.
//
// Nothing here allocates, takes a lock that a hook could re-enter, or initialises the pool: it is
// safe from inside dlsym, from library constructors and from the loader's callbacks.
#pragma once

#include "cuda_abi.h"
#include "hooks.h"

namespace gpustitch::preload {

// glibc's dlsym. Never null on glibc.
using DlsymFn = void* (*)(void*, const char*);
DlsymFn glibc_dlsym() noexcept;
void* real_dlsym(void* handle, const char* symbol) noexcept;

// The real function behind hook h, or null if it cannot be found (no driver / no runtime loaded).
void* real(Hook h) noexcept;
template <typename Fn>
Fn real_as(Hook h) noexcept {
  return reinterpret_cast<Fn>(real(h));
}
// Records fn as the real function behind h if none is known yet. fn must not be a hook.
void record_real(Hook h, void* fn) noexcept;

// The driver library handle (dlopen("libcuda.so.1")), or null if there is no driver.
void* libcuda() noexcept;
// A driver symbol by exact name (cuCtxGetDevice, cuStreamIsCapturing_ptsz, ...), cached. Only for
// symbols the shim does not hook.
void* driver_symbol(const char* symbol) noexcept;

// Functions the shim calls but does not hook. Null when the driver lacks them.
struct DriverCalls {
  cuda::PFN_cuCtxGetDevice ctx_get_device = nullptr;
  cuda::PFN_cuDeviceGetCount device_get_count = nullptr;
  cuda::PFN_cuCtxPushCurrent ctx_push = nullptr;
  cuda::PFN_cuCtxPopCurrent ctx_pop = nullptr;
  cuda::PFN_cuStreamIsCapturing stream_is_capturing = nullptr;
  cuda::PFN_cuStreamIsCapturing stream_is_capturing_ptsz = nullptr;
  cuda::PFN_cuStreamGetDevice stream_get_device = nullptr;
  cuda::PFN_cuStreamGetDevice stream_get_device_ptsz = nullptr;
};
// Resolved once, on first use; all members null when there is no driver.
const DriverCalls& driver_calls() noexcept;

// gpustitch::DriverResolver for make_cuda_backend: base names through the real
// cuGetProcAddress_v2 (latest version), exact names through dlsym on the driver handle.
void* resolve_real_driver(const char* symbol, void* context);

}  // namespace gpustitch::preload
