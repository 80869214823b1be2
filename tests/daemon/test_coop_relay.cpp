// gpustitchd's cooperative-release part (daemon/src/coop_relay.h) against real records and real
// sockets: the floor asks the processes holding cache, the relay forwards across users only for
// a process really on that GPU, and the kernel's credentials decide who may ask.
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>

#include <gtest/gtest.h>

#include "coop_relay.h"
#include "daemon_config.h"
#include "gpustitch/shm/names.h"
#include "gpustitch/shm/record_writer.h"
#include "process_table.h"
#include "test_helpers.h"

using namespace gpustitch;
using namespace gpustitch::daemon;
using nlohmann::json;

namespace {

const Uuid kGpu = {0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88,
                   0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0xff, 0x01};
const char* kGpuText = "GPU-11223344-5566-7788-99aa-bbccddeeff01";

// The driver's answer, as the test wants it.
class FakeMembership : public GpuMembership {
 public:
  explicit FakeMembership(std::function<std::optional<bool>(pid_t, const Uuid&)> f)
      : f_(std::move(f)) {}
  std::optional<bool> on_gpu(pid_t pid, const Uuid& uuid) override { return f_(pid, uuid); }

 private:
  std::function<std::optional<bool>(pid_t, const Uuid&)> f_;
};

// A membership where every process is on the GPU its record names (what the tests' records say
// is true).
std::unique_ptr<GpuMembership> believe_records() {
  return std::make_unique<FakeMembership>([](pid_t, const Uuid&) { return true; });
}
std::unique_ptr<GpuMembership> driver_says(std::optional<bool> answer) {
  return std::make_unique<FakeMembership>([answer](pid_t, const Uuid&) { return answer; });
}

class CoopRelayTest : public ::testing::Test {
 protected:
  DaemonConfig config() {
    DaemonConfig c;
    c.record_prefix = g_.prefix;
    return c;
  }
  // This process's record: one device on kGpu with `cached` idle bytes and `free` device free.
  std::unique_ptr<shm::RecordWriter> own_record(std::uint64_t cached, std::uint64_t free,
                                                std::uint64_t program = 0) {
    std::string why;
    auto w = shm::RecordWriter::create(shm::RecordWriter::self_name(g_.prefix), "/bin/own", "own",
                                       100, &why);
    EXPECT_TRUE(w) << why;
    shm::DeviceCounters d{};
    d.bytes_reserved = cached + (64ull << 20);
    d.bytes_allocated = 64ull << 20;
    d.bytes_cached = cached;
    d.device_free = free;
    d.device_total = 80ull << 30;
    d.program_held_bytes = program;
    d.program_mapped_bytes = program;
    std::memcpy(d.uuid, kGpu.data(), kGpu.size());
    w->publish({&d, 1}, shm::realtime_ns());
    return w;
  }
  test::PrefixGuard g_;
};

}  // namespace

TEST(CoopRelayParse, Uuids) {
  auto u = parse_uuid(kGpuText);
  ASSERT_TRUE(u);
  EXPECT_EQ(*u, kGpu);
  EXPECT_FALSE(parse_uuid("GPU-1122"));
  EXPECT_FALSE(parse_uuid("GPU-11223344-5566-7788-99aa-bbccddeeff0"));     // odd digits
  EXPECT_FALSE(parse_uuid("GPU-11223344-5566-7788-99aa-bbccddeeff0102"));  // too long
  EXPECT_FALSE(parse_uuid("GPU-1122334x-5566-7788-99aa-bbccddeeff01"));
}

TEST(CoopRelayConfig, FloorKey) {
  auto r = parse_daemon_config("coop_floor_mb = 2048\n");
  EXPECT_TRUE(r.errors.empty());
  EXPECT_EQ(r.config.coop_floor_mb, 2048u);
  EXPECT_FALSE(parse_daemon_config("coop_floor_mb = lots\n").errors.empty());
  EXPECT_EQ(DaemonConfig{}.coop_floor_mb, 0u);
}

// Memory a process maps itself (cuMemCreate/cuMemMap) is on the GPU but not the pool's to give.
TEST_F(CoopRelayTest, NeverAsksForMemoryTheProgramMappedItself) {
  {
    auto w = own_record(512ull << 20, 1ull << 30, 10ull << 30);
    ProcessTable t(config());
    t.sample();
    auto plan = plan_release(t.processes(), kGpu, 8ull << 30);
    ASSERT_EQ(plan.size(), 1u);
    EXPECT_EQ(plan[0].bytes, 512ull << 20);
  }
  auto w = own_record(0, 1ull << 30, 10ull << 30);
  ProcessTable t(config());
  t.sample();
  EXPECT_TRUE(plan_release(t.processes(), kGpu, 8ull << 30).empty());
}

TEST_F(CoopRelayTest, PlansLargestCacheFirstAndNeverMoreThanWanted) {
  auto w = own_record(512ull << 20, 1ull << 30);
  ProcessTable t(config());
  t.sample();
  auto plan = plan_release(t.processes(), kGpu, 100ull << 20);
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_EQ(plan[0].pid, ::getpid());
  EXPECT_EQ(plan[0].bytes, 100ull << 20);
  EXPECT_EQ(plan_release(t.processes(), kGpu, 1ull << 40)[0].bytes, 512ull << 20);
  EXPECT_TRUE(plan_release(t.processes(), kGpu, 1ull << 20, ::geteuid()).empty());
  Uuid other = kGpu;
  other[0] ^= 1;
  EXPECT_TRUE(plan_release(t.processes(), other, 1ull << 20).empty());
  auto below = gpus_below_floor(t.processes(), 3ull << 30);
  ASSERT_EQ(below.size(), 1u);
  EXPECT_EQ(below[0].second, 2ull << 30);
  EXPECT_TRUE(gpus_below_floor(t.processes(), 1ull << 30).empty());
}

TEST_F(CoopRelayTest, TheFloorAsksTheProcessHoldingCache) {
  auto w = own_record(512ull << 20, 256ull << 20);
  auto start = shm::process_start_time(0);
  ASSERT_TRUE(start);
  auto listener = coop::Socket::listen(::getpid(), *start);  // plays the preloaded process
  ASSERT_TRUE(listener);
  ProcessTable t(config());
  t.sample();
  CoopRelay relay(believe_records());
  DaemonConfig off = config();
  relay.after_sample(t, off);  // coop_floor_mb 0: nothing
  EXPECT_FALSE(listener->receive(100));
  DaemonConfig c = config();
  c.coop_floor_mb = 512;
  relay.after_sample(t, c);
  auto r = listener->receive(1000);
  ASSERT_TRUE(r && r->message);
  EXPECT_EQ(r->message->kind, coop::Kind::request);
  EXPECT_EQ(r->message->bytes, 256ull << 20);  // what brings free back to the floor
  EXPECT_EQ(std::memcmp(r->message->uuid, kGpu.data(), kGpu.size()), 0);
  EXPECT_EQ(r->sender.uid, ::geteuid());
  relay.after_sample(t, c);  // within the second: no second round
  EXPECT_FALSE(listener->receive(100));
  EXPECT_EQ(relay.floor_requests(), 1u);
}

TEST_F(CoopRelayTest, RelayAnswersOnlyAProcessOnThatGpu) {
  auto w = own_record(0, 1ull << 30);
  ProcessTable t(config());
  t.sample();
  CoopRelay relay(believe_records());
  DaemonConfig c = config();
  const std::string ask =
      std::string(R"({"cmd":"coop_release","uuid":")") + kGpuText + R"(","bytes":1048576})";
  EXPECT_FALSE(relay.handle(R"({"cmd":"list"})", Peer{::geteuid(), 0, ::getpid(), {}}, t, c));
  // A peer that is not a tracked process: refused like an unknown pid.
  auto stranger = relay.handle(ask, Peer{::geteuid(), 0, 1, {}}, t, c);
  ASSERT_TRUE(stranger);
  EXPECT_EQ(json::parse(*stranger)["error"], "not found");
  // The tracked process itself, on that GPU: accepted (no other user's process to ask here).
  auto mine = relay.handle(ask, Peer{::geteuid(), 0, ::getpid(), {}}, t, c);
  ASSERT_TRUE(mine);
  json a = json::parse(*mine);
  EXPECT_TRUE(a["ok"].get<bool>()) << a.dump();
  EXPECT_EQ(a["asked"], 0);
  // Another GPU: not found. Malformed: an error, never a crash.
  std::string other = ask;
  other.replace(other.find("ff01"), 4, "ff02");
  EXPECT_EQ(json::parse(*relay.handle(other, Peer{::geteuid(), 0, ::getpid(), {}}, t, c))["error"],
            "not found");
  auto bad = relay.handle(R"({"cmd":"coop_release","uuid":5})", Peer{}, t, c);
  ASSERT_TRUE(bad);
  EXPECT_FALSE(json::parse(*bad)["ok"].get<bool>());
  // Rate limit per asking user: a burst of 4, then refusals.
  int limited = 0;
  for (int i = 0; i < 10; ++i) {
    auto r = relay.handle(ask, Peer{::geteuid(), 0, ::getpid(), {}}, t, c);
    if (json::parse(*r).value("error", "") == "rate limited") ++limited;
  }
  EXPECT_GE(limited, 6);
}

namespace {

// Across users: a process of another user (nobody) holding cache on kGpu listens; this process,
// whose record says it is on kGpu, asks the relay. What the listener received within wait_ms
// ({sender uid, origin pid, bytes}, -1 each when nothing) and the relay's answer.
struct RelayOutcome {
  long long got[3] = {-1, -1, -1};
  json answer;
};

RelayOutcome relay_to_other_user(const std::string& prefix, const DaemonConfig& config,
                                 std::unique_ptr<GpuMembership> membership, int wait_ms) {
  RelayOutcome out;
  int ready[2], result[2];
  EXPECT_EQ(pipe(ready), 0);
  EXPECT_EQ(pipe(result), 0);
  pid_t child = fork();
  if (child == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(3);
    std::string why;
    auto rw = shm::RecordWriter::create(shm::RecordWriter::self_name(prefix), "/bin/other", "other",
                                        100, &why);
    if (!rw) _exit(4);
    shm::DeviceCounters d{};
    d.bytes_cached = 1ull << 30;
    d.bytes_reserved = 1ull << 30;
    d.device_free = 1ull << 30;
    d.device_total = 80ull << 30;
    std::memcpy(d.uuid, kGpu.data(), kGpu.size());
    rw->publish({&d, 1}, shm::realtime_ns());
    auto start = shm::process_start_time(0);
    auto l = coop::Socket::listen(::getpid(), start.value_or(0));
    if (!l) _exit(5);
    (void)!write(ready[1], "r", 1);
    auto r = l->receive(wait_ms);
    long long got[3] = {-1, -1, -1};
    if (r && r->message) {
      got[0] = r->sender.uid;
      got[1] = r->message->origin_pid;
      got[2] = static_cast<long long>(r->message->bytes);
    }
    (void)!write(result[1], got, sizeof got);
    rw->remove();
    _exit(0);
  }
  char c;
  EXPECT_EQ(read(ready[0], &c, 1), 1);
  ProcessTable t(config);
  t.sample();
  EXPECT_TRUE(t.find(child));
  CoopRelay relay(std::move(membership));
  const std::string ask =
      std::string(R"({"cmd":"coop_release","uuid":")") + kGpuText + R"(","bytes":268435456})";
  auto answer = relay.handle(ask, Peer{::geteuid(), 0, ::getpid(), {}}, t, config);
  EXPECT_TRUE(answer);
  if (answer) out.answer = json::parse(*answer);
  EXPECT_EQ(read(result[0], out.got, sizeof out.got), static_cast<ssize_t>(sizeof out.got));
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  for (int fd : {ready[0], ready[1], result[0], result[1]}) close(fd);
  return out;
}

}  // namespace

// The daemon asks the other user's process as root, with our pid as origin, when the driver
// shows us on that GPU.
TEST_F(CoopRelayTest, RelaysToAnotherUsersProcessAsRoot) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a process as another user";
  auto w = own_record(0, 1ull << 30);
  auto pid = ::getpid();
  auto only_us = std::make_unique<FakeMembership>(
      [pid](pid_t p, const Uuid& u) { return p == pid && u == kGpu; });
  RelayOutcome o = relay_to_other_user(g_.prefix, config(), std::move(only_us), 5000);
  EXPECT_EQ(o.answer["asked"], 1) << o.answer.dump();
  EXPECT_EQ(o.answer["bytes"], 268435456u);
  EXPECT_EQ(o.got[0], 0);           // from root, as the other user's process requires
  EXPECT_EQ(o.got[1], ::getpid());  // on behalf of the asker
  EXPECT_EQ(o.got[2], 268435456);
}

// Hardening issue, item 4: a record naming another user's GPU is not enough. Our record claims
// kGpu, the driver does not show us there: nothing is relayed.
TEST_F(CoopRelayTest, AForgedGpuInARecordRelaysNothing) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a process as another user";
  auto w = own_record(0, 1ull << 30);
  RelayOutcome o = relay_to_other_user(g_.prefix, config(), driver_says(false), 1000);
  EXPECT_FALSE(o.answer.value("ok", true)) << o.answer.dump();
  EXPECT_EQ(o.answer.value("error", ""), "not found");
  EXPECT_EQ(o.got[0], -1) << "the other user's process was asked";
}

// Where the driver cannot tell (no NVIDIA driver on the node), the relay refuses too.
TEST_F(CoopRelayTest, NoDriverToAskRelaysNothing) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a process as another user";
  auto w = own_record(0, 1ull << 30);
  RelayOutcome o = relay_to_other_user(g_.prefix, config(), driver_says(std::nullopt), 1000);
  EXPECT_FALSE(o.answer.value("ok", true)) << o.answer.dump();
  EXPECT_EQ(o.got[0], -1) << "the other user's process was asked";
}

// Without root: the refusal itself, from the relay's answer.
TEST_F(CoopRelayTest, TheRelayAsksTheDriverNotTheRecord) {
  auto w = own_record(0, 1ull << 30);
  ProcessTable t(config());
  t.sample();
  const std::string ask =
      std::string(R"({"cmd":"coop_release","uuid":")") + kGpuText + R"(","bytes":1048576})";
  Peer me{::geteuid(), 0, ::getpid(), {}};
  CoopRelay no(driver_says(false));
  EXPECT_EQ(json::parse(*no.handle(ask, me, t, config()))["error"], "not found");
  EXPECT_EQ(no.refused_requests(), 1u);
  CoopRelay unknown(driver_says(std::nullopt));
  EXPECT_FALSE(json::parse(*unknown.handle(ask, me, t, config()))["ok"].get<bool>());
  EXPECT_EQ(unknown.unverified_requests(), 1u);
  CoopRelay yes(driver_says(true));
  EXPECT_TRUE(json::parse(*yes.handle(ask, me, t, config()))["ok"].get<bool>());
}

// The floor believes only reports of processes the driver shows on the GPU: a made-up record
// with no free memory does not make others release.
TEST_F(CoopRelayTest, AForgedLowFreeReportDoesNotTriggerTheFloor) {
  auto w = own_record(512ull << 20, 0);
  auto start = shm::process_start_time(0);
  ASSERT_TRUE(start);
  auto listener = coop::Socket::listen(::getpid(), *start);
  ASSERT_TRUE(listener);
  ProcessTable t(config());
  t.sample();
  DaemonConfig c = config();
  c.coop_floor_mb = 512;
  for (std::optional<bool> answer : {std::optional<bool>(false), std::optional<bool>()}) {
    CoopRelay relay(driver_says(answer));
    relay.after_sample(t, c);
    EXPECT_FALSE(listener->receive(200));
    EXPECT_EQ(relay.floor_requests(), 0u);
  }
  CoopRelay relay(driver_says(true));
  relay.after_sample(t, c);
  EXPECT_TRUE(listener->receive(1000));
  EXPECT_EQ(relay.floor_requests(), 1u);
}

// The driver's view from open device files: a fake driver directory and device files in a
// temporary directory stand for /proc/driver/nvidia/gpus and /dev/nvidia<minor>.
TEST(DriverMembershipTest, OpenDeviceFileOfThatGpu) {
  char tmpl[] = "/tmp/gstest-gpus-XXXXXX";
  ASSERT_TRUE(::mkdtemp(tmpl));
  std::string dir = tmpl;
  std::filesystem::create_directories(dir + "/gpus/0000:3b:00.0");
  std::filesystem::create_directories(dir + "/gpus/0000:5e:00.0");
  std::ofstream(dir + "/gpus/0000:3b:00.0/information")
      << "Model: \t\t NVIDIA H200\nIRQ:   \t\t 100\nGPU UUID: \t " << kGpuText
      << "\nDevice Minor: \t 7\n";
  std::ofstream(dir + "/gpus/0000:5e:00.0/information")
      << "GPU UUID: \t GPU-00000000-0000-0000-0000-000000000002\nDevice Minor: \t 3\n";
  std::ofstream(dir + "/nvidia3") << "";
  std::ofstream(dir + "/nvidia7") << "";
  DriverPaths paths{dir + "/gpus", dir + "/nvidia", "/proc", false};
  Uuid other = *parse_uuid("GPU-00000000-0000-0000-0000-000000000002");
  Uuid absent = kGpu;
  absent[15] ^= 0xff;
  {
    DriverMembership m(paths);
    EXPECT_EQ(m.on_gpu(::getpid(), kGpu), std::optional<bool>(false));    // nothing open yet
    EXPECT_EQ(m.on_gpu(::getpid(), absent), std::optional<bool>(false));  // not on this node
  }
  int fd = ::open((dir + "/nvidia7").c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  {
    DriverMembership m(paths);
    EXPECT_EQ(m.on_gpu(::getpid(), kGpu), std::optional<bool>(true));
    EXPECT_EQ(m.on_gpu(::getpid(), other), std::optional<bool>(false));
    // Another process (pid 1) does not hold it; without the right to read its descriptors the
    // answer is "cannot tell", never "yes".
    EXPECT_NE(m.on_gpu(1, kGpu), std::optional<bool>(true));
  }
  ::close(fd);
  // No driver: cannot tell.
  DriverMembership none(DriverPaths{dir + "/no-such-dir", dir + "/nvidia", "/proc", false});
  EXPECT_EQ(none.on_gpu(::getpid(), kGpu), std::nullopt);
  std::filesystem::remove_all(dir);
  EXPECT_EQ(uuid_text(kGpu), kGpuText);
}
