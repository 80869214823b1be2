// Creation of the pool's observers from the configuration. See observers.cpp.
#pragma once

#include <spdlog/logger.h>

#include "gpustitch/config.h"
#include "gpustitch/pool.h"
#include "gpustitch/shm/publisher.h"
#include "gpustitch/trace/snapshot.h"
#include "observer_fanout.h"

namespace gpustitch::preload {

// Adds to fanout every observer the configuration asks for. Called once, during the shim's lazy
// initialisation, right after pool was created with fanout as its observer and before any other
// thread can reach the pool through a hook.
void add_configured_observers(const Config& config, Pool& pool, ObserverFanout& fanout,
                              spdlog::logger& log);

// The statistics publisher add_configured_observers created, or null (publish:off, failure).
shm::StatsPublisher* configured_publisher() noexcept;

// The pool as a PyTorch memory snapshot: its memory map, block stacks when sites are sampled, and
// the ring of recent events as device_traces. Throws std::bad_alloc only.
trace::SnapshotData snapshot_of(const Pool& pool);

}  // namespace gpustitch::preload
