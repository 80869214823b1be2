// Test controls of the fake CUDA driver (fake_libcuda.cpp). The fake exports the driver's own
// entry points under their real names; these extra functions let tests inspect and steer it.
#pragma once

#include <cstddef>
#include <cstdint>

struct CUstream_st;
struct CUctx_st;
struct CUmemPoolHandle_st;

extern "C" {
// Number of calls that reached the fake's implementation of symbol (exact exported name, e.g.
// "cuMemAlloc_v2"), since the last reset.
int fakecuda_calls(const char* symbol);
void fakecuda_reset_calls();
// Marks a stream as being captured into a graph (cuStreamIsCapturing answers ACTIVE).
void fakecuda_set_capturing(CUstream_st* stream, int capturing);
// Bytes the fake has handed out on device (device, managed and host allocations included).
std::size_t fakecuda_used(int device);
// The arguments of the last call of a VMM entry point ("cuMemCreate", "cuMemMap", ...) as
// 64-bit values in declaration order (pointers as addresses); 0 when it was never called.
int fakecuda_last_args(const char* symbol, std::uint64_t* out /* [5] */);
// The release threshold the fake driver holds for a memory pool (no hook in between);
// UINT64_MAX for a handle that is not a pool.
std::uint64_t fakecuda_pool_release_threshold(CUmemPoolHandle_st* pool);
}
