// A small CUDA program for the process-level tests (process_test.cpp): it allocates through the
// shared runtime and prints what happened as key=value pairs on stdout. The tests run it under
// different environments (no driver, configuration variants) and read its output and stderr.
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_decls.h"
#include "shim_api.h"

// The PyTorch pluggable-allocator use: the library dlopen'ed (as ctypes does, RTLD_LOCAL), nothing
// preloaded, allocations through gpustitch_malloc/gpustitch_free only.
int pluggable(const char* library) {
  void* h = dlopen(library, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    std::printf("dlopen failed: %s\n", dlerror());
    return 1;
  }
  auto m = reinterpret_cast<void* (*)(long, int, CUstream_st*)>(dlsym(h, "gpustitch_malloc"));
  auto f = reinterpret_cast<void (*)(void*, long, int, CUstream_st*)>(dlsym(h, "gpustitch_free"));
  auto owns = reinterpret_cast<int (*)(const void*)>(dlsym(h, "gpustitch_owns"));
  auto active = reinterpret_cast<int (*)()>(dlsym(h, "gpustitch_active"));
  CUstream_st* s = nullptr;
  cudaSetDevice(0);
  cudaStreamCreate(&s);
  void* p = m(1 << 20, 0, s);
  int ok = p != nullptr && owns(p) == 1;
  if (p) std::memset(p, 0x42, 1 << 20);
  void* q = m(1 << 20, 0, s);
  ok = ok && q && q != p && static_cast<unsigned char*>(p)[(1 << 20) - 1] == 0x42;
  f(p, 1 << 20, 0, s);
  f(q, 1 << 20, 0, s);
  cudaStreamDestroy(s);
  std::printf("pluggable active=%d ok=%d owned_after_free=%d\n", active(), ok, owns(p));
  return 0;
}

// `gpustitch snapshot` of this very process while it holds memory: a live 3 MiB block, a live
// 4 KiB one, and a freed 8 MiB one the pool keeps cached. Runs CLI (without the preload) and
// prints its exit status.
int snapshot(const char* cli, const char* out) {
  cudaSetDevice(0);
  void *large = nullptr, *small = nullptr, *cached = nullptr;
  int rc = cudaMalloc(&large, 3 << 20) | cudaMalloc(&small, 4096) | cudaMalloc(&cached, 8 << 20);
  if (rc == 0) rc = cudaFree(cached);
  std::printf("alloc_rc=%d large=%p small=%p\n", rc, large, small);
  std::fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    unsetenv("LD_PRELOAD");
    std::string self = std::to_string(getppid());
    execl(cli, cli, "snapshot", self.c_str(), "-o", out, static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  std::printf("snapshot_rc=%d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  cudaFree(large);
  cudaFree(small);
  return 0;
}

// An out-of-memory through cudaMalloc of `mb` MiB, after pinning scatter_mb MiB of small-object
// chunks: 4 KiB blocks fill them and one block in 512 stays live, so their memory is cached but
// can neither be released nor stitched. Prints the result; the shim's line is on stderr.
int oom(long mb, long scatter_mb) {
  cudaSetDevice(0);
  std::vector<void*> small;
  for (long i = 0; i < scatter_mb * 256; ++i) {
    void* p = nullptr;
    if (cudaMalloc(&p, 4096) != 0) break;
    small.push_back(p);
  }
  for (std::size_t i = 0; i < small.size(); ++i) {
    if (i % 512 != 0) cudaFree(small[i]);
  }
  void* p = nullptr;
  int rc = cudaMalloc(&p, static_cast<std::size_t>(mb) << 20);
  std::printf("oom_rc=%d pinned=%zu\n", rc, small.size() / 512);
  std::fflush(stdout);
  return 0;
}

// CUDA IPC on pool memory under ipc:native: stream-ordered memory is the pool's, and both APIs
// refuse to export it, twice each (the error is logged once per API).
int ipc_native() {
  cudaSetDevice(0);
  // The probe links the runtime only: the driver's entry point as a program finds it in the
  // driver the runtime loaded (the shim's, when preloaded).
  void* libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  auto driver_get =
      libcuda ? reinterpret_cast<int (*)(void*, CUdeviceptr)>(dlsym(libcuda, "cuIpcGetMemHandle"))
              : nullptr;
  void* a = nullptr;
  const int async_rc = cudaMallocAsync(&a, 1 << 20, nullptr);
  unsigned char handle[64];
  int runtime_rc[2] = {-1, -1}, driver_rc[2] = {-1, -1};
  for (int i = 0; i < 2 && async_rc == 0; ++i) {
    runtime_rc[i] = cudaIpcGetMemHandle(handle, a);
    if (driver_get) driver_rc[i] = driver_get(handle, reinterpret_cast<CUdeviceptr>(a));
  }
  const int owned = shim::owns(a) ? 1 : 0;
  if (async_rc == 0) cudaFreeAsync(a, nullptr);
  std::printf("ipc_native owned=%d runtime_rc=%d,%d driver_rc=%d,%d\n", owned, runtime_rc[0],
              runtime_rc[1], driver_rc[0], driver_rc[1]);
  return 0;
}

int main(int argc, char** argv) {
  const char* action = argc > 1 ? argv[1] : "alloc";
  if (std::strcmp(action, "pluggable") == 0 && argc > 2) return pluggable(argv[2]);
  if (std::strcmp(action, "snapshot") == 0 && argc > 3) return snapshot(argv[2], argv[3]);
  if (std::strcmp(action, "oom") == 0 && argc > 3)
    return oom(std::atol(argv[2]), std::atol(argv[3]));
  if (std::strcmp(action, "ipc_native") == 0) return ipc_native();
  if (std::strcmp(action, "alloc") != 0) return 2;
  cudaSetDevice(0);
  void* libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);  // loaded by the runtime
  auto driver_calls =
      libcuda ? reinterpret_cast<int (*)(const char*)>(dlsym(libcuda, "fakecuda_calls")) : nullptr;
  void* p = nullptr;
  int rc = cudaMalloc(&p, 1 << 20);
  int owned = shim::owns(p);
  unsigned char handle[64];
  int ipc_rc = rc == 0 ? cudaIpcGetMemHandle(handle, p) : -1;
  void* a = nullptr;
  int async_rc = cudaMallocAsync(&a, 1 << 20, nullptr);
  int async_owned = shim::owns(a);
  if (rc == 0) cudaFree(p);
  if (async_rc == 0) cudaFreeAsync(a, nullptr);
  std::printf(
      "active=%d malloc_rc=%d owned=%d ipc_rc=%d async_rc=%d async_owned=%d "
      "driver_allocs=%d pool_allocs=%llu\n",
      shim::active(), rc, owned, ipc_rc, async_rc, async_owned,
      driver_calls ? driver_calls("cuMemAlloc_v2") : -1,
      static_cast<unsigned long long>(shim::stats(0).allocs));
  return 0;
}
