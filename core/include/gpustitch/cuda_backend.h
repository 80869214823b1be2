// The CUDA driver backend: virtual memory management through libcuda.so.1, loaded at run time.
// Nothing links libcuda or libcudart, so every binary loads on a machine without a driver.
#pragma once

#include <memory>
#include <string>

#include "gpustitch/backend.h"

namespace gpustitch {

// Resolves a driver entry point by name ("cuMemCreate"), returning the real driver function.
// The preload shim passes one that bypasses its own hooks; null means dlopen("libcuda.so.1") and
// the driver's own cuGetProcAddress.
using DriverResolver = void* (*)(const char* symbol, void* context);

// Loads the driver and checks that every device supports virtual memory management. On failure
// returns null and sets *why (e.g. "libcuda.so.1 not found", "device 0 lacks VMM support").
// shareable: create physical memory exportable as POSIX file descriptors where the device supports
// it (CUDA IPC on pool memory); false (ipc:native, where pool memory is never exported) creates
// it without, as does a device or driver that refuses the type.
std::unique_ptr<Backend> make_cuda_backend(std::string* why, DriverResolver resolver = nullptr,
                                           void* resolver_context = nullptr, bool shareable = true);

}  // namespace gpustitch
