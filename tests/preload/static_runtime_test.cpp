// libgpustitch.so under LD_PRELOAD in a program with the CUDA runtime linked statically (nvcc's
// default): the program's cudaMalloc is internal and cannot be interposed; the runtime reaches the
// driver only through dlopen + dlsym + cuGetProcAddress. The shim must serve it anyway, once.
//
// The stand-in runtime is doubles/fake_cudart.cpp built with hidden symbols; the fake driver is
// found by dlopen through LD_LIBRARY_PATH. GPUSTITCH_CONF=backend:sim,sim_devices:2.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>

#include "cuda_decls.h"
#include "shim_api.h"

struct CUmemPoolHandle_st;
extern "C" {
int cudaDeviceGetDefaultMemPool(CUmemPoolHandle_st**, int);
int cudaMemPoolGetAttribute(CUmemPoolHandle_st*, int, void*);
int cudaMemPoolSetAttribute(CUmemPoolHandle_st*, int, void*);
}

namespace {

constexpr std::size_t MiB = 1 << 20;

int driver_calls(const char* name) {
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  auto f = h ? reinterpret_cast<int (*)(const char*)>(dlsym(h, "fakecuda_calls")) : nullptr;
  return f ? f(name) : -1;
}

TEST(StaticRuntime, CudaMallocReachesThePoolThroughCuGetProcAddress) {
  ASSERT_TRUE(shim::preloaded());
  // The program's own cudaMalloc, not the shim's.
  EXPECT_NE(shim::library_of(reinterpret_cast<void*>(&cudaMalloc)), "libgpustitch.so");
  ASSERT_EQ(cudaSetDevice(0), 0);
  ASSERT_EQ(shim::active(), 1);
  auto before = shim::stats(0);
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 6 * MiB), 0);
  EXPECT_TRUE(shim::owns(p));
  std::memset(p, 0x3c, 6 * MiB);
  EXPECT_EQ(static_cast<unsigned char*>(p)[6 * MiB - 1], 0x3c);
  EXPECT_EQ(shim::stats(0).allocs, before.allocs + 1);  // once, by the driver-level hook
  EXPECT_EQ(driver_calls("cuMemAlloc_v2"), 0);
  ASSERT_EQ(cudaFree(p), 0);
  EXPECT_FALSE(shim::owns(p));
  EXPECT_EQ(driver_calls("cuMemFree_v2"), 0);
  EXPECT_EQ(shim::stats(0).frees, before.frees + 1);
}

TEST(StaticRuntime, PerThreadStreamVariantsAndDevices) {
  ASSERT_EQ(cudaSetDevice(1), 0);
  void* p = nullptr;
  ASSERT_EQ(cudaMallocAsync_ptsz(&p, MiB, nullptr), 0);
  EXPECT_TRUE(shim::owns(p));
  EXPECT_EQ(shim::stats(1).live_blocks, 1u);
  EXPECT_EQ(cudaFreeAsync_ptsz(p, nullptr), 0);
  EXPECT_EQ(driver_calls("cuMemAllocAsync_ptsz"), 0);
  ASSERT_EQ(cudaSetDevice(0), 0);
}

TEST(StaticRuntime, OutOfMemoryAndBadArgumentsGetNativeCodes) {
  ASSERT_EQ(cudaSetDevice(0), 0);
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, 4096 * MiB), 2);  // cudaErrorMemoryAllocation
  EXPECT_EQ(cudaGetLastError(), 2);
  EXPECT_EQ(cudaMalloc(nullptr, 10), 1);
  int local = 0;
  EXPECT_EQ(cudaFree(&local), 1);
  cudaGetLastError();
}

// The runtime's memory-pool queries are internal too: the driver-level hooks the runtime fetched
// with cuGetProcAddress add the pool's figures (PyTorch's statistics in a static-runtime build).
TEST(StaticRuntime, DefaultMemPoolAttributesReportThePoolThroughTheDriverHooks) {
  ASSERT_EQ(cudaSetDevice(0), 0);
  EXPECT_NE(shim::library_of(reinterpret_cast<void*>(&cudaMemPoolGetAttribute)), "libgpustitch.so");
  void* p = nullptr;
  ASSERT_EQ(cudaMallocAsync(&p, 12 * MiB, nullptr), 0);
  ASSERT_TRUE(shim::owns(p));
  CUmemPoolHandle_st* pool = nullptr;
  ASSERT_EQ(cudaDeviceGetDefaultMemPool(&pool, 0), 0);
  std::uint64_t used = 0, reserved = 0, high = 0, zero = 0;
  ASSERT_EQ(cudaMemPoolGetAttribute(pool, 7, &used), 0);      // UsedMemCurrent
  ASSERT_EQ(cudaMemPoolGetAttribute(pool, 5, &reserved), 0);  // ReservedMemCurrent
  const auto s = shim::stats(0);
  EXPECT_EQ(used, s.bytes_allocated);
  EXPECT_EQ(reserved, s.bytes_reserved);
  EXPECT_GE(used, 12 * MiB);
  ASSERT_EQ(cudaFreeAsync(p, nullptr), 0);
  ASSERT_EQ(cudaMemPoolSetAttribute(pool, 8, &zero), 0);  // reset UsedMemHigh
  ASSERT_EQ(cudaMemPoolGetAttribute(pool, 8, &high), 0);
  EXPECT_EQ(high, shim::stats(0).bytes_allocated);
  EXPECT_LT(high, used);
}

}  // namespace
