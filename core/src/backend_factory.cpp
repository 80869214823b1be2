#include "gpustitch/backend_factory.h"

#include "gpustitch/sim_backend.h"

namespace gpustitch {

std::unique_ptr<Backend> make_sim_backend(const Config& config) {
  SimOptions o;
  o.devices = config.sim_devices;
  o.capacity = config.sim_capacity;
  o.granularity = config.sim_granularity;
  o.map_offset = config.sim_map_offset;
  o.shared_name = config.sim_shared;
  return std::make_unique<SimBackend>(o);
}

std::unique_ptr<Backend> make_backend(const Config& config, std::string* why,
                                      DriverResolver resolver, void* resolver_context) {
  if (config.backend == BackendKind::sim) return make_sim_backend(config);
#ifdef GPUSTITCH_NO_CUDA_BACKEND
  (void)resolver, (void)resolver_context;
  if (why != nullptr) *why = "this build has no CUDA backend";
  return nullptr;
#else
  // ipc:native: pool memory is never exported, so its handles need no shareable type.
  return make_cuda_backend(why, resolver, resolver_context, !config.ipc_native);
#endif
}

}  // namespace gpustitch
