// The single-writer sequence lock that guards the record's snapshot and site table.
//
// Writer (one thread only, never waits):   seq = s+1 (odd); release fence; write payload;
//                                          seq = s+2 (release).
// Reader (any process, never writes):      s1 = seq; copy payload; acquire fence; s2 = seq;
//                                          accept when s1 == s2 and s1 is even, else retry,
//                                          at most kMaxReadRetries times.
// Readers in other processes copy with pread(2) on the record's descriptor instead of loads from
// a mapping (see record_reader.h); the same protocol applies, each pread acting as the copy.
// The payload is written with plain stores: a torn copy is always detected by the sequence check
// and thrown away, never interpreted.
#pragma once

#include <atomic>
#include <cstdint>

namespace gpustitch::shm {

inline constexpr int kMaxReadRetries = 64;

inline void seqlock_write_begin(std::uint64_t& seq) noexcept {
  std::atomic_ref<std::uint64_t> s(seq);
  s.store(s.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
}

inline void seqlock_write_end(std::uint64_t& seq) noexcept {
  std::atomic_ref<std::uint64_t> s(seq);
  s.store(s.load(std::memory_order_relaxed) + 1, std::memory_order_release);
}

}  // namespace gpustitch::shm
