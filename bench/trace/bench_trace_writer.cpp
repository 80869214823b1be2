// Cost of trace recording on the allocating thread (one allocate + one free event), with the
// writer thread formatting and writing in the background, from 1 and 4 threads.
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <string>

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

// The live-block table kept for `gpustitch snapshot PID` (an allocate + free pair), with
// `state.range(0)` other blocks live.
void LiveTablePair(benchmark::State& state) {
  static LiveBlockTable* table = nullptr;
  if (state.thread_index() == 0) {
    table = new LiveBlockTable();
    for (std::int64_t i = 0; i < state.range(0); ++i)
      table->on_allocate(0, 0x7e0000000000 + static_cast<DevPtr>(i) * 4096, 4096, kAnyStream,
                         ServedBy::cache);
  }
  DevPtr p = 0x7f0000000000 + (static_cast<DevPtr>(state.thread_index()) << 36);
  for (auto _ : state) {
    table->on_allocate(0, p, 4096, kAnyStream, ServedBy::cache);
    table->on_free(0, p, 4096, kAnyStream);
    p += 4096;
  }
  if (state.thread_index() == 0) {
    delete table;
    table = nullptr;
  }
}

}  // namespace

BENCHMARK(RecordPair)->Threads(1)->Threads(4)->UseRealTime();
BENCHMARK(LiveTablePair)->Arg(10000)->Threads(1)->Threads(4)->UseRealTime();
BENCHMARK_MAIN();
