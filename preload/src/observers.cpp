// THE place where the shim's pool observers are created from Config.
//
// Every layer that watches the pool (shared-memory statistics for gpustitchd, the allocation
// trace, allocation-site sampling) is a gpustitch::PoolObserver. The pool is created with one
// ObserverFanout as its observer; each enabled observer is constructed here, from the config and
// the pool, and fanout.add()ed. Constructors must not call into CUDA through the hooks or allocate
// from the pool, must not throw out of here (a failure is logged once and the observer left out),
// and must be cheap on the allocation path (callbacks run on the allocating thread).
#include "observers.h"

namespace gpustitch::preload {

void add_configured_observers(const Config& config, Pool& pool, ObserverFanout& fanout,
                              spdlog::logger& log) {
  (void)pool;
  (void)fanout;
  // --- statistics publisher (gpustitch_shm)
  // ------------------------------------------------------- Wiring point: link gpustitch_shm into
  // gpustitch_preload and add, when config.publish:
  //   auto publisher = std::make_unique<gpustitch::shm::StatsPublisher>(pool, config);
  //   if (!publisher->active()) log.debug("statistics not published: {}", publisher->error());
  //   fanout.add(std::move(publisher));
  if (config.publish) log.debug("statistics publishing is not built into this library");

  // --- allocation trace
  // --------------------------------------------------------------------------- Wiring point: when
  // config.trace_path is non-empty, add the trace writer (TraceWriter).
  if (!config.trace_path.empty()) {
    log.warn("trace:{} requested, but this build has no trace writer; not tracing",
             config.trace_path);
  }
}

}  // namespace gpustitch::preload
