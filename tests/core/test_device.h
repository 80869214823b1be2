// The device the core's tests run on: the simulated backend by default, the real GPU through the
// CUDA backend when GPUSTITCH_TEST_BACKEND=cuda. Tests read and write device memory only through
// write/read, so the same test body checks bytes on both.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

#include "gpustitch/backend.h"
#include "gpustitch/sim_backend.h"

struct TestDevice {
  std::unique_ptr<gpustitch::Backend> backend;
  // null when the backend is CUDA (fault injection etc. unavailable)
  gpustitch::SimBackend* sim = nullptr;
  // Copy bytes to/from device memory at ptr (host memcpy on sim, cuMemcpyHtoD/DtoH on CUDA).
  std::function<void(gpustitch::DevPtr, const void*, std::size_t)> write;
  std::function<void(gpustitch::DevPtr, void*, std::size_t)> read;
};
// GPUSTITCH_TEST_BACKEND=cuda selects the CUDA backend; otherwise sim with these options.
TestDevice make_test_device(const gpustitch::SimOptions& sim_options = {});
