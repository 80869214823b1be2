// libFuzzer target: arbitrary bytes as an allocation trace (RMM's logging CSV). read_trace reads
// files from killed processes and foreign tools, so for any input it must return without crashing
// or hanging, and what it returns must be coherent: kept errors bounded and never more than the
// bad lines counted, event line numbers inside the input, a device count of at least one.
#include <cstdint>
#include <sstream>
#include <string>

#include "gpustitch/trace/trace_reader.h"

using namespace gpustitch::trace;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);
  std::istringstream in(bytes);
  Trace trace = read_trace(in);
  if (trace.errors.size() > kMaxKeptErrors) __builtin_trap();
  if (trace.errors.size() > trace.bad_lines) __builtin_trap();
  std::uint64_t lines = 1;
  for (char c : bytes) lines += c == '\n';
  for (const TraceEvent& ev : trace.events) {
    if (ev.line == 0 || ev.line > lines) __builtin_trap();
  }
  if (trace.device_count() < 1) __builtin_trap();
  // Line-based parsing (time fields in both formats) on the raw bytes as one field.
  (void)parse_trace_time(bytes);
  return 0;
}
