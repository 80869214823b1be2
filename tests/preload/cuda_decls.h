// Declarations of the CUDA runtime and driver calls the tests make, as the fake libraries
// (doubles/) define them. Types are the ABI's (ints, pointers), not the toolkit headers', so the
// tests also cover the plain and versioned names side by side.
#pragma once

#include <cstddef>
#include <cstdint>

struct CUstream_st;
struct CUctx_st;
using CUdeviceptr = std::uintptr_t;

extern "C" {
// runtime (libcudart.so.13 / the static stand-in)
int cudaMalloc(void**, std::size_t);
int cudaFree(void*);
int cudaMallocAsync(void**, std::size_t, CUstream_st*);
int cudaMallocAsync_ptsz(void**, std::size_t, CUstream_st*);
int cudaFreeAsync(void*, CUstream_st*);
int cudaFreeAsync_ptsz(void*, CUstream_st*);
int cudaMallocPitch(void**, std::size_t*, std::size_t, std::size_t);
int cudaMallocManaged(void**, std::size_t, unsigned);
int cudaMallocHost(void**, std::size_t);
int cudaFreeHost(void*);
int cudaMemGetInfo(std::size_t*, std::size_t*);
int cudaSetDevice(int);
int cudaGetLastError();
int cudaStreamCreate(CUstream_st**);
int cudaStreamDestroy(CUstream_st*);
int cudaDeviceEnablePeerAccess(int, unsigned);
int cudaIpcGetMemHandle(void*, void*);
struct IpcHandle {  // cudaIpcMemHandle_t / CUipcMemHandle, passed by value
  char reserved[64];
};
int cudaIpcOpenMemHandle(void**, IpcHandle, unsigned);
int cudaIpcCloseMemHandle(void*);
int cuIpcGetMemHandle(void*, CUdeviceptr);
int cuIpcOpenMemHandle_v2(CUdeviceptr*, IpcHandle, unsigned);
int cuIpcCloseMemHandle(CUdeviceptr);
int cudaGetDriverEntryPoint(const char*, void**, unsigned long long, int*);
int cudaGetDriverEntryPointByVersion(const char*, void**, unsigned, unsigned long long, int*);
}

namespace cu {
using MemAlloc = int (*)(CUdeviceptr*, std::size_t);
using MemFree = int (*)(CUdeviceptr);
using MemAllocAsync = int (*)(CUdeviceptr*, std::size_t, CUstream_st*);
using MemFreeAsync = int (*)(CUdeviceptr, CUstream_st*);
using GetProcAddress = int (*)(const char*, void**, int, std::uint64_t, int*);
}  // namespace cu
