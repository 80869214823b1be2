// Simulated backend. See sim_backend.h for the model; the notes here are about the mechanics.
//
// Reservations are anonymous PROT_NONE mappings with MAP_NORESERVE whose base is
// granularity-aligned like a real cuMemAddressReserve result. They ascend, as the driver's ranges
// do: the pool breaks ties between equal blocks and idle handles by address, and with mmap's
// top-down order a replay of a trace recorded on an H100 (GPT training, reclaim:inline) placed its
// 630th large block elsewhere and peaked 0.85% below the GPU; in the driver's order it gives the
// GPU's bytes exactly. Each backend takes a lane of address space at its first reservation (only
// bookkeeping: nothing is mapped for it), from an area far from where the loader and mmap put
// things, and asks for each range just above its last one (MAP_FIXED_NOREPLACE, which never
// replaces a mapping; a range someone else holds is stepped over). The lane goes back when the
// backend is destroyed, so a process that replays many traces keeps reusing the area. Where there
// is no lane or no room left in it, a plain mmap serves the range, over-allocated and trimmed to
// alignment: only the order is lost. One PROT_NONE window mapped up front and carved bottom up
// gave the same order, but qemu-user (CI's aarch64 stage) tracks every mapping page by page, and
// the window made that stage three times slower; lanes map no more than mmap's order did.
//
// map() replaces a part of a reservation with a MAP_SHARED|MAP_FIXED view of the handle's memfd,
// still PROT_NONE until set_access() (as on CUDA, where a mapping is inaccessible until
// cuMemSetAccess). unmap() puts the PROT_NONE anonymous placeholder back so the address range
// stays reserved.
#include "gpustitch/sim_backend.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <map>
#include <mutex>
#include <new>
#include <unordered_map>

namespace gpustitch {
namespace {

// The area lanes come from (47-bit user space: the loader puts PIE images near 0x55..., mmap works
// down from 0x7f..., AddressSanitizer's shadow ends below 16 TiB), handed out first fit and merged
// when given back. Never destroyed: a backend may outlive static destructors at exit. Under
// ThreadSanitizer there are no lanes: its runtime kills a process that maps outside the areas it
// keeps for the program, so reservations come from mmap in its order.
class AscendingLanes {
 public:
  static AscendingLanes* get() noexcept {
#if defined(__SANITIZE_THREAD__)
    return nullptr;
#else
    static AscendingLanes* lanes = new (std::nothrow) AscendingLanes;
    return lanes;
#endif
  }
  // A lane of `size` bytes, or 0 where none is free.
  DevPtr take(std::size_t size) noexcept {
    std::lock_guard lock(mu_);
    if (!ready_) {
      try {
        free_.emplace(kBase, kEnd - kBase);
      } catch (...) {
        return 0;
      }
      ready_ = true;
    }
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < size) continue;
      DevPtr base = it->first;
      std::size_t rest = it->second - size;
      free_.erase(it);
      if (rest > 0) {
        try {
          free_.emplace(base + size, rest);
        } catch (...) {  // the rest is lost to lanes, not to the process
        }
      }
      return base;
    }
    return 0;
  }
  void give_back(DevPtr base, std::size_t size) noexcept {
    std::lock_guard lock(mu_);
    try {
      auto [it, inserted] = free_.emplace(base, size);
      if (!inserted) return;
      if (auto next = std::next(it); next != free_.end() && it->first + it->second == next->first) {
        it->second += next->second;
        free_.erase(next);
      }
      if (it != free_.begin()) {
        if (auto prev = std::prev(it); prev->first + prev->second == it->first) {
          prev->second += it->second;
          free_.erase(it);
        }
      }
    } catch (...) {  // lost to lanes
    }
  }

 private:
  static constexpr DevPtr kBase = DevPtr{0x200000000000};  // 32 TiB
  static constexpr DevPtr kEnd = DevPtr{0x500000000000};   // 80 TiB
  std::mutex mu_;
  bool ready_ = false;
  std::map<DevPtr, std::size_t> free_;  // base -> size
};

}  // namespace

struct SimBackend::State {
  struct HandleInfo {
    int fd;
    std::size_t size;
    int device;
    bool imported = false;  // import_handle: another backend counts its bytes
  };
  struct MappingInfo {
    std::size_t size;
    bool accessible;
  };
  mutable std::mutex mu;
  std::uint64_t identity = 0;  // distinguishes this backend's devices from any other's (UUIDs)
  std::condition_variable device_cv;
  bool device_held = false;
  // Holds so far: an event recorded during hold n has completed once that hold ended (the device
  // ran past it), even while a later hold keeps synchronize() blocking. events: each event and
  // the hold it was last recorded in (0: none).
  std::uint64_t holds = 0;
  std::unordered_map<Event, std::uint64_t> events;
  Event next_event = 1;
  std::vector<std::size_t> used;
  std::vector<std::size_t> external;
  std::unordered_map<PhysHandle, HandleInfo> handles;
  PhysHandle next_handle = 1;
  std::map<DevPtr, std::size_t> reservations;  // base -> size
  // The lane reservations ascend in (sim_backend.cpp's top): [lane, lane_end), next at lane_next.
  DevPtr lane = 0, lane_end = 0, lane_next = 0;
  bool lane_tried = false;
  std::map<DevPtr, MappingInfo> mappings;  // base -> mapping
  struct Fault {
    std::uint64_t countdown = 0;
    bool always = false;
    Status status = Status::out_of_memory;
    std::uint64_t calls = 0;
  };
  Fault faults[static_cast<int>(SimOp::count_)];
  // synchronize() skips the mutex while the device is not held and no synchronize fault is armed:
  // an idle device's fence then costs the pool little, as a real idle cuCtxSynchronize does,
  // rather than a process-wide lock that two benchmark threads would take turns on.
  alignas(64) std::atomic<bool> sync_slow{false};  // device_held, or a synchronize fault armed
  // Fast calls, counted per thread slot on lines of their own (calls() sums them).
  struct alignas(64) Counter {
    std::atomic<std::uint64_t> n{0};
  };
  static constexpr unsigned kCounterSlots = 8;
  Counter sync_fast_calls[kCounterSlots];
  std::uint64_t fast_calls() const {
    std::uint64_t total = 0;
    for (const Counter& c : sync_fast_calls) total += c.n.load(std::memory_order_relaxed);
    return total;
  }
  void update_sync_slow() {  // mu held
    const Fault& f = faults[static_cast<int>(SimOp::synchronize)];
    sync_slow.store(device_held || f.always || f.countdown != 0, std::memory_order_seq_cst);
  }
  // Shared device (sim_shared:NAME): bytes in use per device, for every process using NAME.
  struct Shared {
    std::atomic<std::uint64_t> used[16];
  };
  static_assert(std::atomic<std::uint64_t>::is_always_lock_free);
  Shared* shared = nullptr;
  std::uint64_t shared_identity = 0;

  // The reservation containing [ptr, ptr+size), or reservations.end().
  std::map<DevPtr, std::size_t>::iterator reservation_of(DevPtr ptr, std::size_t size) {
    auto it = reservations.upper_bound(ptr);
    if (it == reservations.begin()) return reservations.end();
    --it;
    if (ptr + size > it->first + it->second || ptr + size < ptr) return reservations.end();
    return it;
  }
  bool overlaps_mapping(DevPtr ptr, std::size_t size) const {
    auto it = mappings.lower_bound(ptr);
    if (it != mappings.end() && it->first < ptr + size) return true;
    if (it != mappings.begin()) {
      --it;
      if (it->first + it->second.size > ptr) return true;
    }
    return false;
  }
};

SimBackend::SimBackend(SimOptions options) : options_(options), state_(std::make_unique<State>()) {
  if (options_.devices < 1) options_.devices = 1;
  if (options_.granularity == 0 || (options_.granularity & (options_.granularity - 1)) != 0 ||
      options_.granularity % static_cast<std::size_t>(sysconf(_SC_PAGESIZE)) != 0) {
    options_.granularity = 2 * MiB;
  }
  state_->used.assign(options_.devices, 0);
  open_shared();
  state_->external.assign(options_.devices, 0);
  static std::atomic<std::uint64_t> instances{0};
  timespec now{};
  clock_gettime(CLOCK_REALTIME, &now);
  state_->identity = (static_cast<std::uint64_t>(getpid()) << 40) ^
                     (static_cast<std::uint64_t>(now.tv_sec) << 20) ^
                     static_cast<std::uint64_t>(now.tv_nsec) ^ (instances.fetch_add(1) << 56);
  // Each handle is a file descriptor: allow as many as the hard limit permits.
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    setrlimit(RLIMIT_NOFILE, &lim);
  }
}

namespace {
// The call's configured cost (SimOptions::call_ns), spent busy-waiting as a driver call would
// hold its caller.
void spend(const SimOptions& options, SimOp op) noexcept {
  const std::uint32_t ns = options.call_ns[static_cast<std::size_t>(op)];
  if (ns == 0) return;
  const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
  while (std::chrono::steady_clock::now() < until) {
  }
}

bool valid_shared_name(const std::string& n) {
  if (n.empty() || n.size() > 64) return false;
  for (char c : n) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '-' || c == '.';
    if (!ok) return false;
  }
  return true;
}
std::string shared_object(const std::string& name) {
  return "/gpustitch-sim." + std::to_string(geteuid()) + "." + name;
}
}  // namespace

void SimBackend::open_shared() noexcept {
  if (!valid_shared_name(options_.shared_name)) return;
  if (options_.devices > 16) options_.devices = 16;
  const std::string obj = shared_object(options_.shared_name);
  int fd = shm_open(obj.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return;
  // Every process sets the same size; a fresh object reads as zeros (no bytes in use).
  struct stat st {};
  if (fstat(fd, &st) != 0 || st.st_uid != geteuid() ||
      (st.st_size != sizeof(State::Shared) &&
       ftruncate(fd, static_cast<off_t>(sizeof(State::Shared))) != 0)) {
    close(fd);
    return;
  }
  void* p = mmap(nullptr, sizeof(State::Shared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return;
  state_->shared = static_cast<State::Shared*>(p);
  // FNV-1a of the name: the same in every process.
  std::uint64_t h = 1469598103934665603ull;
  for (char c : options_.shared_name) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  state_->shared_identity = h;
}

bool SimBackend::shared() const noexcept {
  return state_->shared != nullptr;
}

void SimBackend::unlink_shared(const std::string& name) noexcept {
  if (valid_shared_name(name)) shm_unlink(shared_object(name).c_str());
}

SimBackend::~SimBackend() {
  if (state_->shared != nullptr) {
    // Handles still held go back to the shared device (the pool of a process normally outlives
    // its backend only at exit).
    for (auto& [id, h] : state_->handles) state_->shared->used[h.device].fetch_sub(h.size);
    munmap(state_->shared, sizeof(State::Shared));
  }
  for (auto& [base, m] : state_->mappings) munmap(reinterpret_cast<void*>(base), m.size);
  for (auto& [base, size] : state_->reservations) munmap(reinterpret_cast<void*>(base), size);
  for (auto& [id, h] : state_->handles) close(h.fd);
  if (state_->lane != 0)
    AscendingLanes::get()->give_back(state_->lane, state_->lane_end - state_->lane);
}

Status SimBackend::check_fault(SimOp op) noexcept {
  // Called with the lock held.
  auto& f = state_->faults[static_cast<int>(op)];
  ++f.calls;
  if (f.always) return f.status;
  if (f.countdown > 0 && --f.countdown == 0) return f.status;
  return Status::ok;
}

void SimBackend::fail_nth(SimOp op, std::uint64_t nth, Status status) noexcept {
  std::lock_guard lock(state_->mu);
  auto& f = state_->faults[static_cast<int>(op)];
  f.countdown = nth;
  f.status = status;
  state_->update_sync_slow();
}

void SimBackend::fail_always(SimOp op, bool on, Status status) noexcept {
  std::lock_guard lock(state_->mu);
  auto& f = state_->faults[static_cast<int>(op)];
  f.always = on;
  f.status = status;
  state_->update_sync_slow();
}

std::uint64_t SimBackend::calls(SimOp op) const noexcept {
  std::lock_guard lock(state_->mu);
  return state_->faults[static_cast<int>(op)].calls +
         (op == SimOp::synchronize ? state_->fast_calls() : 0);
}

void SimBackend::set_external_usage(int device, std::size_t bytes) noexcept {
  std::lock_guard lock(state_->mu);
  if (device >= 0 && device < options_.devices) state_->external[device] = bytes;
}

void SimBackend::hold_device(bool held) noexcept {
  {
    std::lock_guard lock(state_->mu);
    if (held && !state_->device_held) ++state_->holds;
    state_->device_held = held;
    state_->update_sync_slow();
  }
  state_->device_cv.notify_all();
}

std::size_t SimBackend::granularity(int) noexcept {
  return options_.granularity;
}
bool SimBackend::supports_map_offset(int) noexcept {
  return options_.map_offset;
}

Status SimBackend::device_uuid(int device, DeviceUuid* out) noexcept {
  if (device < 0 || device >= options_.devices) return Status::invalid_device;
  if (out == nullptr) return Status::invalid_value;
  DeviceUuid uuid{'S', 'I', 'M', static_cast<std::uint8_t>(state_->shared ? 'S' : 0)};
  const std::uint64_t identity = state_->shared ? state_->shared_identity : state_->identity;
  std::memcpy(uuid.data() + 4, &identity, sizeof identity);
  const auto ordinal = static_cast<std::uint32_t>(device);
  std::memcpy(uuid.data() + 12, &ordinal, sizeof ordinal);
  *out = uuid;
  return Status::ok;
}

Status SimBackend::handle_properties(int device, HandleProperties* out) noexcept {
  if (device < 0 || device >= options_.devices) return Status::invalid_device;
  if (out == nullptr) return Status::invalid_value;
  *out = HandleProperties{};  // memfds of this backend, not driver handles; nothing exportable
  return Status::ok;
}

Status SimBackend::mem_info(int device, std::size_t* free, std::size_t* total) noexcept {
  spend(options_, SimOp::mem_info);
  if (device < 0 || device >= options_.devices) return Status::invalid_device;
  std::lock_guard lock(state_->mu);
  if (Status s = check_fault(SimOp::mem_info); s != Status::ok) return s;
  std::size_t taken = state_->external[device] +
                      (state_->shared ? state_->shared->used[device].load() : state_->used[device]);
  if (free) *free = taken >= options_.capacity ? 0 : options_.capacity - taken;
  if (total) *total = options_.capacity;
  return Status::ok;
}

Status SimBackend::reserve(int device, std::size_t size, DevPtr* out) noexcept {
  spend(options_, SimOp::reserve);
  if (device < 0 || device >= options_.devices) return Status::invalid_device;
  if (size == 0 || size % options_.granularity != 0 || out == nullptr) return Status::invalid_value;
  std::lock_guard lock(state_->mu);
  if (Status s = check_fault(SimOp::reserve); s != Status::ok) return s;
  const std::size_t g = options_.granularity;
  DevPtr base = reserve_in_lane(size);
  if (base == 0) {
    void* raw =
        mmap(nullptr, size + g, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) return Status::out_of_memory;
    auto start = reinterpret_cast<DevPtr>(raw);
    base = align_up(start, g);
    if (base > start) munmap(raw, base - start);
    if (DevPtr end = base + size; end < start + size + g) {
      munmap(reinterpret_cast<void*>(end), start + size + g - end);
    }
  }
  try {
    state_->reservations.emplace(base, size);
  } catch (const std::bad_alloc&) {  // no host memory for the bookkeeping: nothing reserved
    munmap(reinterpret_cast<void*>(base), size);
    return Status::out_of_memory;
  }
  *out = base;
  return Status::ok;
}

DevPtr SimBackend::reserve_in_lane(std::size_t size) noexcept {
  // Mutex held. The lane: eight times the devices' capacity and 64 GiB more (the pool reserves
  // about 3.5 times a device's capacity), at most 16 TiB.
  State& st = *state_;
  const std::size_t g = options_.granularity;
  if (!st.lane_tried) {
    st.lane_tried = true;
    constexpr std::size_t kMaxLane = std::size_t{16} << 40;
    const std::size_t capacity = std::min(options_.capacity, kMaxLane);
    std::size_t want =
        std::min(kMaxLane, capacity * 8 * static_cast<std::size_t>(options_.devices) + 64 * GiB);
    want = align_up(want, g);
    if (AscendingLanes* lanes = AscendingLanes::get(); lanes != nullptr) {
      if (DevPtr lane = lanes->take(want); lane != 0) {
        st.lane = lane;
        st.lane_end = lane + want;
        st.lane_next = align_up(lane, g);
      }
    }
  }
  // A few tries, stepping over ranges someone else maps inside the lane.
  for (int tries = 0; tries < 4 && st.lane != 0; ++tries) {
    const DevPtr want = st.lane_next;
    if (want >= st.lane_end || size > st.lane_end - want) return 0;
    void* raw = mmap(reinterpret_cast<void*>(want), size, PROT_NONE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
    if (raw == reinterpret_cast<void*>(want)) {
      // A granule between ranges, as the driver leaves: no two reservations touch.
      st.lane_next = std::min(st.lane_end, align_up(want + size + g, g));
      return want;
    }
    if (raw != MAP_FAILED) {
      // Placed elsewhere: the range was taken and the kernel (before Linux 4.17) or emulator
      // (qemu-user 7) took the address as a hint. Step over it as over EEXIST.
      munmap(raw, size);
    } else if (errno != EEXIST) {
      return 0;  // no room there (a smaller address space, a limit)
    }
    st.lane_next = std::min(st.lane_end, align_up(want + size + g, g));
  }
  return 0;
}

Status SimBackend::unreserve(DevPtr ptr, std::size_t size) noexcept {
  spend(options_, SimOp::unreserve);
  std::lock_guard lock(state_->mu);
  if (Status s = check_fault(SimOp::unreserve); s != Status::ok) return s;
  auto it = state_->reservations.find(ptr);
  if (it == state_->reservations.end() || it->second != size) return Status::invalid_value;
  if (state_->overlaps_mapping(ptr, size)) return Status::invalid_value;  // still mapped
  munmap(reinterpret_cast<void*>(ptr), size);
  state_->reservations.erase(it);
  return Status::ok;
}

Status SimBackend::create(int device, std::size_t size, PhysHandle* out) noexcept {
  spend(options_, SimOp::create);
  if (device < 0 || device >= options_.devices) return Status::invalid_device;
  if (size == 0 || size % options_.granularity != 0 || out == nullptr) return Status::invalid_value;
  std::lock_guard lock(state_->mu);
  if (Status s = check_fault(SimOp::create); s != Status::ok) return s;
  if (state_->shared != nullptr) {
    // Check-and-add across processes in one compare-exchange: never over the capacity, and
    // never a spurious failure from another process's attempt that will not succeed.
    const std::size_t limit = options_.capacity > state_->external[device]
                                  ? options_.capacity - state_->external[device]
                                  : 0;
    std::uint64_t cur = state_->shared->used[device].load();
    do {
      if (cur > limit || size > limit - cur) return Status::out_of_memory;
    } while (!state_->shared->used[device].compare_exchange_weak(cur, cur + size));
  } else {
    std::size_t taken = state_->used[device] + state_->external[device];
    if (taken > options_.capacity || size > options_.capacity - taken) return Status::out_of_memory;
  }
  auto unshare = [&] {
    if (state_->shared != nullptr) state_->shared->used[device].fetch_sub(size);
  };
  int fd = memfd_create("gpustitch-sim", MFD_CLOEXEC);
  if (fd < 0) {
    unshare();
    return Status::out_of_memory;
  }
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    close(fd);
    unshare();
    return Status::out_of_memory;
  }
  PhysHandle id = state_->next_handle++;
  try {
    state_->handles.emplace(id, State::HandleInfo{fd, size, device});
  } catch (const std::bad_alloc&) {
    close(fd);
    unshare();
    return Status::out_of_memory;
  }
  state_->used[device] += size;
  *out = id;
  return Status::ok;
}

Status SimBackend::release(PhysHandle handle) noexcept {
  spend(options_, SimOp::release);
  std::lock_guard lock(state_->mu);
  if (Status s = check_fault(SimOp::release); s != Status::ok) return s;
  auto it = state_->handles.find(handle);
  if (it == state_->handles.end()) return Status::invalid_value;
  // Like cuMemRelease: existing mappings keep the memory alive (the kernel does that for us).
  close(it->second.fd);
  if (!it->second.imported) {
    state_->used[it->second.device] -= it->second.size;
    if (state_->shared != nullptr) {
      state_->shared->used[it->second.device].fetch_sub(it->second.size);
    }
  }
  state_->handles.erase(it);
  return Status::ok;
}

Status SimBackend::export_handle(PhysHandle handle, int* fd) noexcept {
  if (fd == nullptr) return Status::invalid_value;
  std::lock_guard lock(state_->mu);
  auto it = state_->handles.find(handle);
  if (it == state_->handles.end()) return Status::invalid_value;
  const int copy = fcntl(it->second.fd, F_DUPFD_CLOEXEC, 0);
  if (copy < 0) return Status::error;
  *fd = copy;
  return Status::ok;
}

Status SimBackend::import_handle(int device, int fd, std::size_t size, PhysHandle* out) noexcept {
  if (device < 0 || device >= options_.devices) return Status::invalid_device;
  if (out == nullptr || fd < 0 || size == 0 || size % options_.granularity != 0) {
    return Status::invalid_value;
  }
  struct stat st {};
  // A memfd of at least size bytes, as create() makes them; anything else is not a handle.
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || static_cast<std::size_t>(st.st_size) < size) {
    return Status::invalid_value;
  }
  const int copy = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (copy < 0) return Status::error;
  std::lock_guard lock(state_->mu);
  PhysHandle id = state_->next_handle++;
  try {
    state_->handles.emplace(id, State::HandleInfo{copy, size, device, true});
  } catch (const std::bad_alloc&) {
    close(copy);
    return Status::out_of_memory;
  }
  *out = id;
  return Status::ok;
}

Status SimBackend::map(DevPtr ptr, std::size_t size, PhysHandle handle,
                       std::size_t offset) noexcept {
  spend(options_, SimOp::map);
  const std::size_t g = options_.granularity;
  if (size == 0 || ptr % g != 0 || size % g != 0 || offset % g != 0) return Status::invalid_value;
  std::lock_guard lock(state_->mu);
  if (Status s = check_fault(SimOp::map); s != Status::ok) return s;
  if (offset != 0 && !options_.map_offset) return Status::invalid_value;
  auto h = state_->handles.find(handle);
  if (h == state_->handles.end()) return Status::invalid_value;
  if (offset > h->second.size || size > h->second.size - offset) return Status::invalid_value;
  if (state_->reservation_of(ptr, size) == state_->reservations.end()) return Status::invalid_value;
  if (state_->overlaps_mapping(ptr, size)) return Status::invalid_value;
  void* p = mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED,
                 h->second.fd, static_cast<off_t>(offset));
  if (p == MAP_FAILED) return Status::out_of_memory;
  try {
    state_->mappings.emplace(ptr, State::MappingInfo{size, false});
  } catch (const std::bad_alloc&) {  // back to a bare reservation
    mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE,
         MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    return Status::out_of_memory;
  }
  return Status::ok;
}

Status SimBackend::unmap(DevPtr ptr, std::size_t size) noexcept {
  spend(options_, SimOp::unmap);
  std::lock_guard lock(state_->mu);
  if (Status s = check_fault(SimOp::unmap); s != Status::ok) return s;
  auto it = state_->mappings.find(ptr);
  if (it == state_->mappings.end() || it->second.size != size) return Status::invalid_value;
  void* p = mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return Status::error;
  state_->mappings.erase(it);
  return Status::ok;
}

Status SimBackend::set_access(DevPtr ptr, std::size_t size, std::span<const int> devices) noexcept {
  spend(options_, SimOp::set_access);
  if (size == 0) return Status::invalid_value;
  for (int d : devices) {
    if (d < 0 || d >= options_.devices) return Status::invalid_device;
  }
  std::lock_guard lock(state_->mu);
  if (Status s = check_fault(SimOp::set_access); s != Status::ok) return s;
  // The whole range must be covered by mappings, as cuMemSetAccess requires.
  auto first = state_->mappings.upper_bound(ptr);
  if (first != state_->mappings.begin()) --first;
  DevPtr cur = ptr;
  auto it = first;
  while (cur < ptr + size) {
    if (it == state_->mappings.end() || it->first > cur || it->first + it->second.size <= cur) {
      return Status::invalid_value;
    }
    cur = it->first + it->second.size;
    ++it;
  }
  if (mprotect(reinterpret_cast<void*>(ptr), size, PROT_READ | PROT_WRITE) != 0) {
    return Status::error;
  }
  for (auto m = first; m != it; ++m) m->second.accessible = true;
  return Status::ok;
}

Status SimBackend::synchronize(int device) noexcept {
  spend(options_, SimOp::synchronize);
  if (device < 0 || device >= options_.devices) return Status::invalid_device;
  if (!state_->sync_slow.load(std::memory_order_seq_cst)) {
    static std::atomic<unsigned> next_slot{0};
    thread_local const unsigned slot = next_slot.fetch_add(1) % State::kCounterSlots;
    state_->sync_fast_calls[slot].n.fetch_add(1, std::memory_order_relaxed);
    return Status::ok;
  }
  std::unique_lock lock(state_->mu);
  const Status fault = check_fault(SimOp::synchronize);
  state_->update_sync_slow();  // a fault that just fired is disarmed
  if (fault != Status::ok) return fault;
  state_->device_cv.wait(lock, [&] { return !state_->device_held; });
  return Status::ok;
}

Status SimBackend::create_event(int device, Event* out) noexcept {
  if (device < 0 || device >= options_.devices) return Status::invalid_device;
  std::lock_guard lock(state_->mu);
  try {
    const Event e = state_->next_event++;
    state_->events.emplace(e, 0);
    *out = e;
  } catch (...) {
    return Status::out_of_memory;
  }
  return Status::ok;
}

Status SimBackend::destroy_event(Event event) noexcept {
  std::lock_guard lock(state_->mu);
  return state_->events.erase(event) != 0 ? Status::ok : Status::invalid_value;
}

Status SimBackend::record_event(int, Event event, Stream) noexcept {
  std::lock_guard lock(state_->mu);
  auto it = state_->events.find(event);
  if (it == state_->events.end()) return Status::invalid_value;
  it->second = state_->device_held ? state_->holds : 0;
  return Status::ok;
}

Status SimBackend::query_event(Event event, bool* done) noexcept {
  std::lock_guard lock(state_->mu);
  auto it = state_->events.find(event);
  if (it == state_->events.end()) return Status::invalid_value;
  *done = it->second == 0 || !state_->device_held || state_->holds > it->second;
  return Status::ok;
}

std::size_t SimBackend::live_events() const noexcept {
  std::lock_guard lock(state_->mu);
  return state_->events.size();
}

std::size_t SimBackend::used(int device) const noexcept {
  std::lock_guard lock(state_->mu);
  return device >= 0 && device < options_.devices ? state_->used[device] : 0;
}
std::size_t SimBackend::live_handles() const noexcept {
  std::lock_guard lock(state_->mu);
  return state_->handles.size();
}
std::size_t SimBackend::live_reservations() const noexcept {
  std::lock_guard lock(state_->mu);
  return state_->reservations.size();
}
std::size_t SimBackend::live_mappings() const noexcept {
  std::lock_guard lock(state_->mu);
  return state_->mappings.size();
}

}  // namespace gpustitch
