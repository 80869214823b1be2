// The CUDA IPC hooks' shared logic (ipc_hooks.h): a pool block is exported by the shim, a pool
// handle opened by it; everything else is CUDA's. The runtime and driver forms differ only in their
// error codes, in the name they log under, and in how the current device is found for an open
// (the runtime's way lets the runtime create its context; the driver's reports a missing one).
#include "ipc_hooks.h"

#include <atomic>

#include "ipc.h"
#include "shim.h"

namespace gpustitch::preload::ipc {

namespace {

HookAnswer answer(Status s) noexcept {
  return {HookAnswer::Kind::answered, s};
}

}  // namespace

HookAnswer get_mem_handle(Api api, void* handle, DevPtr ptr) noexcept {
  Pool* pool = existing_pool();
  if (!pool || !handle || !ptr || !pool->find(ptr)) return {};
  if (ipc_native()) {
    static std::atomic<bool> warned_runtime{false};
    static std::atomic<bool> warned_driver{false};
    if (api == Api::runtime) {
      if (!warned_runtime.exchange(true)) {
        log().error(
            "cudaIpcGetMemHandle on pool memory with ipc:native: only cudaMalloc allocations stay "
            "native and can be shared; this one came from the pool");
      }
    } else if (!warned_driver.exchange(true)) {
      log().error(
          "cuIpcGetMemHandle on pool memory with ipc:native: only cudaMalloc/cuMemAlloc "
          "allocations stay native and can be shared; this one came from the pool");
    }
    return answer(Status::not_supported);
  }
  return answer(export_block(*pool, ptr, handle));
}

HookAnswer open_mem_handle(Api api, const void* handle, DevPtr* out) noexcept {
  if (!is_pool_handle(handle)) return {};
  Pool* pool = serving_pool();
  if (!out) return answer(Status::invalid_value);
  if (!pool) return {};
  int device = 0;
  if (api == Api::runtime) {
    if (!runtime_current_device(&device)) return {};
  } else if (!driver_current_device(&device)) {
    return {HookAnswer::Kind::no_context, Status::ok};
  }
  DevPtr opened = 0;
  const Status s = open_handle(*pool, handle, device, &opened);
  if (s == Status::ok) *out = opened;
  return answer(s);
}

HookAnswer close_mem_handle(DevPtr ptr) noexcept {
  Pool* pool = existing_pool();
  Status s = Status::ok;
  if (pool && ptr && close_handle(*pool, ptr, &s)) return answer(s);
  return {};
}

}  // namespace gpustitch::preload::ipc
