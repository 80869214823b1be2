// Daemon soak (issue 8): for GPUSTITCH_SOAK_SECONDS (default 180), CUDA programs under
// LD_PRELOAD=libgpustitch.so (preload_producer.cpp on the simulated backend) start and die
// continuously against one running gpustitchd sampling every 100 ms: about 16 live at a time, each
// living 50 ms to 3 s, a quarter of them allocating in a loop when they die; 60% die by SIGKILL,
// 20% by SIGTERM, 20% exit normally (SIGUSR1). Asserts:
//   * memory stays flat: the daemon's RSS (from /proc/<pid>/smaps_rollup, sampled every second)
//     in the last window is at most 5% + 256 KiB above the first window after warm-up (windows
//     of a third of the run, at most 60 s each; warm-up is the first of those thirds);
//   * no stale records: every dead producer's record is gone from /dev/shm within 5 s, and none
//     is left at the end (the socket lists no process either);
//   * no missed processes: every producer during whose life (READY to death) at least two
//     sampling passes ended, so that one whole pass saw it running, appears in the daemon's log as
//     "tracking pid N". Passes are counted by the daemon (status "passes"), not assumed from the
//     interval: on a loaded machine a pass can start well after its nominal time.
// Prints the figures at the end (processes started and how they died, RSS/PSS, reap latency).
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <sstream>

#include <gtest/gtest.h>

#include "gpustitch/shm/json.h"
#include "process_helpers.h"
#include "test_helpers.h"

using namespace gpustitch;
using namespace std::chrono_literals;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kSampleIntervalMs = 100;
constexpr int kPopulation = 16;
constexpr auto kReapBound = 5s;  // 50 sampling intervals: the bound holds on a loaded CI machine

double seconds_since(Clock::time_point t0, Clock::time_point t = Clock::now()) {
  return std::chrono::duration<double>(t - t0).count();
}

// Rss and Pss of a process in KiB (smaps_rollup), {0, 0} when it cannot be read.
std::pair<std::uint64_t, std::uint64_t> rss_pss_kib(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/smaps_rollup");
  std::string key;
  std::uint64_t value = 0, rss = 0, pss = 0;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    if (!(ls >> key >> value)) continue;
    if (key == "Rss:") rss = value;
    if (key == "Pss:") pss = value;
  }
  return {rss, pss};
}

struct MemorySample {
  double t;  // seconds since the start
  std::uint64_t rss_kib, pss_kib;
};

struct Producer {
  test::Child child;
  shm::RecordName record;
  Clock::time_point ready, deadline;
  std::uint64_t passes_at_ready = 0;
  bool churn = false;
};

struct Death {
  pid_t pid;
  std::string record_path;
  Clock::time_point when;
  double lived_s;
  std::uint64_t passes_lived;  // sampling passes that ended while it ran
};

std::uint64_t max_rss(const std::vector<MemorySample>& v, double from, double to) {
  std::uint64_t m = 0;
  for (const auto& s : v)
    if (s.t >= from && s.t <= to) m = std::max(m, s.rss_kib);
  return m;
}

}  // namespace

TEST(DaemonSoak, MemoryStaysFlatNoStaleRecordsNoMissedProcesses) {
  double duration = 180;
  if (const char* e = std::getenv("GPUSTITCH_SOAK_SECONDS"); e && std::atof(e) > 0)
    duration = std::atof(e);
  test::PrefixGuard g;
  char tmpl[] = "/tmp/gstest-soak-XXXXXX";
  ASSERT_TRUE(::mkdtemp(tmpl));
  const std::string dir = tmpl, socket = dir + "/d.sock", config = dir + "/gpustitchd.conf",
                    log = dir + "/gpustitchd.log";
  std::ofstream(config) << "sample_interval_ms = " << kSampleIntervalMs
                        << "\nhistory_seconds = 30\nrecord_prefix = " << g.prefix
                        << "\nlog_level = info\n";
  test::Child daemon =
      test::spawn({GPUSTITCHD, "--config", config, "--socket", socket}, {}, -1, -1, log);
  auto query = [&](const json& req) { return shm::query_daemon(socket, req, 2000, nullptr); };
  auto passes = [&]() -> std::uint64_t {
    auto a = query({{"cmd", "status"}});
    return a ? a->value("passes", std::uint64_t{0}) : 0;
  };
  ASSERT_TRUE(test::eventually([&] { return query({{"cmd", "ping"}}).has_value(); }));

  std::mt19937 rng(12345);
  std::uniform_int_distribution<int> lifetime_ms(50, 3000), percent(0, 99);
  std::vector<Producer> live;
  std::vector<Death> pending;  // dead, record not yet seen gone
  std::vector<Death> deaths;
  std::vector<MemorySample> memory;
  int started = 0, failed_starts = 0, by_kill = 0, by_term = 0, by_exit = 0, churners = 0;
  int stale = 0;
  double max_reap_s = 0, sum_reap_s = 0;
  int reaped = 0;
  const auto t0 = Clock::now();
  auto next_memory_sample = t0;

  auto check_pending = [&](Clock::time_point now) {
    std::erase_if(pending, [&](const Death& d) {
      struct stat st;
      if (::stat(d.record_path.c_str(), &st) != 0) {
        double s = seconds_since(d.when, now);
        max_reap_s = std::max(max_reap_s, s);
        sum_reap_s += s;
        ++reaped;
        return true;
      }
      if (now - d.when > kReapBound) {
        ADD_FAILURE() << "stale record " << d.record_path << " " << seconds_since(d.when, now)
                      << " s after pid " << d.pid << " died";
        ++stale;
        return true;
      }
      return false;
    });
  };

  while (seconds_since(t0) < duration) {
    auto now = Clock::now();
    // Deaths.
    for (auto& p : live) {
      if (now < p.deadline) continue;
      std::uint64_t passes_at_death = passes();
      int how = percent(rng);
      int sig = how < 60 ? SIGKILL : how < 80 ? SIGTERM : SIGUSR1;
      (sig == SIGKILL ? by_kill : sig == SIGTERM ? by_term : by_exit)++;
      ::kill(p.child.pid, sig);
      int status = 0;
      ::waitpid(p.child.pid, &status, 0);
      ::close(p.child.out);
      auto died = Clock::now();
      if (sig == SIGUSR1) {
        EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "pid " << p.child.pid;
      }
      Death d{p.child.pid, p.record.path(), died, seconds_since(p.ready, died),
              passes_at_death - std::min(passes_at_death, p.passes_at_ready)};
      pending.push_back(d);
      deaths.push_back(d);
      p.child.pid = -1;
    }
    std::erase_if(live, [](const Producer& p) { return p.child.pid < 0; });
    // Births.
    while (live.size() < std::size_t(kPopulation) && seconds_since(t0) < duration) {
      Producer p;
      p.churn = percent(rng) < 25;
      std::vector<std::string> args{"0:" + std::to_string(2048 * (1 + started % 4)),
                                    "1:2048:async"};
      if (p.churn) args.push_back("--churn");
      p.child = test::start_producer(g.prefix, args);
      ++started;
      if (p.child.pid <= 0) {
        ++failed_starts;
        continue;
      }
      churners += p.churn;
      p.ready = Clock::now();
      p.passes_at_ready = passes();
      p.deadline = p.ready + std::chrono::milliseconds(lifetime_ms(rng));
      for (const auto& n : shm::discover_records(g.prefix))
        if (n.pid == p.child.pid) p.record = n;
      EXPECT_EQ(p.record.pid, p.child.pid) << "no record for a READY producer";
      live.push_back(std::move(p));
    }
    check_pending(Clock::now());
    if (Clock::now() >= next_memory_sample) {
      auto [rss, pss] = rss_pss_kib(daemon.pid);
      memory.push_back({seconds_since(t0), rss, pss});
      next_memory_sample += 1s;
    }
    std::this_thread::sleep_for(10ms);
  }
  // The last ones die by SIGKILL.
  for (auto& p : live) {
    test::kill_child(p.child);
    ++by_kill;
    Death d{-1, p.record.path(), Clock::now(), 0, 0};
    pending.push_back(d);
  }
  live.clear();
  ASSERT_TRUE(test::eventually(
      [&] {
        check_pending(Clock::now());
        return pending.empty();
      },
      5s));
  const double run_s = seconds_since(t0);

  // No stale records, nothing listed.
  auto left = shm::discover_records(g.prefix);
  EXPECT_TRUE(left.empty()) << left.size() << " records left";
  auto listed = query({{"cmd", "list"}});
  ASSERT_TRUE(listed.has_value());
  EXPECT_TRUE((*listed)["processes"].empty()) << (*listed)["processes"].size();

  // No missed processes: the daemon's log names every producer that lived two intervals.
  std::ifstream in(log);
  std::set<pid_t> tracked;
  std::vector<std::string> log_lines;
  std::string line;
  const std::regex tracking("tracking pid ([0-9]+) ");
  std::smatch m;
  while (std::getline(in, line)) {
    if (std::regex_search(line, m, tracking)) tracked.insert(std::stoi(m[1]));
    log_lines.push_back(line);
  }
  auto log_about = [&](pid_t pid) {
    std::string out;
    for (const auto& l : log_lines)
      if (l.find(std::to_string(pid)) != std::string::npos) out += "\n  " + l;
    return out.empty() ? std::string(" (nothing in the daemon's log)") : out;
  };
  int long_lived = 0, long_seen = 0, short_lived = 0, short_seen = 0;
  for (const auto& d : deaths) {
    bool seen = tracked.count(d.pid) != 0;
    if (d.passes_lived >= 2) {
      ++long_lived;
      long_seen += seen;
      EXPECT_TRUE(seen) << "pid " << d.pid << " lived " << d.lived_s << " s and " << d.passes_lived
                        << " passes, never tracked" << log_about(d.pid);
    } else {
      ++short_lived;
      short_seen += seen;
    }
  }

  // Memory stays flat.
  const double window = std::min(60.0, run_s / 3);
  const std::uint64_t first = max_rss(memory, window, 2 * window);
  const std::uint64_t last = max_rss(memory, run_s - window, run_s);
  std::uint64_t min_rss = ~0ull, top_rss = 0, min_pss = ~0ull, top_pss = 0;
  for (const auto& s : memory) {
    min_rss = std::min(min_rss, s.rss_kib), top_rss = std::max(top_rss, s.rss_kib);
    min_pss = std::min(min_pss, s.pss_kib), top_pss = std::max(top_pss, s.pss_kib);
  }
  ASSERT_FALSE(memory.empty());
  EXPECT_GT(first, 0u);
  EXPECT_LE(last, first + first / 20 + 256)
      << "daemon RSS grew: first window max " << first << " KiB, last window max " << last;

  std::printf(
      "soak: %.0f s, %d producers started (%d failed to start), %d churning; died: %d SIGKILL, "
      "%d SIGTERM, %d normal exit\n"
      "soak: daemon RSS min %llu KiB max %llu KiB (window max: first %llu KiB at %.0f-%.0f s, "
      "last %llu KiB); PSS min %llu KiB max %llu KiB; %zu samples\n"
      "soak: records reaped %d, max %.2f s mean %.3f s after death, stale %d, left at end %zu\n"
      "soak: tracked by the daemon: %d/%d that lived across >= 2 passes, %d/%d shorter-lived\n",
      run_s, started, failed_starts, churners, by_kill, by_term, by_exit,
      static_cast<unsigned long long>(min_rss), static_cast<unsigned long long>(top_rss),
      static_cast<unsigned long long>(first), window, 2 * window,
      static_cast<unsigned long long>(last), static_cast<unsigned long long>(min_pss),
      static_cast<unsigned long long>(top_pss), memory.size(), reaped, max_reap_s,
      reaped ? sum_reap_s / reaped : 0.0, stale, left.size(), long_seen, long_lived, short_seen,
      short_lived);
  EXPECT_EQ(failed_starts, 0);

  ::kill(daemon.pid, SIGTERM);
  int st = 0;
  ::waitpid(daemon.pid, &st, 0);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  ::close(daemon.out);
  std::filesystem::remove_all(dir);
}
