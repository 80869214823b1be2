// Cooperative release inside the preload library: the listener that gives idle cache to
// neighbours, and the asking that an allocation about to fail does. See coop.cpp for the design.
#pragma once

#include <cstddef>

#include "gpustitch/config.h"
#include "gpustitch/pool.h"
#include "gpustitch/shm/publisher.h"
#include "gpustitch/shm/record.h"

namespace gpustitch::preload {

// When config.coop is on: starts the listener thread and installs the pool's out-of-memory
// handler (ask the neighbours on the same GPU to release idle cache, wait up to coop_wait_ms,
// let the pool retry once). publisher (may be null) receives the coop_give/coop_receive events.
// Called once, from the shim's initialisation, before the pool serves.
void start_coop(const Config& config, Pool& pool, shm::StatsPublisher* publisher) noexcept;

// Adds the coop_* counters of device (the publisher's augment hook).
void fill_coop_counters(int device, shm::DeviceCounters& counters) noexcept;

}  // namespace gpustitch::preload
