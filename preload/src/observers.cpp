// THE place where the shim's pool observers are created from Config.
//
// Every layer that watches the pool (shared-memory statistics for gpustitchd, the allocation
// trace, allocation-site sampling) is a gpustitch::PoolObserver; the shim hands the pool one
// ObserverFanout and adds each enabled observer to it here. To plug in a new one: construct it
// from the config below and fanout.add() it. Constructors must not call into CUDA or the pool,
// and must not throw out of here (failures are logged once and the observer left out).
#include "observers.h"

namespace gpustitch::preload {

void add_configured_observers(const Config& config, ObserverFanout& fanout, spdlog::logger& log) {
  // --- statistics publisher (gpustitch_shm's StatsPublisher) --------------------------------------
  // Wiring point: when config.publish is on, add the shared-memory publisher, e.g.
  //   fanout.add(std::make_unique<gpustitch::shm::StatsPublisher>(config, ...));
  // (not linked yet: the gpustitch_shm library lands separately).
  (void)config.publish;

  // --- allocation trace ---------------------------------------------------------------------------
  // Wiring point: when config.trace_path is non-empty, add the trace writer.
  if (!config.trace_path.empty()) {
    log.warn("trace:{} requested, but this build has no trace writer; not tracing",
             config.trace_path);
  }
  (void)fanout;
}

}  // namespace gpustitch::preload
