// `gpustitch tune`: the allocator settings scan that users do by rerunning their job once per
// value (PyTorch's max_split_size_mb swept from 1/4 to 1x of the peak and over 32..4096 MiB, then
// combined with other settings), done by replaying one recorded trace through the allocator
// models instead, and the one PYTORCH_CUDA_ALLOC_CONF line that comes out of it.
//
// Each setting of the sweep (TuneSetting) is replayed twice over:
//   - at the user's capacity: peak reserved, the OOMs, the two fragmentation figures at the peak
//     (replayer.h: idle cache and unusable free memory) and the model's time per operation,
//     relative to PyTorch's default;
//   - by bisection, the smallest device without OOM: between the peak live bytes (nothing runs
//     below them) and a capacity that fits, to `resolution`. It assumes that a trace that fits on
//     a device fits on every larger one, which holds for the models' rules (more capacity only
//     removes releases and retries) and is not checked at every size.
// The sweep runs its settings on `jobs` threads; each replay owns its policy, the trace is shared
// read-only.
//
// The answer (TuneAnswer) ranks the PyTorch settings by: no OOM at the capacity, then the smallest
// device, then peak reserved, then the sweep's order (not the cost: host timing, too noisy); the
// default wins unless another setting beats it by more than the bisection's resolution or avoids
// its OOMs. gpustitch's best row is given next to it. When no setting, gpustitch's included, fits
// the capacity, the answer says so: the job is short of memory, by how much, and whether its live
// tensors alone exceed the device.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "gpustitch/trace/trace_reader.h"
#include "policy.h"
#include "replayer.h"

namespace gpustitch::replay {

enum class TuneFamily { pytorch, gpustitch };

struct TuneSetting {
  std::string label;  // what the user sets: "max_split_size_mb:128", "gpustitch fresh_handles:16"
  TuneFamily family = TuneFamily::pytorch;
  // PYTORCH_CUDA_ALLOC_CONF value (pytorch family; empty: the default) or GPUSTITCH_CONF
  // settings (gpustitch family; empty: gpustitch's defaults).
  std::string conf;
  PolicyFactory make;
};

struct TuneRow {
  TuneSetting setting;
  ReplayResult at_capacity;
  std::uint64_t min_capacity = 0;  // 0: none up to the largest capacity tried
  std::uint64_t largest_tried = 0;
  double relative_cost = 1;  // ns per operation / the default's
};

struct TuneOptions {
  std::uint64_t capacity = 80 * GiB;
  std::uint64_t resolution = 0;  // 0: about 0.5% of the peak live bytes, at least 2 MiB
  unsigned jobs = 1;
  std::size_t max_points = 2000;
  // Called after each setting (from the sweep's threads, serialised): settings done, of total.
  std::function<void(std::size_t done, std::size_t total, const std::string& label)> progress;
};

enum class TuneVerdict {
  default_is_best,      // no setting saves more than the resolution
  setting_saves,        // the recommendation needs less memory than the default
  setting_avoids_oom,   // the default OOMs at the capacity, the recommendation does not
  only_gpustitch_fits,  // no PyTorch setting fits the capacity, gpustitch does
  short_of_memory,      // nothing fits the capacity
};

struct TuneAnswer {
  TuneVerdict verdict = TuneVerdict::default_is_best;
  std::size_t recommended = 0;  // index into rows (pytorch family)
  std::size_t default_row = 0;
  std::size_t best_gpustitch = SIZE_MAX;  // SIZE_MAX: no gpustitch row
  std::string alloc_conf;                 // PYTORCH_CUDA_ALLOC_CONF=... line, "" for the default
  std::string summary;                    // one or two plain sentences
};

struct TuneReport {
  std::uint64_t capacity = 0;
  std::uint64_t resolution = 0;
  std::uint64_t peak_allocated = 0;
  std::vector<TuneRow> rows;
  TuneAnswer answer;
};

// The default sweep for a trace whose PyTorch-default replay peaked at peak_reserved: default,
// max_split_size_mb over both scans, garbage_collection_threshold, roundup_power2_divisions,
// expandable_segments, and gpustitch with its own settings. The combinations are added by
// run_tune once the single settings are known.
std::vector<TuneSetting> default_sweep(std::uint64_t peak_reserved);

// The max_split_size_mb values of the seeds' two scans, in MiB, ascending and without repeats:
// 1/4 to 1x of the peak in steps of sqrt(2), and 32..4096 in powers of two. PyTorch rejects
// values of 20 MiB and less, so those are left out.
std::vector<std::uint64_t> max_split_scan_mb(std::uint64_t peak_reserved);

TuneReport run_tune(const trace::Trace& trace, const TuneOptions& options);

// Decides the answer from rows whose figures are in; exposed for tests.
TuneAnswer decide(const std::vector<TuneRow>& rows, std::uint64_t capacity,
                  std::uint64_t resolution, std::uint64_t peak_allocated);

}  // namespace gpustitch::replay
