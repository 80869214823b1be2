// The CUDA IPC hooks' shared logic: what cudaIpcGetMemHandle / cuIpcGetMemHandle,
// cudaIpcOpenMemHandle / cuIpcOpenMemHandle_v2 and cudaIpcCloseMemHandle / cuIpcCloseMemHandle
// do with a call, once for both APIs (ipc_hooks.cpp). Each hook in hooks_runtime.cpp and
// hooks_driver.cpp is a translation of the answer into its API's codes, or a forward of the call,
// arguments untouched, to CUDA.
#pragma once

#include "gpustitch/pool.h"

namespace gpustitch::preload::ipc {

// What became of an IPC call.
struct HookAnswer {
  enum class Kind {
    forward,     // not pool memory / not a pool handle: CUDA answers
    answered,    // the shim answered: status
    no_context,  // a pool handle opened with no current context (the driver's invalid context)
  };
  Kind kind = Kind::forward;
  Status status = Status::ok;
};

// Which API a hook belongs to: the name it logs under, and how it finds the current device.
enum class Api { runtime, driver };

// A handle for the pool block containing ptr into the 64 bytes at handle. Under ipc:native pool
// blocks keep their old answer (not_supported, logged once per API): the opt-out leaves
// cudaMalloc memory native for CUDA's own IPC.
HookAnswer get_mem_handle(Api api, void* handle, DevPtr ptr) noexcept;

// Opens the pool handle at handle into *out (not written unless ok). A null out is invalid_value.
// Without a current device the runtime forwards (the runtime creates its context and answers);
// the driver answers no_context.
HookAnswer open_mem_handle(Api api, const void* handle, DevPtr* out) noexcept;

// Closes an address open_mem_handle returned.
HookAnswer close_mem_handle(DevPtr ptr) noexcept;

}  // namespace gpustitch::preload::ipc
