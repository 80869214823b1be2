// Cost of an allocation through libgpustitch.so, against native CUDA: run this program twice, once
// plain and once under the shim, and compare the same rows.
//
//   ./preload_bench                                                   # native CUDA
//   gpustitch run --keep-framework-cache -- ./preload_bench           # through the shim
//
// The runtime is found like PyTorch and CuPy find it: dlopen("libcudart.so.13") and dlsym, so the
// calls go through the shim's hooks exactly as theirs do (set LD_LIBRARY_PATH to the directory of
// libcudart.so.13, e.g. .../site-packages/nvidia/cu13/lib). Targets (issue 3): a cache-hit
// allocation or free through the shim at most 150 ns at the median; a call the shim only passes
// through at most 50 ns more than native. Pass --benchmark_repetitions=5
// --benchmark_report_aggregates_only=true for medians.
#include <benchmark/benchmark.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

struct Runtime {
  int (*malloc)(void**, std::size_t) = nullptr;
  int (*free)(void*) = nullptr;
  int (*malloc_async)(void**, std::size_t, void*) = nullptr;
  int (*free_async)(void*, void*) = nullptr;
  int (*stream_create)(void**) = nullptr;
  int (*device_synchronize)() = nullptr;
  int (*mem_get_info)(std::size_t*, std::size_t*) = nullptr;
  bool ok = false;
};

const Runtime& rt() {
  static Runtime r = [] {
    Runtime x;
    void* h = dlopen("libcudart.so.13", RTLD_NOW | RTLD_LOCAL);
    if (!h) return x;
    x.malloc = reinterpret_cast<decltype(x.malloc)>(dlsym(h, "cudaMalloc"));
    x.free = reinterpret_cast<decltype(x.free)>(dlsym(h, "cudaFree"));
    x.malloc_async = reinterpret_cast<decltype(x.malloc_async)>(dlsym(h, "cudaMallocAsync"));
    x.free_async = reinterpret_cast<decltype(x.free_async)>(dlsym(h, "cudaFreeAsync"));
    x.stream_create = reinterpret_cast<decltype(x.stream_create)>(dlsym(h, "cudaStreamCreate"));
    x.device_synchronize =
        reinterpret_cast<decltype(x.device_synchronize)>(dlsym(h, "cudaDeviceSynchronize"));
    x.mem_get_info = reinterpret_cast<decltype(x.mem_get_info)>(dlsym(h, "cudaMemGetInfo"));
    x.ok = x.malloc && x.free && x.malloc_async && x.free_async && x.stream_create &&
           x.device_synchronize && x.free(nullptr) == 0;
    return x;
  }();
  return r;
}

bool ready(benchmark::State& state) {
  if (rt().ok) return true;
  state.SkipWithError("libcudart.so.13 not loadable or no CUDA device");
  return false;
}

// cudaMalloc + cudaFree of one size, repeatedly: after the first round every allocation is a cache
// hit in the pool (natively: a real cudaMalloc each time).
void BM_MallocFree(benchmark::State& state) {
  if (!ready(state)) return;
  auto size = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    void* p = nullptr;
    if (rt().malloc(&p, size) != 0) {
      state.SkipWithError("cudaMalloc failed");
      break;
    }
    rt().free(p);
  }
  state.SetItemsProcessed(state.iterations() * 2);  // calls
}
BENCHMARK(BM_MallocFree)->Arg(512)->Arg(64 << 10)->Arg(2 << 20)->Arg(64 << 20);

// cudaMallocAsync + cudaFreeAsync on one stream, no synchronisation.
void BM_MallocFreeAsync(benchmark::State& state) {
  if (!ready(state)) return;
  static void* stream = [] {
    void* s = nullptr;
    rt().stream_create(&s);
    return s;
  }();
  auto size = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    void* p = nullptr;
    if (rt().malloc_async(&p, size, stream) != 0) {
      state.SkipWithError("cudaMallocAsync failed");
      break;
    }
    rt().free_async(p, stream);
  }
  state.SetItemsProcessed(state.iterations() * 2);
}
BENCHMARK(BM_MallocFreeAsync)->Arg(512)->Arg(2 << 20);

// Random sizes up to 4 MiB, up to 64 live blocks, cudaMalloc/cudaFree (the measured native cost is
// about 46 us per call).
void BM_RandomMallocFree(benchmark::State& state) {
  if (!ready(state)) return;
  std::mt19937_64 rng(42);
  std::uniform_int_distribution<std::size_t> size(1, 4 << 20);
  std::vector<void*> live;
  for (auto _ : state) {
    if (live.size() < 64 && (live.empty() || rng() % 2)) {
      void* p = nullptr;
      if (rt().malloc(&p, size(rng)) == 0) live.push_back(p);
    } else {
      std::size_t i = rng() % live.size();
      rt().free(live[i]);
      live[i] = live.back();
      live.pop_back();
    }
  }
  for (void* p : live) rt().free(p);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_RandomMallocFree);

// A call the shim only forwards: cudaFree(NULL) (the runtime returns at once).
void BM_PassThrough(benchmark::State& state) {
  if (!ready(state)) return;
  for (auto _ : state) benchmark::DoNotOptimize(rt().free(nullptr));
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_PassThrough);

// A driver call on memory the pool does not own, which the shim only passes through
// (cuMemGetAddressRange on managed or native memory), while the pool holds live blocks.
void BM_PassThroughAddressRange(benchmark::State& state) {
  if (!ready(state)) return;
  using AddressRange = int (*)(unsigned long long*, std::size_t*, unsigned long long);
  static const auto address_range = reinterpret_cast<AddressRange>(
      dlsym(dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD), "cuMemGetAddressRange_v2"));
  if (address_range == nullptr) {
    state.SkipWithError("no cuMemGetAddressRange_v2");
    return;
  }
  std::vector<void*> held(8);
  for (std::size_t i = 0; i < held.size(); ++i) rt().malloc(&held[i], i % 2 ? 512 : 4 << 20);
  // Host memory: nobody's device memory, so both the shim and the driver look it up and say no.
  std::vector<char> foreign(4096);
  const auto p = reinterpret_cast<unsigned long long>(foreign.data());
  for (auto _ : state) {
    unsigned long long base = 0;
    std::size_t size = 0;
    benchmark::DoNotOptimize(address_range(&base, &size, p));
  }
  for (void* q : held) rt().free(q);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_PassThroughAddressRange);

}  // namespace

BENCHMARK_MAIN();
