// The device a core test runs on: the simulated backend by default, the CUDA backend when
// GPUSTITCH_TEST_BACKEND=cuda (GPU runs, ctest label "gpu").
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "gpustitch/backend.h"
#include "gpustitch/config.h"
#include "gpustitch/sim_backend.h"

struct TestDevice {
  std::unique_ptr<gpustitch::Backend> backend;
  gpustitch::SimBackend* sim =
      nullptr;  // null when the backend is CUDA (fault injection etc. unavailable)
  // Copy bytes to/from device memory at ptr (host memcpy on sim, cuMemcpyHtoD/DtoH on CUDA).
  std::function<void(gpustitch::DevPtr, const void*, std::size_t)> write;
  std::function<void(gpustitch::DevPtr, void*, std::size_t)> read;
};
// GPUSTITCH_TEST_BACKEND=cuda selects the CUDA backend; otherwise sim with these options.
TestDevice make_test_device(const gpustitch::SimOptions& sim_options = {});

// A simulated device whose every fence (synchronize) takes ns: a busy device, on which the pool
// does not fence under its lock once it has timed one.
inline gpustitch::SimOptions slow_fences(std::uint32_t ns) {
  gpustitch::SimOptions o;
  o.call_ns[static_cast<std::size_t>(gpustitch::SimOp::synchronize)] = ns;
  return o;
}

// A pool configuration whose frees are fenced only when the pool needs memory or a test drains
// them (no reclaimer thread), so that which blocks are cached is deterministic.
inline gpustitch::Config inline_config() {
  gpustitch::Config c;
  c.background_reclaim = false;
  return c;
}

// A configuration whose stream-ordered fresh blocks of 256 MiB and more come in large handles,
// as cudaMalloc's do (stream_fresh_coarse_mb:0): for tests of what a stream's cut does inside one.
inline gpustitch::Config stream_coarse(gpustitch::Config c = {}) {
  c.stream_fresh_coarse = 0;
  return c;
}

// inline_config() without the memory-first phase (memory_first_mb:0): for tests of the handle
// sizes and placement the heap uses once that phase is over.
inline gpustitch::Config no_memory_first() {
  gpustitch::Config c = inline_config();
  c.memory_first = 0;
  return c;
}

// Writes an 8-byte tag at the start, the middle and the end of [p, p+size); check() reads them
// back.
inline void stamp(TestDevice& d, gpustitch::DevPtr p, std::size_t size, std::uint64_t tag) {
  for (std::size_t off : {std::size_t{0}, size / 2 / 8 * 8, size - 8}) d.write(p + off, &tag, 8);
}
inline bool check(TestDevice& d, gpustitch::DevPtr p, std::size_t size, std::uint64_t tag) {
  for (std::size_t off : {std::size_t{0}, size / 2 / 8 * 8, size - 8}) {
    std::uint64_t got = 0;
    d.read(p + off, &got, 8);
    if (got != tag) return false;
  }
  return true;
}
