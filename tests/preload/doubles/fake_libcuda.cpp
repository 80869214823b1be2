// A fake CUDA driver (libcuda.so.1) on host memory, for testing the preload shim without a GPU.
//
// It exports the entry points the shim, the fake runtime and the pool's CUDA backend use, under the
// real names and, like the real libcuda.so.1, without symbol versions. Device memory is malloc'ed
// host memory, so tests can check bytes directly. Contexts are one primary context per device, made
// current per thread; streams are heap objects that remember their device. cuGetProcAddress(_v2)
// implements the real lookup rules for the entry points it knows: the newest variant whose version
// is at most the requested one, and the _ptsz variant under
// CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM.
//
// Virtual memory management (cuMemCreate, cuMemAddressReserve, cuMemMap, cuMemSetAccess, ...) is
// backed by the host's own: a physical handle is a memfd of its size, a reserved range an
// inaccessible anonymous mapping, cuMemMap maps the memfd over part of it (MAP_SHARED|MAP_FIXED,
// still inaccessible), cuMemSetAccess makes it readable and writable, cuMemUnmap puts the
// inaccessible reservation back. As in CUDA, a released handle stays alive while it is mapped (the
// mapping holds the memfd). The granularity is 2 MiB. Each VMM call's arguments are kept for the
// tests (fakecuda_last_args).
//
// Environment: FAKE_CUDA_DEVICES (default 2), FAKE_CUDA_MEM_MB per device (default 4096).
// Built with FAKE_CUDA_NO_VMM (the fake_cuda_novmm target), it is a driver without virtual memory
// management: the VMM entry points are neither exported nor found by cuGetProcAddress.
// Error codes follow the CUDA driver documentation for each call.
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "fake_cuda.h"

#define API extern "C" __attribute__((visibility("default")))
#ifdef FAKE_CUDA_NO_VMM
#define VMM_API extern "C" __attribute__((visibility("hidden")))
#else
#define VMM_API API
#endif

namespace {

using CUresult = int;
using CUdeviceptr = std::uintptr_t;
struct Ctx {
  int device;
};
struct Stream {
  int device;
  std::atomic<int> capturing{0};
  // Destroyed streams are kept (and answer CUDA_ERROR_INVALID_HANDLE) so that a test can call an
  // API with a destroyed stream without the fake reading freed memory.
  std::atomic<bool> destroyed{false};
};

constexpr CUresult kOk = 0, kInvalidValue = 1, kOom = 2, kNotInit = 3, kInvalidDevice = 101,
                   kInvalidContext = 201, kInvalidHandle = 400, kNotFound = 500, kPeerAlready = 704,
                   kNotSupported = 801;

enum class Kind { device, managed, host };
struct Alloc {
  std::size_t size;
  int device;
  Kind kind;
  bool from_pool = false;  // cuMemAllocAsync: counted in the device's default memory pool
};

// A memory pool (the device's default one, or one from cuMemPoolCreate): what stream-ordered
// allocations hold, with the attributes the driver documents.
struct MemPool {
  int device = 0;
  std::uint64_t used = 0, reserved = 0, used_high = 0, reserved_high = 0;
  std::uint64_t release_threshold = 0;
  int reuse[3] = {1, 1, 1};
};

struct Driver {
  int devices = 2;
  std::size_t capacity = 4096ull << 20;
  std::vector<Ctx> ctxs;
  std::mutex mu;
  std::map<CUdeviceptr, Alloc> allocs;
  std::vector<std::size_t> used;
  std::map<std::pair<int, int>, bool> peers;
  std::vector<MemPool*> default_pools;  // one per device
  std::vector<MemPool*> created_pools;
  bool initialized = false;
  Driver() {
    if (const char* d = std::getenv("FAKE_CUDA_DEVICES")) devices = std::atoi(d);
    if (const char* m = std::getenv("FAKE_CUDA_MEM_MB"))
      capacity = std::strtoull(m, nullptr, 10) << 20;
    ctxs.resize(devices);
    for (int i = 0; i < devices; ++i) ctxs[i].device = i;
    used.assign(devices, 0);
    for (int i = 0; i < devices; ++i) {
      default_pools.push_back(new MemPool());
      default_pools.back()->device = i;
    }
  }
};

void drv_lock();
void drv_unlock();
Driver& drv() {
  static Driver* d = [] {
    auto* drv = new Driver();
    // Like fork-aware allocators: no lock is held across fork(), so a child can keep allocating.
    pthread_atfork([] { drv_lock(); }, [] { drv_unlock(); }, [] { drv_unlock(); });
    return drv;
  }();
  return *d;
}
void drv_lock() {
  drv().mu.lock();
}
void drv_unlock() {
  drv().mu.unlock();
}

// Call counters, lock-free so that counting is safe in a forked child.
struct Counter {
  std::atomic<const char*> name{nullptr};
  std::atomic<int> calls{0};
};
Counter g_counters[128];

thread_local std::vector<Ctx*> t_ctx_stack;  // back() is current

void count(const char* name) {
  for (Counter& c : g_counters) {
    const char* n = c.name.load();
    if (!n) {
      const char* expected = nullptr;
      if (c.name.compare_exchange_strong(expected, name))
        n = name;
      else
        n = expected;
    }
    if (std::strcmp(n, name) == 0) {
      ++c.calls;
      return;
    }
  }
}

Ctx* current() {
  return t_ctx_stack.empty() ? nullptr : t_ctx_stack.back();
}

CUresult allocate(CUdeviceptr* p, std::size_t size, int device, Kind kind, bool from_pool = false) {
  auto& d = drv();
  std::lock_guard g(d.mu);
  if (kind != Kind::host && d.used[device] + size > d.capacity) return kOom;
  void* mem = std::aligned_alloc(256, (size + 255) / 256 * 256);
  if (!mem) return kOom;
  auto addr = reinterpret_cast<CUdeviceptr>(mem);
  d.allocs[addr] = Alloc{size, device, kind, from_pool};
  if (kind != Kind::host) d.used[device] += size;
  if (from_pool) {
    // The pool keeps what was freed into it: reserved grows only past what it already holds.
    MemPool& mp = *d.default_pools[device];
    mp.used += size;
    mp.reserved = std::max(mp.reserved, mp.used);
    mp.used_high = std::max(mp.used_high, mp.used);
    mp.reserved_high = std::max(mp.reserved_high, mp.reserved);
  }
  *p = addr;
  return kOk;
}

CUresult release(CUdeviceptr p, Kind kind) {
  auto& d = drv();
  std::lock_guard g(d.mu);
  auto it = d.allocs.find(p);
  if (it == d.allocs.end() || (kind == Kind::host) != (it->second.kind == Kind::host)) {
    return kInvalidValue;
  }
  if (it->second.kind != Kind::host) d.used[it->second.device] -= it->second.size;
  if (it->second.from_pool) d.default_pools[it->second.device]->used -= it->second.size;
  d.allocs.erase(it);
  std::free(reinterpret_cast<void*>(p));
  return kOk;
}

// The allocation containing p, if any.
bool lookup(CUdeviceptr p, CUdeviceptr* base, Alloc* out) {
  auto& d = drv();
  std::lock_guard g(d.mu);
  auto it = d.allocs.upper_bound(p);
  if (it == d.allocs.begin()) return false;
  --it;
  if (p >= it->first + std::max<std::size_t>(it->second.size, 1)) return false;
  *base = it->first;
  *out = it->second;
  return true;
}

Stream* as_stream(CUstream_st* s) {
  return reinterpret_cast<Stream*>(s);
}
bool special(CUstream_st* s) {
  return reinterpret_cast<std::uintptr_t>(s) <= 2;
}

}  // namespace

// --- test controls
// ---------------------------------------------------------------------------------
API int fakecuda_calls(const char* symbol) {
  for (Counter& c : g_counters) {
    const char* n = c.name.load();
    if (n && std::strcmp(n, symbol) == 0) return c.calls.load();
  }
  return 0;
}
API void fakecuda_reset_calls() {
  for (Counter& c : g_counters) c.calls = 0;
}
API void fakecuda_set_capturing(CUstream_st* s, int capturing) {
  if (!special(s)) as_stream(s)->capturing = capturing;
}
namespace {
// The arguments of the last call of each VMM entry point (tests check they arrive unchanged).
struct LastArgs {
  const char* name;
  std::uint64_t args[5];
};
std::mutex g_last_mu;
LastArgs g_last[16];
void note_args(const char* name, std::uint64_t a0, std::uint64_t a1 = 0, std::uint64_t a2 = 0,
               std::uint64_t a3 = 0, std::uint64_t a4 = 0) {
  std::lock_guard g(g_last_mu);
  for (LastArgs& l : g_last) {
    if (l.name == nullptr || std::strcmp(l.name, name) == 0) {
      l.name = name;
      l.args[0] = a0, l.args[1] = a1, l.args[2] = a2, l.args[3] = a3, l.args[4] = a4;
      return;
    }
  }
}
}  // namespace
API int fakecuda_last_args(const char* symbol, std::uint64_t* out) {
  std::lock_guard g(g_last_mu);
  for (const LastArgs& l : g_last) {
    if (l.name != nullptr && std::strcmp(l.name, symbol) == 0) {
      std::memcpy(out, l.args, sizeof l.args);
      return 1;
    }
  }
  return 0;
}
API std::size_t fakecuda_used(int device) {
  std::lock_guard g(drv().mu);
  return device >= 0 && device < drv().devices ? drv().used[device] : 0;
}

// --- initialisation, devices, contexts
// ---------------------------------------------------------------
API CUresult cuInit(unsigned flags) {
  count("cuInit");
  if (flags != 0) return kInvalidValue;
  drv().initialized = true;
  return kOk;
}
API CUresult cuDriverGetVersion(int* v) {
  if (!v) return kInvalidValue;
  *v = 13000;
  return kOk;
}
API CUresult cuDeviceGetCount(int* n) {
  if (!n) return kInvalidValue;
  if (!drv().initialized) return kNotInit;
  *n = drv().devices;
  return kOk;
}
API CUresult cuDeviceGet(int* dev, int ordinal) {
  if (!dev) return kInvalidValue;
  if (ordinal < 0 || ordinal >= drv().devices) return kInvalidDevice;
  *dev = ordinal;
  return kOk;
}
API CUresult cuDeviceTotalMem_v2(std::size_t* bytes, int dev) {
  if (!bytes) return kInvalidValue;
  if (dev < 0 || dev >= drv().devices) return kInvalidDevice;
  *bytes = drv().capacity;
  return kOk;
}
API CUresult cuDeviceGetAttribute(int* v, int /*attr*/, int dev) {
  if (!v) return kInvalidValue;
  if (dev < 0 || dev >= drv().devices) return kInvalidDevice;
  *v = 1;
  return kOk;
}
API CUresult cuDevicePrimaryCtxRetain(CUctx_st** ctx, int dev) {
  if (!ctx) return kInvalidValue;
  if (dev < 0 || dev >= drv().devices) return kInvalidDevice;
  *ctx = reinterpret_cast<CUctx_st*>(&drv().ctxs[dev]);
  return kOk;
}
API CUresult cuDevicePrimaryCtxRelease_v2(int dev) {
  return dev < 0 || dev >= drv().devices ? kInvalidDevice : kOk;
}
API CUresult cuCtxSetCurrent(CUctx_st* ctx) {
  if (t_ctx_stack.empty()) t_ctx_stack.push_back(nullptr);
  t_ctx_stack.back() = reinterpret_cast<Ctx*>(ctx);
  if (!ctx) t_ctx_stack.pop_back();
  return kOk;
}
API CUresult cuCtxGetCurrent(CUctx_st** ctx) {
  if (!ctx) return kInvalidValue;
  *ctx = reinterpret_cast<CUctx_st*>(current());
  return kOk;
}
API CUresult cuCtxPushCurrent_v2(CUctx_st* ctx) {
  if (!ctx) return kInvalidValue;
  t_ctx_stack.push_back(reinterpret_cast<Ctx*>(ctx));
  return kOk;
}
API CUresult cuCtxPopCurrent_v2(CUctx_st** ctx) {
  if (t_ctx_stack.empty()) return kInvalidContext;
  if (ctx) *ctx = reinterpret_cast<CUctx_st*>(t_ctx_stack.back());
  t_ctx_stack.pop_back();
  return kOk;
}
API CUresult cuCtxGetDevice(int* dev) {
  count("cuCtxGetDevice");
  if (!dev) return kInvalidValue;
  Ctx* c = current();
  if (!c) return kInvalidContext;
  *dev = c->device;
  return kOk;
}
API CUresult cuCtxSynchronize() {
  return current() ? kOk : kInvalidContext;
}
API CUresult cuCtxEnablePeerAccess(CUctx_st* peer, unsigned flags) {
  count("cuCtxEnablePeerAccess");
  Ctx* c = current();
  if (!c || !peer) return kInvalidContext;
  if (flags != 0) return kInvalidValue;
  auto key = std::make_pair(c->device, reinterpret_cast<Ctx*>(peer)->device);
  std::lock_guard g(drv().mu);
  if (drv().peers[key]) return kPeerAlready;
  drv().peers[key] = true;
  return kOk;
}

// --- streams
// -------------------------------------------------------------------------------------------
API CUresult cuStreamCreate(CUstream_st** s, unsigned /*flags*/) {
  if (!s) return kInvalidValue;
  Ctx* c = current();
  if (!c) return kInvalidContext;
  auto* st = new Stream();
  st->device = c->device;
  *s = reinterpret_cast<CUstream_st*>(st);
  return kOk;
}
API CUresult cuStreamDestroy_v2(CUstream_st* s) {
  if (special(s) || as_stream(s)->destroyed.exchange(true)) return kInvalidHandle;
  // Reachable from here for the leak checker; a handful per test run.
  static std::vector<Stream*>* destroyed = new std::vector<Stream*>;
  std::lock_guard g(drv().mu);
  destroyed->push_back(as_stream(s));
  return kOk;
}
API CUresult cuStreamSynchronize(CUstream_st*) {
  return kOk;
}
static CUresult stream_is_capturing(CUstream_st* s, int* status) {
  if (!status) return kInvalidValue;
  if (!special(s) && as_stream(s)->destroyed) return kInvalidHandle;
  // The NULL and per-thread streams are the current context's: a thread with none gets the
  // real driver's answer (PyTorch's autograd thread, whose first call is an allocation).
  if (special(s) && !current()) return kInvalidContext;
  *status = special(s) ? 0 : as_stream(s)->capturing.load();
  return kOk;
}
API CUresult cuStreamIsCapturing(CUstream_st* s, int* status) {
  count("cuStreamIsCapturing");
  return stream_is_capturing(s, status);
}
API CUresult cuStreamIsCapturing_ptsz(CUstream_st* s, int* status) {
  count("cuStreamIsCapturing_ptsz");
  return stream_is_capturing(s, status);
}
static CUresult stream_get_device(CUstream_st* s, int* dev) {
  if (!dev) return kInvalidValue;
  if (special(s)) return cuCtxGetDevice(dev);
  if (as_stream(s)->destroyed) return kInvalidHandle;
  *dev = as_stream(s)->device;
  return kOk;
}
API CUresult cuStreamGetDevice(CUstream_st* s, int* dev) {
  return stream_get_device(s, dev);
}
API CUresult cuStreamGetDevice_ptsz(CUstream_st* s, int* dev) {
  return stream_get_device(s, dev);
}

// --- memory
// ----------------------------------------------------------------------------------------------
static CUresult mem_alloc(CUdeviceptr* p, std::size_t size) {
  if (!p || size == 0) return kInvalidValue;
  Ctx* c = current();
  if (!c) return kInvalidContext;
  return allocate(p, size, c->device, Kind::device);
}
API CUresult cuMemAlloc_v2(CUdeviceptr* p, std::size_t size) {
  count("cuMemAlloc_v2");
  return mem_alloc(p, size);
}
// The CUDA 3.0 variant (32-bit sizes), what cuGetProcAddress returns for versions below 3020.
API CUresult cuMemAlloc(unsigned* p, unsigned size) {
  count("cuMemAlloc");
  CUdeviceptr full = 0;
  // Host addresses do not fit 32 bits: hand out the low half only to show which variant ran.
  CUresult r = mem_alloc(&full, size);
  if (r == kOk && p) *p = static_cast<unsigned>(full);
  return r;
}
API CUresult cuMemFree_v2(CUdeviceptr p) {
  count("cuMemFree_v2");
  if (!current()) return kInvalidContext;
  return release(p, Kind::device);
}
static CUresult alloc_async(CUdeviceptr* p, std::size_t size, CUstream_st* s) {
  if (!p || size == 0) return kInvalidValue;
  int dev = 0;
  CUresult r = stream_get_device(s, &dev);
  if (r != kOk) return r;
  return allocate(p, size, dev, Kind::device, true);
}
API CUresult cuMemAllocAsync(CUdeviceptr* p, std::size_t size, CUstream_st* s) {
  count("cuMemAllocAsync");
  return alloc_async(p, size, s);
}
API CUresult cuMemAllocAsync_ptsz(CUdeviceptr* p, std::size_t size, CUstream_st* s) {
  count("cuMemAllocAsync_ptsz");
  return alloc_async(p, size, s);
}
// From a memory pool: the pool's device, counted in that pool when it is a device's default one
// (as cuMemAllocAsync is); a pool from cuMemPoolCreate gives plain device memory.
static CUresult alloc_from_pool_async(CUdeviceptr* p, std::size_t size, CUmemPoolHandle_st* h,
                                      CUstream_st* s);
API CUresult cuMemAllocFromPoolAsync(CUdeviceptr* p, std::size_t size, CUmemPoolHandle_st* pool,
                                     CUstream_st* s) {
  count("cuMemAllocFromPoolAsync");
  return alloc_from_pool_async(p, size, pool, s);
}
API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr* p, std::size_t size,
                                          CUmemPoolHandle_st* pool, CUstream_st* s) {
  count("cuMemAllocFromPoolAsync_ptsz");
  return alloc_from_pool_async(p, size, pool, s);
}
API CUresult cuMemFreeAsync(CUdeviceptr p, CUstream_st*) {
  count("cuMemFreeAsync");
  return release(p, Kind::device);
}
API CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream_st*) {
  count("cuMemFreeAsync_ptsz");
  return release(p, Kind::device);
}
API CUresult cuMemAllocPitch_v2(CUdeviceptr* p, std::size_t* pitch, std::size_t width,
                                std::size_t height, unsigned elem) {
  count("cuMemAllocPitch_v2");
  if (!p || !pitch || width == 0 || height == 0) return kInvalidValue;
  if (elem != 4 && elem != 8 && elem != 16) return kInvalidValue;
  std::size_t pt = (width + 511) / 512 * 512;
  CUresult r = mem_alloc(p, pt * height);
  if (r == kOk) *pitch = pt;
  return r;
}
API CUresult cuMemAllocManaged(CUdeviceptr* p, std::size_t size, unsigned /*flags*/) {
  count("cuMemAllocManaged");
  if (!p || size == 0) return kInvalidValue;
  Ctx* c = current();
  if (!c) return kInvalidContext;
  return allocate(p, size, c->device, Kind::managed);
}
API CUresult cuMemAllocHost_v2(void** p, std::size_t size) {
  count("cuMemAllocHost_v2");
  if (!p || size == 0) return kInvalidValue;
  CUdeviceptr d = 0;
  CUresult r = allocate(&d, size, 0, Kind::host);
  if (r == kOk) *p = reinterpret_cast<void*>(d);
  return r;
}
API CUresult cuMemFreeHost(void* p) {
  count("cuMemFreeHost");
  return release(reinterpret_cast<CUdeviceptr>(p), Kind::host);
}
API CUresult cuMemGetInfo_v2(std::size_t* free, std::size_t* total) {
  count("cuMemGetInfo_v2");
  if (!free || !total) return kInvalidValue;
  Ctx* c = current();
  if (!c) return kInvalidContext;
  std::lock_guard g(drv().mu);
  *total = drv().capacity;
  *free = drv().capacity - drv().used[c->device];
  return kOk;
}
API CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, std::size_t* size, CUdeviceptr p) {
  count("cuMemGetAddressRange_v2");
  CUdeviceptr b = 0;
  Alloc a{};
  if (!lookup(p, &b, &a)) return kNotFound;
  if (base) *base = b;
  if (size) *size = a.size;
  return kOk;
}
static bool attribute(int attr, void* data, CUdeviceptr p, bool* known) {
  CUdeviceptr b = 0;
  Alloc a{};
  *known = lookup(p, &b, &a);
  switch (attr) {
    case 2: {  // MEMORY_TYPE
      unsigned v = !*known ? 0 : a.kind == Kind::host ? 1 : 2;
      std::memcpy(data, &v, sizeof v);
      return true;
    }
    case 3: {  // DEVICE_POINTER
      CUdeviceptr v = *known ? p : 0;
      std::memcpy(data, &v, sizeof v);
      return true;
    }
    case 8: {  // IS_MANAGED
      unsigned v = *known && a.kind == Kind::managed;
      std::memcpy(data, &v, sizeof v);
      return true;
    }
    case 9: {  // DEVICE_ORDINAL
      int v = *known ? a.device : -2;
      std::memcpy(data, &v, sizeof v);
      return true;
    }
    case 11: {  // RANGE_START_ADDR
      CUdeviceptr v = *known ? b : 0;
      std::memcpy(data, &v, sizeof v);
      return true;
    }
    case 12: {  // RANGE_SIZE
      std::size_t v = *known ? a.size : 0;
      std::memcpy(data, &v, sizeof v);
      return true;
    }
    default:
      return false;
  }
}
API CUresult cuPointerGetAttribute(void* data, int attr, CUdeviceptr p) {
  count("cuPointerGetAttribute");
  if (!data) return kInvalidValue;
  bool known = false;
  if (!attribute(attr, data, p, &known)) return kInvalidValue;
  return known ? kOk : kInvalidValue;
}
API CUresult cuPointerGetAttributes(unsigned n, int* attrs, void** data, CUdeviceptr p) {
  count("cuPointerGetAttributes");
  if (!attrs || !data || n == 0) return kInvalidValue;
  for (unsigned i = 0; i < n; ++i) {
    bool known = false;
    if (data[i]) attribute(attrs[i], data[i], p, &known);
  }
  return kOk;
}
// The fake driver's own IPC handles name a pointer of the process that made them, which means
// nothing in another process: opening any handle fails as CUDA does for one it cannot map, and
// closing a pointer no open returned is an invalid value.
struct IpcHandle {
  char reserved[64];
};
API CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* p, IpcHandle, unsigned) {
  count("cuIpcOpenMemHandle_v2");
  (void)p;
  return kInvalidValue;
}
API CUresult cuIpcCloseMemHandle(CUdeviceptr) {
  count("cuIpcCloseMemHandle");
  return kInvalidValue;
}
API CUresult cuIpcGetMemHandle(void* handle, CUdeviceptr p) {
  count("cuIpcGetMemHandle");
  CUdeviceptr b = 0;
  Alloc a{};
  if (!handle || !lookup(p, &b, &a) || b != p || a.kind != Kind::device) return kInvalidValue;
  std::memset(handle, 0, 64);
  std::memcpy(handle, &b, sizeof b);
  return kOk;
}

// --- memory pools
// ----------------------------------------------------------------------------------------
namespace {
// The pool behind a handle, or null for a handle the driver never gave out (mu held).
MemPool* as_pool(CUmemPoolHandle_st* h) {
  auto* p = reinterpret_cast<MemPool*>(h);
  auto& d = drv();
  for (MemPool* q : d.default_pools)
    if (q == p) return p;
  for (MemPool* q : d.created_pools)
    if (q == p) return p;
  return nullptr;
}
}  // namespace
static CUresult alloc_from_pool_async(CUdeviceptr* p, std::size_t size, CUmemPoolHandle_st* h,
                                      CUstream_st* s) {
  if (!p || size == 0) return kInvalidValue;
  int dev = 0;
  bool is_default = false;
  {
    std::lock_guard g(drv().mu);
    MemPool* pool = as_pool(h);
    if (!pool) return kInvalidValue;
    for (MemPool* q : drv().default_pools) is_default |= q == pool;
    dev = pool->device;
  }
  int stream_dev = 0;
  if (CUresult r = stream_get_device(s, &stream_dev); r != kOk) return r;
  return allocate(p, size, dev, Kind::device, is_default);
}
API CUresult cuDeviceGetDefaultMemPool(CUmemPoolHandle_st** pool, int dev) {
  count("cuDeviceGetDefaultMemPool");
  if (!pool) return kInvalidValue;
  if (!drv().initialized) return kNotInit;
  if (dev < 0 || dev >= drv().devices) return kInvalidDevice;
  *pool = reinterpret_cast<CUmemPoolHandle_st*>(drv().default_pools[dev]);
  return kOk;
}
API CUresult cuMemPoolCreate(CUmemPoolHandle_st** pool, const void* props) {
  count("cuMemPoolCreate");
  if (!pool || !props) return kInvalidValue;
  auto* p = new MemPool();
  std::lock_guard g(drv().mu);
  drv().created_pools.push_back(p);
  *pool = reinterpret_cast<CUmemPoolHandle_st*>(p);
  return kOk;
}
API std::uint64_t fakecuda_pool_release_threshold(CUmemPoolHandle_st* h) {
  std::lock_guard g(drv().mu);
  MemPool* p = as_pool(h);
  return p ? p->release_threshold : UINT64_MAX;
}
// Attributes: 1-3 the Reuse* flags (int), 4 ReleaseThreshold, 5-8 Reserved/Used Current/High
// (cuuint64_t); the Current ones are read-only, the High ones accept only 0 (reset to current).
API CUresult cuMemPoolGetAttribute(CUmemPoolHandle_st* h, int attr, void* value) {
  count("cuMemPoolGetAttribute");
  std::lock_guard g(drv().mu);
  MemPool* p = as_pool(h);
  if (!p || !value) return kInvalidValue;
  std::uint64_t v = 0;
  switch (attr) {
    case 1:
    case 2:
    case 3:
      std::memcpy(value, &p->reuse[attr - 1], sizeof(int));
      return kOk;
    case 4:
      v = p->release_threshold;
      break;
    case 5:
      v = p->reserved;
      break;
    case 6:
      v = p->reserved_high;
      break;
    case 7:
      v = p->used;
      break;
    case 8:
      v = p->used_high;
      break;
    default:
      return kInvalidValue;
  }
  std::memcpy(value, &v, sizeof v);
  return kOk;
}
API CUresult cuMemPoolSetAttribute(CUmemPoolHandle_st* h, int attr, void* value) {
  count("cuMemPoolSetAttribute");
  std::lock_guard g(drv().mu);
  MemPool* p = as_pool(h);
  if (!p || !value) return kInvalidValue;
  std::uint64_t v = 0;
  if (attr >= 4) std::memcpy(&v, value, sizeof v);
  switch (attr) {
    case 1:
    case 2:
    case 3:
      std::memcpy(&p->reuse[attr - 1], value, sizeof(int));
      return kOk;
    case 4:
      p->release_threshold = v;
      return kOk;
    case 6:
      if (v != 0) return kInvalidValue;
      p->reserved_high = p->reserved;
      return kOk;
    case 8:
      if (v != 0) return kInvalidValue;
      p->used_high = p->used;
      return kOk;
    default:
      return kInvalidValue;  // 5 and 7 are read-only
  }
}
API CUresult cuMemPoolTrimTo(CUmemPoolHandle_st* h, std::size_t keep) {
  count("cuMemPoolTrimTo");
  std::lock_guard g(drv().mu);
  MemPool* p = as_pool(h);
  if (!p) return kInvalidValue;
  if (p->reserved > keep) p->reserved = std::max<std::uint64_t>(p->used, keep);
  return kOk;
}

// --- virtual memory management
// ------------------------------------------------------------------------
namespace {
constexpr std::size_t kGranularity = 2u << 20;
struct Physical {
  int fd;
  std::size_t size;
  int device;
  int refs;               // cuMemCreate and each cuMemRetainAllocationHandle, minus cuMemRelease
  int maps;               // mappings of it; the memory lives while either count is non-zero
  int handle_types = 0;   // requestedHandleTypes at cuMemCreate (1: POSIX file descriptor)
  bool imported = false;  // cuMemImportFromShareableHandle: another process's memory
};
struct Mapping {
  std::size_t size;
  std::uint64_t handle;
};
struct Vmm {
  std::mutex mu;
  std::uint64_t next_handle = 0x10000;
  std::map<std::uint64_t, Physical> handles;
  std::map<CUdeviceptr, std::size_t> reserved;
  std::map<CUdeviceptr, Mapping> mapped;
};
Vmm& vmm() {
  static Vmm* v = new Vmm();
  return *v;
}
// CUmemAllocationProp as cuda.h lays it out: type, requestedHandleTypes, location {type, id}.
struct PropHead {
  int type, handle_types, location_type, location_id;
};
bool in_reservation(const Vmm& v, CUdeviceptr p, std::size_t size) {
  auto it = v.reserved.upper_bound(p);
  if (it == v.reserved.begin()) return false;
  --it;
  return p >= it->first && p + size <= it->first + it->second;
}
}  // namespace

VMM_API CUresult cuMemGetAllocationGranularity(std::size_t* g, const void* prop, int /*option*/) {
  count("cuMemGetAllocationGranularity");
  if (!g || !prop) return kInvalidValue;
  *g = kGranularity;
  return kOk;
}
// POSIX file descriptor (type 1) only: a new descriptor of the handle's memfd.
VMM_API CUresult cuMemExportToShareableHandle(void* shareable, std::uint64_t handle, int type,
                                              unsigned long long flags);
VMM_API CUresult cuMemCreate(std::uint64_t* handle, std::size_t size, const void* prop,
                             unsigned long long flags) {
  count("cuMemCreate");
  note_args("cuMemCreate", reinterpret_cast<std::uintptr_t>(handle), size,
            reinterpret_cast<std::uintptr_t>(prop), flags);
  if (!handle || !prop || size == 0 || size % kGranularity != 0 || flags != 0) return kInvalidValue;
  PropHead head;
  std::memcpy(&head, prop, sizeof head);
  if (head.type != 1 || head.location_type != 1) return kInvalidValue;
  if (head.location_id < 0 || head.location_id >= drv().devices) return kInvalidDevice;
  {
    std::lock_guard g(drv().mu);
    if (drv().used[head.location_id] + size > drv().capacity) return kOom;
    drv().used[head.location_id] += size;
  }
  int fd = memfd_create("fake-cuda-physical", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) {
    if (fd >= 0) close(fd);
    std::lock_guard g(drv().mu);
    drv().used[head.location_id] -= size;
    return kOom;
  }
  std::lock_guard g(vmm().mu);
  std::uint64_t h = vmm().next_handle++;
  vmm().handles[h] = Physical{fd, size, head.location_id, 1, 0, head.handle_types, false};
  *handle = h;
  return kOk;
}
// Frees the memory once nothing references or maps it (vmm().mu held).
static void free_if_unused(std::map<std::uint64_t, Physical>::iterator it) {
  if (it->second.refs == 0 && it->second.maps == 0) {
    close(it->second.fd);
    if (!it->second.imported) {
      std::lock_guard g(drv().mu);
      drv().used[it->second.device] -= it->second.size;
    }
    vmm().handles.erase(it);
  }
}
VMM_API CUresult cuMemRelease(std::uint64_t handle) {
  count("cuMemRelease");
  note_args("cuMemRelease", handle);
  auto& v = vmm();
  std::lock_guard g(v.mu);
  auto it = v.handles.find(handle);
  if (it == v.handles.end() || it->second.refs == 0) return kInvalidValue;
  --it->second.refs;
  free_if_unused(it);
  return kOk;
}
// Sharing as POSIX file descriptors (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1): the export
// is a dup of the handle's memfd, so another process that imports it maps the same memory. Only
// handles created with that type in requestedHandleTypes can be exported, as on CUDA.
VMM_API CUresult cuMemExportToShareableHandle(void* shareable, std::uint64_t handle, int type,
                                              unsigned long long flags) {
  count("cuMemExportToShareableHandle");
  if (!shareable || type != 1 || flags != 0) return kInvalidValue;
  auto& v = vmm();
  std::lock_guard g(v.mu);
  auto it = v.handles.find(handle);
  if (it == v.handles.end() || it->second.refs == 0) return kInvalidValue;
  if ((it->second.handle_types & 1) == 0) return kNotSupported;
  int fd = fcntl(it->second.fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return kOom;
  std::memcpy(shareable, &fd, sizeof fd);
  return kOk;
}
VMM_API CUresult cuMemImportFromShareableHandle(std::uint64_t* handle, void* os_handle, int type) {
  count("cuMemImportFromShareableHandle");
  if (!handle || type != 1) return kInvalidValue;
  const int fd = static_cast<int>(reinterpret_cast<std::intptr_t>(os_handle));
  struct stat st {};
  if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0 ||
      st.st_size % kGranularity != 0) {
    return kInvalidValue;
  }
  int copy = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (copy < 0) return kOom;
  std::lock_guard g(vmm().mu);
  std::uint64_t h = vmm().next_handle++;
  vmm().handles[h] = Physical{copy, static_cast<std::size_t>(st.st_size), 0, 1, 0, 1, true};
  *handle = h;
  return kOk;
}
VMM_API CUresult cuMemRetainAllocationHandle(std::uint64_t* handle, void* addr) {
  count("cuMemRetainAllocationHandle");
  note_args("cuMemRetainAllocationHandle", reinterpret_cast<std::uintptr_t>(handle),
            reinterpret_cast<std::uintptr_t>(addr));
  if (!handle) return kInvalidValue;
  auto& v = vmm();
  std::lock_guard g(v.mu);
  auto p = reinterpret_cast<CUdeviceptr>(addr);
  auto it = v.mapped.upper_bound(p);
  if (it == v.mapped.begin()) return kInvalidValue;
  --it;
  if (p >= it->first + it->second.size) return kInvalidValue;
  auto h = v.handles.find(it->second.handle);
  if (h == v.handles.end()) return kInvalidValue;
  ++h->second.refs;
  *handle = it->second.handle;
  return kOk;
}
VMM_API CUresult cuMemAddressReserve(CUdeviceptr* ptr, std::size_t size, std::size_t alignment,
                                     CUdeviceptr addr, unsigned long long flags) {
  count("cuMemAddressReserve");
  note_args("cuMemAddressReserve", reinterpret_cast<std::uintptr_t>(ptr), size, alignment, addr,
            flags);
  if (!ptr || size == 0 || size % kGranularity != 0 || flags != 0) return kInvalidValue;
  if (alignment == 0) alignment = kGranularity;
  if (alignment % kGranularity != 0 || (alignment & (alignment - 1)) != 0) return kInvalidValue;
  // Over-reserve, then trim to the alignment.
  const std::size_t span = size + alignment;
  void* m = mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return kOom;
  auto base = reinterpret_cast<CUdeviceptr>(m);
  CUdeviceptr aligned = (base + alignment - 1) / alignment * alignment;
  if (aligned > base) munmap(m, aligned - base);
  if (aligned + size < base + span) {
    munmap(reinterpret_cast<void*>(aligned + size), base + span - aligned - size);
  }
  std::lock_guard g(vmm().mu);
  vmm().reserved[aligned] = size;
  *ptr = aligned;
  return kOk;
}
VMM_API CUresult cuMemAddressFree(CUdeviceptr ptr, std::size_t size) {
  count("cuMemAddressFree");
  note_args("cuMemAddressFree", ptr, size);
  auto& v = vmm();
  std::lock_guard g(v.mu);
  auto it = v.reserved.find(ptr);
  if (it == v.reserved.end() || it->second != size) return kInvalidValue;
  auto m = v.mapped.lower_bound(ptr);
  if (m != v.mapped.end() && m->first < ptr + size) return kInvalidValue;  // still mapped
  munmap(reinterpret_cast<void*>(ptr), size);
  v.reserved.erase(it);
  return kOk;
}
VMM_API CUresult cuMemMap(CUdeviceptr ptr, std::size_t size, std::size_t offset,
                          std::uint64_t handle, unsigned long long flags) {
  count("cuMemMap");
  note_args("cuMemMap", ptr, size, offset, handle, flags);
  if (size == 0 || size % kGranularity != 0 || offset % kGranularity != 0 ||
      ptr % kGranularity != 0 || flags != 0) {
    return kInvalidValue;
  }
  auto& v = vmm();
  std::lock_guard g(v.mu);
  auto h = v.handles.find(handle);
  if (h == v.handles.end() || h->second.refs == 0) return kInvalidHandle;
  if (offset > h->second.size || size > h->second.size - offset) return kInvalidValue;
  if (!in_reservation(v, ptr, size)) return kInvalidValue;
  auto next = v.mapped.lower_bound(ptr);
  if (next != v.mapped.end() && next->first < ptr + size) return kInvalidValue;  // overlap
  if (next != v.mapped.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.size > ptr) return kInvalidValue;
  }
  void* m = mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED,
                 h->second.fd, static_cast<off_t>(offset));
  if (m == MAP_FAILED) return kOom;
  v.mapped[ptr] = Mapping{size, handle};
  ++h->second.maps;
  return kOk;
}
VMM_API CUresult cuMemUnmap(CUdeviceptr ptr, std::size_t size) {
  count("cuMemUnmap");
  note_args("cuMemUnmap", ptr, size);
  auto& v = vmm();
  std::lock_guard g(v.mu);
  // The range must cover whole mappings, starting at one.
  auto it = v.mapped.find(ptr);
  if (it == v.mapped.end() || size == 0) return kInvalidValue;
  CUdeviceptr end = ptr;
  for (auto m = it; m != v.mapped.end() && m->first == end && end < ptr + size; ++m) {
    end += m->second.size;
  }
  if (end != ptr + size) return kInvalidValue;
  for (auto m = it; m != v.mapped.end() && m->first < ptr + size; ++m) {
    auto h = v.handles.find(m->second.handle);
    if (h != v.handles.end()) {
      --h->second.maps;
      free_if_unused(h);
    }
  }
  v.mapped.erase(it, v.mapped.lower_bound(ptr + size));
  mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE,
       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  return kOk;
}
// CUmemAccessDesc: location {type, id}, flags (0 none, 1 read, 3 read-write).
VMM_API CUresult cuMemSetAccess(CUdeviceptr ptr, std::size_t size, const void* desc,
                                std::size_t n) {
  count("cuMemSetAccess");
  if (!desc || n == 0 || size == 0) return kInvalidValue;
  int flags = 0;
  for (std::size_t i = 0; i < n; ++i) {
    int entry[3];
    std::memcpy(entry, static_cast<const char*>(desc) + i * sizeof entry, sizeof entry);
    flags |= entry[2];
  }
  auto& v = vmm();
  std::lock_guard g(v.mu);
  // Every byte of the range must be mapped.
  CUdeviceptr at = ptr;
  auto it = v.mapped.upper_bound(ptr);
  if (it == v.mapped.begin()) return kInvalidValue;
  --it;
  if (it->first + it->second.size <= ptr) return kInvalidValue;
  for (; it != v.mapped.end() && it->first <= at && at < ptr + size; ++it) {
    at = it->first + it->second.size;
  }
  if (at < ptr + size) return kInvalidValue;
  const int prot = flags & 2 ? PROT_READ | PROT_WRITE : flags & 1 ? PROT_READ : PROT_NONE;
  return mprotect(reinterpret_cast<void*>(ptr), size, prot) == 0 ? kOk : kInvalidValue;
}

// --- cuGetProcAddress
// --------------------------------------------------------------------------------------
namespace {
struct Proc {
  const char* base;
  int since;
  void* fn;
  void* ptsz;
};
#define FN(f) reinterpret_cast<void*>(&f)
}  // namespace
API CUresult cuGetProcAddress_v2(const char*, void**, int, std::uint64_t, int*);
API CUresult cuGetProcAddress(const char*, void**, int, std::uint64_t);
namespace {
const Proc kProcs[] = {
    {"cuInit", 2000, FN(cuInit), nullptr},
    {"cuDriverGetVersion", 2020, FN(cuDriverGetVersion), nullptr},
    {"cuDeviceGetCount", 2000, FN(cuDeviceGetCount), nullptr},
    {"cuDeviceGet", 2000, FN(cuDeviceGet), nullptr},
    {"cuDeviceTotalMem", 3020, FN(cuDeviceTotalMem_v2), nullptr},
    {"cuDeviceGetAttribute", 2000, FN(cuDeviceGetAttribute), nullptr},
    {"cuDevicePrimaryCtxRetain", 7000, FN(cuDevicePrimaryCtxRetain), nullptr},
    {"cuDevicePrimaryCtxRelease", 11000, FN(cuDevicePrimaryCtxRelease_v2), nullptr},
    {"cuCtxSetCurrent", 4000, FN(cuCtxSetCurrent), nullptr},
    {"cuCtxGetCurrent", 4000, FN(cuCtxGetCurrent), nullptr},
    {"cuCtxPushCurrent", 4000, FN(cuCtxPushCurrent_v2), nullptr},
    {"cuCtxPopCurrent", 4000, FN(cuCtxPopCurrent_v2), nullptr},
    {"cuCtxGetDevice", 2000, FN(cuCtxGetDevice), nullptr},
    {"cuCtxSynchronize", 2000, FN(cuCtxSynchronize), nullptr},
    {"cuCtxEnablePeerAccess", 4000, FN(cuCtxEnablePeerAccess), nullptr},
    {"cuStreamCreate", 2000, FN(cuStreamCreate), nullptr},
    {"cuStreamDestroy", 4000, FN(cuStreamDestroy_v2), nullptr},
    {"cuStreamSynchronize", 2000, FN(cuStreamSynchronize), nullptr},
    {"cuStreamIsCapturing", 10000, FN(cuStreamIsCapturing), FN(cuStreamIsCapturing_ptsz)},
    {"cuStreamGetDevice", 12080, FN(cuStreamGetDevice), FN(cuStreamGetDevice_ptsz)},
    {"cuMemAlloc", 2000, FN(cuMemAlloc), nullptr},
    {"cuMemAlloc", 3020, FN(cuMemAlloc_v2), nullptr},
    {"cuMemFree", 3020, FN(cuMemFree_v2), nullptr},
    {"cuMemAllocAsync", 11020, FN(cuMemAllocAsync), FN(cuMemAllocAsync_ptsz)},
    {"cuMemAllocFromPoolAsync", 11020, FN(cuMemAllocFromPoolAsync),
     FN(cuMemAllocFromPoolAsync_ptsz)},
    {"cuMemFreeAsync", 11020, FN(cuMemFreeAsync), FN(cuMemFreeAsync_ptsz)},
    {"cuMemAllocPitch", 3020, FN(cuMemAllocPitch_v2), nullptr},
    {"cuMemAllocManaged", 6000, FN(cuMemAllocManaged), nullptr},
    {"cuMemAllocHost", 3020, FN(cuMemAllocHost_v2), nullptr},
    {"cuMemFreeHost", 2000, FN(cuMemFreeHost), nullptr},
    {"cuMemGetInfo", 3020, FN(cuMemGetInfo_v2), nullptr},
    {"cuMemGetAddressRange", 3020, FN(cuMemGetAddressRange_v2), nullptr},
    {"cuPointerGetAttribute", 4000, FN(cuPointerGetAttribute), nullptr},
    {"cuPointerGetAttributes", 7000, FN(cuPointerGetAttributes), nullptr},
    {"cuIpcGetMemHandle", 4010, FN(cuIpcGetMemHandle), nullptr},
    {"cuIpcOpenMemHandle", 11000, FN(cuIpcOpenMemHandle_v2), nullptr},
    {"cuIpcCloseMemHandle", 4010, FN(cuIpcCloseMemHandle), nullptr},
    {"cuDeviceGetDefaultMemPool", 11020, FN(cuDeviceGetDefaultMemPool), nullptr},
    {"cuMemPoolCreate", 11020, FN(cuMemPoolCreate), nullptr},
    {"cuMemPoolGetAttribute", 11020, FN(cuMemPoolGetAttribute), nullptr},
    {"cuMemPoolSetAttribute", 11020, FN(cuMemPoolSetAttribute), nullptr},
    {"cuMemPoolTrimTo", 11020, FN(cuMemPoolTrimTo), nullptr},
#ifndef FAKE_CUDA_NO_VMM
    {"cuMemGetAllocationGranularity", 10020, FN(cuMemGetAllocationGranularity), nullptr},
    {"cuMemCreate", 10020, FN(cuMemCreate), nullptr},
    {"cuMemRelease", 10020, FN(cuMemRelease), nullptr},
    {"cuMemRetainAllocationHandle", 11000, FN(cuMemRetainAllocationHandle), nullptr},
    {"cuMemAddressReserve", 10020, FN(cuMemAddressReserve), nullptr},
    {"cuMemAddressFree", 10020, FN(cuMemAddressFree), nullptr},
    {"cuMemExportToShareableHandle", 10020, FN(cuMemExportToShareableHandle), nullptr},
    {"cuMemMap", 10020, FN(cuMemMap), nullptr},
    {"cuMemUnmap", 10020, FN(cuMemUnmap), nullptr},
    {"cuMemSetAccess", 10020, FN(cuMemSetAccess), nullptr},
    {"cuMemImportFromShareableHandle", 10020, FN(cuMemImportFromShareableHandle), nullptr},
#endif
    {"cuGetProcAddress", 11030, FN(cuGetProcAddress), nullptr},
    {"cuGetProcAddress", 12000, FN(cuGetProcAddress_v2), nullptr},
};
}  // namespace

API CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version, std::uint64_t flags,
                                 int* status) {
  count("cuGetProcAddress_v2");
  if (!symbol || !pfn) return kInvalidValue;
  *pfn = nullptr;
  const Proc* best = nullptr;
  bool seen = false;
  for (const Proc& p : kProcs) {
    if (std::strcmp(p.base, symbol) != 0) continue;
    seen = true;
    if (p.since <= version && (!best || p.since > best->since)) best = &p;
  }
  if (!best) {
    if (status) *status = seen ? 2 : 1;
    return kNotFound;
  }
  *pfn = (flags & 2) && best->ptsz ? best->ptsz : best->fn;
  if (status) *status = 0;
  return kOk;
}
API CUresult cuGetProcAddress(const char* symbol, void** pfn, int version, std::uint64_t flags) {
  count("cuGetProcAddress");
  return cuGetProcAddress_v2(symbol, pfn, version, flags, nullptr);
}
