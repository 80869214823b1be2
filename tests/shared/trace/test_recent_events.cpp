// The ring of recent events behind live snapshots' timelines: what it records (sizes, addresses,
// streams, microseconds since the epoch, sampled sites), that it keeps only the last N, that
// concurrent writers never hand a reader a torn event, that a forked child can use it, and that
// its device_traces pass the snapshot check memory_viz's reader relies on.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "gpustitch/config.h"
#include "gpustitch/trace/recent_events.h"
#include "gpustitch/trace/snapshot.h"

using namespace gpustitch;
using namespace gpustitch::trace;

namespace {

std::string check_snapshot(const std::string& file, int* rc) {
  std::string cmd =
      std::string(GPUSTITCH_PYTHON3) + " " + GPUSTITCH_SNAPSHOT_CHECK + " snapshot '" + file + "'";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  std::size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  *rc = pclose(p);
  return out;
}

std::uint64_t g_site_for = 0;  // the address whose allocation the fake sampler "sampled"
std::uint64_t fake_site_of(DevPtr p) noexcept {
  return p == g_site_for ? 42 : 0;
}

}  // namespace

TEST(RecentEvents, RecordsAllocFreeAndOomWithMicrosecondsSinceTheEpoch) {
  g_site_for = 0x7f0000200000;
  RecentEvents ring(16, &fake_site_of);
  const std::uint64_t before = epoch_microseconds();
  ring.on_allocate(0, 0x7f0000000000, 3 * MiB, 0x1234, ServedBy::fresh);
  ring.on_allocate(1, 0x7f0000200000, 4096, kAnyStream, ServedBy::small);
  ring.on_free(0, 0x7f0000000000, 3 * MiB, 0x1234);
  PoolEvent oom{};
  oom.kind = EventKind::oom;
  oom.device = 1;
  oom.time_ns = (before + 5) * 1000;
  oom.size = 80 * GiB;
  oom.device_free = 512 * MiB;
  ring.on_event(oom);
  PoolEvent trim = oom;
  trim.kind = EventKind::trim;
  ring.on_event(trim);  // not a snapshot action: left out
  const std::uint64_t after = epoch_microseconds();

  auto ev = ring.read();
  ASSERT_EQ(ev.size(), 4u);
  EXPECT_EQ(ring.recorded(), 4u);
  EXPECT_EQ(ev[0].action, RecentEvent::Action::alloc);
  EXPECT_EQ(ev[0].addr, 0x7f0000000000u);
  EXPECT_EQ(ev[0].size, 3 * MiB);
  EXPECT_EQ(ev[0].stream, 0x1234u);
  EXPECT_EQ(ev[0].site, 0u);
  EXPECT_EQ(ev[1].device, 1);
  EXPECT_EQ(ev[1].site, 42u);
  EXPECT_EQ(ev[2].action, RecentEvent::Action::free);
  EXPECT_EQ(ev[2].size, 3 * MiB);
  EXPECT_EQ(ev[3].action, RecentEvent::Action::oom);
  EXPECT_EQ(ev[3].size, 80 * GiB);
  EXPECT_EQ(ev[3].device_free, 512 * MiB);
  EXPECT_EQ(ev[3].time_us, before + 5);
  // PyTorch's time_us: microseconds since 1970 (after 2020-01-01 and in order here).
  for (int i = 0; i < 3; ++i) {
    EXPECT_GE(ev[i].time_us, before);
    EXPECT_LE(ev[i].time_us, after);
  }
  EXPECT_GT(before, 1577836800ull * 1000000ull);
}

TEST(RecentEvents, KeepsOnlyTheLastCapacityEventsOldestFirst) {
  RecentEvents ring(100);
  for (std::uint64_t i = 0; i < 1050; ++i) ring.on_allocate(0, 0x1000 * (i + 1), i, 0, {});
  auto ev = ring.read();
  ASSERT_EQ(ev.size(), 100u);
  EXPECT_EQ(ring.recorded(), 1050u);
  for (std::size_t k = 0; k < ev.size(); ++k) EXPECT_EQ(ev[k].size, 950 + k) << k;
}

TEST(RecentEvents, ConfiguredByTraceEventsAndOffAtZero) {
  auto defaults = parse_config("");
  EXPECT_EQ(defaults.config.trace_events, 10000u);
  auto ring = make_recent_events(defaults.config);
  ASSERT_NE(ring, nullptr);
  EXPECT_EQ(ring->capacity(), 10000u);
  auto off = parse_config("trace_events:0");
  EXPECT_TRUE(off.errors.empty());
  EXPECT_EQ(make_recent_events(off.config), nullptr);
  auto small = parse_config("trace_events:3");
  EXPECT_EQ(make_recent_events(small.config)->capacity(), 3u);
  auto bad = parse_config("trace_events:20000000");
  ASSERT_EQ(bad.errors.size(), 1u);
  EXPECT_NE(bad.errors[0].find("trace_events"), std::string::npos);
}

// Writers on several threads while a reader reads: every event read is one that was written
// whole (its fields agree with each other), in each writer's own order, and none is lost once
// they stop (the ring holds the last capacity).
TEST(RecentEvents, ConcurrentWritersNeverHandTheReaderATornEvent) {
  constexpr int kThreads = 4;
  constexpr std::uint64_t kPerThread = 50000;
  RecentEvents ring(1024);
  std::atomic<bool> done{false}, reading{false};
  std::atomic<std::uint64_t> torn{0}, seen{0};
  // The reader passes over the ring while the writers write, and once more after they are done;
  // the writers start only once it runs. On a loaded machine the scheduler may otherwise not run
  // it at all while they write (seen was 0 in 4 of 18 runs, six at once on 2 cores).
  std::thread reader([&] {
    auto pass = [&] {
      std::uint64_t last[kThreads] = {};
      for (const auto& e : ring.read()) {
        int th = e.device;
        // Each writer writes addr = (th << 40) | i, size = i * 3 + th, stream = i ^ 0x5a5a.
        std::uint64_t i = e.addr & ((1ull << 40) - 1);
        if (th < 0 || th >= kThreads || (e.addr >> 40) != static_cast<std::uint64_t>(th) ||
            e.size != i * 3 + static_cast<std::uint64_t>(th) || e.stream != (i ^ 0x5a5a) ||
            i < last[th]) {
          ++torn;
        }
        last[th] = i;
        ++seen;
      }
    };
    reading = true;
    while (!done.load()) pass();
    pass();
  });
  while (!reading.load()) std::this_thread::yield();
  std::vector<std::thread> writers;
  for (int th = 0; th < kThreads; ++th) {
    writers.emplace_back([&, th] {
      for (std::uint64_t i = 1; i <= kPerThread; ++i) {
        ring.on_allocate(th, (static_cast<std::uint64_t>(th) << 40) | i,
                         i * 3 + static_cast<std::uint64_t>(th), i ^ 0x5a5a, ServedBy::cache);
      }
    });
  }
  for (auto& w : writers) w.join();
  done = true;
  reader.join();
  EXPECT_EQ(torn.load(), 0u);
  EXPECT_GT(seen.load(), 0u);
  EXPECT_EQ(ring.recorded(), kThreads * kPerThread);
  // A writer that finds its slot still being written by one a whole ring of events earlier (a
  // stalled thread) drops its event rather than wait, so under contention the last ring may miss
  // a few; once the writers are done, the next ring of events is there whole and in order.
  EXPECT_GE(ring.read().size(), 1024u - 128u);
  for (std::uint64_t i = 1; i <= 1024; ++i) {
    ring.on_allocate(0, i, i * 3, i ^ 0x5a5a, ServedBy::cache);
  }
  const auto last = ring.read();
  ASSERT_EQ(last.size(), 1024u);
  for (std::uint64_t i = 0; i < last.size(); ++i) EXPECT_EQ(last[i].addr, i + 1);
}

// fork() while another thread writes: the child reads without waiting on anything the parent's
// thread held, and records once it has let go of the slot that thread was writing.
TEST(RecentEvents, AForkedChildReadsAndRecords) {
  RecentEvents ring(256);
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    for (std::uint64_t i = 1; !stop.load(); ++i) ring.on_allocate(0, i, i, 0, ServedBy::cache);
  });
  while (ring.recorded() < 1000) std::this_thread::yield();
  pid_t pid = fork();
  if (pid == 0) {
    std::size_t inherited = ring.read().size();
    ring.forget_unfinished();  // the writer thread may have been mid-event at fork()
    for (int i = 0; i < 300; ++i) ring.on_free(0, 0xabc000 + i, 7, 0);
    auto ev = ring.read();
    bool own = ev.size() == 256 && ev.back().addr == 0xabc000 + 299 &&
               ev.back().action == RecentEvent::Action::free;
    _exit(inherited >= 250 && own ? 0 : 1);
  }
  stop = true;
  writer.join();
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// The ring as a snapshot's device_traces: alloc, free_requested + free_completed, oom, per device,
// with the sampled site's frames on its allocation; the pickle passes check_snapshot.py.
TEST(RecentEvents, DeviceTracesPassTheSnapshotCheck) {
  if (std::string(GPUSTITCH_PYTHON3).empty()) GTEST_SKIP() << "no python3";
  g_site_for = 0x7f0000000000;
  RecentEvents ring(64, &fake_site_of);
  ring.on_allocate(0, 0x7f0000000000, 8 * MiB, kAnyStream, ServedBy::fresh);
  ring.on_allocate(0, 0x7f0000800000, 4 * MiB, 7, ServedBy::cache);
  ring.on_free(0, 0x7f0000800000, 4 * MiB, 7);
  ring.on_allocate(1, 0x7f1000000000, 2 * MiB, kAnyStream, ServedBy::fresh);
  PoolEvent oom{};
  oom.kind = EventKind::oom;
  oom.device = 1;
  oom.time_ns = epoch_microseconds() * 1000;
  oom.size = 64 * GiB;
  oom.device_free = 1 * GiB;
  ring.on_event(oom);

  MappedSegment seg;
  seg.base = 0x7f0000000000;
  seg.size = 12 * MiB;
  seg.blocks = {{seg.base, 8 * MiB, 8 * MiB, MappedBlock::State::live},
                {seg.base + 8 * MiB, 4 * MiB, 0, MappedBlock::State::free}};
  SnapshotData data = build_snapshot_from_segments({seg}, 1);
  int asked = 0;
  append_device_traces(
      ring.read(),
      [&](std::uint64_t site) {
        ++asked;
        return std::vector<SnapshotFrame>{{"libtrain.so", 0, "site" + std::to_string(site)}};
      },
      &data);
  EXPECT_EQ(asked, 1);
  ASSERT_EQ(data.device_traces.size(), 2u);
  ASSERT_EQ(data.device_traces[0].size(), 4u);
  EXPECT_EQ(data.device_traces[0][0].frames.size(), 1u);
  EXPECT_EQ(data.device_traces[0][1].stream, 7u);
  EXPECT_EQ(data.device_traces[0][2].action, "free_requested");
  EXPECT_EQ(data.device_traces[0][3].action, "free_completed");
  EXPECT_EQ(data.device_traces[1][1].action, "oom");

  std::string path = testing::TempDir() + "gpustitch_ring_" + std::to_string(getpid()) + ".pickle";
  std::string why;
  ASSERT_TRUE(write_pytorch_snapshot(data, path, &why)) << why;
  int rc = 0;
  std::string out = check_snapshot(path, &rc);
  ASSERT_EQ(rc, 0) << out;
  auto j = nlohmann::json::parse(out);
  EXPECT_EQ(j["devices"], 2);
  EXPECT_EQ(j["entries"], 6);
  EXPECT_EQ(j["actions"]["alloc"], 3);
  EXPECT_EQ(j["actions"]["free_requested"], 1);
  EXPECT_EQ(j["actions"]["free_completed"], 1);
  EXPECT_EQ(j["actions"]["oom"], 1);
  EXPECT_EQ(j["alloc_sizes"], nlohmann::json::array({8 * MiB, 4 * MiB, 2 * MiB}));
  EXPECT_EQ(j["trace_frames"], 1);
  std::remove(path.c_str());
}

// Segment events become segment_map / segment_unmap entries that memory_viz's Allocator State
// History can replay backwards from the snapshot's segments: touching ranges (a small-object
// chunk inside a mapped run) are one segment on stream 0, and an event the segments contradict is
// left out rather than break the page.
TEST(RecentEvents, SegmentEventsReplayBackwardsFromTheSegments) {
  const DevPtr base = 0x7f0000000000;
  RecentEvents ring(64);
  ring.on_segment(0, base, 32 * MiB, true);                // the pool grows by 32 MiB
  ring.on_allocate(0, base, 8 * MiB, 5, ServedBy::fresh);  // a block in it
  ring.on_segment(0, base + 24 * MiB, 8 * MiB, false);     // its tail moves away
  ring.on_segment(0, base, 2 * MiB, false);                // contradicted: mapped in the snapshot
  ring.on_segment(0, base + 64 * MiB, 4 * MiB, true);      // contradicted: not mapped there
  ring.on_free(0, base, 8 * MiB, 5);

  // The memory map cuts the run at a chunk: three ranges side by side.
  MappedSegment run1, chunk, run2;
  run1.base = base;
  run1.size = 8 * MiB;
  run1.stream = 5;
  run1.blocks = {{base, 8 * MiB, 0, MappedBlock::State::free}};
  chunk.base = base + 8 * MiB;
  chunk.size = 2 * MiB;
  chunk.small = true;
  chunk.blocks = {{chunk.base, 2 * MiB, 100, MappedBlock::State::live}};
  run2.base = base + 10 * MiB;
  run2.size = 14 * MiB;
  run2.blocks = {{run2.base, 14 * MiB, 0, MappedBlock::State::free}};
  SnapshotData data = build_snapshot_from_segments({run2, chunk, run1}, 1);
  ASSERT_EQ(data.segments.size(), 1u) << "touching ranges are one segment";
  EXPECT_EQ(data.segments[0].address, base);
  EXPECT_EQ(data.segments[0].total_size, 24 * MiB);
  EXPECT_EQ(data.segments[0].stream, 0u);
  EXPECT_EQ(data.segments[0].blocks.size(), 3u);
  EXPECT_EQ(data.segments[0].allocated_size, 2 * MiB);

  append_device_traces(ring.read(), nullptr, &data);
  std::vector<std::string> actions;
  for (const auto& e : data.device_traces[0]) actions.push_back(e.action);
  EXPECT_EQ(actions, (std::vector<std::string>{"segment_map", "alloc", "segment_unmap",
                                               "free_requested", "free_completed"}));
  EXPECT_EQ(data.device_traces[0][0].size, 32 * MiB);
  EXPECT_EQ(data.device_traces[0][2].addr, base + 24 * MiB);

  std::string path =
      testing::TempDir() + "gpustitch_segments_" + std::to_string(getpid()) + ".pickle";
  std::string why;
  ASSERT_TRUE(write_pytorch_snapshot(data, path, &why)) << why;
  int rc = 0;
  std::string out = check_snapshot(path, &rc);
  ASSERT_EQ(rc, 0) << out;
  auto j = nlohmann::json::parse(out);
  EXPECT_TRUE(j["history_error"].is_null()) << j["history_error"].dump();
  EXPECT_EQ(j["actions"]["segment_map"], 1);
  EXPECT_EQ(j["actions"]["segment_unmap"], 1);

  // The check does catch a timeline the page could not draw: without the merge, the 32 MiB map
  // finds no single segment holding it.
  SnapshotData cut = build_snapshot_from_segments({run1}, 1);
  cut.device_traces[0] = {{"alloc", base, 1 * MiB, 0, 1, 0, {}},
                          {"segment_map", base, 32 * MiB, 0, 2, 0, {}}};
  ASSERT_TRUE(write_pytorch_snapshot(cut, path, &why)) << why;
  out = check_snapshot(path, &rc);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_FALSE(nlohmann::json::parse(out)["history_error"].is_null()) << out;
  std::remove(path.c_str());
}
