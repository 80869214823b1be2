// The CUDA driver backend: the pool's virtual-memory operations on a real GPU.
//
// Loading. Nothing links libcuda: the backend dlopens "libcuda.so.1" (RTLD_NOW|RTLD_LOCAL, so the
// driver's symbols never enter the global namespace of a host process), takes cuGetProcAddress_v2
// with dlsym and resolves every other entry point through it, asking for the toolkit's
// CUDA_VERSION with CU_GET_PROC_ADDRESS_DEFAULT. Names are the base names cuGetProcAddress takes
// ("cuMemGetInfo", not "cuMemGetInfo_v2"): the version argument picks the ABI the headers we
// compiled against describe. A caller-supplied DriverResolver replaces both steps and receives the
// same base names; the preload shim passes one that reaches the real driver behind its own hooks,
// so the pool's driver calls are never intercepted by the shim itself. The library handle is never
// dlclose'd: the driver does not support being unloaded while a process uses it.
//
// Contexts. Virtual memory management acts on the process-wide unified address space, so reserve,
// create, map, set-access, unmap and release need only *some* context current on the calling
// thread. When the thread has none (a fresh worker thread of the host program), the device's
// primary context is pushed for the call and popped after. mem_info (cuMemGetInfo) and
// synchronize (cuCtxSynchronize) are about one device, so they always run with that device's
// primary context pushed. In every case the caller's thread leaves with the context stack it came
// with. The primary contexts are retained for the backend's lifetime: it is the context the CUDA
// runtime uses, so synchronizing it fences the work of every runtime-based caller.
//
// Physical memory. Each handle is CU_MEM_ALLOCATION_TYPE_PINNED on the device. When the device
// supports it, and the caller did not say otherwise (make_cuda_backend's shareable: ipc:native),
// the handle is created exportable as a POSIX file descriptor (so that CUDA IPC on pool memory can
// share it with cuMemExportToShareableHandle) and GPUDirect-RDMA capable (so NICs can
// register pool memory like cudaMalloc memory). If the driver rejects those optional properties
// at probe time they are dropped rather than failing every allocation; handles created without the
// file-descriptor type are not exportable (export_handle: not_supported), so CUDA IPC on pool
// memory then fails with the error the shim reports. What asking for the type costs per cuMemCreate
// is measured by tools/gpu/vmm_probe (its "POSIX fd handle type" rows against "no shareable
// type"; see docs/preload.md, "CUDA IPC on pool memory").
//
// Map offsets. Whether cuMemMap accepts a non-zero offset into a handle decides whether the pool
// can stitch free slices of a partly used big handle or only whole free handles. Older driver docs
// (and HIP) require offset 0, current ones allow a granularity-aligned offset. We do not trust
// either: at start-up each device is probed once by creating a two-granule handle and mapping its
// second granule; the answer is kept for supports_map_offset().
//
// Thread safety. After construction everything the backend holds (entry points, per-device
// properties) is immutable; each method only calls the driver, which is itself thread-safe. No
// method throws: every driver failure becomes a gpustitch::Status.
#include "gpustitch/cuda_backend.h"

#include <cuda.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <new>
#include <vector>

namespace gpustitch {
namespace {

// Entry points, declared with the types cuda.h gives the names (cuMemGetInfo is the _v2 ABI, as
// its macro says), and looked up by the base name, which cuGetProcAddress maps to that ABI.
#define GPUSTITCH_DRIVER_ENTRY_POINTS(X) \
  X(cuInit)                              \
  X(cuDriverGetVersion)                  \
  X(cuDeviceGetCount)                    \
  X(cuDeviceGet)                         \
  X(cuDeviceGetAttribute)                \
  X(cuDevicePrimaryCtxRetain)            \
  X(cuDevicePrimaryCtxRelease)           \
  X(cuCtxGetCurrent)                     \
  X(cuCtxPushCurrent)                    \
  X(cuCtxPopCurrent)                     \
  X(cuCtxSynchronize)                    \
  X(cuMemGetInfo)                        \
  X(cuMemGetAllocationGranularity)       \
  X(cuMemAddressReserve)                 \
  X(cuMemAddressFree)                    \
  X(cuMemCreate)                         \
  X(cuMemRelease)                        \
  X(cuMemMap)                            \
  X(cuMemUnmap)                          \
  X(cuMemSetAccess)

struct Driver {
#define GPUSTITCH_DECLARE(name) decltype(&::name) name = nullptr;
  GPUSTITCH_DRIVER_ENTRY_POINTS(GPUSTITCH_DECLARE)
#undef GPUSTITCH_DECLARE
  // Optional: without it, calls behave as the driver's default capture mode says.
  decltype(&::cuThreadExchangeStreamCaptureMode) cuThreadExchangeStreamCaptureMode = nullptr;
  // Optional: without it, device_uuid() reports not_supported.
  decltype(&::cuDeviceGetUuid) cuDeviceGetUuid = nullptr;
  // Optional: without them, export_handle() and import_handle() report not_supported.
  decltype(&::cuMemExportToShareableHandle) cuMemExportToShareableHandle = nullptr;
  decltype(&::cuMemImportFromShareableHandle) cuMemImportFromShareableHandle = nullptr;
  // Optional: without them, the event calls report not_supported (the pool fences instead).
  decltype(&::cuEventCreate) cuEventCreate = nullptr;
  decltype(&::cuEventDestroy) cuEventDestroy = nullptr;
  decltype(&::cuEventRecord) cuEventRecord = nullptr;
  decltype(&::cuEventQuery) cuEventQuery = nullptr;
};

// While another thread captures a CUDA graph in the global capture mode, "unsafe" calls from any
// thread (cuMemCreate, cuCtxSynchronize, ...) would invalidate that capture. The pool's calls are
// unrelated to the captured streams, so each backend call runs in the relaxed mode for its
// thread, and the thread's previous mode is restored afterwards.
class RelaxedCapture {
 public:
  explicit RelaxedCapture(const Driver& d) noexcept : d_(d) {
    if (d_.cuThreadExchangeStreamCaptureMode != nullptr) {
      mode_ = CU_STREAM_CAPTURE_MODE_RELAXED;
      active_ = d_.cuThreadExchangeStreamCaptureMode(&mode_) == CUDA_SUCCESS;
    }
  }
  ~RelaxedCapture() {
    if (active_) d_.cuThreadExchangeStreamCaptureMode(&mode_);
  }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  const Driver& d_;
  CUstreamCaptureMode mode_ = CU_STREAM_CAPTURE_MODE_RELAXED;
  bool active_ = false;
};

// CUDA 13 changed cuCtxSynchronize's ABI: asked for at version 13000, cuGetProcAddress returns
// the variant that takes the context to synchronise (cuCtxSynchronize_v2), while cuda.h declares
// the old one without arguments. Calling it with the context is right for both: the old ABI
// ignores an extra argument register, the new one needs it.
using CtxSynchronizeFn = CUresult (*)(CUcontext);

// cuGetProcAddress_v2's signature (CUDA 12.0 and later).
using GetProcAddressFn = CUresult (*)(const char*, void**, int, cuuint64_t,
                                      CUdriverProcAddressQueryResult*);

Status to_status(CUresult r) noexcept {
  switch (r) {
    case CUDA_SUCCESS:
      return Status::ok;
    case CUDA_ERROR_OUT_OF_MEMORY:
      return Status::out_of_memory;
    case CUDA_ERROR_INVALID_VALUE:
      return Status::invalid_value;
    case CUDA_ERROR_INVALID_DEVICE:
      return Status::invalid_device;
    case CUDA_ERROR_NOT_SUPPORTED:
      return Status::not_supported;
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_DEINITIALIZED:
    case CUDA_ERROR_STUB_LIBRARY:
      return Status::not_initialized;
    default:
      return Status::error;
  }
}

void set_why(std::string* why, const char* text) {
  if (why == nullptr) return;
  try {
    *why = text;
  } catch (...) {
  }
}

struct DeviceInfo {
  CUdevice device = 0;
  CUcontext primary = nullptr;
  std::size_t granularity = 0;
  CUmemAllocationProp prop{};  // what create() passes to cuMemCreate
  bool map_offset = false;
  bool has_uuid = false;
  DeviceUuid uuid{};
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(const Driver& driver, std::vector<DeviceInfo> devices)
      : driver_(driver), devices_(std::move(devices)) {}

  ~CudaBackend() override {
    for (const DeviceInfo& d : devices_) {
      if (d.primary != nullptr) driver_.cuDevicePrimaryCtxRelease(d.device);
    }
  }

  const char* name() const noexcept override { return "cuda"; }
  int device_count() noexcept override { return static_cast<int>(devices_.size()); }

  std::size_t granularity(int device) noexcept override {
    return valid(device) ? devices_[device].granularity : 0;
  }

  bool supports_map_offset(int device) noexcept override {
    return valid(device) && devices_[device].map_offset;
  }

  // The properties settle_allocation_properties left in prop, which create() passes for every
  // handle: the process's own driver handles.
  Status handle_properties(int device, HandleProperties* out) noexcept override {
    if (!valid(device)) return Status::invalid_device;
    if (out == nullptr) return Status::invalid_value;
    const CUmemAllocationProp& p = devices_[device].prop;
    out->driver_handles = true;
    out->handle_types = static_cast<unsigned>(p.requestedHandleTypes);
    out->rdma_capable = p.allocFlags.gpuDirectRDMACapable != 0;
    out->compression = p.allocFlags.compressionType;
    return Status::ok;
  }

  Status device_uuid(int device, DeviceUuid* out) noexcept override {
    if (!valid(device)) return Status::invalid_device;
    if (out == nullptr) return Status::invalid_value;
    if (!devices_[device].has_uuid) return Status::not_supported;
    *out = devices_[device].uuid;
    return Status::ok;
  }

  Status mem_info(int device, std::size_t* free, std::size_t* total) noexcept override {
    if (!valid(device)) return Status::invalid_device;
    if (free == nullptr || total == nullptr) return Status::invalid_value;
    PushedContext pushed(driver_, devices_[device].primary);
    if (!pushed.ok()) return to_status(pushed.result());
    return to_status(driver_.cuMemGetInfo(free, total));
  }

  Status reserve(int device, std::size_t size, DevPtr* out) noexcept override {
    if (!valid(device)) return Status::invalid_device;
    if (out == nullptr || size == 0) return Status::invalid_value;
    ContextIfNone guard(driver_, devices_[device].primary);
    CUdeviceptr ptr = 0;
    const CUresult r = driver_.cuMemAddressReserve(&ptr, size, devices_[device].granularity, 0, 0);
    if (r != CUDA_SUCCESS) return to_status(r);
    *out = static_cast<DevPtr>(ptr);
    return Status::ok;
  }

  Status unreserve(DevPtr ptr, std::size_t size) noexcept override {
    ContextIfNone guard(driver_, any_primary());
    return to_status(driver_.cuMemAddressFree(static_cast<CUdeviceptr>(ptr), size));
  }

  Status create(int device, std::size_t size, PhysHandle* out) noexcept override {
    if (!valid(device)) return Status::invalid_device;
    if (out == nullptr || size == 0) return Status::invalid_value;
    ContextIfNone guard(driver_, devices_[device].primary);
    CUmemGenericAllocationHandle handle = 0;
    const CUresult r = driver_.cuMemCreate(&handle, size, &devices_[device].prop, 0);
    if (r != CUDA_SUCCESS) return to_status(r);
    *out = static_cast<PhysHandle>(handle);
    return Status::ok;
  }

  Status release(PhysHandle handle) noexcept override {
    ContextIfNone guard(driver_, any_primary());
    return to_status(driver_.cuMemRelease(static_cast<CUmemGenericAllocationHandle>(handle)));
  }

  // Handles are exportable only when every device's handles were created with the POSIX file
  // descriptor type (settle_allocation_properties drops it where the driver refuses it); a handle
  // does not say which device it is on.
  Status export_handle(PhysHandle handle, int* fd) noexcept override {
    if (fd == nullptr) return Status::invalid_value;
    if (driver_.cuMemExportToShareableHandle == nullptr || !exportable()) {
      return Status::not_supported;
    }
    ContextIfNone guard(driver_, any_primary());
    int out = -1;
    const CUresult r = driver_.cuMemExportToShareableHandle(
        &out, static_cast<CUmemGenericAllocationHandle>(handle),
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (r != CUDA_SUCCESS) return to_status(r);
    *fd = out;
    return Status::ok;
  }

  Status import_handle(int device, int fd, std::size_t size, PhysHandle* out) noexcept override {
    (void)size;  // the driver knows the size from the handle
    if (!valid(device)) return Status::invalid_device;
    if (out == nullptr || fd < 0) return Status::invalid_value;
    if (driver_.cuMemImportFromShareableHandle == nullptr) return Status::not_supported;
    ContextIfNone guard(driver_, devices_[device].primary);
    CUmemGenericAllocationHandle handle = 0;
    const CUresult r = driver_.cuMemImportFromShareableHandle(
        &handle, reinterpret_cast<void*>(static_cast<std::intptr_t>(fd)),
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != CUDA_SUCCESS) return to_status(r);
    *out = static_cast<PhysHandle>(handle);
    return Status::ok;
  }

  Status map(DevPtr ptr, std::size_t size, PhysHandle handle,
             std::size_t offset) noexcept override {
    ContextIfNone guard(driver_, any_primary());
    return to_status(driver_.cuMemMap(static_cast<CUdeviceptr>(ptr), size, offset,
                                      static_cast<CUmemGenericAllocationHandle>(handle), 0));
  }

  Status unmap(DevPtr ptr, std::size_t size) noexcept override {
    ContextIfNone guard(driver_, any_primary());
    return to_status(driver_.cuMemUnmap(static_cast<CUdeviceptr>(ptr), size));
  }

  Status set_access(DevPtr ptr, std::size_t size, std::span<const int> devices) noexcept override {
    if (devices.empty()) return Status::invalid_value;
    // One descriptor per device; a small fixed buffer keeps the call allocation-free.
    constexpr std::size_t kInline = 16;
    CUmemAccessDesc inline_descs[kInline];
    std::unique_ptr<CUmemAccessDesc[]> heap_descs;
    CUmemAccessDesc* descs = inline_descs;
    if (devices.size() > kInline) {
      heap_descs.reset(new (std::nothrow) CUmemAccessDesc[devices.size()]);
      if (!heap_descs) return Status::out_of_memory;
      descs = heap_descs.get();
    }
    for (std::size_t i = 0; i < devices.size(); ++i) {
      if (!valid(devices[i])) return Status::invalid_device;
      descs[i] = CUmemAccessDesc{};
      descs[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      descs[i].location.id = devices_[devices[i]].device;
      descs[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    }
    ContextIfNone guard(driver_, devices_[devices[0]].primary);
    return to_status(
        driver_.cuMemSetAccess(static_cast<CUdeviceptr>(ptr), size, descs, devices.size()));
  }

  Status synchronize(int device) noexcept override {
    if (!valid(device)) return Status::invalid_device;
    PushedContext pushed(driver_, devices_[device].primary);
    if (!pushed.ok()) return to_status(pushed.result());
    auto sync =
        reinterpret_cast<CtxSynchronizeFn>(reinterpret_cast<void*>(driver_.cuCtxSynchronize));
    return to_status(sync(devices_[device].primary));
  }

  // Events are created in the device's primary context (the runtime's, whose streams a program's
  // stream-ordered frees name), without timing (a record then costs no timestamp). A record on a
  // stream of another context fails, and the pool fences instead.
  Status create_event(int device, Event* out) noexcept override {
    if (!valid(device)) return Status::invalid_device;
    if (driver_.cuEventCreate == nullptr || driver_.cuEventDestroy == nullptr ||
        driver_.cuEventRecord == nullptr || driver_.cuEventQuery == nullptr) {
      return Status::not_supported;
    }
    PushedContext pushed(driver_, devices_[device].primary);
    if (!pushed.ok()) return to_status(pushed.result());
    CUevent event = nullptr;
    const CUresult r = driver_.cuEventCreate(&event, CU_EVENT_DISABLE_TIMING);
    if (r != CUDA_SUCCESS) return to_status(r);
    *out = reinterpret_cast<Event>(event);
    return Status::ok;
  }

  Status destroy_event(Event event) noexcept override {
    if (driver_.cuEventDestroy == nullptr) return Status::not_supported;
    RelaxedCapture relaxed(driver_);
    return to_status(driver_.cuEventDestroy(reinterpret_cast<CUevent>(event)));
  }

  Status record_event(int device, Event event, Stream stream) noexcept override {
    if (!valid(device)) return Status::invalid_device;
    if (driver_.cuEventRecord == nullptr) return Status::not_supported;
    // The shim's keys (types.h): a per-thread key is the calling thread's per-thread stream, 0
    // the legacy default stream; other values are the CUstream itself.
    CUstream s = is_per_thread_stream(stream) ? CU_STREAM_PER_THREAD
                 : stream == 0                ? CU_STREAM_LEGACY
                                              : reinterpret_cast<CUstream>(stream);
    // A thread that frees before any runtime call of its own has no current context: the
    // runtime's streams are the primary context's, where the event was created.
    ContextIfNone guard(driver_, devices_[device].primary);
    return to_status(driver_.cuEventRecord(reinterpret_cast<CUevent>(event), s));
  }

  Status query_event(Event event, bool* done) noexcept override {
    if (driver_.cuEventQuery == nullptr) return Status::not_supported;
    RelaxedCapture relaxed(driver_);
    const CUresult r = driver_.cuEventQuery(reinterpret_cast<CUevent>(event));
    *done = r == CUDA_SUCCESS;
    return r == CUDA_SUCCESS || r == CUDA_ERROR_NOT_READY ? Status::ok : to_status(r);
  }

 private:
  // Pushes ctx for the guard's lifetime.
  class PushedContext {
   public:
    PushedContext(const Driver& d, CUcontext ctx) noexcept : d_(d), relaxed_(d) {
      result_ = d_.cuCtxPushCurrent(ctx);
    }
    ~PushedContext() {
      if (result_ == CUDA_SUCCESS) {
        CUcontext popped = nullptr;
        d_.cuCtxPopCurrent(&popped);
      }
    }
    PushedContext(const PushedContext&) = delete;
    PushedContext& operator=(const PushedContext&) = delete;
    bool ok() const noexcept { return result_ == CUDA_SUCCESS; }
    CUresult result() const noexcept { return result_; }

   private:
    const Driver& d_;
    RelaxedCapture relaxed_;
    CUresult result_;
  };

  // Pushes ctx only when the calling thread has no current context.
  class ContextIfNone {
   public:
    ContextIfNone(const Driver& d, CUcontext ctx) noexcept : d_(d), relaxed_(d) {
      CUcontext current = nullptr;
      if (d_.cuCtxGetCurrent(&current) == CUDA_SUCCESS && current == nullptr && ctx != nullptr) {
        pushed_ = d_.cuCtxPushCurrent(ctx) == CUDA_SUCCESS;
      }
    }
    ~ContextIfNone() {
      if (pushed_) {
        CUcontext popped = nullptr;
        d_.cuCtxPopCurrent(&popped);
      }
    }
    ContextIfNone(const ContextIfNone&) = delete;
    ContextIfNone& operator=(const ContextIfNone&) = delete;

   private:
    const Driver& d_;
    RelaxedCapture relaxed_;
    bool pushed_ = false;
  };

  bool valid(int device) const noexcept {
    return device >= 0 && device < static_cast<int>(devices_.size());
  }
  CUcontext any_primary() const noexcept {
    return devices_.empty() ? nullptr : devices_.front().primary;
  }
  bool exportable() const noexcept {
    for (const DeviceInfo& d : devices_) {
      if (d.prop.requestedHandleTypes != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return false;
    }
    return !devices_.empty();
  }

  const Driver driver_;
  const std::vector<DeviceInfo> devices_;
};

// --- loading -----------------------------------------------------------------------------------

struct Loader {
  DriverResolver resolver = nullptr;
  void* context = nullptr;
  GetProcAddressFn get_proc = nullptr;

  void* resolve(const char* name) const noexcept {
    if (resolver != nullptr) return resolver(name, context);
    void* fn = nullptr;
    CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    if (get_proc(name, &fn, CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &found) != CUDA_SUCCESS ||
        found != CU_GET_PROC_ADDRESS_SUCCESS) {
      return nullptr;
    }
    return fn;
  }
};

// Library handle, opened once per process and kept (see the top of the file).
void* driver_library() noexcept {
  static void* const handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  return handle;
}

// Probes whether cuMemMap accepts a non-zero, granularity-aligned offset into a handle. Any
// failure (out of memory included) answers "no", the conservative choice.
bool probe_map_offset(const Driver& d, const DeviceInfo& info) noexcept {
  const std::size_t g = info.granularity;
  CUmemGenericAllocationHandle handle = 0;
  if (d.cuMemCreate(&handle, 2 * g, &info.prop, 0) != CUDA_SUCCESS) return false;
  bool ok = false;
  CUdeviceptr va = 0;
  if (d.cuMemAddressReserve(&va, g, g, 0, 0) == CUDA_SUCCESS) {
    if (d.cuMemMap(va, g, g, handle, 0) == CUDA_SUCCESS) {
      ok = true;
      d.cuMemUnmap(va, g);
    }
    d.cuMemAddressFree(va, g);
  }
  d.cuMemRelease(handle);
  return ok;
}

// Creates and releases one granule with prop; drops the optional properties the driver rejects.
CUresult settle_allocation_properties(const Driver& d, DeviceInfo& info) noexcept {
  for (;;) {
    CUmemGenericAllocationHandle handle = 0;
    const CUresult r = d.cuMemCreate(&handle, info.granularity, &info.prop, 0);
    if (r == CUDA_SUCCESS) {
      d.cuMemRelease(handle);
      return r;
    }
    if (r != CUDA_ERROR_NOT_SUPPORTED && r != CUDA_ERROR_INVALID_VALUE) return r;
    if (info.prop.allocFlags.gpuDirectRDMACapable != 0) {
      info.prop.allocFlags.gpuDirectRDMACapable = 0;
    } else if (info.prop.requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE) {
      info.prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    } else {
      return r;
    }
  }
}

std::unique_ptr<Backend> load(std::string* why, DriverResolver resolver, void* resolver_context,
                              bool shareable) {
  Loader loader{resolver, resolver_context, nullptr};
  if (resolver == nullptr) {
    void* lib = driver_library();
    if (lib == nullptr) {
      set_why(why, "libcuda.so.1 not found (no NVIDIA driver)");
      return nullptr;
    }
    loader.get_proc = reinterpret_cast<GetProcAddressFn>(dlsym(lib, "cuGetProcAddress_v2"));
    if (loader.get_proc == nullptr) {
      set_why(why, "libcuda.so.1 lacks cuGetProcAddress_v2 (driver older than CUDA 12)");
      return nullptr;
    }
  }

  Driver d;
  const char* missing = nullptr;
#define GPUSTITCH_RESOLVE(name)                                       \
  d.name = reinterpret_cast<decltype(d.name)>(loader.resolve(#name)); \
  if (d.name == nullptr && missing == nullptr) missing = #name;
  GPUSTITCH_DRIVER_ENTRY_POINTS(GPUSTITCH_RESOLVE)
#undef GPUSTITCH_RESOLVE
  d.cuThreadExchangeStreamCaptureMode =
      reinterpret_cast<decltype(d.cuThreadExchangeStreamCaptureMode)>(
          loader.resolve("cuThreadExchangeStreamCaptureMode"));
  d.cuDeviceGetUuid =
      reinterpret_cast<decltype(d.cuDeviceGetUuid)>(loader.resolve("cuDeviceGetUuid"));
  d.cuMemExportToShareableHandle = reinterpret_cast<decltype(d.cuMemExportToShareableHandle)>(
      loader.resolve("cuMemExportToShareableHandle"));
  d.cuMemImportFromShareableHandle = reinterpret_cast<decltype(d.cuMemImportFromShareableHandle)>(
      loader.resolve("cuMemImportFromShareableHandle"));
  d.cuEventCreate = reinterpret_cast<decltype(d.cuEventCreate)>(loader.resolve("cuEventCreate"));
  d.cuEventDestroy = reinterpret_cast<decltype(d.cuEventDestroy)>(loader.resolve("cuEventDestroy"));
  d.cuEventRecord = reinterpret_cast<decltype(d.cuEventRecord)>(loader.resolve("cuEventRecord"));
  d.cuEventQuery = reinterpret_cast<decltype(d.cuEventQuery)>(loader.resolve("cuEventQuery"));
  if (missing != nullptr) {
    char text[160];
    std::snprintf(text, sizeof text, "driver entry point %s not found (driver too old?)", missing);
    set_why(why, text);
    return nullptr;
  }

  CUresult r = d.cuInit(0);
  if (r != CUDA_SUCCESS) {
    char text[96];
    std::snprintf(text, sizeof text, "cuInit failed (CUresult %d)", static_cast<int>(r));
    set_why(why, r == CUDA_ERROR_NO_DEVICE ? "no CUDA device" : text);
    return nullptr;
  }
  int count = 0;
  if (d.cuDeviceGetCount(&count) != CUDA_SUCCESS || count <= 0) {
    set_why(why, "no CUDA device");
    return nullptr;
  }

  std::vector<DeviceInfo> devices;
  try {
    devices.resize(static_cast<std::size_t>(count));
  } catch (...) {
    set_why(why, "out of host memory");
    return nullptr;
  }
  auto release_retained = [&] {
    for (const DeviceInfo& info : devices) {
      if (info.primary != nullptr) d.cuDevicePrimaryCtxRelease(info.device);
    }
  };
  auto fail = [&](int ordinal, const char* what, CUresult res) {
    char text[160];
    std::snprintf(text, sizeof text, "device %d: %s (CUresult %d)", ordinal, what,
                  static_cast<int>(res));
    set_why(why, text);
    release_retained();
    return nullptr;
  };

  for (int i = 0; i < count; ++i) {
    DeviceInfo& info = devices[static_cast<std::size_t>(i)];
    if ((r = d.cuDeviceGet(&info.device, i)) != CUDA_SUCCESS) return fail(i, "cuDeviceGet", r);
    int vmm = 0, posix_fd = 0, rdma = 0;
    r = d.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                               info.device);
    if (r != CUDA_SUCCESS || vmm == 0) {
      char text[96];
      std::snprintf(text, sizeof text, "device %d lacks VMM support", i);
      set_why(why, text);
      release_retained();
      return nullptr;
    }
    CUuuid uuid{};
    if (d.cuDeviceGetUuid != nullptr && d.cuDeviceGetUuid(&uuid, info.device) == CUDA_SUCCESS) {
      static_assert(sizeof uuid.bytes == std::tuple_size_v<DeviceUuid>);
      std::memcpy(info.uuid.data(), uuid.bytes, sizeof uuid.bytes);
      info.has_uuid = true;
    }
    d.cuDeviceGetAttribute(
        &posix_fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, info.device);
    d.cuDeviceGetAttribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                           info.device);
    if ((r = d.cuDevicePrimaryCtxRetain(&info.primary, info.device)) != CUDA_SUCCESS) {
      info.primary = nullptr;
      return fail(i, "cuDevicePrimaryCtxRetain", r);
    }

    info.prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    info.prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    info.prop.location.id = info.device;
    info.prop.requestedHandleTypes = posix_fd != 0 && shareable
                                         ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                                         : CU_MEM_HANDLE_TYPE_NONE;
    info.prop.allocFlags.gpuDirectRDMACapable = rdma != 0 ? 1 : 0;

    // The probes below need a context on this thread; leave the caller's stack as it was.
    if ((r = d.cuCtxPushCurrent(info.primary)) != CUDA_SUCCESS) {
      return fail(i, "cuCtxPushCurrent", r);
    }
    r = d.cuMemGetAllocationGranularity(&info.granularity, &info.prop,
                                        CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
    if (r == CUDA_SUCCESS && info.granularity == 0) r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS) r = settle_allocation_properties(d, info);
    // Out of memory while probing says nothing about support: keep the device, but assume the
    // conservative answer for the offset probe.
    if (r == CUDA_ERROR_OUT_OF_MEMORY) r = CUDA_SUCCESS;
    if (r == CUDA_SUCCESS) info.map_offset = probe_map_offset(d, info);
    CUcontext popped = nullptr;
    d.cuCtxPopCurrent(&popped);
    if (r != CUDA_SUCCESS) return fail(i, "cannot create VMM allocations", r);
  }

  CudaBackend* backend = new (std::nothrow) CudaBackend(d, std::move(devices));
  if (backend == nullptr) {
    set_why(why, "out of host memory");
    release_retained();
    return nullptr;
  }
  return std::unique_ptr<Backend>(backend);
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(std::string* why, DriverResolver resolver,
                                           void* resolver_context, bool shareable) {
  try {
    return load(why, resolver, resolver_context, shareable);
  } catch (...) {
    set_why(why, "unexpected failure while loading the CUDA driver");
    return nullptr;
  }
}

}  // namespace gpustitch
