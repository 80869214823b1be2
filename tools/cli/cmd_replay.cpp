// gpustitch replay TRACE: replays an allocation trace (RMM CSV, ours or RMM's) through gpustitch
// and baseline policies on a simulated device of a given capacity, and reports for each policy
// peak reserved/allocated, fragmentation (1 - allocated/reserved) at peak and on average, the
// out-of-memory count and the time per operation. --plot writes allocated vs reserved over time.
// --generate FILE writes the synthetic transformer trace (tools/replay/generator.h) first.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "command.h"
#include "generator.h"
#include "gpustitch/config.h"
#include "gpustitch/trace/trace_reader.h"
#include "plot.h"
#include "policy.h"
#include "replayer.h"

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
  std::string conf;
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
  std::string path = a.trace;
  trace::Trace tr;
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
  if (a.generate.empty() || path != a.generate) {
    std::string why;
    if (!trace::read_trace_file(path, &tr, &why)) {
      std::cerr << "gpustitch replay: " << why << "\n";
      return kNotFound;
    }
  }
  for (const auto& e : tr.errors)
    std::cerr << path << ":" << e.line << ": skipped: " << e.reason << "\n";
  if (tr.bad_lines > tr.errors.size())
    std::cerr << path << ": " << tr.bad_lines - tr.errors.size() << " more bad lines skipped\n";
  if (tr.events.empty()) {
    std::cerr << "gpustitch replay: " << path << " holds no allocation events\n";
    return kNotFound;
  }

  if (!a.conf.empty()) {
    const ConfigResult conf = parse_config(a.conf);
    if (!conf.errors.empty()) {
      for (const auto& e : conf.errors) std::cerr << "gpustitch replay: --conf: " << e << "\n";
      return kUsage;
    }
  }
  PolicyEnv env;
  env.devices = tr.device_count();
  env.capacity = static_cast<std::size_t>(a.capacity_gb * 1024.0 * 1024.0 * 1024.0);
  env.gpu = a.gpu;
  env.map_offset = !a.whole_handles;
  env.pool_conf = a.conf;
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
      continue;
    }
    results.push_back(replay_trace(tr, *policy));
    if (a.min_capacity) {
      std::uint64_t upper = std::max<std::uint64_t>(env.capacity, 2 * results.back().peak_reserved);
      min_caps.push_back(replay::min_capacity(tr, *spec, env, upper));
    }
  }

  if (!a.plot.empty()) {
    std::string why;
    std::string title = "allocated vs reserved: " + path + " (" + gib(env.capacity) + " device)";
    if (!write_plot(results, title, static_cast<double>(env.capacity), a.plot, &why))
      std::cerr << "gpustitch replay: " << why << "\n";
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
    }
    std::cout << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
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
  }
  return kOk;
}

Registrar reg{"replay",
              "Replay an allocation trace (RMM CSV) through gpustitch and baseline policies",
              [](CLI::App& app, GlobalOptions& global) {
                auto a = std::make_shared<ReplayArgs>();
                app.add_option("trace", a->trace, "Trace file (RMM logging CSV)");
                app.add_option("--capacity-gb", a->capacity_gb,
                               "Simulated device capacity in GiB (default 80)");
                app.add_option("--policy", a->policies,
                               "Policies to replay, comma-separated (default: all default ones)");
                app.add_option("--max-split-mb", a->max_split_mb,
                               "max_split_size_mb for the pytorch-max-split policy (adds it)");
                app.add_option("--plot", a->plot, "Write allocated vs reserved to FILE.svg|.png");
                app.add_option("--generate", a->generate,
                               "Write the synthetic transformer trace to FILE (and replay it)");
                app.add_option("--steps", a->steps, "Steps of the synthetic trace (default 120)");
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
                app.add_flag("--min-capacity", a->min_capacity,
                             "Also find each policy's smallest device without OOM (bisection)");
                return [a, &global]() { return run_replay(*a, global); };
              }};

}  // namespace
}  // namespace gpustitch::cli
