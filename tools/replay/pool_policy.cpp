// The gpustitch pool as a replay policy: a real gpustitch::Pool over a SimBackend of the given
// capacity (or, with PolicyEnv::gpu, over the CUDA backend with cap = capacity), with stitching
// on ("gpustitch") or off ("gpustitch-no-stitch"). Reserved is the pool's bytes_reserved
// (physical memory held from the backend).
#include <gpustitch/backend_factory.h>
#include <gpustitch/config.h>
#include <gpustitch/pool.h>
#include <gpustitch/sim_backend.h>

#include <algorithm>

#include "driver_cost.h"
#include "policy.h"

namespace gpustitch::replay {

namespace {

class PoolPolicy final : public ReplayPolicy {
 public:
  PoolPolicy(std::string name, std::unique_ptr<Backend> backend, const Config& config)
      : name_(std::move(name)),
        stitching_(config.stitching),
        backend_(std::make_unique<CostedBackend>(std::move(backend))),
        pool_(*backend_, config) {}

  static std::unique_ptr<ReplayPolicy> make(std::string name, const PolicyEnv& env, bool stitching,
                                            std::string* why) {
    Config c = make_config(stitching);
    if (!env.pool_conf.empty()) {
      ConfigResult r = parse_config(env.pool_conf, c);
      if (!r.errors.empty()) {
        if (why) *why = r.errors.front();
        return nullptr;
      }
      c = r.config;
      c.stitching = stitching;  // the policy's name says which
    }
    std::unique_ptr<Backend> backend;
    if (env.gpu) {
      c.backend = BackendKind::cuda;
      c.cap = env.capacity;
      backend = make_backend(c, why);
      if (!backend) return nullptr;
    } else {
      backend = std::make_unique<SimBackend>(sim_options(env));
    }
    if (backend->device_count() < env.devices) {
      if (why) *why = "the trace uses more devices than the backend has";
      return nullptr;
    }
    return std::make_unique<PoolPolicy>(std::move(name), std::move(backend), c);
  }

  std::string name() const override { return name_; }

  bool allocate(int device, std::size_t size, Stream stream, std::uint64_t* handle) override {
    DevPtr p = 0;
    if (pool_.allocate(device, size, stream, &p) != Status::ok) return false;
    *handle = p;
    return true;
  }
  void deallocate(int, std::uint64_t handle, std::size_t, Stream stream) override {
    pool_.deallocate(static_cast<DevPtr>(handle), stream);
  }
  std::uint64_t reserved(int device) const override { return pool_.stats(device).bytes_reserved; }
  std::uint64_t peak_reserved(int device) const override {
    return pool_.stats(device).peak_reserved;
  }
  // With stitching, cached pieces combine into one block: the largest allocation that can
  // succeed, bounded by the cache (it may count fresh device memory too); without, the largest
  // cached block.
  std::uint64_t largest_free_block(int device) const override {
    const DeviceStats s = pool_.stats(device);
    const std::uint64_t usable = s.bytes_cached - std::min(s.bytes_cached, s.bytes_pending);
    if (stitching_) return std::min(s.largest_possible, usable);
    return std::min(s.largest_free_block, usable);
  }
  std::vector<std::pair<std::string, std::uint64_t>> counters(int devices) const override {
    std::uint64_t hits = 0, fresh = 0, stitches = 0, trims = 0;
    for (int d = 0; d < devices; ++d) {
      const DeviceStats s = pool_.stats(d);
      hits += s.cache_hits, fresh += s.fresh, stitches += s.stitches, trims += s.trims;
    }
    std::vector<std::pair<std::string, std::uint64_t>> out = {
        {"cache_hits", hits}, {"fresh", fresh}, {"stitches", stitches}, {"trims", trims}};
    for (auto& c : backend_->cost().counters()) out.push_back(std::move(c));
    return out;
  }

 private:
  // The simulated fence takes kSimFenceNs (policy.h: why), at least: the simulator busy-waits.
  static SimOptions sim_options(const PolicyEnv& env) {
    SimOptions o{env.devices, env.capacity, env.granularity, env.map_offset};
    o.call_ns[static_cast<std::size_t>(SimOp::synchronize)] = kSimFenceNs;
    return o;
  }
  static Config make_config(bool stitching) {
    Config c;
    c.stitching = stitching;
    c.backend = BackendKind::sim;
    c.background_reclaim = false;  // deterministic: the same trace gives the same figures
    return c;
  }
  std::string name_;
  bool stitching_;
  std::unique_ptr<CostedBackend> backend_;  // every driver call, counted and costed
  Pool pool_;
};

PolicyRegistrar reg_on{"gpustitch", "gpustitch pool, stitching on (simulated device)", true,
                       [](const PolicyEnv& env, std::string* why) {
                         return PoolPolicy::make("gpustitch", env, true, why);
                       }};
PolicyRegistrar reg_off{"gpustitch-no-stitch", "gpustitch pool, stitching off (simulated device)",
                        true, [](const PolicyEnv& env, std::string* why) {
                          return PoolPolicy::make("gpustitch-no-stitch", env, false, why);
                        }};

}  // namespace

}  // namespace gpustitch::replay
