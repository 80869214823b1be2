// A stand-in CUDA runtime, built twice: as libcudart.so.13 with the real library's symbol version
// ("libcudart.so.13") and as a static library linked into a program with hidden symbols, the way
// nvcc links the real runtime by default.
//
// Like the real runtime it reaches the driver only through dlopen("libcuda.so.1") + dlsym of
// cuGetProcAddress_v2, then cuGetProcAddress for every entry point (legacy-stream variants for the
// plain API, per-thread variants for the _ptsz API). It keeps a current device and a sticky last
// error per thread and makes the device's primary context current on first use. Device memory is
// whatever the driver returns (host memory in the fake driver).
#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <mutex>

#ifdef FAKE_CUDART_STATIC
#define RT extern "C" __attribute__((visibility("hidden")))
#else
#define RT extern "C" __attribute__((visibility("default")))
#endif

namespace {

using CUresult = int;
using CUdeviceptr = std::uintptr_t;
using cudaError = int;
struct IpcHandle {  // CUipcMemHandle / cudaIpcMemHandle_t, passed by value
  char reserved[64];
};

struct Table {
  CUresult (*init)(unsigned) = nullptr;
  CUresult (*device_get_count)(int*) = nullptr;
  CUresult (*primary_ctx_retain)(void**, int) = nullptr;
  CUresult (*ctx_set_current)(void*) = nullptr;
  CUresult (*ctx_get_current)(void**) = nullptr;
  CUresult (*ctx_get_device)(int*) = nullptr;
  CUresult (*ctx_synchronize)() = nullptr;
  CUresult (*ctx_enable_peer_access)(void*, unsigned) = nullptr;
  CUresult (*stream_create)(void**, unsigned) = nullptr;
  CUresult (*stream_destroy)(void*) = nullptr;
  CUresult (*mem_alloc)(CUdeviceptr*, std::size_t) = nullptr;
  CUresult (*mem_free)(CUdeviceptr) = nullptr;
  CUresult (*mem_alloc_async)(CUdeviceptr*, std::size_t, void*) = nullptr;
  CUresult (*mem_free_async)(CUdeviceptr, void*) = nullptr;
  CUresult (*mem_alloc_pitch)(CUdeviceptr*, std::size_t*, std::size_t, std::size_t,
                              unsigned) = nullptr;
  CUresult (*mem_alloc_managed)(CUdeviceptr*, std::size_t, unsigned) = nullptr;
  CUresult (*mem_alloc_host)(void**, std::size_t) = nullptr;
  CUresult (*mem_free_host)(void*) = nullptr;
  CUresult (*mem_get_info)(std::size_t*, std::size_t*) = nullptr;
  CUresult (*ipc_get_mem_handle)(void*, CUdeviceptr) = nullptr;
  CUresult (*ipc_open_mem_handle)(CUdeviceptr*, IpcHandle, unsigned) = nullptr;
  CUresult (*ipc_close_mem_handle)(CUdeviceptr) = nullptr;
  CUresult (*device_get_default_mem_pool)(void**, int) = nullptr;
  CUresult (*mem_pool_get_attribute)(void*, int, void*) = nullptr;
  CUresult (*mem_pool_set_attribute)(void*, int, void*) = nullptr;
  CUresult (*mem_pool_trim_to)(void*, std::size_t) = nullptr;
  CUresult (*get_proc_address)(const char*, void**, int, std::uint64_t, int*) = nullptr;
};

Table g_legacy, g_ptsz;
std::once_flag g_once;
bool g_ok = false;
thread_local int t_device = 0;
thread_local cudaError t_last_error = 0;

template <typename F>
void get(const char* name, F* out, std::uint64_t flags) {
  void* p = nullptr;
  int status = 0;
  if (g_legacy.get_proc_address(name, &p, 13000, flags, &status) == 0)
    *out = reinterpret_cast<F>(p);
}

void fill(Table& t, std::uint64_t flags) {
  get("cuInit", &t.init, flags);
  get("cuDeviceGetCount", &t.device_get_count, flags);
  get("cuDevicePrimaryCtxRetain", &t.primary_ctx_retain, flags);
  get("cuCtxSetCurrent", &t.ctx_set_current, flags);
  get("cuCtxGetCurrent", &t.ctx_get_current, flags);
  get("cuCtxGetDevice", &t.ctx_get_device, flags);
  get("cuCtxSynchronize", &t.ctx_synchronize, flags);
  get("cuCtxEnablePeerAccess", &t.ctx_enable_peer_access, flags);
  get("cuStreamCreate", &t.stream_create, flags);
  get("cuStreamDestroy", &t.stream_destroy, flags);
  get("cuMemAlloc", &t.mem_alloc, flags);
  get("cuMemFree", &t.mem_free, flags);
  get("cuMemAllocAsync", &t.mem_alloc_async, flags);
  get("cuMemFreeAsync", &t.mem_free_async, flags);
  get("cuMemAllocPitch", &t.mem_alloc_pitch, flags);
  get("cuMemAllocManaged", &t.mem_alloc_managed, flags);
  get("cuMemAllocHost", &t.mem_alloc_host, flags);
  get("cuMemFreeHost", &t.mem_free_host, flags);
  get("cuMemGetInfo", &t.mem_get_info, flags);
  get("cuIpcGetMemHandle", &t.ipc_get_mem_handle, flags);
  get("cuIpcOpenMemHandle", &t.ipc_open_mem_handle, flags);
  get("cuIpcCloseMemHandle", &t.ipc_close_mem_handle, flags);
  get("cuDeviceGetDefaultMemPool", &t.device_get_default_mem_pool, flags);
  get("cuMemPoolGetAttribute", &t.mem_pool_get_attribute, flags);
  get("cuMemPoolSetAttribute", &t.mem_pool_set_attribute, flags);
  get("cuMemPoolTrimTo", &t.mem_pool_trim_to, flags);
}

void load() {
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) return;
  g_legacy.get_proc_address =
      reinterpret_cast<decltype(g_legacy.get_proc_address)>(dlsym(h, "cuGetProcAddress_v2"));
  if (!g_legacy.get_proc_address) return;
  g_ptsz.get_proc_address = g_legacy.get_proc_address;
  fill(g_legacy, 1);  // CU_GET_PROC_ADDRESS_LEGACY_STREAM
  fill(g_ptsz, 2);    // CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
  g_ok = g_legacy.init && g_legacy.init(0) == 0;
}

cudaError to_runtime(CUresult r) {
  // The runtime's codes coincide with the driver's for every error these calls return, except
  // "no driver" (cudaErrorInsufficientDriver) and a missing context (never: the runtime makes one).
  return r;
}

cudaError record(cudaError e) {
  if (e != 0) t_last_error = e;
  return e;
}

// Lazy initialisation and the thread's context, as the real runtime does before each call.
cudaError ready() {
  std::call_once(g_once, load);
  if (!g_ok) return record(35);  // cudaErrorInsufficientDriver
  void* ctx = nullptr;
  g_legacy.ctx_get_current(&ctx);
  if (ctx) return 0;
  CUresult r = g_legacy.primary_ctx_retain(&ctx, t_device);
  if (r == 0) r = g_legacy.ctx_set_current(ctx);
  return record(to_runtime(r));
}

#define READY()             \
  do {                      \
    cudaError e_ = ready(); \
    if (e_ != 0) return e_; \
  } while (0)

}  // namespace

RT cudaError cudaGetLastError() {
  cudaError e = t_last_error;
  t_last_error = 0;
  return e;
}
RT cudaError cudaPeekAtLastError() {
  return t_last_error;
}
RT cudaError cudaGetDeviceCount(int* n) {
  std::call_once(g_once, load);
  if (!g_ok) return record(35);
  return record(to_runtime(g_legacy.device_get_count(n)));
}
RT cudaError cudaSetDevice(int device) {
  std::call_once(g_once, load);
  if (!g_ok) return record(35);
  int n = 0;
  g_legacy.device_get_count(&n);
  if (device < 0 || device >= n) return record(101);
  t_device = device;
  void* ctx = nullptr;
  CUresult r = g_legacy.primary_ctx_retain(&ctx, device);
  if (r == 0) r = g_legacy.ctx_set_current(ctx);
  return record(to_runtime(r));
}
RT cudaError cudaGetDevice(int* device) {
  if (!device) return record(1);
  *device = t_device;
  return 0;
}
RT cudaError cudaDeviceSynchronize() {
  READY();
  return record(g_legacy.ctx_synchronize());
}
RT cudaError cudaMalloc(void** p, std::size_t size) {
  READY();
  if (!p) return record(1);
  if (size == 0) {  // the runtime's documented behaviour: success, NULL pointer
    *p = nullptr;
    return 0;
  }
  CUdeviceptr d = 0;
  CUresult r = g_legacy.mem_alloc(&d, size);
  if (r == 0) *p = reinterpret_cast<void*>(d);
  return record(to_runtime(r));
}
RT cudaError cudaFree(void* p) {
  READY();
  if (!p) return 0;
  return record(to_runtime(g_legacy.mem_free(reinterpret_cast<CUdeviceptr>(p))));
}
static cudaError malloc_async(const Table& t, void** p, std::size_t size, void* stream) {
  READY();
  if (!p) return record(1);
  CUdeviceptr d = 0;
  CUresult r = t.mem_alloc_async(&d, size, stream);
  if (r == 0) *p = reinterpret_cast<void*>(d);
  return record(to_runtime(r));
}
RT cudaError cudaMallocAsync(void** p, std::size_t size, void* stream) {
  return malloc_async(g_legacy, p, size, stream);
}
RT cudaError cudaMallocAsync_ptsz(void** p, std::size_t size, void* stream) {
  return malloc_async(g_ptsz, p, size, stream);
}
RT cudaError cudaFreeAsync(void* p, void* stream) {
  READY();
  return record(to_runtime(g_legacy.mem_free_async(reinterpret_cast<CUdeviceptr>(p), stream)));
}
RT cudaError cudaFreeAsync_ptsz(void* p, void* stream) {
  READY();
  return record(to_runtime(g_ptsz.mem_free_async(reinterpret_cast<CUdeviceptr>(p), stream)));
}
RT cudaError cudaMallocPitch(void** p, std::size_t* pitch, std::size_t width, std::size_t height) {
  READY();
  if (!p || !pitch) return record(1);
  CUdeviceptr d = 0;
  CUresult r = g_legacy.mem_alloc_pitch(&d, pitch, width, height, 4);
  if (r == 0) *p = reinterpret_cast<void*>(d);
  return record(to_runtime(r));
}
RT cudaError cudaMallocManaged(void** p, std::size_t size, unsigned flags) {
  READY();
  if (!p) return record(1);
  CUdeviceptr d = 0;
  CUresult r = g_legacy.mem_alloc_managed(&d, size, flags ? flags : 1);
  if (r == 0) *p = reinterpret_cast<void*>(d);
  return record(to_runtime(r));
}
RT cudaError cudaMallocHost(void** p, std::size_t size) {
  READY();
  return record(to_runtime(g_legacy.mem_alloc_host(p, size)));
}
RT cudaError cudaFreeHost(void* p) {
  READY();
  return record(to_runtime(g_legacy.mem_free_host(p)));
}
RT cudaError cudaMemGetInfo(std::size_t* free, std::size_t* total) {
  READY();
  return record(to_runtime(g_legacy.mem_get_info(free, total)));
}
RT cudaError cudaStreamCreate(void** stream) {
  READY();
  return record(to_runtime(g_legacy.stream_create(stream, 0)));
}
RT cudaError cudaStreamDestroy(void* stream) {
  READY();
  return record(to_runtime(g_legacy.stream_destroy(stream)));
}
RT cudaError cudaDeviceEnablePeerAccess(int peer, unsigned flags) {
  READY();
  void* ctx = nullptr;
  CUresult r = g_legacy.primary_ctx_retain(&ctx, peer);
  if (r != 0) return record(101);
  return record(to_runtime(g_legacy.ctx_enable_peer_access(ctx, flags)));
}
RT cudaError cudaIpcGetMemHandle(void* handle, void* p) {
  READY();
  return record(to_runtime(g_legacy.ipc_get_mem_handle(handle, reinterpret_cast<CUdeviceptr>(p))));
}
RT cudaError cudaIpcOpenMemHandle(void** p, IpcHandle handle, unsigned flags) {
  READY();
  if (!p) return record(1);
  CUdeviceptr d = 0;
  CUresult r = g_legacy.ipc_open_mem_handle(&d, handle, flags);
  if (r == 0) *p = reinterpret_cast<void*>(d);
  return record(to_runtime(r));
}
RT cudaError cudaIpcCloseMemHandle(void* p) {
  READY();
  return record(to_runtime(g_legacy.ipc_close_mem_handle(reinterpret_cast<CUdeviceptr>(p))));
}
// The memory-pool calls, through the driver as the real runtime makes them (cudaMemPool_t is the
// driver's CUmemoryPool).
RT cudaError cudaDeviceGetDefaultMemPool(void** pool, int device) {
  READY();
  return record(to_runtime(g_legacy.device_get_default_mem_pool(pool, device)));
}
RT cudaError cudaMemPoolGetAttribute(void* pool, int attr, void* value) {
  READY();
  return record(to_runtime(g_legacy.mem_pool_get_attribute(pool, attr, value)));
}
RT cudaError cudaMemPoolSetAttribute(void* pool, int attr, void* value) {
  READY();
  return record(to_runtime(g_legacy.mem_pool_set_attribute(pool, attr, value)));
}
RT cudaError cudaMemPoolTrimTo(void* pool, std::size_t keep) {
  READY();
  return record(to_runtime(g_legacy.mem_pool_trim_to(pool, keep)));
}
static cudaError entry_point(const char* symbol, void** fn, unsigned version,
                             unsigned long long flags, int* status) {
  READY();
  if (!symbol || !fn) return record(1);
  CUresult r = g_legacy.get_proc_address(symbol, fn, static_cast<int>(version), flags, status);
  return r == 0 ? 0 : record(r == 500 ? 0 : to_runtime(r));
}
RT cudaError cudaGetDriverEntryPoint(const char* symbol, void** fn, unsigned long long flags,
                                     int* status) {
  return entry_point(symbol, fn, 13000, flags, status);
}
RT cudaError cudaGetDriverEntryPoint_ptsz(const char* symbol, void** fn, unsigned long long flags,
                                          int* status) {
  return entry_point(symbol, fn, 13000, flags ? flags : 2, status);
}
RT cudaError cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned version,
                                              unsigned long long flags, int* status) {
  return entry_point(symbol, fn, version, flags, status);
}
RT cudaError cudaGetDriverEntryPointByVersion_ptsz(const char* symbol, void** fn, unsigned version,
                                                   unsigned long long flags, int* status) {
  return entry_point(symbol, fn, version, flags ? flags : 2, status);
}
