// Backing: the device's handles. See backing.h for the design.
#include "backing.h"

#include <algorithm>
#include <chrono>
#include <new>

namespace gpustitch::detail {

Backing::Backing(Backend& backend, int device) noexcept : backend_(backend), device_(device) {
  try {
    access_.reserve(8);
    failed_.reserve(16);
  } catch (...) {
  }
  access_.push_back(device);  // within the capacity reserved above, or one element anyway
}

Backing::~Backing() {
  settle_retired();  // the reclaimer has stopped: nothing is claimed
  while (!mapped_.empty()) {
    Handle& h = *mapped_.begin();
    mapped_.erase(mapped_.begin());
    backend_.unmap(h.at, h.size);
    backend_.release(h.id);
    delete &h;
  }
  while (!spares_.empty()) {
    Handle& h = *spares_.begin();
    spares_.erase(spares_.begin());
    backend_.release(h.id);
    delete &h;
  }
  for (Handle* h : failed_) {
    backend_.release(h->id);
    delete h;
  }
}

Status Backing::create(std::size_t size, Handle** out) noexcept {
  auto* h = new (std::nothrow) Handle;
  if (h == nullptr) return Status::out_of_memory;
  if (Status s = timed(DriverOp::create, [&] { return backend_.create(device_, size, &h->id); });
      s != Status::ok) {
    delete h;
    return s == Status::ok ? Status::out_of_memory : s;
  }
  h->size = size;
  spares_.insert(*h);
  held_bytes_ += size;
  ++count_;
  *out = h;
  return Status::ok;
}

Status Backing::settle_retired() noexcept {
  return settle([](DevPtr, std::size_t, PhysHandle) { return true; });
}

Status Backing::map(Handle* h, DevPtr at) noexcept {
  // Nothing is mapped over a place a moved handle still holds in the driver.
  if (Status s = settle(
          [&](DevPtr r, std::size_t n, PhysHandle) { return r < at + h->size && at < r + n; });
      s != Status::ok) {
    return s;
  }
  if (Status s = timed(DriverOp::map, [&] { return backend_.map(at, h->size, h->id, 0); });
      s != Status::ok) {
    return s;
  }
  spares_.erase(spares_.iterator_to(*h));
  h->at = at;
  mapped_.insert(*h);
  mapped_bytes_ += h->size;
  return Status::ok;
}

Status Backing::unmap(Handle* h) noexcept {
  if (Status s = timed(DriverOp::unmap, [&] { return backend_.unmap(h->at, h->size); });
      s != Status::ok)
    return s;
  mapped_.erase(mapped_.iterator_to(*h));
  mapped_bytes_ -= h->size;
  h->at = 0;
  spares_.insert(*h);
  return Status::ok;
}

Status Backing::retire(Handle* h) noexcept {
  if (!retired_.add(h->at, h->size, h->id)) return unmap(h);
  mapped_.erase(mapped_.iterator_to(*h));
  mapped_bytes_ -= h->size;
  h->at = 0;
  spares_.insert(*h);
  return Status::ok;
}

void Backing::unmap_claimed(std::span<const RetiredMappings::Claim> claims) noexcept {
  for (const RetiredMappings::Claim& c : claims) {
    const auto t0 = std::chrono::steady_clock::now();
    const Status s = backend_.unmap(c.at, c.size);
    background_ns_.fetch_add(
        static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                       std::chrono::steady_clock::now() - t0)
                                       .count()),
        std::memory_order_relaxed);
    background_calls_.fetch_add(1, std::memory_order_relaxed);
    retired_.finish(c, s);
  }
}

void Backing::release(Handle* h) noexcept {
  // Its old places unmapped first: the driver frees the memory only once nothing maps it.
  if (settle([&](DevPtr, std::size_t, PhysHandle id) { return id == h->id; }) != Status::ok) {
    return;  // still held, still a spare: a later trim tries again
  }
  spares_.erase(spares_.iterator_to(*h));
  if (timed(DriverOp::release, [&] { return backend_.release(h->id); }) == Status::ok) {
    held_bytes_ -= h->size;
    --count_;
    delete h;
    return;
  }
  try {
    failed_.push_back(h);
    failed_bytes_ += h->size;
  } catch (...) {
    // No room to remember it: the driver keeps the memory, and so does the count.
    failed_bytes_ += h->size;
  }
}

std::size_t Backing::retry_failed() noexcept {
  std::size_t released = 0;
  std::erase_if(failed_, [&](Handle* h) {
    if (timed(DriverOp::release, [&] { return backend_.release(h->id); }) != Status::ok)
      return false;
    released += h->size;
    held_bytes_ -= h->size;
    failed_bytes_ -= h->size;
    --count_;
    delete h;
    return true;
  });
  return released;
}

Status Backing::set_access(DevPtr ptr, std::size_t size) noexcept {
  return timed(DriverOp::set_access, [&] {
    return backend_.set_access(ptr, size, std::span<const int>(access_.data(), access_.size()));
  });
}

bool Backing::has_peer(int device) const noexcept {
  return std::find(access_.begin(), access_.end(), device) != access_.end();
}

Status Backing::grant_peer(int peer) noexcept {
  if (has_peer(peer)) return Status::ok;
  try {
    access_.push_back(peer);
  } catch (...) {
    return Status::out_of_memory;
  }
  // Contiguous runs of mapped handles, one cuMemSetAccess each.
  auto for_runs = [&](auto&& fn) {
    for (auto it = mapped_.begin(); it != mapped_.end();) {
      DevPtr lo = it->at, hi = it->end();
      for (++it; it != mapped_.end() && it->at == hi; ++it) hi = it->end();
      if (Status s = fn(lo, hi - lo); s != Status::ok) return std::pair{s, lo};
    }
    return std::pair{Status::ok, DevPtr{0}};
  };
  const auto result = for_runs([&](DevPtr lo, std::size_t n) { return set_access(lo, n); });
  const Status status = result.first;
  const DevPtr failed_at = result.second;  // a plain variable: lambdas below capture it
  if (status == Status::ok) return Status::ok;
  access_.pop_back();
  for_runs([&](DevPtr lo, std::size_t n) {  // back to the previous set of devices
    if (lo >= failed_at) return Status::error;
    set_access(lo, n);
    return Status::ok;
  });
  return status;
}

Handle* Backing::handle_at(DevPtr ptr) const noexcept {
  Handle probe;
  probe.at = ptr;
  auto it = mapped_.upper_bound(probe);
  if (it == mapped_.begin()) return nullptr;
  --it;
  Handle& h = const_cast<Handle&>(*it);
  return ptr < h.end() ? &h : nullptr;
}

Handle* Backing::first_from(DevPtr ptr) const noexcept {
  Handle probe;
  probe.at = ptr;
  auto it = mapped_.lower_bound(probe);
  return it == mapped_.end() ? nullptr : const_cast<Handle*>(&*it);
}

Handle* Backing::next(Handle* h) const noexcept {
  auto it = mapped_.iterator_to(*h);
  ++it;
  return it == mapped_.end() ? nullptr : const_cast<Handle*>(&*it);
}

}  // namespace gpustitch::detail
