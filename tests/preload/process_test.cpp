// Process-level behaviour of libgpustitch.so: what a user sees on stderr and how the program runs
// when there is no driver, when the configuration says so, and at exit. Each test runs the probe
// program (probe.cpp) under LD_PRELOAD with its own environment.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "subprocess.h"

namespace {

using subprocess::count_lines;
using subprocess::Result;

Result run_probe(std::vector<std::string> env) {
  return subprocess::run({PROBE_PATH, "alloc"}, env);
}

const std::string kPreload = std::string("LD_PRELOAD=") + PRELOAD;
const std::string kBothLibs = std::string("LD_LIBRARY_PATH=") + RUNTIME_DIR + ":" + DRIVER_DIR;
const std::string kRuntimeOnly = std::string("LD_LIBRARY_PATH=") + RUNTIME_DIR;

TEST(Process, NoDriverRunsNativelyWithOneWarningLine) {
  Result r = run_probe({kPreload, kRuntimeOnly});
  ASSERT_EQ(r.status, 0) << r.err;
  // The runtime's own answer without a driver (cudaErrorInsufficientDriver), untouched.
  EXPECT_NE(r.out.find("active=0 malloc_rc=35 owned=0"), std::string::npos) << r.out;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_EQ(r.err.rfind("gpustitch: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find("libcuda.so.1 not found"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("natively"), std::string::npos) << r.err;
}

TEST(Process, DriverWithoutVirtualMemoryRunsNatively) {
  // A driver without cuMemCreate & co: the CUDA backend cannot start.
  Result r =
      run_probe({kPreload, std::string("LD_LIBRARY_PATH=") + RUNTIME_DIR + ":" + NOVMM_DRIVER_DIR,
                 "GPUSTITCH_CONF=backend:auto"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("active=0 malloc_rc=0 owned=0"), std::string::npos) << r.out;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
}

TEST(Process, SummaryAtExitWithLogLevelInfo) {
  Result r = run_probe({kPreload, kBothLibs, "GPUSTITCH_CONF=backend:sim,log_level:info"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("active=1 malloc_rc=0 owned=1"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("gpustitch: summary device 0: allocs 2,"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("OOMs 0"), std::string::npos) << r.err;
  // What the peak was made of: the probe's allocations, nothing waiting for the device.
  EXPECT_NE(r.err.find("allocated, 0 B waiting for the device)"), std::string::npos) << r.err;
}

TEST(Process, QuietByDefault) {
  Result r = run_probe({kPreload, kBothLibs, "GPUSTITCH_CONF=backend:sim"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("active=1"), std::string::npos) << r.out;
  // Only the one note of the first CUDA IPC export (importers need gpustitch too) is logged.
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("importing processes must run under gpustitch"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("active=1 malloc_rc=0 owned=1 ipc_rc=0"), std::string::npos) << r.out;
}

TEST(Process, BadConfigurationEntriesAreReportedOnceAndTheRestApplies) {
  Result r = run_probe({kPreload, kBothLibs, "GPUSTITCH_CONF=backend:sim,no_such_key:1"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("active=1"), std::string::npos) << r.out;
  std::size_t first = r.err.find("no_such_key");
  ASSERT_NE(first, std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("no_such_key", first + 1), std::string::npos) << r.err;
  // The variable is named once per line, not "GPUSTITCH_CONF: GPUSTITCH_CONF:".
  EXPECT_EQ(r.err.find("GPUSTITCH_CONF: GPUSTITCH_CONF"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("GPUSTITCH_CONF: unknown key 'no_such_key'"), std::string::npos) << r.err;
}

// An invalid GPUSTITCH_SHM_PREFIX used to fall back to the production prefix, putting a process
// meant to stay apart (a test, a private daemon's) into the node daemon's view. It now turns
// publishing off, with one line saying so.
TEST(Process, AnInvalidRecordPrefixTurnsPublishingOffInsteadOfFallingBack) {
  Result r = run_probe(
      {kPreload, kBothLibs, "GPUSTITCH_CONF=backend:sim", "GPUSTITCH_SHM_PREFIX=../not/a/prefix"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("active=1"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("GPUSTITCH_SHM_PREFIX"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("statistics not published"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("using 'gpustitch'"), std::string::npos) << r.err;
}

// trace: naming a FIFO nobody reads used to hang the program in its first CUDA call (the trace
// file's open() waited for a reader under the library's init lock). The program now runs, with
// one line saying why it is not traced.
TEST(Process, TraceToAFifoWithoutAReaderDoesNotHangTheProgram) {
  std::string fifo = testing::TempDir() + "gpustitch_fifo_" + std::to_string(getpid());
  unlink(fifo.c_str());
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  Result r = subprocess::run({PROBE_PATH, "alloc"},
                             {kPreload, kBothLibs, "GPUSTITCH_CONF=backend:sim,trace:" + fifo},
                             /*timeout_s=*/20);
  unlink(fifo.c_str());
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("active=1"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("trace file " + fifo), std::string::npos) << r.err;
}

TEST(Process, DisabledPassesEverythingThrough) {
  Result r = run_probe({kPreload, kBothLibs, "GPUSTITCH_CONF=backend:sim,enable:off"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("active=0 malloc_rc=0 owned=0 ipc_rc=0 async_rc=0 async_owned=0"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.err, "");
}

TEST(Process, IpcNativeKeepsCudaMallocNativeAndServesItOnce) {
  Result r =
      run_probe({kPreload, kBothLibs, "GPUSTITCH_CONF=backend:sim,ipc:native,log_level:info"});
  ASSERT_EQ(r.status, 0) << r.err;
  // cudaMalloc went to the real runtime and the real driver exactly once (the driver hook saw it
  // under the passthrough guard); cudaIpcGetMemHandle works on it; stream-ordered memory is pooled.
  EXPECT_NE(r.out.find("active=1 malloc_rc=0 owned=0 ipc_rc=0 async_rc=0 async_owned=1 "
                       "driver_allocs=1 pool_allocs=1"),
            std::string::npos)
      << r.out;
  // The summary counts the passed-through cudaMalloc once (not again at the driver level).
  EXPECT_NE(r.err.find("summary device 0: allocs 1, cache hits"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("passed through 1 "), std::string::npos) << r.err;
  EXPECT_EQ(subprocess::count_lines(r.err), 1) << r.err;  // one summary line per device
}

// Pool memory (stream-ordered) under ipc:native cannot be exported: cudaErrorNotSupported and
// CUDA_ERROR_NOT_SUPPORTED (both 801), and one error line per API however often it is asked.
TEST(Process, IpcNativeRefusesToExportPoolMemoryAndSaysSoOncePerApi) {
  Result r = subprocess::run({PROBE_PATH, "ipc_native"},
                             {kPreload, kBothLibs, "GPUSTITCH_CONF=backend:sim,ipc:native"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("ipc_native owned=1 runtime_rc=801,801 driver_rc=801,801"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.err.find("cudaIpcGetMemHandle on pool memory with ipc:native"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("cuIpcGetMemHandle on pool memory with ipc:native"), std::string::npos)
      << r.err;
  EXPECT_EQ(count_lines(r.err), 2) << r.err;
}

TEST(Process, PluggableAllocatorWithoutPreload) {
  Result r = subprocess::run({PROBE_PATH, "pluggable", SHIM_PATH},
                             {kBothLibs, "GPUSTITCH_CONF=backend:sim"});
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("pluggable active=1 ok=1 owned_after_free=0"), std::string::npos) << r.out;
  EXPECT_EQ(r.err, "");
}

}  // namespace

// The out-of-memory line says which kind of failure it was: a request larger than device free and
// pool cached together is a real shortage; one that fits in them, but only in pieces the pool
// can neither release nor stitch (small-object chunks pinned by one live block each), would have
// fit. Both name this process as the holder.
TEST(Process, OutOfMemoryLineGivesAVerdict) {
  const std::string conf = "GPUSTITCH_CONF=backend:sim,sim_capacity_mb:512,coop:off";
  Result r = subprocess::run({PROBE_PATH, "oom", "600", "0"}, {kPreload, kBothLibs, conf});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("oom_rc=2"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("gpustitch: out of memory on device 0: requested 600.00 MiB"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("verdict: real shortage, 88.00 MiB more than device free + pool cached "
                       "(512.00 MiB) together"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("holding most on this GPU: pid "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("(this process)"), std::string::npos) << r.err;

  r = subprocess::run({PROBE_PATH, "oom", "200", "400"}, {kPreload, kBothLibs, conf});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("oom_rc=2"), std::string::npos) << r.out << r.err;
  EXPECT_NE(r.err.find("verdict: would have fit, device free + pool cached is "), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("but no 200.00 MiB range could be put together"), std::string::npos)
      << r.err;
}
