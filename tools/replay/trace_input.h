// The TRACE argument of `gpustitch replay` and `gpustitch tune`: an RMM-format CSV (recorded by
// gpustitch or by RMM) or a PyTorch memory snapshot pickle, told apart by the file's first byte.
// One place decides what is unreadable (the file cannot be opened) and what is malformed (nothing
// in it is an allocation event, or it is not a regular file, or it is larger than 4 GiB: see
// bounded_file.h), so both commands answer the same way.
#pragma once

#include <optional>
#include <string>

#include "gpustitch/trace/trace_reader.h"
#include "snapshot_trace.h"

namespace gpustitch::replay {

enum class TraceInputStatus { ok, cannot_open, malformed };

struct TraceInput {
  trace::Trace trace;
  std::optional<SnapshotImport> snapshot;  // set when the file was a PyTorch snapshot
  // Whether the events carry times worth plotting against (not all zero, not all equal).
  bool has_time = false;
};

// Reads path into *in. On anything but ok, *why is one line saying what is wrong.
TraceInputStatus read_trace_input(const std::string& path, TraceInput* in, std::string* why);

}  // namespace gpustitch::replay
