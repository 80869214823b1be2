// A PyTorch memory snapshot (torch.cuda.memory._record_memory_history() then _dump_snapshot())
// read as an allocation trace, so that `gpustitch tune` and `replay` serve PyTorch users who never
// ran gpustitch.
//
// The snapshot's device_traces hold, per device, the last N allocator events (a ring buffer,
// max_entries): "alloc" (addr, size as requested, stream, time_us), "free_requested" (the tensor
// was freed) and "free_completed" (its block went back to the cache, after the streams that used
// it were done), "segment_alloc"/"segment_free"/"segment_map"/"segment_unmap" (what the allocator
// reserved), "oom", "snapshot". The trace is the allocs and free_completed events (the moment the
// memory can be reused; free_requested where the snapshot has no free_completed, and "free" in
// PyTorch versions that wrote that), ordered by time across devices.
//
// Truncation: once the ring is full its oldest events are gone, so some frees have no recorded
// alloc, and blocks live when the snapshot was taken (its segments' active_allocated blocks) may
// have none either. Both were live when the surviving record begins, so each becomes an alloc at
// the start of the trace: the demand the replay sees is then what the job really held, not less.
// What happened before the record began (an earlier, higher peak) cannot be recovered; the report
// says how much was reconstructed so the reader can judge.
//
// The allocator's own reserved bytes are also recovered: the snapshot's segments give reserved at
// the end, and the segment events walked back from there give its peak over the record. A replay
// of the PyTorch model can then be checked against what the job actually reserved.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "gpustitch/trace/trace_reader.h"

namespace gpustitch::replay {

struct SnapshotImport {
  std::uint64_t entries = 0;  // device_traces entries read, all devices
  std::uint64_t allocs = 0, frees = 0;
  // Frees whose alloc fell out of the ring: replayed as allocated at the start.
  std::uint64_t lost_allocs = 0, lost_alloc_bytes = 0;
  // Blocks live in the snapshot's segments with no alloc in the ring: allocated at the start too.
  std::uint64_t unrecorded_live = 0, unrecorded_live_bytes = 0;
  std::uint64_t recorded_ooms = 0;
  // Reserved bytes the allocator held: at the snapshot, and at most over the record (summed over
  // devices); has_segment_record is false when the snapshot holds neither segments nor segment
  // events.
  std::uint64_t reserved_at_snapshot = 0, recorded_peak_reserved = 0;
  bool has_segment_record = false;
  bool truncated() const noexcept { return lost_allocs > 0 || unrecorded_live > 0; }
};

// Whether the bytes start like a pickle (PROTO opcode) rather than a CSV.
bool looks_like_pickle(std::string_view bytes) noexcept;

// Reads a snapshot's bytes into *out. Returns false and sets *why when the bytes are not a
// snapshot (not a pickle of plain data, no device_traces, entries of the wrong shape).
bool read_pytorch_snapshot(std::string_view bytes, trace::Trace* out, SnapshotImport* report,
                           std::string* why);

}  // namespace gpustitch::replay
