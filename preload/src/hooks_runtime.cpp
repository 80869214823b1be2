// Runtime-level hooks: what programs linked against the shared CUDA runtime call through the PLT
// (PyTorch's libtorch_cuda.so imports cudaMalloc@libcudart.so.13). Serving here rather than at the
// driver level keeps the runtime's bookkeeping out of the fast path.
//
// Every call the shim does not serve goes to the real runtime function under the passthrough
// guard: the runtime implements it with driver calls that reach the shim's driver hooks, and those
// must not serve the same allocation a second time.
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

template <typename Fn, typename... Args>
cudaError forward(Hook h, Args... args) {
  auto fn = pl::real_as<Fn>(h);
  if (!fn) return cudaErrorInitializationError;
  pl::PassthroughScope guard;
  return fn(args...);
}

// The runtime's code for the driver's answer about a stream it rejects. The runtime numbers these
// as the driver does (invalid handle 400, invalid context 201, context destroyed 709, invalid
// value 1); anything else reads as an invalid resource handle, the runtime's answer for a stream
// that is not one.
cudaError runtime_error_of(CUresult r) {
  switch (r) {
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_CONTEXT:
    case CUDA_ERROR_INVALID_HANDLE:
    case CUDA_ERROR_CONTEXT_IS_DESTROYED:
      return r;
    default:
      return cudaErrorInvalidResourceHandle;
  }
}

// The runtime's codes for what the pool did; -1: forward instead. A failed cudaMalloc also leaves
// its error as the runtime's last error (cudaGetLastError() after an OOM).
int runtime_result(pl::Served served, void** ptr, DevPtr out) {
  switch (served) {
    case pl::Served::ok:
      *ptr = reinterpret_cast<void*>(out);
      return cudaSuccess;
    case pl::Served::out_of_memory:
      pl::set_runtime_last_error_oom();
      return cudaErrorMemoryAllocation;
    case pl::Served::not_served:
      break;
  }
  return -1;
}

// cudaMalloc semantics on the runtime's current device. -1: forward instead.
int serve_sync_alloc(Pool* pool, void** ptr, std::size_t size) {
  int device = 0;
  if (!pl::runtime_current_device(&device)) return -1;
  DevPtr out = 0;
  const pl::Served served = pl::serve_allocation(*pool, device, size, kAnyStream, &out);
  return runtime_result(served, ptr, out);
}

cudaError malloc_async(void** ptr, std::size_t size, CUstream stream, bool per_thread) {
  Hook h = per_thread ? Hook::cudaMallocAsync_ptsz : Hook::cudaMallocAsync;
  Pool* pool = pl::serving_pool();
  int device = 0;
  if (pool && ptr && size != 0) {
    // The device first: on a thread with no current context (PyTorch's autograd thread, whose
    // first call is the loss gradient's allocation) it makes the runtime's context current, as
    // the runtime itself would, and only then can the driver say whether the NULL or per-thread
    // stream is capturing. In the other order that first allocation went to the driver's own
    // pool, uncounted: 2 GiB of HF Llama training's logits gradient.
    if (pl::stream_device(stream, per_thread, true, &device) &&
        !pl::stream_capturing(stream, per_thread)) {
      DevPtr out = 0;
      const pl::Served served =
          pl::serve_allocation(*pool, device, size, pl::stream_key(stream, per_thread), &out);
      const int r = runtime_result(served, ptr, out);
      if (r >= 0) return static_cast<cudaError>(r);
    }
    pl::note_passthrough();
  }
  return forward<PFN_cudaMallocAsync>(h, ptr, size, stream);
}

cudaError free_async(void* ptr, CUstream stream, bool per_thread) {
  Hook h = per_thread ? Hook::cudaFreeAsync_ptsz : Hook::cudaFreeAsync;
  Pool* pool = pl::existing_pool();
  auto p = reinterpret_cast<DevPtr>(ptr);
  if (pool && p) {
    // As the runtime does before the call: the context current, so that a free on a thread that
    // has made no CUDA call yet is stream-ordered, not refused for want of a context (the NULL and
    // per-thread streams' capture state needs one). A thread-local test once it has had one.
    pl::ensure_runtime_context();
    CUresult error = CUDA_SUCCESS;
    switch (pl::serve_free_async(*pool, p, stream, per_thread, "cudaFreeAsync", &error)) {
      case pl::FreeServed::freed:
        return cudaSuccess;
      case pl::FreeServed::capture_unsupported:
        return cudaErrorStreamCaptureUnsupported;
      case pl::FreeServed::invalid_stream:
        return runtime_error_of(error);
      case pl::FreeServed::not_served:
        break;
    }
  }
  return forward<PFN_cudaFreeAsync>(h, ptr, stream);
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) cudaError cudaMalloc(void** ptr, size_t size) {
  Pool* pool = pl::serving_pool();
  if (pool && ptr && size != 0) {
    int r = pl::ipc_native() ? -1 : serve_sync_alloc(pool, ptr, size);
    if (r >= 0) return r;
    pl::note_passthrough();
  }
  return forward<PFN_cudaMalloc>(Hook::cudaMalloc, ptr, size);
}

__attribute__((visibility("default"))) cudaError cudaFree(void* ptr) {
  Pool* pool = pl::existing_pool();
  if (pool && ptr && pool->deallocate(reinterpret_cast<DevPtr>(ptr), kAnyStream) == Status::ok) {
    return cudaSuccess;
  }
  return forward<PFN_cudaFree>(Hook::cudaFree, ptr);
}

__attribute__((visibility("default"))) cudaError cudaMallocAsync(void** ptr, size_t size,
                                                                 CUstream stream) {
  return malloc_async(ptr, size, stream, false);
}
__attribute__((visibility("default"))) cudaError cudaMallocAsync_ptsz(void** ptr, size_t size,
                                                                      CUstream stream) {
  return malloc_async(ptr, size, stream, true);
}
__attribute__((visibility("default"))) cudaError cudaFreeAsync(void* ptr, CUstream stream) {
  return free_async(ptr, stream, false);
}
__attribute__((visibility("default"))) cudaError cudaFreeAsync_ptsz(void* ptr, CUstream stream) {
  return free_async(ptr, stream, true);
}

__attribute__((visibility("default"))) cudaError cudaMallocPitch(void** ptr, size_t* pitch,
                                                                 size_t width, size_t height) {
  Pool* pool = pl::serving_pool();
  if (pool && ptr && pitch && width != 0 && height != 0) {
    std::size_t p = align_up(width, kPitchAlignment);
    if (!pl::ipc_native() && p >= width && height <= SIZE_MAX / p) {
      int r = serve_sync_alloc(pool, ptr, p * height);
      if (r == cudaSuccess) *pitch = p;
      if (r >= 0) return r;
    }
    pl::note_passthrough();
  }
  return forward<PFN_cudaMallocPitch>(Hook::cudaMallocPitch, ptr, pitch, width, height);
}

__attribute__((visibility("default"))) cudaError cudaMemGetInfo(size_t* free, size_t* total) {
  Pool* pool = pl::serving_pool();
  int device = 0;
  if (pool && free && total && pl::runtime_current_device(&device)) {
    std::size_t f = 0, t = 0;
    if (pool->mem_info(device, &f, &t) == Status::ok) {
      *free = pl::program_bounded_free(*pool, device, f, t);
      *total = t;
      return cudaSuccess;
    }
  }
  return forward<PFN_cudaMemGetInfo>(Hook::cudaMemGetInfo, free, total);
}

__attribute__((visibility("default"))) cudaError cudaDeviceEnablePeerAccess(int peer,
                                                                            unsigned flags) {
  cudaError r =
      forward<PFN_cudaDeviceEnablePeerAccess>(Hook::cudaDeviceEnablePeerAccess, peer, flags);
  if (r != cudaSuccess && r != cudaErrorPeerAccessAlreadyEnabled) return r;
  Pool* pool = pl::serving_pool();
  int device = 0;
  // The current device may now read peer's memory: pool memory of peer must be mapped for it too.
  if (pool && pl::driver_current_device(&device) &&
      pool->grant_peer_access(peer, device) != Status::ok) {
    pl::log().error("could not map pool memory of device {} for peer device {}", peer, device);
  }
  return r;
}

// CUDA IPC (ipc_hooks.h): the runtime's codes for the shared answer.
__attribute__((visibility("default"))) cudaError cudaIpcGetMemHandle(void* handle, void* ptr) {
  const pl::ipc::HookAnswer a =
      pl::ipc::get_mem_handle(pl::ipc::Api::runtime, handle, reinterpret_cast<DevPtr>(ptr));
  if (a.kind == pl::ipc::HookAnswer::Kind::answered) return pl::to_cuda_error(a.status);
  return forward<PFN_cudaIpcGetMemHandle>(Hook::cudaIpcGetMemHandle, handle, ptr);
}

__attribute__((visibility("default"))) cudaError cudaIpcOpenMemHandle(void** ptr,
                                                                      IpcMemHandle handle,
                                                                      unsigned flags) {
  DevPtr out = 0;
  const pl::ipc::HookAnswer a =
      pl::ipc::open_mem_handle(pl::ipc::Api::runtime, &handle, ptr ? &out : nullptr);
  if (a.kind == pl::ipc::HookAnswer::Kind::answered) {
    if (a.status == Status::ok) *ptr = reinterpret_cast<void*>(out);
    return pl::to_cuda_error(a.status);
  }
  // (no_context is the driver's answer only: without a device the runtime's call goes on.)
  return forward<PFN_cudaIpcOpenMemHandle>(Hook::cudaIpcOpenMemHandle, ptr, handle, flags);
}

__attribute__((visibility("default"))) cudaError cudaIpcCloseMemHandle(void* ptr) {
  const pl::ipc::HookAnswer a = pl::ipc::close_mem_handle(reinterpret_cast<DevPtr>(ptr));
  if (a.kind == pl::ipc::HookAnswer::Kind::answered) return pl::to_cuda_error(a.status);
  return forward<PFN_cudaIpcCloseMemHandle>(Hook::cudaIpcCloseMemHandle, ptr);
}

}  // extern "C"
