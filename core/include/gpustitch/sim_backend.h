// Simulated backend on host memory, so that every path of the pool runs without a GPU.
//
// A physical handle is a memfd (sparse: untouched pages cost no RAM), an address reservation a
// PROT_NONE anonymous mapping, map() an mmap(MAP_FIXED|MAP_SHARED) of the memfd at an offset, and
// set_access() an mprotect to read/write. A stitched range therefore really aliases its physical
// pieces: bytes written through one view read back through another.
//
// Device capacity is an accounting limit, so an 80 GiB device can be simulated on a small machine
// as long as tests touch only a few bytes per block.
//
// Shared devices (SimOptions::shared_name, config sim_shared:NAME): processes that name the same
// NAME see one device, as processes on one GPU do. Capacity is then accounted in the POSIX
// shared-memory object "/gpustitch-sim.<uid>.<NAME>" (one std::atomic<uint64_t> of bytes in use
// per device, lock-free across processes): create() checks and adds in one compare-exchange, so
// two processes can never over-commit. UUIDs derive from NAME and the
// ordinal, so every process reports the same UUID for the same simulated GPU. Bytes of handles a
// process still holds when it ends stay counted unless its backend is destroyed first (the preload
// library never destroys its backend): use a fresh NAME per test, and remove the object with
// SimBackend::unlink_shared(NAME). Fault injection makes the Nth call of any
// operation fail, to test rollback.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "gpustitch/backend.h"

namespace gpustitch {

enum class SimOp : int {
  reserve,
  unreserve,
  create,
  release,
  map,
  unmap,
  set_access,
  synchronize,
  mem_info,
  count_
};

struct SimOptions {
  int devices = 1;
  std::size_t capacity = 80 * GiB;  // per device
  std::size_t granularity = 2 * MiB;
  bool map_offset = true;  // whether map() accepts a non-zero handle offset
  // Non-empty: the device's capacity is shared with every process using the same name (see
  // above). Letters, digits, '_', '-' and '.', at most 64 characters.
  std::string shared_name = {};
  // How long each call takes, by SimOp, in ns (0: as fast as the host allows). The calling thread
  // busy-waits before the call, outside the backend's lock, as a driver call holds its caller:
  // a pool's policies can then be run against a real GPU's costs (bench/core/gpu_cost_model).
  std::array<std::uint32_t, static_cast<std::size_t>(SimOp::count_)> call_ns = {};
};

class SimBackend final : public Backend {
 public:
  explicit SimBackend(SimOptions options = {});
  ~SimBackend() override;

  const char* name() const noexcept override { return "sim"; }
  int device_count() noexcept override { return options_.devices; }
  std::size_t granularity(int device) noexcept override;
  bool supports_map_offset(int device) noexcept override;
  // "GPU-5349xxxx-...": unique to this backend object and device (a simulated device is private
  // to its backend), so processes never take two simulated devices for one GPU; for a shared
  // device, derived from its name and ordinal, the same in every process that shares it.
  Status device_uuid(int device, DeviceUuid* out) noexcept override;
  // Memfds, no handle types: lendable only to callers that use this backend's handles.
  Status handle_properties(int device, HandleProperties* out) noexcept override;
  Status mem_info(int device, std::size_t* free, std::size_t* total) noexcept override;
  Status reserve(int device, std::size_t size, DevPtr* out) noexcept override;
  Status unreserve(DevPtr ptr, std::size_t size) noexcept override;
  Status create(int device, std::size_t size, PhysHandle* out) noexcept override;
  Status release(PhysHandle handle) noexcept override;
  Status map(DevPtr ptr, std::size_t size, PhysHandle handle, std::size_t offset) noexcept override;
  Status unmap(DevPtr ptr, std::size_t size) noexcept override;
  Status set_access(DevPtr ptr, std::size_t size, std::span<const int> devices) noexcept override;
  Status synchronize(int device) noexcept override;
  // Events complete with the hold_device() they were recorded in (at once outside one).
  Status create_event(int device, Event* out) noexcept override;
  Status destroy_event(Event event) noexcept override;
  Status record_event(int device, Event event, Stream stream) noexcept override;
  Status query_event(Event event, bool* done) noexcept override;
  // Export: a dup of the handle's memfd. Import: a dup of the received one, not counted in the
  // device's capacity (the exporting backend counts it).
  Status export_handle(PhysHandle handle, int* fd) noexcept override;
  Status import_handle(int device, int fd, std::size_t size, PhysHandle* out) noexcept override;

  // --- test controls ---------------------------------------------------------------------------
  // The nth call (1 = the next one) of op from now fails with status. 0 disarms.
  void fail_nth(SimOp op, std::uint64_t nth, Status status = Status::out_of_memory) noexcept;
  // Every call of op fails while set.
  void fail_always(SimOp op, bool on, Status status = Status::out_of_memory) noexcept;
  std::uint64_t calls(SimOp op) const noexcept;
  // Memory used by someone else (another process): reduces what create() can get.
  void set_external_usage(int device, std::size_t bytes) noexcept;
  // While held, synchronize() blocks: models device work still running after a free. Events
  // recorded while held complete when this hold ends, even if another begins at once (the device
  // ran past them, and is busy with later work).
  void hold_device(bool held) noexcept;

  // Whether shared_name was given and the shared object could be opened (else the device is
  // private, as without shared_name).
  bool shared() const noexcept;
  // Removes the shared-memory object of a shared simulated device (tests).
  static void unlink_shared(const std::string& name) noexcept;

  // --- leak accounting -------------------------------------------------------------------------
  std::size_t used(int device) const noexcept;  // bytes in live handles
  std::size_t live_handles() const noexcept;
  std::size_t live_reservations() const noexcept;
  std::size_t live_mappings() const noexcept;
  std::size_t live_events() const noexcept;

 private:
  struct State;
  Status check_fault(SimOp op) noexcept;
  void open_shared() noexcept;
  // The next reservation's base, ascending in this backend's lane (sim_backend.cpp), or 0: use a
  // plain mapping.
  DevPtr reserve_in_lane(std::size_t size) noexcept;
  SimOptions options_;
  std::unique_ptr<State> state_;
};

}  // namespace gpustitch
