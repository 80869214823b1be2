// alloc_latency: what one allocation and one free cost on the GPU, side by side in one run.
//
// Rows, for sizes 512 B, 64 KiB, 2 MiB, 64 MiB, 1 GiB and a random mix of sizes <= 4 MiB:
//  - cudaMalloc / cudaFree;
//  - cudaMallocAsync / cudaFreeAsync on the device's default memory pool, warm, with its release
//    threshold at UINT64_MAX (nothing goes back to the driver), no synchronisation in the loop;
//  - gpustitch::Pool on the CUDA backend, in process: stream-ordered (cudaMallocAsync semantics)
//    and with cudaFree semantics (kAnyStream: freed memory is reusable after a device fence,
//    which the pool's reclaimer takes off the hot path).
// Each operation is timed alone (steady_clock; the cost of reading the clock, printed at the start,
// is included in every figure); we report median (the lowest of 5 round medians, see summarize)
// and p99 of alloc, of free, and of the pair, in nanoseconds.
//
// Then the cost of one large allocation (256 MiB, 2 GiB) against cudaMalloc of the same size:
// a fresh pool allocation (one new physical handle), and a stitched one (the pool is capped so
// fresh memory is refused, and holds the size in cached 2 MiB or 64 MiB pieces).
//
// Then single calls, each the median over many batches of 32 calls: the driver calls the shim
// makes on its allocation paths (cuCtxGetDevice, cuStreamIsCapturing, cuStreamGetDevice, and
// cuCtxGetCurrent for comparison), and calls the shim only passes through (cuMemGetAddressRange
// and cuPointerGetAttribute on managed memory, which the pool never serves). Driver functions come
// from cudaGetDriverEntryPointByVersion, as the runtime's own callers get them, so under
// LD_PRELOAD the hooked ones are the shim's hooks: compare the "pass-through" rows of a native run
// with those of a run under the shim (target: at most 50 ns more).
//
// The same binary is built twice: with the static CUDA runtime (nvcc's default) and with
// -cudart shared. Run under LD_PRELOAD=libgpustitch.so, the cudaMalloc and cudaMallocAsync rows
// measure the shim (the header says whether libgpustitch is loaded: it exports gpustitch_malloc).
//
// Usage: alloc_latency [--json PATH] [--quick]
#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "gpustitch/cuda_backend.h"
#include "gpustitch/pool.h"

#ifndef GPUSTITCH_CUDART_LINKAGE
#define GPUSTITCH_CUDART_LINKAGE "static"
#endif

using gpustitch::DevPtr;
using gpustitch::GiB;
using gpustitch::KiB;
using gpustitch::MiB;
using Clock = std::chrono::steady_clock;

namespace {

#define CUDA_CHECK(call)                                                                       \
  do {                                                                                         \
    const cudaError_t e_ = (call);                                                             \
    if (e_ != cudaSuccess) {                                                                   \
      std::printf("FAIL: %s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

double ns_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::nano>(b - a).count();
}

struct Stat {
  double median = 0, p99 = 0;
};
// The median is the lowest of the medians of kRounds consecutive parts of the samples, the p99
// that of all of them. Why: the GPU host is a shared virtual machine whose speed drifts by up to
// 2x for milliseconds at a time (the same call measured 52 and 80 ns in back-to-back runs of one
// process), so the median of one stretch mostly says how busy the neighbours were. The lowest
// round median is what the code costs when the host lets it run; both sides of a native-vs-shim
// comparison are measured the same way.
constexpr int kRounds = 5;
Stat summarize(const std::vector<double>& samples) {
  Stat s;
  if (samples.empty()) return s;
  auto median_of = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const std::size_t rounds = samples.size() >= 10 * kRounds ? kRounds : 1;
  const std::size_t per = samples.size() / rounds;
  s.median = INFINITY;
  for (std::size_t r = 0; r < rounds; ++r) {
    std::vector<double> part(samples.begin() + static_cast<std::ptrdiff_t>(r * per),
                             samples.begin() + static_cast<std::ptrdiff_t>((r + 1) * per));
    s.median = std::min(s.median, median_of(std::move(part)));
  }
  std::vector<double> v = samples;
  std::sort(v.begin(), v.end());
  s.p99 = v[std::min(v.size() - 1, static_cast<std::size_t>(v.size() * 0.99))];
  return s;
}

struct Row {
  std::string allocator, size;
  int ops = 0;
  Stat alloc, free, pair;
};
std::vector<Row> rows;

struct LargeRow {
  std::string what;
  std::size_t size;
  double pool_us = 0, cuda_malloc_us = 0;
  bool ok = false;
  std::string note;
};
std::vector<LargeRow> large_rows;

// An allocator under test: alloc(size) -> pointer or null, free(pointer).
struct Allocator {
  std::string name;
  std::function<void*(std::size_t)> alloc;
  std::function<void(void*)> free;
};

void measure(const Allocator& a, const std::string& size_name,
             const std::vector<std::size_t>& sizes, int warmup) {
  std::vector<double> t_alloc, t_free, t_pair;
  t_alloc.reserve(sizes.size());
  t_free.reserve(sizes.size());
  t_pair.reserve(sizes.size());
  for (int i = 0; i < warmup; ++i) {
    void* p = a.alloc(sizes[i % sizes.size()]);
    if (p != nullptr) a.free(p);
  }
  int failed = 0;
  for (std::size_t size : sizes) {
    const auto t0 = Clock::now();
    void* p = a.alloc(size);
    const auto t1 = Clock::now();
    if (p == nullptr) {
      ++failed;
      continue;
    }
    a.free(p);
    const auto t2 = Clock::now();
    t_alloc.push_back(ns_between(t0, t1));
    t_free.push_back(ns_between(t1, t2));
    t_pair.push_back(ns_between(t0, t2));
  }
  if (failed > 0)
    std::fprintf(stderr, "%s %s: %d allocations failed\n", a.name.c_str(), size_name.c_str(),
                 failed);
  rows.push_back({a.name, size_name, static_cast<int>(t_pair.size()), summarize(t_alloc),
                  summarize(t_free), summarize(t_pair)});
  std::fprintf(stderr, "  %-36s %-10s pair median %10.0f ns\n", a.name.c_str(), size_name.c_str(),
               rows.back().pair.median);
}

double cuda_malloc_us(std::size_t size, int reps) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    void* p = nullptr;
    const auto t0 = Clock::now();
    CUDA_CHECK(cudaMalloc(&p, size));
    t.push_back(ns_between(t0, Clock::now()) / 1000);
    CUDA_CHECK(cudaFree(p));
  }
  return summarize(t).median;
}

// Times one allocation of size from pool and checks that it was served the way the row measures
// (counter: the statistic that must grow, e.g. fresh or stitches), then gives the memory back to
// the driver so that the next repetition starts from the same state. False (and row.note set) if
// the allocation failed or was served another way.
bool time_one_allocation(gpustitch::Pool& pool, std::size_t size,
                         std::uint64_t gpustitch::DeviceStats::*counter, const char* expected,
                         LargeRow* row, std::vector<double>* t) {
  const auto before = pool.stats(0);
  DevPtr p = 0;
  const auto t0 = Clock::now();
  const auto st = pool.allocate(0, size, gpustitch::kAnyStream, &p);
  const double us = ns_between(t0, Clock::now()) / 1000;
  if (st != gpustitch::Status::ok) {
    row->note = std::string("allocate: ") + gpustitch::to_string(st);
    return false;
  }
  if (pool.stats(0).*counter == before.*counter) row->note = expected;
  t->push_back(us);
  pool.deallocate(p);
  pool.drain_pending(0);
  pool.trim(0);
  return true;
}

// One fresh allocation of size from an empty pool, with the default configuration (a fresh range
// of 256 MiB and more gets a few large handles) or with ordinary handles only (fresh_coarse_mb:0).
LargeRow pool_fresh(gpustitch::Backend& backend, std::size_t size, int reps, bool ordinary) {
  LargeRow row{ordinary ? "pool, fresh, ordinary handles only (fresh_coarse_mb:0)" : "pool, fresh",
               size};
  std::vector<double> t;
  gpustitch::Config config;
  if (ordinary) config.fresh_coarse = 0;
  gpustitch::Pool pool(backend, config);
  for (int r = 0; r < reps; ++r) {
    if (!time_one_allocation(pool, size, &gpustitch::DeviceStats::fresh, "not served fresh", &row,
                             &t)) {
      return row;
    }
  }
  row.pool_us = summarize(t).median;
  row.ok = row.note.empty();
  return row;
}

// What follows a fresh block, timed:
//  - its free and fence (against cudaFree of the same size in the cudaMalloc column): the large
//    handles stay as they are, so this costs no driver call;
//  - where the few large handles are paid for: the first block cut inside one of them (5/8 of
//    the freed block), which splits that handle in three (against cudaMalloc of the cut's size).
//    A block taken again at its own size pays nothing.
enum class AfterFresh { free_and_fence, cut_five_eighths };
LargeRow pool_after_fresh(gpustitch::Backend& backend, std::size_t size, int reps,
                          AfterFresh what) {
  const bool cut = what == AfterFresh::cut_five_eighths;
  LargeRow row{cut ? "pool, cached, 5/8 of a freed fresh block (splits one large handle)"
                   : "pool, free + fence of a fresh block (vs cudaFree)",
               size};
  std::vector<double> t;
  gpustitch::Pool pool(backend, gpustitch::Config{});
  for (int r = 0; r < reps; ++r) {
    DevPtr p = 0;
    if (pool.allocate(0, size, gpustitch::kAnyStream, &p) != gpustitch::Status::ok) {
      row.note = "allocate failed";
      return row;
    }
    auto t0 = Clock::now();
    pool.deallocate(p);
    pool.drain_pending(0);
    if (cut) {
      const auto before = pool.stats(0);
      t0 = Clock::now();
      if (pool.allocate(0, size / 8 * 5, gpustitch::kAnyStream, &p) != gpustitch::Status::ok) {
        row.note = "allocate failed";
        return row;
      }
      t.push_back(ns_between(t0, Clock::now()) / 1000);
      if (pool.stats(0).handles <= before.handles) row.note = "split nothing";
      pool.deallocate(p);
      pool.drain_pending(0);
    } else {
      t.push_back(ns_between(t0, Clock::now()) / 1000);
    }
    pool.trim(0);
  }
  row.pool_us = summarize(t).median;
  row.ok = row.note.empty();
  return row;
}

double cuda_free_us(std::size_t size, int reps) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, size));
    const auto t0 = Clock::now();
    CUDA_CHECK(cudaFree(p));
    t.push_back(ns_between(t0, Clock::now()) / 1000);
  }
  return summarize(t).median;
}

// One stitched allocation of size: the pool holds 2 x size/piece handles of piece bytes, every
// other one live, under a cap of 2 x size, so the request fits in no free block and no fresh
// memory is allowed: it can only be served by moving the idle handles of the holes side by side.
// (Pieces freed next to each other would merge into one cached block: a cache hit, not a stitch.)
LargeRow pool_stitched(gpustitch::Backend& backend, std::size_t size, std::size_t piece, int reps) {
  char what[96];
  std::snprintf(what, sizeof what, "pool, stitched from %zu x %zu MiB", size / piece, piece / MiB);
  LargeRow row{what, size};
  std::vector<double> t;
  gpustitch::Config config;
  config.cap = 2 * size;
  config.segment_size = piece;  // every piece is one handle of its own
  config.max_handle = 0;
  for (int r = 0; r < reps; ++r) {
    gpustitch::Pool pool(backend, config);
    std::vector<DevPtr> pieces(2 * (size / piece));
    for (auto& p : pieces) {
      if (pool.allocate(0, piece, gpustitch::kAnyStream, &p) != gpustitch::Status::ok) {
        row.note = "could not fill the cap with pieces";
        return row;
      }
    }
    for (std::size_t i = 1; i < pieces.size(); i += 2) pool.deallocate(pieces[i]);
    pool.drain_pending(0);
    const bool ok = time_one_allocation(pool, size, &gpustitch::DeviceStats::stitches,
                                        "not served by a stitch", &row, &t);
    for (std::size_t i = 0; i < pieces.size(); i += 2) pool.deallocate(pieces[i]);
    if (!ok) return row;
  }
  row.pool_us = summarize(t).median;
  row.ok = row.note.empty();
  return row;
}

struct CallRow {
  std::string call, kind;
  Stat ns;
};
std::vector<CallRow> call_rows;

// Median and p99 of one call's cost: batches of 32 calls timed together.
Stat time_call(const std::function<void()>& call, int batches) {
  constexpr int kBatch = 32;
  for (int i = 0; i < 1000; ++i) call();
  std::vector<double> t;
  t.reserve(batches);
  for (int b = 0; b < batches; ++b) {
    const auto t0 = Clock::now();
    for (int i = 0; i < kBatch; ++i) call();
    t.push_back(ns_between(t0, Clock::now()) / kBatch);
  }
  return summarize(t);
}

template <typename Fn>
Fn driver_entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

void measure_calls(cudaStream_t stream, int batches) {
  using GetCurrent = CUresult (*)(CUcontext*);
  using GetDevice = CUresult (*)(CUdevice*);
  using IsCapturing = CUresult (*)(CUstream, CUstreamCaptureStatus*);
  using StreamDevice = CUresult (*)(CUstream, CUdevice*);
  using AddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  using PointerAttribute = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);
  auto get_current = driver_entry<GetCurrent>("cuCtxGetCurrent");
  auto get_device = driver_entry<GetDevice>("cuCtxGetDevice");
  auto is_capturing = driver_entry<IsCapturing>("cuStreamIsCapturing");
  auto stream_device = driver_entry<StreamDevice>("cuStreamGetDevice");
  auto address_range = driver_entry<AddressRange>("cuMemGetAddressRange");
  auto pointer_attribute = driver_entry<PointerAttribute>("cuPointerGetAttribute");
  void* managed = nullptr;
  CUDA_CHECK(cudaMallocManaged(&managed, 1 * MiB));
  const auto mp = reinterpret_cast<CUdeviceptr>(managed);
  auto s = reinterpret_cast<CUstream>(stream);
  auto add = [&](const char* call, const char* kind, bool ok, const std::function<void()>& f) {
    if (!ok) {
      std::fprintf(stderr, "  %s: no driver entry point\n", call);
      return;
    }
    call_rows.push_back({call, kind, time_call(f, batches)});
    std::fprintf(stderr, "  %-48s median %6.0f ns\n", call, call_rows.back().ns.median);
  };
  add("cuCtxGetCurrent", "driver call", get_current != nullptr, [&] {
    CUcontext c = nullptr;
    get_current(&c);
  });
  add("cuCtxGetDevice", "driver call (shim: cudaMalloc)", get_device != nullptr, [&] {
    CUdevice d = 0;
    get_device(&d);
  });
  add("cuStreamIsCapturing", "driver call (shim: *Async)", is_capturing != nullptr, [&] {
    CUstreamCaptureStatus st{};
    is_capturing(s, &st);
  });
  // The runtime's own entry cost: the same driver call reached through the runtime. With the
  // static runtime, every hooked allocation pays this before it reaches the shim's driver hook.
  add("cudaStreamIsCapturing (runtime, same driver call)", "runtime call", true, [&] {
    cudaStreamCaptureStatus st{};
    cudaStreamIsCapturing(stream, &st);
  });
  add("cuStreamGetDevice", "driver call (shim: *Async)", stream_device != nullptr, [&] {
    CUdevice d = 0;
    stream_device(s, &d);
  });
  bool range_ok = false;
  if (address_range != nullptr) {
    CUdeviceptr base = 0;
    size_t size = 0;
    range_ok = address_range(&base, &size, mp) == CUDA_SUCCESS && base == mp;
    if (!range_ok) std::printf("FAIL: cuMemGetAddressRange on managed memory\n");
  }
  add("cuMemGetAddressRange (managed memory)", "pass-through", range_ok, [&] {
    CUdeviceptr base = 0;
    size_t size = 0;
    address_range(&base, &size, mp);
  });
  add("cuPointerGetAttribute MEMORY_TYPE (managed)", "pass-through", pointer_attribute != nullptr,
      [&] {
        unsigned type = 0;
        pointer_attribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, mp);
      });
  CUDA_CHECK(cudaFree(managed));
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const char* json_path = nullptr;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc) {
      json_path = argv[++i];
    } else if (!std::strcmp(argv[i], "--quick")) {
      quick = true;
    } else {
      std::printf("usage: alloc_latency [--json PATH] [--quick]\n");
      return 2;
    }
  }
  const bool shim = dlsym(RTLD_DEFAULT, "gpustitch_malloc") != nullptr;
  CUDA_CHECK(cudaSetDevice(0));
  CUDA_CHECK(cudaFree(nullptr));  // create the context outside the timings
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);

  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaMemPool_t mempool;
  CUDA_CHECK(cudaDeviceGetDefaultMemPool(&mempool, 0));
  std::uint64_t threshold = UINT64_MAX;
  CUDA_CHECK(cudaMemPoolSetAttribute(mempool, cudaMemPoolAttrReleaseThreshold, &threshold));

  std::string why;
  auto backend = gpustitch::make_cuda_backend(&why);
  if (!backend) {
    std::printf("FAIL: CUDA backend: %s\n", why.c_str());
    return 1;
  }
  gpustitch::Pool pool(*backend, gpustitch::Config{});
  const auto stream_id = reinterpret_cast<gpustitch::Stream>(stream);

  const std::string via = shim ? " (through libgpustitch)" : "";
  std::vector<Allocator> allocators = {
      {"cudaMalloc/cudaFree" + via,
       [](std::size_t n) {
         void* p = nullptr;
         return cudaMalloc(&p, n) == cudaSuccess ? p : nullptr;
       },
       [](void* p) { cudaFree(p); }},
      {"cudaMallocAsync/cudaFreeAsync" + via,
       [&](std::size_t n) {
         void* p = nullptr;
         return cudaMallocAsync(&p, n, stream) == cudaSuccess ? p : nullptr;
       },
       [&](void* p) { cudaFreeAsync(p, stream); }},
      {"gpustitch::Pool, stream-ordered",
       [&](std::size_t n) {
         DevPtr p = 0;
         return pool.allocate(0, n, stream_id, &p) == gpustitch::Status::ok
                    ? reinterpret_cast<void*>(p)
                    : nullptr;
       },
       [&](void* p) { pool.deallocate(reinterpret_cast<DevPtr>(p), stream_id); }},
      {"gpustitch::Pool, cudaFree semantics",
       [&](std::size_t n) {
         DevPtr p = 0;
         return pool.allocate(0, n, gpustitch::kAnyStream, &p) == gpustitch::Status::ok
                    ? reinterpret_cast<void*>(p)
                    : nullptr;
       },
       [&](void* p) { pool.deallocate(reinterpret_cast<DevPtr>(p), gpustitch::kAnyStream); }},
  };

  struct SizeCase {
    std::string name;
    std::size_t size;  // 0 = random mix
    int ops;
  };
  const int scale = quick ? 10 : 1;
  const std::vector<SizeCase> cases = {
      {"512 B", 512, 10000 / scale},    {"64 KiB", 64 * KiB, 10000 / scale},
      {"2 MiB", 2 * MiB, 5000 / scale}, {"64 MiB", 64 * MiB, 1000 / scale},
      {"1 GiB", 1 * GiB, 100 / scale},  {"mix <= 4 MiB", 0, 10000 / scale},
  };
  std::uint64_t rng = 12345;
  auto next = [&rng] {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return rng >> 17;
  };
  std::fprintf(stderr, "alloc_latency: measuring\n");
  {
    std::vector<double> clock;
    for (int i = 0; i < 100000; ++i) {
      const auto t0 = Clock::now();
      clock.push_back(ns_between(t0, Clock::now()));
    }
    std::printf("clock: %.0f ns per timed operation (median; included in every per-call figure)\n",
                summarize(clock).median);
  }
  for (const SizeCase& c : cases) {
    std::vector<std::size_t> sizes(static_cast<std::size_t>(std::max(c.ops, 10)));
    for (auto& s : sizes) s = c.size != 0 ? c.size : 256 + next() % (4 * MiB - 255);
    for (const Allocator& a : allocators) {
      measure(a, c.name, sizes, std::max(c.ops / 10, 2));
      CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    pool.drain_pending(0);
    pool.trim(0);
  }

  measure_calls(stream, quick ? 500 : 5000);

  // Large allocations: fresh and stitched pool allocations against cudaMalloc.
  const int reps = quick ? 2 : 5;
  for (std::size_t size : {256 * MiB, 2 * GiB}) {
    const double native = cuda_malloc_us(size, reps);
    for (LargeRow row :
         {pool_fresh(*backend, size, reps, false), pool_fresh(*backend, size, reps, true),
          pool_stitched(*backend, size, 64 * MiB, reps),
          pool_stitched(*backend, size, 2 * MiB, reps)}) {
      row.cuda_malloc_us = native;
      large_rows.push_back(row);
    }
    LargeRow freed = pool_after_fresh(*backend, size, reps, AfterFresh::free_and_fence);
    freed.cuda_malloc_us = cuda_free_us(size, reps);
    large_rows.push_back(freed);
    LargeRow cut = pool_after_fresh(*backend, size, reps, AfterFresh::cut_five_eighths);
    cut.cuda_malloc_us = cuda_malloc_us(size / 8 * 5, reps);
    large_rows.push_back(cut);
  }

  std::printf("## alloc_latency: %s, driver %d, runtime %d (%s cudart), libgpustitch %s\n\n",
              prop.name, driver, runtime, GPUSTITCH_CUDART_LINKAGE,
              shim ? "LOADED (cudaMalloc rows go through the shim)" : "not loaded");
  std::printf(
      "| allocator | size | ops | alloc median | alloc p99 | free median | free p99 | "
      "pair median | pair p99 |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (const Row& r : rows) {
    std::printf("| %s | %s | %d | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f |\n", r.allocator.c_str(),
                r.size.c_str(), r.ops, r.alloc.median, r.alloc.p99, r.free.median, r.free.p99,
                r.pair.median, r.pair.p99);
  }
  std::printf(
      "\n(nanoseconds per operation)\n\n| single call | kind | median ns | p99 ns |\n| --- | --- | "
      "--- | --- |\n");
  for (const CallRow& r : call_rows) {
    std::printf("| %s | %s | %.0f | %.0f |\n", r.call.c_str(), r.kind.c_str(), r.ns.median,
                r.ns.p99);
  }
  std::printf(
      "\n(pass-through rows: compare with the same rows of a run without the shim; target <= +50 "
      "ns)\n\n| large allocation | size | pool (us) | cudaMalloc "
      "(us) | pool / cudaMalloc | note |\n| --- | --- | --- | --- | --- | --- |\n");
  for (const LargeRow& r : large_rows) {
    std::printf("| %s | %zu MiB | %.1f | %.1f | %.2f | %s |\n", r.what.c_str(), r.size / MiB,
                r.pool_us, r.cuda_malloc_us,
                r.cuda_malloc_us > 0 ? r.pool_us / r.cuda_malloc_us : 0,
                r.ok ? "" : r.note.c_str());
  }

  if (json_path != nullptr) {
    FILE* f = std::fopen(json_path, "w");
    if (f == nullptr) {
      std::printf("FAIL: cannot write %s\n", json_path);
      return 1;
    }
    std::fprintf(f,
                 "{\n  \"device\": \"%s\",\n  \"driver\": %d,\n  \"runtime\": %d,\n  \"cudart\": "
                 "\"%s\",\n  \"shim_loaded\": %s,\n  \"unit\": \"ns\",\n  \"rows\": [\n",
                 json_escape(prop.name).c_str(), driver, runtime, GPUSTITCH_CUDART_LINKAGE,
                 shim ? "true" : "false");
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      std::fprintf(f,
                   "    {\"allocator\": \"%s\", \"size\": \"%s\", \"ops\": %d, \"alloc_median\": "
                   "%.0f, \"alloc_p99\": %.0f, \"free_median\": %.0f, \"free_p99\": %.0f, "
                   "\"pair_median\": %.0f, \"pair_p99\": %.0f}%s\n",
                   json_escape(r.allocator).c_str(), r.size.c_str(), r.ops, r.alloc.median,
                   r.alloc.p99, r.free.median, r.free.p99, r.pair.median, r.pair.p99,
                   i + 1 < rows.size() ? "," : "");
    }
    std::fprintf(f, "  ],\n  \"calls\": [\n");
    for (std::size_t i = 0; i < call_rows.size(); ++i) {
      const CallRow& r = call_rows[i];
      std::fprintf(f,
                   "    {\"call\": \"%s\", \"kind\": \"%s\", \"median\": %.1f, \"p99\": "
                   "%.1f}%s\n",
                   json_escape(r.call).c_str(), json_escape(r.kind).c_str(), r.ns.median, r.ns.p99,
                   i + 1 < call_rows.size() ? "," : "");
    }
    std::fprintf(f, "  ],\n  \"large\": [\n");
    for (std::size_t i = 0; i < large_rows.size(); ++i) {
      const LargeRow& r = large_rows[i];
      std::fprintf(f,
                   "    {\"what\": \"%s\", \"size_bytes\": %zu, \"pool_us\": %.1f, "
                   "\"cuda_malloc_us\": %.1f, \"ok\": %s, \"note\": \"%s\"}%s\n",
                   json_escape(r.what).c_str(), r.size, r.pool_us, r.cuda_malloc_us,
                   r.ok ? "true" : "false", json_escape(r.note).c_str(),
                   i + 1 < large_rows.size() ? "," : "");
    }
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
  std::printf("\nPASS: alloc_latency\n");
  return 0;
}
