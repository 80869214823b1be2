// libgpustitch.so under LD_PRELOAD in a program linked against a shared CUDA runtime (the fake
// libcudart.so.13, versioned like the real one) and the driver (the fake libcuda.so.1): every way
// an allocation reaches CUDA, what the caller gets back, and that the pool served it exactly once.
//
// ctest runs this with LD_PRELOAD=libgpustitch.so and
// GPUSTITCH_CONF=backend:sim,sim_devices:2,sim_capacity_mb:1024; the fake driver has 2 devices of
// 4096 MiB, so answers coming from the pool and from the driver can be told apart.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cuda_decls.h"
#include "doubles/fake_cuda.h"
#include "shim_api.h"

extern "C" {
int cuMemAlloc_v2(CUdeviceptr*, std::size_t);
int cuMemFree_v2(CUdeviceptr);
int cuMemAllocPitch_v2(CUdeviceptr*, std::size_t*, std::size_t, std::size_t, unsigned);
int cuMemGetInfo_v2(std::size_t*, std::size_t*);
int cuMemGetAddressRange_v2(CUdeviceptr*, std::size_t*, CUdeviceptr);
int cuPointerGetAttribute(void*, int, CUdeviceptr);
int cuPointerGetAttributes(unsigned, int*, void**, CUdeviceptr);
int cuStreamCreate(CUstream_st**, unsigned);
int cuStreamDestroy_v2(CUstream_st*);
int cuMemAllocAsync(CUdeviceptr*, std::size_t, CUstream_st*);
int cuMemFreeAsync(CUdeviceptr, CUstream_st*);
// A reference to the pre-2.34 version of dlsym: the architecture's first glibc version.
void* dlsym_pre_2_34(void*, const char*);
#if defined(__aarch64__)
__asm__(".symver dlsym_pre_2_34,dlsym@GLIBC_2.17");
#else
__asm__(".symver dlsym_pre_2_34,dlsym@GLIBC_2.2.5");
#endif
}

namespace {

constexpr int kSuccess = 0, kInvalidValue = 1, kMemoryAllocation = 2, kNotSupported = 801,
              kCaptureUnsupported = 900, kInvalidResourceHandle = 400;
constexpr std::size_t MiB = 1 << 20;

void fill(void* p, std::size_t n, unsigned char seed) {
  auto* b = static_cast<unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<unsigned char>(seed + i * 7);
}
bool check(const void* p, std::size_t n, unsigned char seed) {
  auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i) {
    if (b[i] != static_cast<unsigned char>(seed + i * 7)) return false;
  }
  return true;
}

class DynamicRuntime : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(shim::preloaded()) << "run under LD_PRELOAD=libgpustitch.so (ctest does)";
    ASSERT_EQ(cudaSetDevice(0), kSuccess);
    ASSERT_EQ(shim::active(), 1) << "the pool did not start (backend:sim expected)";
    fakecuda_reset_calls();
  }
  void* libcuda() { return dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD); }
};

TEST_F(DynamicRuntime, CudaMallocIsServedOnceByThePoolAndBytesReadBack) {
  auto before = shim::stats(0);
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 3 * MiB + 5), kSuccess);
  ASSERT_NE(p, nullptr);
  EXPECT_TRUE(shim::owns(p));
  EXPECT_TRUE(shim::owns(static_cast<char*>(p) + 3 * MiB));  // interior pointer
  fill(p, 3 * MiB + 5, 11);
  EXPECT_TRUE(check(p, 3 * MiB + 5, 11));
  auto during = shim::stats(0);
  EXPECT_EQ(during.allocs, before.allocs + 1);
  EXPECT_EQ(during.live_blocks, before.live_blocks + 1);
  // Served by the pool at the runtime level: the driver never saw an allocation.
  EXPECT_EQ(fakecuda_calls("cuMemAlloc_v2"), 0);
  ASSERT_EQ(cudaFree(p), kSuccess);
  EXPECT_FALSE(shim::owns(p));
  auto after = shim::stats(0);
  EXPECT_EQ(after.frees, before.frees + 1);
  EXPECT_EQ(after.live_blocks, before.live_blocks);
  EXPECT_EQ(fakecuda_calls("cuMemFree_v2"), 0);
}

TEST_F(DynamicRuntime, ManyLiveAllocationsDoNotOverlap) {
  std::vector<void*> ptrs;
  const std::size_t sizes[] = {1, 512, 4096, 100000, 2 * MiB, 2 * MiB + 1, 7 * MiB};
  for (int round = 0; round < 6; ++round) {
    for (std::size_t s : sizes) {
      void* p = nullptr;
      ASSERT_EQ(cudaMalloc(&p, s), kSuccess);
      fill(p, s, static_cast<unsigned char>(ptrs.size()));
      ptrs.push_back(p);
    }
  }
  for (std::size_t i = 0; i < ptrs.size(); ++i) {
    EXPECT_TRUE(check(ptrs[i], sizes[i % 7], static_cast<unsigned char>(i))) << "block " << i;
    EXPECT_EQ(cudaFree(ptrs[i]), kSuccess);
  }
}

TEST_F(DynamicRuntime, StreamOrderedAllocationsUseThePool) {
  CUstream_st* s = nullptr;
  ASSERT_EQ(cudaStreamCreate(&s), kSuccess);
  auto before = shim::stats(0);
  void* a = nullptr;
  void* b = nullptr;
  ASSERT_EQ(cudaMallocAsync(&a, 1 * MiB, s), kSuccess);
  ASSERT_EQ(cudaMallocAsync_ptsz(&b, 1 * MiB, nullptr), kSuccess);
  EXPECT_TRUE(shim::owns(a));
  EXPECT_TRUE(shim::owns(b));
  fill(a, MiB, 1);
  fill(b, MiB, 2);
  EXPECT_TRUE(check(a, MiB, 1));
  EXPECT_TRUE(check(b, MiB, 2));
  EXPECT_EQ(cudaFreeAsync(a, s), kSuccess);
  EXPECT_EQ(cudaFreeAsync_ptsz(b, nullptr), kSuccess);
  EXPECT_EQ(shim::stats(0).allocs, before.allocs + 2);
  EXPECT_EQ(fakecuda_calls("cuMemAllocAsync") + fakecuda_calls("cuMemAllocAsync_ptsz"), 0);
  EXPECT_EQ(cudaStreamDestroy(s), kSuccess);
}

// A thread that has made no CUDA call has no current context; the runtime makes one current
// inside its first call. PyTorch's autograd thread starts that way, and its first call is the
// loss gradient's cudaMallocAsync on the NULL stream: that one must be served like any other,
// not handed to the driver's own pool. A free there must not fail for want of a context either.
TEST_F(DynamicRuntime, StreamOrderedCallsOnAThreadWithoutAContextUseThePool) {
  auto before = shim::stats(0);
  void* kept = nullptr;
  ASSERT_EQ(cudaMalloc(&kept, 2 * MiB), kSuccess);
  int rc[3] = {-1, -1, -1};
  void* p[2] = {nullptr, nullptr};
  bool owned[2] = {false, false}, read_back[2] = {false, false};
  std::thread([&] { rc[0] = cudaMallocAsync(&p[0], 3 * MiB, nullptr); }).join();
  std::thread([&] { rc[1] = cudaFreeAsync(kept, nullptr); }).join();  // another thread's block
  std::thread([&] { rc[2] = cudaMallocAsync_ptsz(&p[1], 3 * MiB, nullptr); }).join();
  for (int i = 0; i < 2; ++i) {
    owned[i] = shim::owns(p[i]);
    if (p[i] != nullptr) {
      fill(p[i], 3 * MiB, static_cast<unsigned char>(40 + i));
      read_back[i] = check(p[i], 3 * MiB, static_cast<unsigned char>(40 + i));
    }
  }
  EXPECT_EQ(rc[0], kSuccess);
  EXPECT_EQ(rc[1], kSuccess);
  EXPECT_EQ(rc[2], kSuccess);
  EXPECT_TRUE(owned[0]) << "the NULL stream's first allocation went past the pool";
  EXPECT_TRUE(owned[1]) << "the per-thread stream's first allocation went past the pool";
  EXPECT_TRUE(read_back[0] && read_back[1]);
  EXPECT_FALSE(shim::owns(kept)) << "the free on a fresh thread did not free the block";
  auto after = shim::stats(0);
  EXPECT_EQ(after.allocs, before.allocs + 3);
  EXPECT_EQ(fakecuda_calls("cuMemAllocAsync") + fakecuda_calls("cuMemAllocAsync_ptsz"), 0);
  EXPECT_EQ(cudaFree(p[0]), kSuccess);
  EXPECT_EQ(cudaFree(p[1]), kSuccess);
}

TEST_F(DynamicRuntime, DriverCalledDirectlyByName) {
  CUdeviceptr p = 0;
  ASSERT_EQ(cuMemAlloc_v2(&p, 64 * 1024), kSuccess);
  EXPECT_TRUE(shim::owns(reinterpret_cast<void*>(p)));
  fill(reinterpret_cast<void*>(p), 64 * 1024, 9);
  EXPECT_TRUE(check(reinterpret_cast<void*>(p), 64 * 1024, 9));
  EXPECT_EQ(cuMemFree_v2(p), kSuccess);
  EXPECT_EQ(fakecuda_calls("cuMemAlloc_v2"), 0);
}

TEST_F(DynamicRuntime, DriverThroughDlsymOnTheLibcudaHandle) {
  void* h = libcuda();
  ASSERT_NE(h, nullptr);
  auto alloc = reinterpret_cast<cu::MemAlloc>(dlsym(h, "cuMemAlloc_v2"));
  auto release = reinterpret_cast<cu::MemFree>(dlsym(h, "cuMemFree_v2"));
  ASSERT_NE(alloc, nullptr);
  EXPECT_EQ(shim::library_of(reinterpret_cast<void*>(alloc)), "libgpustitch.so");
  CUdeviceptr p = 0;
  ASSERT_EQ(alloc(&p, 1000), kSuccess);
  EXPECT_TRUE(shim::owns(reinterpret_cast<void*>(p)));
  EXPECT_EQ(release(p), kSuccess);
  // Names the shim does not hook come from the driver, and unknown names stay unknown.
  EXPECT_EQ(shim::library_of(dlsym(h, "cuCtxGetDevice")), "libcuda.so.1");
  EXPECT_EQ(dlsym(h, "cuNoSuchFunction"), nullptr);
}

TEST_F(DynamicRuntime, DlsymOfBothGlibcVersions) {
  // This binary references dlsym@GLIBC_2.34 (plain calls, glibc >= 2.34) and, through the alias
  // above, dlsym@GLIBC_2.2.5 (x86_64) or dlsym@GLIBC_2.17 (aarch64) as programs built against older
  // glibc do. Both must bind to the hook.
  EXPECT_EQ(shim::library_of(reinterpret_cast<void*>(&dlsym_pre_2_34)), "libgpustitch.so");
  EXPECT_EQ(shim::library_of(dlsym_pre_2_34(libcuda(), "cuMemAlloc_v2")), "libgpustitch.so");
  EXPECT_EQ(shim::library_of(dlsym(libcuda(), "cuMemAlloc_v2")), "libgpustitch.so");
  EXPECT_EQ(shim::library_of(dlsym_pre_2_34(libcuda(), "cuCtxGetDevice")), "libcuda.so.1");
}

TEST_F(DynamicRuntime, DlsymRtldNextStaysRelativeToTheCaller) {
  // From the executable, "next" starts with the preloaded shim itself. If the hook called glibc's
  // dlsym instead of tail-jumping to it, glibc would search after the shim and miss these.
  EXPECT_EQ(shim::library_of(dlsym(RTLD_NEXT, "gpustitch_version")), "libgpustitch.so");
  EXPECT_EQ(shim::library_of(dlsym(RTLD_NEXT, "dlsym")), "libgpustitch.so");
}

TEST_F(DynamicRuntime, GetProcAddressHonoursVersionAndStreamFlavour) {
  auto gpa = reinterpret_cast<cu::GetProcAddress>(dlsym(libcuda(), "cuGetProcAddress_v2"));
  ASSERT_NE(gpa, nullptr);
  EXPECT_EQ(shim::library_of(reinterpret_cast<void*>(gpa)), "libgpustitch.so");
  void* fn = nullptr;
  int status = -1;
  ASSERT_EQ(gpa("cuMemAlloc", &fn, 13000, 0, &status), kSuccess);
  EXPECT_EQ(status, 0);
  EXPECT_EQ(shim::symbol_of(fn), "cuMemAlloc_v2");
  EXPECT_EQ(shim::library_of(fn), "libgpustitch.so");
  CUdeviceptr p = 0;
  ASSERT_EQ(reinterpret_cast<cu::MemAlloc>(fn)(&p, 4096), kSuccess);
  EXPECT_TRUE(shim::owns(reinterpret_cast<void*>(p)));
  EXPECT_EQ(cuMemFree_v2(p), kSuccess);
  // Below CUDA 3.2 the driver's old 32-bit cuMemAlloc is returned, untouched.
  ASSERT_EQ(gpa("cuMemAlloc", &fn, 3000, 0, &status), kSuccess);
  EXPECT_EQ(shim::library_of(fn), "libcuda.so.1");
  EXPECT_EQ(shim::symbol_of(fn), "cuMemAlloc");
  // Stream flavours.
  ASSERT_EQ(gpa("cuMemAllocAsync", &fn, 12000, 2, &status), kSuccess);
  EXPECT_EQ(shim::symbol_of(fn), "cuMemAllocAsync_ptsz");
  EXPECT_EQ(shim::library_of(fn), "libgpustitch.so");
  ASSERT_EQ(gpa("cuMemFreeAsync", &fn, 12000, 1, &status), kSuccess);
  EXPECT_EQ(shim::symbol_of(fn), "cuMemFreeAsync");
  EXPECT_EQ(shim::library_of(fn), "libgpustitch.so");
  // Before CUDA 11.2 there was no cuMemAllocAsync: the driver's answer stands.
  fn = reinterpret_cast<void*>(1);
  EXPECT_NE(gpa("cuMemAllocAsync", &fn, 11000, 0, &status), kSuccess);
  EXPECT_EQ(fn, nullptr);
  EXPECT_EQ(status, 2);
  // cuGetProcAddress hands out itself too.
  ASSERT_EQ(gpa("cuGetProcAddress", &fn, 12000, 0, &status), kSuccess);
  EXPECT_EQ(shim::symbol_of(fn), "cuGetProcAddress_v2");
  EXPECT_EQ(shim::library_of(fn), "libgpustitch.so");
  ASSERT_EQ(gpa("cuGetProcAddress", &fn, 11080, 0, &status), kSuccess);
  EXPECT_EQ(shim::symbol_of(fn), "cuGetProcAddress");
  EXPECT_EQ(shim::library_of(fn), "libgpustitch.so");
  // Unhooked names pass through.
  ASSERT_EQ(gpa("cuCtxGetDevice", &fn, 13000, 0, &status), kSuccess);
  EXPECT_EQ(shim::library_of(fn), "libcuda.so.1");
}

TEST_F(DynamicRuntime, RuntimeDriverEntryPoints) {
  void* fn = nullptr;
  int status = -1;
  ASSERT_EQ(cudaGetDriverEntryPoint("cuMemAlloc", &fn, 0, &status), kSuccess);
  EXPECT_EQ(shim::library_of(fn), "libgpustitch.so");
  EXPECT_EQ(shim::symbol_of(fn), "cuMemAlloc_v2");
  ASSERT_EQ(cudaGetDriverEntryPointByVersion("cuMemFreeAsync", &fn, 12000, 2, &status), kSuccess);
  EXPECT_EQ(shim::symbol_of(fn), "cuMemFreeAsync_ptsz");
  EXPECT_EQ(shim::library_of(fn), "libgpustitch.so");
}

TEST_F(DynamicRuntime, ForeignPointersPassThroughToTheRealFree) {
  // Managed and pinned host memory are always native.
  void* managed = nullptr;
  ASSERT_EQ(cudaMallocManaged(&managed, 4096, 1), kSuccess);
  EXPECT_FALSE(shim::owns(managed));
  EXPECT_EQ(fakecuda_calls("cuMemAllocManaged"), 1);
  std::memset(managed, 0x5a, 4096);
  EXPECT_EQ(cudaFree(managed), kSuccess);  // foreign: the real cudaFree -> real cuMemFree_v2
  EXPECT_EQ(fakecuda_calls("cuMemFree_v2"), 1);
  void* host = nullptr;
  ASSERT_EQ(cudaMallocHost(&host, 4096), kSuccess);
  EXPECT_FALSE(shim::owns(host));
  EXPECT_EQ(cudaFreeHost(host), kSuccess);
  // A pointer nobody allocated gets the native error.
  int local = 0;
  EXPECT_EQ(cudaFree(&local), kInvalidValue);
  EXPECT_EQ(cuMemFree_v2(reinterpret_cast<CUdeviceptr>(&local)), kInvalidValue);
}

TEST_F(DynamicRuntime, NativeErrorCodesForBadArguments) {
  EXPECT_EQ(cudaMalloc(nullptr, 16), kInvalidValue);
  void* p = reinterpret_cast<void*>(1);
  EXPECT_EQ(cudaMalloc(&p, 0), kSuccess);  // the runtime's own answer: success, NULL
  EXPECT_EQ(p, nullptr);
  CUdeviceptr d = 0;
  EXPECT_EQ(cuMemAlloc_v2(nullptr, 16), kInvalidValue);
  EXPECT_EQ(cuMemAlloc_v2(&d, 0), kInvalidValue);
  std::size_t pitch = 0;
  EXPECT_EQ(cuMemAllocPitch_v2(&d, &pitch, 100, 10, 3), kInvalidValue);
  EXPECT_EQ(cuMemGetInfo_v2(nullptr, nullptr), kInvalidValue);
  EXPECT_EQ(cudaMemGetInfo(nullptr, nullptr), kInvalidValue);
  // Freeing an interior pointer of a pool block is not a free of that block.
  void* q = nullptr;
  ASSERT_EQ(cudaMalloc(&q, 4096), kSuccess);
  EXPECT_EQ(cudaFree(static_cast<char*>(q) + 16), kInvalidValue);
  EXPECT_TRUE(shim::owns(q));
  EXPECT_EQ(cudaFree(q), kSuccess);
  cudaGetLastError();
}

TEST_F(DynamicRuntime, OutOfMemoryIsTheNativeErrorAndCounted) {
  auto before = shim::stats(0);
  void* p = reinterpret_cast<void*>(1);
  cudaGetLastError();
  // The simulated device has 1 GiB; the fake driver (4 GiB) is never asked.
  EXPECT_EQ(cudaMalloc(&p, 2048 * MiB), kMemoryAllocation);
  EXPECT_EQ(cudaGetLastError(), kMemoryAllocation);  // sticky error set as natively
  EXPECT_EQ(cudaGetLastError(), kSuccess);
  CUdeviceptr d = 0;
  EXPECT_EQ(cuMemAlloc_v2(&d, 2048 * MiB), kMemoryAllocation);
  void* a = nullptr;
  EXPECT_EQ(cudaMallocAsync(&a, 2048 * MiB, nullptr), kMemoryAllocation);
  cudaGetLastError();
  EXPECT_EQ(shim::stats(0).ooms, before.ooms + 3);
  // The driver saw only the two probes that set the runtime's sticky error (one per runtime OOM).
  EXPECT_EQ(fakecuda_calls("cuMemAlloc_v2"), 2);
  // The pool still serves afterwards.
  ASSERT_EQ(cudaMalloc(&p, MiB), kSuccess);
  EXPECT_TRUE(shim::owns(p));
  EXPECT_EQ(cudaFree(p), kSuccess);
}

TEST_F(DynamicRuntime, MemGetInfoReportsThePool) {
  std::size_t free = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free, &total), kSuccess);
  EXPECT_EQ(total, 1024 * MiB);  // the pool's device, not the fake driver's 4 GiB
  EXPECT_LE(free, total);
  ASSERT_EQ(cuMemGetInfo_v2(&free, &total), kSuccess);
  EXPECT_EQ(total, 1024 * MiB);
}

TEST_F(DynamicRuntime, PointerQueriesAnswerForPoolBlocks) {
  ASSERT_EQ(cudaSetDevice(1), kSuccess);
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 10000), kSuccess);
  ASSERT_TRUE(shim::owns(p));
  auto base = reinterpret_cast<CUdeviceptr>(p);
  CUdeviceptr got_base = 0;
  std::size_t got_size = 0;
  ASSERT_EQ(cuMemGetAddressRange_v2(&got_base, &got_size, base + 5000), kSuccess);
  EXPECT_EQ(got_base, base);
  EXPECT_EQ(got_size, 10000u);
  int ordinal = -1;
  ASSERT_EQ(cuPointerGetAttribute(&ordinal, 9, base + 1), kSuccess);
  EXPECT_EQ(ordinal, 1);
  unsigned type = 0;
  CUdeviceptr start = 0;
  int attrs[] = {2, 11};
  void* data[] = {&type, &start};
  ASSERT_EQ(cuPointerGetAttributes(2, attrs, data, base + 77), kSuccess);
  EXPECT_EQ(type, 2u);  // CU_MEMORYTYPE_DEVICE
  EXPECT_EQ(start, base);
  EXPECT_EQ(shim::stats(1).live_blocks, 1u);
  EXPECT_EQ(cudaFree(p), kSuccess);
  ASSERT_EQ(cudaSetDevice(0), kSuccess);
}

// Between processes: ipc_test.cpp. Here: a pool block's handle is the shim's ("GPUSTIPC"), the
// same for every call on one block, and a fresh one once the block was freed.
TEST_F(DynamicRuntime, IpcHandleOfPoolMemoryIsTheShims) {
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 4096), kSuccess);
  unsigned char handle[64], again[64];
  ASSERT_EQ(cudaIpcGetMemHandle(handle, p), kSuccess);
  EXPECT_EQ(std::memcmp(handle, "GPUSTIPC", 8), 0);
  ASSERT_EQ(cudaIpcGetMemHandle(again, p), kSuccess);
  EXPECT_EQ(std::memcmp(handle, again, sizeof handle), 0);
  EXPECT_EQ(cudaFree(p), kSuccess);
  EXPECT_FALSE(shim::owns(p));  // freed at once: no process had opened it
  ASSERT_EQ(cudaMalloc(&p, 4096), kSuccess);
  ASSERT_EQ(cudaIpcGetMemHandle(again, p), kSuccess);
  EXPECT_NE(std::memcmp(handle, again, sizeof handle), 0);
  EXPECT_EQ(cudaFree(p), kSuccess);
}

// What the shim answers itself when a pool handle is opened (preload/src/ipc_hooks.cpp), the
// same in both APIs but for the missing context: a null address pointer is an invalid value, and
// through the driver a thread without a current context gets CUDA_ERROR_INVALID_CONTEXT, none of
// it passed to CUDA (which does not know the handle and would answer invalid value for all).
TEST_F(DynamicRuntime, OpeningAPoolHandleBadlyGetsTheShimsAnswerInEitherApi) {
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 4096), kSuccess);
  IpcHandle h{};
  ASSERT_EQ(cudaIpcGetMemHandle(&h, p), kSuccess);
  fakecuda_reset_calls();
  EXPECT_EQ(cudaIpcOpenMemHandle(nullptr, h, 1), kInvalidValue);
  EXPECT_EQ(cuIpcOpenMemHandle_v2(nullptr, h, 1), kInvalidValue);
  int without_context = -1;
  std::thread([&] {
    CUdeviceptr d = 0;
    without_context = cuIpcOpenMemHandle_v2(&d, h, 1);
  }).join();
  EXPECT_EQ(without_context, 201);  // CUDA_ERROR_INVALID_CONTEXT
  EXPECT_EQ(fakecuda_calls("cuIpcOpenMemHandle_v2"), 0);
  cudaGetLastError();
  EXPECT_EQ(cudaFree(p), kSuccess);
}

TEST_F(DynamicRuntime, PeerAccessPassesTheDriverResultThrough) {
  EXPECT_EQ(cudaDeviceEnablePeerAccess(1, 0), kSuccess);
  EXPECT_EQ(cudaDeviceEnablePeerAccess(1, 0), 704);  // cudaErrorPeerAccessAlreadyEnabled
  EXPECT_EQ(cudaDeviceEnablePeerAccess(1, 5), kInvalidValue);
  cudaGetLastError();
}

TEST_F(DynamicRuntime, GraphCaptureKeepsNativeBehaviourAndIsNotServedTwice) {
  CUstream_st* s = nullptr;
  ASSERT_EQ(cudaStreamCreate(&s), kSuccess);
  void* before_capture = nullptr;
  ASSERT_EQ(cudaMallocAsync(&before_capture, 4096, s), kSuccess);
  ASSERT_TRUE(shim::owns(before_capture));
  auto stats_before = shim::stats(0);
  fakecuda_set_capturing(s, 1);
  void* p = nullptr;
  ASSERT_EQ(cudaMallocAsync(&p, 4096, s), kSuccess);
  EXPECT_FALSE(shim::owns(p));
  // The runtime passed through went to the driver hook, which forwarded it (guard): once.
  EXPECT_EQ(fakecuda_calls("cuMemAllocAsync"), 1);
  EXPECT_EQ(shim::stats(0).allocs, stats_before.allocs);
  EXPECT_EQ(cudaFreeAsync(p, s), kSuccess);
  EXPECT_EQ(fakecuda_calls("cuMemFreeAsync"), 1);
  EXPECT_EQ(cudaFreeAsync(before_capture, s), kCaptureUnsupported);
  cudaGetLastError();
  fakecuda_set_capturing(s, 0);
  EXPECT_EQ(cudaFreeAsync(before_capture, s), kSuccess);
  EXPECT_EQ(cudaStreamDestroy(s), kSuccess);
}

// A free on a stream that was destroyed used to count as "on a capturing stream": error 900, a log
// line about CUDA graphs, and the block stayed live for the life of the process. Now the caller
// gets the driver's error for the stream and the pool takes the block back (fenced as cudaFree).
TEST_F(DynamicRuntime, FreeAsyncOnADestroyedStreamReturnsTheStreamsErrorAndFreesTheBlock) {
  CUstream_st* s = nullptr;
  ASSERT_EQ(cudaStreamCreate(&s), kSuccess);
  void* p = nullptr;
  ASSERT_EQ(cudaMallocAsync(&p, 3 * MiB, s), kSuccess);
  ASSERT_TRUE(shim::owns(p));
  const auto before = shim::stats(0);
  ASSERT_EQ(cudaStreamDestroy(s), kSuccess);
  EXPECT_EQ(cudaFreeAsync(p, s), kInvalidResourceHandle);
  cudaGetLastError();
  EXPECT_FALSE(shim::owns(p)) << "the block must not stay live";
  EXPECT_EQ(shim::stats(0).live_blocks, before.live_blocks - 1);
  EXPECT_EQ(fakecuda_calls("cuMemFreeAsync"), 0) << "pool memory must not reach the driver";

  // The same through the driver API.
  CUstream_st* d = nullptr;
  ASSERT_EQ(cuStreamCreate(&d, 0), kSuccess);
  CUdeviceptr q = 0;
  ASSERT_EQ(cuMemAllocAsync(&q, 3 * MiB, d), kSuccess);
  ASSERT_TRUE(shim::owns(reinterpret_cast<void*>(q)));
  ASSERT_EQ(cuStreamDestroy_v2(d), kSuccess);
  EXPECT_EQ(cuMemFreeAsync(q, d), kInvalidResourceHandle);
  EXPECT_FALSE(shim::owns(reinterpret_cast<void*>(q)));
  EXPECT_EQ(shim::stats(0).live_blocks, before.live_blocks - 1);
}

TEST_F(DynamicRuntime, PitchedAllocations) {
  void* p = nullptr;
  std::size_t pitch = 0;
  ASSERT_EQ(cudaMallocPitch(&p, &pitch, 1000, 30), kSuccess);
  EXPECT_TRUE(shim::owns(p));
  EXPECT_EQ(pitch % 512, 0u);
  EXPECT_GE(pitch, 1000u);
  fill(p, pitch * 30, 4);
  EXPECT_TRUE(check(p, pitch * 30, 4));
  EXPECT_EQ(cudaFree(p), kSuccess);
  CUdeviceptr d = 0;
  ASSERT_EQ(cuMemAllocPitch_v2(&d, &pitch, 100, 3, 4), kSuccess);
  EXPECT_TRUE(shim::owns(reinterpret_cast<void*>(d)));
  EXPECT_EQ(pitch, 512u);
  EXPECT_EQ(cuMemFree_v2(d), kSuccess);
}

TEST_F(DynamicRuntime, ManyThreadsAllocateAndFreeConcurrently) {
  constexpr int kThreads = 8, kIters = 1500;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t, &failures] {
      cudaSetDevice(t % 2);
      CUstream_st* s = nullptr;
      cudaStreamCreate(&s);
      std::vector<std::pair<void*, std::size_t>> live;
      for (int i = 0; i < kIters; ++i) {
        std::size_t size = 64 + static_cast<std::size_t>((i * 7919 + t * 104729) % (3 * MiB));
        void* p = nullptr;
        int r = (i % 3 == 0) ? cudaMallocAsync(&p, size, s) : cudaMalloc(&p, size);
        if (r != 0 || !shim::owns(p)) {
          ++failures;
          continue;
        }
        auto seed = static_cast<unsigned char>(t * 31 + i);
        std::memset(p, seed, 64);
        std::memset(static_cast<char*>(p) + size - 64, seed, 64);
        live.emplace_back(p, size);
        if (live.size() > 8 || i % 5 == 0) {
          auto [q, n] = live.front();
          live.erase(live.begin());
          auto* b = static_cast<unsigned char*>(q);
          unsigned char want = b[0];
          for (std::size_t k = 0; k < 64; ++k) {
            if (b[k] != want || b[n - 64 + k] != want) {
              ++failures;
              break;
            }
          }
          if (cudaFree(q) != 0) ++failures;
        }
      }
      for (auto [q, n] : live) {
        if (cudaFree(q) != 0) ++failures;
      }
      cudaStreamDestroy(s);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(fakecuda_calls("cuMemAlloc_v2"), 0);
}

TEST_F(DynamicRuntime, ForkedChildNeverTouchesTheParentsPool) {
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 8192), kSuccess);
  fill(p, 8192, 77);
  // Another thread keeps allocating while we fork: the fork handlers must leave no lock held.
  std::atomic<bool> stop{false};
  std::thread busy([&] {
    cudaSetDevice(0);
    while (!stop) {
      void* q = nullptr;
      if (cudaMalloc(&q, 4096) == 0) cudaFree(q);
    }
  });
  for (int i = 0; i < 20; ++i) {
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      // Child: allocations pass through (the inherited pool is the parent's), frees of the
      // parent's pool pointers are not frees of the parent's memory.
      int rc = 0;
      void* c = nullptr;
      if (cudaMalloc(&c, 4096) != 0) rc |= 1;
      if (shim::owns(c) || shim::active()) rc |= 2;
      std::memset(c, 0xee, 4096);
      cudaFree(p);  // native error, and no effect on the parent
      _exit(rc);
    }
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0) << "child " << i;
  }
  stop = true;
  busy.join();
  EXPECT_TRUE(shim::owns(p));
  EXPECT_TRUE(check(p, 8192, 77));
  void* q = nullptr;
  ASSERT_EQ(cudaMalloc(&q, 8192), kSuccess);
  EXPECT_TRUE(shim::owns(q));
  EXPECT_EQ(cudaFree(q), kSuccess);
  EXPECT_EQ(cudaFree(p), kSuccess);
}

TEST_F(DynamicRuntime, PluggableAllocatorEntryPoints) {
  auto m = shim::lookup<void* (*)(ssize_t, int, CUstream_st*)>("gpustitch_malloc");
  auto f = shim::lookup<void (*)(void*, ssize_t, int, CUstream_st*)>("gpustitch_free");
  ASSERT_NE(m, nullptr);
  ASSERT_NE(f, nullptr);
  CUstream_st* s = nullptr;
  ASSERT_EQ(cudaStreamCreate(&s), kSuccess);
  auto before = shim::stats(1);
  void* p = m(5 * MiB, 1, s);
  ASSERT_NE(p, nullptr);
  EXPECT_TRUE(shim::owns(p));
  fill(p, 5 * MiB, 3);
  EXPECT_TRUE(check(p, 5 * MiB, 3));
  EXPECT_EQ(shim::stats(1).allocs, before.allocs + 1);
  f(p, 5 * MiB, 1, s);
  EXPECT_FALSE(shim::owns(p));
  EXPECT_EQ(m(-1, 0, s), nullptr);
  EXPECT_EQ(m(4096 * MiB, 0, s), nullptr);  // larger than the device: NULL, not a crash
  EXPECT_EQ(cudaStreamDestroy(s), kSuccess);
}

}  // namespace

// With one visible device (ctest's preload_dynamic_runtime_one_device: FAKE_CUDA_DEVICES=1,
// sim_devices:1) the hooks know the device without asking the driver on every call: cache-hit
// allocations then cost no cuCtxGetDevice/cuStreamGetDevice, and are still served by the pool on
// device 0 with their bytes intact.
TEST_F(DynamicRuntime, OneDeviceAllocationsAskTheDriverNothing) {
  const char* devices = std::getenv("FAKE_CUDA_DEVICES");
  if (devices == nullptr || std::string(devices) != "1") GTEST_SKIP() << "needs one device";
  CUstream_st* stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), kSuccess);
  void* warm = nullptr;
  ASSERT_EQ(cudaMalloc(&warm, 4096), kSuccess);  // this thread's context is seen once
  ASSERT_EQ(cudaFree(warm), kSuccess);
  fakecuda_reset_calls();
  auto before = shim::stats(0);
  for (int i = 0; i < 10; ++i) {
    void* p = nullptr;
    void* q = nullptr;
    ASSERT_EQ(cudaMalloc(&p, 4096), kSuccess);
    ASSERT_EQ(cudaMallocAsync(&q, 8192, stream), kSuccess);
    EXPECT_TRUE(shim::owns(p));
    EXPECT_TRUE(shim::owns(q));
    fill(p, 4096, 3);
    fill(q, 8192, 5);
    EXPECT_TRUE(check(p, 4096, 3));
    EXPECT_TRUE(check(q, 8192, 5));
    ASSERT_EQ(cudaFree(p), kSuccess);
    ASSERT_EQ(cudaFreeAsync(q, stream), kSuccess);
  }
  EXPECT_EQ(shim::stats(0).allocs, before.allocs + 20);
  EXPECT_EQ(fakecuda_calls("cuCtxGetDevice"), 0);
  EXPECT_EQ(fakecuda_calls("cuStreamGetDevice"), 0);
  EXPECT_EQ(fakecuda_calls("cuMemAlloc_v2") + fakecuda_calls("cuMemAllocAsync"), 0);
}
