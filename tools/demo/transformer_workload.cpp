#include "transformer_workload.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <random>
#include <vector>

namespace gpustitch::demo {
namespace {

// Tracks the allocations of one step so that a failed step can be abandoned cleanly, as a
// training loop that catches out-of-memory and skips the batch would.
class Step {
 public:
  Step(Pool& pool, int device, WorkloadResult& result) : pool_(pool), device_(device), r_(result) {}
  ~Step() {
    for (DevPtr p : live_) pool_.deallocate(p);
  }
  bool failed() const { return failed_; }
  DevPtr alloc(std::size_t size) {
    if (failed_) return 0;
    DevPtr p = 0;
    ++r_.allocations;
    if (pool_.allocate(device_, size, kAnyStream, &p) != Status::ok) {
      failed_ = true;
      ++r_.ooms;
      r_.largest_failed = std::max(r_.largest_failed, size);
      return 0;
    }
    live_.push_back(p);
    return p;
  }
  void free(DevPtr p) {
    if (p == 0) return;
    auto it = std::find(live_.begin(), live_.end(), p);
    if (it != live_.end()) live_.erase(it);
    pool_.deallocate(p);
  }
  // Hands p over to the caller (it outlives the step).
  DevPtr release(DevPtr p) {
    auto it = std::find(live_.begin(), live_.end(), p);
    if (it != live_.end()) live_.erase(it);
    return p;
  }

 private:
  Pool& pool_;
  int device_;
  WorkloadResult& r_;
  std::vector<DevPtr> live_;
  bool failed_ = false;
};

}  // namespace

WorkloadResult run_transformer_workload(Pool& pool, int device, std::size_t capacity,
                                        const WorkloadOptions& o) {
  WorkloadResult r;
  const auto start = std::chrono::steady_clock::now();
  std::mt19937_64 rng(o.seed);
  auto sample = [&] {
    pool.drain_pending(device);  // a step boundary: the device has caught up
    DeviceStats s = pool.stats(device);
    r.peak_reserved = std::max<std::size_t>(r.peak_reserved, s.peak_reserved);
    r.peak_allocated = std::max<std::size_t>(r.peak_allocated, s.peak_allocated);
  };

  // Persistent state: weights, gradients and two optimizer moments per layer, in several sizes.
  const std::size_t persistent = o.persistent_bytes != 0 ? o.persistent_bytes : capacity / 100 * 35;
  std::vector<DevPtr> persistent_ptrs;
  {
    const std::size_t per_layer = persistent / static_cast<std::size_t>(o.layers);
    const std::size_t parts[] = {per_layer / 8, per_layer / 8, per_layer / 4, per_layer / 2};
    for (int l = 0; l < o.layers; ++l) {
      for (std::size_t part : parts) {
        DevPtr p = 0;
        if (pool.allocate(device, part, kAnyStream, &p) == Status::ok) persistent_ptrs.push_back(p);
      }
    }
  }

  std::deque<std::vector<DevPtr>> retained;  // tensors kept alive across steps, by step
  const int lo = std::max(1, o.min_seq / 256), hi = std::max(lo, o.max_seq / 256);
  for (int step = 0; step < o.steps; ++step) {
    // The sequence length jumps: mostly short batches, sometimes a long one.
    int seq = 256 * (rng() % 4 == 0 ? hi : lo + static_cast<int>(rng() % (hi - lo + 1)));
    const std::size_t tokens = static_cast<std::size_t>(o.batch) * static_cast<std::size_t>(seq);
    const std::size_t unit = tokens * o.hidden * 2;  // one bf16 activation
    std::vector<DevPtr> keep;
    {
      Step s(pool, device, r);
      std::vector<std::vector<DevPtr>> saved(o.layers);
      // Forward: each layer saves qkv (3 units), attention output (1), MLP up (4); a workspace
      // comes and goes; a few small tensors (norm statistics, masks).
      for (int l = 0; l < o.layers && !s.failed(); ++l) {
        DevPtr ws = s.alloc(2 * unit);
        for (std::size_t mult : {3, 1, 4}) saved[l].push_back(s.alloc(mult * unit));
        saved[l].push_back(s.alloc(tokens * 4));  // norm statistics: small
        s.free(ws);
      }
      DevPtr logits = s.alloc(tokens * o.vocab * 2);
      // Backward: gradients of activations come and go, saved tensors are freed layer by layer.
      for (int l = o.layers - 1; l >= 0 && !s.failed(); --l) {
        DevPtr g1 = s.alloc(4 * unit);
        DevPtr g2 = s.alloc(unit);
        for (DevPtr p : saved[l]) s.free(p);
        s.free(g1);
        s.free(g2);
      }
      if (!s.failed()) {
        // The loss and its logits stay alive for logging for a few steps; so do small metrics.
        keep.push_back(s.release(logits));
        keep.push_back(s.release(s.alloc(4096)));
        ++r.steps_completed;
      }
    }
    retained.push_back(std::move(keep));
    while (static_cast<int>(retained.size()) > o.retain_steps) {
      for (DevPtr p : retained.front()) pool.deallocate(p);
      retained.pop_front();
    }
    sample();
  }
  for (auto& k : retained) {
    for (DevPtr p : k) pool.deallocate(p);
  }
  for (DevPtr p : persistent_ptrs) pool.deallocate(p);
  sample();
  r.fragmentation = r.peak_reserved == 0 ? 0.0
                                         : 1.0 - static_cast<double>(r.peak_allocated) /
                                                     static_cast<double>(r.peak_reserved);
  r.stitches = pool.stats(device).stitches;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

}  // namespace gpustitch::demo
