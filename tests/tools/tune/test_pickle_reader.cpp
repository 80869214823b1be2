// The pickle reader on the bytes Python writes (protocol 4 with FRAME and the memo, protocol 2
// from gpustitch's own writer) and on bytes it must refuse; and a snapshot read as a trace.
#include <gtest/gtest.h>

#include "gpustitch/trace/pickle_writer.h"
#include "pickle_reader.h"
#include "snapshot_fixture.h"
#include "snapshot_trace.h"

using namespace gpustitch;
using namespace gpustitch::replay;

TEST(PickleReader, ReadsPythonsProtocol4WithMemo) {
  // pickle.dumps({'a': [1, 'x', 'x'], 'b': None, 'c': 2.5, 'd': True, 'e': -3, 'f': 2**40}, 4)
  // (the bytes Python 3 writes)
  std::string bytes = {
      '\x80', '\x04', '\x95', '\x41', '\x00', '\x00', '\x00', '\x00', '\x00', '\x00', '\x00',
      '\x7d', '\x94', '\x28', '\x8c', '\x01', '\x61', '\x94', '\x5d', '\x94', '\x28', '\x4b',
      '\x01', '\x8c', '\x01', '\x78', '\x94', '\x68', '\x03', '\x65', '\x8c', '\x01', '\x62',
      '\x94', '\x4e', '\x8c', '\x01', '\x63', '\x94', '\x47', '\x40', '\x04', '\x00', '\x00',
      '\x00', '\x00', '\x00', '\x00', '\x8c', '\x01', '\x64', '\x94', '\x88', '\x8c', '\x01',
      '\x65', '\x94', '\x4a', '\xfd', '\xff', '\xff', '\xff', '\x8c', '\x01', '\x66', '\x94',
      '\x8a', '\x06', '\x00', '\x00', '\x00', '\x00', '\x00', '\x01', '\x75', '\x2e'};
  std::string why;
  PickleRef v = read_pickle(bytes, &why);
  ASSERT_TRUE(v) << why;
  const auto* a = v->get("a");
  ASSERT_TRUE(a && a->as_list());
  ASSERT_EQ(a->as_list()->size(), 3u);
  std::int64_t i = 0;
  EXPECT_TRUE((*a->as_list())[0]->as_int(&i));
  EXPECT_EQ(i, 1);
  EXPECT_EQ(*(*a->as_list())[2]->as_str(), "x");  // BINGET of the memoized string
  EXPECT_TRUE(v->get("b")->is_none());
  EXPECT_EQ(std::get<double>(v->get("c")->v), 2.5);
  EXPECT_TRUE(v->get("e")->as_int(&i));
  EXPECT_EQ(i, -3);
  EXPECT_TRUE(v->get("f")->as_int(&i));
  EXPECT_EQ(i, 1ll << 40);
}

TEST(PickleReader, ReadsGpustitchsOwnWriter) {
  trace::PickleWriter w;
  w.begin_dict();
  w.key("list");
  w.begin_list();
  for (int k = 0; k < 2500; ++k) w.integer(k);  // three APPENDS batches
  w.end_list();
  w.uint_entry("big", 0xffffffffffff0000ull);
  w.end_dict();
  std::string why;
  PickleRef v = read_pickle(w.finish(), &why);
  ASSERT_TRUE(v) << why;
  EXPECT_EQ(v->get("list")->as_list()->size(), 2500u);
  std::int64_t i = 0;
  ASSERT_TRUE(v->get("big")->as_int(&i));
  EXPECT_EQ(static_cast<std::uint64_t>(i), 0xffffffffffff0000ull);
}

TEST(PickleReader, RefusesCodeAndTruncation) {
  std::string why;
  // GLOBAL 'os system': a pickle that would run code.
  EXPECT_FALSE(read_pickle(std::string("\x80\x02"
                                       "cos\nsystem\n."),
                           &why));
  EXPECT_NE(why.find("unsupported pickle opcode 0x63"), std::string::npos) << why;
  EXPECT_FALSE(read_pickle(std::string("\x80\x04}\x94(\x8c\x05"
                                       "ab",
                                       8),
                           &why));
  EXPECT_NE(why.find("truncated"), std::string::npos) << why;
}

TEST(SnapshotTrace, TruncatedRingIsReconstructedAndReported) {
  constexpr std::uint64_t MB = 1 << 20;
  // The ring starts with the free of a block allocated before it (lost alloc); block 0x3000 is
  // live at the snapshot with no alloc recorded; 0x2000 is allocated and freed in the record.
  std::vector<test::FixtureEntry> ring = {
      {"free_requested", 0x1000, 4 * MB, 7, 10}, {"free_completed", 0x1000, 4 * MB, 7, 11},
      {"segment_alloc", 0x2000, 20 * MB, 7, 12}, {"alloc", 0x2000, 6 * MB, 7, 13},
      {"free_requested", 0x2000, 6 * MB, 7, 14}, {"free_completed", 0x2000, 6 * MB, 7, 15},
  };
  std::vector<test::FixtureSegment> segments = {
      {0x1000,
       40 * MB,
       {{0x3000, 8 * MB, 8 * MB, "active_allocated"}, {0x4000, 2 * MB, 0, "inactive"}}}};
  std::string bytes = test::Protocol4Pickler().dump_snapshot(segments, {ring});
  trace::Trace tr;
  SnapshotImport rep;
  std::string why;
  ASSERT_TRUE(read_pytorch_snapshot(bytes, &tr, &rep, &why)) << why;
  EXPECT_EQ(rep.entries, 6u);
  EXPECT_EQ(rep.allocs, 1u);
  EXPECT_EQ(rep.frees, 2u);  // free_completed only
  EXPECT_EQ(rep.lost_allocs, 1u);
  EXPECT_EQ(rep.lost_alloc_bytes, 4 * MB);
  EXPECT_EQ(rep.unrecorded_live, 1u);
  EXPECT_EQ(rep.unrecorded_live_bytes, 8 * MB);
  EXPECT_TRUE(rep.truncated());
  // Reserved: 40 MiB at the end; the record's one segment_alloc means 20 MiB before it.
  EXPECT_EQ(rep.reserved_at_snapshot, 40 * MB);
  EXPECT_EQ(rep.recorded_peak_reserved, 40 * MB);
  // Two reconstructed allocs first, then alloc, free, free in time order.
  ASSERT_EQ(tr.events.size(), 5u);
  EXPECT_EQ(tr.events[0].action, trace::TraceAction::allocate);
  EXPECT_EQ(tr.events[1].action, trace::TraceAction::allocate);
  EXPECT_EQ(tr.events[2].action, trace::TraceAction::free);  // 0x1000 at 11 us
  EXPECT_EQ(tr.events[2].ptr, 0x1000u);
  EXPECT_EQ(tr.events[3].ptr, 0x2000u);
  EXPECT_EQ(tr.events[3].stream, 7u);
  EXPECT_DOUBLE_EQ(tr.events[3].time_s, 13e-6);
}

TEST(SnapshotTrace, ASnapshotWithoutDeviceTracesIsRefused) {
  std::string bytes = test::Protocol4Pickler().dump_snapshot({}, {});
  trace::PickleWriter w;
  w.begin_dict();
  w.empty_list_entry("segments");
  w.end_dict();
  trace::Trace tr;
  std::string why;
  EXPECT_FALSE(read_pytorch_snapshot(w.finish(), &tr, nullptr, &why));
  EXPECT_NE(why.find("_record_memory_history"), std::string::npos) << why;
  EXPECT_TRUE(read_pytorch_snapshot(bytes, &tr, nullptr, &why)) << why;  // empty but well formed
}
