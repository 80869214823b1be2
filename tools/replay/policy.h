// Allocation policies a trace can be replayed through, behind one narrow interface.
//
// A policy serves allocate/deallocate calls and reports the physical memory it holds
// ("reserved"). The replayer (replayer.h) keeps the bytes live by the trace ("allocated") itself,
// so every policy is measured against the same demand. Policies register by name in a registry,
// so `gpustitch replay --policy a,b` can name any of them and parts that own other policies (the
// native cudaMalloc / cudaMallocAsync policies for backend:cuda) add themselves without touching
// the replayer:
//
//   static gpustitch::replay::PolicyRegistrar reg{"cudaMalloc", "native cudaMalloc/cudaFree",
//       /*default_on=*/false, [](const PolicyEnv& env) -> std::unique_ptr<ReplayPolicy> {...}};
//
// A factory may return null with *why set when the policy cannot run here (no GPU).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gpustitch/types.h"

namespace gpustitch::replay {

class ReplayPolicy {
 public:
  virtual ~ReplayPolicy() = default;
  virtual std::string name() const = 0;
  // Serves size bytes on device. Returns false for out-of-memory; *handle identifies the block
  // for deallocate.
  virtual bool allocate(int device, std::size_t size, Stream stream, std::uint64_t* handle) = 0;
  virtual void deallocate(int device, std::uint64_t handle, std::size_t size, Stream stream) = 0;
  // The trace's thread of the calls that follow (its Thread column). A policy whose state is per
  // thread (the gpustitch pool's arenas) makes them on a thread of its own for each; the others
  // ignore it.
  virtual void set_thread(std::uint64_t thread) { (void)thread; }
  // Physical memory the policy holds on device now.
  virtual std::uint64_t reserved(int device) const = 0;
  // Highest reserved seen by the policy itself (it may exceed what is sampled between calls);
  // 0 when the policy does not track it.
  virtual std::uint64_t peak_reserved(int device) const {
    (void)device;
    return 0;
  }
  // The largest block one request could be given out of the policy's cached memory (reserved,
  // not allocated) on device now, without reserving more: what is left of the cache when this is
  // taken out cannot serve a request as one block. kUnknownSize when the policy cannot tell.
  static constexpr std::uint64_t kUnknownSize = UINT64_MAX;
  virtual std::uint64_t largest_free_block(int device) const {
    (void)device;
    return kUnknownSize;
  }
  // How the policy served the trace, by name (gpustitch: cache hits, fresh handles, stitches,
  // trims), summed over devices; empty when the policy keeps no such counts.
  virtual std::vector<std::pair<std::string, std::uint64_t>> counters(int devices) const {
    (void)devices;
    return {};
  }
};

// The value of the counter named key in a policy's counters, or nothing when it keeps none.
inline std::optional<std::uint64_t> find_counter(
    const std::vector<std::pair<std::string, std::uint64_t>>& counters, std::string_view key) {
  for (const auto& [name, value] : counters)
    if (name == key) return value;
  return std::nullopt;
}

struct PolicyEnv {
  int devices = 1;
  std::size_t capacity = 80 * GiB;  // per device
  std::size_t granularity = 2 * MiB;
  std::size_t max_split_size = SIZE_MAX;  // PyTorch's max_split_size_mb (policies that have it)
  // Replay on the GPU: the gpustitch policies use the CUDA backend (with cap = capacity) and the
  // native policies (cuda-malloc, cuda-malloc-async) become available.
  bool gpu = false;
  // Simulated device only: whether the driver maps at an offset into a handle (the H200 with
  // driver 580 does not: then only whole handles can be stitched).
  bool map_offset = true;
  // GPUSTITCH_CONF-style settings for the gpustitch policies, on top of replay's own (empty: none).
  std::string pool_conf;
  // The gpustitch policies say what their memory held when reserved peaked (counters "peak_*":
  // live, free by size, waiting for a fence, small chunks, unmapped spares; pool_policy.cpp).
  bool explain_peak = false;
};

// How long a fence takes on the simulated device the gpustitch policies replay on, in ns
// (SimOptions::call_ns). The pool takes some decisions by how long its last fence took, over or
// under a few hundred ns; at the simulator's natural cost (tens of ns) host noise decided them
// and the same trace replayed to different figures. About what a fence costs on an idle H200.
inline constexpr std::uint32_t kSimFenceNs = 700;

using PolicyFactory =
    std::function<std::unique_ptr<ReplayPolicy>(const PolicyEnv& env, std::string* why)>;

struct PolicySpec {
  std::string name;
  std::string description;
  bool default_on;  // replayed when --policy is not given
  PolicyFactory make;
};

std::vector<PolicySpec>& policy_registry();

struct PolicyRegistrar {
  PolicyRegistrar(std::string name, std::string description, bool default_on, PolicyFactory make);
};

// Looks a policy up by name (case-sensitive). Null when unknown.
const PolicySpec* find_policy(const std::string& name);

}  // namespace gpustitch::replay
