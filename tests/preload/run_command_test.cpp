// `gpustitch run`: the environment it gives the program, that it execs (exit status passes
// through), and end to end that the program really runs with the pool.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "subprocess.h"

namespace {

using subprocess::Result;

const std::string kLibPath = std::string("LD_LIBRARY_PATH=") + RUNTIME_DIR + ":" + DRIVER_DIR;

std::string env_value(const std::string& env_output, const std::string& name) {
  std::size_t at = env_output.find("\n" + name + "=");
  std::size_t start =
      at == std::string::npos ? (env_output.rfind(name + "=", 0) == 0 ? 0 : at) : at + 1;
  if (start == std::string::npos) return "<unset>";
  start += name.size() + 1;
  return env_output.substr(start, env_output.find('\n', start) - start);
}

TEST(RunCommand, SetsThePreloadTheConfigurationAndFrameworkSwitches) {
  Result r =
      subprocess::run({GPUSTITCH_CLI, "run", "--conf", "log_level:info", "--", "/usr/bin/env"},
                      {"LD_PRELOAD=/opt/other.so", "GPUSTITCH_CONF=backend:sim"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(env_value(r.out, "LD_PRELOAD"), std::string(SHIM_PATH) + ":/opt/other.so");
  EXPECT_EQ(env_value(r.out, "GPUSTITCH_CONF"), "summary:on,backend:sim,log_level:info");
  EXPECT_EQ(env_value(r.out, "PYTORCH_CUDA_ALLOC_CONF"), "backend:cudaMallocAsync");
  EXPECT_EQ(env_value(r.out, "PYTORCH_NO_CUDA_MEMORY_CACHING"), "<unset>");
  EXPECT_EQ(env_value(r.out, "XLA_PYTHON_CLIENT_ALLOCATOR"), "cuda_async");
  EXPECT_EQ(env_value(r.out, "XLA_PYTHON_CLIENT_PREALLOCATE"), "false");
  EXPECT_EQ(env_value(r.out, "TF_GPU_ALLOCATOR"), "cuda_malloc_async");
  EXPECT_NE(r.err.find("PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync"), std::string::npos)
      << r.err;
}

// PyTorch's allocator setting: the stream-ordered backend unless the user chose otherwise; a
// PYTORCH_CUDA_ALLOC_CONF without a backend key is kept and PyTorch's cache is turned off beside
// it.
TEST(RunCommand, PyTorchAllocatorChoiceNeverOverridesTheUser) {
  struct Case {
    std::vector<std::string> env;
    std::string conf, no_cache;
  };
  const Case cases[] = {
      {{}, "backend:cudaMallocAsync", "<unset>"},
      {{"PYTORCH_CUDA_ALLOC_CONF=backend:native"}, "backend:native", "<unset>"},
      {{"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,backend:cudaMallocAsync"},
       "expandable_segments:True,backend:cudaMallocAsync",
       "<unset>"},
      {{"PYTORCH_CUDA_ALLOC_CONF= backend = native"}, " backend = native", "<unset>"},
      {{"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"}, "expandable_segments:True", "1"},
      {{"PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128,roundup_power2_divisions:4"},
       "max_split_size_mb:128,roundup_power2_divisions:4",
       "1"},
      {{"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "PYTORCH_NO_CUDA_MEMORY_CACHING=0"},
       "expandable_segments:True",
       "0"},
      {{"PYTORCH_NO_CUDA_MEMORY_CACHING=1"}, "<unset>", "1"},
      {{"PYTORCH_NO_CUDA_MEMORY_CACHING=0"}, "<unset>", "0"},
  };
  for (const Case& c : cases) {
    Result r = subprocess::run({GPUSTITCH_CLI, "run", "--", "/usr/bin/env"}, c.env);
    ASSERT_EQ(r.status, 0) << r.err;
    const std::string what = c.env.empty() ? "(nothing set)" : c.env.front();
    EXPECT_EQ(env_value(r.out, "PYTORCH_CUDA_ALLOC_CONF"), c.conf) << what;
    EXPECT_EQ(env_value(r.out, "PYTORCH_NO_CUDA_MEMORY_CACHING"), c.no_cache) << what;
    EXPECT_EQ(env_value(r.out, "TF_GPU_ALLOCATOR"), "cuda_malloc_async") << what;
  }
}

// --dry-run shows the PyTorch setting without running anything, as text and as JSON.
TEST(RunCommand, DryRunShowsThePyTorchSetting) {
  Result r = subprocess::run({GPUSTITCH_CLI, "run", "--dry-run", "--", "python3", "train.py"}, {});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("\nPYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync\n"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("\npython3 train.py\n"), std::string::npos) << r.out;
  r = subprocess::run({GPUSTITCH_CLI, "run", "--json", "--dry-run", "--", "python3", "train.py"},
                      {"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"});
  ASSERT_EQ(r.status, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_FALSE(j["environment"].contains("PYTORCH_CUDA_ALLOC_CONF"));  // the user's, unchanged
  EXPECT_EQ(j["environment"]["PYTORCH_NO_CUDA_MEMORY_CACHING"], "1");
  EXPECT_EQ(j["environment"]["GPUSTITCH_CONF"], "summary:on");
}

TEST(RunCommand, KeepFrameworkCacheAndUserChoicesStand) {
  Result r =
      subprocess::run({GPUSTITCH_CLI, "run", "--keep-framework-cache", "--", "/usr/bin/env"}, {});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(env_value(r.out, "PYTORCH_NO_CUDA_MEMORY_CACHING"), "<unset>");
  EXPECT_EQ(env_value(r.out, "PYTORCH_CUDA_ALLOC_CONF"), "<unset>");
  EXPECT_EQ(env_value(r.out, "TF_GPU_ALLOCATOR"), "<unset>");
  EXPECT_EQ(env_value(r.out, "GPUSTITCH_CONF"), "summary:on");
  EXPECT_EQ(r.err, "");
  r = subprocess::run(
      {GPUSTITCH_CLI, "run", "--", "/usr/bin/env"},
      {"TF_GPU_ALLOCATOR=bfc", "LD_PRELOAD=" SHIM_PATH, "XLA_PYTHON_CLIENT_ALLOCATOR=platform"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(env_value(r.out, "TF_GPU_ALLOCATOR"), "bfc");
  // A JAX allocator the user chose stays (its VMM calls are then served where they can be);
  // preallocation is still turned off unless the user set it too.
  EXPECT_EQ(env_value(r.out, "XLA_PYTHON_CLIENT_ALLOCATOR"), "platform");
  EXPECT_EQ(env_value(r.out, "XLA_PYTHON_CLIENT_PREALLOCATE"), "false");
  EXPECT_EQ(env_value(r.out, "LD_PRELOAD"), SHIM_PATH);  // not preloaded twice
}

TEST(RunCommand, ExitStatusPassesThrough) {
  EXPECT_EQ(subprocess::run({GPUSTITCH_CLI, "run", "--", "/bin/sh", "-c", "exit 7"}, {}).status, 7);
  EXPECT_EQ(
      subprocess::run({GPUSTITCH_CLI, "run", "--", "/bin/sh", "-c", "kill -TERM $$"}, {}).status,
      128 + 15);  // exec'd: the signal reaches the program itself
  Result r = subprocess::run({GPUSTITCH_CLI, "run", "--", "no-such-program-here"}, {});
  EXPECT_EQ(r.status, 127);
  EXPECT_NE(r.err.find("no-such-program-here"), std::string::npos);
  EXPECT_EQ(subprocess::run({GPUSTITCH_CLI, "run"}, {}).status, 2);  // usage
}

TEST(RunCommand, TheProgramRunsWithThePool) {
  Result r = subprocess::run(
      {GPUSTITCH_CLI, "run", "--conf", "backend:sim,log_level:info", "--", PROBE_PATH, "alloc"},
      {kLibPath});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("active=1 malloc_rc=0 owned=1"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("gpustitch: summary device 0: allocs 2,"), std::string::npos) << r.err;
}

// The exit summary is on by default under run (at the default log level), off with summary:off
// or log_level:off, and absent when the library is preloaded by hand.
TEST(RunCommand, ExitSummaryIsPrintedByDefault) {
  Result r = subprocess::run(
      {GPUSTITCH_CLI, "run", "--conf", "backend:sim", "--", PROBE_PATH, "alloc"}, {kLibPath});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("gpustitch: summary device 0: allocs 2,"), std::string::npos) << r.err;
  for (const char* off : {"backend:sim,summary:off", "backend:sim,log_level:off"}) {
    r = subprocess::run({GPUSTITCH_CLI, "run", "--conf", off, "--", PROBE_PATH, "alloc"},
                        {kLibPath});
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(r.err.find("summary device"), std::string::npos) << off << ": " << r.err;
  }
  r = subprocess::run({PROBE_PATH, "alloc"},
                      {kLibPath, "LD_PRELOAD=" SHIM_PATH, "GPUSTITCH_CONF=backend:sim"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("active=1 malloc_rc=0 owned=1"), std::string::npos) << r.out;
  EXPECT_EQ(r.err.find("summary device"), std::string::npos) << r.err;
}

// `gpustitch snapshot PID` of a running program: the pickle holds its live blocks (exact address
// and size asked for) and the memory the pool keeps cached, as PyTorch's memory_viz reads it, and
// its allocations and frees so far as the timeline (device_traces), with the stacks of the
// sampled ones.
TEST(RunCommand, SnapshotOfARunningProgramShowsItsLiveAndCachedMemory) {
  char dir[] = "/tmp/gpustitch-snapshot-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string out = std::string(dir) + "/snap.pickle";
  const auto epoch_us = [] {
    return std::chrono::duration_cast<std::chrono::microseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  };
  const auto started_us = epoch_us();
  Result r = subprocess::run(
      {GPUSTITCH_CLI, "run", "--conf", "backend:sim,publish_interval_ms:20,sites_min_mb:2", "--",
       PROBE_PATH, "snapshot", GPUSTITCH_CLI, out},
      {kLibPath, std::string("XDG_RUNTIME_DIR=") + dir,
       "GPUSTITCH_SHM_PREFIX=snaptest" + std::to_string(getpid())});
  ASSERT_EQ(r.status, 0) << r.err;
  ASSERT_NE(r.out.find("alloc_rc=0"), std::string::npos) << r.out;
  ASSERT_NE(r.out.find("snapshot_rc=0"), std::string::npos) << r.out << r.err;
  Result check =
      subprocess::run({GPUSTITCH_PYTHON3, GPUSTITCH_SNAPSHOT_CHECK, "snapshot", out}, {});
  ASSERT_EQ(check.status, 0) << check.out << check.err;
  auto j = nlohmann::json::parse(check.out);
  EXPECT_EQ(j["blocks"], 2);                    // the live ones
  EXPECT_EQ(j["allocated"], (3 << 20) + 4096);  // large blocks are cut at 512 B
  EXPECT_GE(j["segments"].get<int>(), 2);  // the 3 MiB with the cached memory beside it, the chunk
  // The timeline: 3 MiB, 4 KiB and 8 MiB allocated, the 8 MiB freed; the two >= 2 MiB sampled.
  EXPECT_EQ(j["alloc_sizes"], nlohmann::json::array({3 << 20, 4096, 8 << 20})) << check.out;
  EXPECT_EQ(j["actions"]["free_requested"], 1) << check.out;
  EXPECT_EQ(j["actions"]["free_completed"], 1) << check.out;
  EXPECT_EQ(j["trace_frames"], 2) << check.out;
  ASSERT_EQ(j["time_us"].size(), 2u) << check.out;
  EXPECT_GE(j["time_us"][0].get<long long>(), started_us);  // microseconds since the epoch
  EXPECT_LE(j["time_us"][1].get<long long>(), epoch_us());
  std::filesystem::remove_all(dir);
}

}  // namespace
