// The events of stream-ordered frees: whether the device has run past a free, asked without
// waiting for the device.
//
// Why. A stream may reuse its own freed memory at once (stream order), but cutting such a block
// inside a large handle leaves the live part pinning the handle's free rest, since a handle is
// split only where the GPU no longer uses it (LargeHeap::split_for_cut; cuMemUnmap does not wait
// for kernels). The pool then fenced the whole device before the cut (stream_cut_fence): on an
// H100 that held HF Llama training at 1.017x of PyTorch's peak allocated instead of 1.03x, but
// GPT waited 158-195 ms in about 2 s of steps for fences. A device fence waits for everything
// queued, up to the cut; the free's own uses usually finished long before. An event recorded at
// the free and queried at the cut says so in about a microsecond: where it has completed, the
// block (and every block its stream freed before it) is as good as fenced.
//
// How. A ring of kSlots events, each created once (lazily) and recorded again and again: a free
// takes the next sequence number and the slot seq % kSlots. A block remembers its free's sequence
// number (Block::free_event; 0: none). completed(stream, seq) queries the slot if it still holds
// seq; if a later free overwrote it, a later record of the same stream still in the ring answers
// for it, since a stream's work completes in order (a conservative answer: that free came later);
// otherwise the answer is "not known", i.e. not completed. Recording costs one cuEventRecord per
// stream-ordered free of a large block, and only once the heap made a large handle, the only
// case a cut can pin.
//
// Not thread-safe: used under the device lock. record() runs on the freeing thread (a per-thread
// stream key names that thread's stream: Backend::record_event).
#pragma once

#include <array>
#include <cstdint>

#include "gpustitch/backend.h"

namespace gpustitch::detail {

class FreeEvents {
 public:
  static constexpr std::size_t kSlots = 128;

  FreeEvents(Backend& backend, int device) noexcept : backend_(backend), device_(device) {}
  ~FreeEvents();
  FreeEvents(const FreeEvents&) = delete;
  FreeEvents& operator=(const FreeEvents&) = delete;

  // Records an event on `stream` (not kAnyStream) now; returns its sequence number, or 0 where
  // none could be recorded (no event support, another context's stream, a driver error).
  std::uint64_t record(Stream stream) noexcept;
  // Whether the device has run past the free that record() numbered seq on `stream`; false when
  // not known. A newer free's number may stand for an older one's (the merged block of both).
  bool completed(Stream stream, std::uint64_t seq) noexcept;
  // The event completed() would ask (0: none). For a waiter without the device lock to poll as a
  // hint: by then the slot may have been recorded again, even on another stream, so the waiter
  // asks completed() again under the lock before it relies on the answer.
  Event event_of(Stream stream, std::uint64_t seq) noexcept;

  // The newer of two frees of one stream, or 0 (not known) if either is not known: what a block
  // merged of both waits for.
  static std::uint64_t later(std::uint64_t a, std::uint64_t b) noexcept {
    return a == 0 || b == 0 ? 0 : (a > b ? a : b);
  }

  std::uint64_t records() const noexcept { return records_; }

 private:
  struct Slot {
    Event event = 0;
    bool created = false;
    Stream stream = kAnyStream;
    std::uint64_t seq = 0;  // the free recorded last (0: none, or its record failed)
  };
  bool query(Slot& slot) noexcept;
  Slot* answering(Stream stream, std::uint64_t seq) noexcept;  // for seq, or nullptr

  Backend& backend_;
  const int device_;
  std::array<Slot, kSlots> slots_{};
  std::uint64_t next_ = 1;
  std::uint64_t records_ = 0;
  bool unsupported_ = false;  // the backend has no events: record() stops trying
};

}  // namespace gpustitch::detail
