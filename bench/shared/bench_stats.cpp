// Statistics costs: what publishing adds to an allocation, one gpustitchd sampling pass over
// 1,000 records, and `gpustitch ps` latency with 1,000 records (direct and through the daemon).
// Targets (issue 4): <= 20 ns per allocation, <= 20 ms CPU per pass, ps within 100 ms.
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "gpustitch/pool.h"
#include "gpustitch/shm/json.h"
#include "gpustitch/shm/publisher.h"
#include "gpustitch/shm/record_writer.h"
#include "gpustitch/sim_backend.h"
#include "process_table.h"

#include <spdlog/spdlog.h>

using namespace gpustitch;

namespace {

// Forwards to a target observer, as the preload library's fan-out does.
struct Forward final : PoolObserver {
  PoolObserver* target = nullptr;
  void on_allocate(int d, DevPtr p, std::size_t s, Stream st, ServedBy how) noexcept override {
    if (target) target->on_allocate(d, p, s, st, how);
  }
  void on_free(int d, DevPtr p, std::size_t s, Stream st) noexcept override {
    if (target) target->on_free(d, p, s, st);
  }
  void on_event(const PoolEvent& e) noexcept override {
    if (target) target->on_event(e);
  }
};

Config bench_config() {
  Config c;
  c.publish = true;
  c.publish_interval_ms = 100;
  return c;
}

// The observer call an allocation pays when the publisher is attached.
void BM_PublisherObserverCall(benchmark::State& state) {
  Config c = bench_config();
  shm::StatsPublisher pub(shm::StatsSource{[] { return 1; }, [](int) { return DeviceStats{}; }}, c,
                          {"gsbench" + std::to_string(::getpid())});
  PoolObserver* obs = &pub;
  benchmark::DoNotOptimize(obs);
  DevPtr p = 0x1000;
  for (auto _ : state) {
    obs->on_allocate(0, p, 512, kAnyStream, ServedBy::small);
    obs->on_free(0, p, 512, kAnyStream);
    benchmark::ClobberMemory();
  }
  state.SetLabel("on_allocate+on_free");
}
BENCHMARK(BM_PublisherObserverCall);

// Pool allocate+free of 512 B on the simulated backend, without (0) and with (1) a publisher
// attached through a fan-out. The difference is what publishing costs per allocation.
void BM_PoolAllocFree(benchmark::State& state) {
  SimOptions sim;
  sim.capacity = 4 * GiB;
  SimBackend backend(sim);
  Config c = bench_config();
  Forward forward;
  Pool pool(backend, c, &forward);
  std::unique_ptr<shm::StatsPublisher> pub;
  if (state.range(0)) {
    pub = std::make_unique<shm::StatsPublisher>(
        pool, c, shm::PublisherOptions{.prefix = "gsbench" + std::to_string(::getpid())});
    forward.target = pub.get();
  }
  for (auto _ : state) {
    DevPtr p = 0;
    pool.allocate(0, 512, 1, &p);
    pool.deallocate(p, 1);
  }
  forward.target = nullptr;
  state.SetLabel(state.range(0) ? "publisher attached" : "no observer");
}
BENCHMARK(BM_PoolAllocFree)->Arg(0)->Arg(1);

// 1,000 live processes of this user, each with a published record: forked children that create
// their record, publish once and wait.
struct Fleet {
  std::string prefix = "gsbenchfleet" + std::to_string(::getpid());
  std::vector<pid_t> children;
  explicit Fleet(int n) {
    for (int i = 0; i < n; ++i) {
      int fds[2];
      if (::pipe(fds) != 0) break;
      pid_t pid = ::fork();
      if (pid == 0) {
        std::string why;
        auto w = shm::RecordWriter::create(shm::RecordWriter::self_name(prefix), "/bin/bench",
                                           "bench child", 1000, &why);
        if (w) {
          shm::DeviceCounters d{};
          d.bytes_allocated = std::uint64_t(i) << 20;
          d.bytes_reserved = std::uint64_t(i) << 21;
          w->publish({&d, 1}, shm::realtime_ns());
        }
        char c = w ? 'y' : 'n';
        (void)!::write(fds[1], &c, 1);
        // Publish every second, as a real process does (keeps the heartbeat fresh).
        while (w) {
          ::sleep(1);
          shm::DeviceCounters d{};
          d.bytes_allocated = std::uint64_t(i) << 20;
          d.bytes_reserved = std::uint64_t(i) << 21;
          w->publish({&d, 1}, shm::realtime_ns());
        }
        ::_exit(0);
      }
      ::close(fds[1]);
      char c;
      (void)!::read(fds[0], &c, 1);
      ::close(fds[0]);
      children.push_back(pid);
    }
  }
  ~Fleet() {
    for (pid_t p : children) ::kill(p, SIGKILL);
    for (pid_t p : children) ::waitpid(p, nullptr, 0);
    for (const auto& n : shm::discover_records(prefix)) ::unlink(n.path().c_str());
  }
};

Fleet& fleet() {
  static Fleet f(1000);
  return f;
}

// One gpustitchd sampling pass over 1,000 records (steady state: all already tracked).
void BM_DaemonSamplingPass(benchmark::State& state) {
  daemon::DaemonConfig c;
  c.record_prefix = fleet().prefix;
  daemon::ProcessTable table(c);
  table.sample();  // discovery
  double cpu_ms = 0;
  std::size_t tracked = 0;
  for (auto _ : state) {
    auto s = table.sample();
    cpu_ms += double(s.cpu_ns) / 1e6;
    tracked = s.tracked;
  }
  state.counters["records"] = static_cast<double>(tracked);
  state.counters["cpu_ms_per_pass"] = cpu_ms / static_cast<double>(state.iterations());
}
BENCHMARK(BM_DaemonSamplingPass)->Unit(benchmark::kMillisecond)->UseRealTime();

// CPU time (user + system) used by waited-for children so far, in ms.
double children_cpu_ms() {
  rusage ru{};
  ::getrusage(RUSAGE_CHILDREN, &ru);
  return double(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e3 +
         double(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e3;
}

// `gpustitch ps` with 1,000 records, as a user runs it (a new process each time). Wall time
// depends on the machine's load; child_cpu_ms is the CLI's own CPU time per run.
int run_cli(const std::vector<std::string>& args) {
  pid_t pid = ::fork();
  if (pid == 0) {
    std::freopen("/dev/null", "w", stdout);
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  int st = 0;
  ::waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

void BM_CliPsDirect(benchmark::State& state) {
  const std::string prefix = fleet().prefix;
  double cpu0 = children_cpu_ms();
  for (auto _ : state) {
    int rc = run_cli({GPUSTITCH_CLI, "ps", "--direct", "--prefix", prefix});
    if (rc != 0) state.SkipWithError("gpustitch ps failed");
  }
  state.counters["child_cpu_ms"] = (children_cpu_ms() - cpu0) / double(state.iterations());
}
BENCHMARK(BM_CliPsDirect)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(10);

void BM_CliPsDaemon(benchmark::State& state) {
  const std::string prefix = fleet().prefix;
  std::string sock = "/tmp/gsbench-" + std::to_string(::getpid()) + ".sock";
  pid_t d = ::fork();
  if (d == 0) {
    std::freopen("/dev/null", "w", stderr);
    ::execl(GPUSTITCHD, GPUSTITCHD, "--config", "/nonexistent", "--socket", sock.c_str(), "--set",
            ("record_prefix=" + prefix).c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  for (int i = 0; i < 100; ++i) {
    auto a = shm::query_daemon(sock, {{"cmd", "status"}}, 1000, nullptr);
    if (a && (*a)["tracked"].get<int>() >= 1000) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  double cpu0 = children_cpu_ms();
  for (auto _ : state) {
    int rc = run_cli({GPUSTITCH_CLI, "ps", "--socket", sock});
    if (rc != 0) state.SkipWithError("gpustitch ps failed");
  }
  state.counters["child_cpu_ms"] = (children_cpu_ms() - cpu0) / double(state.iterations());
  ::kill(d, SIGTERM);
  ::waitpid(d, nullptr, 0);
}
BENCHMARK(BM_CliPsDaemon)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(10);

}  // namespace

int main(int argc, char** argv) {
  spdlog::set_level(spdlog::level::warn);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
