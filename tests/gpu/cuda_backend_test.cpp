// The CUDA backend on a real GPU: every operation the pool relies on, checked by bytes read back
// through the driver, plus the error codes a caller sees and the context-stack promise (the
// backend never leaves the calling thread with a different current context). GPU only: ctest
// label "gpu".
#include <cuda.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "gpustitch/cuda_backend.h"
#include "test_device.h"

using gpustitch::DevPtr;
using gpustitch::GiB;
using gpustitch::MiB;
using gpustitch::PhysHandle;
using gpustitch::Status;

namespace {

// The calling thread's current context, read straight from the driver.
CUcontext current_context() {
  static auto get_current = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    return lib ? reinterpret_cast<decltype(&::cuCtxGetCurrent)>(dlsym(lib, "cuCtxGetCurrent"))
               : nullptr;
  }();
  CUcontext ctx = reinterpret_cast<CUcontext>(0x1);  // sentinel: "could not ask"
  if (get_current != nullptr) get_current(&ctx);
  return ctx;
}

std::vector<unsigned char> pattern(std::size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  unsigned x = seed * 2654435761u + 1;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = static_cast<unsigned char>(x);
  }
  return v;
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("GPUSTITCH_TEST_BACKEND", "cuda", 1);
    device_ = make_test_device();
    be_ = device_.backend.get();
    ASSERT_NE(be_, nullptr);
    g_ = be_->granularity(0);
    ASSERT_GT(g_, 0u);
  }

  // A range of n granules, mapped from one handle and accessible from device 0.
  struct Mapping {
    DevPtr va = 0;
    std::size_t size = 0;
    PhysHandle handle = 0;
  };
  Mapping map_fresh(std::size_t size) {
    Mapping m;
    m.size = size;
    EXPECT_EQ(be_->reserve(0, size, &m.va), Status::ok);
    EXPECT_EQ(be_->create(0, size, &m.handle), Status::ok);
    EXPECT_EQ(be_->map(m.va, size, m.handle, 0), Status::ok);
    const int dev0[] = {0};
    EXPECT_EQ(be_->set_access(m.va, size, dev0), Status::ok);
    return m;
  }
  void unmap_all(const Mapping& m) {
    EXPECT_EQ(be_->unmap(m.va, m.size), Status::ok);
    EXPECT_EQ(be_->release(m.handle), Status::ok);
    EXPECT_EQ(be_->unreserve(m.va, m.size), Status::ok);
  }

  TestDevice device_;
  gpustitch::Backend* be_ = nullptr;
  std::size_t g_ = 0;
};

TEST_F(CudaBackendTest, ReportsDevicesAndGranularity) {
  EXPECT_STREQ(be_->name(), "cuda");
  ASSERT_GE(be_->device_count(), 1);
  for (int d = 0; d < be_->device_count(); ++d) {
    const std::size_t g = be_->granularity(d);
    EXPECT_GT(g, 0u);
    EXPECT_EQ(g & (g - 1), 0u) << "granularity is a power of two";
    std::printf("device %d: granularity %zu KiB, map at non-zero offset: %s\n", d, g / 1024,
                be_->supports_map_offset(d) ? "supported" : "NOT supported");
  }
  ::testing::Test::RecordProperty("map_offset", be_->supports_map_offset(0) ? "yes" : "no");
  EXPECT_EQ(be_->granularity(be_->device_count()), 0u);
  EXPECT_FALSE(be_->supports_map_offset(-1));
}

TEST_F(CudaBackendTest, RoundTripBytesReadBack) {
  const std::size_t size = 4 * g_;
  Mapping m = map_fresh(size);
  const auto in = pattern(size, 1);
  device_.write(m.va, in.data(), size);
  std::vector<unsigned char> out(size);
  device_.read(m.va, out.data(), size);
  EXPECT_EQ(in, out);
  unmap_all(m);
}

TEST_F(CudaBackendTest, StitchedRangeAliasesItsPieces) {
  // Two handles mapped side by side into one range; a write across the seam lands in both, and a
  // second view of the first handle sees the same bytes.
  DevPtr range = 0;
  ASSERT_EQ(be_->reserve(0, 2 * g_, &range), Status::ok);
  PhysHandle a = 0, b = 0;
  ASSERT_EQ(be_->create(0, g_, &a), Status::ok);
  ASSERT_EQ(be_->create(0, g_, &b), Status::ok);
  ASSERT_EQ(be_->map(range, g_, a, 0), Status::ok);
  ASSERT_EQ(be_->map(range + g_, g_, b, 0), Status::ok);
  const int dev0[] = {0};
  ASSERT_EQ(be_->set_access(range, 2 * g_, dev0), Status::ok);

  const std::size_t seam = 64 * 1024;
  const auto in = pattern(2 * seam, 2);
  device_.write(range + g_ - seam, in.data(), in.size());
  std::vector<unsigned char> out(in.size());
  device_.read(range + g_ - seam, out.data(), out.size());
  EXPECT_EQ(in, out);

  DevPtr view = 0;
  ASSERT_EQ(be_->reserve(0, g_, &view), Status::ok);
  ASSERT_EQ(be_->map(view, g_, a, 0), Status::ok);
  ASSERT_EQ(be_->set_access(view, g_, dev0), Status::ok);
  std::vector<unsigned char> tail(seam);
  device_.read(view + g_ - seam, tail.data(), seam);
  EXPECT_TRUE(std::equal(tail.begin(), tail.end(), in.begin()));

  EXPECT_EQ(be_->unmap(view, g_), Status::ok);
  EXPECT_EQ(be_->unreserve(view, g_), Status::ok);
  EXPECT_EQ(be_->unmap(range, g_), Status::ok);
  EXPECT_EQ(be_->unmap(range + g_, g_), Status::ok);
  EXPECT_EQ(be_->release(a), Status::ok);
  EXPECT_EQ(be_->release(b), Status::ok);
  EXPECT_EQ(be_->unreserve(range, 2 * g_), Status::ok);
}

TEST_F(CudaBackendTest, MapAtOffsetMatchesProbe) {
  PhysHandle h = 0;
  ASSERT_EQ(be_->create(0, 2 * g_, &h), Status::ok);
  DevPtr whole = 0, second = 0;
  ASSERT_EQ(be_->reserve(0, 2 * g_, &whole), Status::ok);
  ASSERT_EQ(be_->reserve(0, g_, &second), Status::ok);
  ASSERT_EQ(be_->map(whole, 2 * g_, h, 0), Status::ok);
  const int dev0[] = {0};
  ASSERT_EQ(be_->set_access(whole, 2 * g_, dev0), Status::ok);
  const Status st = be_->map(second, g_, h, g_);
  std::printf("cuMemMap at offset %zu KiB: %s (probe said %s)\n", g_ / 1024,
              gpustitch::to_string(st), be_->supports_map_offset(0) ? "supported" : "unsupported");
  EXPECT_EQ(st == Status::ok, be_->supports_map_offset(0));
  if (st == Status::ok) {
    ASSERT_EQ(be_->set_access(second, g_, dev0), Status::ok);
    const auto in = pattern(g_, 3);
    device_.write(whole + g_, in.data(), g_);
    std::vector<unsigned char> out(g_);
    device_.read(second, out.data(), g_);
    EXPECT_EQ(in, out) << "the offset view shows the handle's second granule";
    EXPECT_EQ(be_->unmap(second, g_), Status::ok);
  }
  EXPECT_EQ(be_->unmap(whole, 2 * g_), Status::ok);
  EXPECT_EQ(be_->release(h), Status::ok);
  EXPECT_EQ(be_->unreserve(whole, 2 * g_), Status::ok);
  EXPECT_EQ(be_->unreserve(second, g_), Status::ok);
}

TEST_F(CudaBackendTest, AbsurdCreateIsOutOfMemory) {
  std::size_t free = 0, total = 0;
  ASSERT_EQ(be_->mem_info(0, &free, &total), Status::ok);
  PhysHandle h = 0;
  const std::size_t absurd = gpustitch::align_up(4 * total, g_);
  const Status st = be_->create(0, absurd, &h);
  EXPECT_EQ(st, Status::out_of_memory) << gpustitch::to_string(st);
  if (st == Status::ok) be_->release(h);
}

TEST_F(CudaBackendTest, MemInfoSeesCreatedMemory) {
  std::size_t free0 = 0, total = 0, free1 = 0, free2 = 0;
  ASSERT_EQ(be_->mem_info(0, &free0, &total), Status::ok);
  EXPECT_GT(total, 0u);
  EXPECT_LE(free0, total);
  PhysHandle h = 0;
  ASSERT_EQ(be_->create(0, 1 * GiB, &h), Status::ok);
  ASSERT_EQ(be_->mem_info(0, &free1, &total), Status::ok);
  EXPECT_LE(free1 + 1 * GiB, free0 + 64 * MiB) << "a 1 GiB handle shows in the driver's free";
  ASSERT_EQ(be_->release(h), Status::ok);
  ASSERT_EQ(be_->mem_info(0, &free2, &total), Status::ok);
  EXPECT_GE(free2 + 64 * MiB, free0) << "released memory comes back";
}

TEST_F(CudaBackendTest, LeavesTheCallersContextAlone) {
  const CUcontext before = current_context();
  ASSERT_NE(before, reinterpret_cast<CUcontext>(0x1));
  std::size_t free = 0, total = 0;
  EXPECT_EQ(be_->mem_info(0, &free, &total), Status::ok);
  EXPECT_EQ(current_context(), before);
  EXPECT_EQ(be_->synchronize(0), Status::ok);
  EXPECT_EQ(current_context(), before);
  Mapping m = map_fresh(g_);
  EXPECT_EQ(current_context(), before);
  unmap_all(m);
  EXPECT_EQ(current_context(), before);
}

TEST_F(CudaBackendTest, BadArgumentsGiveStatusCodes) {
  DevPtr p = 0;
  PhysHandle h = 0;
  std::size_t free = 0, total = 0;
  const int n = be_->device_count();
  EXPECT_EQ(be_->reserve(n, g_, &p), Status::invalid_device);
  EXPECT_EQ(be_->create(-1, g_, &h), Status::invalid_device);
  EXPECT_EQ(be_->mem_info(n, &free, &total), Status::invalid_device);
  EXPECT_EQ(be_->synchronize(n), Status::invalid_device);
  const int bad[] = {n};
  EXPECT_EQ(be_->set_access(0, g_, bad), Status::invalid_device);
  EXPECT_NE(be_->create(0, g_ / 2, &h), Status::ok) << "size not a multiple of the granularity";
  EXPECT_NE(be_->unmap(0x1000, g_), Status::ok) << "nothing mapped there";
}

}  // namespace
