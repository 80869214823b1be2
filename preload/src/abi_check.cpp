// Compile-time proof that cuda_abi.h agrees with the CUDA toolkit's own headers. Nothing here runs.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstddef>

#include "cuda_abi.h"

namespace c = gpustitch::cuda;

static_assert(c::CUDA_ERROR_INVALID_VALUE == CUDA_ERROR_INVALID_VALUE);
static_assert(c::CUDA_ERROR_OUT_OF_MEMORY == CUDA_ERROR_OUT_OF_MEMORY);
static_assert(c::CUDA_ERROR_NOT_INITIALIZED == CUDA_ERROR_NOT_INITIALIZED);
static_assert(c::CUDA_ERROR_INVALID_DEVICE == CUDA_ERROR_INVALID_DEVICE);
static_assert(c::CUDA_ERROR_INVALID_CONTEXT == CUDA_ERROR_INVALID_CONTEXT);
static_assert(c::CUDA_ERROR_NOT_FOUND == CUDA_ERROR_NOT_FOUND);
static_assert(c::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED == CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
static_assert(c::CUDA_ERROR_NOT_SUPPORTED == CUDA_ERROR_NOT_SUPPORTED);
static_assert(c::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
static_assert(c::CUDA_ERROR_UNKNOWN == CUDA_ERROR_UNKNOWN);
static_assert(c::cudaErrorInvalidValue == cudaErrorInvalidValue);
static_assert(c::cudaErrorMemoryAllocation == cudaErrorMemoryAllocation);
static_assert(c::cudaErrorInitializationError == cudaErrorInitializationError);
static_assert(c::cudaErrorInvalidDevice == cudaErrorInvalidDevice);
static_assert(c::cudaErrorPeerAccessAlreadyEnabled == cudaErrorPeerAccessAlreadyEnabled);
static_assert(c::cudaErrorNotSupported == cudaErrorNotSupported);
static_assert(c::cudaErrorStreamCaptureUnsupported == cudaErrorStreamCaptureUnsupported);
static_assert(c::cudaErrorUnknown == cudaErrorUnknown);
static_assert(c::CU_GET_PROC_ADDRESS_LEGACY_STREAM == CU_GET_PROC_ADDRESS_LEGACY_STREAM);
static_assert(c::CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM ==
              CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM);
static_assert(c::CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM == cudaEnablePerThreadDefaultStream);
static_assert(c::CU_GET_PROC_ADDRESS_LEGACY_STREAM == cudaEnableLegacyStream);
static_assert(c::CU_GET_PROC_ADDRESS_SUCCESS == CU_GET_PROC_ADDRESS_SUCCESS);
static_assert(c::CU_GET_PROC_ADDRESS_SUCCESS == cudaDriverEntryPointSuccess);
static_assert(c::CU_STREAM_CAPTURE_STATUS_NONE == CU_STREAM_CAPTURE_STATUS_NONE);
static_assert(c::CU_POINTER_ATTRIBUTE_MEMORY_TYPE == CU_POINTER_ATTRIBUTE_MEMORY_TYPE);
static_assert(c::CU_POINTER_ATTRIBUTE_DEVICE_POINTER == CU_POINTER_ATTRIBUTE_DEVICE_POINTER);
static_assert(c::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL == CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL);
static_assert(c::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR == CU_POINTER_ATTRIBUTE_RANGE_START_ADDR);
static_assert(c::CU_POINTER_ATTRIBUTE_RANGE_SIZE == CU_POINTER_ATTRIBUTE_RANGE_SIZE);
static_assert(c::CU_MEMORYTYPE_DEVICE == CU_MEMORYTYPE_DEVICE);
static_assert(c::kIpcHandleSize == CU_IPC_HANDLE_SIZE);
static_assert(c::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT == CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
static_assert(c::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH);
static_assert(c::CU_MEMPOOL_ATTR_USED_MEM_CURRENT == CU_MEMPOOL_ATTR_USED_MEM_CURRENT);
static_assert(c::CU_MEMPOOL_ATTR_USED_MEM_HIGH == CU_MEMPOOL_ATTR_USED_MEM_HIGH);
static_assert(c::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT == cudaMemPoolAttrReservedMemCurrent);
static_assert(c::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH == cudaMemPoolAttrReservedMemHigh);
static_assert(c::CU_MEMPOOL_ATTR_USED_MEM_CURRENT == cudaMemPoolAttrUsedMemCurrent);
static_assert(c::CU_MEMPOOL_ATTR_USED_MEM_HIGH == cudaMemPoolAttrUsedMemHigh);
static_assert(sizeof(CUmemoryPool) == sizeof(c::CUmemoryPool));
static_assert(sizeof(cudaMemPool_t) == sizeof(c::CUmemoryPool));
static_assert(sizeof(CUmemPool_attribute) == sizeof(int));
static_assert(sizeof(cudaMemPoolAttr) == sizeof(int));
static_assert(sizeof(CUipcMemHandle) == c::kIpcHandleSize);
static_assert(sizeof(cudaIpcMemHandle_t) == c::kIpcHandleSize);
static_assert(sizeof(c::IpcMemHandle) == sizeof(CUipcMemHandle));
static_assert(alignof(c::IpcMemHandle) == alignof(CUipcMemHandle));
static_assert(sizeof(CUdeviceptr) == sizeof(c::CUdeviceptr));
static_assert(sizeof(CUresult) == sizeof(c::CUresult));
static_assert(sizeof(cudaError_t) == sizeof(c::cudaError));
static_assert(sizeof(CUpointer_attribute) == sizeof(int));
static_assert(offsetof(CUmemAllocationProp, location) == c::kAllocationPropLocationOffset);
static_assert(offsetof(CUmemAllocationProp, type) == c::kAllocationPropTypeOffset);
static_assert(offsetof(CUmemAllocationProp, requestedHandleTypes) ==
              c::kAllocationPropHandleTypesOffset);
static_assert(offsetof(CUmemAllocationProp, allocFlags) == c::kAllocationPropCompressionOffset);
static_assert(offsetof(CUmemAllocationProp, allocFlags.gpuDirectRDMACapable) ==
              c::kAllocationPropRdmaOffset);
static_assert(offsetof(CUmemAllocationProp, allocFlags.usage) == c::kAllocationPropUsageOffset);
static_assert(sizeof(CUmemAllocationProp) == c::kAllocationPropSize);
static_assert(CU_MEM_ALLOCATION_TYPE_PINNED == c::CU_MEM_ALLOCATION_TYPE_PINNED);
static_assert(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR ==
              c::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
static_assert(offsetof(CUmemLocation, type) == 0 && offsetof(CUmemLocation, id) == 4);
static_assert(sizeof(CUmemLocationType) == sizeof(int));
static_assert(c::CU_MEM_LOCATION_TYPE_DEVICE == CU_MEM_LOCATION_TYPE_DEVICE);
static_assert(sizeof(CUmemGenericAllocationHandle) == sizeof(c::CUmemGenericAllocationHandle));
// CU_STREAM_LEGACY / CU_STREAM_PER_THREAD are ((CUstream)0x1) / ((CUstream)0x2): shim.cpp relies on
// those values, which cannot be checked at compile time (a pointer cast is not a constant).
