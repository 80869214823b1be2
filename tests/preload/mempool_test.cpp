// The memory-pool hooks (preload/src/hooks_mempool.cpp): the default memory pool of a device the
// pool serves reports the pool's figures, as PyTorch's backend:cudaMallocAsync reads them for
// memory_stats(), max_memory_allocated(), reset_peak_memory_stats() and empty_cache(); every other
// pool, attribute and bad argument gets the native answer.
//
// ctest runs this with LD_PRELOAD=libgpustitch.so, the fake runtime and driver (2 devices of
// 4096 MiB) and GPUSTITCH_CONF=backend:sim,sim_devices:2,sim_capacity_mb:1024.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cuda_decls.h"
#include "doubles/fake_cuda.h"
#include "shim_api.h"

struct CUmemPoolHandle_st;
using MemPool = CUmemPoolHandle_st*;

extern "C" {
int cudaDeviceGetDefaultMemPool(MemPool*, int);
int cudaMemPoolGetAttribute(MemPool, int, void*);
int cudaMemPoolSetAttribute(MemPool, int, void*);
int cudaMemPoolTrimTo(MemPool, std::size_t);
int cudaDeviceSynchronize();
int cuMemPoolCreate(MemPool*, const void*);
int cuDeviceGetDefaultMemPool(MemPool*, int);
int cuMemAllocFromPoolAsync(CUdeviceptr*, std::size_t, MemPool, CUstream_st*);
int cuMemFreeAsync(CUdeviceptr, CUstream_st*);
int cuGetProcAddress_v2(const char*, void**, int, std::uint64_t, int*);
}

namespace {

constexpr int kSuccess = 0, kInvalidValue = 1, kMemoryAllocation = 2;
constexpr int kReleaseThreshold = 4, kReservedCurrent = 5, kReservedHigh = 6, kUsedCurrent = 7,
              kUsedHigh = 8;
constexpr std::size_t MiB = 1 << 20;

using GetAttr = int (*)(MemPool, int, void*);
using SetAttr = int (*)(MemPool, int, void*);
using TrimTo = int (*)(MemPool, std::size_t);
using GetDefault = int (*)(MemPool*, int);

std::uint64_t attr(MemPool pool, int a, GetAttr get = &cudaMemPoolGetAttribute) {
  std::uint64_t v = ~0ull;
  EXPECT_EQ(get(pool, a, &v), kSuccess) << "attribute " << a;
  return v;
}

class MemPoolHooks : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(shim::preloaded()) << "run under LD_PRELOAD=libgpustitch.so (ctest does)";
    ASSERT_EQ(cudaSetDevice(0), kSuccess);
    ASSERT_EQ(shim::active(), 1) << "the pool did not start (backend:sim expected)";
    ASSERT_EQ(cudaStreamCreate(&stream_), kSuccess);
    ASSERT_EQ(cudaDeviceGetDefaultMemPool(&pool_, 0), kSuccess);
    ASSERT_NE(pool_, nullptr);
    fakecuda_reset_calls();
  }
  void TearDown() override { cudaStreamDestroy(stream_); }
  void* alloc(std::size_t size) {
    void* p = nullptr;
    EXPECT_EQ(cudaMallocAsync(&p, size, stream_), kSuccess);
    EXPECT_TRUE(shim::owns(p));
    return p;
  }
  CUstream_st* stream_ = nullptr;
  MemPool pool_ = nullptr;
};

TEST_F(MemPoolHooks, DefaultPoolReportsThePoolsFigures) {
  void* p = alloc(8 * MiB + 3);
  const auto s = shim::stats(0);
  ASSERT_GE(s.bytes_allocated, 8 * MiB);
  EXPECT_EQ(attr(pool_, kUsedCurrent), s.bytes_allocated);
  EXPECT_EQ(attr(pool_, kReservedCurrent), s.bytes_reserved);
  EXPECT_GE(attr(pool_, kUsedHigh), s.bytes_allocated);
  EXPECT_GE(attr(pool_, kReservedHigh), s.bytes_reserved);
  // The fragmentation PyTorch users compute from these is the pool's own.
  const double frag = 1.0 - static_cast<double>(attr(pool_, kUsedCurrent)) /
                                static_cast<double>(attr(pool_, kReservedCurrent));
  EXPECT_DOUBLE_EQ(
      frag, 1.0 - static_cast<double>(s.bytes_allocated) / static_cast<double>(s.bytes_reserved));
  // The driver's pool never saw the allocation; its own query was still made (once per call).
  EXPECT_EQ(fakecuda_calls("cuMemAllocAsync"), 0);
  EXPECT_EQ(fakecuda_calls("cuMemPoolGetAttribute"), 6);
  ASSERT_EQ(cudaFreeAsync(p, stream_), kSuccess);
  EXPECT_EQ(attr(pool_, kUsedCurrent), shim::stats(0).bytes_allocated);
}

TEST_F(MemPoolHooks, ResettingTheHighsRestartsThePoolsMarks) {
  void* big = alloc(64 * MiB);
  const std::uint64_t used_peak = attr(pool_, kUsedCurrent);
  ASSERT_EQ(cudaFreeAsync(big, stream_), kSuccess);
  EXPECT_GE(attr(pool_, kUsedHigh), used_peak);
  EXPECT_LT(attr(pool_, kUsedCurrent), used_peak);

  std::uint64_t zero = 0;
  ASSERT_EQ(cudaMemPoolSetAttribute(pool_, kUsedHigh, &zero), kSuccess);
  EXPECT_EQ(attr(pool_, kUsedHigh), attr(pool_, kUsedCurrent));
  EXPECT_EQ(attr(pool_, kUsedHigh), shim::stats(0).bytes_allocated);
  // The lifetime peak of the statistics records is not reset.
  EXPECT_GE(shim::stats(0).peak_allocated, used_peak);

  ASSERT_EQ(cudaMemPoolSetAttribute(pool_, kReservedHigh, &zero), kSuccess);
  EXPECT_EQ(attr(pool_, kReservedHigh), shim::stats(0).bytes_reserved);

  // Only 0 resets a high, and the current figures are read-only: the native errors, no reset.
  void* again = alloc(32 * MiB);
  const std::uint64_t high = attr(pool_, kUsedHigh);
  ASSERT_EQ(cudaFreeAsync(again, stream_), kSuccess);
  std::uint64_t five = 5;
  EXPECT_EQ(cudaMemPoolSetAttribute(pool_, kUsedHigh, &five), kInvalidValue);
  EXPECT_EQ(cudaMemPoolSetAttribute(pool_, kUsedCurrent, &zero), kInvalidValue);
  EXPECT_EQ(attr(pool_, kUsedHigh), high);
  cudaGetLastError();
}

TEST_F(MemPoolHooks, TrimToZeroTrimsThePool) {
  void* big = alloc(128 * MiB);
  ASSERT_EQ(cudaFreeAsync(big, stream_), kSuccess);
  const std::uint64_t before = attr(pool_, kReservedCurrent);
  ASSERT_GE(before, 128 * MiB);  // freed memory stays cached
  // A minimum to keep: the pool is left as it is (it cannot promise an exact amount).
  ASSERT_EQ(cudaMemPoolTrimTo(pool_, 64 * MiB), kSuccess);
  EXPECT_EQ(attr(pool_, kReservedCurrent), before);
  // empty_cache(): synchronise, then trim to 0.
  ASSERT_EQ(cudaDeviceSynchronize(), kSuccess);
  ASSERT_EQ(cudaMemPoolTrimTo(pool_, 0), kSuccess);
  const std::uint64_t after = attr(pool_, kReservedCurrent);
  EXPECT_LE(after + 128 * MiB, before);
  EXPECT_EQ(after, shim::stats(0).bytes_reserved);
  EXPECT_EQ(fakecuda_calls("cuMemPoolTrimTo"), 2);  // the driver's pool was trimmed too
}

TEST_F(MemPoolHooks, DriverFormsByNameDlsymAndGetProcAddressAnswerTheSame) {
  void* p = alloc(4 * MiB);
  void* libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(libcuda, nullptr);
  auto get_proc = reinterpret_cast<cu::GetProcAddress>(dlsym(libcuda, "cuGetProcAddress_v2"));
  ASSERT_NE(get_proc, nullptr);
  for (const char* name : {"cuDeviceGetDefaultMemPool", "cuMemPoolGetAttribute",
                           "cuMemPoolSetAttribute", "cuMemPoolTrimTo"}) {
    void* by_dlsym = dlsym(libcuda, name);
    void* by_proc = nullptr;
    int status = -1;
    ASSERT_EQ(get_proc(name, &by_proc, 13000, 0, &status), kSuccess) << name;
    EXPECT_EQ(shim::library_of(by_dlsym), "libgpustitch.so") << name;
    EXPECT_EQ(by_proc, by_dlsym) << name;
  }
  MemPool drv_pool = nullptr;
  ASSERT_EQ(reinterpret_cast<GetDefault>(dlsym(libcuda, "cuDeviceGetDefaultMemPool"))(&drv_pool, 0),
            kSuccess);
  EXPECT_EQ(drv_pool, pool_);  // the runtime's handle is the driver's
  auto get = reinterpret_cast<GetAttr>(dlsym(libcuda, "cuMemPoolGetAttribute"));
  const auto s = shim::stats(0);
  EXPECT_EQ(attr(drv_pool, kUsedCurrent, get), s.bytes_allocated);
  EXPECT_EQ(attr(drv_pool, kReservedCurrent, get), s.bytes_reserved);
  EXPECT_EQ(attr(drv_pool, kUsedCurrent), s.bytes_allocated);  // the runtime adds it once only
  std::uint64_t zero = 0;
  ASSERT_EQ(reinterpret_cast<SetAttr>(dlsym(libcuda, "cuMemPoolSetAttribute"))(drv_pool, kUsedHigh,
                                                                               &zero),
            kSuccess);
  EXPECT_EQ(attr(drv_pool, kUsedHigh, get), shim::stats(0).bytes_allocated);
  ASSERT_EQ(cudaFreeAsync(p, stream_), kSuccess);
  ASSERT_EQ(reinterpret_cast<TrimTo>(dlsym(libcuda, "cuMemPoolTrimTo"))(drv_pool, 0), kSuccess);
  EXPECT_EQ(attr(drv_pool, kReservedCurrent, get), shim::stats(0).bytes_reserved);
}

TEST_F(MemPoolHooks, OtherPoolsAttributesAndBadArgumentsPassThrough) {
  void* p = alloc(16 * MiB);
  // A pool of the program's own: the driver's figures only, and trimming it leaves the pool.
  MemPool own = nullptr;
  const char props[88] = {};
  ASSERT_EQ(cuMemPoolCreate(&own, props), kSuccess);
  EXPECT_EQ(attr(own, kUsedCurrent), 0u);
  EXPECT_EQ(attr(own, kReservedCurrent), 0u);
  const std::uint64_t reserved = shim::stats(0).bytes_reserved;
  ASSERT_EQ(cudaMemPoolTrimTo(own, 0), kSuccess);
  EXPECT_EQ(shim::stats(0).bytes_reserved, reserved);
  // Attributes the shim does not answer: the driver's values round-trip.
  std::uint64_t threshold = ~0ull;
  ASSERT_EQ(cudaMemPoolSetAttribute(pool_, kReleaseThreshold, &threshold), kSuccess);
  EXPECT_EQ(attr(pool_, kReleaseThreshold), ~0ull);
  int reuse = -1;
  ASSERT_EQ(cudaMemPoolGetAttribute(pool_, 1, &reuse), kSuccess);
  EXPECT_EQ(reuse, 1);
  // Bad arguments: the native error, and the caller's buffer is not written.
  std::uint64_t v = 77;
  EXPECT_EQ(cudaMemPoolGetAttribute(pool_, kUsedCurrent, nullptr), kInvalidValue);
  EXPECT_EQ(cudaMemPoolGetAttribute(pool_, 99, &v), kInvalidValue);
  auto forged = reinterpret_cast<MemPool>(&v);
  EXPECT_EQ(cudaMemPoolGetAttribute(forged, kUsedCurrent, &v), kInvalidValue);
  EXPECT_EQ(cudaMemPoolTrimTo(forged, 0), kInvalidValue);
  EXPECT_EQ(v, 77u);
  EXPECT_EQ(cudaDeviceGetDefaultMemPool(nullptr, 0), kInvalidValue);
  MemPool none = nullptr;
  EXPECT_EQ(cudaDeviceGetDefaultMemPool(&none, 7), 101);  // invalid device
  cudaGetLastError();
  // Device 1's default pool is its own: device 0's memory is not reported there.
  MemPool pool1 = nullptr;
  ASSERT_EQ(cudaDeviceGetDefaultMemPool(&pool1, 1), kSuccess);
  ASSERT_NE(pool1, pool_);
  EXPECT_EQ(attr(pool1, kUsedCurrent), shim::stats(1).bytes_allocated);
  EXPECT_LT(attr(pool1, kUsedCurrent), 16 * MiB);
  ASSERT_EQ(cudaFreeAsync(p, stream_), kSuccess);
}

// PyTorch's cudaMallocAsync backend raises the default pool's release threshold to the maximum.
// With driver_pool_release:on (the default) the program reads back its own value, by either API,
// but the driver's stays 0, so memory that reaches the driver's pool past the hooks goes back at
// the next synchronisation; off (ctest runs this test again so), the driver holds what was set. A
// pool of the program's own keeps the threshold it is given, and a bad argument gets the native
// error.
TEST_F(MemPoolHooks, DriverPoolReleaseHoldsTheDriversThresholdAtZero) {
  const char* conf = std::getenv("GPUSTITCH_CONF");
  const bool on = conf == nullptr || std::strstr(conf, "driver_pool_release:off") == nullptr;
  auto held = [&](std::uint64_t set) { return on ? 0 : set; };
  std::uint64_t max = ~0ull;
  ASSERT_EQ(cudaMemPoolSetAttribute(pool_, kReleaseThreshold, &max), kSuccess);
  EXPECT_EQ(attr(pool_, kReleaseThreshold), ~0ull);
  EXPECT_EQ(fakecuda_pool_release_threshold(pool_), held(~0ull));
  MemPool drv_pool = nullptr;
  ASSERT_EQ(cuDeviceGetDefaultMemPool(&drv_pool, 0), kSuccess);
  ASSERT_EQ(drv_pool, pool_);
  void* libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(libcuda, nullptr);
  auto drv_get = reinterpret_cast<GetAttr>(dlsym(libcuda, "cuMemPoolGetAttribute"));
  auto drv_set = reinterpret_cast<SetAttr>(dlsym(libcuda, "cuMemPoolSetAttribute"));
  ASSERT_NE(drv_get, nullptr);
  ASSERT_NE(drv_set, nullptr);
  std::uint64_t half = 1ull << 40;
  ASSERT_EQ(drv_set(pool_, kReleaseThreshold, &half), kSuccess);
  EXPECT_EQ(attr(pool_, kReleaseThreshold, drv_get), half);
  EXPECT_EQ(attr(pool_, kReleaseThreshold), half);
  EXPECT_EQ(fakecuda_pool_release_threshold(pool_), held(half));
  // 0 from the program: nothing to hold down, and it reads back 0.
  std::uint64_t zero = 0;
  ASSERT_EQ(cudaMemPoolSetAttribute(pool_, kReleaseThreshold, &zero), kSuccess);
  EXPECT_EQ(attr(pool_, kReleaseThreshold), 0u);
  // Bad arguments: the native error; the remembered value stays.
  ASSERT_EQ(cudaMemPoolSetAttribute(pool_, kReleaseThreshold, &max), kSuccess);
  EXPECT_EQ(cudaMemPoolSetAttribute(pool_, kReleaseThreshold, nullptr), kInvalidValue);
  EXPECT_EQ(cudaMemPoolGetAttribute(pool_, kReleaseThreshold, nullptr), kInvalidValue);
  EXPECT_EQ(attr(pool_, kReleaseThreshold), ~0ull);
  EXPECT_EQ(fakecuda_pool_release_threshold(pool_), held(~0ull));
  // A pool the program created is its own business.
  MemPool own = nullptr;
  const char props[88] = {};
  ASSERT_EQ(cuMemPoolCreate(&own, props), kSuccess);
  ASSERT_EQ(cudaMemPoolSetAttribute(own, kReleaseThreshold, &max), kSuccess);
  EXPECT_EQ(fakecuda_pool_release_threshold(own), ~0ull);
  EXPECT_EQ(attr(own, kReleaseThreshold), ~0ull);
  ASSERT_EQ(cudaMemPoolSetAttribute(pool_, kReleaseThreshold, &zero), kSuccess);
}

// Allocations made while the stream is captured into a graph go to the driver's pool: they are
// counted too, on top of the pool's.
TEST_F(MemPoolHooks, GraphCaptureAllocationsAreCountedFromTheDriversPool) {
  fakecuda_set_capturing(stream_, 1);
  void* g = nullptr;
  ASSERT_EQ(cudaMallocAsync(&g, 2 * MiB, stream_), kSuccess);
  fakecuda_set_capturing(stream_, 0);
  EXPECT_FALSE(shim::owns(g));
  EXPECT_EQ(attr(pool_, kUsedCurrent), shim::stats(0).bytes_allocated + 2 * MiB);
  EXPECT_GE(attr(pool_, kReservedCurrent), shim::stats(0).bytes_reserved + 2 * MiB);
  ASSERT_EQ(cudaFreeAsync(g, stream_), kSuccess);
  EXPECT_EQ(attr(pool_, kUsedCurrent), shim::stats(0).bytes_allocated);
}

// PyTorch's CudaMallocAsync allocator raises torch.OutOfMemoryError when cudaMallocAsync returns
// cudaErrorMemoryAllocation; it then clears the sticky error and asks cudaMemGetInfo for its
// message. Anything else would surface as a generic CUDA error.
TEST_F(MemPoolHooks, OutOfMemoryOnTheStreamOrderedPathIsCudaErrorMemoryAllocation) {
  cudaGetLastError();
  void* p = reinterpret_cast<void*>(1);
  EXPECT_EQ(cudaMallocAsync(&p, 2048 * MiB, stream_), kMemoryAllocation);
  EXPECT_EQ(cudaGetLastError(), kMemoryAllocation);
  EXPECT_EQ(cudaGetLastError(), kSuccess);
  std::size_t free = 0, total = 0;
  EXPECT_EQ(cudaMemGetInfo(&free, &total), kSuccess);
  EXPECT_EQ(total, 1024 * MiB);
  EXPECT_EQ(fakecuda_calls("cuMemAllocAsync"), 0);  // the pool answered, not the driver's pool
  // And the next allocation is served as usual.
  void* q = alloc(MiB);
  ASSERT_EQ(cudaFreeAsync(q, stream_), kSuccess);
}

}  // namespace

// XLA's cuda_async allocator and TensorFlow's cuda_malloc_async allocate every buffer with
// cuMemAllocFromPoolAsync on the device's default pool: served by the pool as cuMemAllocAsync is,
// whichever way the entry point was found; a pool the program created stays the driver's.
TEST_F(MemPoolHooks, AllocFromTheDefaultPoolIsServed) {
  MemPool driver_default = nullptr;
  ASSERT_EQ(cuDeviceGetDefaultMemPool(&driver_default, 1), kSuccess);
  using AllocFromPool = int (*)(CUdeviceptr*, std::size_t, MemPool, CUstream_st*);
  void* gpa_fn = nullptr;
  int status = -1;
  auto gpa = reinterpret_cast<int (*)(const char*, void**, int, std::uint64_t, int*)>(
      dlsym(RTLD_DEFAULT, "cuGetProcAddress_v2"));
  ASSERT_NE(gpa, nullptr);
  ASSERT_EQ(gpa("cuMemAllocFromPoolAsync", &gpa_fn, 12000, 0, &status), kSuccess);
  EXPECT_EQ(shim::library_of(gpa_fn), "libgpustitch.so");
  for (AllocFromPool fn : {static_cast<AllocFromPool>(&cuMemAllocFromPoolAsync),
                           reinterpret_cast<AllocFromPool>(gpa_fn)}) {
    fakecuda_reset_calls();
    const auto before = shim::stats(1);
    CUdeviceptr p = 0;
    ASSERT_EQ(fn(&p, 16 * MiB, driver_default, stream_), kSuccess);
    EXPECT_TRUE(shim::owns(reinterpret_cast<void*>(p)));
    EXPECT_EQ(shim::stats(1).allocs, before.allocs + 1) << "on the pool's device, not the stream's";
    EXPECT_EQ(fakecuda_calls("cuMemAllocFromPoolAsync"), 0);
    std::memset(reinterpret_cast<void*>(p), 0x7d, 16 * MiB);  // sim backend: host memory
    EXPECT_EQ(reinterpret_cast<unsigned char*>(p)[16 * MiB - 1], 0x7d);
    ASSERT_EQ(cuMemFreeAsync(p, stream_), kSuccess);
    EXPECT_EQ(shim::stats(1).frees, before.frees + 1);
  }
  // A pool the program created: the driver's allocation.
  MemPool own = nullptr;
  int props[22] = {1, 0, 1, 0};  // pinned, no handle types, device 0
  ASSERT_EQ(cuMemPoolCreate(&own, props), kSuccess);
  CUdeviceptr q = 0;
  ASSERT_EQ(cuMemAllocFromPoolAsync(&q, 4 * MiB, own, stream_), kSuccess);
  EXPECT_FALSE(shim::owns(reinterpret_cast<void*>(q)));
  EXPECT_EQ(fakecuda_calls("cuMemAllocFromPoolAsync"), 1);
  ASSERT_EQ(cuMemFreeAsync(q, stream_), kSuccess);
  // Bad arguments get the driver's answer.
  EXPECT_EQ(cuMemAllocFromPoolAsync(nullptr, 4 * MiB, driver_default, stream_), kInvalidValue);
  EXPECT_EQ(cuMemAllocFromPoolAsync(&q, 4 * MiB, nullptr, stream_), kInvalidValue);
}
