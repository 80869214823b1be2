// Creation of the pool's observers from the configuration. See observers.cpp.
#pragma once

#include <spdlog/logger.h>

#include "gpustitch/config.h"
#include "observer_fanout.h"

namespace gpustitch::preload {

// Adds to fanout every observer the configuration asks for. Called once, during the shim's lazy
// initialisation, before the pool is created.
void add_configured_observers(const Config& config, ObserverFanout& fanout, spdlog::logger& log);

}  // namespace gpustitch::preload
