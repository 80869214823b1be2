// See real_api.h.
#include "real_api.h"

#include <dlfcn.h>

#include <atomic>
#include <cstring>

namespace gpustitch::preload {
namespace {

std::atomic<void*> g_real[kHookCount];

bool is_runtime_hook(Hook h) noexcept {
  static constexpr bool runtime[] = {
#define GPUSTITCH_HOOK_RT(name, rt) rt,
      GPUSTITCH_HOOKS(GPUSTITCH_HOOK_RT)
#undef GPUSTITCH_HOOK_RT
  };
  return runtime[static_cast<int>(h)];
}

// Before 2.34 dlsym lived in libdl.so.2, at the architecture's first glibc version.
#if defined(__aarch64__)
constexpr const char* kDlsymFirstVersion = "GLIBC_2.17";
#else
constexpr const char* kDlsymFirstVersion = "GLIBC_2.2.5";
#endif

}  // namespace

DlsymFn glibc_dlsym() noexcept {
  static std::atomic<DlsymFn> cached{nullptr};
  DlsymFn fn = cached.load(std::memory_order_acquire);
  if (fn) return fn;
  // dlvsym is not interposed, so this reaches glibc directly. Several threads may race here; they
  // all store the same value.
  fn = reinterpret_cast<DlsymFn>(dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34"));
  if (!fn) fn = reinterpret_cast<DlsymFn>(dlvsym(RTLD_NEXT, "dlsym", kDlsymFirstVersion));
  cached.store(fn, std::memory_order_release);
  return fn;
}

void* real_dlsym(void* handle, const char* symbol) noexcept {
  return glibc_dlsym()(handle, symbol);
}

void* libcuda() noexcept {
  // A plain function-local static: its initialisation (dlopen) may run libcuda's constructors,
  // which may call dlsym, which never comes back here (hooks_dlsym.cpp does not need the handle).
  static void* handle = [] {
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (!h) h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    return h;
  }();
  return handle;
}

void* driver_symbol(const char* symbol) noexcept {
  void* h = libcuda();
  return h ? real_dlsym(h, symbol) : nullptr;
}

void record_real(Hook h, void* fn) noexcept {
  if (!fn || is_hook_address(fn)) return;
  void* expected = nullptr;
  g_real[static_cast<int>(h)].compare_exchange_strong(expected, fn, std::memory_order_acq_rel);
}

void* real(Hook h) noexcept {
  auto& slot = g_real[static_cast<int>(h)];
  void* fn = slot.load(std::memory_order_acquire);
  if (fn) return fn;
  const char* name = hook_name(h);
  if (is_runtime_hook(h)) {
    fn = real_dlsym(RTLD_NEXT, name);
  } else {
    fn = driver_symbol(name);
  }
  if (fn && !is_hook_address(fn)) {
    record_real(h, fn);
    return slot.load(std::memory_order_acquire);
  }
  return nullptr;
}

const DriverCalls& driver_calls() noexcept {
  static const DriverCalls calls = [] {
    DriverCalls c;
    c.ctx_get_device = reinterpret_cast<cuda::PFN_cuCtxGetDevice>(driver_symbol("cuCtxGetDevice"));
    c.device_get_count =
        reinterpret_cast<cuda::PFN_cuDeviceGetCount>(driver_symbol("cuDeviceGetCount"));
    c.ctx_push = reinterpret_cast<cuda::PFN_cuCtxPushCurrent>(driver_symbol("cuCtxPushCurrent_v2"));
    c.ctx_pop = reinterpret_cast<cuda::PFN_cuCtxPopCurrent>(driver_symbol("cuCtxPopCurrent_v2"));
    c.stream_is_capturing =
        reinterpret_cast<cuda::PFN_cuStreamIsCapturing>(driver_symbol("cuStreamIsCapturing"));
    c.stream_is_capturing_ptsz =
        reinterpret_cast<cuda::PFN_cuStreamIsCapturing>(driver_symbol("cuStreamIsCapturing_ptsz"));
    c.stream_get_device =
        reinterpret_cast<cuda::PFN_cuStreamGetDevice>(driver_symbol("cuStreamGetDevice"));
    c.stream_get_device_ptsz =
        reinterpret_cast<cuda::PFN_cuStreamGetDevice>(driver_symbol("cuStreamGetDevice_ptsz"));
    return c;
  }();
  return calls;
}

void* resolve_real_driver(const char* symbol, void* /*context*/) {
  if (!symbol || !libcuda()) return nullptr;
  auto get_proc = real_as<cuda::PFN_cuGetProcAddress_v2>(Hook::cuGetProcAddress_v2);
  if (get_proc) {
    void* fn = nullptr;
    int status = 0;
    // 13000: the toolkit generation this shim is built against; the driver returns the newest
    // variant of each entry point that existed at that version.
    if (get_proc(symbol, &fn, 13000, cuda::CU_GET_PROC_ADDRESS_LEGACY_STREAM, &status) ==
            cuda::CUDA_SUCCESS &&
        fn && !is_hook_address(fn)) {
      return fn;
    }
  }
  void* fn = driver_symbol(symbol);
  return is_hook_address(fn) ? nullptr : fn;
}

}  // namespace gpustitch::preload
