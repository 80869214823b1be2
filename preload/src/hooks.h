// The table of interposed entry points: every symbol the shim defines in place of the CUDA driver
// or runtime, and where the real function behind each one is found.
//
// A hook is reached three ways (see hooks_dlsym.cpp and proc_address.cpp): by symbol interposition
// (LD_PRELOAD puts these definitions ahead of libcuda/libcudart), through dlsym on a library
// handle, and through cuGetProcAddress / cudaGetDriverEntryPoint. Each way must end in the same
// function, and each hook must reach the real function without passing through any hook again.
#pragma once

#include "cuda_abi.h"

// X(name, runtime?) for every hooked symbol. "_ptsz" entries are the per-thread-default-stream
// variants of the driver and runtime (what cuGetProcAddress returns with
// CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, and what code built with
// --default-stream per-thread calls).
#define GPUSTITCH_HOOKS(X)                  \
  X(cuMemAlloc_v2, false)                   \
  X(cuMemFree_v2, false)                    \
  X(cuMemAllocAsync, false)                 \
  X(cuMemAllocAsync_ptsz, false)            \
  X(cuMemFreeAsync, false)                  \
  X(cuMemFreeAsync_ptsz, false)             \
  X(cuMemAllocPitch_v2, false)              \
  X(cuMemGetInfo_v2, false)                 \
  X(cuMemGetAddressRange_v2, false)         \
  X(cuPointerGetAttribute, false)           \
  X(cuPointerGetAttributes, false)          \
  X(cuIpcGetMemHandle, false)               \
  X(cuIpcOpenMemHandle_v2, false)           \
  X(cuIpcCloseMemHandle, false)             \
  X(cuCtxEnablePeerAccess, false)           \
  X(cuDeviceGetDefaultMemPool, false)       \
  X(cuMemPoolGetAttribute, false)           \
  X(cuMemPoolSetAttribute, false)           \
  X(cuMemPoolTrimTo, false)                 \
  X(cuMemAllocFromPoolAsync, false)         \
  X(cuMemAllocFromPoolAsync_ptsz, false)    \
  X(cuMemCreate, false)                     \
  X(cuMemRelease, false)                    \
  X(cuMemRetainAllocationHandle, false)     \
  X(cuMemMap, false)                        \
  X(cuMemUnmap, false)                      \
  X(cuMemAddressReserve, false)             \
  X(cuMemAddressFree, false)                \
  X(cuMemExportToShareableHandle, false)    \
  X(cuGetProcAddress, false)                \
  X(cuGetProcAddress_v2, false)             \
  X(cudaMalloc, true)                       \
  X(cudaFree, true)                         \
  X(cudaMallocAsync, true)                  \
  X(cudaMallocAsync_ptsz, true)             \
  X(cudaFreeAsync, true)                    \
  X(cudaFreeAsync_ptsz, true)               \
  X(cudaMallocPitch, true)                  \
  X(cudaMemGetInfo, true)                   \
  X(cudaDeviceEnablePeerAccess, true)       \
  X(cudaIpcGetMemHandle, true)              \
  X(cudaIpcOpenMemHandle, true)             \
  X(cudaIpcCloseMemHandle, true)            \
  X(cudaDeviceGetDefaultMemPool, true)      \
  X(cudaMemPoolGetAttribute, true)          \
  X(cudaMemPoolSetAttribute, true)          \
  X(cudaMemPoolTrimTo, true)                \
  X(cudaGetDriverEntryPoint, true)          \
  X(cudaGetDriverEntryPoint_ptsz, true)     \
  X(cudaGetDriverEntryPointByVersion, true) \
  X(cudaGetDriverEntryPointByVersion_ptsz, true)

namespace gpustitch::preload {

enum class Hook : int {
#define GPUSTITCH_HOOK_ENUM(name, rt) name,
  GPUSTITCH_HOOKS(GPUSTITCH_HOOK_ENUM)
#undef GPUSTITCH_HOOK_ENUM
      count_
};
inline constexpr int kHookCount = static_cast<int>(Hook::count_);

// The hook index of an exact symbol name, or -1. Cheap: called from every dlsym.
int find_hook(const char* symbol) noexcept;
const char* hook_name(Hook h) noexcept;
// Address of the shim's definition.
void* hook_address(Hook h) noexcept;
// Whether fn is one of the shim's definitions.
bool is_hook_address(const void* fn) noexcept;

}  // namespace gpustitch::preload

// The definitions (hooks_driver.cpp, hooks_runtime.cpp, proc_address.cpp).
extern "C" {
using gpustitch::cuda::CUcontext;
using gpustitch::cuda::cudaError;
using gpustitch::cuda::CUdeviceptr;
using gpustitch::cuda::CUmemGenericAllocationHandle;
using gpustitch::cuda::CUmemoryPool;
using gpustitch::cuda::CUresult;
using gpustitch::cuda::CUstream;
using gpustitch::cuda::cuuint64;
using gpustitch::cuda::IpcMemHandle;

CUresult cuMemAlloc_v2(CUdeviceptr* dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemAllocAsync(CUdeviceptr* dptr, size_t bytesize, CUstream stream);
CUresult cuMemAllocAsync_ptsz(CUdeviceptr* dptr, size_t bytesize, CUstream stream);
CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream);
CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream);
CUresult cuMemAllocPitch_v2(CUdeviceptr* dptr, size_t* pitch, size_t width, size_t height,
                            unsigned element_size);
CUresult cuMemGetInfo_v2(size_t* free, size_t* total);
CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* size, CUdeviceptr dptr);
CUresult cuPointerGetAttribute(void* data, int attribute, CUdeviceptr ptr);
CUresult cuPointerGetAttributes(unsigned count, int* attributes, void** data, CUdeviceptr ptr);
CUresult cuIpcGetMemHandle(void* handle, CUdeviceptr dptr);
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* dptr, IpcMemHandle handle, unsigned flags);
CUresult cuIpcCloseMemHandle(CUdeviceptr dptr);
CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned flags);
CUresult cuDeviceGetDefaultMemPool(CUmemoryPool* pool, int device);
CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void* value);
CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void* value);
CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t min_bytes_to_keep);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr* dptr, size_t bytesize, CUmemoryPool pool,
                                 CUstream stream);
CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr* dptr, size_t bytesize, CUmemoryPool pool,
                                      CUstream stream);
CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size, const void* prop,
                     unsigned long long flags);
CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle* handle, void* addr);
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags);
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags);
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size);
CUresult cuMemExportToShareableHandle(void* shareable, CUmemGenericAllocationHandle handle,
                                      int type, unsigned long long flags);
CUresult cuGetProcAddress(const char* symbol, void** pfn, int cuda_version, cuuint64 flags);
CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int cuda_version, cuuint64 flags,
                             int* status);

cudaError cudaMalloc(void** ptr, size_t size);
cudaError cudaFree(void* ptr);
cudaError cudaMallocAsync(void** ptr, size_t size, CUstream stream);
cudaError cudaMallocAsync_ptsz(void** ptr, size_t size, CUstream stream);
cudaError cudaFreeAsync(void* ptr, CUstream stream);
cudaError cudaFreeAsync_ptsz(void* ptr, CUstream stream);
cudaError cudaMallocPitch(void** ptr, size_t* pitch, size_t width, size_t height);
cudaError cudaMemGetInfo(size_t* free, size_t* total);
cudaError cudaDeviceEnablePeerAccess(int peer, unsigned flags);
cudaError cudaIpcGetMemHandle(void* handle, void* ptr);
cudaError cudaIpcOpenMemHandle(void** ptr, IpcMemHandle handle, unsigned flags);
cudaError cudaIpcCloseMemHandle(void* ptr);
cudaError cudaDeviceGetDefaultMemPool(CUmemoryPool* pool, int device);
cudaError cudaMemPoolGetAttribute(CUmemoryPool pool, int attr, void* value);
cudaError cudaMemPoolSetAttribute(CUmemoryPool pool, int attr, void* value);
cudaError cudaMemPoolTrimTo(CUmemoryPool pool, size_t min_bytes_to_keep);
cudaError cudaGetDriverEntryPoint(const char* symbol, void** fn, unsigned long long flags,
                                  int* status);
cudaError cudaGetDriverEntryPoint_ptsz(const char* symbol, void** fn, unsigned long long flags,
                                       int* status);
cudaError cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned version,
                                           unsigned long long flags, int* status);
cudaError cudaGetDriverEntryPointByVersion_ptsz(const char* symbol, void** fn, unsigned version,
                                                unsigned long long flags, int* status);
}
