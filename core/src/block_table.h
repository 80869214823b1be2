// Live large blocks by start address: how a free finds its block (the device pool's table, and
// each arena's for the blocks it holds).
//
// An open-addressing hash table: linear probing over a power-of-two array of {address, block}
// pairs kept at most half full, Fibonacci hashing of the address (block addresses are
// granularity-aligned, so their low bits carry nothing), and backward-shift deletion (no
// tombstones, so probe chains never lengthen with churn). Why not std::unordered_map: its lookup
// divides by a prime bucket count and each insert allocates a node. On pool_bench's 8 MiB
// cudaFree-semantics pair the map's find, insert and erase took about a fifth of the pair's time
// (perf); here a lookup is a multiply and one or two probes of adjacent entries, and memory is
// allocated only when the table doubles.
//
// Not thread-safe: used under the lock of its owner (the device pool or an arena).
#pragma once

#include <cstdint>
#include <vector>

#include "pool_types.h"

namespace gpustitch::detail {

class BlockTable {
 public:
  // capacity: entries before the first growth (rounded up to a power of two, times two).
  explicit BlockTable(std::size_t capacity = 32) {
    std::size_t n = 16;
    while (n < capacity * 2) n *= 2;
    reset(n);
  }

  bool empty() const { return size_ == 0; }
  std::size_t size() const { return size_; }

  // Adds b under b->ptr (not present yet, nonzero).
  void insert(Block* b) {
    if ((size_ + 1) * 2 > entries_.size()) grow();
    place(b->ptr, b);
    ++size_;
  }

  Block* find(DevPtr ptr) const noexcept {
    for (std::size_t i = home(ptr);; i = (i + 1) & mask_) {
      if (entries_[i].ptr == ptr) return entries_[i].block;
      if (entries_[i].ptr == 0) return nullptr;
    }
  }

  // Removes and returns the block at ptr; nullptr if none.
  Block* take(DevPtr ptr) noexcept {
    if (ptr == 0) return nullptr;
    std::size_t i = home(ptr);
    while (entries_[i].ptr != ptr) {
      if (entries_[i].ptr == 0) return nullptr;
      i = (i + 1) & mask_;
    }
    Block* b = entries_[i].block;
    // Backward shift: move later entries of the chain into the hole unless that would put one
    // before its home slot.
    for (std::size_t j = (i + 1) & mask_; entries_[j].ptr != 0; j = (j + 1) & mask_) {
      const std::size_t k = home(entries_[j].ptr);
      if (((j - k) & mask_) >= ((j - i) & mask_)) {
        entries_[i] = entries_[j];
        i = j;
      }
    }
    entries_[i] = Entry{};
    --size_;
    return b;
  }

 private:
  struct Entry {
    DevPtr ptr = 0;
    Block* block = nullptr;
  };

  std::size_t home(DevPtr ptr) const noexcept {
    return static_cast<std::size_t>((ptr * 0x9E3779B97F4A7C15ull) >> shift_);
  }
  void place(DevPtr ptr, Block* b) noexcept {
    std::size_t i = home(ptr);
    while (entries_[i].ptr != 0) i = (i + 1) & mask_;
    entries_[i] = Entry{ptr, b};
  }
  void reset(std::size_t n) {
    entries_.assign(n, Entry{});
    mask_ = n - 1;
    shift_ = 64;
    while (n > 1) n >>= 1, --shift_;
  }
  void grow() {
    std::vector<Entry> old;
    old.swap(entries_);
    reset(old.size() * 2);
    for (const Entry& e : old) {
      if (e.ptr != 0) place(e.ptr, e.block);
    }
  }

  std::vector<Entry> entries_;
  std::size_t mask_ = 0;
  int shift_ = 64;
  std::size_t size_ = 0;
};

}  // namespace gpustitch::detail
