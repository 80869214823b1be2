// PyTorch snapshot export: the pickle loads in Python's pickle with the values written, and the
// snapshot has the structure torch.cuda.memory._snapshot() documents (check_snapshot.py); the
// request channel delivers a snapshot from a "process" (here: a polling thread of this one).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include "temp_file.h"

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <vector>

#include "gpustitch/trace/pickle_writer.h"
#include "gpustitch/trace/snapshot.h"

using namespace gpustitch;
using namespace gpustitch::trace;

namespace {

std::string temp_path(const std::string& name) {
  return gpustitch::test::temp_file("snap", name);
}

// Runs check_snapshot.py MODE FILE and returns its stdout; empty string when Python is missing.
std::string run_check(const std::string& mode, const std::string& file, int* rc) {
  std::string py = GPUSTITCH_PYTHON3;
  if (py.empty()) return {};
  std::string cmd = py + " " + GPUSTITCH_SNAPSHOT_CHECK + " " + mode + " '" + file + "'";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  std::size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  *rc = pclose(p);
  while (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

#define REQUIRE_PYTHON()                                                      \
  do {                                                                        \
    if (std::string(GPUSTITCH_PYTHON3).empty()) GTEST_SKIP() << "no python3"; \
  } while (0)

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

}  // namespace

TEST(PickleWriter, PythonReadsBackEveryValue) {
  REQUIRE_PYTHON();
  PickleWriter w;
  w.begin_dict();
  w.key("ints");
  w.begin_list();
  for (std::int64_t v :
       {std::int64_t{0}, std::int64_t{255}, std::int64_t{256}, std::int64_t{65535},
        std::int64_t{65536}, std::int64_t{-1}, std::int64_t{INT32_MIN}, std::int64_t{INT32_MAX} + 1,
        std::int64_t{1} << 40, -(std::int64_t{1} << 40), INT64_MIN, INT64_MAX})
    w.integer(v);
  w.uinteger(UINT64_MAX);
  w.uinteger(0x7f8a40000000ull);
  w.end_list();
  w.key("text");
  w.str("na\xc3\xafve \xe2\x9c\x93");
  w.key("misc");
  w.begin_list();
  w.real(1.5);
  w.boolean(true);
  w.boolean(false);
  w.none();
  w.begin_list();
  w.end_list();
  w.begin_dict();
  w.end_dict();
  w.begin_tuple2();
  w.integer(3);
  w.str("x");
  w.end_tuple2();
  w.end_list();
  w.key("long");
  w.begin_list();
  for (int i = 0; i < 2500; ++i) w.integer(i);
  w.end_list();
  w.end_dict();
  std::string path = temp_path("values.pickle");
  write_file(path, w.finish());
  int rc = 0;
  std::string out = run_check("repr", path, &rc);
  ASSERT_EQ(rc, 0) << out;
  std::string longlist;
  for (int i = 0; i < 2500; ++i) longlist += (i ? ", " : "") + std::to_string(i);
  std::string expected =
      "{'ints': [0, 255, 256, 65535, 65536, -1, -2147483648, 2147483648, 1099511627776, "
      "-1099511627776, -9223372036854775808, 9223372036854775807, 18446744073709551615, " +
      std::to_string(0x7f8a40000000ull) +
      "], 'text': 'na\xc3\xafve \xe2\x9c\x93', 'misc': [1.5, True, False, None, [], {}, "
      "(3, 'x')], 'long': [" +
      longlist + "]}";
  EXPECT_TRUE(out == expected) << "python read:\n"
                               << out.substr(0, 400) << "\nexpected:\n"
                               << expected.substr(0, 400);
}

TEST(Snapshot, LiveBlocksBecomePyTorchSegmentsAndBlocks) {
  REQUIRE_PYTHON();
  const DevPtr base = 0x7f0000000000ull;
  std::vector<LiveBlock> blocks;
  auto add = [&](DevPtr p, std::size_t s, int dev, ServedBy how) {
    LiveBlock b;
    b.ptr = p;
    b.size = s;
    b.device = dev;
    b.stream = kAnyStream;
    b.served_by = how;
    blocks.push_back(b);
  };
  add(base, 512, 0, ServedBy::small);  // three small blocks in one 2 MiB page
  add(base + 0x1000, 4096, 0, ServedBy::small);
  add(base + 0x100000, 1000, 0, ServedBy::small);
  add(base + 16 * MiB, 10 * MiB, 0, ServedBy::fresh);         // a large block, own segment
  add(base + 256 * MiB, 4 * MiB + 1, 0, ServedBy::stitched);  // a stitched one
  add(base + 1024 * MiB, 3 * MiB, 1, ServedBy::cache);        // another device
  blocks[3].frames = {{"libtrain.so", 0, "train_step()"}};
  SnapshotData data = build_snapshot(blocks, 2);
  ASSERT_EQ(data.segments.size(), 4u);
  EXPECT_EQ(data.segments[0].segment_type, "small");
  EXPECT_EQ(data.segments[0].total_size, 2 * MiB);
  EXPECT_EQ(data.segments[1].segment_type, "large");
  EXPECT_EQ(data.segments[1].total_size, 10 * MiB);
  EXPECT_TRUE(data.segments[2].is_expandable);
  EXPECT_EQ(data.segments[2].total_size, 6 * MiB);
  EXPECT_EQ(data.segments[3].device, 1);

  std::string path = temp_path("live.pickle");
  std::string why;
  ASSERT_TRUE(write_pytorch_snapshot(data, path, &why)) << why;
  int rc = 0;
  std::string out = run_check("snapshot", path, &rc);
  ASSERT_EQ(rc, 0) << out;
  auto j = nlohmann::json::parse(out);
  EXPECT_EQ(j["segments"], 4);
  EXPECT_EQ(j["blocks"], 6);
  EXPECT_EQ(j["allocated"], 512 + 4096 + 1000 + 10 * MiB + 4 * MiB + 1 + 3 * MiB);
  EXPECT_EQ(j["devices"], 2);
  EXPECT_EQ(j["frames"], nlohmann::json::array({"train_step()"}));
}

TEST(Snapshot, FromTraceHasTheLiveBlocksAndTheTimeline) {
  REQUIRE_PYTHON();
  Trace t;
  auto ev = [&](TraceAction a, std::uint64_t p, std::uint64_t s) {
    TraceEvent e;
    e.action = a;
    e.ptr = p;
    e.size = s;
    e.stream = kAnyStream;
    e.time_s = static_cast<double>(t.events.size());
    t.events.push_back(e);
  };
  ev(TraceAction::allocate, 0x7f0000000000, 8 * MiB);
  ev(TraceAction::allocate, 0x7f0000800000, 4 * MiB);
  ev(TraceAction::allocate, 0x7f0001000000, 2 * MiB);
  ev(TraceAction::free, 0x7f0000800000, 4 * MiB);
  ev(TraceAction::free, 0x7f00ffff0000, 64);  // allocated before the trace began: ignored
  SnapshotData all = snapshot_from_trace(t);
  std::string path = temp_path("trace.pickle");
  ASSERT_TRUE(write_pytorch_snapshot(all, path, nullptr));
  int rc = 0;
  std::string out = run_check("snapshot", path, &rc);
  ASSERT_EQ(rc, 0) << out;
  auto j = nlohmann::json::parse(out);
  EXPECT_EQ(j["blocks"], 2);
  EXPECT_EQ(j["allocated"], 10 * MiB);
  EXPECT_EQ(j["entries"], 5);  // 3 alloc + free_requested + free_completed

  SnapshotData early = snapshot_from_trace(t, 2);  // after the first two events
  std::uint64_t live = 0;
  for (const auto& s : early.segments) live += s.allocated_size;
  EXPECT_EQ(live, 12 * MiB);
}

TEST(SnapshotRequests, AProcessAnswersARequestThroughItsPollingThread) {
  REQUIRE_PYTHON();
  std::string runtime = temp_path("xdg");
  mkdir(runtime.c_str(), 0700);
  setenv("XDG_RUNTIME_DIR", runtime.c_str(), 1);

  std::vector<LiveBlock> blocks(1);
  blocks[0].ptr = 0x7f0000000000;
  blocks[0].size = 6 * MiB;
  std::atomic<bool> stop{false};
  std::atomic<int> served{0};
  std::thread publisher([&] {
    while (!stop) {
      if (SnapshotRequests::poll([&] { return build_snapshot(blocks, 1); })) ++served;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  std::string out_path = temp_path("requested.pickle");
  std::string why;
  bool ok = SnapshotRequests::request(getpid(), out_path, 5000, &why);
  stop = true;
  publisher.join();
  ASSERT_TRUE(ok) << why;
  EXPECT_EQ(served, 1);
  int rc = 0;
  std::string out = run_check("snapshot", out_path, &rc);
  ASSERT_EQ(rc, 0) << out;
  auto j = nlohmann::json::parse(out);
  EXPECT_EQ(j["blocks"], 1);
  EXPECT_EQ(j["allocated"], 6 * MiB);

  // Nobody polls for a process that does not exist.
  EXPECT_FALSE(SnapshotRequests::request(999999999, out_path, 100, &why));
}

// The process to snapshot, run by the next test as this test binary with
// GPUSTITCH_TEST_SNAPSHOT_TARGET set: polls for requests for 20 s (or until one is served) and
// exits 0 once it served one. Skipped in an ordinary run.
TEST(SnapshotRequests, TargetProcessHelper) {
  if (std::getenv("GPUSTITCH_TEST_SNAPSHOT_TARGET") == nullptr) GTEST_SKIP() << "helper";
  std::vector<LiveBlock> blocks(1);
  blocks[0].ptr = 0x7f0000000000;
  blocks[0].size = 2 * MiB;
  for (int i = 0; i < 2000; ++i) {
    if (SnapshotRequests::poll([&] { return build_snapshot(blocks, 1); })) _exit(0);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  _exit(3);
}

// `gpustitch snapshot PID` failed with "did not answer ... as the same user?" when only one side
// had XDG_RUNTIME_DIR set: each looked for the rendezvous directory in its own environment. The
// requester now uses the target's.
TEST(SnapshotRequests, ThePolledDirectoryIsTheTargetsNotTheCallers) {
  std::string runtime = temp_path("xdg-target");
  mkdir(runtime.c_str(), 0700);
  for (bool target_has_xdg : {true, false}) {
    // The target: this binary, running only the helper above, with or without XDG_RUNTIME_DIR.
    std::vector<std::string> env_strings = {"GPUSTITCH_TEST_SNAPSHOT_TARGET=1"};
    if (target_has_xdg) env_strings.push_back("XDG_RUNTIME_DIR=" + runtime);
    // The caller reads the target's /proc/PID/environ, which holds the new environment only once
    // execve() has run: wait for that (the close-on-exec pipe reads end-of-file), as a user asks
    // a process that has long been running.
    int exec_seen[2];
    ASSERT_EQ(pipe2(exec_seen, O_CLOEXEC), 0);
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      close(exec_seen[0]);
      std::vector<char*> envp;
      for (auto& e : env_strings) envp.push_back(e.data());
      envp.push_back(nullptr);
      std::string filter = "--gtest_filter=SnapshotRequests.TargetProcessHelper";
      char* argv[] = {const_cast<char*>("/proc/self/exe"), filter.data(), nullptr};
      execve("/proc/self/exe", argv, envp.data());
      _exit(127);
    }
    close(exec_seen[1]);
    char byte;
    while (read(exec_seen[0], &byte, 1) < 0 && errno == EINTR) {
    }
    close(exec_seen[0]);
    // The caller: the other way round.
    if (target_has_xdg)
      unsetenv("XDG_RUNTIME_DIR");
    else
      setenv("XDG_RUNTIME_DIR", runtime.c_str(), 1);
    std::string out_path = temp_path(target_has_xdg ? "xdg-t.pickle" : "xdg-c.pickle");
    std::string why;
    bool ok = SnapshotRequests::request(pid, out_path, 8000, &why);
    int status = 0;
    if (!ok) kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    EXPECT_TRUE(ok) << (target_has_xdg ? "target with, caller without: " : "caller with: ") << why;
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    struct stat st;
    EXPECT_EQ(stat(out_path.c_str(), &st), 0) << out_path;
  }
  unsetenv("XDG_RUNTIME_DIR");
}

TEST(Snapshot, PoolSegmentsKeepFreeAndPendingBlocks) {
  REQUIRE_PYTHON();
  using State = MappedBlock::State;
  const DevPtr base = 0x7f0000000000ull;
  MappedSegment seg;
  seg.base = base;
  seg.size = 64 * MiB;
  seg.stitched = true;
  seg.blocks = {{base, 16 * MiB, 15 * MiB, State::live},
                {base + 16 * MiB, 8 * MiB, 0, State::pending},
                {base + 24 * MiB, 40 * MiB, 0, State::free}};
  SnapshotData data = build_snapshot_from_segments({seg}, 1, [](DevPtr) {
    return std::vector<SnapshotFrame>{{"libx.so", 0, "f()"}};
  });
  ASSERT_EQ(data.segments.size(), 1u);
  EXPECT_EQ(data.segments[0].allocated_size, 16 * MiB);
  EXPECT_EQ(data.segments[0].active_size, 24 * MiB);
  EXPECT_EQ(data.segments[0].blocks[1].state, "active_pending_free");
  std::string path = temp_path("segments.pickle");
  ASSERT_TRUE(write_pytorch_snapshot(data, path, nullptr));
  int rc = 0;
  std::string out = run_check("snapshot", path, &rc);
  ASSERT_EQ(rc, 0) << out;
  auto j = nlohmann::json::parse(out);
  EXPECT_EQ(j["blocks"], 1);
  EXPECT_EQ(j["allocated"], 16 * MiB);
  EXPECT_EQ(j["frames"], nlohmann::json::array({"f()"}));
}
