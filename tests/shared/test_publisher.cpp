// StatsPublisher against a scripted statistics source: what a reader of its record sees.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <gtest/gtest.h>

#include "gpustitch/shm/publisher.h"
#include "gpustitch/shm/record_reader.h"
#include "test_helpers.h"

using namespace gpustitch;
using namespace gpustitch::shm;
using namespace std::chrono_literals;

namespace {

struct ScriptedSource {
  std::atomic<std::uint64_t> allocated{0};
  int devices = 2;
  StatsSource source() {
    return {[this] { return devices; },
            [this](int d) {
              DeviceStats s;
              s.bytes_allocated = allocated.load() + std::uint64_t(d);
              s.bytes_reserved = 4 * MiB * (d + 1);
              s.allocs = 10 + d;
              s.hist_allocs[3] = 7;
              s.driver_calls = 30 + d;
              s.driver_ns = 2'000'000 + d;
              s.driver_background_calls = 4 + d;
              s.driver_background_ns = 400'000 + d;
              for (int op = 0; op < kDriverOps; ++op) {
                s.driver_op_calls[op] = 100 * (op + 1) + d;
                s.driver_op_ns[op] = 1000 * (op + 1) + d;
              }
              s.peak_reserved_allocated = 3 * MiB + d;
              s.peak_reserved_pending = 1 * MiB + d;
              s.fence_syncs = 50 + d;
              s.fence_sync_ns = 7'000'000 + d;
              s.fence_waits = 60 + d;
              s.fence_wait_ns = 8'000'000 + d;
              s.fence_waits_timed_out = 2 + d;
              return s;
            }};
  }
};

Config fast_config() {
  Config c;
  c.publish = true;
  c.publish_interval_ms = 5;
  return c;
}

template <typename F>
bool eventually(F f, std::chrono::milliseconds limit = 3000ms) {
  return test::eventually(f, limit, 2ms);
}

std::optional<RecordReader> open_own(const std::string& prefix) {
  auto names = discover_records(prefix, ::geteuid());
  if (names.size() != 1) return std::nullopt;
  return RecordReader::open(names[0], ::geteuid(), nullptr);
}

}  // namespace

TEST(StatsPublisher, PublishesTheSourcesFiguresPeriodically) {
  test::PrefixGuard g;
  ScriptedSource src;
  src.allocated = 3 * MiB;
  StatsPublisher pub(src.source(), fast_config(), {g.prefix});
  ASSERT_TRUE(pub.active()) << pub.error();
  EXPECT_EQ(pub.record_name(), RecordWriter::self_name(g.prefix).object_name());
  auto reader = open_own(g.prefix);
  ASSERT_TRUE(reader);
  struct stat st;
  ASSERT_EQ(::stat(reader->name().path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // The background thread picks up new figures without any call from the program.
  src.allocated = 5 * MiB;
  EXPECT_TRUE(eventually([&] {
    SnapshotCopy s;
    return reader->read_snapshot(&s) == ReadError::none && s.devices.size() == 2 &&
           s.devices[0].bytes_allocated == 5 * MiB && s.devices[1].bytes_allocated == 5 * MiB + 1;
  }));
  SnapshotCopy s;
  pub.publish_now();
  ASSERT_EQ(reader->read_snapshot(&s), ReadError::none);
  EXPECT_EQ(s.devices[1].bytes_reserved, 8 * MiB);
  EXPECT_EQ(s.devices[1].allocs, 11u);
  EXPECT_EQ(s.devices[0].hist_allocs[3], 7u);
  EXPECT_EQ(s.devices[1].driver_calls, 31u);
  EXPECT_EQ(s.devices[1].driver_ns, 2'000'001u);
  // Each kind lands in its own field (DriverOp order), the reclaimer's share and the peak's apart.
  EXPECT_EQ(s.devices[1].driver_create_calls, 101u);
  EXPECT_EQ(s.devices[1].driver_map_calls, 201u);
  EXPECT_EQ(s.devices[1].driver_set_access_calls, 301u);
  EXPECT_EQ(s.devices[1].driver_unmap_calls, 401u);
  EXPECT_EQ(s.devices[1].driver_release_calls, 501u);
  EXPECT_EQ(s.devices[1].driver_create_ns, 1001u);
  EXPECT_EQ(s.devices[1].driver_release_ns, 5001u);
  EXPECT_EQ(s.devices[1].driver_background_calls, 5u);
  EXPECT_EQ(s.devices[1].driver_background_ns, 400'001u);
  EXPECT_EQ(s.devices[1].peak_reserved_allocated, 3 * MiB + 1);
  EXPECT_EQ(s.devices[1].peak_reserved_pending, 1 * MiB + 1);
  // The program's threads' waits for the device, each in its own field, per device.
  for (int d = 0; d < 2; ++d) {
    EXPECT_EQ(s.devices[d].fence_syncs, 50u + d);
    EXPECT_EQ(s.devices[d].fence_sync_ns, 7'000'000u + d);
    EXPECT_EQ(s.devices[d].fence_waits, 60u + d);
    EXPECT_EQ(s.devices[d].fence_wait_ns, 8'000'000u + d);
    EXPECT_EQ(s.devices[d].fence_waits_timed_out, 2u + d);
  }
  EXPECT_DOUBLE_EQ(s.devices[1].fragmentation(), 1.0 - double(5 * MiB + 1) / double(8 * MiB));
  EXPECT_GT(s.publish_count, 1u);
}

TEST(StatsPublisher, EventsReachTheRingWithTheirFigures) {
  test::PrefixGuard g;
  ScriptedSource src;
  StatsPublisher pub(src.source(), fast_config(), {g.prefix});
  ASSERT_TRUE(pub.active());
  PoolEvent oom{EventKind::oom, 1, 1111, 3 * GiB, 1 * GiB, 512 * MiB, 1536 * MiB, 0, 0.25};
  pub.on_event(oom);
  PoolEvent stitch{EventKind::stitch, 0, 2222, 64 * MiB, 0, 0, 0, 4, 0.1};
  pub.on_event(stitch);
  RecordEvent give;
  give.kind = RecordEventKind::coop_give;
  give.peer_pid = 77;
  give.size = 2 * GiB;
  pub.record_event(give);
  auto reader = open_own(g.prefix);
  ASSERT_TRUE(reader);
  std::vector<EventCopy> ev;
  ASSERT_EQ(reader->read_events(&ev), ReadError::none);
  ASSERT_EQ(ev.size(), 3u);
  EXPECT_EQ(ev[0].kind, RecordEventKind::oom);
  EXPECT_EQ(ev[0].device, 1);
  EXPECT_EQ(ev[0].time_ns, 1111u);
  EXPECT_EQ(ev[0].size, 3 * GiB);
  EXPECT_EQ(ev[0].device_free, 1 * GiB);
  EXPECT_EQ(ev[0].cached, 512 * MiB);
  EXPECT_EQ(ev[0].largest_possible, 1536 * MiB);
  EXPECT_DOUBLE_EQ(ev[0].fragmentation, 0.25);
  EXPECT_EQ(ev[1].kind, RecordEventKind::stitch);
  EXPECT_EQ(ev[1].pieces, 4u);
  EXPECT_EQ(ev[2].kind, RecordEventKind::coop_give);
  EXPECT_EQ(ev[2].peer_pid, 77u);
}

TEST(StatsPublisher, RemovesItsRecordWhenDestroyed) {
  test::PrefixGuard g;
  ScriptedSource src;
  {
    StatsPublisher pub(src.source(), fast_config(), {g.prefix});
    ASSERT_TRUE(pub.active());
    EXPECT_EQ(discover_records(g.prefix).size(), 1u);
  }
  EXPECT_TRUE(discover_records(g.prefix).empty());
}

TEST(StatsPublisher, PublishOffCreatesNothing) {
  test::PrefixGuard g;
  ScriptedSource src;
  Config c = fast_config();
  c.publish = false;
  StatsPublisher pub(src.source(), c, {g.prefix});
  EXPECT_FALSE(pub.active());
  EXPECT_FALSE(pub.error().empty());
  pub.on_event(PoolEvent{EventKind::oom, 0, 0, 0, 0, 0, 0, 0, 0});  // harmless
  EXPECT_TRUE(discover_records(g.prefix).empty());
}

// systemd-logind's RemoveIPC (or rm) deletes the name while the process runs: the publisher
// puts it back, with the events recorded so far.
TEST(StatsPublisher, RecreatesItsRecordAfterTheNameIsRemoved) {
  test::PrefixGuard g;
  ScriptedSource src;
  src.allocated = 42;
  StatsPublisher pub(src.source(), fast_config(), {g.prefix});
  ASSERT_TRUE(pub.active());
  pub.on_event(PoolEvent{EventKind::trim, 0, 5, 8 * MiB, 0, 0, 0, 4, 0});
  std::string path = RecordWriter::self_name(g.prefix).path();
  struct stat before;
  ASSERT_EQ(::stat(path.c_str(), &before), 0);
  ASSERT_EQ(::unlink(path.c_str()), 0);
  ASSERT_TRUE(eventually([&] {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0 && st.st_ino != before.st_ino;
  }));
  // The new record is readable once its header is complete (the writer stores the magic last; a
  // reader that comes too early is refused and retries, as gpustitchd does).
  std::optional<RecordReader> reader;
  ASSERT_TRUE(eventually([&] {
    reader = open_own(g.prefix);
    return reader.has_value();
  }));
  std::vector<EventCopy> ev;
  ASSERT_EQ(reader->read_events(&ev), ReadError::none);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, RecordEventKind::trim);
  EXPECT_TRUE(eventually([&] {
    SnapshotCopy s;
    return reader->read_snapshot(&s) == ReadError::none && !s.devices.empty() &&
           s.devices[0].bytes_allocated == 42;
  }));
  // New events go to the new record.
  pub.on_event(PoolEvent{EventKind::oom, 0, 6, 1, 0, 0, 0, 0, 0});
  ASSERT_EQ(reader->read_events(&ev), ReadError::none);
  EXPECT_EQ(ev.size(), 2u);
}

// After fork() the child must neither write the parent's record nor remove it.
TEST(StatsPublisher, ForkedChildLeavesTheParentsRecordAlone) {
#if defined(__SANITIZE_THREAD__)
  // ThreadSanitizer's runtime can deadlock in a child forked from a multithreaded process.
  GTEST_SKIP() << "fork from a multithreaded process under ThreadSanitizer";
#endif
  test::PrefixGuard g;
  ScriptedSource src;
  auto pub = std::make_unique<StatsPublisher>(src.source(), fast_config(),
                                              PublisherOptions{.prefix = g.prefix});
  ASSERT_TRUE(pub->active());
  pid_t child = ::fork();
  if (child == 0) {
    pub->on_event(PoolEvent{EventKind::oom, 0, 0, 0, 0, 0, 0, 0, 0});
    pub->stop();
    const bool says_why = !pub->active() && pub->error() == "stopped in a forked child";
    pub.reset();  // the destructor runs in the child
    ::_exit(says_why ? 0 : 3);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3: the child's publisher did not say why it stopped";
  auto reader = open_own(g.prefix);
  ASSERT_TRUE(reader) << "the child removed the parent's record";
  std::vector<EventCopy> ev;
  ASSERT_EQ(reader->read_events(&ev), ReadError::none);
  EXPECT_TRUE(ev.empty()) << "the child wrote into the parent's record";
}

// A publisher nobody destroys (the preload library's) still removes its record on exit().
TEST(StatsPublisher, ExitRemovesTheRecordOfAPublisherNeverDestroyed) {
  test::PrefixGuard g;
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  pid_t child = ::fork();
  if (child == 0) {
    ScriptedSource* src = new ScriptedSource;  // leaked on purpose, like the shim's state
    auto* pub = new StatsPublisher(src->source(), fast_config(), {g.prefix});
    char c = pub->active() ? 'y' : 'n';
    (void)!::write(fds[1], &c, 1);
    std::exit(0);  // runs atexit handlers
  }
  char c = 0;
  ASSERT_EQ(::read(fds[0], &c, 1), 1);
  EXPECT_EQ(c, 'y');
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_TRUE(discover_records(g.prefix).empty());
}

// Records left by this user's processes that were killed are removed by the next publisher.
TEST(StatsPublisher, RemovesStaleRecordsOfItsUser) {
  test::PrefixGuard g;
  pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  auto start = process_start_time(child);
  ::waitpid(child, nullptr, 0);
  RecordName dead{g.prefix, ::geteuid(), child, start.value_or(1)};
  std::string why;
  ASSERT_TRUE(RecordWriter::create(dead, "x", "x", 1, &why)) << why;
  ASSERT_EQ(discover_records(g.prefix).size(), 1u);
  ScriptedSource src;
  StatsPublisher pub(src.source(), fast_config(), {g.prefix});
  EXPECT_TRUE(eventually([&] { return discover_records(g.prefix).size() == 1; }));
  auto names = discover_records(g.prefix);
  ASSERT_EQ(names.size(), 1u);
  EXPECT_EQ(names[0].pid, ::getpid());
}
