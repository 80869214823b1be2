// The memory targets on the recorded traces (tests/data/traces), replayed as the README's table
// does (--whole-handles, 140 GiB; and again at each trace's PyTorch-model minimum), in both free
// orders: cudaFree semantics as recorded, and every event on one stream, as `gpustitch run`'s
// PyTorch path frees (cudaFreeAsync). What a user relies on: gpustitch holds the least physical
// memory of every policy, at most 1.03x of the program's peak demand, and never fails an
// allocation that fits. The defaults meet the target on every row since the memory-first phase
// (memory_first_mb: the memory-first layout until the heap first holds 8 GiB). The same checks
// run with the memory-first layout throughout (size_ranges:on,handle_share:1024,gap_handles:0),
// and with the layout the defaults keep after the phase, from the start (memory_first_mb:0),
// where two traces miss the target (hf_llama_generate, 1.052x and 1.055x: granules that the KV
// cache's many 1-8 MiB blocks share; transformer_bucketed, 1.031x, 1.040x in stream order and
// 1.067x at its smallest device in stream order: handles its 128 MiB blocks pin). Those are held
// to a ceiling just above that figure, so that they cannot get worse unnoticed. Each trace
// thread's calls are made on a thread of their own (tools/replay/trace_threads.h), as the
// program made them, so the pool serves them from as many arenas.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <ostream>
#include <string>

#include "gpustitch/trace/trace_reader.h"
#include "policy.h"
#include "replay_test_util.h"
#include "replayer.h"

namespace gpustitch::replay {
namespace {

constexpr double kTarget = 1.03;

struct TraceCase {
  const char* name;
  const char* conf;             // GPUSTITCH_CONF for the gpustitch policies ("": the defaults)
  double ceiling;               // cudaFree order, 140 GiB
  double stream_order_ceiling;  // one stream, 140 GiB
  double small_device_ceiling;  // both orders, PyTorch's smallest device
};

void PrintTo(const TraceCase& c, std::ostream* os) {
  *os << c.name << " " << c.conf;
}

// The policies a user could pick instead, and gpustitch without stitching.
constexpr const char* kOthers[] = {"pytorch", "expandable-segments", "gpustitch-no-stitch"};

trace::Trace load(const std::string& name) {
  trace::Trace t;
  std::string why;
  EXPECT_TRUE(trace::read_trace_file(std::string(GPUSTITCH_TRACES) + "/" + name + ".csv", &t, &why))
      << why;
  EXPECT_EQ(t.bad_lines, 0u) << name;
  return t;
}

// The same events on one stream: frees are stream-ordered (cudaFreeAsync), as PyTorch's
// cudaMallocAsync backend makes them under `gpustitch run`.
trace::Trace on_one_stream(trace::Trace t) {
  for (trace::TraceEvent& e : t.events) e.stream = 0x10;
  return t;
}

ReplayResult replay(const std::string& policy, const trace::Trace& t, std::uint64_t capacity,
                    const std::string& conf) {
  PolicyEnv env;
  env.pool_conf = conf;
  env.devices = t.device_count();
  env.capacity = capacity;
  env.map_offset = false;  // --whole-handles: the H200's driver (580) maps handles whole
  const PolicySpec* spec = find_policy(policy);
  EXPECT_NE(spec, nullptr) << policy;
  std::string why;
  auto p = spec->make(env, &why);
  EXPECT_NE(p, nullptr) << why;
  return replay_trace(t, *p);
}

double ratio(const ReplayResult& r) {
  return static_cast<double>(r.peak_reserved) / static_cast<double>(r.peak_allocated);
}

// gpustitch has no OOM, holds the least of all policies that have none, and at most `ceiling`
// of the peak demand. Returns its ratio.
double check(const std::string& label, const trace::Trace& t, std::uint64_t capacity,
             double ceiling, const std::string& conf) {
  const ReplayResult ours = replay("gpustitch", t, capacity, conf);
  EXPECT_EQ(ours.ooms, 0u) << label << ": an allocation failed that fits";
  EXPECT_GT(ours.peak_allocated, 0u) << label;
  for (const char* other : kOthers) {
    const ReplayResult r = replay(other, t, capacity, conf);
    EXPECT_EQ(r.peak_allocated, ours.peak_allocated) << label << ", " << other;
    if (r.ooms != 0) continue;  // it could not run the trace at all on this device
    EXPECT_LE(ours.peak_reserved, r.peak_reserved)
        << label << ": gpustitch holds more than " << other;
  }
  const double x = ratio(ours);
  EXPECT_LE(x, ceiling) << label << ": peak reserved / peak demand";
  std::printf("%-44s %.4f (ceiling %.3f)\n", label.c_str(), x, ceiling);
  return x;
}

class TraceTargets : public testing::TestWithParam<TraceCase> {};

TEST_P(TraceTargets, GpustitchHoldsTheLeastAndAtMostItsCeilingOfDemand) {
  const TraceCase& c = GetParam();
  const trace::Trace recorded = load(c.name);
  const trace::Trace streamed = on_one_stream(recorded);
  const std::string conf = c.conf;
  const std::string name = std::string(c.name) + (conf.empty() ? "" : " (" + conf + ")");
  check(name + ", 140 GiB", recorded, 140 * GiB, c.ceiling, conf);
  check(name + ", stream order, 140 GiB", streamed, 140 * GiB, c.stream_order_ceiling, conf);
  // On the smallest device PyTorch's default allocator (the model) runs the trace on, plus the
  // bisection's step: gpustitch must run it too, holding the least.
  const std::uint64_t step = 64 * MiB;
  PolicyEnv whole_handles;
  whole_handles.map_offset = false;
  const std::uint64_t torch_min =
      min_capacity(recorded, *find_policy("pytorch"), whole_handles, 140 * GiB, step);
  ASSERT_GT(torch_min, 0u);
  check(name + ", PyTorch's smallest device", recorded, torch_min + step, c.small_device_ceiling,
        conf);
  check(name + ", stream order, PyTorch's smallest device", streamed, torch_min + step,
        c.small_device_ceiling, conf);
}

std::string case_name(const testing::TestParamInfo<TraceCase>& i) {
  return i.param.name;
}

// The defaults: the target on every row.
INSTANTIATE_TEST_SUITE_P(
    Recorded, TraceTargets,
    testing::Values(TraceCase{"gpt_seqlen_b5", "", kTarget, kTarget, kTarget},
                    TraceCase{"hf_llama_train", "", kTarget, kTarget, kTarget},
                    TraceCase{"hf_llama_generate", "", kTarget, kTarget, kTarget},
                    TraceCase{"transformer_bucketed", "", kTarget, kTarget, kTarget},
                    TraceCase{"transformer_dynseq", "", kTarget, kTarget, kTarget},
                    TraceCase{"transformer_dynseq_long", "", kTarget, kTarget, kTarget}),
    case_name);

// The layout after the memory-first phase, from the start. Ceilings: the target where it is met,
// that layout's figure rounded up where it is not.
constexpr const char* kWithoutPhase = "memory_first_mb:0";
INSTANTIATE_TEST_SUITE_P(
    WithoutMemoryFirstPhase, TraceTargets,
    testing::Values(TraceCase{"gpt_seqlen_b5", kWithoutPhase, kTarget, kTarget, kTarget},
                    TraceCase{"hf_llama_train", kWithoutPhase, kTarget, kTarget, kTarget},
                    TraceCase{"hf_llama_generate", kWithoutPhase, 1.055, 1.058, 1.055},
                    TraceCase{"transformer_bucketed", kWithoutPhase, 1.031, 1.052, 1.068},
                    TraceCase{"transformer_dynseq", kWithoutPhase, kTarget, kTarget, kTarget},
                    TraceCase{"transformer_dynseq_long", kWithoutPhase, kTarget, kTarget, kTarget}),
    case_name);

// The memory-first layout (README, "Configuration"; large_heap.cpp, "Size ranges"): the target on
// every row.
constexpr const char* kMemoryFirst = "size_ranges:on,handle_share:1024,gap_handles:0";
INSTANTIATE_TEST_SUITE_P(
    MemoryFirst, TraceTargets,
    testing::Values(TraceCase{"gpt_seqlen_b5", kMemoryFirst, kTarget, kTarget, kTarget},
                    TraceCase{"hf_llama_train", kMemoryFirst, kTarget, kTarget, kTarget},
                    TraceCase{"hf_llama_generate", kMemoryFirst, kTarget, kTarget, kTarget},
                    TraceCase{"transformer_bucketed", kMemoryFirst, kTarget, kTarget, kTarget},
                    TraceCase{"transformer_dynseq", kMemoryFirst, kTarget, kTarget, kTarget},
                    TraceCase{"transformer_dynseq_long", kMemoryFirst, kTarget, kTarget, kTarget}),
    case_name);

// A stream's cuts out of its own freed memory must not wait for the GPU: inside a large handle
// such a cut fences before splitting it (stream_cut_fence), and on the H100 those fences were
// 64-68 waits per GPT training run (310-402 ms). Below stream_fresh_coarse_mb a stream's fresh
// memory is ordinary handles, so on the recorded traces in stream order the defaults make no
// such fence: as many fences as with the rule off, and the same peak. Replay's device is idle,
// so the fences cost nothing here; their number is what tells (stream_fresh_coarse_mb:0 makes
// 141 instead of 66 on gpt_seqlen_b5).
TEST(StreamOrder, TheDefaultsStreamCutsMakeNoFences) {
  for (const char* name :
       {"gpt_seqlen_b5", "hf_llama_train", "hf_llama_generate", "transformer_bucketed",
        "transformer_dynseq", "transformer_dynseq_long"}) {
    const trace::Trace streamed = on_one_stream(load(name));
    const ReplayResult defaults = replay("gpustitch", streamed, 140 * GiB, "");
    const ReplayResult no_cut_fences =
        replay("gpustitch", streamed, 140 * GiB, "stream_cut_fence:off");
    auto fences = [](const ReplayResult& r) { return test::counter(r.counters, "fences"); };
    EXPECT_GT(fences(defaults), 0u) << name;
    EXPECT_EQ(fences(defaults), fences(no_cut_fences)) << name << ": a stream's cut fenced";
    EXPECT_EQ(defaults.peak_reserved, no_cut_fences.peak_reserved) << name;
  }
}

}  // namespace
}  // namespace gpustitch::replay
