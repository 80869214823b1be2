// On the GPU (ctest label "gpu"): the synthetic transformer trace replayed through the gpustitch
// pool over the CUDA backend and through native cuMemAlloc / cuMemAllocAsync, under a capacity a
// little above the live peak. Prints one PASS/FAIL line per policy with its figures.
#include <gtest/gtest.h>

#include <cstdio>

#include "generator.h"
#include "policy.h"
#include "replayer.h"

using namespace gpustitch;
using namespace gpustitch::replay;

TEST(ReplayGpu, TransformerTraceOnTheDevice) {
  TransformerTraceParams params;
  params.steps = 40;
  trace::Trace t = generate_transformer_trace(params);
  PolicyEnv env;
  env.gpu = true;
  env.capacity = 80 * GiB;
  std::string why;
  auto probe = find_policy("gpustitch")->make(env, &why);
  ASSERT_NE(probe, nullptr) << "no usable GPU: " << why;
  const std::uint64_t live_peak = replay_trace(t, *probe).peak_allocated;
  probe.reset();
  env.capacity = align_up(live_peak + live_peak / 25, 64 * MiB);
  std::printf("trace: %zu events, live peak %.2f GiB, capacity %.2f GiB\n", t.events.size(),
              static_cast<double>(live_peak) / GiB, static_cast<double>(env.capacity) / GiB);
  for (const char* name :
       {"gpustitch", "gpustitch-no-stitch", "cuda-malloc", "cuda-malloc-async", "pytorch"}) {
    auto policy = find_policy(name)->make(env, &why);
    ASSERT_NE(policy, nullptr) << name << ": " << why;
    ReplayResult r = replay_trace(t, *policy);
    bool pass = r.peak_allocated <= live_peak && r.unmatched_frees == 0;
    if (std::string(name) == "gpustitch" || std::string(name) == "cuda-malloc")
      pass = pass && r.ooms == 0;
    std::printf(
        "%s %-20s peak reserved %.2f GiB, OOMs %llu, frag@peak %.1f%%, %.0f ns/alloc, "
        "%.0f ns/free\n",
        pass ? "PASS" : "FAIL", name, static_cast<double>(r.peak_reserved) / GiB,
        static_cast<unsigned long long>(r.ooms), r.frag_at_peak * 100, r.ns_per_alloc,
        r.ns_per_free);
    EXPECT_TRUE(pass) << name;
  }
}
