// A test producer: a Pool on the simulated backend with a StatsPublisher, as the preload library
// runs it, holding a known set of allocations. Prints "READY <pid>" once its record holds them.
//
//   stats_producer --prefix P [--devices N] [--blocks K] [--size-mib S] [--interval-ms I]
//                  [--churn] [--oom]
// Each device holds K live blocks of S MiB (bytes_requested = K*S MiB, live_blocks = K). With
// --churn the program keeps allocating and freeing one more block, so a SIGKILL lands in the
// middle of updates. With --oom it first asks for more than the device holds (32 GiB on a 16 GiB
// simulated device), so the pool reports one out-of-memory event. SIGTERM/SIGINT exit cleanly
// (the record is removed).
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gpustitch/pool.h"
#include "gpustitch/shm/publisher.h"
#include "gpustitch/sim_backend.h"

namespace {
volatile sig_atomic_t g_stop = 0;
void on_signal(int) {
  g_stop = 1;
}
}  // namespace

int main(int argc, char** argv) {
  std::string prefix = "gpustitch";
  int devices = 1, blocks = 2;
  unsigned size_mib = 4, interval_ms = 50;
  bool churn = false, oom = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char* { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--prefix")
      prefix = next();
    else if (a == "--devices")
      devices = std::atoi(next());
    else if (a == "--blocks")
      blocks = std::atoi(next());
    else if (a == "--size-mib")
      size_mib = static_cast<unsigned>(std::atoi(next()));
    else if (a == "--interval-ms")
      interval_ms = static_cast<unsigned>(std::atoi(next()));
    else if (a == "--churn")
      churn = true;
    else if (a == "--oom")
      oom = true;
    else {
      std::fprintf(stderr, "stats_producer: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);

  gpustitch::SimOptions sim;
  sim.devices = devices;
  sim.capacity = 16 * gpustitch::GiB;
  gpustitch::SimBackend backend(sim);
  gpustitch::Config config;
  config.publish = true;
  config.publish_interval_ms = interval_ms;
  config.sim_devices = devices;
  // The pool is constructed first and the publisher from it: the observer is attached through a
  // forwarding observer, as the preload library's fan-out does.
  struct Forward : gpustitch::PoolObserver {
    gpustitch::PoolObserver* target = nullptr;
    void on_event(const gpustitch::PoolEvent& e) noexcept override {
      if (target) target->on_event(e);
    }
  } forward;
  gpustitch::Pool pool(backend, config, &forward);
  gpustitch::shm::StatsPublisher publisher(pool, config, {prefix});
  if (!publisher.active()) {
    std::fprintf(stderr, "stats_producer: %s\n", publisher.error().c_str());
    return 1;
  }
  forward.target = &publisher;
  std::vector<std::pair<int, gpustitch::DevPtr>> live;
  for (int d = 0; d < devices; ++d)
    for (int b = 0; b < blocks; ++b) {
      gpustitch::DevPtr p = 0;
      auto st = pool.allocate(d, std::size_t(size_mib) * gpustitch::MiB, gpustitch::kAnyStream, &p);
      if (st != gpustitch::Status::ok) {
        std::fprintf(stderr, "stats_producer: allocate failed: %s\n", gpustitch::to_string(st));
        return 1;
      }
      live.emplace_back(d, p);
    }
  if (oom) {
    gpustitch::DevPtr p = 0;
    auto st = pool.allocate(0, 32 * gpustitch::GiB, gpustitch::kAnyStream, &p);
    if (st != gpustitch::Status::out_of_memory) {
      std::fprintf(stderr, "stats_producer: 32 GiB on 16 GiB gave %s\n", gpustitch::to_string(st));
      return 1;
    }
  }
  publisher.publish_now();
  std::printf("READY %d\n", static_cast<int>(::getpid()));
  std::fflush(stdout);
  while (!g_stop) {
    if (churn) {
      gpustitch::DevPtr p = 0;
      if (pool.allocate(0, 1 * gpustitch::MiB, gpustitch::kAnyStream, &p) == gpustitch::Status::ok)
        pool.deallocate(p);
    } else {
      ::pause();
    }
  }
  forward.target = nullptr;
  publisher.stop();
  for (auto& [d, p] : live) pool.deallocate(p);
  return 0;
}
