// gpustitch tune TRACE: which PYTORCH_CUDA_ALLOC_CONF setting should this job use, and would
// gpustitch help? Replays one recorded trace (RMM CSV or PyTorch memory snapshot) through the
// whole settings sweep of tools/replay/tune.h and prints one row per setting, the recommended
// line and gpustitch's figure next to it. --json for scripts, --plot for the chart.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "command.h"
#include "number_checks.h"
#include "plot.h"
#include "terminal_text.h"
#include "trace_input.h"
#include "tune.h"
#include "tune_plot.h"

namespace gpustitch::cli {
namespace {

struct TuneArgs {
  std::string trace;
  double capacity_gb = 80;
  double precision_mb = 0;
  unsigned jobs = 0;
  std::string plot;
  int plot_width = 1000, plot_height = 0;
};

std::string gib(std::uint64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(b) / (1024.0 * 1024 * 1024));
  return buf;
}

const char* verdict_name(replay::TuneVerdict v) {
  switch (v) {
    case replay::TuneVerdict::default_is_best:
      return "default_is_best";
    case replay::TuneVerdict::setting_saves:
      return "setting_saves";
    case replay::TuneVerdict::setting_avoids_oom:
      return "setting_avoids_oom";
    case replay::TuneVerdict::only_gpustitch_fits:
      return "only_gpustitch_fits";
    case replay::TuneVerdict::short_of_memory:
      return "short_of_memory";
  }
  return "?";
}

int run_tune(const TuneArgs& a, const GlobalOptions& g) {
  using namespace gpustitch::replay;
  if (!(a.capacity_gb > 0)) {
    std::cerr << "gpustitch tune: --capacity-gb must be a positive number of GiB\n";
    return kUsage;
  }
  if (a.precision_mb < 0) {
    std::cerr << "gpustitch tune: --precision-mb must not be negative\n";
    return kUsage;
  }
  std::string why;
  if (!a.plot.empty() && !plot_path_supported(a.plot, &why)) {
    std::cerr << "gpustitch tune: --plot: " << why << "\n";
    return kUsage;
  }
  if (a.plot_width < 400 || a.plot_height < 0 || (a.plot_height && a.plot_height < 200)) {
    std::cerr << "gpustitch tune: --plot-width must be at least 400 and --plot-height 200\n";
    return kUsage;
  }
  TraceInput in;
  switch (read_trace_input(a.trace, &in, &why)) {
    case TraceInputStatus::ok:
      break;
    case TraceInputStatus::cannot_open:
      std::cerr << "gpustitch tune: " << terminal_text(why) << "\n";
      return kNotFound;
    case TraceInputStatus::malformed:
      std::cerr << "gpustitch tune: " << terminal_text(why) << "\n";
      return kUsage;
  }
  if (in.trace.bad_lines)
    std::cerr << terminal_text(a.trace) << ": " << in.trace.bad_lines
              << " bad lines skipped (first: line " << in.trace.errors.front().line << ": "
              << terminal_text(in.trace.errors.front().reason) << ")\n";

  TuneOptions opt;
  opt.capacity = static_cast<std::uint64_t>(a.capacity_gb * 1024.0 * 1024.0 * 1024.0);
  opt.resolution = static_cast<std::uint64_t>(a.precision_mb * 1024 * 1024);
  opt.jobs = a.jobs ? a.jobs : std::max(1u, std::thread::hardware_concurrency());
  // A progress line on stderr once the sweep has run a second; rewritten in place on a terminal.
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto last = start;
  const bool tty = isatty(STDERR_FILENO) != 0;
  bool printed = false;
  opt.progress = [&](std::size_t done, std::size_t total, const std::string& label) {
    const auto now = clock::now();
    if (now - start < std::chrono::seconds(1) || (!tty && now - last < std::chrono::seconds(2)))
      return;
    last = now;
    printed = true;
    std::fprintf(stderr, "%sgpustitch tune: %zu/%zu settings replayed (%s), %.0f s%s",
                 tty ? "\r\033[K" : "", done, total, label.c_str(),
                 std::chrono::duration<double>(now - start).count(), tty ? "" : "\n");
  };
  TuneReport rep = run_tune(in.trace, opt);
  if (printed && tty) std::fprintf(stderr, "\n");
  const double seconds = std::chrono::duration<double>(clock::now() - start).count();

  if (!a.plot.empty()) {
    TunePlotOptions po;
    po.width = a.plot_width;
    po.height = a.plot_height;
    po.title = "gpustitch tune: " + a.trace + " (" + gib(rep.capacity) + " device)";
    if (!write_tune_plot(rep, po, a.plot, &why)) {
      std::cerr << "gpustitch tune: " << why << "\n";
      return kProblem;
    }
  }

  const TuneAnswer& ans = rep.answer;
  if (g.json) {
    nlohmann::json j;
    j["trace"] = a.trace;
    j["events"] = in.trace.events.size();
    j["capacity_bytes"] = rep.capacity;
    j["min_capacity_precision_bytes"] = rep.resolution;
    j["peak_allocated_bytes"] = rep.peak_allocated;
    j["seconds"] = seconds;
    if (in.snapshot) {
      const auto& s = *in.snapshot;
      j["snapshot"] = {{"entries", s.entries},
                       {"allocs", s.allocs},
                       {"frees", s.frees},
                       {"truncated", s.truncated()},
                       {"lost_allocs", s.lost_allocs},
                       {"lost_alloc_bytes", s.lost_alloc_bytes},
                       {"unrecorded_live", s.unrecorded_live},
                       {"unrecorded_live_bytes", s.unrecorded_live_bytes},
                       {"recorded_ooms", s.recorded_ooms}};
      if (s.has_segment_record)
        j["snapshot"]["recorded_peak_reserved_bytes"] = s.recorded_peak_reserved;
    }
    j["settings"] = nlohmann::json::array();
    for (const auto& r : rep.rows) {
      nlohmann::json row = {
          {"setting", r.setting.label},
          {"family", r.setting.family == TuneFamily::pytorch ? "pytorch" : "gpustitch"},
          {"conf", r.setting.conf},
          {"peak_reserved_bytes", r.at_capacity.peak_reserved},
          {"min_capacity_bytes", r.min_capacity},
          {"ooms_at_capacity", r.at_capacity.ooms},
          {"idle_cache_at_peak", r.at_capacity.frag_at_peak},
          {"relative_cost", r.relative_cost},
          {"ns_per_op", r.at_capacity.ns_per_op}};
      if (const auto us = find_counter(r.at_capacity.counters, "driver_us")) row["driver_us"] = *us;
      if (r.min_capacity == 0) row["min_capacity_above_bytes"] = r.largest_tried;
      if (r.at_capacity.unusable_at_peak >= 0)
        row["unusable_free_at_peak"] = r.at_capacity.unusable_at_peak;
      else
        row["unusable_free_at_peak"] = nullptr;
      j["settings"].push_back(row);
    }
    const auto& rec = rep.rows[ans.recommended];
    j["recommendation"] = {{"verdict", verdict_name(ans.verdict)},
                           {"setting", rec.setting.label},
                           {"pytorch_cuda_alloc_conf", ans.alloc_conf},
                           {"peak_reserved_bytes", rec.at_capacity.peak_reserved},
                           {"min_capacity_bytes", rec.min_capacity},
                           {"summary", ans.summary}};
    if (ans.best_gpustitch != SIZE_MAX) {
      const auto& gs = rep.rows[ans.best_gpustitch];
      j["gpustitch"] = {{"setting", gs.setting.label},
                        {"gpustitch_conf", gs.setting.conf},
                        {"peak_reserved_bytes", gs.at_capacity.peak_reserved},
                        {"min_capacity_bytes", gs.min_capacity},
                        {"ooms_at_capacity", gs.at_capacity.ooms}};
    }
    std::cout << terminal_json(j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace))
              << "\n";
    return kOk;
  }

  std::printf("trace %s: %zu events, peak live %s, device capacity %s\n", a.trace.c_str(),
              in.trace.events.size(), gib(rep.peak_allocated).c_str(), gib(rep.capacity).c_str());
  if (in.snapshot) {
    const auto& s = *in.snapshot;
    std::printf("PyTorch snapshot: %llu trace entries (%llu allocs, %llu frees)",
                static_cast<unsigned long long>(s.entries),
                static_cast<unsigned long long>(s.allocs),
                static_cast<unsigned long long>(s.frees));
    if (s.has_segment_record)
      std::printf(", the job reserved at most %s over the record",
                  gib(s.recorded_peak_reserved).c_str());
    std::printf("\n");
    if (s.truncated())
      std::printf(
          "the ring buffer was truncated: %llu frees (%s) had lost their alloc and %llu blocks "
          "(%s) live at the snapshot had none recorded; both are replayed as live from the "
          "start. What happened before the record began is not known.\n",
          static_cast<unsigned long long>(s.lost_allocs), gib(s.lost_alloc_bytes).c_str(),
          static_cast<unsigned long long>(s.unrecorded_live), gib(s.unrecorded_live_bytes).c_str());
  }
  int width = 8;
  for (const auto& r : rep.rows)
    width = std::max(width, static_cast<int>(r.setting.label.size()) + 2);
  std::printf("%-*s %13s %13s %7s %6s %8s %9s\n", width, "setting", "peak reserved", "min device",
              "OOMs", "idle", "unusable", "driver");
  for (std::size_t i = 0; i < rep.rows.size(); ++i) {
    const auto& r = rep.rows[i];
    std::string label = r.setting.label + (i == ans.recommended ? " *" : "");
    char unusable[16] = "n/a";
    if (r.at_capacity.unusable_at_peak >= 0)
      std::snprintf(unusable, sizeof unusable, "%.1f%%", r.at_capacity.unusable_at_peak * 100);
    char driver[24] = "n/a";
    if (const auto us = find_counter(r.at_capacity.counters, "driver_us"))
      std::snprintf(driver, sizeof driver, "%.0f ms", static_cast<double>(*us) / 1000.0);
    std::printf("%-*s %13s %13s %7llu %5.1f%% %8s %9s\n", width, label.c_str(),
                gib(r.at_capacity.peak_reserved).c_str(),
                r.min_capacity ? gib(r.min_capacity).c_str() : "none",
                static_cast<unsigned long long>(r.at_capacity.ooms),
                r.at_capacity.frag_at_peak * 100, unusable, driver);
  }
  std::printf(
      "min device: smallest capacity without OOM, by bisection to within %.0f MiB; idle: idle "
      "cache, 1 - allocated/reserved at peak reserved; unusable: unusable free memory, free but "
      "not allocatable as one block at peak reserved; driver: what the setting's calls into the "
      "driver's memory API (cudaMalloc/cudaFree, or cuMemCreate/Map/SetAccess/Unmap/Release) "
      "would cost over the whole trace on an idle H200 (the sweep took %.1f s)\n",
      static_cast<double>(rep.resolution) / (1024.0 * 1024.0), seconds);
  std::printf("recommended: PYTORCH_CUDA_ALLOC_CONF=%s%s\n", ans.alloc_conf.c_str(),
              ans.alloc_conf.empty() ? "  (leave it unset)" : "");
  std::printf("%s\n", ans.summary.c_str());
  return kOk;
}

Registrar reg{
    "tune",
    "Find the allocator setting a recorded job needs: PyTorch's settings sweep and gpustitch",
    [](CLI::App& app, GlobalOptions& global) {
      auto a = std::make_shared<TuneArgs>();
      app.footer(
          "Figures per setting: peak reserved at the capacity; min device, the smallest capacity "
          "without out-of-memory (bisection; the precision is printed); OOMs at the capacity; "
          "idle cache = 1 - allocated/reserved at peak reserved (PyTorch's fragmentation "
          "figure); unusable free memory = (reserved - allocated - the largest cached block one "
          "request could get) / reserved at peak reserved, i.e. free but not allocatable as one "
          "block; cost = the model's time per operation relative to PyTorch's default.");
      app.add_option("trace", a->trace,
                     "Trace: RMM-format CSV (GPUSTITCH_CONF=trace:FILE) or a PyTorch memory "
                     "snapshot (torch.cuda.memory._dump_snapshot)")
          ->required();
      app.add_option("--capacity-gb", a->capacity_gb,
                     "Device capacity in GiB the job must fit (default 80; the trace does not "
                     "record the device's)")
          ->check(capacity_gb_check());
      app.add_option("--precision-mb", a->precision_mb,
                     "Bisection precision of the smallest device, MiB (default: 0.5% of the "
                     "peak live bytes, at least 2)")
          ->check(finite_range(0, kMaxCapacityGb * 1024, false,
                               "a number of MiB between 0 and 1073741824"));
      app.add_option("--jobs", a->jobs, "Settings replayed at once (default: one per core)")
          ->check(CLI::Range(0u, 1024u));
      app.add_option("--plot", a->plot,
                     "Write the chart of peak reserved and smallest device per setting to "
                     "FILE.svg or FILE.png");
      app.add_option("--plot-width", a->plot_width, "Chart width in pixels (default 1000)")
          ->check(CLI::Range(400, kMaxPlotPixels));
      app.add_option("--plot-height", a->plot_height,
                     "Chart height in pixels (default: from the number of settings)")
          ->check(CLI::Range(0, kMaxPlotPixels));
      return [a, &global]() { return run_tune(*a, global); };
    }};

}  // namespace
}  // namespace gpustitch::cli
