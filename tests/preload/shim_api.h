// Test access to libgpustitch.so's C API without linking it: the symbols are looked up in the
// process (present only when the shim is preloaded), so the same test binaries also run without
// the shim.
#pragma once

#include <dlfcn.h>

#include <string>

#include "gpustitch/gpustitch.h"

namespace shim {

template <typename F>
F lookup(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_DEFAULT, name));
}

inline bool preloaded() {
  return lookup<int (*)()>("gpustitch_active") != nullptr;
}
inline int active() {
  auto f = lookup<int (*)()>("gpustitch_active");
  return f ? f() : 0;
}
inline bool owns(const void* p) {
  auto f = lookup<int (*)(const void*)>("gpustitch_owns");
  return f && f(p) == 1;
}
inline gpustitch_device_stats stats(int device) {
  gpustitch_device_stats s{};
  auto f = lookup<int (*)(int, gpustitch_device_stats*, size_t)>("gpustitch_get_stats");
  if (f) f(device, &s, sizeof s);
  return s;
}
// The shared object that defines the function at address fn ("libgpustitch.so", "libcuda.so.1").
inline std::string library_of(const void* fn) {
  Dl_info info{};
  if (!fn || !dladdr(fn, &info) || !info.dli_fname) return "";
  std::string path = info.dli_fname;
  return path.substr(path.rfind('/') + 1);
}
inline std::string symbol_of(const void* fn) {
  Dl_info info{};
  if (!fn || !dladdr(fn, &info) || !info.dli_sname) return "";
  return info.dli_sname;
}

}  // namespace shim
