// Simulated branch of make_test_device (the CUDA branch lives in cuda_test_device.cpp).
#include <cstring>

#include "test_device.h"

TestDevice make_test_device(const gpustitch::SimOptions& sim_options) {
  TestDevice d;
  auto sim = std::make_unique<gpustitch::SimBackend>(sim_options);
  d.sim = sim.get();
  d.backend = std::move(sim);
  d.write = [](gpustitch::DevPtr p, const void* src, std::size_t n) {
    std::memcpy(reinterpret_cast<void*>(p), src, n);
  };
  d.read = [](gpustitch::DevPtr p, void* dst, std::size_t n) {
    std::memcpy(dst, reinterpret_cast<const void*>(p), n);
  };
  return d;
}
