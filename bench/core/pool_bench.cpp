// Pool speed on the simulated backend (the backend is off the cache-hit path, so these are the
// pool's own costs). Run: build/bench/core/pool_bench
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "gpustitch/pool.h"
#include "gpustitch/sim_backend.h"

using namespace gpustitch;

namespace {

struct Fixture {
  SimBackend sim{SimOptions{.devices = 1, .capacity = 64 * GiB}};
  Pool pool{sim, Config{}};
};

Fixture& shared_fixture() {
  static Fixture f;
  return f;
}

// A cache-hit allocate+free pair. Stream-ordered (cudaMallocAsync/cudaFreeAsync semantics):
// the freed block is reusable by the same stream at once.
void BM_CacheHitPairStream(benchmark::State& state) {
  Pool& pool = shared_fixture().pool;
  const std::size_t size = static_cast<std::size_t>(state.range(0));
  const Stream stream = 0x1000 + static_cast<Stream>(state.thread_index());
  DevPtr warm = 0;
  pool.allocate(0, size, stream, &warm);
  pool.deallocate(warm, stream);
  for (auto _ : state) {
    DevPtr p = 0;
    pool.allocate(0, size, stream, &p);
    benchmark::DoNotOptimize(p);
    pool.deallocate(p, stream);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_CacheHitPairStream)
    ->Arg(512)
    ->Arg(64 << 10)
    ->Arg(8 << 20)
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime();

// cudaMalloc/cudaFree semantics: every free waits for a fence on the reclaimer thread, so the
// allocation is served from other fenced cached blocks meanwhile.
void BM_CacheHitPairAnyStream(benchmark::State& state) {
  Pool& pool = shared_fixture().pool;
  const std::size_t size = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    DevPtr p = 0;
    pool.allocate(0, size, kAnyStream, &p);
    benchmark::DoNotOptimize(p);
    pool.deallocate(p);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_CacheHitPairAnyStream)->Arg(512)->Arg(8 << 20)->Threads(1)->Threads(2)->UseRealTime();

// Mixed random sizes up to 4 MiB with up to 64 live blocks per thread: stream-ordered (arg 0) or
// with cudaFree semantics (arg 1: a freed block is anyone's once a fence has covered it).
void BM_MixedRandom(benchmark::State& state) {
  Pool& pool = shared_fixture().pool;
  const Stream stream =
      state.range(0) == 0 ? 0x2000 + static_cast<Stream>(state.thread_index()) : kAnyStream;
  std::mt19937_64 rng(state.thread_index() + 1);
  std::vector<DevPtr> live;
  live.reserve(64);
  for (auto _ : state) {
    if (live.size() < 64 && (live.empty() || rng() % 2)) {
      DevPtr p = 0;
      pool.allocate(0, 256 + rng() % (4 << 20), stream, &p);
      live.push_back(p);
    } else {
      std::size_t k = rng() % live.size();
      pool.deallocate(live[k], stream);
      live[k] = live.back();
      live.pop_back();
    }
  }
  for (DevPtr p : live) pool.deallocate(p, stream);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_MixedRandom)->Arg(0)->Arg(1)->Threads(1)->Threads(2)->UseRealTime();

// A stitch of 1 GiB from 512 scattered 2 MiB holes (simulated mapping costs, not the GPU's).
void BM_Stitch1GiB(benchmark::State& state) {
  for (auto _ : state) {
    state.PauseTiming();
    SimBackend sim{SimOptions{.devices = 1, .capacity = 3 * GiB}};
    Config cfg;
    cfg.background_reclaim = false;
    Pool pool(sim, cfg);
    std::vector<DevPtr> blocks(1024);
    DevPtr seg = 0;
    pool.allocate(0, 2 * GiB, kAnyStream, &seg);
    pool.deallocate(seg);
    pool.drain_pending(0);
    for (auto& b : blocks) pool.allocate(0, 2 * MiB, kAnyStream, &b);
    for (std::size_t i = 0; i < blocks.size(); i += 2) pool.deallocate(blocks[i]);
    pool.drain_pending(0);
    sim.set_external_usage(0, 1 * GiB);
    state.ResumeTiming();
    DevPtr big = 0;
    pool.allocate(0, 1 * GiB, kAnyStream, &big);
    benchmark::DoNotOptimize(big);
  }
}
BENCHMARK(BM_Stitch1GiB)->Unit(benchmark::kMillisecond)->Iterations(5);

}  // namespace

BENCHMARK_MAIN();
