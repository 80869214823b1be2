// The statistics record: layout, seqlock consistency under a concurrent writer, the event ring,
// validation of hostile records, names and liveness.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include <gtest/gtest.h>

#include "gpustitch/shm/record_reader.h"
#include "gpustitch/shm/record_writer.h"
#include "test_helpers.h"

using namespace gpustitch;
using namespace gpustitch::shm;

namespace {

std::unique_ptr<RecordWriter> make_writer(const std::string& prefix) {
  std::string why;
  auto w = RecordWriter::create(RecordWriter::self_name(prefix), "/usr/bin/test", "test --arg", 100,
                                &why);
  EXPECT_TRUE(w) << why;
  return w;
}

DeviceCounters counters_filled_with(std::uint64_t v, int ordinal) {
  DeviceCounters c;
  std::memset(static_cast<void*>(&c), 0, sizeof c);
#define FILL(name) c.name = v;
  GPUSTITCH_SHM_DEVICE_COUNTERS(FILL)
#undef FILL
  for (auto& h : c.hist_allocs) h = v;
  for (auto& h : c.hist_live) h = v;
  c.ordinal = ordinal;
  return c;
}

// Every field of every device equals one value: a torn snapshot mixes two.
bool uniform(const SnapshotCopy& s, std::uint64_t* value) {
  if (s.devices.empty()) return true;
  std::uint64_t v = s.devices[0].bytes_allocated;
  for (const auto& d : s.devices) {
#define CHECK(name) \
  if (d.name != v) return false;
    GPUSTITCH_SHM_DEVICE_COUNTERS(CHECK)
#undef CHECK
    for (auto h : d.hist_allocs)
      if (h != v) return false;
    for (auto h : d.hist_live)
      if (h != v) return false;
  }
  if (s.heartbeat_ns != v) return false;
  *value = v;
  return true;
}

// Writes a hostile object at /dev/shm/<name> with the given bytes and mode.
void write_object(const RecordName& name, const void* bytes, std::size_t size, mode_t mode = 0600) {
  std::string path = name.path();
  ::unlink(path.c_str());
  int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY, mode);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::fchmod(fd, mode), 0);
  ASSERT_EQ(::write(fd, bytes, size), static_cast<ssize_t>(size));
  ::close(fd);
}

}  // namespace

TEST(RecordName, RoundTripsAndRejectsJunk) {
  RecordName n{"gpustitch", 1000, 4242, 987654321};
  EXPECT_EQ(n.object_name(), "gpustitch.1000.4242.987654321");
  auto p = parse_record_name(n.object_name(), "gpustitch");
  ASSERT_TRUE(p);
  EXPECT_EQ(p->uid, 1000u);
  EXPECT_EQ(p->pid, 4242);
  EXPECT_EQ(p->start_time, 987654321u);
  for (const char* bad : {"gpustitch.1000.4242", "gpustitch.1000.4242.1.2", "gpustitch.-1.2.3",
                          "gpustitch.1.+2.3", "gpustitch.1.0.3", "gpustitchx.1.2.3",
                          "gpustitch.1..3", "gpustitch.99999999999999999999999.2.3",
                          "gpustitch.1.2.3 ", "other.1.2.3", "gpustitch.1.2147483648.3"})
    EXPECT_FALSE(parse_record_name(bad, "gpustitch")) << bad;
}

TEST(RecordName, LivenessNeedsPidStartTimeAndOwner) {
  auto self = RecordWriter::self_name("x");
  EXPECT_TRUE(record_process_alive(self));
  auto wrong_start = self;
  wrong_start.start_time += 1;
  EXPECT_FALSE(record_process_alive(wrong_start));
  auto wrong_uid = self;
  wrong_uid.uid += 1;
  EXPECT_FALSE(record_process_alive(wrong_uid));
  // A child that exited: its pid no longer names it.
  pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  auto start = process_start_time(child);
  ::waitpid(child, nullptr, 0);
  RecordName dead{"x", ::geteuid(), child, start.value_or(1)};
  EXPECT_FALSE(record_process_alive(dead));
}

// The start time a process puts in its own record name, from whichever of its threads, is the
// one every other process reads for it: a reader (the daemon, the CLI, a cooperating peer) takes
// a mismatch for a dead process. (qemu-user, which runs the aarch64 tests, answers a process's
// own /proc/self/stat with a start time of its own: the calling thread's, at best a tick off.)
TEST(RecordName, AnotherProcessSeesTheWritersStartTime) {
  RecordName self;
  std::thread named_later([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    self = RecordWriter::self_name("x");
  });
  named_later.join();
  pid_t child = ::fork();
  if (child == 0) ::_exit(record_process_alive(self) ? 0 : 1);
  ASSERT_GT(child, 0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "another process found start time " << self.start_time << " wrong";
}

TEST(Record, CreatedPrivateAndReadable) {
  test::PrefixGuard g;
  auto w = make_writer(g.prefix);
  ASSERT_TRUE(w);
  struct stat st;
  ASSERT_EQ(::stat(w->name().path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(st.st_uid, ::geteuid());
  EXPECT_EQ(st.st_size, static_cast<off_t>(sizeof(Record)));
  ReadError err;
  auto r = RecordReader::open(w->name(), ::geteuid(), &err);
  ASSERT_TRUE(r) << to_string(err);
  EXPECT_EQ(r->identity().pid, ::getpid());
  EXPECT_EQ(r->identity().exe, "/usr/bin/test");
  EXPECT_EQ(r->identity().cmdline, "test --arg");
  auto names = discover_records(g.prefix);
  ASSERT_EQ(names.size(), 1u);
  EXPECT_EQ(names[0].object_name(), w->name().object_name());
  // Before the first publish the snapshot is empty but consistent.
  SnapshotCopy s;
  ASSERT_EQ(r->read_snapshot(&s), ReadError::none);
  EXPECT_TRUE(s.devices.empty());
  w->remove();
  EXPECT_FALSE(r->linked());
  EXPECT_TRUE(discover_records(g.prefix).empty());
}

TEST(Record, PublishedFiguresReadBackExactly) {
  test::PrefixGuard g;
  auto w = make_writer(g.prefix);
  ASSERT_TRUE(w);
  DeviceCounters d[3];
  for (int i = 0; i < 3; ++i) {
    d[i] = counters_filled_with(0, i);
    d[i].bytes_allocated = (i + 1) * 1000003ull;
    d[i].bytes_reserved = (i + 1) * 2000003ull;
    d[i].ooms = i;
    d[i].uuid[0] = static_cast<std::uint8_t>(0xa0 + i);
    d[i].fence_syncs = 40 + i;             // layout 7
    d[i].fence_waits_timed_out = 900 + i;  // the last counter of the entry
  }
  w->publish(d, 123456789);
  auto r = RecordReader::open(w->name(), std::nullopt, nullptr);
  ASSERT_TRUE(r);
  SnapshotCopy s;
  ASSERT_EQ(r->read_snapshot(&s), ReadError::none);
  ASSERT_EQ(s.devices.size(), 3u);
  EXPECT_EQ(s.heartbeat_ns, 123456789u);
  EXPECT_EQ(s.publish_count, 1u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(s.devices[i].bytes_allocated, (i + 1) * 1000003ull);
    EXPECT_EQ(s.devices[i].bytes_reserved, (i + 1) * 2000003ull);
    EXPECT_EQ(s.devices[i].ooms, static_cast<std::uint64_t>(i));
    EXPECT_EQ(s.devices[i].ordinal, i);
    EXPECT_EQ(s.devices[i].uuid[0], 0xa0 + i);
    EXPECT_EQ(s.devices[i].fence_syncs, 40u + i);
    EXPECT_EQ(s.devices[i].fence_waits_timed_out, 900u + i);
  }
}

// What a reader expects of each readable layout: this one's (7) and layout 6's as it was pinned
// when it was current, so that a record from a process still running that library is read.
TEST(Record, LayoutsKeepTheirPinnedSizesAndOffsets) {
  ASSERT_EQ(kLayoutVersion, 7u);
  const LayoutInfo* now = find_layout(7);
  ASSERT_NE(now, nullptr);
  EXPECT_EQ(now->device_stride, 1008u);
  EXPECT_EQ(now->record_size, 45744u);
  EXPECT_EQ(now->events_offset, 17584u);
  EXPECT_EQ(now->sites_offset, 23792u);
  EXPECT_EQ(offsetof(DeviceCounters, fence_syncs), 968u);
  EXPECT_EQ(offsetof(DeviceCounters, fence_waits_timed_out), 1000u);
  const LayoutInfo* v6 = find_layout(6);
  ASSERT_NE(v6, nullptr);
  EXPECT_EQ(v6->device_stride, 968u);
  EXPECT_EQ(v6->record_size, 45104u);
  EXPECT_EQ(v6->events_offset, 16944u);
  EXPECT_EQ(v6->sites_offset, 23152u);
  const LayoutInfo* v5 = find_layout(5);
  ASSERT_NE(v5, nullptr);
  EXPECT_EQ(v5->record_size, 43312u);
  EXPECT_EQ(find_layout(8), nullptr);
}

// A writer publishing as fast as it can while a reader copies: every accepted copy is
// internally consistent, and the reader makes progress.
TEST(Seqlock, ReaderNeverSeesTornSnapshot) {
  test::PrefixGuard g;
  auto w = make_writer(g.prefix);
  ASSERT_TRUE(w);
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    DeviceCounters d[kMaxDevices];
    for (std::uint64_t v = 1; !stop.load(std::memory_order_relaxed); ++v) {
      for (int i = 0; i < kMaxDevices; ++i) d[i] = counters_filled_with(v, i);
      w->publish(d, v);
    }
  });
  auto r = RecordReader::open(w->name(), ::geteuid(), nullptr);
  ASSERT_TRUE(r);
  int accepted = 0, busy = 0, distinct = 0;
  std::uint64_t last = 0;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
  while (std::chrono::steady_clock::now() < deadline) {
    SnapshotCopy s;
    ReadError e = r->read_snapshot(&s);
    if (e == ReadError::busy) {
      ++busy;
      continue;
    }
    ASSERT_EQ(e, ReadError::none);
    std::uint64_t v = 0;
    ASSERT_TRUE(uniform(s, &v)) << "torn snapshot after " << accepted << " good ones";
    if (s.devices.empty()) continue;
    ASSERT_EQ(s.devices.size(), static_cast<std::size_t>(kMaxDevices));
    ASSERT_GE(v, last);  // never goes back in time
    distinct += v != last;
    last = v;
    ++accepted;
  }
  stop = true;
  writer.join();
  EXPECT_GT(accepted, 100);
  EXPECT_GT(distinct, 10);
  RecordProperty("accepted", accepted);
  RecordProperty("busy", busy);
}

// A writer that dies mid-update leaves an odd sequence: readers give up after the retry cap
// instead of hanging.
TEST(Seqlock, StuckWriterCannotHangReader) {
  test::PrefixGuard g;
  auto w = make_writer(g.prefix);
  ASSERT_TRUE(w);
  w->record()->snapshot.seq = 7;  // odd: "being written", forever
  w->record()->sites.seq = 9;
  auto r = RecordReader::open(w->name(), ::geteuid(), nullptr);
  ASSERT_TRUE(r);
  SnapshotCopy s;
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(r->read_snapshot(&s), ReadError::busy);
  std::vector<SiteCopy> sites;
  EXPECT_EQ(r->read_sites(&sites), ReadError::busy);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
}

TEST(EventRing, EventsFromManyThreadsAllReadBackOnce) {
  test::PrefixGuard g;
  auto w = make_writer(g.prefix);
  ASSERT_TRUE(w);
  constexpr int kThreads = 4, kPer = 10;  // 40 events: fit in the ring
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t)
    ts.emplace_back([&, t] {
      for (int i = 0; i < kPer; ++i) {
        RecordEvent e;
        e.kind = RecordEventKind::stitch;
        e.device = t;
        e.size = std::uint64_t(t) * 1000 + i;
        e.pieces = 3;
        w->record_event(e);
      }
    });
  for (auto& t : ts) t.join();
  auto r = RecordReader::open(w->name(), ::geteuid(), nullptr);
  ASSERT_TRUE(r);
  std::vector<EventCopy> events;
  std::uint64_t dropped = 99;
  ASSERT_EQ(r->read_events(&events, &dropped), ReadError::none);
  EXPECT_EQ(dropped, 0u);
  ASSERT_EQ(events.size(), static_cast<std::size_t>(kThreads * kPer));
  std::set<std::uint64_t> sizes;
  for (std::size_t i = 0; i < events.size(); ++i) {
    EXPECT_EQ(events[i].index, i);
    EXPECT_EQ(events[i].kind, RecordEventKind::stitch);
    EXPECT_EQ(events[i].pieces, 3u);
    EXPECT_EQ(events[i].size / 1000, static_cast<std::uint64_t>(events[i].device));
    sizes.insert(events[i].size);
  }
  EXPECT_EQ(sizes.size(), static_cast<std::size_t>(kThreads * kPer));
}

TEST(EventRing, KeepsTheNewestWhenItWraps) {
  test::PrefixGuard g;
  auto w = make_writer(g.prefix);
  ASSERT_TRUE(w);
  for (int i = 0; i < 3 * kEventSlots + 5; ++i) {
    RecordEvent e;
    e.kind = i % 2 ? RecordEventKind::trim : RecordEventKind::oom;
    e.size = static_cast<std::uint64_t>(i);
    w->record_event(e);
  }
  auto r = RecordReader::open(w->name(), ::geteuid(), nullptr);
  std::vector<EventCopy> events;
  ASSERT_EQ(r->read_events(&events), ReadError::none);
  ASSERT_EQ(events.size(), static_cast<std::size_t>(kEventSlots));
  EXPECT_EQ(events.front().size, static_cast<std::uint64_t>(2 * kEventSlots + 5));
  EXPECT_EQ(events.back().size, static_cast<std::uint64_t>(3 * kEventSlots + 4));
}

// A record re-created under its old name (after RemoveIPC) starts with the old events, readable
// the moment the record is, and goes on numbering after them.
TEST(EventRing, ReCreatedRecordIsReadableOnlyWithTheCarriedEvents) {
  test::PrefixGuard g;
  auto old = make_writer(g.prefix);
  ASSERT_TRUE(old);
  for (int i = 0; i < 3; ++i) {
    RecordEvent e;
    e.kind = RecordEventKind::trim;
    e.size = static_cast<std::uint64_t>(100 + i);
    old->record_event(e);
  }
  old->remove();
  std::string why;
  auto fresh = RecordWriter::create(old->name(), "/usr/bin/test", "test", 100, &why, old->record());
  ASSERT_TRUE(fresh) << why;
  auto r = RecordReader::open(fresh->name(), ::geteuid(), nullptr);
  ASSERT_TRUE(r);
  std::vector<EventCopy> events;
  ASSERT_EQ(r->read_events(&events), ReadError::none);
  ASSERT_EQ(events.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(events[i].index, i);
    EXPECT_EQ(events[i].size, 100 + i);
  }
  RecordEvent next;
  next.kind = RecordEventKind::oom;
  next.size = 7;
  fresh->record_event(next);
  ASSERT_EQ(r->read_events(&events), ReadError::none);
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[3].index, 3u);
  EXPECT_EQ(events[3].kind, RecordEventKind::oom);
  // The old mapping is untouched by the new record's events.
  RecordEvent stray;
  stray.kind = RecordEventKind::stitch;
  old->record_event(stray);
  ASSERT_EQ(r->read_events(&events), ReadError::none);
  EXPECT_EQ(events.size(), 4u);
}

TEST(Sites, TableReadsBackWithBoundedStrings) {
  test::PrefixGuard g;
  auto w = make_writer(g.prefix);
  ASSERT_TRUE(w);
  Site s[2];
  std::memset(static_cast<void*>(s), 0, sizeof s);
  s[0].live_bytes = 1 << 20;
  s[0].count = 2;
  s[0].frame_count = 2;
  std::strcpy(s[0].frames[0].function, "forward");
  std::strcpy(s[0].frames[0].library, "libtorch_cuda.so");
  s[0].frames[0].offset = 0x1234;
  std::memset(s[0].frames[1].function, 'A', sizeof s[0].frames[1].function);  // no NUL
  s[1].frame_count = 1000;  // hostile count: clamped
  w->publish_sites(s, 5);
  auto r = RecordReader::open(w->name(), ::geteuid(), nullptr);
  std::vector<SiteCopy> sites;
  std::uint64_t updated = 0;
  ASSERT_EQ(r->read_sites(&sites, &updated), ReadError::none);
  EXPECT_EQ(updated, 5u);
  ASSERT_EQ(sites.size(), 2u);
  EXPECT_EQ(sites[0].live_bytes, 1u << 20);
  EXPECT_EQ(sites[0].frames[0].function, "forward");
  EXPECT_EQ(sites[0].frames[0].library, "libtorch_cuda.so");
  EXPECT_EQ(sites[0].frames[0].offset, 0x1234u);
  EXPECT_EQ(sites[0].frames[1].function.size(), sizeof s[0].frames[1].function);
  EXPECT_EQ(sites[1].frames.size(), static_cast<std::size_t>(kMaxFrames));
}

// ---- hostile records -------------------------------------------------------------------------

class HostileRecord : public ::testing::Test {
 protected:
  void SetUp() override {
    name_ = RecordWriter::self_name(g_.prefix);
    std::memset(static_cast<void*>(&good_), 0, sizeof good_);
    good_.header.magic = kRecordMagic;
    good_.header.version = kLayoutVersion;
    good_.header.record_size = sizeof(Record);
    good_.header.max_devices = kMaxDevices;
    good_.header.event_slots = kEventSlots;
    good_.header.max_sites = kMaxSites;
    good_.identity.pid = name_.pid;
    good_.identity.uid = name_.uid;
    good_.identity.start_time = name_.start_time;
  }
  ReadError open_error() {
    ReadError err = ReadError::none;
    auto r = RecordReader::open(name_, ::geteuid(), &err);
    return r ? ReadError::none : err;
  }
  test::PrefixGuard g_;
  RecordName name_;
  Record good_;
};

TEST_F(HostileRecord, WellFormedIsAccepted) {
  write_object(name_, &good_, sizeof good_);
  EXPECT_EQ(open_error(), ReadError::none);
}

TEST_F(HostileRecord, TruncatedIsRejected) {
  write_object(name_, &good_, 100);
  EXPECT_EQ(open_error(), ReadError::bad_size);
  write_object(name_, &good_, 0);
  EXPECT_EQ(open_error(), ReadError::bad_size);
}

TEST_F(HostileRecord, OversizedIsRejected) {
  std::vector<char> big(sizeof good_ + 4096, 0);
  std::memcpy(big.data(), &good_, sizeof good_);
  write_object(name_, big.data(), big.size());
  EXPECT_EQ(open_error(), ReadError::bad_size);
}

TEST_F(HostileRecord, WrongMagicVersionOrHeaderIsRejected) {
  Record r = good_;
  r.header.magic ^= 1;
  write_object(name_, &r, sizeof r);
  EXPECT_EQ(open_error(), ReadError::bad_magic);
  r = good_;
  r.header.version = kLayoutVersion + 1;
  write_object(name_, &r, sizeof r);
  EXPECT_EQ(open_error(), ReadError::bad_version);
  r = good_;
  r.header.record_size = 1u << 30;
  write_object(name_, &r, sizeof r);
  EXPECT_EQ(open_error(), ReadError::bad_header);
  r = good_;
  r.header.max_devices = 1000;
  write_object(name_, &r, sizeof r);
  EXPECT_EQ(open_error(), ReadError::bad_header);
}

TEST_F(HostileRecord, IdentityMustMatchTheName) {
  Record r = good_;
  r.identity.pid = 1;  // claims to be init
  write_object(name_, &r, sizeof r);
  EXPECT_EQ(open_error(), ReadError::bad_identity);
}

TEST_F(HostileRecord, GroupOrWorldWritableIsRejected) {
  write_object(name_, &good_, sizeof good_, 0622);
  EXPECT_EQ(open_error(), ReadError::bad_mode);
}

TEST_F(HostileRecord, FifoDoesNotBlockTheReader) {
  ::unlink(name_.path().c_str());
  ASSERT_EQ(::mkfifo(name_.path().c_str(), 0600), 0);
  EXPECT_EQ(open_error(), ReadError::not_regular);
}

TEST_F(HostileRecord, SymlinkIsNotFollowed) {
  write_object(name_, &good_, sizeof good_);
  RecordName link = name_;
  link.start_time += 1;
  ::unlink(link.path().c_str());
  ASSERT_EQ(::symlink(name_.path().c_str(), link.path().c_str()), 0);
  ReadError err;
  EXPECT_FALSE(RecordReader::open(link, std::nullopt, &err));
  EXPECT_EQ(err, ReadError::not_regular);
}

TEST_F(HostileRecord, OtherOwnerIsRejected) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to chown";
  write_object(name_, &good_, sizeof good_);
  ASSERT_EQ(::chown(name_.path().c_str(), 65534, 65534), 0);
  // The name says uid 0 but the object belongs to nobody.
  EXPECT_EQ(open_error(), ReadError::wrong_owner);
}

TEST_F(HostileRecord, HostileSnapshotAndEventsAreClampedOrRejected) {
  Record r = good_;
  r.snapshot.device_count = 0xffffffff;
  r.events.head = 5;
  r.events.slots[0].seq = 2;           // event 0, complete
  r.events.slots[1].seq = 2 * 65 + 2;  // claims index 65 in slot 1: 65 % 64 == 1 but >= head
  r.events.slots[2].seq = 2 * 7 + 2;   // index 7 in slot 2: wrong slot
  r.events.slots[3].seq = 2 * 3 + 1;   // being written
  r.events.slots[0].kind = 999;        // unknown kind: reported as unknown
  write_object(name_, &r, sizeof r);
  ReadError err;
  auto reader = RecordReader::open(name_, ::geteuid(), &err);
  ASSERT_TRUE(reader) << to_string(err);
  SnapshotCopy s;
  EXPECT_EQ(reader->read_snapshot(&s), ReadError::bad_header);
  std::vector<EventCopy> events;
  ASSERT_EQ(reader->read_events(&events), ReadError::none);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].index, 0u);
  EXPECT_FALSE(events[0].known_kind);
}

TEST_F(HostileRecord, ShrunkAfterOpenFailsCleanly) {
  write_object(name_, &good_, sizeof good_);
  ReadError err;
  auto reader = RecordReader::open(name_, ::geteuid(), &err);
  ASSERT_TRUE(reader);
  ASSERT_EQ(::truncate(name_.path().c_str(), 64), 0);  // no SIGBUS: the reader never maps
  SnapshotCopy s;
  EXPECT_EQ(reader->read_snapshot(&s), ReadError::io);
}

// A record of a previous layout (2: before the program_* counters, 3: before program_served_*,
// 4: before driver_*, 5: before the driver detail counters, 6: before fence_*) from a process
// still running an older library: read with its own device stride and offsets, the newer
// counters zero.
TEST_F(HostileRecord, PreviousLayoutsAreReadWithNewerCountersZero) {
  for (const std::uint32_t version : {2u, 3u, 4u, 5u, 6u}) {
    SCOPED_TRACE(version);
    const LayoutInfo& v2 = *find_layout(version);
    ASSERT_LT(v2.record_size, sizeof(Record));
    std::vector<std::uint8_t> image(v2.record_size, 0);
    RecordHeader h = good_.header;
    h.version = version;
    h.record_size = v2.record_size;
    std::memcpy(image.data(), &h, sizeof h);
    std::memcpy(image.data() + offsetof(Record, identity), &good_.identity, sizeof good_.identity);
    Snapshot head{};
    head.device_count = 2;
    head.publish_count = 9;
    std::memcpy(image.data() + offsetof(Record, snapshot), &head, offsetof(Snapshot, devices));
    for (int d = 0; d < 2; ++d) {
      DeviceCounters c{};
      c.bytes_allocated = 100 + d;
      c.coop_dropped = 7 + d;              // the last counter of layout 2
      c.program_mapped_bytes = 70 + d;     // the last counter of layout 3
      c.program_served_handles = 80 + d;   // the last counter of layout 4
      c.driver_ns = 90 + d;                // the last counter of layout 5
      c.driver_background_calls = 95 + d;  // the first counter of layout 6
      c.peak_reserved_pending = 96 + d;    // the last counter of layout 6
      c.fence_syncs = 97 + d;              // not in any of them: must not be read
      c.fence_waits_timed_out = 98 + d;    // nor this
      c.ordinal = d;
      std::memcpy(image.data() + offsetof(Record, snapshot) + offsetof(Snapshot, devices) +
                      d * v2.device_stride,
                  &c, v2.device_stride);
    }
    EventSlot slot{};
    slot.seq = 2;  // event 0, complete
    slot.kind = static_cast<std::uint32_t>(RecordEventKind::oom);
    slot.size = 4096;
    std::uint64_t events_head = 1;
    std::memcpy(image.data() + v2.events_offset + offsetof(EventRing, head), &events_head, 8);
    std::memcpy(image.data() + v2.events_offset + offsetof(EventRing, slots), &slot, sizeof slot);
    std::uint32_t sites = 1;
    std::memcpy(image.data() + v2.sites_offset + offsetof(SiteTable, count), &sites, 4);
    std::uint64_t live = 12345;
    std::memcpy(
        image.data() + v2.sites_offset + offsetof(SiteTable, sites) + offsetof(Site, live_bytes),
        &live, 8);
    write_object(name_, image.data(), image.size());

    ReadError err = ReadError::none;
    auto r = RecordReader::open(name_, ::geteuid(), &err);
    ASSERT_TRUE(r) << to_string(err);
    EXPECT_EQ(r->identity().layout_version, version);
    SnapshotCopy snap;
    ASSERT_EQ(r->read_snapshot(&snap), ReadError::none);
    EXPECT_EQ(snap.layout_version, version);
    EXPECT_EQ(snap.publish_count, 9u);
    ASSERT_EQ(snap.devices.size(), 2u);
    for (int d = 0; d < 2; ++d) {
      EXPECT_EQ(snap.devices[d].bytes_allocated, 100u + d);
      EXPECT_EQ(snap.devices[d].coop_dropped, 7u + d);
      EXPECT_EQ(snap.devices[d].ordinal, d);
      EXPECT_EQ(snap.devices[d].program_mapped_bytes, version >= 3 ? 70u + d : 0u);
      EXPECT_EQ(snap.devices[d].program_served_bytes, 0u);
      EXPECT_EQ(snap.devices[d].program_served_handles, version >= 4 ? 80u + d : 0u);
      EXPECT_EQ(snap.devices[d].driver_calls, 0u);
      EXPECT_EQ(snap.devices[d].driver_ns, version >= 5 ? 90u + d : 0u);
      EXPECT_EQ(snap.devices[d].driver_background_calls, version >= 6 ? 95u + d : 0u);
      EXPECT_EQ(snap.devices[d].peak_reserved_pending, version >= 6 ? 96u + d : 0u);
      EXPECT_EQ(snap.devices[d].fence_syncs, 0u);
      EXPECT_EQ(snap.devices[d].fence_waits_timed_out, 0u);
    }
    std::vector<EventCopy> events;
    ASSERT_EQ(r->read_events(&events), ReadError::none);
    ASSERT_EQ(events.size(), 1u);
    EXPECT_EQ(events[0].size, 4096u);
    std::vector<SiteCopy> site_copies;
    ASSERT_EQ(r->read_sites(&site_copies), ReadError::none);
    ASSERT_EQ(site_copies.size(), 1u);
    EXPECT_EQ(site_copies[0].live_bytes, 12345u);
  }
}

TEST_F(HostileRecord, HeaderOfOneLayoutInAnObjectOfAnothersSizeIsRejected) {
  const LayoutInfo& v2 = *find_layout(2);
  // A layout-2 header padded to this layout's size.
  Record r = good_;
  r.header.version = 2;
  r.header.record_size = v2.record_size;
  write_object(name_, &r, sizeof r);
  EXPECT_EQ(open_error(), ReadError::bad_size);
  // This layout's header cut to layout 2's size.
  write_object(name_, &good_, v2.record_size);
  EXPECT_EQ(open_error(), ReadError::bad_size);
  EXPECT_EQ(find_layout(1), nullptr);  // layout 1 is not read
}
