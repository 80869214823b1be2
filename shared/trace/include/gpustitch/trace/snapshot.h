// PyTorch memory snapshots (the pickle torch.cuda.memory._dump_snapshot() writes and
// pytorch.org/memory_viz reads) for any program running under gpustitch.
//
// Three pieces:
//   - LiveBlockTable (a PoolObserver): the live allocations of the process, with the site
//     sampler's stack when one was captured.
//   - build_snapshot(): live blocks -> PyTorch's structure. The pool's own segment list is not
//     part of the observer interface, so segments are derived: each run of granularity-aligned
//     pages touched by live blocks becomes one segment ("large"; "small" when it only holds blocks
//     <= 1 MiB), the gaps between blocks are "inactive" blocks. Cached memory that holds no live
//     block is not shown (the pool reports it as reserved-but-free in its statistics).
//   - write_pytorch_snapshot(): pickles the structure (protocol 2, see pickle_writer.h).
// snapshot_from_trace() builds the same structure from a recorded trace, with device_traces
// (alloc / free_requested / free_completed entries) so memory_viz's timeline tabs work too.
//
// Requesting a snapshot from another process (SnapshotRequests): a file-based rendezvous in a
// per-user directory, polled by a thread the process already has (the statistics publisher):
//   CLI:      writes DIR/snapshot-<pid>.request containing the output path, waits for
//             DIR/snapshot-<pid>.done ("ok" or "error: ...").
//   process:  poll() stats the request file (one stat() per call), takes it by rename, writes the
//             snapshot to PATH.tmp, renames it to PATH and writes .done.
// DIR is $XDG_RUNTIME_DIR/gpustitch, else /tmp/gpustitch-<uid>, mode 0700; the process only
// honours requests in a directory it owns that no one else can write.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory_resource>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

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
  std::string action;  // alloc | free_requested | free_completed | oom
  std::uint64_t addr = 0;
  std::uint64_t size = 0;
  std::uint64_t stream = 0;
  std::uint64_t time_us = 0;
  std::uint64_t device_free = 0;  // oom only
};

struct SnapshotData {
  std::vector<SnapshotSegment> segments;
  std::vector<std::vector<SnapshotTraceEntry>> device_traces;  // one list per device
};

// Streams in snapshots: kAnyStream is written as 0 (PyTorch's default stream), others as is.
std::uint64_t snapshot_stream(Stream s) noexcept;

SnapshotData build_snapshot(const std::vector<LiveBlock>& blocks, int device_count,
                            std::size_t granularity = 2 * MiB);

// The pool's own view of its memory, for when the core can enumerate it (a mapped range and the
// blocks in it, free ones included). Preferred over build_snapshot(): cached memory shows up as
// inactive blocks and segments are the pool's real ranges.
struct PoolBlockView {
  DevPtr ptr = 0;
  std::size_t size = 0;       // bytes the block spans
  std::size_t requested = 0;  // bytes asked for (live blocks)
  enum class State : std::uint8_t { live, free, pending } state = State::free;
};
struct PoolSegmentView {
  int device = 0;
  DevPtr base = 0;
  std::size_t size = 0;
  bool stitched = false;
  Stream stream = kAnyStream;
  std::vector<PoolBlockView> blocks;  // in address order, covering [base, base+size)
};
SnapshotData build_snapshot_from_segments(
    const std::vector<PoolSegmentView>& segments, int device_count,
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

// Live allocations of a process, for snapshots on request.
class LiveBlockTable final : public PoolObserver {
 public:
  // Optional: called for each allocation to attach a stack (e.g. the site sampler's).
  using FramesFor = std::function<std::vector<SnapshotFrame>(DevPtr)>;
  explicit LiveBlockTable(FramesFor frames_for = nullptr) : frames_for_(std::move(frames_for)) {}

  void on_allocate(int device, DevPtr ptr, std::size_t size, Stream stream,
                   ServedBy how) noexcept override;
  void on_free(int device, DevPtr ptr, std::size_t size, Stream stream) noexcept override;

  std::vector<LiveBlock> blocks() const;
  int device_count() const noexcept;

 private:
  struct Entry {
    std::size_t size;
    int device;
    Stream stream;
    ServedBy served_by;
  };
  static constexpr int kShards = 16;
  // Each shard's map draws its nodes from its own pool (under mu), not from malloc: this table
  // sits on every allocation and free of the shim's hot path.
  struct Shard {
    mutable std::mutex mu;
    std::pmr::unsynchronized_pool_resource nodes;
    std::pmr::unordered_map<DevPtr, Entry> live{&nodes};
  };
  Shard& shard(DevPtr p) const noexcept { return shards_[(p >> 9) % kShards]; }
  mutable Shard shards_[kShards];
  FramesFor frames_for_;
  std::atomic<int> max_device_{0};
};

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
