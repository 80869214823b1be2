// See program_memory.h.
#include "program_memory.h"

#include <pthread.h>

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "gpustitch/shm/record.h"
#include "shim.h"

namespace gpustitch::preload {
namespace {

constexpr int kMaxCounted = 64;

struct Counters {
  std::atomic<std::uint64_t> held{0}, created{0}, handles{0}, mapped{0}, served{0},
      served_handles{0};
};
Counters g_counters[kMaxCounted];

struct HandleInfo {
  std::size_t size = 0;
  int device = 0;
  int refs = 0;  // cuMemCreate and each cuMemRetainAllocationHandle, minus cuMemRelease
  std::uint64_t maps = 0;
  bool kept = false;  // goes to the pool's cache when done (program_lending.h)
  // Kept: the program still holds the create's reference, whose release is not forwarded (the
  // others, from cuMemRetainAllocationHandle, are the driver's and their releases are).
  bool kept_ref = false;
  bool lent = false;      // the pool's handle: counted as served
  bool exported = false;  // cuMemExportToShareableHandle: another process may hold it
  HandleProperties props;
};
struct MapInfo {
  std::size_t size = 0;
  cuda::CUmemGenericAllocationHandle handle = 0;
  int device = 0;
  bool known = false;  // handle is in the handle table
};

struct Tables {
  std::mutex mu;
  std::unordered_map<cuda::CUmemGenericAllocationHandle, HandleInfo> handles;
  std::map<cuda::CUdeviceptr, MapInfo> maps;
  // Kept handles the program is done with and the pool took: the driver still knows them (the
  // pool holds the reference), so a second cuMemRelease must get the driver's "invalid" here
  // instead of reaching it. A value leaves when a cuMemCreate hands it out again.
  std::unordered_set<cuda::CUmemGenericAllocationHandle> retired;
};

Tables& tables() noexcept {
  // Leaked on purpose: hooks may run after static destructors (CUDA's own teardown at exit).
  static Tables* t = [] {
    auto* p = new Tables();
    pthread_atfork([] { tables().mu.lock(); }, [] { tables().mu.unlock(); },
                   [] { tables().mu.unlock(); });
    return p;
  }();
  return *t;
}

Counters* counters(int device) noexcept {
  return device >= 0 && device < kMaxCounted ? &g_counters[device] : nullptr;
}

void add(std::atomic<std::uint64_t>& c, std::uint64_t v) noexcept {
  c.fetch_add(v, std::memory_order_relaxed);
}
void sub(std::atomic<std::uint64_t>& c, std::uint64_t v) noexcept {
  c.fetch_sub(v, std::memory_order_relaxed);
}

// The handle is no longer referenced by the program (refs reached 0): not created any more.
void drop_created(HandleInfo& h) noexcept {
  if (Counters* c = counters(h.device)) {
    sub(c->created, h.size);
    sub(c->handles, 1);
  }
}
// Neither referenced nor mapped: the driver frees it, or, kept, it goes to the pool. Erases it
// first (tables().mu held), so the handle value is free for the table when the pool lends it out
// again.
void drop_held(
    Tables& t,
    std::unordered_map<cuda::CUmemGenericAllocationHandle, HandleInfo>::iterator it) noexcept {
  const cuda::CUmemGenericAllocationHandle handle = it->first;
  const HandleInfo h = it->second;
  if (Counters* c = counters(h.device)) {
    sub(c->held, h.size);
    if (h.lent) {
      sub(c->served, h.size);
      sub(c->served_handles, 1);
    }
  }
  t.handles.erase(it);
  if (h.kept && retire_kept_handle(h.device, handle, h.size, h.props, !h.exported)) {
    try {
      t.retired.insert(handle);
    } catch (...) {  // no host memory: a second release would reach the driver, as before
    }
  }
}

}  // namespace

ProgramMemory program_memory(int device) noexcept {
  ProgramMemory m;
  if (const Counters* c = counters(device)) {
    m.held_bytes = c->held.load(std::memory_order_relaxed);
    m.created_bytes = c->created.load(std::memory_order_relaxed);
    m.handles = c->handles.load(std::memory_order_relaxed);
    m.mapped_bytes = c->mapped.load(std::memory_order_relaxed);
    m.served_bytes = c->served.load(std::memory_order_relaxed);
    m.served_handles = c->served_handles.load(std::memory_order_relaxed);
  }
  return m;
}

void note_program_create(cuda::CUmemGenericAllocationHandle handle, std::size_t size,
                         const void* prop, const PoolTerms& terms, bool lent) noexcept {
  if (prop == nullptr || size == 0) return;
  int location[2];  // CUmemLocation {type, id}
  std::memcpy(location, static_cast<const char*>(prop) + cuda::kAllocationPropLocationOffset,
              sizeof location);
  if (location[0] != cuda::CU_MEM_LOCATION_TYPE_DEVICE) return;  // host memory
  const int device = location[1];
  Counters* c = counters(device);
  if (c == nullptr) return;
  Tables& t = tables();
  std::lock_guard lock(t.mu);
  t.retired.erase(handle);
  try {
    auto [it, inserted] = t.handles.try_emplace(handle);
    if (!inserted) {
      // The driver handed out this value again, so the old handle is gone (freed outside the
      // hooks): forget it.
      if (it->second.refs > 0) drop_created(it->second);
      if (Counters* old = counters(it->second.device)) {
        sub(old->held, it->second.size);
        if (it->second.lent) {
          sub(old->served, it->second.size);
          sub(old->served_handles, 1);
        }
      }
    }
    it->second = HandleInfo{size, device, 1, 0, terms.kept, terms.kept, lent, false, terms.props};
  } catch (...) {
    // Out of host memory: this handle goes uncounted, and the pool cannot keep track of it, so
    // one it lent goes back now (the program releases it to the driver like its own).
    if (lent) retire_kept_handle(device, handle, size, terms.props, true);
    return;
  }
  add(c->created, size);
  add(c->handles, 1);
  add(c->held, size);
  if (lent) {
    add(c->served, size);
    add(c->served_handles, 1);
  }
}

void note_program_export(cuda::CUmemGenericAllocationHandle handle) noexcept {
  Tables& t = tables();
  std::lock_guard lock(t.mu);
  auto it = t.handles.find(handle);
  if (it != t.handles.end()) it->second.exported = true;
}

void note_program_retain(cuda::CUmemGenericAllocationHandle handle) noexcept {
  Tables& t = tables();
  std::lock_guard lock(t.mu);
  auto it = t.handles.find(handle);
  if (it == t.handles.end()) return;
  if (it->second.refs++ == 0) {
    // Released but still mapped, now referenced again.
    if (Counters* c = counters(it->second.device)) {
      add(c->created, it->second.size);
      add(c->handles, 1);
    }
  }
}

void note_program_map(cuda::CUdeviceptr ptr, std::size_t size,
                      cuda::CUmemGenericAllocationHandle handle) noexcept {
  if (size == 0) return;
  Tables& t = tables();
  std::unique_lock lock(t.mu);
  MapInfo m{size, handle, -1, false};
  auto it = t.handles.find(handle);
  if (it != t.handles.end()) {
    m.device = it->second.device;
    m.known = true;
  } else {
    lock.unlock();  // the driver call below must not run under the table lock needlessly
    int device = -1;
    if (!driver_current_device(&device)) return;
    m.device = device;
    lock.lock();
  }
  Counters* c = counters(m.device);
  if (c == nullptr) return;
  try {
    auto [at, inserted] = t.maps.insert_or_assign(ptr, m);
    (void)at;
    (void)inserted;
  } catch (...) {
    return;
  }
  if (m.known) ++t.handles.find(handle)->second.maps;
  add(c->mapped, size);
}

cuda::CUresult program_release(cuda::PFN_cuMemRelease fn,
                               cuda::CUmemGenericAllocationHandle handle) noexcept {
  Tables& t = tables();
  std::lock_guard lock(t.mu);
  auto kept = t.handles.find(handle);
  if (kept != t.handles.end() && kept->second.kept) {
    HandleInfo& h = kept->second;
    // The driver still holds the create's reference for the pool, so it would accept a release
    // the program has no reference for: answer as it would have.
    if (h.refs <= 0) return cuda::CUDA_ERROR_INVALID_VALUE;
    cuda::CUresult r = cuda::CUDA_SUCCESS;
    if (h.refs == 1 && h.kept_ref) {
      h.kept_ref = false;  // not forwarded: the reference stays, for the pool
    } else if ((r = fn(handle)) != cuda::CUDA_SUCCESS) {
      return r;
    }
    if (--h.refs == 0) {
      drop_created(h);
      if (h.maps == 0) drop_held(t, kept);
    }
    return r;
  }
  if (kept == t.handles.end() && t.retired.count(handle) != 0) {
    return cuda::CUDA_ERROR_INVALID_VALUE;  // released already; the pool's now
  }
  const cuda::CUresult r = fn(handle);
  if (r != cuda::CUDA_SUCCESS) return r;
  auto it = t.handles.find(handle);
  if (it == t.handles.end() || it->second.refs <= 0) return r;
  if (--it->second.refs == 0) {
    drop_created(it->second);
    if (it->second.maps == 0) drop_held(t, it);
  }
  return r;
}

cuda::CUresult program_unmap(cuda::PFN_cuMemUnmap fn, cuda::CUdeviceptr ptr,
                             std::size_t size) noexcept {
  Tables& t = tables();
  std::lock_guard lock(t.mu);
  const cuda::CUresult r = fn(ptr, size);
  if (r != cuda::CUDA_SUCCESS || size == 0) return r;
  // One unmap may cover several adjacent mappings.
  const cuda::CUdeviceptr end = ptr + size < ptr ? ~cuda::CUdeviceptr{0} : ptr + size;
  auto first = t.maps.lower_bound(ptr);
  auto last = first;
  for (; last != t.maps.end() && last->first < end; ++last) {
    const MapInfo& m = last->second;
    if (Counters* c = counters(m.device)) sub(c->mapped, m.size);
    if (!m.known) continue;
    auto h = t.handles.find(m.handle);
    if (h == t.handles.end()) continue;
    if (h->second.maps > 0) --h->second.maps;
    if (h->second.maps == 0 && h->second.refs <= 0) drop_held(t, h);
  }
  t.maps.erase(first, last);
  return r;
}

std::size_t bound_free_memory(std::size_t free, std::size_t total, std::uint64_t held,
                              std::uint64_t pool_in_use) noexcept {
  if (held == 0) return free;
  const std::uint64_t used = held + pool_in_use;
  const std::size_t left = used >= total ? 0 : static_cast<std::size_t>(total - used);
  return free < left ? free : left;
}

std::size_t program_bounded_free(Pool& pool, int device, std::size_t free,
                                 std::size_t total) noexcept {
  const std::uint64_t held = program_memory(device).held_bytes;
  if (held == 0) return free;
  return bound_free_memory(free, total, held, pool.stats(device).bytes_allocated);
}

void fill_program_counters(int device, shm::DeviceCounters& out) noexcept {
  const ProgramMemory m = program_memory(device);
  out.program_held_bytes = m.held_bytes;
  out.program_created_bytes = m.created_bytes;
  out.program_handles = m.handles;
  out.program_mapped_bytes = m.mapped_bytes;
  out.program_served_bytes = m.served_bytes;
  out.program_served_handles = m.served_handles;
  if (out.device_total != 0) {
    out.largest_possible = bound_free_memory(out.largest_possible, out.device_total, m.held_bytes,
                                             out.bytes_allocated);
  }
}

}  // namespace gpustitch::preload
