// Which framework environment variables `gpustitch run` sets so that frameworks hand their
// allocations down to the pool, given what the user has already set.
//
// PyTorch is asked for its stream-ordered backend (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync)
// rather than for its cache off (PYTORCH_NO_CUDA_MEMORY_CACHING=1): every tensor still reaches the
// pool, but through cudaMallocAsync/cudaFreeAsync with its stream, so the pool reuses freed memory
// on the same stream without a fence, PyTorch raises torch.OutOfMemoryError on a failed
// allocation, and PyTorch's memory statistics are read from the device's default memory pool,
// which the shim answers with the pool's figures (preload/src/hooks_mempool.cpp). Measured on one
// H200 it was also faster and held less (README, "The framework-cache trade-off").
//
// A value the user set is never changed:
// - PYTORCH_CUDA_ALLOC_CONF set with a backend key (backend:native, backend:cudaMallocAsync):
//   PyTorch's allocator is the user's choice; nothing is added for PyTorch.
// - PYTORCH_CUDA_ALLOC_CONF set without a backend key (expandable_segments:True, ...): the value
//   is kept, and the native allocator it configures is asked to keep no cache
//   (PYTORCH_NO_CUDA_MEMORY_CACHING=1), the setting before this one. Appending backend:... to the
//   user's value would change what they wrote, and options of the native allocator mean nothing
//   to the stream-ordered one.
// - PYTORCH_NO_CUDA_MEMORY_CACHING set (and no PYTORCH_CUDA_ALLOC_CONF): the user chose the cache
//   setting; nothing is added for PyTorch.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace gpustitch::cli {

// The value of a variable in the user's environment, or null when unset.
using EnvLookup = std::function<const char*(const char* name)>;

// The (name, value) pairs to set, in a stable order, none of them already set by the user.
std::vector<std::pair<std::string, std::string>> framework_settings(const EnvLookup& env);

// Whether a PYTORCH_CUDA_ALLOC_CONF value names a backend (backend:X or backend=X, any spacing),
// as PyTorch's parser reads the comma-separated list.
bool alloc_conf_has_backend(const std::string& value);

}  // namespace gpustitch::cli
