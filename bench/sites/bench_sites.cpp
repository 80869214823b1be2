// Cost of the allocation-site sampler per allocate+free pair, at several stack depths:
//   Unsampled: sampler registered, this allocation not selected (size below the threshold)
//   EveryAllocation: 1 in 1 (the worst case), 1 in 100, 1 in 1000
// "Off" costs nothing: make_site_sampler() returns null and nothing is registered.
#include <benchmark/benchmark.h>

#include "gpustitch/sites/site_sampler.h"

using namespace gpustitch;
using namespace gpustitch::sites;

namespace {

__attribute__((noinline)) void at_depth(int depth, PoolObserver& s, DevPtr p, std::size_t size) {
  if (depth > 0) {
    at_depth(depth - 1, s, p, size);
    asm volatile("" ::: "memory");
    return;
  }
  s.on_allocate(0, p, size, kAnyStream, ServedBy::cache);
  s.on_free(0, p, size, kAnyStream);
}

void run(benchmark::State& state, SiteSamplerOptions o, std::size_t size) {
  SiteSampler s(o);
  DevPtr p = 0x7f0000000000;
  int depth = static_cast<int>(state.range(0));
  for (auto _ : state) {
    at_depth(depth, s, p, size);
    p += 4096;
  }
  state.SetLabel(SiteSampler::unwinder());
}

// Baseline: the same calls into an observer that does nothing (what "off" compares with).
void NoSampler(benchmark::State& state) {
  PoolObserver nothing;
  DevPtr p = 0x7f0000000000;
  int depth = static_cast<int>(state.range(0));
  for (auto _ : state) {
    at_depth(depth, nothing, p, 4096);
    p += 4096;
  }
}

void Unsampled(benchmark::State& state) {
  run(state, {.min_size = 64 * MiB}, 4096);
}
void EveryAllocation(benchmark::State& state) {
  run(state, {.min_size = 1}, 4096);
}
void OneIn100(benchmark::State& state) {
  run(state, {.sample_every = 100}, 4096);
}
void OneIn1000(benchmark::State& state) {
  run(state, {.sample_every = 1000}, 4096);
}

}  // namespace

BENCHMARK(NoSampler)->Arg(10)->Arg(40);
BENCHMARK(Unsampled)->Arg(10)->Arg(40);
BENCHMARK(EveryAllocation)->Arg(10)->Arg(40);
BENCHMARK(OneIn100)->Arg(10)->Arg(40);
BENCHMARK(OneIn1000)->Arg(10)->Arg(40);
BENCHMARK_MAIN();
