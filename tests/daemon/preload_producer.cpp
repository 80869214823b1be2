// A plain CUDA program for the statistics end-to-end and soak tests. It links the CUDA runtime (the
// test double in tests/preload/doubles) and knows nothing of gpustitch: the tests run it under
// LD_PRELOAD=libgpustitch.so with GPUSTITCH_CONF=backend:sim,..., so every figure the daemon and
// the CLI show comes from the shim's own pool and publisher, as in a real job.
//
//   preload_producer [--churn] [--oom] [DEVICE:KIB[:async|:free] ...]
//
// Each spec is one allocation of KIB KiB on DEVICE, through cudaMallocAsync on the default stream
// when ":async" is given, else cudaMalloc; the allocations stay live, except those marked ":free",
// which are freed at once (their memory stays cached in the pool: fragmentation). --oom then asks
// device 0 for 32 GiB (more than the simulated device holds), which must fail with
// cudaErrorMemoryAllocation. Prints "READY <pid>" and waits for a signal; with --churn it meanwhile
// keeps allocating and freeing 1 MiB on device 0 (bursts of 100, 1 ms apart), so a SIGKILL lands in
// the middle of record updates. SIGUSR1 makes it return from main (a normal exit: the shim removes
// its record); other signals keep their default action. Each SIGUSR2 asks device 0 for 32 GiB once
// more (an OOM that happens while a scraper watches). Exit status 1 (with a line on stderr) when a
// CUDA call does not answer as it should.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cuda_decls.h"

namespace {

constexpr int kCudaErrorMemoryAllocation = 2;

volatile sig_atomic_t g_stop = 0;
volatile sig_atomic_t g_oom_requests = 0;
void on_usr1(int) {
  g_stop = 1;
}
void on_usr2(int) {
  g_oom_requests = g_oom_requests + 1;
}

int fail(const char* what, const char* spec, int rc) {
  std::fprintf(stderr, "preload_producer: %s %s: error %d\n", what, spec, rc);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  struct sigaction sa {};
  sa.sa_handler = on_usr1;
  ::sigaction(SIGUSR1, &sa, nullptr);
  sa.sa_handler = on_usr2;
  ::sigaction(SIGUSR2, &sa, nullptr);
  // SIGUSR1/2 are delivered only inside sigsuspend (or between churn bursts): no lost wake-up.
  sigset_t usr1, waiting;
  sigemptyset(&usr1);
  sigaddset(&usr1, SIGUSR1);
  sigaddset(&usr1, SIGUSR2);
  ::sigprocmask(SIG_BLOCK, &usr1, &waiting);
  bool churn = false, oom = false;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (std::strcmp(a, "--churn") == 0) {
      churn = true;
      continue;
    }
    if (std::strcmp(a, "--oom") == 0) {
      oom = true;
      continue;
    }
    char* end = nullptr;
    long device = std::strtol(a, &end, 10);
    if (*end != ':') return fail("bad spec", a, -1);
    unsigned long long kib = std::strtoull(end + 1, &end, 10);
    bool async = std::strcmp(end, ":async") == 0;
    bool free_it = std::strcmp(end, ":free") == 0;
    if (!async && !free_it && *end != '\0') return fail("bad spec", a, -1);
    if (int rc = cudaSetDevice(static_cast<int>(device)); rc != 0)
      return fail("cudaSetDevice", a, rc);
    void* p = nullptr;
    std::size_t bytes = static_cast<std::size_t>(kib) << 10;
    int rc = async ? cudaMallocAsync(&p, bytes, nullptr) : cudaMalloc(&p, bytes);
    if (rc != 0 || p == nullptr) return fail("allocating", a, rc);
    if (free_it && (rc = cudaFree(p)) != 0) return fail("freeing", a, rc);
  }
  cudaSetDevice(0);
  auto ask_too_much = [] {
    void* p = nullptr;
    int rc = cudaMalloc(&p, std::size_t(32) << 30);
    return rc == kCudaErrorMemoryAllocation ? 0 : fail("32 GiB on a small device gave", "", rc);
  };
  if (oom && ask_too_much() != 0) return 1;
  std::printf("READY %d\n", static_cast<int>(::getpid()));
  std::fflush(stdout);
  while (!g_stop) {
    while (g_oom_requests > 0) {
      g_oom_requests = g_oom_requests - 1;
      if (ask_too_much() != 0) return 1;
    }
    if (!churn) {
      ::sigsuspend(&waiting);
      continue;
    }
    for (int i = 0; i < 100; ++i) {
      void* p = nullptr;
      if (cudaMalloc(&p, 1 << 20) == 0) cudaFree(p);
    }
    ::sigprocmask(SIG_SETMASK, &waiting, nullptr);
    ::usleep(1000);
    ::sigprocmask(SIG_BLOCK, &usr1, nullptr);
  }
  return 0;
}
