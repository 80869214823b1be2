// See framework_env.h.
#include "framework_env.h"

#include <cctype>

namespace gpustitch::cli {
namespace {

constexpr const char* kTorchConf = "PYTORCH_CUDA_ALLOC_CONF";
constexpr const char* kTorchNoCache = "PYTORCH_NO_CUDA_MEMORY_CACHING";

// The other frameworks: what makes each hand every allocation to an entry point the pool serves
// (cudaMalloc, cuMemAlloc, cudaMallocAsync, cuMemAllocFromPoolAsync on the default pool). Each is
// independent of the others and is set unless the user set it.
//
// JAX: XLA 0.11 allocates device memory with the VMM API itself in every mode but cuda_async
// (docs/frameworks.md): the BFC and platform allocators sit on cuMemCreate/cuMemMap, and no flag
// brings cuMemAlloc back. cuda_async allocates each buffer with cuMemAllocFromPoolAsync on the
// device's default pool, on XLA's compute stream, which the pool serves as cuMemAllocAsync; without
// preallocation it takes nothing at start.
struct Setting {
  const char* name;
  const char* value;
};
constexpr Setting kOthers[] = {
    {"XLA_PYTHON_CLIENT_ALLOCATOR", "cuda_async"},
    {"XLA_PYTHON_CLIENT_PREALLOCATE", "false"},
    {"TF_GPU_ALLOCATOR", "cuda_malloc_async"},
};

std::string trim(const std::string& s) {
  std::size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

}  // namespace

bool alloc_conf_has_backend(const std::string& value) {
  std::size_t i = 0;
  while (i <= value.size()) {
    std::size_t j = value.find(',', i);
    if (j == std::string::npos) j = value.size();
    const std::string entry = value.substr(i, j - i);
    const std::size_t sep = entry.find_first_of(":=");
    if (sep != std::string::npos && trim(entry.substr(0, sep)) == "backend") return true;
    i = j + 1;
  }
  return false;
}

std::vector<std::pair<std::string, std::string>> framework_settings(const EnvLookup& env) {
  std::vector<std::pair<std::string, std::string>> out;
  const char* conf = env(kTorchConf);
  const char* no_cache = env(kTorchNoCache);
  if (!conf && !no_cache) {
    out.emplace_back(kTorchConf, "backend:cudaMallocAsync");
  } else if (conf && !no_cache && !alloc_conf_has_backend(conf)) {
    out.emplace_back(kTorchNoCache, "1");
  }
  for (const Setting& s : kOthers) {
    if (!env(s.name)) out.emplace_back(s.name, s.value);
  }
  return out;
}

}  // namespace gpustitch::cli
