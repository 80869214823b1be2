// read_trace_input: CSV or PyTorch snapshot. See trace_input.h.
#include "trace_input.h"

#include <sstream>

#include "bounded_file.h"

namespace gpustitch::replay {

TraceInputStatus read_trace_input(const std::string& path, TraceInput* in, std::string* why) {
  std::string bytes;
  switch (read_bounded_file(path, kMaxTraceFileBytes, &bytes, why)) {
    case BoundedRead::ok:
      break;
    case BoundedRead::cannot_open:
      return TraceInputStatus::cannot_open;
    case BoundedRead::refused:
      return TraceInputStatus::malformed;
  }
  TraceInput result;
  if (looks_like_pickle(bytes)) {
    SnapshotImport report;
    std::string err;
    if (!read_pytorch_snapshot(bytes, &result.trace, &report, &err)) {
      *why = path + ": " + err;
      return TraceInputStatus::malformed;
    }
    result.snapshot = report;
  } else {
    std::istringstream text(std::move(bytes));
    result.trace = trace::read_trace(text);
  }
  if (result.trace.events.empty()) {
    *why = path + ": not an allocation trace (an RMM-format CSV or a PyTorch memory snapshot): ";
    if (!result.trace.errors.empty()) {
      const auto& e = result.trace.errors.front();
      *why += "line " + std::to_string(e.line) + ": " + e.reason;
    } else {
      *why += "no allocation events";
    }
    return TraceInputStatus::malformed;
  }
  double first = result.trace.events.front().time_s;
  for (const auto& e : result.trace.events)
    if (e.time_s != first) {
      result.has_time = true;
      break;
    }
  *in = std::move(result);
  return TraceInputStatus::ok;
}

}  // namespace gpustitch::replay
