// TraceReader: reads RMM's own logs (both time formats RMM has used), gpustitch's, files without
// a header or with reordered columns, and skips bad lines with their line numbers.
#include <gtest/gtest.h>

#include <sstream>

#include "gpustitch/trace/trace_reader.h"

using namespace gpustitch;
using namespace gpustitch::trace;

TEST(TraceReader, ReadsRmmsOwnLog) {
  // As rmm::mr::logging_resource_adaptor writes it (spdlog pattern "%t,%H:%M:%S.%f,%v").
  std::istringstream in(
      "Thread,Time,Action,Pointer,Size,Stream\n"
      "140573312345856,14:03:07.123456,allocate,0x7f8a40000000,1024,0x7f8a38001020\n"
      "140573312345856,14:03:07.234567,allocate,0x7f8a40000400,2048,0x0\n"
      "140573312345856,14:03:07.345678,free,0x7f8a40000000,1024,0x7f8a38001020\n");
  Trace t = read_trace(in);
  EXPECT_TRUE(t.has_header);
  EXPECT_FALSE(t.gpustitch_columns);
  EXPECT_EQ(t.bad_lines, 0u);
  ASSERT_EQ(t.events.size(), 3u);
  EXPECT_EQ(t.events[0].thread, 140573312345856u);
  EXPECT_EQ(t.events[0].action, TraceAction::allocate);
  EXPECT_EQ(t.events[0].ptr, 0x7f8a40000000u);
  EXPECT_EQ(t.events[0].size, 1024u);
  EXPECT_EQ(t.events[0].stream, 0x7f8a38001020u);
  EXPECT_EQ(t.events[0].device, 0);
  EXPECT_NEAR(t.events[0].time_s, 14 * 3600 + 3 * 60 + 7.123456, 1e-6);
  EXPECT_EQ(t.events[1].stream, 0u);
  EXPECT_EQ(t.events[2].action, TraceAction::free);
  EXPECT_FALSE(t.events[2].served_by.has_value());
}

TEST(TraceReader, AcceptsEpochSecondsAndDeallocate) {
  std::istringstream in(
      "Thread,Time,Action,Pointer,Size,Stream\n"
      "1,1634567890.123456,allocate,0x7f8a40000000,1024,0x7f8a38001020\n"
      "1,1634567890.345678,deallocate,0x7f8a40000000,1024,0x7f8a38001020\n");
  Trace t = read_trace(in);
  ASSERT_EQ(t.events.size(), 2u);
  EXPECT_NEAR(t.events[0].time_s, 1634567890.123456, 1e-3);
  EXPECT_EQ(t.events[1].action, TraceAction::free);
}

TEST(TraceReader, ReadsGpustitchColumnsInAnyOrder) {
  std::istringstream in(
      "Action,Size,Pointer,Thread,Time,Stream,ServedBy,Device\n"
      "allocate,4096,0x1000,9,00:00:01.000000,0xffffffffffffffff,stitched,3\n"
      "free,4096,0x1000,9,00:00:02.000000,0xffffffffffffffff,,3\n");
  Trace t = read_trace(in);
  EXPECT_TRUE(t.gpustitch_columns);
  ASSERT_EQ(t.events.size(), 2u);
  EXPECT_EQ(t.events[0].device, 3);
  EXPECT_EQ(t.events[0].served_by, ServedBy::stitched);
  EXPECT_EQ(t.events[0].stream, kAnyStream);
  EXPECT_EQ(t.events[0].size, 4096u);
  EXPECT_EQ(t.device_count(), 4);
}

TEST(TraceReader, FileWithoutHeaderUsesRmmsColumnOrder) {
  std::istringstream in("5,10:00:00.000001,allocate,7f0000001000,64,0\n");
  Trace t = read_trace(in);
  EXPECT_FALSE(t.has_header);
  ASSERT_EQ(t.events.size(), 1u);
  EXPECT_EQ(t.events[0].ptr, 0x7f0000001000u);  // RMM reads pointers base 16 even without 0x
  EXPECT_EQ(t.events[0].size, 64u);
}

TEST(TraceReader, BadLinesAreSkippedAndReportedWithTheirLineNumbers) {
  std::istringstream in(
      "Thread,Time,Action,Pointer,Size,Stream,Device,ServedBy\n"
      "1,10:00:00.000001,allocate,0x1000,64,0x0,0,fresh\n"
      "1,10:00:00.000002,resize,0x1000,64,0x0,0,\n"
      "1,10:00:00.000003,allocate,0xZZ,64,0x0,0,fresh\n"
      "1,10:00:00.000004,allocate,0x2000,-5,0x0,0,fresh\n"
      "garbage\n"
      "\n"
      "1,10:00:00.000005,free,0x1000,64,0x0,0,\n"
      "1,10:00:00.0000");  // a line cut off by a crash
  Trace t = read_trace(in);
  ASSERT_EQ(t.events.size(), 2u);
  EXPECT_EQ(t.events[1].line, 8u);
  EXPECT_EQ(t.bad_lines, 5u);
  ASSERT_EQ(t.errors.size(), 5u);
  EXPECT_EQ(t.errors[0].line, 3u);
  EXPECT_NE(t.errors[0].reason.find("resize"), std::string::npos);
  EXPECT_EQ(t.errors[1].line, 4u);
  EXPECT_NE(t.errors[1].reason.find("pointer"), std::string::npos);
  EXPECT_EQ(t.errors[2].line, 5u);
  EXPECT_EQ(t.errors[3].line, 6u);
  EXPECT_EQ(t.errors[4].line, 9u);
}

TEST(TraceReader, ParsesBothTimeFormats) {
  EXPECT_NEAR(*parse_trace_time("01:02:03.500000"), 3723.5, 1e-9);
  EXPECT_NEAR(*parse_trace_time("12.25"), 12.25, 1e-9);
  EXPECT_FALSE(parse_trace_time("1:2").has_value());
  EXPECT_FALSE(parse_trace_time("").has_value());
}
