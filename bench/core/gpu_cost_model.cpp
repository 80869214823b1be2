// The allocation-latency sequence of bench/gpu/alloc_latency (cudaMalloc/cudaFree semantics, one
// thread: 512 B, 64 KiB, 2 MiB, 64 MiB, then random sizes up to 4 MiB) run through the pool on the
// simulated device with an H200's call costs added (as measured on an H200: cuMemCreate
// 12 us, cuMemMap 1-2 us, cuMemSetAccess 27 us per handle, cuMemUnmap 18 us, cuMemRelease 14 us,
// an idle cuCtxSynchronize about 0.7 us). It shows on any machine how the pool's policies play out
// where a fence costs more than the device pool's own path, which the plain simulated device
// (fences of a few ns) does not: fences per reuse, memory reserved, fresh handles and stitches.
//
// Run: build/bench/core/gpu_cost_model [--ops-scale N]   (N divides the operation counts)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "gpustitch/pool.h"
#include "gpustitch/sim_backend.h"

using namespace gpustitch;
using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  int scale = 1;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--ops-scale") == 0) scale = std::max(1, std::atoi(argv[i + 1]));
  }
  // The H200's costs (map_offset off: its driver maps whole handles only).
  SimOptions options{.devices = 1, .capacity = 80 * GiB, .map_offset = false};
  auto cost = [&](SimOp op, std::uint32_t ns) {
    options.call_ns[static_cast<std::size_t>(op)] = ns;
  };
  cost(SimOp::mem_info, 1'000);
  cost(SimOp::reserve, 2'600);
  cost(SimOp::create, 12'000);
  cost(SimOp::release, 14'000);
  cost(SimOp::map, 1'500);
  cost(SimOp::unmap, 18'000);
  cost(SimOp::set_access, 27'000);
  cost(SimOp::synchronize, 700);
  SimBackend sim{options};
  Pool pool(sim, Config{});
  struct Case {
    const char* name;
    std::size_t size;  // 0: random 256 B .. 4 MiB
    int ops;
  };
  const Case cases[] = {{"512 B", 512, 10000},
                        {"64 KiB", 64 * KiB, 10000},
                        {"2 MiB", 2 * MiB, 5000},
                        {"64 MiB", 64 * MiB, 1000},
                        {"mix <= 4 MiB", 0, 10000}};
  std::uint64_t rng = 12345;  // alloc_latency's sequence
  auto next = [&rng] {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return rng >> 17;
  };
  std::printf(
      "| size | pairs | pair mean (ns) | pair median (ns) | pair p90 (ns) | fences | reserved "
      "after "
      "(MiB) | fresh | stitches |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (const Case& c : cases) {
    std::vector<std::size_t> sizes(static_cast<std::size_t>(std::max(c.ops / scale, 10)));
    for (auto& s : sizes) s = c.size != 0 ? c.size : 256 + next() % (4 * MiB - 255);
    for (std::size_t i = 0; i < sizes.size() / 10; ++i) {  // alloc_latency's warm-up
      DevPtr p = 0;
      if (pool.allocate(0, sizes[i], kAnyStream, &p) == Status::ok) pool.deallocate(p);
    }
    const std::uint64_t fences_before = sim.calls(SimOp::synchronize);
    std::vector<double> pair;
    pair.reserve(sizes.size());
    for (std::size_t size : sizes) {
      const auto t0 = Clock::now();
      DevPtr p = 0;
      if (pool.allocate(0, size, kAnyStream, &p) != Status::ok) {
        std::fprintf(stderr, "%s: allocation of %zu failed\n", c.name, size);
        return 1;
      }
      pool.deallocate(p);
      pair.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count());
    }
    double mean = 0;
    for (double t : pair) mean += t / static_cast<double>(pair.size());
    std::sort(pair.begin(), pair.end());
    const DeviceStats st = pool.stats(0);
    std::printf("| %s | %zu | %.0f | %.0f | %.0f | %llu | %.0f | %llu | %llu |\n", c.name,
                pair.size(), mean, pair[pair.size() / 2], pair[pair.size() * 9 / 10],
                static_cast<unsigned long long>(sim.calls(SimOp::synchronize) - fences_before),
                static_cast<double>(st.bytes_reserved) / static_cast<double>(MiB),
                static_cast<unsigned long long>(st.fresh),
                static_cast<unsigned long long>(st.stitches));
  }
  return 0;
}
