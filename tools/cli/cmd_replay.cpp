// gpustitch replay TRACE: replays an allocation trace (RMM CSV, ours or RMM's) through gpustitch
// and baseline policies on a simulated device of a given capacity, and reports for each policy
// peak reserved/allocated, fragmentation (1 - allocated/reserved) at peak and on average, the
// out-of-memory count and the time per operation. --plot writes allocated vs reserved over time.
// --generate FILE writes the synthetic transformer trace (tools/replay/generator.h) first.
// TRACE may also be a PyTorch memory snapshot (tools/replay/snapshot_trace.h).
// Input is checked before any work: a capacity that is not positive, an unknown policy, a plot
// extension that cannot be written and a trace with no allocation events in it are usage errors
// (exit 2, one line); with --gpu, a policy that cannot run here (no GPU) fails the command.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "command.h"
#include "generator.h"
#include "gpustitch/config.h"
#include "gpustitch/trace/trace_reader.h"
#include "number_checks.h"
#include "plot.h"
#include "policy.h"
#include "replayer.h"
#include "terminal_text.h"
#include "trace_input.h"

namespace gpustitch::cli {
namespace {

struct ReplayArgs {
  std::string trace;
  double capacity_gb = 80;
  std::vector<std::string> policies;
  double max_split_mb = 0;
  std::string plot;
  std::string generate;
  int steps = 120;
  bool list = false;
  bool min_capacity = false;
  bool gpu = false;
  bool whole_handles = false;
  bool explain_peak = false;
  std::string conf;
  int plot_width = 1000, plot_height = 540;
};

std::vector<std::string> split_names(const std::vector<std::string>& in) {
  std::vector<std::string> out;
  for (const auto& s : in) {
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ','))
      if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::string gib(std::uint64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(b) / (1024.0 * 1024 * 1024));
  return buf;
}

int run_replay(const ReplayArgs& a, const GlobalOptions& g) {
  using namespace gpustitch::replay;
  if (a.list) {
    for (const auto& p : policy_registry())
      std::cout << p.name << (p.default_on ? " (default)" : "") << ": " << p.description << "\n";
    return kOk;
  }
  if (!(a.capacity_gb > 0)) {
    std::cerr << "gpustitch replay: --capacity-gb must be a positive number of GiB\n";
    return kUsage;
  }
  if (a.steps <= 0) {
    std::cerr << "gpustitch replay: --steps must be positive\n";
    return kUsage;
  }
  if (a.max_split_mb < 0) {
    std::cerr << "gpustitch replay: --max-split-mb must not be negative\n";
    return kUsage;
  }
  if (!a.plot.empty()) {
    std::string why;
    if (!plot_path_supported(a.plot, &why)) {
      std::cerr << "gpustitch replay: --plot: " << why << "\n";
      return kUsage;
    }
    if (a.plot_width < 400 || a.plot_height < 200) {
      std::cerr << "gpustitch replay: --plot-width must be at least 400 and --plot-height 200\n";
      return kUsage;
    }
  }
  for (const auto& name : split_names(a.policies)) {
    if (find_policy(name) == nullptr) {
      std::cerr << "gpustitch replay: unknown policy '" << name << "' (see --list-policies)\n";
      return kUsage;
    }
  }
  std::string path = a.trace;
  trace::Trace tr;
  bool has_time = false;
  if (!a.generate.empty()) {
    TransformerTraceParams params;
    params.steps = a.steps;
    tr = generate_transformer_trace(params);
    std::ofstream out(a.generate);
    write_trace_csv(tr, out);
    if (!out) {
      std::cerr << "gpustitch replay: cannot write " << a.generate << "\n";
      return kProblem;
    }
    if (path.empty()) path = a.generate;
  }
  if (path.empty()) {
    std::cerr << "gpustitch replay: give a TRACE file (or --generate FILE)\n";
    return kUsage;
  }
  if (!a.generate.empty() && path == a.generate) has_time = true;
  if (a.generate.empty() || path != a.generate) {
    std::string why;
    TraceInput in;
    switch (read_trace_input(path, &in, &why)) {
      case TraceInputStatus::ok:
        break;
      case TraceInputStatus::cannot_open:
        std::cerr << "gpustitch replay: " << terminal_text(why) << "\n";
        return kNotFound;
      case TraceInputStatus::malformed:
        std::cerr << "gpustitch replay: " << terminal_text(why) << "\n";
        return kUsage;
    }
    tr = std::move(in.trace);
    has_time = in.has_time;
    if (in.snapshot && in.snapshot->truncated())
      std::cerr << path << ": the snapshot's ring buffer was truncated: "
                << in.snapshot->lost_allocs + in.snapshot->unrecorded_live
                << " blocks live before the record began are replayed as allocated at its start\n";
  }
  for (const auto& e : tr.errors)
    std::cerr << terminal_text(path) << ":" << e.line << ": skipped: " << terminal_text(e.reason)
              << "\n";
  if (tr.bad_lines > tr.errors.size())
    std::cerr << path << ": " << tr.bad_lines - tr.errors.size() << " more bad lines skipped\n";
  if (tr.events.empty()) {
    std::cerr << "gpustitch replay: " << path << " holds no allocation events\n";
    return kNotFound;
  }

  if (!a.conf.empty()) {
    const ConfigResult conf = parse_config(a.conf);
    if (!conf.errors.empty()) {
      for (std::string e : conf.errors) {
        if (e.rfind("GPUSTITCH_CONF: ", 0) == 0) e.erase(0, 16);
        std::cerr << "gpustitch replay: --conf: " << e << "\n";
      }
      return kUsage;
    }
  }
  PolicyEnv env;
  env.devices = tr.device_count();
  env.capacity = static_cast<std::size_t>(a.capacity_gb * 1024.0 * 1024.0 * 1024.0);
  env.gpu = a.gpu;
  env.map_offset = !a.whole_handles;
  env.pool_conf = a.conf;
  env.explain_peak = a.explain_peak;
  if (a.max_split_mb > 0)
    env.max_split_size = static_cast<std::size_t>(a.max_split_mb * 1024 * 1024);
  std::vector<std::string> names = split_names(a.policies);
  if (names.empty()) {
    for (const auto& p : policy_registry())
      if (p.default_on) names.push_back(p.name);
    if (a.max_split_mb > 0) names.push_back("pytorch-max-split");
    if (a.gpu) {
      names.push_back("cuda-malloc");
      names.push_back("cuda-malloc-async");
    }
  }
  std::vector<ReplayResult> results;
  std::vector<std::uint64_t> min_caps;
  // A progress line on stderr once the work has run a second (bisections can take minutes).
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto progress = [&](std::size_t done, const std::string& what) {
    if (clock::now() - start < std::chrono::seconds(1)) return;
    std::fprintf(stderr, "gpustitch replay: %zu/%zu policies done, %s, %.0f s\n", done,
                 names.size(), what.c_str(),
                 std::chrono::duration<double>(clock::now() - start).count());
  };
  int unavailable = 0;
  for (const auto& name : names) {
    const PolicySpec* spec = find_policy(name);
    if (spec == nullptr) {
      std::cerr << "gpustitch replay: unknown policy '" << name << "' (see --list-policies)\n";
      return kUsage;
    }
    std::string why;
    auto policy = spec->make(env, &why);
    if (!policy) {
      std::cerr << "gpustitch replay: policy " << name << " unavailable: " << why << "\n";
      ++unavailable;
      continue;
    }
    results.push_back(replay_trace(tr, *policy));
    progress(results.size(), name + " replayed");
    if (a.min_capacity) {
      std::uint64_t upper = std::max<std::uint64_t>(env.capacity, 2 * results.back().peak_reserved);
      progress(results.size() - 1, name + ": bisecting its smallest device");
      min_caps.push_back(replay::min_capacity(tr, *spec, env, upper));
    }
  }
  if (a.gpu && unavailable > 0) {
    std::cerr << "gpustitch replay: --gpu: " << unavailable
              << " policies could not run on the GPU (see above)\n";
    return kProblem;
  }
  if (results.empty()) {
    std::cerr << "gpustitch replay: no policy could run\n";
    return kProblem;
  }

  if (!a.plot.empty()) {
    std::string why;
    PlotOptions po;
    po.title = "allocated vs reserved: " + path + " (" + gib(env.capacity) + " device)";
    po.capacity_bytes = static_cast<double>(env.capacity);
    po.time_axis = has_time;
    po.width = a.plot_width;
    po.height = a.plot_height;
    if (!write_plot(results, po, a.plot, &why)) {
      std::cerr << "gpustitch replay: " << why << "\n";
      return kProblem;
    }
  }

  if (g.json) {
    nlohmann::json j;
    j["trace"] = path;
    j["events"] = tr.events.size();
    j["bad_lines"] = tr.bad_lines;
    j["devices"] = env.devices;
    j["capacity_bytes"] = env.capacity;
    j["policies"] = nlohmann::json::array();
    for (std::size_t i = 0; i < results.size(); ++i) {
      const auto& r = results[i];
      j["policies"].push_back({{"policy", r.policy},
                               {"peak_reserved_bytes", r.peak_reserved},
                               {"peak_allocated_bytes", r.peak_allocated},
                               {"fragmentation_at_peak", r.frag_at_peak},
                               {"fragmentation_mean", r.frag_mean},
                               {"fragmentation_max", r.frag_max},
                               {"ooms", r.ooms},
                               {"oom_bytes", r.oom_bytes},
                               {"first_oom_event", r.first_oom_op},
                               {"first_oom_size", r.first_oom_size},
                               {"allocated_at_first_oom", r.allocated_at_first_oom},
                               {"reserved_at_first_oom", r.reserved_at_first_oom},
                               {"skipped_frees", r.skipped_frees},
                               {"unmatched_frees", r.unmatched_frees},
                               {"ns_per_op", r.ns_per_op},
                               {"ns_per_alloc", r.ns_per_alloc},
                               {"ns_per_free", r.ns_per_free}});
      if (a.min_capacity) j["policies"].back()["min_capacity_bytes"] = min_caps[i];
      for (const auto& [name, value] : r.counters) j["policies"].back()[name] = value;
      for (const auto& [name, value] : r.second_half) j["policies"].back()[name] = value;
    }
    std::cout << terminal_json(j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace))
              << "\n";
  } else {
    std::printf("trace %s: %zu events, device capacity %s\n", path.c_str(), tr.events.size(),
                gib(env.capacity).c_str());
    std::printf("%-26s %13s %13s %9s %9s %9s %7s %9s\n", "policy", "peak reserved", "peak alloc",
                "frag@peak", "frag mean", "frag max", "OOMs", "ns/op");
    for (const auto& r : results) {
      std::printf("%-26s %13s %13s %8.1f%% %8.1f%% %8.1f%% %7llu %9.0f\n", r.policy.c_str(),
                  gib(r.peak_reserved).c_str(), gib(r.peak_allocated).c_str(), r.frag_at_peak * 100,
                  r.frag_mean * 100, r.frag_max * 100, static_cast<unsigned long long>(r.ooms),
                  r.ns_per_op);
    }
    for (const auto& r : results) {
      if (r.ooms == 0) continue;
      std::printf("%s: first OOM at event %lld: %s requested with %s allocated and %s reserved\n",
                  r.policy.c_str(), static_cast<long long>(r.first_oom_op),
                  gib(r.first_oom_size).c_str(), gib(r.allocated_at_first_oom).c_str(),
                  gib(r.reserved_at_first_oom).c_str());
    }
    for (std::size_t i = 0; i < min_caps.size(); ++i) {
      std::printf("%s: smallest device without OOM: %s\n", results[i].policy.c_str(),
                  min_caps[i] ? gib(min_caps[i]).c_str() : "none tried fits");
    }
    if (!min_caps.empty()) std::printf("(smallest device: bisection to within 64 MiB)\n");
    for (const auto& r : results) {
      const auto us = find_counter(r.counters, "driver_us");
      if (!us) continue;
      std::printf("%s: driver calls %.1f ms on an idle H200's costs (", r.policy.c_str(),
                  static_cast<double>(*us) / 1000.0);
      static constexpr std::pair<const char*, const char*> kCalls[] = {
          {"driver_mallocs", "cudaMalloc"}, {"driver_frees", "cudaFree"},
          {"driver_creates", "creates"},    {"driver_maps", "maps"},
          {"driver_unmaps", "unmaps"},      {"driver_releases", "releases"}};
      const char* sep = "";
      for (const auto& [key, what] : kCalls) {
        const std::uint64_t n = find_counter(r.counters, key).value_or(0);
        if (n == 0) continue;
        std::printf("%s%llu %s", sep, static_cast<unsigned long long>(n), what);
        sep = ", ";
      }
      std::printf("%s)", *sep ? "" : "no calls");
      if (const auto later = find_counter(r.second_half, "driver_us_second_half"))
        std::printf(", %.1f ms of it in the second half of the events",
                    static_cast<double>(*later) / 1000.0);
      if (const auto fences = find_counter(r.counters, "fences"))
        std::printf("; %llu device fences (free on this simulated device, a wait on a GPU)",
                    static_cast<unsigned long long>(*fences));
      std::printf("\n");
    }
    for (const auto& r : results) {
      auto get = [&](std::string_view key) {
        return find_counter(r.counters, key).value_or(UINT64_MAX);
      };
      if (get("peak_live_bytes") == UINT64_MAX) continue;
      auto mib = [](std::uint64_t b) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(b) / (1024.0 * 1024.0));
        return std::string(buf);
      };
      std::printf(
          "%s at its peak (%s reserved, after a request of %s): live %s, free %s in %llu blocks "
          "(%s of it in granules that live blocks share, which no handle could move; %s in pieces "
          "under 2 MiB, largest %s), waiting for a fence %s, small chunks %s, spare handles %s\n",
          r.policy.c_str(), mib(get("peak_reserved_explained")).c_str(),
          mib(get("peak_request_bytes")).c_str(), mib(get("peak_live_bytes")).c_str(),
          mib(get("peak_free_bytes")).c_str(),
          static_cast<unsigned long long>(get("peak_free_blocks")),
          mib(get("peak_free_pinned_bytes")).c_str(),
          mib(get("peak_free_under_2mib_bytes")).c_str(),
          mib(get("peak_largest_free_bytes")).c_str(), mib(get("peak_pending_bytes")).c_str(),
          mib(get("peak_small_chunk_bytes")).c_str(), mib(get("peak_spare_bytes")).c_str());
    }
  }
  return kOk;
}

Registrar reg{
    "replay", "Replay an allocation trace (RMM CSV) through gpustitch and baseline policies",
    [](CLI::App& app, GlobalOptions& global) {
      auto a = std::make_shared<ReplayArgs>();
      app.add_option("trace", a->trace, "Trace file (RMM logging CSV)");
      app.add_option("--capacity-gb", a->capacity_gb,
                     "Simulated device capacity in GiB (default 80)")
          ->check(capacity_gb_check());
      app.add_option("--policy", a->policies,
                     "Policies to replay, comma-separated (default: all default ones)");
      app.add_option("--max-split-mb", a->max_split_mb,
                     "max_split_size_mb for the pytorch-max-split policy (adds it)")
          ->check(finite_range(0, kMaxCapacityGb * 1024, false,
                               "a number of MiB between 0 and 1073741824"));
      app.add_option("--plot", a->plot, "Write allocated vs reserved to FILE.svg|.png");
      app.add_option("--plot-width", a->plot_width, "Chart width in pixels (default 1000)")
          ->check(CLI::Range(400, kMaxPlotPixels));
      app.add_option("--plot-height", a->plot_height, "Chart height in pixels (default 540)")
          ->check(CLI::Range(200, kMaxPlotPixels));
      app.add_option("--generate", a->generate,
                     "Write the synthetic transformer trace to FILE (and replay it)");
      app.add_option("--steps", a->steps, "Steps of the synthetic trace (default 120)")
          ->check(CLI::Range(1, kMaxGeneratedSteps));
      app.add_flag("--list-policies", a->list, "List the policies and exit");
      app.add_flag("--gpu", a->gpu,
                   "Replay on the GPU: gpustitch over the CUDA backend (cap = capacity) "
                   "plus native cuda-malloc and cuda-malloc-async rows");
      app.add_flag("--whole-handles", a->whole_handles,
                   "Simulate a driver that cannot map at an offset into a handle (the "
                   "H200 with driver 580), so only whole handles can be stitched");
      app.add_option("--conf", a->conf,
                     "GPUSTITCH_CONF-style settings for the gpustitch policies, e.g. "
                     "segment_mb:64");
      app.add_flag("--explain-peak", a->explain_peak,
                   "Say where the gpustitch policies' reserved memory was at its peak: live, "
                   "free (by size), waiting for a fence, small chunks, spare handles");
      app.add_flag("--min-capacity", a->min_capacity,
                   "Also find each policy's smallest device without OOM (bisection)");
      return [a, &global]() { return run_replay(*a, global); };
    }};

}  // namespace
}  // namespace gpustitch::cli
