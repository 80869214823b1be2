// dlsym interposition: how the shim reaches programs that never call CUDA through the PLT. CuPy and
// JAX/XLA dlopen libcuda/libcudart and dlsym every entry point; the CUDA runtime (shared or
// statically linked into an nvcc-built program) dlsyms cuGetProcAddress from its libcuda handle
// and fetches everything else through it.
//
// One unversioned definition answers both glibc symbol versions: references to dlsym@GLIBC_2.2.5
// (programs built against glibc < 2.34) and dlsym@GLIBC_2.34 (newer) both bind to it, because the
// dynamic linker accepts an unversioned definition for a versioned reference. The shim's own
// lookups use glibc's dlsym obtained with dlvsym (real_api.cpp).
//
// For a hooked name, the real lookup runs first: if it finds nothing the caller gets nothing, as
// natively; otherwise the real address is remembered (it is what the hook will forward to) and the
// caller gets the hook. Every other name goes straight to glibc's dlsym as a tail call, so glibc
// sees the caller's return address: dlsym(RTLD_NEXT, ...) then still means "next after the
// caller", which other interposers (loaded before or after the shim) depend on. This file is built
// with -O2 -foptimize-sibling-calls whatever the build type so the tail call is a jump; a test
// checks RTLD_NEXT behaviour.
// <dlfcn.h> is deliberately not included: it declares dlsym's symbol argument nonnull, which would
// let the compiler drop the NULL check below (glibc itself would crash on a NULL name; the shim
// forwards it instead, so whatever glibc does is what the caller gets).
#include <cstdint>

#include "hooks.h"
#include "real_api.h"

namespace pl = gpustitch::preload;

namespace {

void* const kRtldNext = reinterpret_cast<void*>(static_cast<std::intptr_t>(-1));  // RTLD_NEXT

__attribute__((noinline)) void* resolve_hooked(void* handle, const char* symbol, int index) {
  auto hook = static_cast<pl::Hook>(index);
  void* fn = pl::real_dlsym(handle, symbol);
  if (!fn) return nullptr;
  if (pl::is_hook_address(fn)) {
    // The lookup reached the shim's own definition (RTLD_DEFAULT, or a handle whose scope includes
    // the preloaded shim). Only hand it out if a real definition exists behind it.
    void* next = pl::real_dlsym(kRtldNext, symbol);
    if (!next) return nullptr;
    pl::record_real(hook, next);
    return fn;
  }
  pl::record_real(hook, fn);
  return pl::hook_address(hook);
}

}  // namespace

extern "C" __attribute__((visibility("default"))) void* dlsym(void* handle, const char* symbol) {
  if (symbol != nullptr && symbol[0] == 'c' && symbol[1] == 'u') {
    int index = pl::find_hook(symbol);
    if (index >= 0) return resolve_hooked(handle, symbol, index);
  }
  return pl::glibc_dlsym()(handle, symbol);
}
