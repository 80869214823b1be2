// Cost of trace recording on the allocating thread (one allocate + one free event), with the
// writer thread formatting and writing in the background, from 1 and 4 threads; the same pair
// into the in-memory ring of recent events (trace_events, on by default); and the cost of one
// memory snapshot of a pool.
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "gpustitch/pool.h"
#include "gpustitch/sim_backend.h"
#include "gpustitch/trace/recent_events.h"
#include "gpustitch/trace/snapshot.h"
#include "gpustitch/trace/trace_writer.h"

using namespace gpustitch;
using namespace gpustitch::trace;

namespace {

TraceWriter* g_writer = nullptr;

void RecordPair(benchmark::State& state) {
  if (state.thread_index() == 0) {
    TraceWriterOptions o;
    o.path = "/tmp/gpustitch_bench_trace_" + std::to_string(getpid()) + ".csv";
    o.handle_sigterm = false;
    g_writer = new TraceWriter(o);
  }
  DevPtr p = 0x7f0000000000 + (static_cast<DevPtr>(state.thread_index()) << 36);
  for (auto _ : state) {
    g_writer->on_allocate(0, p, 4096, kAnyStream, ServedBy::cache);
    g_writer->on_free(0, p, 4096, kAnyStream);
    p += 4096;
  }
  if (state.thread_index() == 0) {
    std::string path = g_writer->path();
    delete g_writer;
    unlink(path.c_str());
  }
}

RecentEvents* g_ring = nullptr;

// One allocate + one free event into the ring of recent events (its default 10,000 slots).
void RecentEventsPair(benchmark::State& state) {
  if (state.thread_index() == 0) g_ring = new RecentEvents(10000);
  DevPtr p = 0x7f0000000000 + (static_cast<DevPtr>(state.thread_index()) << 36);
  for (auto _ : state) {
    g_ring->on_allocate(0, p, 4096, kAnyStream, ServedBy::cache);
    g_ring->on_free(0, p, 4096, kAnyStream);
    p += 4096;
  }
  if (state.thread_index() == 0) {
    benchmark::DoNotOptimize(g_ring->read().size());
    delete g_ring;
  }
}

// What `gpustitch snapshot PID` costs the process, once per request, on the statistics thread:
// the pool's memory map with state.range(0) live blocks (small and large) and the PyTorch
// structure built from it. Nothing of it runs on the allocation path.
void SnapshotOfPool(benchmark::State& state) {
  SimBackend sim;
  Pool pool(sim, Config{});
  std::vector<DevPtr> live;
  for (std::int64_t i = 0; i < state.range(0); ++i) {
    DevPtr p = 0;
    if (pool.allocate(0, i % 10 == 0 ? 4 * MiB : 4096, kAnyStream, &p) == Status::ok) {
      live.push_back(p);
    }
  }
  for (auto _ : state) {
    std::vector<MappedSegment> segments;
    pool.memory_map(0, &segments);
    benchmark::DoNotOptimize(build_snapshot_from_segments(segments, 1));
  }
  for (DevPtr p : live) pool.deallocate(p);
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

}  // namespace

BENCHMARK(RecordPair)->Threads(1)->Threads(4)->UseRealTime();
BENCHMARK(RecentEventsPair)->Threads(1)->Threads(4)->UseRealTime();
BENCHMARK(SnapshotOfPool)->Arg(10000)->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();
