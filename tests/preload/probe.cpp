// A small CUDA program for the process-level tests (process_test.cpp): it allocates through the
// shared runtime and prints what happened as key=value pairs on stdout. The tests run it under
// different environments (no driver, configuration variants) and read its output and stderr.
#include <dlfcn.h>

#include <cstdio>
#include <cstring>

#include "cuda_decls.h"
#include "shim_api.h"

int main(int argc, char** argv) {
  const char* action = argc > 1 ? argv[1] : "alloc";
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
  std::printf("active=%d malloc_rc=%d owned=%d ipc_rc=%d async_rc=%d async_owned=%d "
              "driver_allocs=%d pool_allocs=%llu\n",
              shim::active(), rc, owned, ipc_rc, async_rc, async_owned,
              driver_calls ? driver_calls("cuMemAlloc_v2") : -1,
              static_cast<unsigned long long>(shim::stats(0).allocs));
  return 0;
}
