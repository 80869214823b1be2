// vmm_probe: measures on the GPU the virtual-memory facts the pool's design depends on.
//
//  1. Whether cuMemMap accepts a non-zero, granularity-aligned offset into a handle (older docs
//     and HIP say the offset must be 0). If it does, free slices of a partly used big handle can
//     be stitched; if not, only whole free handles can.
//  2. The cost of each VMM call for one handle of 2 MiB, 64 MiB and 1 GiB.
//  3. What asking for the POSIX file descriptor handle type at cuMemCreate costs (CUDA IPC on
//     pool memory needs it), alone and with RDMA as the backend asks, and what exporting a handle
//     as a descriptor and importing it back cost.
//  4. The cost of stitching 1 GiB from 512 x 2 MiB handles, from 16 x 64 MiB handles, and from
//     slices of one 1 GiB handle (offset maps, when supported): create, map, set access, unmap,
//     release, each phase timed as a whole. "remap" maps the same pieces again into a new range
//     and sets access: the cost of re-stitching memory the pool already holds.
// Prints a markdown table (microseconds, median of the repetitions). The driver is loaded at run
// time like the backend does; nothing links libcuda.
//
// Usage: vmm_probe [--reps N] [--device D]
#include <cuda.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

// clang-format off
#define DRIVER_FUNCTIONS(X) \
  X(cuInit) \
  X(cuDeviceGet) \
  X(cuDeviceGetName) \
  X(cuDeviceGetAttribute) \
  X(cuDevicePrimaryCtxRetain) \
  X(cuCtxPushCurrent) \
  X(cuMemGetAllocationGranularity) \
  X(cuMemAddressReserve) \
  X(cuMemAddressFree) \
  X(cuMemCreate) \
  X(cuMemRelease) \
  X(cuMemMap) \
  X(cuMemUnmap) \
  X(cuMemSetAccess) \
  X(cuMemGetInfo) \
  X(cuMemExportToShareableHandle) \
  X(cuMemImportFromShareableHandle) \
  X(cuDriverGetVersion)
// clang-format on

struct Driver {
#define DECLARE(name) decltype(&::name) name = nullptr;
  DRIVER_FUNCTIONS(DECLARE)
#undef DECLARE
} drv;

void die(const char* what, CUresult r = CUDA_SUCCESS) {
  std::printf("FAIL: %s (CUresult %d)\n", what, static_cast<int>(r));
  std::exit(1);
}

#define CHECK(call)                         \
  do {                                      \
    const CUresult r_ = (call);             \
    if (r_ != CUDA_SUCCESS) die(#call, r_); \
  } while (0)

void load_driver() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) die("dlopen libcuda.so.1");
  using GetProc =
      CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
  auto get_proc = reinterpret_cast<GetProc>(dlsym(lib, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) die("dlsym cuGetProcAddress_v2");
#define RESOLVE(name)                                                                         \
  {                                                                                           \
    void* p = nullptr;                                                                        \
    CUdriverProcAddressQueryResult q;                                                         \
    if (get_proc(#name, &p, CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &q) != CUDA_SUCCESS || \
        p == nullptr)                                                                         \
      die("resolve " #name);                                                                  \
    drv.name = reinterpret_cast<decltype(drv.name)>(p);                                       \
  }
  DRIVER_FUNCTIONS(RESOLVE)
#undef RESOLVE
}

using Clock = std::chrono::steady_clock;
double us_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

CUdevice dev;
CUmemAllocationProp prop{};
CUmemAccessDesc access{};
std::size_t gran = 0;

struct Phases {
  std::vector<double> create, reserve, map, set_access, unmap, release, remap;
};

// One handle of `size`, each call timed.
void single_handle(std::size_t size, Phases& ph) {
  CUmemGenericAllocationHandle h;
  CUdeviceptr va;
  auto t = Clock::now();
  CHECK(drv.cuMemCreate(&h, size, &prop, 0));
  ph.create.push_back(us_since(t));
  t = Clock::now();
  CHECK(drv.cuMemAddressReserve(&va, size, gran, 0, 0));
  ph.reserve.push_back(us_since(t));
  t = Clock::now();
  CHECK(drv.cuMemMap(va, size, 0, h, 0));
  ph.map.push_back(us_since(t));
  t = Clock::now();
  CHECK(drv.cuMemSetAccess(va, size, &access, 1));
  ph.set_access.push_back(us_since(t));
  t = Clock::now();
  CHECK(drv.cuMemUnmap(va, size));
  ph.unmap.push_back(us_since(t));
  t = Clock::now();
  CHECK(drv.cuMemRelease(h));
  ph.release.push_back(us_since(t));
  CHECK(drv.cuMemAddressFree(va, size));
}

// total bytes stitched from pieces of piece bytes. slices: the pieces are slices of one handle
// (mapped at offsets, in reverse order, as scattered free slices would be).
void stitch(std::size_t total, std::size_t piece, bool slices, Phases& ph) {
  const std::size_t n = total / piece;
  std::vector<CUmemGenericAllocationHandle> hs(slices ? 1 : n);
  auto t = Clock::now();
  if (slices) {
    CHECK(drv.cuMemCreate(&hs[0], total, &prop, 0));
  } else {
    for (auto& h : hs) CHECK(drv.cuMemCreate(&h, piece, &prop, 0));
  }
  ph.create.push_back(us_since(t));
  CUdeviceptr va, va2;
  t = Clock::now();
  CHECK(drv.cuMemAddressReserve(&va, total, gran, 0, 0));
  ph.reserve.push_back(us_since(t));
  CHECK(drv.cuMemAddressReserve(&va2, total, gran, 0, 0));
  auto map_all = [&](CUdeviceptr base) {
    for (std::size_t i = 0; i < n; ++i) {
      if (slices) {
        CHECK(drv.cuMemMap(base + i * piece, piece, (n - 1 - i) * piece, hs[0], 0));
      } else {
        CHECK(drv.cuMemMap(base + i * piece, piece, 0, hs[i], 0));
      }
    }
  };
  auto unmap_all = [&](CUdeviceptr base) {
    for (std::size_t i = 0; i < n; ++i) CHECK(drv.cuMemUnmap(base + i * piece, piece));
  };
  t = Clock::now();
  map_all(va);
  ph.map.push_back(us_since(t));
  t = Clock::now();
  CHECK(drv.cuMemSetAccess(va, total, &access, 1));
  ph.set_access.push_back(us_since(t));
  t = Clock::now();
  unmap_all(va);
  ph.unmap.push_back(us_since(t));
  // Re-stitch the same pieces into another range: what reusing held memory costs.
  t = Clock::now();
  map_all(va2);
  CHECK(drv.cuMemSetAccess(va2, total, &access, 1));
  ph.remap.push_back(us_since(t));
  unmap_all(va2);
  t = Clock::now();
  for (auto h : hs) CHECK(drv.cuMemRelease(h));
  ph.release.push_back(us_since(t));
  CHECK(drv.cuMemAddressFree(va, total));
  CHECK(drv.cuMemAddressFree(va2, total));
}

bool probe_map_offset() {
  CUmemGenericAllocationHandle h;
  CHECK(drv.cuMemCreate(&h, 2 * gran, &prop, 0));
  CUdeviceptr va;
  CHECK(drv.cuMemAddressReserve(&va, gran, gran, 0, 0));
  const CUresult r = drv.cuMemMap(va, gran, gran, h, 0);
  std::printf("cuMemMap(offset = %zu KiB) returned CUresult %d\n", gran / 1024,
              static_cast<int>(r));
  if (r == CUDA_SUCCESS) {
    CHECK(drv.cuMemSetAccess(va, gran, &access, 1));
    CHECK(drv.cuMemUnmap(va, gran));
  }
  CHECK(drv.cuMemAddressFree(va, gran));
  CHECK(drv.cuMemRelease(h));
  return r == CUDA_SUCCESS;
}

std::string size_name(std::size_t b) {
  char s[32];
  if (b >= (1ull << 30)) {
    std::snprintf(s, sizeof s, "%zu GiB", b >> 30);
  } else {
    std::snprintf(s, sizeof s, "%zu MiB", b >> 20);
  }
  return s;
}

void row(const std::string& what, const Phases& p, bool remap) {
  auto cell = [](const std::vector<double>& v) {
    char s[32];
    if (v.empty()) return std::string("-");
    std::snprintf(s, sizeof s, "%.1f", median(v));
    return std::string(s);
  };
  const double total =
      median(p.create) + median(p.map) + median(p.set_access) + median(p.unmap) + median(p.release);
  std::printf("| %s | %s | %s | %s | %s | %s | %s | %s | %.1f |\n", what.c_str(),
              cell(p.create).c_str(), cell(p.reserve).c_str(), cell(p.map).c_str(),
              cell(p.set_access).c_str(), cell(p.unmap).c_str(), cell(p.release).c_str(),
              remap ? cell(p.remap).c_str() : "-", total);
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 5, device = 0;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc)
      reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--device") && i + 1 < argc)
      device = std::atoi(argv[++i]);
    else {
      std::printf("usage: vmm_probe [--reps N] [--device D]\n");
      return 2;
    }
  }
  load_driver();
  CHECK(drv.cuInit(0));
  CHECK(drv.cuDeviceGet(&dev, device));
  CUcontext ctx;
  CHECK(drv.cuDevicePrimaryCtxRetain(&ctx, dev));
  CHECK(drv.cuCtxPushCurrent(ctx));
  char name[256] = {};
  drv.cuDeviceGetName(name, sizeof name, dev);
  int version = 0;
  drv.cuDriverGetVersion(&version);

  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  std::size_t min_gran = 0;
  CHECK(drv.cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  CHECK(drv.cuMemGetAllocationGranularity(&min_gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  std::size_t free = 0, total = 0;
  CHECK(drv.cuMemGetInfo(&free, &total));

  std::printf("## vmm_probe: %s, driver API %d, device %d\n\n", name, version, device);
  std::printf("granularity: recommended %zu KiB, minimum %zu KiB; free %zu MiB of %zu MiB\n",
              gran / 1024, min_gran / 1024, free >> 20, total >> 20);
  const bool offset_ok = probe_map_offset();
  std::printf("map at a non-zero handle offset: %s\n\n", offset_ok ? "SUPPORTED" : "NOT SUPPORTED");

  // Warm-up: the first calls of a process pay one-time costs.
  {
    Phases warm;
    single_handle(gran, warm);
  }

  std::printf(
      "| operation (us, median of %d) | create | reserve | map | set access | unmap | release | "
      "remap + set access | create..release |\n",
      reps);
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (std::size_t size : {2ull << 20, 64ull << 20, 1ull << 30}) {
    Phases p;
    for (int r = 0; r < reps; ++r) single_handle(size, p);
    row("one " + size_name(size) + " handle", p, false);
  }
  // The CUDA backend asks for exportable (POSIX fd) and RDMA-capable handles where supported:
  // does that change the cost?
  {
    int posix_fd = 0, rdma = 0;
    drv.cuDeviceGetAttribute(&posix_fd,
                             CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev);
    drv.cuDeviceGetAttribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                             dev);
    const CUmemAllocationProp plain = prop;
    if (posix_fd) prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    if (rdma) prop.allocFlags.gpuDirectRDMACapable = 1;
    for (std::size_t size : {2ull << 20, 1ull << 30}) {
      Phases p;
      for (int r = 0; r < reps; ++r) single_handle(size, p);
      row("one " + size_name(size) + " handle" + (posix_fd ? ", POSIX fd" : "") +
              (rdma ? ", RDMA" : "") + " (as the backend creates)",
          p, false);
    }
    prop = plain;
  }
  // The POSIX fd type alone against no shareable type (CUDA IPC on pool memory), and the cost of
  // one export (cuMemExportToShareableHandle) and one import (cuMemImportFromShareableHandle).
  {
    int posix_fd = 0;
    drv.cuDeviceGetAttribute(&posix_fd,
                             CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev);
    if (!posix_fd) {
      std::printf(
          "| cuMemCreate, POSIX fd handle type | not supported by the device | | | | | | | |\n");
    } else {
      const CUmemAllocationProp plain = prop;
      for (std::size_t size : {2ull << 20, 64ull << 20, 1ull << 30}) {
        Phases none, fd;
        for (int r = 0; r < reps; ++r) {  // interleaved, so drift affects both alike
          prop = plain;
          single_handle(size, none);
          prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
          single_handle(size, fd);
        }
        row("one " + size_name(size) + " handle, no shareable type", none, false);
        row("one " + size_name(size) + " handle, POSIX fd handle type", fd, false);
      }
      prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
      std::vector<double> exports, imports;
      for (int r = 0; r < reps; ++r) {
        CUmemGenericAllocationHandle h, back;
        CHECK(drv.cuMemCreate(&h, 2ull << 20, &prop, 0));
        int fd = -1;
        auto t = Clock::now();
        CHECK(
            drv.cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
        exports.push_back(us_since(t));
        t = Clock::now();
        CHECK(drv.cuMemImportFromShareableHandle(&back,
                                                 reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
        imports.push_back(us_since(t));
        CHECK(drv.cuMemRelease(back));
        CHECK(drv.cuMemRelease(h));
        if (FILE* f = fdopen(fd, "r")) std::fclose(f);  // closes fd (unistd.h's access clashes)
      }
      prop = plain;
      std::printf(
          "| 2 MiB handle: export as fd %.1f us, import from fd %.1f us (median) | | | | | "
          "| | | |\n",
          median(exports), median(imports));
    }
  }
  struct Case {
    std::size_t piece;
    bool slices;
  };
  for (Case c : {Case{2ull << 20, false}, Case{64ull << 20, false}, Case{2ull << 20, true},
                 Case{64ull << 20, true}}) {
    if (c.slices && !offset_ok) {
      std::printf("| 1 GiB from %zu slices of one handle | not supported | | | | | | | |\n",
                  static_cast<std::size_t>((1ull << 30) / c.piece));
      continue;
    }
    Phases p;
    for (int r = 0; r < reps; ++r) stitch(1ull << 30, c.piece, c.slices, p);
    char what[96];
    std::snprintf(what, sizeof what, "1 GiB stitched from %zu x %s %s",
                  static_cast<std::size_t>((1ull << 30) / c.piece), size_name(c.piece).c_str(),
                  c.slices ? "slices of one handle" : "handles");
    row(what, p, true);
  }
  std::printf("\nPASS: vmm_probe\n");
  return 0;
}
