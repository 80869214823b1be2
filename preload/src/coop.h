// Cooperative release inside the preload library: the listener that gives idle cache to
// neighbours, and the asking that an allocation about to fail does. See coop.cpp for the design.
#pragma once

#include <cstddef>

#include "gpustitch/config.h"
#include "gpustitch/pool.h"
#include "gpustitch/shm/publisher.h"
#include "gpustitch/shm/record.h"

namespace gpustitch::preload {

// Starts the listener thread when config.coop is on. publisher (may be null) receives the
// coop_give/coop_receive events. Called once, from the shim's initialisation.
void start_coop(const Config& config, Pool& pool, shm::StatsPublisher* publisher) noexcept;

// pool.allocate(), and when that reports out-of-memory (the pool has already trimmed its own
// cache) and coop is on: ask the neighbours on the same GPU to release idle cache, wait up to
// coop_wait_ms for their answers, and retry once. Never holds a pool lock while waiting.
Status allocate_or_ask(Pool& pool, int device, std::size_t size, Stream stream,
                       DevPtr* out) noexcept;

// Adds the coop_* counters of device (the publisher's augment hook).
void fill_coop_counters(int device, shm::DeviceCounters& counters) noexcept;

}  // namespace gpustitch::preload
