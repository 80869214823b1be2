// The shim's process-wide state: lazy initialisation, the pool, the passthrough guard, and the
// helpers every hook shares (current device, stream identity, capture check, error mapping).
//
// Lifecycle. Nothing happens when the library is loaded: no constructor runs CUDA or parses
// configuration, so the loader can never deadlock on the shim. The first hooked call that could be
// served (an allocation, a memory query) initialises: parse GPUSTITCH_CONF, create the backend
// (CUDA driver, or the simulated one for tests), the observers and the pool, register fork
// handlers and the exit summary. If that fails (no driver, no device, no VMM support) the shim
// logs one warning line and passes every call through from then on. Nothing is ever destroyed:
// CUDA's own teardown at exit may still call cudaFree through the hooks after static destructors
// would have run, so the pool simply outlives the process's destructors.
//
// Passthrough guard. A thread-local depth counter is raised while the shim calls a real runtime
// function (cudaMalloc passed through, cudaFree of a foreign pointer, ...). The runtime implements
// those with driver calls that land in the shim's driver hooks; under the guard those hooks
// forward to the driver untouched, so one allocation is served once, by one layer. The shim's own
// backend never sees a hook at all: it gets the real driver functions (resolve_real_driver).
//
// fork(). The prepare/parent handlers hold the pool's locks across fork() so the child's copy is
// consistent; the child then stops using the inherited pool for good (its device memory belongs to
// the parent; CUDA itself is unusable in a child of a CUDA process) and passes everything through.
// A child that execs starts afresh through LD_PRELOAD.
#pragma once

#include <spdlog/logger.h>

#include <string>

#include "cuda_abi.h"
#include "gpustitch/pool.h"

namespace gpustitch::preload {

// --- passthrough guard --------------------------------------------------------------------------
extern thread_local int t_passthrough_depth;

class PassthroughScope {
 public:
  PassthroughScope() noexcept { ++t_passthrough_depth; }
  ~PassthroughScope() { --t_passthrough_depth; }
  PassthroughScope(const PassthroughScope&) = delete;
  PassthroughScope& operator=(const PassthroughScope&) = delete;
};

// --- the pool -----------------------------------------------------------------------------------
// The pool that should serve the current call, initialising on first use; null when the call must
// pass through (guard raised, shim disabled or unusable, forked child, during initialisation on
// this thread).
Pool* serving_pool() noexcept;
// The pool if it has been initialised and is serving, without initialising (frees, lookups: a
// pointer cannot be the pool's before the pool exists).
Pool* existing_pool() noexcept;
// Initialises if needed and reports whether the pool serves allocations.
bool shim_active() noexcept;
// ipc:native: cudaMalloc-semantics allocations stay native so cudaIpcGetMemHandle works on them.
bool ipc_native() noexcept;

// Counts an allocation the pool could have served but that was passed to CUDA instead (graph
// capture, ipc:native, a device the pool does not manage), for the current context's device.
// Reported in the exit summary.
void note_passthrough() noexcept;

// The shim's logger (stderr, "gpustitch: " prefix). Usable before initialisation.
spdlog::logger& log() noexcept;
// One line per out-of-memory (oom_report.cpp): requested, device free, pool cached, largest
// possible, fragmentation, the verdict (real shortage or would have fit) and, at most once a
// second, the processes holding the most of this GPU.
void log_oom(Pool& pool, int device, std::size_t size) noexcept;
// That line without the logger's prefix. Throws only std::bad_alloc.
std::string oom_message(Pool& pool, int device, std::size_t size, bool with_holders);

// --- devices and streams ------------------------------------------------------------------------
// The current context's device, through the real driver. False when no context is current.
bool driver_current_device(int* device) noexcept;
// Same, but first lets the runtime create its context if none is current yet (what the native
// runtime call would have done itself).
//
// Fast path (no driver call): when the driver shows exactly one device, the current device can
// only be device 0, so once the calling thread has been seen with a current context the answer
// is 0 without asking. (A cache keyed by thread alone would be wrong with several devices:
// cudaSetDevice is not hooked, and the runtime switches contexts through private entry points.
// With one device there is nothing to switch to.) The driver-level hooks keep asking, so a
// driver-API program without a context still gets the native CUDA_ERROR_INVALID_CONTEXT.
bool runtime_current_device(int* device) noexcept;
// What the runtime does before each call, for the hooks that answer a runtime call themselves:
// a thread that has never had a current context gets the runtime's (runtime_current_device);
// one that had needs no driver call.
void ensure_runtime_context() noexcept;
// The device a stream-ordered allocation on stream belongs to. Follow it with stream_capturing(),
// which validates the stream (with one visible device an explicit stream's device is 0 without
// asking the driver); the runtime's hooks call this first, since for the NULL and per-thread
// streams it makes the runtime's context current, without which the driver cannot answer that.
bool stream_device(cuda::CUstream stream, bool per_thread, bool runtime, int* device) noexcept;
// Whether stream is being captured into a CUDA graph (then stream-ordered calls keep their native,
// graph-recording behaviour). invalid: the driver could not say (a destroyed stream, no context);
// *error, when given, is its answer.
enum class Capture { none, active, invalid };
Capture stream_capture(cuda::CUstream stream, bool per_thread,
                       cuda::CUresult* error = nullptr) noexcept;
// stream_capture() != none. For allocations, where an invalid stream counts as "capturing":
// native handling is always safe, and the native call reports the stream's error.
bool stream_capturing(cuda::CUstream stream, bool per_thread) noexcept;
// The pool's identity for a stream: the legacy default stream is 0, and the per-thread default
// stream (handle 0x2, or 0 in a per-thread-stream call) a value unique to the calling thread, since
// the same handle names a different stream on every thread.
Stream stream_key(cuda::CUstream stream, bool per_thread) noexcept;

// --- serving (shared by the runtime, driver and pluggable entry points) ------------------------
// What became of a request the pool was asked to serve; each hook turns it into its API's code.
enum class Served { ok, out_of_memory, not_served };

// The driver's code for what the pool did, with the block stored in *dptr when it was served;
// -1: the call goes to the driver instead. (The runtime's codes: runtime_result in
// hooks_runtime.cpp, which also sets the runtime's last error.)
inline int driver_result(Served served, cuda::CUdeviceptr* dptr, DevPtr out) noexcept {
  switch (served) {
    case Served::ok:
      *dptr = out;
      return cuda::CUDA_SUCCESS;
    case Served::out_of_memory:
      return cuda::CUDA_ERROR_OUT_OF_MEMORY;
    case Served::not_served:
      break;
  }
  return -1;
}

// pool.allocate() on device into *out. An out-of-memory has been logged (one line) when this
// returns; not_served means the pool cannot serve this device and the call goes to CUDA.
Served serve_allocation(Pool& pool, int device, std::size_t size, Stream stream,
                        DevPtr* out) noexcept;

// A stream-ordered driver allocation (cuMemAllocAsync, cuMemAllocFromPoolAsync on a default
// pool) served on device in stream's order: the driver's code with *dptr set, or -1 when the call
// goes to the driver instead.
inline int serve_stream_ordered_driver(Pool& pool, int device, std::size_t size,
                                       cuda::CUstream stream, bool per_thread,
                                       cuda::CUdeviceptr* dptr) noexcept {
  DevPtr out = 0;
  const Served served = serve_allocation(pool, device, size, stream_key(stream, per_thread), &out);
  return driver_result(served, dptr, out);
}

// A stream-ordered free (cudaFreeAsync, cuMemFreeAsync). capture_unsupported: ptr is the pool's
// but stream is being captured into a graph, which cannot record a free of memory the driver does
// not know (logged, naming api); invalid_stream: ptr is the pool's but the driver rejects stream
// (destroyed, or of no context): the block is freed with cudaFree semantics (reused only after
// the device work queued so far completes, so nothing still running on any stream can see it
// reused) and the caller gets the driver's error in *error; not_served: ptr is not the pool's,
// the call goes to CUDA.
enum class FreeServed { freed, capture_unsupported, invalid_stream, not_served };
FreeServed serve_free_async(Pool& pool, DevPtr ptr, cuda::CUstream stream, bool per_thread,
                            const char* api, cuda::CUresult* error) noexcept;

// --- errors -------------------------------------------------------------------------------------
cuda::CUresult to_curesult(Status s) noexcept;
cuda::cudaError to_cuda_error(Status s) noexcept;
// Makes the runtime's sticky "last error" say cudaErrorMemoryAllocation, as a native failed
// cudaMalloc would have (cudaGetLastError() after an OOM).
void set_runtime_last_error_oom() noexcept;

}  // namespace gpustitch::preload
