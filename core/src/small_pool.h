// Small-object pool: requests below small_limit are carved by size class from chunks (2 MiB by
// default) that the large pool hands out as ordinary allocated blocks. Small objects therefore
// never split a large block, so a live 4 KiB tensor cannot pin a 20 MiB segment (the pinning
// failure the PyTorch allocator has).
//
// Size classes: 512 B steps up to 2 KiB, then four classes per power of two (at most 25% internal
// waste). Each chunk serves one class.
//
// A freed slot is "pending" until the device has finished the work queued before its free (see
// reclaimer.cpp): it is queued FIFO with its fence epoch and becomes reusable by anyone once that
// epoch is fenced. A slot freed on a stream (cudaFreeAsync) is also remembered in that stream's
// cache and may be reused by the same stream at once, as stream order makes that safe. Every state
// change bumps the slot's generation, so stale queue and cache entries are recognised and skipped.
//
// Not thread-safe: DevicePool calls it under its lock.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <unordered_map>
#include <vector>

#include "pool_types.h"

namespace gpustitch::detail {

struct Chunk {
  Block* block = nullptr;
  DevPtr base = 0;
  std::uint32_t cls = 0;
  std::uint32_t slot_size = 0;
  std::uint32_t nslots = 0;
  std::uint32_t live = 0;     // allocated slots
  std::uint32_t pending = 0;  // freed slots not yet fenced
  std::vector<std::uint32_t> free_slots;
  std::vector<std::uint32_t> requested;  // per slot, for statistics
  std::vector<std::uint32_t> gen;        // per slot generation
  std::vector<std::uint8_t> allocated;   // per slot: 1 if live
  std::size_t partial_index = SIZE_MAX;  // position in its class's partial list
};

// Supplies and takes back chunks (implemented by DevicePool).
class ChunkSource {
 public:
  virtual ~ChunkSource() = default;
  virtual Block* take_chunk(std::size_t size) noexcept = 0;
  virtual void return_chunk(Block* block) noexcept = 0;
};

struct SmallAlloc {
  DevPtr ptr = 0;
  Chunk* chunk = nullptr;
  std::uint32_t slot = 0;
  bool from_new_chunk = false;
};

class SmallPool {
 public:
  SmallPool(std::size_t limit, std::size_t granularity);
  ~SmallPool();

  std::size_t limit() const { return limit_; }
  std::size_t chunk_size() const { return chunk_size_; }
  std::size_t class_size(std::size_t size) const;

  // Allocates one slot; ptr == 0 when no chunk could be had.
  SmallAlloc allocate(std::size_t size, Stream stream, ChunkSource& source);
  void free(Chunk* chunk, std::uint32_t slot, Stream stream, std::uint64_t epoch);
  // Makes slots freed at or before epoch reusable. Returns chunks that became empty beyond one
  // spare per class to source.
  void promote(std::uint64_t epoch, ChunkSource& source);
  bool has_pending() const { return !pending_.empty(); }
  // Returns every empty, fenced chunk to source. Returns the number of chunks returned.
  std::size_t release_empty(ChunkSource& source);
  // Forgets per-stream caches (their slots stay queued for the fence).
  void drop_stream_caches() { stream_caches_.clear(); }
  // The chunk containing ptr, if any.
  Chunk* chunk_of(DevPtr ptr) const;

  std::size_t live_slots() const { return live_slots_; }

 private:
  struct SlotRef {
    Chunk* chunk;
    std::uint32_t slot;
    std::uint32_t gen;
    std::uint64_t epoch;
  };
  struct SizeClass {
    std::uint32_t size = 0;
    std::vector<Chunk*> partial;  // chunks with free slots
    std::size_t empty = 0;        // chunks with live == pending == 0
  };
  using StreamCache = std::vector<std::deque<SlotRef>>;  // by class

  std::uint32_t class_index(std::size_t size) const;
  void add_partial(Chunk* c);
  void remove_partial(Chunk* c);
  void take_slot(Chunk* c, std::uint32_t slot, std::size_t requested);
  void destroy_chunk(Chunk* c, ChunkSource& source);

  std::size_t limit_;
  std::size_t chunk_size_;
  std::vector<SizeClass> classes_;
  std::map<DevPtr, Chunk*> chunks_;
  std::deque<SlotRef> pending_;
  std::unordered_map<Stream, StreamCache> stream_caches_;
  std::size_t live_slots_ = 0;
};

}  // namespace gpustitch::detail
