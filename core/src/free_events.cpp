// FreeEvents: see free_events.h for the design.
#include "free_events.h"

namespace gpustitch::detail {

FreeEvents::~FreeEvents() {
  for (Slot& s : slots_) {
    if (s.created) backend_.destroy_event(s.event);
  }
}

std::uint64_t FreeEvents::record(Stream stream) noexcept {
  if (unsupported_ || stream == kAnyStream) return 0;
  Slot& slot = slots_[next_ % kSlots];
  if (!slot.created) {
    const Status s = backend_.create_event(device_, &slot.event);
    if (s == Status::not_supported) unsupported_ = true;
    if (s != Status::ok) return 0;
    slot.created = true;
  }
  if (backend_.record_event(device_, slot.event, stream) != Status::ok) {
    slot.seq = 0;  // the slot's earlier record may be gone too
    return 0;
  }
  slot.stream = stream;
  slot.seq = next_;
  ++records_;
  return next_++;
}

bool FreeEvents::query(Slot& slot) noexcept {
  bool done = false;
  return backend_.query_event(slot.event, &done) == Status::ok && done;
}

FreeEvents::Slot* FreeEvents::answering(Stream stream, std::uint64_t seq) noexcept {
  if (seq == 0 || seq >= next_) return nullptr;
  Slot& own = slots_[seq % kSlots];
  if (own.seq == seq) return own.stream == stream ? &own : nullptr;  // not that stream's free
  // Overwritten: the oldest later record of the stream answers for it.
  Slot* later = nullptr;
  for (Slot& s : slots_) {
    if (s.seq > seq && s.stream == stream && (later == nullptr || s.seq < later->seq)) later = &s;
  }
  return later;
}

bool FreeEvents::completed(Stream stream, std::uint64_t seq) noexcept {
  Slot* slot = answering(stream, seq);
  return slot != nullptr && query(*slot);
}

Event FreeEvents::event_of(Stream stream, std::uint64_t seq) noexcept {
  Slot* slot = answering(stream, seq);
  return slot != nullptr ? slot->event : 0;
}

}  // namespace gpustitch::detail
