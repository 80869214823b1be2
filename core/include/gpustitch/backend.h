// The driver backend: the handful of virtual-memory operations the pool needs.
//
// Data flows one way: hook -> pool -> backend. The pool owns all policy; a backend only performs
// operations and reports failures. Two implementations exist: CudaBackend (the CUDA driver's
// virtual memory management API, resolved at run time from libcuda.so.1) and SimBackend (host
// memory: a physical handle is a memfd, a reservation a PROT_NONE mapping, a map an
// mmap(MAP_FIXED|MAP_SHARED) of the memfd, so a stitched range really aliases its pieces).
//
// Every method is noexcept and thread-safe; failures are reported as Status, never thrown.
#pragma once

#include <span>

#include "gpustitch/types.h"

namespace gpustitch {

// What a backend's physical handles are: the properties they were created with, in the terms of
// CUmemAllocationProp. A program that calls cuMemCreate itself may be answered with an idle
// handle of the pool only when the handle has what it asked for (Pool::lend_handle).
struct HandleProperties {
  // The handles are the process's own driver handles (CUmemGenericAllocationHandle), which a
  // program can map with the driver's cuMemMap; false for the simulated backend's memfds.
  bool driver_handles = false;
  unsigned handle_types = 0;      // CUmemAllocationHandleType bits (0: none)
  bool rdma_capable = false;      // allocFlags.gpuDirectRDMACapable
  unsigned char compression = 0;  // allocFlags.compressionType
  bool operator==(const HandleProperties&) const = default;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual const char* name() const noexcept = 0;
  virtual int device_count() noexcept = 0;

  // Allocation granularity (cuMemGetAllocationGranularity, recommended). Sizes, offsets and
  // addresses passed to create/map/reserve are multiples of it.
  virtual std::size_t granularity(int device) noexcept = 0;

  // Whether map() accepts a non-zero offset into a handle. Decides whether a free piece of a
  // partly used handle can be stitched, or only whole free handles.
  virtual bool supports_map_offset(int device) noexcept = 0;

  // The device's UUID (cuDeviceGetUuid): what identifies one GPU across processes, whose ordinals
  // differ with CUDA_VISIBLE_DEVICES. not_supported when the backend cannot tell.
  virtual Status device_uuid(int device, DeviceUuid* out) noexcept {
    (void)device;
    (void)out;
    return Status::not_supported;
  }

  // The properties every handle create() makes on device has; not_supported when the backend
  // cannot say (then no handle of it is lent to a program).
  virtual Status handle_properties(int device, HandleProperties* out) noexcept {
    (void)device;
    (void)out;
    return Status::not_supported;
  }

  // Free and total physical memory of the device as the driver sees it.
  virtual Status mem_info(int device, std::size_t* free, std::size_t* total) noexcept = 0;

  // Virtual address reservations (cuMemAddressReserve / cuMemAddressFree).
  virtual Status reserve(int device, std::size_t size, DevPtr* out) noexcept = 0;
  virtual Status unreserve(DevPtr ptr, std::size_t size) noexcept = 0;

  // Physical memory (cuMemCreate / cuMemRelease).
  virtual Status create(int device, std::size_t size, PhysHandle* out) noexcept = 0;
  virtual Status release(PhysHandle handle) noexcept = 0;

  // Map size bytes of handle, starting at offset, at ptr (cuMemMap). unmap takes exactly a range
  // that one map() call created (cuMemUnmap cannot unmap a sub-range).
  virtual Status map(DevPtr ptr, std::size_t size, PhysHandle handle,
                     std::size_t offset) noexcept = 0;
  virtual Status unmap(DevPtr ptr, std::size_t size) noexcept = 0;

  // Make [ptr, ptr+size) readable and writable from each device in devices (cuMemSetAccess).
  virtual Status set_access(DevPtr ptr, std::size_t size,
                            std::span<const int> devices) noexcept = 0;

  // Sharing physical memory with another process (CUDA IPC on pool memory, preload/src/ipc_*.cpp).
  // export_handle: a POSIX file descriptor for handle that the caller owns and closes
  // (cuMemExportToShareableHandle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR). not_supported when
  // the backend created its handles without that handle type (a driver or device that refused it).
  virtual Status export_handle(PhysHandle handle, int* fd) noexcept {
    (void)handle;
    (void)fd;
    return Status::not_supported;
  }
  // import_handle: a handle of this process for the size bytes of physical memory behind fd, an
  // export_handle result received from another process (cuMemImportFromShareableHandle). fd stays
  // the caller's. The handle maps like one from create() and goes with release(); it counts
  // nowhere in this process's device capacity (the exporter's process holds the memory).
  virtual Status import_handle(int device, int fd, std::size_t size, PhysHandle* out) noexcept {
    (void)device;
    (void)fd;
    (void)size;
    (void)out;
    return Status::not_supported;
  }

  // Block until all work queued on the device before the call has completed. Called only off the
  // allocation fast path (the reclaimer thread, or an allocation that would otherwise fail).
  virtual Status synchronize(int device) noexcept = 0;

  // Events: a mark in one stream's work, recorded where a stream-ordered free happens and asked,
  // never waited for, whether the device has run past it (cuEventRecord, cuEventQuery). An event
  // is created once per device and recorded again and again. record_event runs on the freeing
  // thread: a per-thread stream key (is_per_thread_stream) is that thread's per-thread stream.
  // Backends without events report not_supported and the pool fences instead.
  virtual Status create_event(int device, Event* out) noexcept {
    (void)device;
    (void)out;
    return Status::not_supported;
  }
  virtual Status destroy_event(Event event) noexcept {
    (void)event;
    return Status::not_supported;
  }
  virtual Status record_event(int device, Event event, Stream stream) noexcept {
    (void)device;
    (void)event;
    (void)stream;
    return Status::not_supported;
  }
  // *done: whether the work before the event's last record has completed. Anything but ok
  // means "unknown": the caller treats the work as still running.
  virtual Status query_event(Event event, bool* done) noexcept {
    (void)event;
    (void)done;
    return Status::not_supported;
  }
};

}  // namespace gpustitch
