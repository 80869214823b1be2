// Serving the program's own VMM calls from the pool: a cuMemCreate answered with an idle handle of
// the pool, a released handle kept in the pool's cache (core: Pool::lend_handle,
// Pool::take_back_handle, core/src/handle_lending.cpp).
//
// XLA allocates every device buffer this way (docs/frameworks.md), so do PyTorch's expandable
// segments, NCCL and vLLM. A handle is only ever exchanged whole and unchanged: the program still
// makes every cuMemAddressReserve, cuMemMap, cuMemSetAccess and cuMemUnmap on the real driver, so
// what it maps is what it would have mapped, with the properties it asked for.
//
// When the pool may take part (anything else goes to the driver exactly as before):
//   * program_vmm:serve (the default), the pool serving, its backend's handles the process's own
//     driver handles (backend:cuda; the simulated backend's memfds are not);
//   * cuMemCreate with flags 0 and properties the pool's handles can satisfy: pinned memory on a
//     device location the pool serves, requested handle types none or POSIX file descriptor,
//     allocFlags usage 0, compression and RDMA no more than the pool's handles have, and a size
//     that is a multiple of the pool's granularity.
// Then a cuMemCreate of S bytes gets an idle handle of exactly S bytes when the pool holds one
// ("lent"), and otherwise the driver's. A handle the pool lent, or one the program created with
// exactly the pool's properties, is "kept": its last cuMemRelease is not forwarded (the driver
// would free the memory once unmapped) and, once it is also mapped nowhere, it goes to the pool as
// an idle spare; if the pool will not take it (its cap), it is released to the driver then. A
// cuMemRelease of a kept handle with no reference left gets CUDA_ERROR_INVALID_VALUE, as the
// driver's would. References from cuMemRetainAllocationHandle are the driver's and their releases
// are forwarded. A handle the program exported (cuMemExportToShareableHandle) is never the pool's:
// another process may have imported it and keep its memory mapped; it goes to the driver.
#pragma once

#include <cstddef>

#include "cuda_abi.h"
#include "gpustitch/backend.h"

namespace gpustitch::preload {

// What decided a created handle's fate: whether the pool keeps it once the program is done with
// it, and the properties it was created with.
struct PoolTerms {
  bool kept = false;
  HandleProperties props;
};

// For cuMemCreate(size, prop, flags): an idle handle of the pool into *out (true), or false, and
// *terms says whether a handle the driver creates for this call would be kept by the pool.
bool lend_to_program(std::size_t size, const void* prop, unsigned long long flags,
                     cuda::CUmemGenericAllocationHandle* out, PoolTerms* terms) noexcept;

// A kept handle the program is done with (no reference, no mapping): to the pool's cache (true),
// or to the driver when the pool will not take it or it is not reusable (exported: another
// process may still map its memory) (false).
bool retire_kept_handle(int device, cuda::CUmemGenericAllocationHandle handle, std::size_t size,
                        const HandleProperties& props, bool reusable) noexcept;

}  // namespace gpustitch::preload
