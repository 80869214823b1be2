// A fragmenting workload modelled on the seeds' case: a transformer training step whose sequence
// length jumps between 256 and 8192, with tensors that outlive their step (logits kept for
// metrics, small bookkeeping tensors) so that later, longer steps meet a cache cut up by earlier,
// shorter ones. Used by `gpustitch demo` and the benchmarks.
#pragma once

#include <cstdint>
#include <string>

#include "gpustitch/pool.h"

namespace gpustitch::demo {

struct WorkloadOptions {
  int steps = 200;
  unsigned seed = 1;
  int layers = 24;
  std::size_t hidden = 4096;
  std::size_t vocab = 32000;
  int batch = 3;
  int min_seq = 256;
  int max_seq = 8192;
  std::size_t persistent_bytes = 0;  // weights + gradients + optimizer state; 0 = from capacity
  int retain_steps = 3;              // how long a step's logits stay alive
};

struct WorkloadResult {
  std::size_t peak_reserved = 0;
  std::size_t peak_allocated = 0;
  double fragmentation = 0;  // 1 - peak allocated / peak reserved
  std::uint64_t ooms = 0;
  std::size_t largest_failed = 0;  // largest request that failed
  std::uint64_t steps_completed = 0;
  std::uint64_t stitches = 0;
  std::uint64_t allocations = 0;
  double seconds = 0;
};

// Runs the workload against pool on device. capacity is the memory the run may use (for sizing
// the persistent state); the pool's backend enforces the real limit.
WorkloadResult run_transformer_workload(Pool& pool, int device, std::size_t capacity,
                                        const WorkloadOptions& options);

}  // namespace gpustitch::demo
