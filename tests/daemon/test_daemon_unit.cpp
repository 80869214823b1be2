// gpustitchd's pieces without the event loop: config file, request parser and access rules,
// Prometheus exposition, the process table against real records.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <map>
#include <regex>
#include <set>
#include <sstream>

#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include "daemon_config.h"
#include "gpu_fixture.h"
#include "gpustitch/shm/json.h"
#include "gpustitch/shm/metrics.h"
#include "gpustitch/shm/record_writer.h"
#include "http.h"
#include "process_table.h"
#include "prometheus.h"
#include "request.h"
#include "test_helpers.h"

using namespace gpustitch;
using namespace gpustitch::daemon;
using nlohmann::json;

TEST(DaemonConfig, ParsesKeysAndReportsEachBadLine) {
  auto r = parse_daemon_config(
      "# comment\n"
      "socket = /tmp/x.sock\n"
      "socket_mode = 0660\n"
      "sample_interval_ms=250   # trailing comment\n"
      "history_seconds = 60\n"
      "admin_group = gpuadmin\n"
      "prometheus_port = 9400\n"
      "bogus = 1\n"
      "reap = maybe\n"
      "no equals sign\n"
      "log_level = debug\n");
  EXPECT_EQ(r.config.socket_path, "/tmp/x.sock");
  EXPECT_EQ(r.config.socket_mode, 0660u);
  EXPECT_EQ(r.config.sample_interval_ms, 250u);
  EXPECT_EQ(r.config.history_seconds, 60u);
  EXPECT_EQ(r.config.history_capacity(), 240u);
  EXPECT_EQ(r.config.admin_group, "gpuadmin");
  EXPECT_EQ(r.config.prometheus_port, 9400u);
  EXPECT_EQ(r.config.log_level, "debug");
  EXPECT_TRUE(r.config.reap);  // bad value ignored, default kept
  ASSERT_EQ(r.errors.size(), 3u);
  EXPECT_NE(r.errors[0].find("bogus"), std::string::npos);
  EXPECT_NE(r.errors[1].find("reap"), std::string::npos);
  EXPECT_NE(r.errors[2].find("line 10"), std::string::npos);
}

TEST(Request, ParsesValidAndRejectsInvalid) {
  std::string why;
  auto r = parse_request(R"({"cmd":"show","pid":123,"history_seconds":60})", &why);
  ASSERT_TRUE(r) << why;
  EXPECT_EQ(r->cmd, Command::show);
  EXPECT_EQ(r->pid, 123);
  EXPECT_EQ(r->history_seconds, 60u);
  EXPECT_TRUE(parse_request(R"({"cmd":"list"})", &why));
  for (const char* bad :
       {"", "{", "[]", "null", R"({"cmd":1})", R"({"cmd":"rm"})", R"({"cmd":"show"})",
        R"({"cmd":"show","pid":-1})", R"({"cmd":"show","pid":"1"})", R"({"cmd":"show","pid":1e30})",
        R"({"cmd":"list","history_seconds":-5})"})
    EXPECT_FALSE(parse_request(bad, &why)) << bad;
  EXPECT_FALSE(parse_request(std::string(kMaxRequestBytes + 1, ' '), &why));
}

TEST(Request, RootAndAdminGroupSeeAll) {
  Peer root{0, 0, 1, {}};
  Peer user{1000, 1000, 1, {}};
  EXPECT_TRUE(peer_sees_all(root, ""));
  EXPECT_FALSE(peer_sees_all(user, ""));
  EXPECT_FALSE(peer_sees_all(user, "nogroup"));
  user.groups = {65534};  // nogroup
  EXPECT_TRUE(peer_sees_all(user, "nogroup"));
  EXPECT_FALSE(peer_sees_all(user, "no-such-group-here"));
}

class TableTest : public ::testing::Test {
 protected:
  DaemonConfig config() {
    DaemonConfig c;
    c.record_prefix = g_.prefix;
    c.sample_interval_ms = 1000;
    c.history_seconds = 5;
    return c;
  }
  std::unique_ptr<shm::RecordWriter> own_record(std::uint64_t allocated) {
    std::string why;
    auto w = shm::RecordWriter::create(shm::RecordWriter::self_name(g_.prefix), "/bin/own",
                                       "own --x", 100, &why);
    EXPECT_TRUE(w) << why;
    shm::DeviceCounters d{};
    d.bytes_allocated = allocated;
    d.bytes_reserved = 2 * allocated;
    d.stitches = 3;
    d.driver_calls = 42;
    d.driver_ns = 1'500'000'000;    // 1.5 s
    d.fence_wait_ns = 250'000'000;  // 0.25 s
    d.fence_waits_timed_out = 2;
    w->publish({&d, 1}, shm::realtime_ns());
    return w;
  }
  test::PrefixGuard g_;
};

TEST_F(TableTest, TracksLiveRecordsAndKeepsHistory) {
  auto w = own_record(1000);
  ProcessTable t(config());
  auto s = t.sample();
  EXPECT_EQ(s.added, 1u);
  ASSERT_EQ(t.processes().size(), 1u);
  const TrackedProcess* p = t.find(::getpid());
  ASSERT_TRUE(p);
  ASSERT_TRUE(p->have_snapshot);
  EXPECT_EQ(p->snapshot.devices[0].bytes_allocated, 1000u);
  for (int i = 0; i < 10; ++i) t.sample();
  ASSERT_EQ(p->history.size(), 1u);
  EXPECT_EQ(p->history[0].size(), 5u);  // 5 s at 1 s: capacity 5
  json summary = process_summary_json(*p, shm::JsonDetail::counters);
  EXPECT_EQ(summary["devices"][0]["bytes_reserved"].get<std::uint64_t>(), 2000u);
  EXPECT_EQ(summary["command"], "own --x");
}

// A record whose pid is alive but whose start time differs is a recycled pid: not listed,
// and removed.
TEST_F(TableTest, RecycledPidIsNotTakenForTheDeadProcess) {
  auto self = shm::RecordWriter::self_name(g_.prefix);
  shm::RecordName recycled = self;
  recycled.start_time = self.start_time - 1;  // "the process that had this pid before"
  std::string why;
  auto w = shm::RecordWriter::create(recycled, "/bin/old", "old", 100, &why);
  ASSERT_TRUE(w) << why;
  ProcessTable t(config());
  auto s = t.sample();
  EXPECT_EQ(t.processes().size(), 0u);
  EXPECT_EQ(s.exited, 1u);
  EXPECT_EQ(s.reaped, 1u);
  struct stat st;
  EXPECT_NE(::stat(recycled.path().c_str(), &st), 0);
}

TEST_F(TableTest, DeadProcessIsDroppedAndReaped) {
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  pid_t child = ::fork();
  if (child == 0) {
    std::string why;
    auto w =
        shm::RecordWriter::create(shm::RecordWriter::self_name(g_.prefix), "/bin/c", "c", 1, &why);
    char c = w ? 'y' : 'n';
    (void)!::write(pipefd[1], &c, 1);
    ::pause();
    ::_exit(0);
  }
  char c = 0;
  ASSERT_EQ(::read(pipefd[0], &c, 1), 1);
  ASSERT_EQ(c, 'y');
  ProcessTable t(config());
  t.sample();
  ASSERT_TRUE(t.find(child));
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  auto s = t.sample();
  EXPECT_FALSE(t.find(child));
  EXPECT_EQ(s.reaped, 1u);
  EXPECT_TRUE(shm::discover_records(g_.prefix).empty());
}

TEST_F(TableTest, HostileRecordIsRejectedAndOthersStillServed) {
  auto w = own_record(7);
  // A garbage object under a live pid's name (our parent's): rejected, not fatal.
  shm::RecordName bogus{g_.prefix, ::geteuid(), ::getppid(),
                        shm::process_start_time(::getppid()).value_or(0)};
  int fd = ::open(bogus.path().c_str(), O_CREAT | O_WRONLY | O_TRUNC, 0600);
  ASSERT_GE(fd, 0);
  std::string junk(sizeof(shm::Record), 'Z');
  ASSERT_EQ(::write(fd, junk.data(), junk.size()), static_cast<ssize_t>(junk.size()));
  ::close(fd);
  ProcessTable t(config());
  auto s = t.sample();
  EXPECT_EQ(s.rejected, 1u);
  EXPECT_EQ(t.processes().size(), 1u);
  EXPECT_TRUE(t.find(::getpid()));
}

// A record seen between its creation and the store of its magic is picked up once complete.
TEST_F(TableTest, RecordCaughtBeforeItsMagicIsTrackedOnceComplete) {
  auto w = own_record(11);
  std::uint64_t magic = w->record()->header.magic;
  w->record()->header.magic = 0;
  ProcessTable t(config());
  auto s = t.sample();
  EXPECT_EQ(s.rejected, 1u);
  EXPECT_FALSE(t.find(::getpid()));
  w->record()->header.magic = magic;
  t.sample();
  ASSERT_TRUE(t.find(::getpid()));
  EXPECT_EQ(t.find(::getpid())->snapshot.devices[0].bytes_allocated, 11u);
}

// A record seen after its writer created the object but before it sized it (an empty object) is
// looked at again and tracked once complete, not rejected for good. (Found by the daemon soak: a
// pass that listed /dev/shm in that window never tracked the process.)
TEST_F(TableTest, RecordCaughtBeforeItIsSizedIsTrackedOnceComplete) {
  shm::RecordName name = shm::RecordWriter::self_name(g_.prefix);
  int fd = ::open(name.path().c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ProcessTable t(config());
  auto s = t.sample();
  EXPECT_EQ(s.rejected, 1u);
  EXPECT_FALSE(t.find(::getpid()));
  t.sample();
  EXPECT_FALSE(t.find(::getpid()));
  // The writer completes the same object (same inode): a whole record, as RecordWriter makes it.
  const std::string other = g_.prefix + "b";
  {
    std::string why;
    auto w = shm::RecordWriter::create(shm::RecordWriter::self_name(other), "/bin/own", "own", 100,
                                       &why);
    ASSERT_TRUE(w) << why;
    shm::DeviceCounters d{};
    d.bytes_allocated = 13;
    w->publish({&d, 1}, shm::realtime_ns());
    std::string bytes(sizeof(shm::Record), '\0');
    int src = ::open(shm::RecordWriter::self_name(other).path().c_str(), O_RDONLY);
    ASSERT_GE(src, 0);
    ASSERT_EQ(::pread(src, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
    ::close(src);
    ASSERT_EQ(::pwrite(fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
  }
  ::close(fd);
  test::remove_records(other);
  t.sample();
  ASSERT_TRUE(t.find(::getpid()));
  EXPECT_EQ(t.find(::getpid())->snapshot.devices[0].bytes_allocated, 13u);
}

TEST_F(TableTest, RequestsAnswerOnlyWhatThePeerMaySee) {
  auto w = own_record(5);
  ProcessTable t(config());
  t.sample();
  DaemonConfig c = config();
  Peer owner{::geteuid(), ::getegid(), ::getpid(), {}};
  Peer stranger{::geteuid() + 12345, 12345, 1, {}};
  json mine = json::parse(handle_request(R"({"cmd":"list"})", owner, t, c));
  ASSERT_TRUE(mine["ok"].get<bool>());
  EXPECT_EQ(mine["processes"].size(), 1u);
  json theirs = json::parse(handle_request(R"({"cmd":"list"})", stranger, t, c));
  EXPECT_EQ(theirs["processes"].size(), 0u);
  std::string show = R"({"cmd":"show","pid":)" + std::to_string(::getpid()) + "}";
  json a = json::parse(handle_request(show, owner, t, c));
  ASSERT_TRUE(a["ok"].get<bool>()) << a.dump();
  EXPECT_EQ(a["process"]["devices"][0]["bytes_allocated"].get<std::uint64_t>(), 5u);
  EXPECT_EQ(a["history"][0]["allocated"][0].get<std::uint64_t>(), 5u);
  json b = json::parse(handle_request(show, stranger, t, c));
  EXPECT_FALSE(b["ok"].get<bool>());
  EXPECT_EQ(b["error"], "not found");
  json bad = json::parse(handle_request("garbage", owner, t, c));
  EXPECT_FALSE(bad["ok"].get<bool>());
}

TEST_F(TableTest, PrometheusExportsEveryMetricWithHelpTypeAndLabels) {
  auto w = own_record(1234);
  ProcessTable t(config());
  t.sample();
  std::string text = format_prometheus(t);
  for (const auto& m : shm::kMetrics) {
    std::string type = m.kind == shm::MetricKind::gauge ? "gauge" : "counter";
    EXPECT_NE(text.find(std::string("# HELP ") + m.name + " "), std::string::npos) << m.name;
    EXPECT_NE(text.find(std::string("# TYPE ") + m.name + " " + type + "\n"), std::string::npos)
        << m.name;
  }
  std::string pid = std::to_string(::getpid());
  EXPECT_NE(text.find("gpustitch_allocated_bytes{pid=\"" + pid + "\",user=\"" +
                      shm::user_name(::geteuid()) +
                      "\",command=\"own --x\",cuda_device=\"0\",UUID=\"\",Hostname=\""),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("gpustitch_reserved_bytes{pid=\"" + pid), std::string::npos);
  EXPECT_NE(text.find("gpustitch_stitches_total{pid=\"" + pid), std::string::npos);
  // This process's sample of a metric: the text after its labels, to the end of the line.
  auto sample = [&](const std::string& metric) -> std::string {
    const std::size_t at = text.find(metric + "{pid=\"" + pid);
    if (at == std::string::npos) return "(no " + metric + ")";
    const std::size_t value = text.find("} ", at) + 2;
    return text.substr(value, text.find('\n', value) - value);
  };
  // The pool's driver time: counted in nanoseconds, exported in seconds.
  EXPECT_EQ(sample("gpustitch_driver_calls_total"), "42");
  EXPECT_EQ(sample("gpustitch_driver_seconds_total"), "1.500000000");
  // The program's threads' waits for the device: the same conversion, and the plain counts.
  EXPECT_EQ(sample("gpustitch_fence_wait_seconds_total"), "0.250000000");
  EXPECT_EQ(sample("gpustitch_fence_waits_timed_out_total"), "2");
  EXPECT_NE(text.find("gpustitch_fragmentation_ratio{pid=\"" + pid + "\""), std::string::npos);
  EXPECT_NE(text.find("\ngpustitch_processes 1\n"), std::string::npos);
  // Every sample line parses as name{labels} value.
  std::regex line(R"(^(# (HELP|TYPE) .*|[a-z_]+(\{[^}]*\})? [0-9.e+-]+)$)");
  // A device without a UUID is no GPU's: no per-GPU series.
  EXPECT_EQ(text.find("gpustitch_device_total_bytes{"), std::string::npos) << text;
  std::size_t start = 0;
  while (start < text.size()) {
    std::size_t nl = text.find('\n', start);
    std::string l = text.substr(start, nl - start);
    EXPECT_TRUE(std::regex_match(l, line)) << l;
    start = nl + 1;
  }
}

TEST(Prometheus, LabelValuesAreEscaped) {
  EXPECT_EQ(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
}

// Prometheus rejects a whole scrape whose text is not UTF-8, so one process with a Latin-1
// argument would break the node's metrics (hardening issue, item 3).
TEST(Prometheus, LabelValuesAreAlwaysUtf8) {
  const std::string fffd = "\xEF\xBF\xBD";
  EXPECT_EQ(escape_label("caf\xE9"), "caf" + fffd);  // Latin-1
  EXPECT_EQ(escape_label("caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80"),
            "caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80");
  EXPECT_EQ(escape_label("\xC0\xAF"), fffd + fffd);                        // overlong '/'
  EXPECT_EQ(escape_label("\xED\xA0\x80"), fffd + fffd + fffd);             // a surrogate
  EXPECT_EQ(escape_label("\xF4\x90\x80\x80"), fffd + fffd + fffd + fffd);  // above U+10FFFF
  EXPECT_EQ(escape_label("\xE2\x82"), fffd + fffd);                        // truncated
  EXPECT_EQ(escape_label("\xE2\x82\""), fffd + fffd + "\\\"");  // a sequence cut by a quote
  EXPECT_EQ(escape_label("\xFF\\"), fffd + "\\\\");
  for (int b = 0; b < 256; ++b) {
    std::string v = escape_label(std::string(1, static_cast<char>(b)) + "x");
    EXPECT_NO_THROW((void)json(v).dump()) << b;  // json's dump() throws on invalid UTF-8
  }
}

TEST_F(TableTest, PrometheusTextIsUtf8WhateverACommandLineHolds) {
  std::string why;
  std::string argv = "train.py --name=caf\xE9 --tag=\xFF\xFE";
  while (argv.size() < 127) argv += "x";
  argv += "\xC3\xA9\xC3\xA9";  // a two-byte character across the 128-byte cut
  auto w = shm::RecordWriter::create(shm::RecordWriter::self_name(g_.prefix), "/bin/own", argv, 100,
                                     &why);
  ASSERT_TRUE(w) << why;
  shm::DeviceCounters d{};
  d.bytes_allocated = 1;
  w->publish({&d, 1}, shm::realtime_ns());
  ProcessTable t(config());
  t.sample();
  ASSERT_TRUE(t.find(::getpid()));
  std::string text = format_prometheus(t);
  EXPECT_NO_THROW((void)json(text).dump());
  EXPECT_NE(text.find("--name=caf\xEF\xBF\xBD --tag=\xEF\xBF\xBD\xEF\xBF\xBD"), std::string::npos);
  EXPECT_EQ(text.find("x\xC3\"}"), std::string::npos);  // no half character at the cut
}

// Item 5 of the hardening issue: no user can inflate the daemon's work or starve others' tracking.

namespace {

// Collects what the daemon logs while it lives.
class LogCapture {
 public:
  LogCapture() : previous_(spdlog::default_logger()) {
    auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out_);
    spdlog::set_default_logger(std::make_shared<spdlog::logger>("capture", sink));
  }
  ~LogCapture() { spdlog::set_default_logger(previous_); }
  std::string text() const { return out_.str(); }

 private:
  std::ostringstream out_;
  std::shared_ptr<spdlog::logger> previous_;
};

// Forks a child that runs publish() (true: its record exists), then waits until killed; the
// child's pid once publish() succeeded, else -1 (the child is reaped).
template <typename Publish>
pid_t publishing_child(Publish publish) {
  int pipefd[2];
  if (::pipe(pipefd) != 0) return -1;
  pid_t child = ::fork();
  if (child == 0) {
    char c = publish() ? 'y' : 'n';
    (void)!::write(pipefd[1], &c, 1);
    ::pause();
    ::_exit(0);
  }
  char c = 0;
  bool ok = ::read(pipefd[0], &c, 1) == 1 && c == 'y';
  ::close(pipefd[0]);
  ::close(pipefd[1]);
  if (!ok) {
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
    return -1;
  }
  return child;
}

// A child of uid/gid (-1: ours) that publishes a record under prefix and waits; its pid once the
// record exists.
pid_t record_child(const std::string& prefix, int uid = -1, int gid = -1) {
  return publishing_child([&] {
    if (gid >= 0 && ::setgid(gid) != 0) ::_exit(3);
    if (uid >= 0 && ::setuid(uid) != 0) ::_exit(3);
    std::string why;
    auto w =
        shm::RecordWriter::create(shm::RecordWriter::self_name(prefix), "/bin/c", "c", 1, &why);
    shm::DeviceCounters d{};
    if (w) w->publish({&d, 1}, shm::realtime_ns());
    return w != nullptr;
  });
}

void end_children(const std::vector<pid_t>& pids) {
  for (pid_t p : pids) {
    ::kill(p, SIGKILL);
    ::waitpid(p, nullptr, 0);
  }
}

}  // namespace

// Issue 20, item 15: series are a GPU's, not a device ordinal's. Three processes on three GPUs
// that each call their GPU device 0 (CUDA_VISIBLE_DEVICES=N), a fourth on GPU 1 as well.

namespace {

const char* kGpuUuids[] = {"GPU-0a1b2c3d-0000-4000-8000-000000000000",
                           "GPU-0a1b2c3d-1111-4000-8000-111111111111",
                           "GPU-0a1b2c3d-2222-4000-8000-222222222222"};

shm::DeviceCounters device_on(const char* uuid, int ordinal, std::uint64_t reserved,
                              std::uint64_t free) {
  shm::DeviceCounters d{};
  std::array<std::uint8_t, shm::kUuidBytes> u{};
  if (uuid) {
    EXPECT_TRUE(shm::parse_uuid_text(uuid, &u));
  }
  std::copy(u.begin(), u.end(), d.uuid);
  d.ordinal = ordinal;
  d.bytes_reserved = reserved;
  d.bytes_allocated = reserved / 2;
  d.device_free = free;
  d.device_total = 80ull << 30;
  return d;
}

// A child that publishes these devices under prefix and waits; its pid once the record exists.
pid_t devices_child(const std::string& prefix, std::vector<shm::DeviceCounters> devices) {
  return publishing_child([&] {
    std::string why;
    auto w = shm::RecordWriter::create(shm::RecordWriter::self_name(prefix), "/bin/train",
                                       "train.py", 1, &why);
    if (w) w->publish({devices.data(), devices.size()}, shm::realtime_ns());
    return w != nullptr;
  });
}

std::vector<std::string> lines_of(const std::string& text, const std::string& metric) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);)
    if (l.rfind(metric + "{", 0) == 0 || l.rfind(metric + " ", 0) == 0) out.push_back(l);
  return out;
}

}  // namespace

TEST(GpuInventory, ReadsTheDriversListInBusOrder) {
  // Created out of order: the index is the bus order, not the directory's.
  test::GpuFixture gpus({{"0000:81:00.0", kGpuUuids[2], "NVIDIA H200", 2},
                         {"0000:01:00.0", kGpuUuids[0], "NVIDIA H200", 0},
                         {"0000:41:00.0", kGpuUuids[1], "NVIDIA A100-SXM4-80GB", 1}});
  auto inv = shm::GpuInventory::read(gpus.dir());
  ASSERT_EQ(inv.gpus().size(), 3u);
  for (int i = 0; i < 3; ++i) {
    std::array<std::uint8_t, shm::kUuidBytes> u{};
    ASSERT_TRUE(shm::parse_uuid_text(kGpuUuids[i], &u));
    const shm::GpuInfo* g = inv.find(u);
    ASSERT_TRUE(g) << i;
    EXPECT_EQ(g->index, i);
    EXPECT_EQ(g->minor, i);
  }
  EXPECT_EQ(inv.gpus()[1].name, "NVIDIA A100-SXM4-80GB");
  EXPECT_EQ(inv.gpus()[1].bus_id, "0000:41:00.0");
  EXPECT_FALSE(inv.find(std::array<std::uint8_t, shm::kUuidBytes>{}));  // unknown UUID
  EXPECT_TRUE(shm::GpuInventory::read(gpus.dir() + "/none").gpus().empty());
  shm::GpuInfo g;
  EXPECT_FALSE(shm::GpuInventory::parse_information("Model: x\nGPU UUID: GPU-zz\n", &g));
  ASSERT_TRUE(shm::GpuInventory::parse_information(
      "Model: \t\t Bad\x1b[2Jname\nGPU UUID: \t " + std::string(kGpuUuids[0]) + "\n", &g));
  EXPECT_EQ(g.name, "Bad?[2Jname");  // no escape sequences into terminals or labels
  EXPECT_EQ(g.minor, -1);
}

TEST_F(TableTest, PrometheusLabelsSeriesByGpuAndExportsGpuFiguresOnce) {
  test::GpuFixture gpus({{"0000:81:00.0", kGpuUuids[2], "NVIDIA H200", 5},
                         {"0000:01:00.0", kGpuUuids[0], "NVIDIA H200", 3},
                         {"0000:41:00.0", kGpuUuids[1], "NVIDIA H200", 4}});
  std::vector<pid_t> pids;
  for (int i = 0; i < 3; ++i)
    pids.push_back(devices_child(g_.prefix, {device_on(kGpuUuids[i], 0, (i + 1) << 20, 70)}));
  // Started last, so published last: GPU 1's free memory is this process's figure.
  pids.push_back(devices_child(g_.prefix, {device_on(kGpuUuids[1], 0, 9 << 20, 60)}));
  for (pid_t p : pids) ASSERT_GT(p, 0);
  DaemonConfig c = config();
  c.nvidia_gpus_dir = gpus.dir();
  c.hostname = "node-7";
  ProcessTable t(c);
  t.sample();
  ASSERT_EQ(t.processes().size(), 4u);
  std::string text = format_prometheus(t);
  end_children(pids);
  for (int i = 0; i < 3; ++i) {
    std::string gpu = "UUID=\"" + std::string(kGpuUuids[i]) + "\",gpu=\"" + std::to_string(i) +
                      "\",device=\"nvidia" + std::to_string(i + 3) +
                      "\",modelName=\"NVIDIA H200\",pci_bus_id=\"" +
                      (i == 0   ? "0000:01:00.0"
                       : i == 1 ? "0000:41:00.0"
                                : "0000:81:00.0") +
                      "\",Hostname=\"node-7\"";
    EXPECT_NE(text.find("gpustitch_reserved_bytes{pid=\"" + std::to_string(pids[i]) + "\",user=\"" +
                        shm::user_name(::geteuid()) + "\",command=\"train.py\",cuda_device=\"0\"," +
                        gpu + "} " + std::to_string((i + 1) << 20) + "\n"),
              std::string::npos)
        << text;
    // Per GPU, once, without the process's labels.
    EXPECT_NE(text.find("gpustitch_device_total_bytes{" + gpu + "} " + std::to_string(80ull << 30) +
                        "\n"),
              std::string::npos)
        << text;
    EXPECT_NE(text.find("gpustitch_device_free_bytes{" + gpu + "} " + (i == 1 ? "60" : "70")),
              std::string::npos)
        << text;
  }
  EXPECT_EQ(lines_of(text, "gpustitch_device_total_bytes").size(), 3u) << text;
  EXPECT_EQ(lines_of(text, "gpustitch_device_free_bytes").size(), 3u) << text;
  EXPECT_EQ(lines_of(text, "gpustitch_reserved_bytes").size(), 4u) << text;
  EXPECT_EQ(text.find("pid=\"" + std::to_string(pids[0]) + "\",device="), std::string::npos);

  // The same through the socket: each device names its GPU.
  Peer owner{::geteuid(), ::getegid(), ::getpid(), {}};
  json list = json::parse(handle_request(R"({"cmd":"list","summary":true})", owner, t, c));
  std::map<std::uint64_t, std::uint64_t> gpu_of;
  for (const auto& p : list["processes"]) {
    ASSERT_EQ(p["devices"].size(), 1u);
    EXPECT_EQ(p["devices"][0]["gpu_name"], "NVIDIA H200");
    gpu_of[p["pid"].get<std::uint64_t>()] = p["devices"][0]["gpu"].get<std::uint64_t>();
  }
  EXPECT_EQ(gpu_of, (std::map<std::uint64_t, std::uint64_t>{{std::uint64_t(pids[0]), 0},
                                                            {std::uint64_t(pids[1]), 1},
                                                            {std::uint64_t(pids[2]), 2},
                                                            {std::uint64_t(pids[3]), 1}}));
}

// A record is its process's word. One that lists a device twice, or a GPU the driver does not
// list, must neither make duplicate series (Prometheus drops the node's whole scrape over one)
// nor borrow a listed GPU's labels.
TEST_F(TableTest, PrometheusNeverExportsOneSeriesTwice) {
  test::GpuFixture gpus({{"0000:01:00.0", kGpuUuids[0], "NVIDIA H200", 0}});
  const char* unlisted = "GPU-53494d53-0000-0000-0000-000000000000";
  pid_t child = devices_child(
      g_.prefix, {device_on(kGpuUuids[0], 0, 1 << 20, 5), device_on(kGpuUuids[0], 0, 2 << 20, 5),
                  device_on(unlisted, 1, 3 << 20, 5), device_on(nullptr, 2, 4 << 20, 5),
                  device_on(nullptr, 2, 4 << 20, 5)});
  ASSERT_GT(child, 0);
  DaemonConfig c = config();
  c.nvidia_gpus_dir = gpus.dir();
  ProcessTable t(c);
  t.sample();
  std::string text = format_prometheus(t);
  end_children({child});
  auto reserved = lines_of(text, "gpustitch_reserved_bytes");
  EXPECT_EQ(reserved.size(), 3u) << text;
  std::set<std::string> label_sets;
  for (const auto& l : reserved) label_sets.insert(l.substr(0, l.rfind(' ')));
  EXPECT_EQ(label_sets.size(), reserved.size());
  EXPECT_NE(text.find("UUID=\"" + std::string(unlisted) + "\",Hostname="), std::string::npos)
      << text;
  // Two GPUs with a UUID, one series each; the UUID-less device has none.
  EXPECT_EQ(lines_of(text, "gpustitch_device_total_bytes").size(), 2u) << text;
}

// Stray names (here: claiming a uid that does not own the file, so they cannot be removed) are
// judged once, not re-examined against /proc on every pass.
TEST_F(TableTest, StrayNamesAreJudgedOnceNotEveryPass) {
  const int n = 300;
  for (int i = 0; i < n; ++i) {
    shm::RecordName stray{g_.prefix, ::geteuid() + 4242, 0x3ffffff0 - i, 12345};
    int fd = ::open(stray.path().c_str(), O_CREAT | O_WRONLY | O_EXCL, 0600);
    ASSERT_GE(fd, 0);
    ::close(fd);
  }
  auto w = own_record(9);
  ProcessTable t(config());
  auto first = t.sample();
  EXPECT_EQ(first.examined, std::size_t(n) + 1);
  EXPECT_TRUE(t.find(::getpid()));
  for (int pass = 0; pass < 3; ++pass) {
    auto s = t.sample();
    EXPECT_EQ(s.discovered, std::size_t(n) + 1);
    EXPECT_EQ(s.examined, 0u) << "pass " << pass;
    EXPECT_EQ(s.rejected, std::size_t(n));
  }
  EXPECT_EQ(t.find(::getpid())->snapshot.devices[0].bytes_allocated, 9u);  // still sampled
  // A name replaced by a new object (new inode) is judged again.
  shm::RecordName again{g_.prefix, ::geteuid() + 4242, 0x3ffffff0, 12345};
  ASSERT_EQ(::unlink(again.path().c_str()), 0);
  int fd = ::open(again.path().c_str(), O_CREAT | O_WRONLY | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  int keep = ::open(shm::RecordName{g_.prefix, 1, 1, 1}.path().c_str(), O_CREAT | O_WRONLY, 0600);
  ::close(fd);
  EXPECT_EQ(t.sample().examined, 2u);  // the new object, and a name never seen
  ::close(keep);
}

TEST_F(TableTest, OneUserCannotFillMaxRecords) {
  LogCapture log;
  DaemonConfig c = config();
  c.max_records = 4;
  c.max_records_per_uid = 2;
  // Root's processes count only towards max_records: as root, play the user with nobody.
  const bool root = ::geteuid() == 0;
  const int uid = root ? 65534 : -1;
  std::vector<pid_t> kids;
  for (int i = 0; i < 3; ++i) {
    pid_t k = record_child(g_.prefix, uid, uid);
    ASSERT_GT(k, 0);
    kids.push_back(k);
  }
  ProcessTable t(c);
  auto s = t.sample();
  EXPECT_EQ(t.processes().size(), 2u);
  EXPECT_EQ(s.over_quota, 1u);
  EXPECT_NE(log.text().find("max_records_per_uid"), std::string::npos) << log.text();
  // Logged once, not every pass.
  t.sample();
  std::string text = log.text();
  EXPECT_EQ(text.find("max_records_per_uid"), text.rfind("max_records_per_uid")) << text;
  if (root) {
    // Another user's process is still tracked.
    pid_t other = record_child(g_.prefix, 1, 1);
    ASSERT_GT(other, 0);
    t.sample();
    EXPECT_TRUE(t.find(other));
    EXPECT_EQ(t.processes().size(), 3u);
    end_children({other});
    t.sample();
  }
  // One of the user's tracked processes exits: the waiting one is tracked in its place.
  pid_t gone = t.processes().begin()->first;
  end_children({gone});
  std::erase(kids, gone);
  t.sample();
  t.sample();
  EXPECT_EQ(t.processes().size(), 2u);
  EXPECT_FALSE(t.find(gone));
  for (pid_t k : kids) EXPECT_TRUE(t.find(k));
  end_children(kids);
}

TEST_F(TableTest, MaxRecordsBitingIsLogged) {
  LogCapture log;
  DaemonConfig c = config();
  c.max_records = 1;
  std::vector<pid_t> kids{record_child(g_.prefix), record_child(g_.prefix)};
  ASSERT_GT(kids[0], 0);
  ASSERT_GT(kids[1], 0);
  ProcessTable t(c);
  auto s = t.sample();
  EXPECT_EQ(t.processes().size(), 1u);
  EXPECT_EQ(s.over_quota, 1u);
  EXPECT_NE(log.text().find("max_records"), std::string::npos) << log.text();
  end_children(kids);
}

// A record may claim 16 devices; history (the daemon's largest memory) follows the node's devices.
TEST_F(TableTest, HistoryIsBoundedByTheNodesDevices) {
  LogCapture log;
  std::string why;
  auto w = shm::RecordWriter::create(shm::RecordWriter::self_name(g_.prefix), "/bin/own", "own",
                                     100, &why);
  ASSERT_TRUE(w) << why;
  std::vector<shm::DeviceCounters> devs(shm::kMaxDevices);
  for (std::size_t i = 0; i < devs.size(); ++i) devs[i].bytes_allocated = i + 1;
  w->publish({devs.data(), devs.size()}, shm::realtime_ns());
  DaemonConfig c = config();
  c.max_devices = 2;
  ProcessTable t(c);
  EXPECT_EQ(t.device_limit(), 2u);
  t.sample();
  t.sample();
  const TrackedProcess* p = t.find(::getpid());
  ASSERT_TRUE(p);
  EXPECT_EQ(p->snapshot.devices.size(), std::size_t(shm::kMaxDevices));  // the counters stay
  EXPECT_EQ(p->history.size(), 2u);
  EXPECT_EQ(p->history[1].points().back().allocated, 2u);
  EXPECT_NE(log.text().find("claims 16 devices"), std::string::npos) << log.text();
  // Without a driver to ask, at most what a record can hold.
  EXPECT_LE(ProcessTable(config()).device_limit(), std::size_t(shm::kMaxDevices));
  EXPECT_FALSE(parse_daemon_config("max_devices = 17\n").errors.empty());
  EXPECT_EQ(parse_daemon_config("max_records_per_uid = 3\n").config.max_records_per_uid, 3u);
}

// Hardening issue, item 14: the pass figures count every user's records; a user sees only their
// own processes' count.
TEST_F(TableTest, StatusShowsNodeWideFiguresOnlyToThoseWhoSeeAll) {
  auto w = own_record(5);
  ProcessTable t(config());
  t.sample();
  Peer owner{::geteuid(), ::getegid(), ::getpid(), {}};
  Peer root{0, 0, 1, {}};
  Peer stranger{::geteuid() + 12345, 12345, 1, {}};
  json r = json::parse(handle_request(R"({"cmd":"status"})", root, t, config()));
  EXPECT_TRUE(r.contains("last_pass"));
  EXPECT_EQ(r["tracked"], 1);
  json s = json::parse(handle_request(R"({"cmd":"status"})", stranger, t, config()));
  EXPECT_TRUE(s["ok"].get<bool>());
  EXPECT_FALSE(s.contains("last_pass")) << s.dump();
  EXPECT_EQ(s["tracked"], 0);
  EXPECT_TRUE(s.contains("passes"));
  if (::geteuid() != 0) {
    json o = json::parse(handle_request(R"({"cmd":"status"})", owner, t, config()));
    EXPECT_FALSE(o.contains("last_pass"));
    EXPECT_EQ(o["tracked"], 1);
  }
}

// The metrics endpoint's parser and routing on bytes (what fuzz_http fuzzes).
TEST_F(TableTest, HttpAnswersMetricsAndRefusesTheRest) {
  auto w = own_record(77);
  ProcessTable t(config());
  t.sample();
  auto get = http_answer("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", t);
  ASSERT_TRUE(get);
  EXPECT_EQ(get->rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << *get;
  EXPECT_NE(get->find("# HELP gpustitch_allocated_bytes"), std::string::npos);
  auto head = http_answer("HEAD /metrics HTTP/1.1\r\n\r\n", t);
  ASSERT_TRUE(head);
  EXPECT_EQ(head->rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << *head;
  EXPECT_EQ(head->find("# HELP"), std::string::npos);
  std::size_t body = get->size() - get->find("\r\n\r\n") - 4;
  EXPECT_NE(head->find("Content-Length: " + std::to_string(body)), std::string::npos) << *head;
  auto other = http_answer("GET /other HTTP/1.0\r\n\r\n", t);
  ASSERT_TRUE(other);
  EXPECT_NE(other->find(" 404 "), std::string::npos);
  EXPECT_FALSE(http_answer("POST /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", t));
  EXPECT_FALSE(http_answer("garbage\r\n\r\n", t));
  EXPECT_FALSE(
      http_answer("GET /metrics HTTP/1.1\r\nX: " + std::string(10000, 'a') + "\r\n\r\n", t));
  EXPECT_FALSE(http_answer("GET /metrics HTTP/1.1\r\n", t));  // incomplete
}
