// Native CUDA allocation as replay policies, for `gpustitch replay --gpu`:
//   cuda-malloc        cuMemAlloc / cuMemFree (what cudaMalloc / cudaFree do)
//   cuda-malloc-async  cuMemAllocAsync / cuMemFreeAsync on one stream, from the device's default
//                      memory pool with its release threshold at the maximum (memory stays in
//                      the pool, as in a warm cudaMallocAsync program)
// The driver is loaded at run time (libcuda.so.1); without it the factories return null with the
// reason, so the CLI still loads and runs everywhere.
//
// Capacity. A real device cannot be made smaller, so the policies enforce `capacity` themselves:
// cuda-malloc fails an allocation when the bytes it holds plus the request (rounded to 2 MiB, the
// driver's granularity) would exceed it; cuda-malloc-async allocates, and gives the block back
// and reports out-of-memory when the pool's reserved memory then exceeds the capacity.
// Reserved: cuda-malloc the rounded bytes it holds; cuda-malloc-async the pool's
// CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT.
#include <cuda.h>
#include <dlfcn.h>

#include <unordered_map>

#include "policy.h"

namespace gpustitch::replay {

namespace {

struct Driver {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t);
  CUresult (*cuMemFree)(CUdeviceptr);
  CUresult (*cuMemAllocAsync)(CUdeviceptr*, size_t, CUstream);
  CUresult (*cuMemFreeAsync)(CUdeviceptr, CUstream);
  CUresult (*cuStreamCreate)(CUstream*, unsigned);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuDeviceGetDefaultMemPool)(CUmemoryPool*, CUdevice);
  CUresult (*cuMemPoolGetAttribute)(CUmemoryPool, CUmemPool_attribute, void*);
  CUresult (*cuMemPoolSetAttribute)(CUmemoryPool, CUmemPool_attribute, void*);
  CUresult (*cuMemPoolTrimTo)(CUmemoryPool, size_t);
};

const Driver* load_driver(std::string* why) {
  static Driver driver;
  static std::string error = [] {
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) return std::string("libcuda.so.1 not found (no NVIDIA driver)");
    bool ok = true;
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
      if (fn == nullptr) ok = false;
    };
    sym(driver.cuInit, "cuInit");
    sym(driver.cuDeviceGet, "cuDeviceGet");
    sym(driver.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    sym(driver.cuCtxSetCurrent, "cuCtxSetCurrent");
    sym(driver.cuMemAlloc, "cuMemAlloc_v2");
    sym(driver.cuMemFree, "cuMemFree_v2");
    sym(driver.cuMemAllocAsync, "cuMemAllocAsync");
    sym(driver.cuMemFreeAsync, "cuMemFreeAsync");
    sym(driver.cuStreamCreate, "cuStreamCreate");
    sym(driver.cuStreamSynchronize, "cuStreamSynchronize");
    sym(driver.cuDeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool");
    sym(driver.cuMemPoolGetAttribute, "cuMemPoolGetAttribute");
    sym(driver.cuMemPoolSetAttribute, "cuMemPoolSetAttribute");
    sym(driver.cuMemPoolTrimTo, "cuMemPoolTrimTo");
    if (!ok) return std::string("libcuda.so.1 lacks a needed entry point");
    if (driver.cuInit(0) != CUDA_SUCCESS) return std::string("cuInit failed");
    return std::string();
  }();
  if (!error.empty()) {
    if (why) *why = error;
    return nullptr;
  }
  return &driver;
}

constexpr std::size_t kGranularity = 2 * MiB;

class NativePolicy final : public ReplayPolicy {
 public:
  NativePolicy(const Driver& d, bool async, const PolicyEnv& env)
      : d_(d), async_(async), capacity_(env.capacity) {}

  bool init(int devices, std::string* why) {
    for (int i = 0; i < devices; ++i) {
      Dev dev;
      CUdevice cu;
      if (d_.cuDeviceGet(&cu, i) != CUDA_SUCCESS ||
          d_.cuDevicePrimaryCtxRetain(&dev.ctx, cu) != CUDA_SUCCESS) {
        if (why) *why = "cannot open CUDA device " + std::to_string(i);
        return false;
      }
      d_.cuCtxSetCurrent(dev.ctx);
      if (async_) {
        if (d_.cuStreamCreate(&dev.stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
            d_.cuDeviceGetDefaultMemPool(&dev.pool, cu) != CUDA_SUCCESS) {
          if (why) *why = "no stream-ordered allocator on device " + std::to_string(i);
          return false;
        }
        cuuint64_t keep = ~cuuint64_t{0};
        d_.cuMemPoolSetAttribute(dev.pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep);
        d_.cuMemPoolTrimTo(dev.pool, 0);
      }
      devs_.push_back(dev);
    }
    return true;
  }

  ~NativePolicy() override {
    for (std::size_t i = 0; i < devs_.size(); ++i) {
      Dev& dev = devs_[i];
      d_.cuCtxSetCurrent(dev.ctx);
      for (auto& [ptr, size] : dev.live) {
        if (async_) {
          d_.cuMemFreeAsync(ptr, dev.stream);
        } else {
          d_.cuMemFree(ptr);
        }
      }
      if (async_) {
        d_.cuStreamSynchronize(dev.stream);
        d_.cuMemPoolTrimTo(dev.pool, 0);
      }
    }
  }

  std::string name() const override { return async_ ? "cuda-malloc-async" : "cuda-malloc"; }

  bool allocate(int device, std::size_t size, Stream, std::uint64_t* handle) override {
    if (device < 0 || device >= static_cast<int>(devs_.size())) return false;
    Dev& dev = devs_[static_cast<std::size_t>(device)];
    d_.cuCtxSetCurrent(dev.ctx);
    std::size_t rounded = align_up(size ? size : 1, kGranularity);
    CUdeviceptr p = 0;
    if (!async_) {
      if (dev.held + rounded > capacity_) return false;
      if (d_.cuMemAlloc(&p, size ? size : 1) != CUDA_SUCCESS) return false;
      dev.held += rounded;
    } else {
      if (d_.cuMemAllocAsync(&p, size ? size : 1, dev.stream) != CUDA_SUCCESS) return false;
      if (reserved(device) > capacity_) {
        d_.cuMemFreeAsync(p, dev.stream);
        d_.cuStreamSynchronize(dev.stream);
        d_.cuMemPoolTrimTo(dev.pool, 0);  // what the driver does before failing an allocation
        if (d_.cuMemAllocAsync(&p, size ? size : 1, dev.stream) != CUDA_SUCCESS) return false;
        if (reserved(device) > capacity_) {
          d_.cuMemFreeAsync(p, dev.stream);
          return false;
        }
      }
    }
    dev.live[p] = rounded;
    *handle = p;
    return true;
  }

  void deallocate(int device, std::uint64_t handle, std::size_t, Stream) override {
    Dev& dev = devs_[static_cast<std::size_t>(device)];
    auto it = dev.live.find(handle);
    if (it == dev.live.end()) return;
    d_.cuCtxSetCurrent(dev.ctx);
    if (async_) {
      d_.cuMemFreeAsync(handle, dev.stream);
    } else {
      d_.cuMemFree(handle);
      dev.held -= it->second;
    }
    dev.live.erase(it);
  }

  std::uint64_t reserved(int device) const override {
    const Dev& dev = devs_[static_cast<std::size_t>(device)];
    if (!async_) return dev.held;
    cuuint64_t r = 0;
    d_.cuMemPoolGetAttribute(dev.pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &r);
    return r;
  }

 private:
  struct Dev {
    CUcontext ctx = nullptr;
    CUstream stream = nullptr;
    CUmemoryPool pool = nullptr;
    std::uint64_t held = 0;
    std::unordered_map<std::uint64_t, std::size_t> live;
  };
  const Driver& d_;
  bool async_;
  std::size_t capacity_;
  std::vector<Dev> devs_;
};

std::unique_ptr<ReplayPolicy> make_native(const PolicyEnv& env, bool async, std::string* why) {
  if (!env.gpu) {
    if (why) *why = "native CUDA policies replay on the GPU only (--gpu)";
    return nullptr;
  }
  const Driver* d = load_driver(why);
  if (d == nullptr) return nullptr;
  auto p = std::make_unique<NativePolicy>(*d, async, env);
  if (!p->init(env.devices, why)) return nullptr;
  return p;
}

PolicyRegistrar reg_malloc{
    "cuda-malloc", "native cuMemAlloc/cuMemFree (needs --gpu)", false,
    [](const PolicyEnv& env, std::string* why) { return make_native(env, false, why); }};
PolicyRegistrar reg_async{
    "cuda-malloc-async", "native cuMemAllocAsync/cuMemFreeAsync, default pool (needs --gpu)", false,
    [](const PolicyEnv& env, std::string* why) { return make_native(env, true, why); }};

}  // namespace

}  // namespace gpustitch::replay
