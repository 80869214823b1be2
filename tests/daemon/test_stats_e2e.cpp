// End to end: gpustitchd, 55 CUDA programs (preload_producer.cpp, linked against the CUDA runtime
// test double) running under LD_PRELOAD=libgpustitch.so on the simulated backend, the gpustitch
// CLI and the Prometheus endpoint. Checks that every process shows, through the socket and through
// `gpustitch ps --json` (daemon and direct), with the figures of what it allocated, its command
// line and a device UUID of its own; that producers SIGKILLed while allocating are detected and
// their records removed; that a recycled pid is not confused with a dead process; and who may see
// what.
//
// Binary paths come from the build (see process_helpers.h).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <gtest/gtest.h>

#include "gpustitch/shm/json.h"
#include "gpustitch/shm/record_writer.h"
#include "process_helpers.h"
#include "test_helpers.h"

using namespace gpustitch;
using nlohmann::json;
using namespace std::chrono_literals;
using test::Child;
using test::eventually;
using test::run;
using test::spawn;

namespace {

constexpr std::uint64_t MiB = 1024 * 1024;

int free_port() {
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(s);
  return ntohs(a.sin_port);
}

std::string http_get(int port, const std::string& path) {
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(s);
    return {};
  }
  std::string req = "GET " + path + " HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
  (void)!::write(s, req.data(), req.size());
  std::string out;
  char buf[65536];
  ssize_t n;
  while ((n = ::read(s, buf, sizeof buf)) > 0) out.append(buf, static_cast<std::size_t>(n));
  ::close(s);
  return out;
}

class StatsEndToEnd : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/gstest-e2e-XXXXXX";
    ASSERT_TRUE(::mkdtemp(tmpl));
    dir_ = tmpl;
    ::chmod(dir_.c_str(), 0755);  // other users must reach the socket
    socket_ = dir_ + "/d.sock";
    port_ = free_port();
    config_ = dir_ + "/gpustitchd.conf";
    // The node's GPUs: none until a test writes them (GpuFixture's format) and sends SIGHUP.
    gpus_dir_ = dir_ + "/gpus";
    std::ofstream(config_) << "sample_interval_ms = 100\nhistory_seconds = 60\nrecord_prefix = "
                           << g_.prefix << "\nlog_level = warn\nnvidia_gpus_dir = " << gpus_dir_
                           << "\nhostname = e2e-node\n";
    daemon_ = spawn({GPUSTITCHD, "--config", config_, "--socket", socket_, "--prometheus-port",
                     std::to_string(port_)});
    ASSERT_TRUE(eventually([&] { return query({{"cmd", "ping"}}).has_value(); }));
  }
  void TearDown() override {
    for (auto& c : producers_) test::kill_child(c);
    if (daemon_.pid > 0) {
      ::kill(daemon_.pid, SIGKILL);
      ::waitpid(daemon_.pid, nullptr, 0);
    }
    std::filesystem::remove_all(dir_);
  }

  std::optional<json> query(const json& req) {
    return shm::query_daemon(socket_, req, 2000, nullptr);
  }
  // A preload_producer with these allocation specs (see preload_producer.cpp), READY.
  // conf: more GPUSTITCH_CONF keys (sim_shared:NAME puts it on a named simulated GPU).
  Child producer(std::vector<std::string> args, int uid = -1, int gid = -1,
                 const std::string& conf = "") {
    Child c = test::start_producer(g_.prefix, args, uid, gid, conf);
    EXPECT_GT(c.pid, 0) << "preload_producer did not start";
    producers_.push_back(c);
    return c;
  }
  std::map<long, json> listed(int uid = -1, int gid = -1) {
    auto [rc, out] = run({GPUSTITCH_CLI, "ps", "--json", "--socket", socket_}, uid, gid);
    EXPECT_EQ(rc, 0) << out;
    std::map<long, json> m;
    json j = json::parse(out, nullptr, false);
    if (j.is_discarded()) return m;
    for (auto& p : j["processes"]) m[p["pid"].get<long>()] = p;
    return m;
  }

  test::PrefixGuard g_;
  std::string dir_, socket_, config_, gpus_dir_;
  int port_ = 0;
  Child daemon_;
  std::vector<Child> producers_;
};

}  // namespace

namespace {

// What one producer allocated on each of the two simulated devices.
struct Expected {
  std::string command;
  std::uint64_t bytes[2] = {0, 0};
  std::uint64_t blocks[2] = {0, 0};
};

// Producer i's allocations: a set of sizes (multiples of the 2 MiB granularity, so nothing is
// rounded) that no other producer has, half of them stream-ordered, some on device 1.
std::vector<std::string> allocation_specs(int i, Expected* e) {
  std::vector<std::string> specs;
  auto add = [&](int device, std::uint64_t kib, bool async) {
    specs.push_back(std::to_string(device) + ":" + std::to_string(kib) + (async ? ":async" : ""));
    e->bytes[device] += kib * 1024;
    ++e->blocks[device];
  };
  add(0, 2048 * (1 + i % 8), false);
  add(0, 2048 * (1 + i / 8), true);
  if (i % 3 == 0) add(1, 2048 * (2 + i % 4), i % 2 == 0);
  e->command = PRELOAD_PRODUCER;
  for (const auto& s : specs) e->command += " " + s;
  return specs;
}

// Checks every expected process in a process list (the socket's, or `gpustitch ps --json`'s):
// present once, with its command line, allocated/requested/reserved figures, block and allocation
// counts per device, and a non-empty device UUID that no other process shares. Returns the number
// of processes checked.
int check_figures(const json& processes, const std::map<pid_t, Expected>& expected,
                  const std::string& source) {
  SCOPED_TRACE(source);
  std::set<std::string> uuids;
  int checked = 0;
  for (const auto& p : processes) {
    auto it = expected.find(p["pid"].get<pid_t>());
    if (it == expected.end()) continue;
    const Expected& e = it->second;
    SCOPED_TRACE("pid " + std::to_string(it->first));
    EXPECT_EQ(p["command"].get<std::string>(), e.command);
    EXPECT_EQ(p["user"].get<std::string>(), shm::user_name(::geteuid()));
    const auto& devices = p["devices"];
    EXPECT_EQ(devices.size(), 2u);
    for (const auto& d : devices) {
      int dev = d["device"].get<int>();
      if (dev < 0 || dev > 1) {
        ADD_FAILURE() << "device " << dev;
        continue;
      }
      EXPECT_EQ(d["bytes_allocated"].get<std::uint64_t>(), e.bytes[dev]) << "device " << dev;
      EXPECT_EQ(d["bytes_requested"].get<std::uint64_t>(), e.bytes[dev]) << "device " << dev;
      EXPECT_EQ(d["live_blocks"].get<std::uint64_t>(), e.blocks[dev]) << "device " << dev;
      EXPECT_EQ(d["allocs"].get<std::uint64_t>(), e.blocks[dev]) << "device " << dev;
      EXPECT_GE(d["bytes_reserved"].get<std::uint64_t>(), e.bytes[dev]) << "device " << dev;
      std::string uuid = d["uuid"].get<std::string>();
      EXPECT_EQ(uuid.rfind("GPU-", 0), 0u) << uuid;
      EXPECT_TRUE(uuids.insert(uuid).second) << "UUID " << uuid << " seen twice";
    }
    ++checked;
  }
  return checked;
}

}  // namespace

TEST_F(StatsEndToEnd, EveryProducerShowsWithItsFiguresAndKilledOnesAreReaped) {
  constexpr int kQuiet = 45, kChurning = 10;
  std::map<pid_t, Expected> expected;
  for (int i = 0; i < kQuiet; ++i) {
    Expected e;
    auto specs = allocation_specs(i, &e);
    expected[producer(specs).pid] = e;
  }
  std::vector<pid_t> churning;
  for (int i = 0; i < kChurning; ++i) churning.push_back(producer({"--churn"}).pid);

  // The socket: every producer, with the figures it holds.
  ASSERT_TRUE(eventually([&] {
    auto a = query({{"cmd", "list"}});
    return a && (*a)["processes"].size() == std::size_t(kQuiet + kChurning);
  })) << query({{"cmd", "list"}}).value_or(json::object()).value("processes", json::array()).size();
  EXPECT_EQ(check_figures((*query({{"cmd", "list"}}))["processes"], expected, "socket"), kQuiet);

  // The CLI, through the daemon and directly: the same processes and figures.
  auto [drc, via_daemon] = run({GPUSTITCH_CLI, "ps", "--json", "--socket", socket_});
  EXPECT_EQ(drc, 0);
  json daemon_list = json::parse(via_daemon);
  EXPECT_EQ(daemon_list["source"], "daemon");
  EXPECT_EQ(daemon_list["processes"].size(), std::size_t(kQuiet + kChurning));
  EXPECT_EQ(check_figures(daemon_list["processes"], expected, "ps --json"), kQuiet);
  auto [rc, out] = run({GPUSTITCH_CLI, "ps", "--json", "--direct", "--prefix", g_.prefix});
  EXPECT_EQ(rc, 0);
  json direct = json::parse(out);
  EXPECT_EQ(direct["source"], "direct");
  EXPECT_EQ(direct["processes"].size(), std::size_t(kQuiet + kChurning));
  EXPECT_EQ(check_figures(direct["processes"], expected, "ps --json --direct"), kQuiet);
  auto [trc, table] = run({GPUSTITCH_CLI, "ps", "--socket", socket_});
  EXPECT_EQ(trc, 0);
  EXPECT_NE(table.find("ALLOCATED"), std::string::npos);
  EXPECT_NE(table.find(std::to_string(expected.begin()->first)), std::string::npos);

  // show: counters, histogram, and history from the daemon.
  pid_t one = expected.begin()->first;
  std::this_thread::sleep_for(300ms);  // a few history samples
  auto [src, shown] =
      run({GPUSTITCH_CLI, "show", std::to_string(one), "--json", "--socket", socket_});
  ASSERT_EQ(src, 0) << shown;
  json s = json::parse(shown);
  EXPECT_EQ(s["process"]["pid"].get<pid_t>(), one);
  EXPECT_EQ(s["process"]["devices"][0]["hist_allocs"].size(), 32u);
  EXPECT_GE(s["history"][0]["allocated"].size(), 2u);
  auto [hrc, human] = run({GPUSTITCH_CLI, "show", std::to_string(one), "--socket", socket_});
  EXPECT_EQ(hrc, 0);
  EXPECT_NE(human.find("history, device 0"), std::string::npos) << human;
  EXPECT_EQ(run({GPUSTITCH_CLI, "show", "999999999", "--socket", socket_}).first, 3);

  // Prometheus: one series per process and device, and the process count.
  std::string metrics = http_get(port_, "/metrics");
  EXPECT_NE(metrics.find("HTTP/1.1 200"), std::string::npos);
  EXPECT_NE(metrics.find("\ngpustitch_processes " + std::to_string(kQuiet + kChurning) + "\n"),
            std::string::npos);
  EXPECT_NE(metrics.find("gpustitch_allocated_bytes{pid=\"" + std::to_string(one) + "\",user="),
            std::string::npos);
  EXPECT_NE(metrics.find("\",cuda_device=\"1\",UUID=\"GPU-"), std::string::npos);
  EXPECT_NE(http_get(port_, "/nope").find("404"), std::string::npos);

  // SIGKILL the churning producers while they allocate and publish: detected and reaped within a
  // few intervals.
  for (auto& c : producers_)
    if (std::find(churning.begin(), churning.end(), c.pid) != churning.end()) test::kill_child(c);
  ASSERT_TRUE(eventually([&] {
    auto a = query({{"cmd", "list"}});
    return a && (*a)["processes"].size() == std::size_t(kQuiet);
  }));
  auto names = shm::discover_records(g_.prefix);
  EXPECT_EQ(names.size(), std::size_t(kQuiet));
  for (const auto& n : names)
    EXPECT_TRUE(std::find(churning.begin(), churning.end(), n.pid) == churning.end());
  auto status = *query({{"cmd", "status"}});
  EXPECT_EQ(status["tracked"].get<int>(), kQuiet);

  // A recycled pid: a record for a live pid with another start time (the previous owner of the
  // pid). The live process keeps its figures; the stale record is removed.
  shm::RecordName stale{g_.prefix, ::geteuid(), one, shm::process_start_time(one).value_or(2) - 1};
  std::string why;
  auto w = shm::RecordWriter::create(stale, "/bin/old", "old", 100, &why);
  ASSERT_TRUE(w) << why;
  ASSERT_TRUE(eventually([&] {
    struct stat st;
    return ::stat(stale.path().c_str(), &st) != 0;
  }));
  auto after = *query({{"cmd", "show"}, {"pid", one}});
  ASSERT_TRUE(after["ok"].get<bool>());
  EXPECT_EQ(after["process"]["command"].get<std::string>().find("old"), std::string::npos);
  EXPECT_EQ(after["process"]["start_time"].get<std::uint64_t>(), *shm::process_start_time(one));

  // SIGHUP reloads the file; SIGTERM stops cleanly and removes the socket.
  std::ofstream(config_) << "sample_interval_ms = 50\nrecord_prefix = " << g_.prefix << "\n";
  ::kill(daemon_.pid, SIGHUP);
  ASSERT_TRUE(eventually([&] {
    auto a = query({{"cmd", "list"}});
    return a && (*a)["sample_interval_ms"] == 50;
  }));
  ::kill(daemon_.pid, SIGTERM);
  int st = 0;
  ASSERT_EQ(::waitpid(daemon_.pid, &st, 0), daemon_.pid);
  daemon_.pid = -1;
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  EXPECT_FALSE(std::filesystem::exists(socket_));
  // Without the daemon the CLI still works (direct), and --daemon fails with 4.
  EXPECT_EQ(run({GPUSTITCH_CLI, "ps", "--daemon", "--socket", socket_}).first, 4);
}

// An out-of-memory in the pool reaches the record's event ring with its figures, the OOM counter,
// the CLI and Prometheus.
TEST_F(StatsEndToEnd, PoolOutOfMemoryShowsAsAnEventWithItsFigures) {
  Child c = producer({"--oom", "0:2048"});
  ASSERT_TRUE(eventually([&] {
    auto a = query({{"cmd", "show"}, {"pid", c.pid}});
    return a && (*a)["ok"].get<bool>() && !(*a)["process"]["events"].empty();
  }));
  auto [rc, out] =
      run({GPUSTITCH_CLI, "show", std::to_string(c.pid), "--json", "--socket", socket_});
  ASSERT_EQ(rc, 0);
  json p = json::parse(out)["process"];
  EXPECT_EQ(p["devices"][0]["ooms"].get<std::uint64_t>(), 1u);
  const json* oom = nullptr;
  for (const auto& e : p["events"])
    if (e["kind"] == "oom") oom = &e;
  ASSERT_TRUE(oom) << p["events"].dump();
  EXPECT_EQ((*oom)["device"].get<int>(), 0);
  EXPECT_EQ((*oom)["size"].get<std::uint64_t>(), 32ull << 30);
  EXPECT_LE((*oom)["largest_possible"].get<std::uint64_t>(), 1ull << 30);  // sim_capacity_mb:1024
  EXPECT_GT((*oom)["time_ns"].get<std::uint64_t>(), 0u);
  auto [hrc, human] = run({GPUSTITCH_CLI, "show", std::to_string(c.pid), "--socket", socket_});
  EXPECT_NE(human.find("oom  dev 0  requested 32.0 GiB"), std::string::npos) << human;
  EXPECT_NE(http_get(port_, "/metrics")
                .find("gpustitch_oom_total{pid=\"" + std::to_string(c.pid) + "\",user="),
            std::string::npos);
}

// Issue 20, item 15: processes are shown by GPU, not by their own device ordinal. Three
// producers on three simulated GPUs, each its own device 0 (as CUDA_VISIBLE_DEVICES=0, 1 and 2
// make them), a fourth sharing GPU 1; the driver's list (a fixture) names the GPUs. Before, `top`
// showed one "dev 0" line holding all four, and Prometheus labelled all four device="0".
TEST_F(StatsEndToEnd, ProcessesAreGroupedByGpuWhateverTheirDeviceOrdinal) {
  std::vector<std::string> names;
  for (int g = 0; g < 3; ++g) names.push_back(g_.prefix + "gpu" + std::to_string(g));
  struct Cleanup {
    std::vector<std::string> names;
    ~Cleanup() {
      for (const auto& n : names)
        ::unlink(("/dev/shm/gpustitch-sim." + std::to_string(::geteuid()) + "." + n).c_str());
    }
  } cleanup{names};
  const int on_gpu[] = {0, 1, 2, 1};
  std::vector<pid_t> pids;
  for (int i = 0; i < 4; ++i)
    pids.push_back(producer({"0:" + std::to_string((i + 1) * 2048)}, -1, -1,
                            "sim_devices:1,sim_shared:" + names[on_gpu[i]])
                       .pid);
  // The simulated GPUs' UUIDs, as the processes report them (from their first publish on that
  // device on); the driver lists them in bus order.
  std::map<pid_t, std::string> uuid_of;
  ASSERT_TRUE(eventually([&] {
    auto a = query({{"cmd", "list"}});
    if (!a || (*a)["processes"].size() != 4u) return false;
    uuid_of.clear();
    for (const auto& p : (*a)["processes"]) {
      if (p["devices"].empty() || p["devices"][0]["uuid"] == "") return false;
      uuid_of[p["pid"].get<pid_t>()] = p["devices"][0]["uuid"].get<std::string>();
    }
    return true;
  }));
  EXPECT_EQ(uuid_of[pids[1]], uuid_of[pids[3]]);
  EXPECT_NE(uuid_of[pids[0]], uuid_of[pids[1]]);
  EXPECT_NE(uuid_of[pids[1]], uuid_of[pids[2]]);
  std::filesystem::create_directory(gpus_dir_);
  for (int g = 0; g < 3; ++g) {
    std::string bus = "0000:" + std::to_string(1 + 4 * g) + "0:00.0";
    std::filesystem::create_directory(gpus_dir_ + "/" + bus);
    std::ofstream(gpus_dir_ + "/" + bus + "/information")
        << "Model: \t\t NVIDIA H200\nGPU UUID: \t " << uuid_of[pids[g]] << "\nBus Location: \t "
        << bus << "\nDevice Minor: \t " << g << "\n";
  }
  ::kill(daemon_.pid, SIGHUP);  // re-reads the driver's list
  ASSERT_TRUE(eventually([&] {
    auto a = query({{"cmd", "list"}});
    if (!a) return false;
    for (const auto& p : (*a)["processes"])
      if (!p["devices"][0].contains("gpu")) return false;
    return true;
  }));

  // top: one line per GPU, by its index and name, with the processes on it.
  auto [trc, top] = run({GPUSTITCH_CLI, "top", "-n", "1", "--socket", socket_});
  EXPECT_EQ(trc, 0) << top;
  for (int g = 0; g < 3; ++g) {
    std::string title = "GPU " + std::to_string(g) + " NVIDIA H200 (" + uuid_of[pids[g]] + ")\n";
    std::size_t at = top.find(title);
    ASSERT_NE(at, std::string::npos) << top;
    const std::size_t from = at + title.size();
    std::string line = top.substr(from, top.find('\n', from) - from);
    // Allocated: 2 MiB (GPU 0), 4 + 8 MiB (GPU 1, two processes), 6 MiB (GPU 2).
    const char* allocated[] = {" 2.00 MiB allocated", " 12.0 MiB allocated", " 6.00 MiB allocated"};
    EXPECT_NE(line.find(allocated[g]), std::string::npos) << line;
    EXPECT_NE(line.find(g == 1 ? " 2 procs" : " 1 procs"), std::string::npos) << line;
  }
  EXPECT_EQ(top.find("dev 0"), std::string::npos) << top;

  // ps: the GPU column is the GPU's index, through the daemon and directly.
  auto gpu_column = [&](const std::string& table) {
    std::map<pid_t, std::string> m;
    std::istringstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string pid, user, gpu;
      f >> pid >> user >> gpu;
      m[std::stoi(pid)] = gpu;
    }
    return m;
  };
  std::map<pid_t, std::string> want;
  for (int i = 0; i < 4; ++i) want[pids[i]] = std::to_string(on_gpu[i]);
  auto [prc, ps] = run({GPUSTITCH_CLI, "ps", "--socket", socket_});
  EXPECT_EQ(prc, 0);
  EXPECT_EQ(gpu_column(ps), want) << ps;
  Child direct = spawn({GPUSTITCH_CLI, "ps", "--direct", "--prefix", g_.prefix},
                       {"GPUSTITCH_NVIDIA_GPUS_DIR=" + gpus_dir_});
  std::string direct_ps;
  char buf[4096];
  for (ssize_t n; (n = ::read(direct.out, buf, sizeof buf)) > 0;) direct_ps.append(buf, n);
  ::close(direct.out);
  ::waitpid(direct.pid, nullptr, 0);
  EXPECT_EQ(gpu_column(direct_ps), want) << direct_ps;

  // Prometheus: each process's series carry its GPU's labels; the GPU's own figures come once
  // per GPU, not once per process.
  std::string metrics = http_get(port_, "/metrics");
  for (int i = 0; i < 4; ++i)
    EXPECT_NE(metrics.find("gpustitch_reserved_bytes{pid=\"" + std::to_string(pids[i]) +
                           "\",user=\"" + shm::user_name(::geteuid()) + "\","),
              std::string::npos);
  for (int g = 0; g < 3; ++g) {
    std::string labels = "UUID=\"" + uuid_of[pids[g]] + "\",gpu=\"" + std::to_string(g) +
                         "\",device=\"nvidia" + std::to_string(g) + "\",modelName=\"NVIDIA H200\"";
    EXPECT_NE(metrics.find("gpustitch_device_total_bytes{" + labels), std::string::npos) << metrics;
    EXPECT_NE(metrics.find("cuda_device=\"0\"," + labels), std::string::npos) << metrics;
  }
  std::size_t totals = 0;
  for (std::size_t at = 0;
       (at = metrics.find("\ngpustitch_device_total_bytes{", at)) != std::string::npos; ++at)
    ++totals;
  EXPECT_EQ(totals, 3u) << metrics;
  EXPECT_NE(metrics.find("Hostname=\"e2e-node\""), std::string::npos);
}

// Another user: cannot read or write someone else's record, and the daemon and CLI show each
// user only their own processes; root sees all.
TEST_F(StatsEndToEnd, UsersSeeOnlyTheirOwnProcesses) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a producer as nobody";
  constexpr int kNobody = 65534;
  Child mine = producer({"0:2048"});
  Child theirs = producer({"0:2048", "0:2048", "0:2048"}, kNobody, kNobody);
  ASSERT_TRUE(eventually([&] {
    auto a = query({{"cmd", "list"}});
    return a && (*a)["processes"].size() == 2;
  }));
  // nobody's record: 0600, owned by nobody.
  auto names = shm::discover_records(g_.prefix, kNobody);
  ASSERT_EQ(names.size(), 1u);
  struct stat st;
  ASSERT_EQ(::stat(names[0].path().c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, static_cast<uid_t>(kNobody));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // As nobody: root's record can be neither read nor written.
  auto root_names = shm::discover_records(g_.prefix, 0);
  ASSERT_EQ(root_names.size(), 1u);
  pid_t probe = ::fork();
  if (probe == 0) {
    if (::setgroups(0, nullptr) != 0 || ::setgid(kNobody) != 0 || ::setuid(kNobody) != 0)
      ::_exit(10);
    int r = ::open(root_names[0].path().c_str(), O_RDONLY);
    int w = ::open(root_names[0].path().c_str(), O_RDWR);
    ::_exit(r < 0 && errno == EACCES && w < 0 ? 0 : 11);
  }
  int status = 0;
  ::waitpid(probe, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << WEXITSTATUS(status);

  // The daemon: nobody sees only nobody's process; root sees both.
  // (A sample may predate the producer's last publish: wait for the figures it holds.)
  std::map<long, json> as_nobody;
  EXPECT_TRUE(eventually([&] {
    as_nobody = listed(kNobody, kNobody);
    if (as_nobody.size() != 1) return false;
    const json& devices = as_nobody.begin()->second["devices"];
    return devices.is_array() && !devices.empty() &&
           devices[0].value("bytes_requested", std::uint64_t{0}) == 3 * 2 * MiB;
  })) << "as nobody: "
      << json(as_nobody).dump();
  ASSERT_EQ(as_nobody.size(), 1u);
  EXPECT_EQ(as_nobody.begin()->first, theirs.pid);
  EXPECT_EQ(listed().size(), 2u);
  auto [rc, out] =
      run({GPUSTITCH_CLI, "show", std::to_string(mine.pid), "--json", "--socket", socket_}, kNobody,
          kNobody);
  EXPECT_EQ(rc, 3) << out;  // "not found", as for a process that does not exist
  // Directly, without the daemon: nobody reads only its own records.
  auto [drc, dout] =
      run({GPUSTITCH_CLI, "ps", "--json", "--direct", "--prefix", g_.prefix}, kNobody, kNobody);
  EXPECT_EQ(drc, 0);
  json d = json::parse(dout);
  ASSERT_EQ(d["processes"].size(), 1u);
  EXPECT_EQ(d["processes"][0]["pid"].get<pid_t>(), theirs.pid);
}
