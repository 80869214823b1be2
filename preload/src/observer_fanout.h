// One PoolObserver that forwards every callback to several: the pool takes a single observer, and
// the shim wants the shared-memory statistics publisher, the trace writer and anything else that
// watches allocations to see the same events.
//
// Observers are added during initialisation, before the pool exists, and never removed (the pool
// outlives them all: nothing in the shim is destroyed at exit), so the callbacks read the list
// without a lock.
#pragma once

#include <memory>
#include <vector>

#include "gpustitch/stats.h"

namespace gpustitch::preload {

class ObserverFanout final : public PoolObserver {
 public:
  // Takes ownership. Only before the fan-out is handed to a Pool.
  void add(std::unique_ptr<PoolObserver> observer) {
    if (observer) observers_.push_back(std::move(observer));
  }
  bool empty() const noexcept { return observers_.empty(); }
  std::size_t size() const noexcept { return observers_.size(); }

  void on_allocate(int device, DevPtr ptr, std::size_t size, Stream stream,
                   ServedBy how) noexcept override {
    for (auto& o : observers_) o->on_allocate(device, ptr, size, stream, how);
  }
  void on_free(int device, DevPtr ptr, std::size_t size, Stream stream) noexcept override {
    for (auto& o : observers_) o->on_free(device, ptr, size, stream);
  }
  void on_event(const PoolEvent& event) noexcept override {
    for (auto& o : observers_) o->on_event(event);
  }

 private:
  std::vector<std::unique_ptr<PoolObserver>> observers_;
};

}  // namespace gpustitch::preload
