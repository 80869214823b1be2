// make_test_device(): picks the backend the core's tests run on and the way they move bytes.
//
// Simulated backend: device addresses are host addresses of memfd mappings, so write/read are a
// memcpy through the pointer. CUDA backend: write/read use the driver's cuMemcpyHtoD/cuMemcpyDtoH,
// resolved at run time exactly as the backend resolves its own entry points (dlopen libcuda.so.1,
// cuGetProcAddress_v2 at the toolkit's CUDA_VERSION), with device 0's primary context pushed for
// the copy; with unified addressing a copy needs some context, not the one owning the memory.
// A test that asked for the GPU and cannot get it stops with a message rather than passing on sim.
#include <cuda.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>

#include "gpustitch/cuda_backend.h"
#include "test_device.h"

namespace {

[[noreturn]] void die(const char* what, const char* detail) {
  std::fprintf(stderr, "test device: %s: %s\n", what, detail);
  std::abort();
}

// The driver functions the copies need, with device 0's primary context retained.
class DriverCopier {
 public:
  DriverCopier() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) die("GPUSTITCH_TEST_BACKEND=cuda", "libcuda.so.1 not found");
    using GetProc =
        CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
    auto get_proc = reinterpret_cast<GetProc>(dlsym(lib, "cuGetProcAddress_v2"));
    if (get_proc == nullptr) die("GPUSTITCH_TEST_BACKEND=cuda", "no cuGetProcAddress_v2");
    auto resolve = [&](const char* name, auto& fn) {
      void* p = nullptr;
      CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
      if (get_proc(name, &p, CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &found) != CUDA_SUCCESS ||
          found != CU_GET_PROC_ADDRESS_SUCCESS || p == nullptr) {
        die("driver entry point missing", name);
      }
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
    resolve("cuInit", init_);
    resolve("cuDeviceGet", device_get_);
    resolve("cuDevicePrimaryCtxRetain", retain_);
    resolve("cuDevicePrimaryCtxRelease", release_);
    resolve("cuCtxPushCurrent", push_);
    resolve("cuCtxPopCurrent", pop_);
    resolve("cuMemcpyHtoD", htod_);
    resolve("cuMemcpyDtoH", dtoh_);
    check(init_(0), "cuInit");
    check(device_get_(&device_, 0), "cuDeviceGet");
    check(retain_(&context_, device_), "cuDevicePrimaryCtxRetain");
  }
  ~DriverCopier() { release_(device_); }
  DriverCopier(const DriverCopier&) = delete;
  DriverCopier& operator=(const DriverCopier&) = delete;

  void write(gpustitch::DevPtr dst, const void* src, std::size_t n) {
    check(push_(context_), "cuCtxPushCurrent");
    const CUresult r = htod_(static_cast<CUdeviceptr>(dst), src, n);
    CUcontext popped = nullptr;
    pop_(&popped);
    check(r, "cuMemcpyHtoD");
  }
  void read(gpustitch::DevPtr src, void* dst, std::size_t n) {
    check(push_(context_), "cuCtxPushCurrent");
    const CUresult r = dtoh_(dst, static_cast<CUdeviceptr>(src), n);
    CUcontext popped = nullptr;
    pop_(&popped);
    check(r, "cuMemcpyDtoH");
  }

 private:
  static void check(CUresult r, const char* call) {
    if (r != CUDA_SUCCESS) {
      const std::string text = "CUresult " + std::to_string(static_cast<int>(r));
      die(call, text.c_str());
    }
  }

  decltype(&::cuInit) init_ = nullptr;
  decltype(&::cuDeviceGet) device_get_ = nullptr;
  decltype(&::cuDevicePrimaryCtxRetain) retain_ = nullptr;
  decltype(&::cuDevicePrimaryCtxRelease) release_ = nullptr;
  decltype(&::cuCtxPushCurrent) push_ = nullptr;
  decltype(&::cuCtxPopCurrent) pop_ = nullptr;
  decltype(&::cuMemcpyHtoD) htod_ = nullptr;
  decltype(&::cuMemcpyDtoH) dtoh_ = nullptr;
  CUdevice device_ = 0;
  CUcontext context_ = nullptr;
};

bool cuda_requested() {
  const char* v = std::getenv("GPUSTITCH_TEST_BACKEND");
  return v != nullptr && std::strcmp(v, "cuda") == 0;
}

}  // namespace

TestDevice make_test_device(const gpustitch::SimOptions& sim_options) {
  TestDevice device;
  if (cuda_requested()) {
    std::string why;
    device.backend = gpustitch::make_cuda_backend(&why);
    if (!device.backend) die("GPUSTITCH_TEST_BACKEND=cuda", why.c_str());
    auto copier = std::make_shared<DriverCopier>();
    device.write = [copier](gpustitch::DevPtr dst, const void* src, std::size_t n) {
      copier->write(dst, src, n);
    };
    device.read = [copier](gpustitch::DevPtr src, void* dst, std::size_t n) {
      copier->read(src, dst, n);
    };
    return device;
  }
  auto sim = std::make_unique<gpustitch::SimBackend>(sim_options);
  device.sim = sim.get();
  device.backend = std::move(sim);
  device.write = [](gpustitch::DevPtr dst, const void* src, std::size_t n) {
    std::memcpy(reinterpret_cast<void*>(dst), src, n);
  };
  device.read = [](gpustitch::DevPtr src, void* dst, std::size_t n) {
    std::memcpy(dst, reinterpret_cast<const void*>(src), n);
  };
  return device;
}
