// Trace recording: every allocation and free the pool serves, written as RAPIDS RMM's
// logging_resource_adaptor CSV so RMM's replay benchmark (and `gpustitch replay`) can read it.
//
//   Thread,Time,Action,Pointer,Size,Stream,Device,ServedBy
//   4711,14:03:07.123456,allocate,0x7f3a00000000,1048576,0xffffffffffffffff,0,fresh
//   4711,14:03:07.123470,free,0x7f3a00000000,1048576,0xffffffffffffffff,0,
//
// The first six columns are exactly RMM's (thread id, local wall time HH:MM:SS.microseconds,
// allocate|free, pointer in hex, size in bytes, stream in hex); Device and ServedBy come after
// them, where RMM's parser ignores them. Stream 0xffffffffffffffff is gpustitch::kAnyStream
// (cudaMalloc/cudaFree semantics).
//
// Design (see trace_writer.cpp): the hot path only copies a 40-byte record into a bounded
// lock-free multi-producer ring; a writer thread formats and write()s batches. The drain path
// uses nothing but the ring, a preallocated buffer and write(), so it is async-signal-safe and is
// also run from an atexit hook and from a SIGTERM handler that then chains to the handler that
// was installed before. A full ring is drained by the producer itself, so nothing is dropped
// while the file is writable; a producer waits for another drainer only while it makes
// progress (at most 100 ms without a written batch), and then drops (and counts) its record.
// Only a regular file is traced (a FIFO or device could block the program); an unusable path or a
// failed write (disk full) is reported once on stderr; tracing then stops and the program carries
// on.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "gpustitch/config.h"
#include "gpustitch/stats.h"

namespace gpustitch::trace {

inline constexpr const char* kTraceHeader =
    "Thread,Time,Action,Pointer,Size,Stream,Device,ServedBy";

struct TraceWriterOptions {
  std::string path;
  std::size_t ring_records = 1 << 16;  // rounded up to a power of two
  unsigned flush_interval_ms = 20;     // writer thread period
  bool start_thread = true;            // false: drained only by flush()/full ring (tests)
  bool handle_sigterm = true;          // install the flushing SIGTERM handler (process-wide)
  bool flush_at_exit = true;           // register an atexit flush
};

class TraceWriter final : public PoolObserver {
 public:
  // Opens (truncates) the file and writes the header. Never fails and never blocks: on an
  // unwritable path or one that is not a regular file the problem is reported once on stderr and
  // the writer records nothing (ok() is false).
  explicit TraceWriter(TraceWriterOptions options);
  ~TraceWriter() override;
  TraceWriter(const TraceWriter&) = delete;
  TraceWriter& operator=(const TraceWriter&) = delete;

  void on_allocate(int device, DevPtr ptr, std::size_t size, Stream stream,
                   ServedBy how) noexcept override;
  void on_free(int device, DevPtr ptr, std::size_t size, Stream stream) noexcept override;

  // Writes everything recorded before the call. Blocking; async-signal-safe apart from the
  // bounded wait for a concurrent drainer.
  void flush() noexcept;
  // Stops the writer thread, flushes and closes the file, then reports dropped records (once,
  // on stderr). Later records are ignored.
  void close() noexcept;
  // Reports records dropped so far on stderr, once per writer (atexit does this for the hooks'
  // writers).
  void report_dropped() noexcept;

  bool ok() const noexcept { return !failed_.load(std::memory_order_relaxed); }
  std::uint64_t records_written() const noexcept {
    return written_.load(std::memory_order_relaxed);
  }
  std::uint64_t records_dropped() const noexcept {
    return dropped_.load(std::memory_order_relaxed);
  }
  const std::string& path() const noexcept { return options_.path; }
  const TraceWriterOptions& options() const noexcept { return options_; }

  // fork(): the child has no writer thread and shares the file with the parent, so it stops
  // recording (its records would interleave with the parent's). Call from pthread_atfork's child
  // hook; the writer registers this itself when constructed.
  void on_fork_child() noexcept;

  struct Impl;

 private:
  void record(std::uint8_t action, int device, DevPtr ptr, std::size_t size, Stream stream,
              ServedBy how) noexcept;

  TraceWriterOptions options_;
  std::unique_ptr<Impl> impl_;
  std::atomic<bool> failed_{false};
  std::atomic<bool> enabled_{false};
  std::atomic<std::uint64_t> written_{0};
  std::atomic<std::uint64_t> dropped_{0};
  friend struct Impl;
};

// The writer GPUSTITCH_CONF=trace:PATH asks for, or null when config.trace_path is empty.
std::unique_ptr<TraceWriter> make_trace_writer(const Config& config);

}  // namespace gpustitch::trace
