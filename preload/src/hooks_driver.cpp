// Driver-level hooks: what the CUDA runtime (dynamic or static), CuPy, JAX/XLA and driver-API
// programs call to allocate. Each hook either serves the call from the pool or forwards it, with
// its arguments untouched, to the real driver function, so anything the pool does not handle
// (bad arguments, no context, size 0, foreign pointers, graph capture) gets exactly the native
// result.
//
// Under the passthrough guard (a runtime call the shim already forwarded) every hook forwards at
// once: the runtime's internal driver calls belong to an allocation the shim decided not to serve.
#include <cstring>

#include "hooks.h"
#include "ipc_hooks.h"
#include "program_memory.h"
#include "real_api.h"
#include "shim.h"

using namespace gpustitch;
using namespace gpustitch::cuda;
using gpustitch::preload::Hook;
namespace pl = gpustitch::preload;

namespace {

// Forwards to the real driver function, or reports "no driver" if there is none.
template <typename Fn, typename... Args>
CUresult forward(Hook h, Args... args) {
  auto fn = pl::real_as<Fn>(h);
  return fn ? fn(args...) : CUDA_ERROR_NOT_INITIALIZED;
}

// Serves a cudaMalloc-semantics allocation (any stream may use it) on the current device.
// Returns -1 when the call must be forwarded instead.
int serve_sync_alloc(Pool* pool, CUdeviceptr* dptr, std::size_t size) {
  int device = 0;
  if (!pl::driver_current_device(&device)) return -1;  // native reports the missing context
  DevPtr out = 0;
  // -1: the pool cannot serve this device, the driver can.
  const pl::Served served = pl::serve_allocation(*pool, device, size, kAnyStream, &out);
  return pl::driver_result(served, dptr, out);
}

CUresult alloc_async(CUdeviceptr* dptr, std::size_t size, CUstream stream, bool per_thread) {
  Hook h = per_thread ? Hook::cuMemAllocAsync_ptsz : Hook::cuMemAllocAsync;
  Pool* pool = pl::serving_pool();
  if (!pool || !dptr || size == 0) return forward<PFN_cuMemAllocAsync>(h, dptr, size, stream);
  int device = 0;
  if (pl::stream_capturing(stream, per_thread) ||
      !pl::stream_device(stream, per_thread, false, &device)) {
    pl::note_passthrough();
    return forward<PFN_cuMemAllocAsync>(h, dptr, size, stream);
  }
  const int r = pl::serve_stream_ordered_driver(*pool, device, size, stream, per_thread, dptr);
  if (r >= 0) return static_cast<CUresult>(r);
  pl::note_passthrough();
  return forward<PFN_cuMemAllocAsync>(h, dptr, size, stream);
}

CUresult free_async(CUdeviceptr dptr, CUstream stream, bool per_thread) {
  Hook h = per_thread ? Hook::cuMemFreeAsync_ptsz : Hook::cuMemFreeAsync;
  Pool* pool = pl::existing_pool();
  if (pool && dptr) {
    CUresult error = CUDA_SUCCESS;
    switch (pl::serve_free_async(*pool, dptr, stream, per_thread, "cuMemFreeAsync", &error)) {
      case pl::FreeServed::freed:
        return CUDA_SUCCESS;
      case pl::FreeServed::capture_unsupported:
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
      case pl::FreeServed::invalid_stream:
        return error;
      case pl::FreeServed::not_served:
        break;
    }
  }
  return forward<PFN_cuMemFreeAsync>(h, dptr, stream);
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) CUresult cuMemAlloc_v2(CUdeviceptr* dptr, size_t bytesize) {
  Pool* pool = pl::serving_pool();
  if (pool && dptr && bytesize != 0) {
    int r = pl::ipc_native() ? -1 : serve_sync_alloc(pool, dptr, bytesize);
    if (r >= 0) return r;
    pl::note_passthrough();
  }
  return forward<PFN_cuMemAlloc_v2>(Hook::cuMemAlloc_v2, dptr, bytesize);
}

__attribute__((visibility("default"))) CUresult cuMemFree_v2(CUdeviceptr dptr) {
  Pool* pool = pl::existing_pool();
  if (pool && dptr && pool->deallocate(dptr, kAnyStream) == Status::ok) return CUDA_SUCCESS;
  return forward<PFN_cuMemFree_v2>(Hook::cuMemFree_v2, dptr);
}

__attribute__((visibility("default"))) CUresult cuMemAllocAsync(CUdeviceptr* dptr, size_t bytesize,
                                                                CUstream stream) {
  return alloc_async(dptr, bytesize, stream, false);
}
__attribute__((visibility("default"))) CUresult cuMemAllocAsync_ptsz(CUdeviceptr* dptr,
                                                                     size_t bytesize,
                                                                     CUstream stream) {
  return alloc_async(dptr, bytesize, stream, true);
}
__attribute__((visibility("default"))) CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream) {
  return free_async(dptr, stream, false);
}
__attribute__((visibility("default"))) CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr,
                                                                    CUstream stream) {
  return free_async(dptr, stream, true);
}

__attribute__((visibility("default"))) CUresult cuMemAllocPitch_v2(CUdeviceptr* dptr, size_t* pitch,
                                                                   size_t width, size_t height,
                                                                   unsigned element_size) {
  Pool* pool = pl::serving_pool();
  bool valid = dptr && pitch && width != 0 && height != 0 &&
               (element_size == 4 || element_size == 8 || element_size == 16);
  if (pool && valid) {
    std::size_t p = align_up(width, kPitchAlignment);
    if (!pl::ipc_native() && p >= width && height <= SIZE_MAX / p) {
      int r = serve_sync_alloc(pool, dptr, p * height);
      if (r == CUDA_SUCCESS) *pitch = p;
      if (r >= 0) return r;
    }
    pl::note_passthrough();
  }
  return forward<PFN_cuMemAllocPitch_v2>(Hook::cuMemAllocPitch_v2, dptr, pitch, width, height,
                                         element_size);
}

__attribute__((visibility("default"))) CUresult cuMemGetInfo_v2(size_t* free, size_t* total) {
  Pool* pool = pl::serving_pool();
  int device = 0;
  if (pool && free && total && pl::driver_current_device(&device)) {
    std::size_t f = 0, t = 0;
    if (pool->mem_info(device, &f, &t) == Status::ok) {
      *free = pl::program_bounded_free(*pool, device, f, t);
      *total = t;
      return CUDA_SUCCESS;
    }
  }
  return forward<PFN_cuMemGetInfo_v2>(Hook::cuMemGetInfo_v2, free, total);
}

__attribute__((visibility("default"))) CUresult cuMemGetAddressRange_v2(CUdeviceptr* base,
                                                                        size_t* size,
                                                                        CUdeviceptr dptr) {
  Pool* pool = pl::existing_pool();
  BlockInfo info;
  if (pool && dptr && pool->find(dptr, &info)) {
    if (base) *base = info.base;
    if (size) *size = info.size;
    return CUDA_SUCCESS;
  }
  return forward<PFN_cuMemGetAddressRange_v2>(Hook::cuMemGetAddressRange_v2, base, size, dptr);
}

}  // extern "C"

namespace {

// Answers attribute for a pool block. False: ask the driver (which sees the block's VMM mapping
// and answers the remaining attributes correctly for it).
bool pool_attribute(int attribute, void* data, CUdeviceptr ptr, const BlockInfo& info) {
  switch (attribute) {
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: {
      unsigned v = CU_MEMORYTYPE_DEVICE;
      std::memcpy(data, &v, sizeof v);
      return true;
    }
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: {
      CUdeviceptr v = ptr;
      std::memcpy(data, &v, sizeof v);
      return true;
    }
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: {
      int v = info.device;
      std::memcpy(data, &v, sizeof v);
      return true;
    }
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: {
      CUdeviceptr v = info.base;
      std::memcpy(data, &v, sizeof v);
      return true;
    }
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: {
      std::size_t v = info.size;
      std::memcpy(data, &v, sizeof v);
      return true;
    }
    default:
      return false;
  }
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) CUresult cuPointerGetAttribute(void* data, int attribute,
                                                                      CUdeviceptr ptr) {
  Pool* pool = pl::existing_pool();
  BlockInfo info;
  if (pool && data && ptr && pool->find(ptr, &info) && pool_attribute(attribute, data, ptr, info)) {
    return CUDA_SUCCESS;
  }
  return forward<PFN_cuPointerGetAttribute>(Hook::cuPointerGetAttribute, data, attribute, ptr);
}

__attribute__((visibility("default"))) CUresult cuPointerGetAttributes(unsigned count,
                                                                       int* attributes, void** data,
                                                                       CUdeviceptr ptr) {
  Pool* pool = pl::existing_pool();
  BlockInfo info;
  if (!pool || !attributes || !data || count == 0 || !pool->find(ptr, &info)) {
    return forward<PFN_cuPointerGetAttributes>(Hook::cuPointerGetAttributes, count, attributes,
                                               data, ptr);
  }
  auto real = pl::real_as<PFN_cuPointerGetAttributes>(Hook::cuPointerGetAttributes);
  for (unsigned i = 0; i < count; ++i) {
    if (!data[i]) continue;
    if (pool_attribute(attributes[i], data[i], ptr, info)) continue;
    // One attribute at a time: cuPointerGetAttributes assigns defaults instead of failing.
    if (real) {
      CUresult r = real(1, &attributes[i], &data[i], ptr);
      if (r != CUDA_SUCCESS) return r;
    }
  }
  return CUDA_SUCCESS;
}

// CUDA IPC (ipc_hooks.h): the driver's codes for the shared answer.
__attribute__((visibility("default"))) CUresult cuIpcGetMemHandle(void* handle, CUdeviceptr dptr) {
  const pl::ipc::HookAnswer a = pl::ipc::get_mem_handle(pl::ipc::Api::driver, handle, dptr);
  if (a.kind == pl::ipc::HookAnswer::Kind::answered) return pl::to_curesult(a.status);
  return forward<PFN_cuIpcGetMemHandle>(Hook::cuIpcGetMemHandle, handle, dptr);
}

__attribute__((visibility("default"))) CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* dptr,
                                                                      IpcMemHandle handle,
                                                                      unsigned flags) {
  const pl::ipc::HookAnswer a = pl::ipc::open_mem_handle(pl::ipc::Api::driver, &handle, dptr);
  switch (a.kind) {
    case pl::ipc::HookAnswer::Kind::answered:
      return pl::to_curesult(a.status);
    case pl::ipc::HookAnswer::Kind::no_context:
      return CUDA_ERROR_INVALID_CONTEXT;
    case pl::ipc::HookAnswer::Kind::forward:
      break;
  }
  return forward<PFN_cuIpcOpenMemHandle_v2>(Hook::cuIpcOpenMemHandle_v2, dptr, handle, flags);
}

__attribute__((visibility("default"))) CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) {
  const pl::ipc::HookAnswer a = pl::ipc::close_mem_handle(dptr);
  if (a.kind == pl::ipc::HookAnswer::Kind::answered) return pl::to_curesult(a.status);
  return forward<PFN_cuIpcCloseMemHandle>(Hook::cuIpcCloseMemHandle, dptr);
}

__attribute__((visibility("default"))) CUresult cuCtxEnablePeerAccess(CUcontext peer,
                                                                      unsigned flags) {
  CUresult r = forward<PFN_cuCtxEnablePeerAccess>(Hook::cuCtxEnablePeerAccess, peer, flags);
  if (r != CUDA_SUCCESS && r != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED) return r;
  Pool* pool = pl::serving_pool();
  const auto& d = pl::driver_calls();
  int device = 0, peer_device = 0;
  if (!pool || !d.ctx_push || !d.ctx_pop || !pl::driver_current_device(&device)) return r;
  // The peer context's device: make it current for a moment.
  if (d.ctx_push(peer) != CUDA_SUCCESS) return r;
  bool ok = pl::driver_current_device(&peer_device);
  CUcontext popped = nullptr;
  d.ctx_pop(&popped);
  // The current context's device may now read peer_device's memory, pool memory included.
  if (ok && pool->grant_peer_access(peer_device, device) != Status::ok) {
    pl::log().error("could not map pool memory of device {} for peer device {}", peer_device,
                    device);
  }
  return r;
}

}  // extern "C"
