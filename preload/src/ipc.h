// CUDA IPC on pool memory, as the hooks use it (cudaIpcGetMemHandle, cudaIpcOpenMemHandle,
// cudaIpcCloseMemHandle and their driver forms). ipc_export.cpp: the exporting side and the design;
// ipc_import.cpp: the importing side; ipc_protocol.h: the handle and the messages; ipc_hooks.h:
// the hooks' shared use of these.
#pragma once

#include "gpustitch/pool.h"

namespace gpustitch::preload::ipc {

// Fills the 64 bytes at handle with a handle for the pool block containing ptr (the same handle
// for every call on one live block). invalid_value: ptr is not a live pool block; not_supported:
// the backend's handles cannot be exported (logged once); error: no server socket (logged).
Status export_block(Pool& pool, DevPtr ptr, void* handle) noexcept;

// Whether the 64 bytes at handle are one of ours (else they are the driver's).
bool is_pool_handle(const void* handle) noexcept;

// Maps the block a pool handle names into this process, on the exporter's device (by UUID) or
// else current_device; *out: the block's address here. Opening one handle again gives the same
// address and counts one more open. invalid_value: the exporter is gone, refuses this process,
// or does not know the handle (a forged one); other failures as the backend reports them.
Status open_handle(Pool& pool, const void* handle, int current_device, DevPtr* out) noexcept;

// Undoes one open_handle of ptr. False when ptr is not an address open_handle returned (or was
// closed already): the caller passes the call to CUDA, which answers for it.
bool close_handle(Pool& pool, DevPtr ptr, Status* status) noexcept;

}  // namespace gpustitch::preload::ipc
