// The gpustitch pool as a replay policy: a real gpustitch::Pool over a SimBackend of the given
// capacity, with stitching on ("gpustitch") or off ("gpustitch-no-stitch"). Reserved is the
// pool's bytes_reserved (physical memory held from the backend).
#include <gpustitch/pool.h>
#include <gpustitch/sim_backend.h>

#include "policy.h"

namespace gpustitch::replay {

namespace {

class PoolPolicy final : public ReplayPolicy {
 public:
  PoolPolicy(std::string name, const PolicyEnv& env, bool stitching)
      : name_(std::move(name)),
        backend_(SimOptions{env.devices, env.capacity, env.granularity, true}),
        pool_(backend_, make_config(stitching)) {}

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

 private:
  static Config make_config(bool stitching) {
    Config c;
    c.stitching = stitching;
    c.backend = BackendKind::sim;
    c.background_reclaim = false;  // deterministic: the same trace gives the same figures
    return c;
  }
  std::string name_;
  SimBackend backend_;
  Pool pool_;
};

PolicyRegistrar reg_on{"gpustitch", "gpustitch pool, stitching on (simulated device)", true,
                       [](const PolicyEnv& env, std::string*) -> std::unique_ptr<ReplayPolicy> {
                         return std::make_unique<PoolPolicy>("gpustitch", env, true);
                       }};
PolicyRegistrar reg_off{"gpustitch-no-stitch", "gpustitch pool, stitching off (simulated device)",
                        true,
                        [](const PolicyEnv& env, std::string*) -> std::unique_ptr<ReplayPolicy> {
                          return std::make_unique<PoolPolicy>("gpustitch-no-stitch", env, false);
                        }};

}  // namespace

}  // namespace gpustitch::replay
