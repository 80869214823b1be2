// A simulated device shared by several backends and processes (sim_shared:NAME): one capacity,
// one UUID, never over-committed even when processes race for the last bytes.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "gpustitch/backend_factory.h"
#include "gpustitch/config.h"
#include "gpustitch/sim_backend.h"

using namespace gpustitch;

namespace {

std::string unique_name(const char* what) {
  return std::string("test-") + what + "-" + std::to_string(getpid());
}

struct SharedName {
  std::string name;
  explicit SharedName(const char* what) : name(unique_name(what)) {
    SimBackend::unlink_shared(name);
  }
  ~SharedName() { SimBackend::unlink_shared(name); }
};

SimOptions shared_options(const std::string& name, std::size_t capacity) {
  SimOptions o;
  o.devices = 2;
  o.capacity = capacity;
  o.shared_name = name;
  return o;
}

}  // namespace

TEST(SimShared, TwoBackendsShareOneCapacityAndOneUuid) {
  SharedName n("two");
  SimBackend a(shared_options(n.name, 64 * MiB));
  SimBackend b(shared_options(n.name, 64 * MiB));
  ASSERT_TRUE(a.shared());
  ASSERT_TRUE(b.shared());
  DeviceUuid ua{}, ub{}, ua1{};
  ASSERT_EQ(a.device_uuid(0, &ua), Status::ok);
  ASSERT_EQ(b.device_uuid(0, &ub), Status::ok);
  ASSERT_EQ(a.device_uuid(1, &ua1), Status::ok);
  EXPECT_EQ(ua, ub);
  EXPECT_NE(ua, ua1);

  PhysHandle h1 = 0, h2 = 0, h3 = 0;
  ASSERT_EQ(a.create(0, 48 * MiB, &h1), Status::ok);
  std::size_t free = 0, total = 0;
  ASSERT_EQ(b.mem_info(0, &free, &total), Status::ok);
  EXPECT_EQ(free, 16 * MiB);
  EXPECT_EQ(total, 64 * MiB);
  EXPECT_EQ(b.create(0, 32 * MiB, &h2), Status::out_of_memory);
  ASSERT_EQ(b.create(1, 32 * MiB, &h3), Status::ok);  // the other device is separate
  ASSERT_EQ(a.release(h1), Status::ok);
  ASSERT_EQ(b.create(0, 32 * MiB, &h2), Status::ok);
  ASSERT_EQ(a.mem_info(0, &free, &total), Status::ok);
  EXPECT_EQ(free, 32 * MiB);
  EXPECT_EQ(b.release(h2), Status::ok);
  EXPECT_EQ(b.release(h3), Status::ok);
}

TEST(SimShared, DifferentNamesAndPrivateDevicesDoNotShare) {
  SharedName n1("n1"), n2("n2");
  SimBackend a(shared_options(n1.name, 64 * MiB));
  SimBackend b(shared_options(n2.name, 64 * MiB));
  SimBackend c(SimOptions{.devices = 1, .capacity = 64 * MiB});
  EXPECT_FALSE(c.shared());
  DeviceUuid ua{}, ub{};
  ASSERT_EQ(a.device_uuid(0, &ua), Status::ok);
  ASSERT_EQ(b.device_uuid(0, &ub), Status::ok);
  EXPECT_NE(ua, ub);
  PhysHandle h1 = 0, h2 = 0, h3 = 0;
  ASSERT_EQ(a.create(0, 64 * MiB, &h1), Status::ok);
  ASSERT_EQ(b.create(0, 64 * MiB, &h2), Status::ok);
  ASSERT_EQ(c.create(0, 64 * MiB, &h3), Status::ok);
}

TEST(SimShared, ABackendDestroyedWithHandlesGivesTheirBytesBack) {
  SharedName n("dtor");
  SimBackend a(shared_options(n.name, 64 * MiB));
  {
    SimBackend b(shared_options(n.name, 64 * MiB));
    PhysHandle h = 0;
    ASSERT_EQ(b.create(0, 64 * MiB, &h), Status::ok);
    std::size_t free = 1;
    ASSERT_EQ(a.mem_info(0, &free, nullptr), Status::ok);
    EXPECT_EQ(free, 0u);
  }
  std::size_t free = 0;
  ASSERT_EQ(a.mem_info(0, &free, nullptr), Status::ok);
  EXPECT_EQ(free, 64 * MiB);
}

TEST(SimShared, ProcessesRacingForTheLastBytesNeverOverCommit) {
  SharedName n("race");
  const std::size_t g = 2 * MiB;
  const std::size_t capacity = 200 * g;
  constexpr int kProcs = 4;
  int pipes[kProcs][2];
  int hold[2];  // children keep their handles until the parent closes this pipe's write end
  ASSERT_EQ(pipe(hold), 0);
  std::vector<pid_t> kids;
  for (int i = 0; i < kProcs; ++i) {
    ASSERT_EQ(pipe(pipes[i]), 0);
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      auto b_owner = std::make_unique<SimBackend>(shared_options(n.name, capacity));
      SimBackend& b = *b_owner;
      unsigned got = 0;
      PhysHandle h = 0;
      // Take granules until the device says no; keep them until the parent has counted.
      while (got < 1000 && b.create(0, g, &h) == Status::ok) ++got;
      (void)!write(pipes[i][1], &got, sizeof got);
      close(hold[1]);
      char c;
      (void)!read(hold[0], &c, 1);  // returns once the parent has counted
      const bool shared = b.shared();
      b_owner.reset();  // gives the handles back (_exit runs no destructors)
      _exit(shared ? 0 : 2);
    }
    kids.push_back(pid);
  }
  unsigned total = 0;
  for (int i = 0; i < kProcs; ++i) {
    unsigned got = 0;
    ASSERT_EQ(read(pipes[i][0], &got, sizeof got), static_cast<ssize_t>(sizeof got));
    total += got;
  }
  EXPECT_EQ(total, 200u);  // exactly the capacity: every granule taken once, none over
  close(hold[1]);
  close(hold[0]);
  for (pid_t pid : kids) {
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  for (int i = 0; i < kProcs; ++i) close(pipes[i][0]), close(pipes[i][1]);
  // Every process released (destructor): the whole capacity is free again.
  SimBackend a(shared_options(n.name, capacity));
  std::size_t free = 0;
  ASSERT_EQ(a.mem_info(0, &free, nullptr), Status::ok);
  EXPECT_EQ(free, capacity);
}

TEST(SimShared, ConfigKeyReachesTheBackend) {
  SharedName n("config");
  ConfigResult r = parse_config("backend:sim,sim_capacity_mb:64,sim_shared:" + n.name);
  ASSERT_TRUE(r.errors.empty());
  EXPECT_EQ(r.config.sim_shared, n.name);
  auto a = make_sim_backend(r.config);
  auto b = make_sim_backend(r.config);
  DeviceUuid ua{}, ub{};
  ASSERT_EQ(a->device_uuid(0, &ua), Status::ok);
  ASSERT_EQ(b->device_uuid(0, &ub), Status::ok);
  EXPECT_EQ(ua, ub);
  EXPECT_FALSE(parse_config("sim_shared:a/b").errors.empty());
  EXPECT_FALSE(parse_config("sim_shared:").errors.empty());
  ConfigResult c = parse_config("coop:off,coop_wait_ms:200,coop_rate:10");
  ASSERT_TRUE(c.errors.empty());
  EXPECT_FALSE(c.config.coop);
  EXPECT_EQ(c.config.coop_wait_ms, 200u);
  EXPECT_EQ(c.config.coop_rate, 10u);
  EXPECT_TRUE(Config{}.coop);
  EXPECT_FALSE(parse_config("coop_rate:0").errors.empty());
  EXPECT_FALSE(parse_config("coop_wait_ms:9999").errors.empty());
}
