// gpustitch demo: the fragmenting workload of the seeds' case, stitching off vs on, side by side.
// Runs on the GPU when one is present (backend auto), else on a simulated 80 GiB device.
#include <nlohmann/json.hpp>

#include <cstdio>
#include <iostream>

#include "../demo/transformer_workload.h"
#include "command.h"
#include "format.h"
#include "gpustitch/backend_factory.h"
#include "gpustitch/pool.h"
#include "number_checks.h"
#include "terminal_text.h"

namespace gpustitch::cli {
namespace {

struct DemoOptions {
  std::string backend = "auto";
  double capacity_gb = 80;
  int steps = 200;
  unsigned seed = 1;
  int batch = 3;
  std::string conf;  // extra GPUSTITCH_CONF-style keys
};

int run_demo(const DemoOptions& opt, const GlobalOptions& global) {
  Config base;
  auto parsed = parse_config("backend:" + opt.backend + "," + opt.conf);
  if (!parsed.errors.empty()) {
    for (const auto& e : parsed.errors) std::cerr << "gpustitch demo: " << e << "\n";
    return kUsage;
  }
  base = parsed.config;
  base.background_reclaim = false;  // fence at step boundaries, like a synchronising loop
  const std::size_t capacity = static_cast<std::size_t>(opt.capacity_gb * GiB);
  base.sim_capacity = capacity;

  std::string why;
  std::unique_ptr<Backend> backend;
  if (base.backend != BackendKind::sim) backend = make_backend(base, &why);
  if (!backend) {
    if (base.backend == BackendKind::cuda) {
      std::cerr << "gpustitch demo: CUDA backend unavailable: " << why << "\n";
      return kUnreachable;
    }
    if (base.backend == BackendKind::automatic && !global.json) {
      std::cerr << "gpustitch demo: no usable GPU (" << why << "); using a simulated "
                << opt.capacity_gb << " GiB device\n";
    }
    backend = make_sim_backend(base);
  }
  const bool on_gpu = std::string(backend->name()) != "sim";
  if (on_gpu) {
    // On a real GPU the run is held to the same budget by the pool's cap.
    base.cap = capacity;
  }

  demo::WorkloadOptions w;
  w.steps = opt.steps;
  w.seed = opt.seed;
  w.batch = opt.batch;
  demo::WorkloadResult results[2];
  for (int stitching = 0; stitching < 2; ++stitching) {
    Config c = base;
    c.stitching = stitching == 1;
    Pool pool(*backend, c);
    results[stitching] = demo::run_transformer_workload(pool, 0, capacity, w);
    pool.trim(0);
  }

  if (global.json) {
    nlohmann::json j;
    j["backend"] = backend->name();
    j["capacity_bytes"] = capacity;
    j["steps"] = opt.steps;
    for (int s = 0; s < 2; ++s) {
      const auto& r = results[s];
      j[s ? "stitching_on" : "stitching_off"] = {{"peak_reserved_bytes", r.peak_reserved},
                                                 {"peak_allocated_bytes", r.peak_allocated},
                                                 {"fragmentation", r.fragmentation},
                                                 {"ooms", r.ooms},
                                                 {"largest_failed_bytes", r.largest_failed},
                                                 {"steps_completed", r.steps_completed},
                                                 {"stitches", r.stitches},
                                                 {"allocations", r.allocations},
                                                 {"seconds", r.seconds}};
    }
    std::cout << terminal_json(j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace))
              << "\n";
    return kOk;
  }
  std::printf("gpustitch demo: transformer steps with sequence length jumping 256..8192\n");
  std::printf("device: %s, budget %s, %d steps, batch %d, seed %u\n\n",
              on_gpu ? "GPU 0 (CUDA)" : "simulated", human_bytes(capacity).c_str(), opt.steps,
              opt.batch, opt.seed);
  std::printf("%-26s %18s %18s\n", "", "stitching off", "stitching on");
  auto row = [](const char* name, const std::string& a, const std::string& b) {
    std::printf("%-26s %18s %18s\n", name, a.c_str(), b.c_str());
  };
  const auto &off = results[0], &on = results[1];
  row("steps completed", std::to_string(off.steps_completed), std::to_string(on.steps_completed));
  row("out-of-memory errors", std::to_string(off.ooms), std::to_string(on.ooms));
  row("largest failed request", off.ooms ? human_bytes(off.largest_failed) : "-",
      on.ooms ? human_bytes(on.largest_failed) : "-");
  row("peak allocated", human_bytes(off.peak_allocated), human_bytes(on.peak_allocated));
  row("peak reserved", human_bytes(off.peak_reserved), human_bytes(on.peak_reserved));
  row("fragmentation at peak", percent(off.fragmentation), percent(on.fragmentation));
  row("stitches", std::to_string(off.stitches), std::to_string(on.stitches));
  row("wall time", std::to_string(off.seconds).substr(0, 5) + " s",
      std::to_string(on.seconds).substr(0, 5) + " s");
  return kOk;
}

Registrar reg{"demo", "Run a fragmenting training workload with stitching off and on",
              [](CLI::App& sub, GlobalOptions& global) -> std::function<int()> {
                auto opt = std::make_shared<DemoOptions>();
                sub.add_option("--backend", opt->backend, "auto (GPU if present), cuda or sim")
                    ->capture_default_str();
                sub.add_option("--capacity-gb", opt->capacity_gb,
                               "Device memory budget in GiB (simulated size, or cap on a GPU)")
                    ->capture_default_str()
                    ->check(capacity_gb_check());
                sub.add_option("--steps", opt->steps, "Training steps per run")
                    ->capture_default_str()
                    ->check(CLI::Range(1, kMaxGeneratedSteps));
                sub.add_option("--seed", opt->seed, "Random seed")->capture_default_str();
                sub.add_option("--batch", opt->batch, "Batch size")
                    ->capture_default_str()
                    ->check(CLI::Range(1, kMaxDemoBatch));
                sub.add_option("--conf", opt->conf,
                               "Extra configuration, GPUSTITCH_CONF style (k:v,...)");
                return [opt, &global] { return run_demo(*opt, global); };
              }};

}  // namespace
}  // namespace gpustitch::cli
