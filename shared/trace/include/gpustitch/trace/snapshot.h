// PyTorch memory snapshots (the pickle torch.cuda.memory._dump_snapshot() writes and
// pytorch.org/memory_viz reads) for any program running under gpustitch.
//
// Three pieces:
//   - build_snapshot_from_segments(): the pool's memory map (Pool::memory_map, memory_map.h) ->
//     PyTorch's structure. Segments are the pool's mapped ranges; cached memory shows up as
//     inactive blocks, memory waiting for its fence as active_pending_free. Ranges that touch
//     (a small-object chunk inside a mapped run) are one segment, on stream 0: the address space
//     is the device's, not a stream's, and memory_viz merges a segment_map with its neighbours
//     only on the same stream, so its replay of segment events needs whole runs. This is what a
//     running process writes for `gpustitch snapshot PID`.
//   - build_snapshot(): a list of live blocks -> PyTorch's structure, for recorded traces, where
//     the pool's ranges are not known: each run of granularity-aligned pages touched by live
//     blocks becomes one segment ("large"; "small" when it only holds blocks <= 1 MiB), the gaps
//     between blocks are "inactive" blocks.
//   - write_pytorch_snapshot(): pickles the structure (protocol 2, see pickle_writer.h).
// snapshot_from_trace() builds the structure from a recorded trace, with device_traces
// (alloc / free_requested / free_completed entries) so memory_viz's timeline tabs work too. A live
// process's device_traces come from its ring of recent events (recent_events.h).
//
// Requesting a snapshot from another process (SnapshotRequests): a file-based rendezvous in a
// per-user directory, polled by a thread the process already has (the statistics publisher):
//   CLI:      writes DIR/snapshot-<pid>.request containing the output path, waits for
//             DIR/snapshot-<pid>.done ("ok" or "error: ...").
//   process:  poll() stats the request file (one stat() per call), takes it by rename, writes the
//             snapshot to PATH.tmp, renames it to PATH and writes .done.
// DIR is $XDG_RUNTIME_DIR/gpustitch, else /tmp/gpustitch-<uid>, mode 0700, in the environment of
// the process asked (the CLI reads its /proc/PID/environ: the caller's own XDG_RUNTIME_DIR may be
// set where the process's is not, or the other way round); where that cannot be read the CLI asks
// in both places. The process only honours requests in a directory it owns that no one else can
// write.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "gpustitch/memory_map.h"
#include "gpustitch/stats.h"
#include "gpustitch/trace/trace_reader.h"
#include "gpustitch/types.h"

namespace gpustitch::trace {

struct SnapshotFrame {
  std::string filename;  // library (or source file)
  int line = 0;          // 0: unknown
  std::string name;      // function
};

struct LiveBlock {
  DevPtr ptr = 0;
  std::size_t size = 0;
  int device = 0;
  Stream stream = kAnyStream;
  ServedBy served_by = ServedBy::fresh;
  std::vector<SnapshotFrame> frames;
};

struct SnapshotBlock {
  std::uint64_t address = 0;
  std::uint64_t size = 0;
  std::uint64_t requested_size = 0;
  std::string state;  // active_allocated | inactive
  std::vector<SnapshotFrame> frames;
};

struct SnapshotSegment {
  int device = 0;
  std::uint64_t address = 0;
  std::uint64_t total_size = 0;
  std::uint64_t allocated_size = 0;
  std::uint64_t active_size = 0;
  std::uint64_t requested_size = 0;
  std::uint64_t stream = 0;
  std::string segment_type;    // small | large
  bool is_expandable = false;  // stitched memory: gpustitch's analogue of expandable segments
  std::vector<SnapshotBlock> blocks;
};

struct SnapshotTraceEntry {
  std::string
      action;  // alloc | free_requested | free_completed | oom | segment_map | segment_unmap
  std::uint64_t addr = 0;
  std::uint64_t size = 0;
  std::uint64_t stream = 0;
  std::uint64_t time_us = 0;
  std::uint64_t device_free = 0;           // oom only
  std::vector<SnapshotFrame> frames = {};  // alloc: the allocation's stack, when sampled
};

struct SnapshotData {
  std::vector<SnapshotSegment> segments;
  std::vector<std::vector<SnapshotTraceEntry>> device_traces;  // one list per device
};

// Streams in snapshots: kAnyStream is written as 0 (PyTorch's default stream), others as is.
std::uint64_t snapshot_stream(Stream s) noexcept;

SnapshotData build_snapshot(const std::vector<LiveBlock>& blocks, int device_count,
                            std::size_t granularity = 2 * MiB);

// The pool's memory map (Pool::memory_map of each device) -> PyTorch's structure. frames_for, if
// set, gives the stack recorded for a live block's address (the allocation-site sampler's).
SnapshotData build_snapshot_from_segments(
    const std::vector<MappedSegment>& segments, int device_count,
    const std::function<std::vector<SnapshotFrame>(DevPtr)>& frames_for = nullptr);

// The state after the first `upto` events of the trace (all when upto is 0), with the last
// `max_trace_entries` events as device_traces.
SnapshotData snapshot_from_trace(const Trace& trace, std::size_t upto = 0,
                                 std::size_t granularity = 2 * MiB,
                                 std::size_t max_trace_entries = 100000);

// Serialises to the pickle bytes memory_viz reads.
std::string snapshot_pickle(const SnapshotData& data);
// Writes PATH.tmp then renames to PATH. Returns false and sets *why on failure.
bool write_pytorch_snapshot(const SnapshotData& data, const std::string& path, std::string* why);

// The request channel between `gpustitch snapshot PID` and the process.
class SnapshotRequests {
 public:
  // The per-user rendezvous directory (created 0700 when create is set). Empty on failure.
  static std::string directory(bool create);
  // CLI side: asks process pid to write its snapshot to out_path (absolute) and waits up to
  // timeout_ms. Returns true when the process reported success; *why says what went wrong.
  static bool request(int pid, const std::string& out_path, unsigned timeout_ms, std::string* why);

  // Process side: checks for a request addressed to this process and, if there is one, serves it
  // with make_data(). Cheap when there is none (one stat()). Never throws.
  static bool poll(const std::function<SnapshotData()>& make_data) noexcept;
};

}  // namespace gpustitch::trace
