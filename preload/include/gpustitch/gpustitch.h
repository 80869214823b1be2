/* gpustitch.h: the C API exported by libgpustitch.so.
 *
 * libgpustitch.so is used in one of two ways:
 *  - LD_PRELOAD (or `gpustitch run -- CMD`): it interposes the CUDA allocation entry points and
 *    serves them from the stitching pool; the program is not changed. See docs/preload.md.
 *  - In process, as a PyTorch pluggable allocator:
 *      torch.cuda.memory.CUDAPluggableAllocator("libgpustitch.so", "gpustitch_malloc",
 *                                               "gpustitch_free")
 * The functions below work in both cases and are safe to call from any thread. The pool initialises
 * on first use from GPUSTITCH_CONF; when it cannot (no driver, enable:off) gpustitch_active()
 * returns 0 and gpustitch_malloc/gpustitch_free fall back to the driver's cuMemAlloc/cuMemFree.
 */
#ifndef GPUSTITCH_GPUSTITCH_H_
#define GPUSTITCH_GPUSTITCH_H_

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GPUSTITCH_API_VERSION 1

struct CUstream_st; /* cudaStream_t / CUstream */

/* PyTorch CUDAPluggableAllocator entry points. Stream-ordered: memory freed on a stream is
 * reusable at once by later allocations on that same stream, and by other streams only once the
 * device has finished the work queued before the free (cudaFreeAsync semantics). size and device
 * of gpustitch_free are those of the allocation and are not needed; ptr alone identifies it.
 * gpustitch_malloc returns NULL when the memory cannot be found (after logging one line saying
 * why: requested, device free, pool cached, largest possible, fragmentation, whether it is a real
 * shortage or would have fit, and the processes holding the most of the GPU). */
void* gpustitch_malloc(ssize_t size, int device, struct CUstream_st* stream);
void gpustitch_free(void* ptr, ssize_t size, int device, struct CUstream_st* stream);

/* 1 if allocations are served by the pool, 0 if the library passes them through (initialises the
 * pool on first call). */
int gpustitch_active(void);

/* 1 if ptr lies inside a live allocation served by the pool (interior pointers too), else 0. */
int gpustitch_owns(const void* ptr);

/* A snapshot of one device's pool statistics (a subset of gpustitch::DeviceStats; see
 * core/include/gpustitch/stats.h for the meaning of each field). */
typedef struct gpustitch_device_stats {
  uint64_t allocs; /* allocations served since start */
  uint64_t frees;
  uint64_t cache_hits; /* served from cached memory */
  uint64_t fresh;      /* served by creating new physical memory */
  uint64_t stitches;   /* served by stitching cached pieces */
  uint64_t ooms;       /* out-of-memory results returned */
  uint64_t live_blocks;
  uint64_t bytes_requested; /* live, as asked by callers */
  uint64_t bytes_allocated; /* live, after rounding */
  uint64_t bytes_reserved;  /* physical memory held from the driver */
  uint64_t bytes_cached;
  uint64_t peak_allocated;
  uint64_t peak_reserved;
  uint64_t largest_possible;
  uint64_t device_free;
  uint64_t device_total;
  /* Appended after 0.1.0: a library from before leaves them as the caller set them, so
   * zero-initialize the struct. */
  uint64_t driver_calls; /* the pool's calls into the driver's memory API (create, map, ...) */
  uint64_t driver_ns;    /* wall time in those calls, nanoseconds */
  /* Of those, the calls made on the pool's background thread (unmaps of moved memory's old
   * places), not on the program's threads. */
  uint64_t driver_background_calls;
  uint64_t driver_background_ns;
  /* The program's threads' share by kind: create, map, set access, unmap, release. */
  uint64_t driver_op_calls[5];
  uint64_t driver_op_ns[5];
  /* When reserved last rose to peak_reserved: bytes then waiting for their fence (freed while the
   * device still ran work queued before the free), and bytes then allocated. */
  uint64_t peak_reserved_pending;
  uint64_t peak_reserved_allocated;
  /* Time the program's threads waited for the device inside the pool: fences run on the calling
   * thread (a miss or trim fencing the frees it needs), and allocations that waited for the
   * background thread's fence, with the waits that ran out apart. */
  uint64_t fence_syncs;
  uint64_t fence_sync_ns;
  uint64_t fence_waits;
  uint64_t fence_wait_ns;
  uint64_t fence_waits_timed_out;
} gpustitch_device_stats;

/* Fills *out (size: sizeof(gpustitch_device_stats), for forward compatibility) for device.
 * Returns 0 on success, -1 if the pool is not active or device is out of range. */
int gpustitch_get_stats(int device, gpustitch_device_stats* out, size_t size);

/* Releases device's idle cached memory back to the driver (after its pending frees), as
 * torch.cuda.empty_cache() does for PyTorch's cache. Returns the bytes released, or -1 if the pool
 * is not active or device is out of range. */
long long gpustitch_trim(int device);

/* Devices the pool serves (0 when it is not active). */
int gpustitch_device_count(void);

/* Writes a PyTorch memory snapshot of this process to path (the pickle
 * torch.cuda.memory._dump_snapshot() writes and pytorch.org/memory_viz reads): the pool's segments
 * and blocks, and the recent allocation events (trace_events) as device_traces, with stacks where
 * allocation sites are sampled. Written to path.tmp, then renamed. Returns 0 on success, -1 if the
 * pool is not active, -2 if the file could not be written; on failure error (if not NULL) receives
 * a NUL-terminated reason, cut to error_size bytes. */
int gpustitch_snapshot(const char* path, char* error, size_t error_size);

/* The library version, e.g. "0.1.0". */
const char* gpustitch_version(void);

#ifdef __cplusplus
}
#endif

#endif /* GPUSTITCH_GPUSTITCH_H_ */
