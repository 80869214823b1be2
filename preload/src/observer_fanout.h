// One PoolObserver that forwards every callback to several: the pool takes a single observer, and
// the shim wants the shared-memory statistics publisher, the trace writer and anything else that
// watches allocations to see the same events.
//
// Observers may be added after the pool exists (the statistics publisher is constructed from the
// pool it reports on), possibly while the pool's reclaimer thread already raises events. So the
// list is a fixed array of atomic pointers published by an atomic count: add() is lock-free and
// callbacks never see a half-added observer. Observers are never removed; the fan-out owns them and
// destroys them with itself. The shim's fan-out is never destroyed (like the rest of the shim's
// state it lives until the process ends, see shim.h), so neither are its observers.
#pragma once

#include <atomic>
#include <memory>

#include "gpustitch/stats.h"

namespace gpustitch::preload {

class ObserverFanout final : public PoolObserver {
 public:
  static constexpr int kMaxObservers = 8;

  ObserverFanout() = default;
  ObserverFanout(const ObserverFanout&) = delete;
  ObserverFanout& operator=(const ObserverFanout&) = delete;
  // Only once no thread raises events any more.
  ~ObserverFanout() override {
    for (int i = 0; i < count_.load(std::memory_order_acquire); ++i)
      delete slots_[i].load(std::memory_order_relaxed);
  }

  // Takes ownership. False when full.
  bool add(std::unique_ptr<PoolObserver> observer) noexcept {
    if (!observer) return false;
    int n = count_.load(std::memory_order_relaxed);
    if (n >= kMaxObservers) return false;
    slots_[n].store(observer.release(), std::memory_order_relaxed);
    count_.store(n + 1, std::memory_order_release);  // additions happen on one thread (init)
    return true;
  }
  int size() const noexcept { return count_.load(std::memory_order_acquire); }

  void on_allocate(int device, DevPtr ptr, std::size_t size, Stream stream,
                   ServedBy how) noexcept override {
    int n = count_.load(std::memory_order_acquire);
    for (int i = 0; i < n; ++i)
      slots_[i].load(std::memory_order_relaxed)->on_allocate(device, ptr, size, stream, how);
  }
  void on_free(int device, DevPtr ptr, std::size_t size, Stream stream) noexcept override {
    int n = count_.load(std::memory_order_acquire);
    for (int i = 0; i < n; ++i) {
      slots_[i].load(std::memory_order_relaxed)->on_free(device, ptr, size, stream);
    }
  }
  void on_event(const PoolEvent& event) noexcept override {
    int n = count_.load(std::memory_order_acquire);
    for (int i = 0; i < n; ++i) slots_[i].load(std::memory_order_relaxed)->on_event(event);
  }
  void on_segment(int device, DevPtr ptr, std::size_t size, bool mapped) noexcept override {
    int n = count_.load(std::memory_order_acquire);
    for (int i = 0; i < n; ++i) {
      slots_[i].load(std::memory_order_relaxed)->on_segment(device, ptr, size, mapped);
    }
  }

 private:
  std::atomic<PoolObserver*> slots_[kMaxObservers] = {};
  std::atomic<int> count_{0};
};

}  // namespace gpustitch::preload
