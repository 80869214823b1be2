// Replaying a trace through a policy and measuring it.
//
// Events are replayed in file order. "Allocated" is the bytes the trace holds live (as requested,
// the same demand for every policy); "reserved" is what the policy holds after each event.
// Fragmentation comes as two figures, both taken when reserved peaks:
//   - idle cache = 1 - allocated/reserved, the figure PyTorch users quote (frag_at_peak);
//   - unusable free memory = (reserved - allocated - the largest cached block one request could
//     get) / reserved: memory that is free but cannot be handed out as one block
//     (unusable_at_peak; -1 when the policy cannot tell its largest block). An allocation that
// fails is counted as an OOM and its later free is skipped; a free of a pointer the trace never
// allocated (recording started late) is counted and ignored. A pointer allocated again before its
// free was recorded (two threads racing) is matched first-in, first-out.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gpustitch/trace/trace_reader.h"
#include "policy.h"

namespace gpustitch::replay {

struct ReplayPoint {
  std::uint64_t op = 0;         // index of the last event in this bucket
  double time_s = 0;            // its time, seconds since the trace's first event
  std::uint64_t allocated = 0;  // highest in the bucket
  std::uint64_t reserved = 0;   // highest in the bucket
};

struct ReplayOom {
  std::uint64_t op = 0;
  double time_s = 0;  // seconds since the trace's first event
  std::uint64_t size = 0;
};

struct ReplayResult {
  std::string policy;
  std::uint64_t ops = 0, allocs = 0, frees = 0;
  std::uint64_t ooms = 0;
  std::uint64_t oom_bytes = 0;     // bytes the failed allocations asked for
  std::int64_t first_oom_op = -1;  // event index of the first OOM
  // At the first OOM: the request, the bytes live and the policy's reserved bytes. An OOM with
  // allocated + request <= capacity failed for fragmentation, not for lack of memory.
  std::uint64_t first_oom_size = 0;
  std::uint64_t allocated_at_first_oom = 0;
  std::uint64_t reserved_at_first_oom = 0;
  std::uint64_t skipped_frees = 0;    // frees of allocations that had failed
  std::uint64_t unmatched_frees = 0;  // frees of pointers never allocated in the trace
  std::uint64_t peak_allocated = 0;
  std::uint64_t peak_reserved = 0;
  double frag_at_peak = 0;       // idle cache when reserved peaked
  double unusable_at_peak = -1;  // unusable free memory when reserved peaked (-1: unknown)
  double frag_mean = 0;          // mean over events with reserved > 0
  double frag_max = 0;           // highest over events where allocated >= 10% of peak allocated
  double ns_per_op = 0, ns_per_alloc = 0, ns_per_free = 0;
  std::vector<ReplayPoint> series;    // at most max_points buckets
  std::vector<ReplayOom> oom_events;  // the first kMaxOomEvents OOMs, for plots
  std::vector<std::pair<std::string, std::uint64_t>> counters;  // ReplayPolicy::counters
  // The driver counters ("driver_*") over the second half of the trace's events alone, named
  // with "_second_half": a training trace's later steps, where most of the pool's growth is
  // behind it (not all: a trace's longest step may come late). Empty when the replay stopped
  // before the midpoint or the policy keeps no driver counters.
  std::vector<std::pair<std::string, std::uint64_t>> second_half;
};

inline constexpr std::size_t kMaxOomEvents = 64;

struct ReplayOptions {
  std::size_t max_points = 2000;
  // Stop at the first OOM (a bisection only needs to know whether one happens); the figures then
  // cover the events up to it.
  bool stop_at_first_oom = false;
};

// The "driver_*" counters of at_end less their value at the midpoint, named "<name>_second_half".
std::vector<std::pair<std::string, std::uint64_t>> second_half_driver_counters(
    const std::vector<std::pair<std::string, std::uint64_t>>& at_end,
    const std::vector<std::pair<std::string, std::uint64_t>>& at_midpoint);

ReplayResult replay_trace(const trace::Trace& trace, ReplayPolicy& policy,
                          const ReplayOptions& options = {});

// The smallest device capacity (to `resolution`) on which the trace replays through the policy
// without an out-of-memory: a bisection between the peak allocated bytes and `upper`. Returns 0
// when even `upper` is not enough, or the policy cannot be made.
std::uint64_t min_capacity(const trace::Trace& trace, const PolicySpec& spec, PolicyEnv env,
                           std::uint64_t upper, std::uint64_t resolution = 64 * MiB);

}  // namespace gpustitch::replay
