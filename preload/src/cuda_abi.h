// The slice of the CUDA driver and runtime ABI that the shim interposes, declared here rather than
// taken from cuda.h / cuda_runtime_api.h.
//
// Why not the toolkit headers: they #define many entry points to versioned names (cuMemAlloc ->
// cuMemAlloc_v2, cuGetProcAddress -> cuGetProcAddress_v2, and _ptsz variants under per-thread
// default stream builds), which makes it impossible to define the plain and the versioned symbol
// side by side. Types here are ABI-identical stand-ins; abi_check.cpp includes the real headers and
// static_asserts that every constant below matches them.
#pragma once

#include <cstddef>
#include <cstdint>

// The driver's opaque handle types, declared at global scope exactly as cuda.h does.
struct CUctx_st;
struct CUstream_st;
struct CUmemPoolHandle_st;

namespace gpustitch::cuda {

using CUresult = int;
using cudaError = int;
using CUdeviceptr = std::uintptr_t;
using CUdevice = int;
using CUcontext = ::CUctx_st*;
using CUstream = ::CUstream_st*;
using CUmemoryPool = ::CUmemPoolHandle_st*;  // cudaMemPool_t is the same handle
using cuuint64 = std::uint64_t;
using CUmemGenericAllocationHandle = unsigned long long;

// CUresult values.
inline constexpr CUresult CUDA_SUCCESS = 0;
inline constexpr CUresult CUDA_ERROR_INVALID_VALUE = 1;
inline constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;
inline constexpr CUresult CUDA_ERROR_NOT_INITIALIZED = 3;
inline constexpr CUresult CUDA_ERROR_INVALID_DEVICE = 101;
inline constexpr CUresult CUDA_ERROR_INVALID_CONTEXT = 201;
inline constexpr CUresult CUDA_ERROR_INVALID_HANDLE = 400;
inline constexpr CUresult CUDA_ERROR_NOT_FOUND = 500;
inline constexpr CUresult CUDA_ERROR_CONTEXT_IS_DESTROYED = 709;
inline constexpr CUresult CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704;
inline constexpr CUresult CUDA_ERROR_NOT_SUPPORTED = 801;
inline constexpr CUresult CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900;
inline constexpr CUresult CUDA_ERROR_UNKNOWN = 999;

// cudaError_t values.
inline constexpr cudaError cudaSuccess = 0;
inline constexpr cudaError cudaErrorInvalidValue = 1;
inline constexpr cudaError cudaErrorMemoryAllocation = 2;
inline constexpr cudaError cudaErrorInitializationError = 3;
inline constexpr cudaError cudaErrorInvalidDevice = 101;
inline constexpr cudaError cudaErrorDeviceUninitialized = 201;  // CUDA_ERROR_INVALID_CONTEXT
inline constexpr cudaError cudaErrorInvalidResourceHandle = 400;
inline constexpr cudaError cudaErrorPeerAccessAlreadyEnabled = 704;
inline constexpr cudaError cudaErrorContextIsDestroyed = 709;
inline constexpr cudaError cudaErrorNotSupported = 801;
inline constexpr cudaError cudaErrorStreamCaptureUnsupported = 900;
inline constexpr cudaError cudaErrorUnknown = 999;

// Special stream handles.
inline const CUstream kStreamLegacy = reinterpret_cast<CUstream>(0x1);
inline const CUstream kStreamPerThread = reinterpret_cast<CUstream>(0x2);

// cuGetProcAddress flags (cudaGetDriverEntryPoint's cudaEnable* flags have the same values).
inline constexpr cuuint64 CU_GET_PROC_ADDRESS_DEFAULT = 0;
inline constexpr cuuint64 CU_GET_PROC_ADDRESS_LEGACY_STREAM = 1;
inline constexpr cuuint64 CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM = 2;
// CUdriverProcAddressQueryResult / cudaDriverEntryPointQueryResult.
inline constexpr int CU_GET_PROC_ADDRESS_SUCCESS = 0;

// CUstreamCaptureStatus.
inline constexpr int CU_STREAM_CAPTURE_STATUS_NONE = 0;

// CUpointer_attribute values the shim answers itself for pool memory.
inline constexpr int CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2;
inline constexpr int CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3;
inline constexpr int CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9;
inline constexpr int CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11;
inline constexpr int CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12;
inline constexpr unsigned CU_MEMORYTYPE_DEVICE = 2;

inline constexpr std::size_t kIpcHandleSize = 64;
// CUipcMemHandle / cudaIpcMemHandle_t: passed by value to the open calls.
struct IpcMemHandle {
  char reserved[kIpcHandleSize];
};

// CUmemAllocationProp: the shim reads where a cuMemCreate puts its memory, location {type, id},
// and, to decide whether an idle handle of the pool may answer it (program_memory.h), the
// allocation type, the requested handle types and allocFlags {compressionType,
// gpuDirectRDMACapable, usage}, at these offsets (pinned against cuda.h in abi_check.cpp); the
// struct is otherwise opaque.
inline constexpr std::size_t kAllocationPropTypeOffset = 0;
inline constexpr std::size_t kAllocationPropHandleTypesOffset = 4;
inline constexpr std::size_t kAllocationPropLocationOffset = 8;
inline constexpr std::size_t kAllocationPropCompressionOffset = 24;
inline constexpr std::size_t kAllocationPropRdmaOffset = 25;
inline constexpr std::size_t kAllocationPropUsageOffset = 26;  // unsigned short
inline constexpr std::size_t kAllocationPropSize = 32;
inline constexpr int CU_MEM_LOCATION_TYPE_DEVICE = 1;
inline constexpr int CU_MEM_ALLOCATION_TYPE_PINNED = 1;
inline constexpr int CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1;

// CUmemPool_attribute / cudaMemPoolAttr values (the same numbers) the shim answers for the
// default memory pool of a device it serves; each takes a cuuint64_t.
inline constexpr int CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4;
inline constexpr int CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT = 5;
inline constexpr int CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH = 6;
inline constexpr int CU_MEMPOOL_ATTR_USED_MEM_CURRENT = 7;
inline constexpr int CU_MEMPOOL_ATTR_USED_MEM_HIGH = 8;

// Pitch granted by the pitched allocators for pool memory: a multiple of 512 bytes, which is what
// the native cudaMallocPitch returns on every current GPU and satisfies every texture/2D-copy
// alignment requirement.
inline constexpr std::size_t kPitchAlignment = 512;

// Driver entry point types.
using PFN_cuMemAlloc_v2 = CUresult (*)(CUdeviceptr*, std::size_t);
using PFN_cuMemFree_v2 = CUresult (*)(CUdeviceptr);
using PFN_cuMemAllocAsync = CUresult (*)(CUdeviceptr*, std::size_t, CUstream);
using PFN_cuMemFreeAsync = CUresult (*)(CUdeviceptr, CUstream);
using PFN_cuMemAllocPitch_v2 = CUresult (*)(CUdeviceptr*, std::size_t*, std::size_t, std::size_t,
                                            unsigned);
using PFN_cuMemGetInfo_v2 = CUresult (*)(std::size_t*, std::size_t*);
using PFN_cuMemGetAddressRange_v2 = CUresult (*)(CUdeviceptr*, std::size_t*, CUdeviceptr);
using PFN_cuPointerGetAttribute = CUresult (*)(void*, int, CUdeviceptr);
using PFN_cuPointerGetAttributes = CUresult (*)(unsigned, int*, void**, CUdeviceptr);
using PFN_cuIpcGetMemHandle = CUresult (*)(void*, CUdeviceptr);
using PFN_cuIpcOpenMemHandle_v2 = CUresult (*)(CUdeviceptr*, IpcMemHandle, unsigned);
using PFN_cuIpcCloseMemHandle = CUresult (*)(CUdeviceptr);
using PFN_cuCtxEnablePeerAccess = CUresult (*)(CUcontext, unsigned);
using PFN_cuGetProcAddress = CUresult (*)(const char*, void**, int, cuuint64);
using PFN_cuGetProcAddress_v2 = CUresult (*)(const char*, void**, int, cuuint64, int*);
using PFN_cuDeviceGetDefaultMemPool = CUresult (*)(CUmemoryPool*, CUdevice);
using PFN_cuMemPoolGetAttribute = CUresult (*)(CUmemoryPool, int, void*);
using PFN_cuMemPoolSetAttribute = CUresult (*)(CUmemoryPool, int, void*);
using PFN_cuMemPoolTrimTo = CUresult (*)(CUmemoryPool, std::size_t);
using PFN_cuMemAllocFromPoolAsync = CUresult (*)(CUdeviceptr*, std::size_t, CUmemoryPool, CUstream);
using PFN_cuMemCreate = CUresult (*)(CUmemGenericAllocationHandle*, std::size_t, const void*,
                                     unsigned long long);
using PFN_cuMemRelease = CUresult (*)(CUmemGenericAllocationHandle);
using PFN_cuMemExportToShareableHandle = CUresult (*)(void*, CUmemGenericAllocationHandle, int,
                                                      unsigned long long);
using PFN_cuMemRetainAllocationHandle = CUresult (*)(CUmemGenericAllocationHandle*, void*);
using PFN_cuMemMap = CUresult (*)(CUdeviceptr, std::size_t, std::size_t,
                                  CUmemGenericAllocationHandle, unsigned long long);
using PFN_cuMemUnmap = CUresult (*)(CUdeviceptr, std::size_t);
using PFN_cuMemAddressReserve = CUresult (*)(CUdeviceptr*, std::size_t, std::size_t, CUdeviceptr,
                                             unsigned long long);
using PFN_cuMemAddressFree = CUresult (*)(CUdeviceptr, std::size_t);
using PFN_cuCtxGetDevice = CUresult (*)(CUdevice*);
using PFN_cuDeviceGetCount = CUresult (*)(int*);
using PFN_cuCtxPushCurrent = CUresult (*)(CUcontext);
using PFN_cuCtxPopCurrent = CUresult (*)(CUcontext*);
using PFN_cuStreamIsCapturing = CUresult (*)(CUstream, int*);
using PFN_cuStreamGetDevice = CUresult (*)(CUstream, CUdevice*);

// Runtime entry point types.
using PFN_cudaMalloc = cudaError (*)(void**, std::size_t);
using PFN_cudaFree = cudaError (*)(void*);
using PFN_cudaMallocAsync = cudaError (*)(void**, std::size_t, CUstream);
using PFN_cudaFreeAsync = cudaError (*)(void*, CUstream);
using PFN_cudaMallocPitch = cudaError (*)(void**, std::size_t*, std::size_t, std::size_t);
using PFN_cudaMemGetInfo = cudaError (*)(std::size_t*, std::size_t*);
using PFN_cudaDeviceEnablePeerAccess = cudaError (*)(int, unsigned);
using PFN_cudaIpcGetMemHandle = cudaError (*)(void*, void*);
using PFN_cudaIpcOpenMemHandle = cudaError (*)(void**, IpcMemHandle, unsigned);
using PFN_cudaIpcCloseMemHandle = cudaError (*)(void*);
using PFN_cudaDeviceGetDefaultMemPool = cudaError (*)(CUmemoryPool*, int);
using PFN_cudaMemPoolGetAttribute = cudaError (*)(CUmemoryPool, int, void*);
using PFN_cudaMemPoolSetAttribute = cudaError (*)(CUmemoryPool, int, void*);
using PFN_cudaMemPoolTrimTo = cudaError (*)(CUmemoryPool, std::size_t);
using PFN_cudaGetDriverEntryPoint = cudaError (*)(const char*, void**, unsigned long long, int*);
using PFN_cudaGetDriverEntryPointByVersion = cudaError (*)(const char*, void**, unsigned,
                                                           unsigned long long, int*);

}  // namespace gpustitch::cuda
