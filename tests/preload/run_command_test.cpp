// `gpustitch run`: the environment it gives the program, that it execs (exit status passes
// through), and end to end that the program really runs with the pool.
#include <gtest/gtest.h>

#include <string>

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
  EXPECT_EQ(env_value(r.out, "GPUSTITCH_CONF"), "backend:sim,log_level:info");
  EXPECT_EQ(env_value(r.out, "PYTORCH_NO_CUDA_MEMORY_CACHING"), "1");
  EXPECT_EQ(env_value(r.out, "XLA_PYTHON_CLIENT_ALLOCATOR"), "platform");
  EXPECT_EQ(env_value(r.out, "XLA_PYTHON_CLIENT_PREALLOCATE"), "false");
  EXPECT_EQ(env_value(r.out, "TF_GPU_ALLOCATOR"), "cuda_malloc_async");
  EXPECT_NE(r.err.find("PYTORCH_NO_CUDA_MEMORY_CACHING=1"), std::string::npos) << r.err;
}

TEST(RunCommand, KeepFrameworkCacheAndUserChoicesStand) {
  Result r =
      subprocess::run({GPUSTITCH_CLI, "run", "--keep-framework-cache", "--", "/usr/bin/env"}, {});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(env_value(r.out, "PYTORCH_NO_CUDA_MEMORY_CACHING"), "<unset>");
  EXPECT_EQ(env_value(r.out, "TF_GPU_ALLOCATOR"), "<unset>");
  EXPECT_EQ(env_value(r.out, "GPUSTITCH_CONF"), "<unset>");
  EXPECT_EQ(r.err, "");
  r = subprocess::run({GPUSTITCH_CLI, "run", "--", "/usr/bin/env"},
                      {"TF_GPU_ALLOCATOR=bfc", "LD_PRELOAD=" SHIM_PATH});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(env_value(r.out, "TF_GPU_ALLOCATOR"), "bfc");
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

}  // namespace
