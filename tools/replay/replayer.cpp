// replay_trace: drives a policy with a trace's events and measures it. See replayer.h.
#include "replayer.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <unordered_map>

namespace gpustitch::replay {

namespace {

struct LiveAlloc {
  std::uint64_t handle;
  std::uint64_t size;
  bool failed;
};

struct KeyHash {
  std::size_t operator()(const std::pair<int, std::uint64_t>& k) const noexcept {
    return std::hash<std::uint64_t>{}(k.second * 31 + static_cast<std::uint64_t>(k.first));
  }
};

}  // namespace

std::vector<std::pair<std::string, std::uint64_t>> second_half_driver_counters(
    const std::vector<std::pair<std::string, std::uint64_t>>& at_end,
    const std::vector<std::pair<std::string, std::uint64_t>>& at_midpoint) {
  std::vector<std::pair<std::string, std::uint64_t>> out;
  for (const auto& [name, end] : at_end) {
    if (!name.starts_with("driver_")) continue;
    const std::uint64_t mid = find_counter(at_midpoint, name).value_or(0);
    out.emplace_back(name + "_second_half", end - std::min(end, mid));
  }
  return out;
}

ReplayResult replay_trace(const trace::Trace& trace, ReplayPolicy& policy,
                          const ReplayOptions& options) {
  using clock = std::chrono::steady_clock;
  ReplayResult r;
  r.policy = policy.name();
  const int devices = trace.device_count();
  const std::size_t n = trace.events.size();
  const std::size_t bucket = std::max<std::size_t>(
      1, (n + options.max_points - 1) / std::max<std::size_t>(1, options.max_points));

  std::unordered_map<std::pair<int, std::uint64_t>, std::deque<LiveAlloc>, KeyHash> live;
  live.reserve(4096);
  std::uint64_t allocated = 0;
  std::vector<std::uint64_t> allocated_on(static_cast<std::size_t>(devices), 0);
  const double t0_trace = n ? trace.events.front().time_s : 0;
  double frag_sum = 0;
  std::uint64_t frag_samples = 0;
  std::uint64_t alloc_ns = 0, free_ns = 0;
  ReplayPoint point;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> samples;  // (allocated, reserved) per op
  samples.reserve(n);
  std::vector<std::pair<std::string, std::uint64_t>> at_midpoint;
  bool passed_midpoint = false, stopped = false;

  for (std::size_t i = 0; i < n; ++i) {
    const trace::TraceEvent& ev = trace.events[i];
    const auto stream = static_cast<Stream>(ev.stream);
    auto key = std::make_pair(ev.device, ev.ptr);
    policy.set_thread(ev.thread);
    if (ev.action == trace::TraceAction::allocate) {
      ++r.allocs;
      std::uint64_t handle = 0;
      auto t0 = clock::now();
      bool ok = policy.allocate(ev.device, ev.size, stream, &handle);
      alloc_ns += static_cast<std::uint64_t>((clock::now() - t0).count());
      if (ok) {
        allocated += ev.size;
        allocated_on[static_cast<std::size_t>(ev.device)] += ev.size;
      } else {
        ++r.ooms;
        r.oom_bytes += ev.size;
        if (r.oom_events.size() < kMaxOomEvents)
          r.oom_events.push_back({i, ev.time_s - t0_trace, ev.size});
        if (r.first_oom_op < 0) {
          r.first_oom_op = static_cast<std::int64_t>(i);
          r.first_oom_size = ev.size;
          r.allocated_at_first_oom = allocated;
          for (int d = 0; d < devices; ++d) r.reserved_at_first_oom += policy.reserved(d);
        }
      }
      live[key].push_back({handle, ev.size, !ok});
    } else {
      ++r.frees;
      auto it = live.find(key);
      if (it == live.end() || it->second.empty()) {
        ++r.unmatched_frees;
      } else {
        LiveAlloc a = it->second.front();
        it->second.pop_front();
        if (it->second.empty()) live.erase(it);
        if (a.failed) {
          ++r.skipped_frees;
        } else {
          auto t0 = clock::now();
          policy.deallocate(ev.device, a.handle, a.size, stream);
          free_ns += static_cast<std::uint64_t>((clock::now() - t0).count());
          allocated -= a.size;
          allocated_on[static_cast<std::size_t>(ev.device)] -= a.size;
        }
      }
    }
    std::uint64_t reserved = 0;
    for (int d = 0; d < devices; ++d) reserved += policy.reserved(d);
    samples.emplace_back(allocated, reserved);
    r.peak_allocated = std::max(r.peak_allocated, allocated);
    if (reserved > r.peak_reserved) {
      r.peak_reserved = reserved;
      r.frag_at_peak =
          1.0 - static_cast<double>(std::min(allocated, reserved)) / static_cast<double>(reserved);
      std::uint64_t unusable = 0;
      bool known = true;
      for (int d = 0; d < devices && known; ++d) {
        const std::uint64_t largest = policy.largest_free_block(d);
        if (largest == ReplayPolicy::kUnknownSize) known = false;
        const std::uint64_t res = policy.reserved(d);
        const std::uint64_t idle = res - std::min(res, allocated_on[static_cast<std::size_t>(d)]);
        unusable += idle - std::min(idle, largest);
      }
      r.unusable_at_peak =
          known ? static_cast<double>(unusable) / static_cast<double>(reserved) : -1.0;
    }
    if (reserved > 0) {
      frag_sum +=
          1.0 - static_cast<double>(std::min(allocated, reserved)) / static_cast<double>(reserved);
      ++frag_samples;
    }
    if (i + 1 == n / 2) {
      at_midpoint = policy.counters(devices);
      passed_midpoint = true;
    }
    point.allocated = std::max(point.allocated, allocated);
    point.reserved = std::max(point.reserved, reserved);
    if ((i + 1) % bucket == 0 || i + 1 == n) {
      point.op = i;
      point.time_s = ev.time_s - t0_trace;
      r.series.push_back(point);
      point = ReplayPoint{};
    }
    if (options.stop_at_first_oom && r.ooms > 0) {
      point.op = i;
      point.time_s = ev.time_s - t0_trace;
      r.series.push_back(point);
      stopped = true;
      break;
    }
  }
  for (const auto& [a, res] : samples) {
    if (res > 0 && a * 10 >= r.peak_allocated)
      r.frag_max = std::max(r.frag_max,
                            1.0 - static_cast<double>(std::min(a, res)) / static_cast<double>(res));
  }
  std::uint64_t policy_peak = 0;
  for (int d = 0; d < devices; ++d) policy_peak += policy.peak_reserved(d);
  if (devices == 1) r.peak_reserved = std::max(r.peak_reserved, policy_peak);
  r.counters = policy.counters(devices);
  if (passed_midpoint && !stopped)
    r.second_half = second_half_driver_counters(r.counters, at_midpoint);
  r.ops = n;
  r.frag_mean = frag_samples ? frag_sum / static_cast<double>(frag_samples) : 0;
  std::uint64_t served_allocs = r.allocs;
  std::uint64_t served_frees = r.frees - r.skipped_frees - r.unmatched_frees;
  r.ns_per_alloc =
      served_allocs ? static_cast<double>(alloc_ns) / static_cast<double>(served_allocs) : 0;
  r.ns_per_free =
      served_frees ? static_cast<double>(free_ns) / static_cast<double>(served_frees) : 0;
  r.ns_per_op = (served_allocs + served_frees)
                    ? static_cast<double>(alloc_ns + free_ns) /
                          static_cast<double>(served_allocs + served_frees)
                    : 0;
  return r;
}

std::uint64_t min_capacity(const trace::Trace& trace, const PolicySpec& spec, PolicyEnv env,
                           std::uint64_t upper, std::uint64_t resolution) {
  auto fits = [&](std::uint64_t capacity) {
    env.capacity = capacity;
    std::string why;
    auto policy = spec.make(env, &why);
    if (!policy) return false;
    return replay_trace(trace, *policy, ReplayOptions{16, /*stop_at_first_oom=*/true}).ooms == 0;
  };
  if (!fits(upper)) return 0;
  std::uint64_t lo = 0, hi = upper;  // lo fails (or is untested 0), hi fits
  {
    env.capacity = upper;
    std::string why;
    if (auto policy = spec.make(env, &why)) {
      std::uint64_t peak = replay_trace(trace, *policy, ReplayOptions{16}).peak_allocated;
      lo = peak > resolution ? align_up(peak, resolution) - resolution : 0;
    }
  }
  while (hi - lo > resolution) {
    std::uint64_t mid = lo + (hi - lo) / 2 / resolution * resolution;
    if (mid <= lo) mid = lo + resolution;
    if (fits(mid)) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
  return hi;
}

}  // namespace gpustitch::replay
