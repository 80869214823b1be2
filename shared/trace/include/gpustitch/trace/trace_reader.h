// Reading allocation traces: RAPIDS RMM's logging_resource_adaptor CSV, as RMM writes it and as
// gpustitch's TraceWriter writes it (RMM's columns plus Device and ServedBy).
//
// Tolerant by design: traces come from processes that were killed, disks that filled up, or
// other tools. A line that cannot be parsed is skipped and reported (line number and reason);
// the rest of the trace is still read. Columns are found by header name, so extra or reordered
// columns are fine; a file without a header is read in RMM's column order.
#pragma once

#include <cstdint>
#include <istream>
#include <optional>
#include <string>
#include <vector>

#include "gpustitch/stats.h"
#include "gpustitch/types.h"

namespace gpustitch::trace {

enum class TraceAction : std::uint8_t { allocate, free };

struct TraceEvent {
  std::uint64_t line = 0;  // 1-based line in the file
  std::uint64_t thread = 0;
  double time_s = 0;  // seconds (time of day for RMM's HH:MM:SS.us format)
  TraceAction action = TraceAction::allocate;
  std::uint64_t ptr = 0;
  std::uint64_t size = 0;
  std::uint64_t stream = 0;
  int device = 0;  // 0 when the trace has no Device column
  std::optional<ServedBy> served_by;
};

struct TraceParseError {
  std::uint64_t line;
  std::string reason;
};

struct Trace {
  std::vector<TraceEvent> events;
  std::vector<TraceParseError> errors;  // at most kMaxKeptErrors kept; bad_lines counts all
  std::uint64_t bad_lines = 0;
  bool has_header = false;
  bool gpustitch_columns = false;     // Device/ServedBy present
  int device_count() const noexcept;  // 1 + highest device seen (at least 1)
};

inline constexpr std::size_t kMaxKeptErrors = 100;

Trace read_trace(std::istream& in);
// Returns false (and sets *why) only when the file cannot be opened.
bool read_trace_file(const std::string& path, Trace* out, std::string* why);

// Parses one time field: "HH:MM:SS.ffffff" (RMM) or seconds as a decimal number.
std::optional<double> parse_trace_time(const std::string& text);

}  // namespace gpustitch::trace
