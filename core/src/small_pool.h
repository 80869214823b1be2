// Small-object pool: requests below small_limit are carved by size class from chunks (2 MiB by
// default) that the large pool hands out as ordinary allocated blocks. Small objects therefore
// never split a large block, so a live 4 KiB tensor cannot pin a 20 MiB segment (the pinning
// failure the PyTorch allocator has).
//
// Size classes: 512 B steps up to 2 KiB, then four classes per power of two (at most 25% internal
// waste). Each chunk serves one class.
//
// Chunk sizes grow with their class: a class's first chunk holds kMinSlots slots (at least
// kMinChunk bytes), and each further chunk it holds doubles that, up to chunk_size (2 MiB). A
// program with a few live objects in each of many classes thus holds a few small chunks, which
// the device pool cuts from shared 2 MiB handles, instead of one 2 MiB chunk per class: in replay
// of hf_llama_generate 13 classes held 26 MiB of chunks for 2.7 MiB of live objects, 4% of the
// program's peak. A class with many live objects still gets 2 MiB chunks after a few steps, so
// the number of chunk requests (each under the device lock) grows only by that many per class.
//
// A freed slot is "pending" until the device has finished the work queued before its free (see
// reclaimer.cpp). A slot freed with cudaFree semantics is queued FIFO with its fence epoch and
// becomes reusable by anyone once that epoch is fenced. A slot freed on a stream (cudaFreeAsync)
// goes to that stream's cache instead, where the same stream may reuse it at once (stream order
// makes that safe); it joins the fence queue only when it leaves the cache (the cache of its class
// is full, or the caches are dropped on trim or out-of-memory). So a stream that allocates and
// frees in a loop never touches the fence queue, and the reclaimer has nothing to walk for it.
// Each cache is bounded (1/32 of a chunk's slots, 2 to 16: small_pool.cpp), so the memory a stream
// keeps for itself stays small; trim and out-of-memory empty the caches into the fence queue.
//
// Invariant: a chunk's `pending` count equals the number of entries naming it in the fence queue
// and the stream caches together, so a chunk with live == pending == 0 is named by none.
//
// Empty chunks are the arena's, not their class's: a chunk whose last slot is fenced leaves its
// class for a short list of spares (kMaxSpareChunks, newest last), and a class that needs a chunk
// takes a spare before it asks the device pool, re-carving it if it was another class's (no slot
// names it, so its tables are simply reset, without allocating once they have grown). Why: with
// mixed sizes the classes near small_limit hold two or three slots per chunk, so their chunks
// empty and refill all the time. One spare per class sent a chunk back to the device pool, under
// the device lock and from the reclaimer thread, whenever a second chunk of a class emptied, and
// the next allocation of that class took one from it again: in pool_bench's mixed-sizes run with
// cudaFree semantics that churn was the largest use of the device lock. The spares overflow down
// to half the bound in one device-lock hold.
//
// A class with no free slot first asks the source whether to fence the arena's queued slots
// itself (DevicePool: yes when the device looked idle and a fence costs less than the device
// pool's path, or the device pool has no fenced chunk to give). The arena's lock is held from the
// free of every queued slot through the fence, so one fence covers them all. Without it, slots
// freed with cudaFree semantics waited for the reclaimer's pass (every 0.5 ms), and a thread
// looping over many classes took a chunk from the device pool for each meanwhile: the mixed-sizes
// benchmark with cudaFree semantics ran at 175 ns per operation on one thread, and slower on two
// (pool_bench, on the 2-core CI machine).
//
// Hot-path costs are kept O(1) without heap allocation in the steady state: the size class is
// computed (no search), caches are fixed rings, and the last stream's cache is remembered so a
// stream looping on one thread skips the hash lookup.
//
// Host memory: nothing here throws. An allocation that cannot get host memory for its tables
// fails like one without device memory; a free that cannot queue its slot leaves the slot unused
// until its chunk is carved afresh (small_pool.cpp).
//
// Not thread-safe: DevicePool calls it under its arena's lock.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <unordered_map>
#include <vector>

#include "pool_types.h"

namespace gpustitch::detail {

struct Chunk {
  Block* block = nullptr;
  DevPtr base = 0;
  std::size_t size = 0;  // bytes of the chunk (its block's size)
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

// Supplies and takes back chunks (DevicePool::ArenaChunks: one per arena and call).
class ChunkSource {
 public:
  virtual ~ChunkSource() = default;
  virtual Block* take_chunk(std::size_t size) noexcept = 0;
  virtual void return_chunks(Block* const* blocks, std::size_t n) noexcept = 0;
  // Waits for the device if that costs less than taking a chunk of `size`; false if it did not.
  virtual bool fence_for_chunk(std::size_t size) noexcept = 0;
};

struct SmallAlloc {
  DevPtr ptr = 0;
  Chunk* chunk = nullptr;
  std::uint32_t slot = 0;
  bool from_new_chunk = false;  // a chunk was taken from the source
  bool fenced = false;          // the source fenced and every queued slot was promoted
};

class SmallPool {
 public:
  // Empty chunks an arena keeps for any class (2 MiB each at most).
  static constexpr std::size_t kMaxSpareChunks = 8;
  // A class's first chunk: this many slots, and at least kMinChunk bytes.
  static constexpr std::size_t kMinSlots = 16;
  static constexpr std::size_t kMinChunk = 64 * KiB;

  SmallPool(std::size_t limit, std::size_t granularity);
  ~SmallPool();

  std::size_t limit() const { return limit_; }
  std::size_t chunk_size() const { return chunk_size_; }  // the largest chunk
  // The size of the next chunk class `cls` takes (see the top of this file).
  std::size_t next_chunk_size(std::uint32_t cls) const;
  std::size_t class_size(std::size_t size) const;

  // Allocates one slot; ptr == 0 when no chunk could be had.
  SmallAlloc allocate(std::size_t size, Stream stream, ChunkSource& source) noexcept;
  void free(Chunk* chunk, std::uint32_t slot, Stream stream, std::uint64_t epoch) noexcept;
  // Makes slots freed at or before epoch reusable. Chunks that become empty join the spares; those
  // beyond kMaxSpareChunks go back to source.
  void promote(std::uint64_t epoch, ChunkSource& source) noexcept;
  bool has_pending() const { return !pending_.empty(); }
  // Returns every empty, fenced chunk (the spares) to source. Returns the number of chunks
  // returned.
  std::size_t release_empty(ChunkSource& source) noexcept;
  // Empties the per-stream caches into the fence queue (their slots are reusable by anyone once
  // fenced).
  void drop_stream_caches() noexcept;
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
    std::uint32_t chunks = 0;     // chunks carved for this class and not spare
    std::vector<Chunk*> partial;  // chunks with free slots and live + pending > 0
  };
  // A bounded LIFO of one stream's freed slots of one class; the oldest leaves when it is full.
  class SlotRing {
   public:
    bool empty() const { return size_ == 0; }
    bool full() const { return size_ == cap_; }
    void push(const SlotRef& r) {
      if (!buf_) buf_ = std::make_unique<SlotRef[]>(cap_);
      buf_[(head_ + size_++) % cap_] = r;
    }
    SlotRef pop_newest() { return buf_[(head_ + --size_) % cap_]; }
    SlotRef pop_oldest() {
      SlotRef r = buf_[head_];
      head_ = (head_ + 1) % cap_, --size_;
      return r;
    }
    void set_capacity(std::uint32_t cap) { cap_ = cap; }

   private:
    std::unique_ptr<SlotRef[]> buf_;
    std::uint32_t cap_ = 1, head_ = 0, size_ = 0;
  };
  using StreamCache = std::vector<SlotRing>;  // by class
  // The fence queue of slots freed with cudaFree semantics: a FIFO ring that only grows. A deque
  // allocated a node every 21 frees and the reclaimer freed it from its own thread, which cost a
  // cudaFree-semantics pair about a tenth of its time in malloc.
  class SlotQueue {
   public:
    bool empty() const { return size_ == 0; }
    const SlotRef& front() const { return buf_[head_]; }
    void pop_front() { head_ = (head_ + 1) & (buf_.size() - 1), --size_; }
    void push_back(const SlotRef& r) {
      if (size_ == buf_.size()) grow();
      buf_[(head_ + size_++) & (buf_.size() - 1)] = r;
    }

   private:
    void grow() {
      std::vector<SlotRef> bigger(buf_.empty() ? 256 : buf_.size() * 2);
      for (std::size_t i = 0; i < size_; ++i) bigger[i] = buf_[(head_ + i) & (buf_.size() - 1)];
      buf_.swap(bigger);
      head_ = 0;
    }
    std::vector<SlotRef> buf_;  // a power of two in size
    std::size_t head_ = 0, size_ = 0;
  };
  StreamCache& cache_of(Stream stream);

  std::uint32_t class_index(std::size_t size) const;
  void add_partial(Chunk* c) noexcept;
  // Appends to the fence queue; without host memory the slot is left unused instead, until its
  // chunk is carved afresh (the chunk's pending count still equals the entries naming it).
  void queue(const SlotRef& ref) noexcept;
  SmallAlloc allocate_slot(std::size_t size, Stream stream, ChunkSource& source);
  void remove_partial(Chunk* c);
  void take_slot(Chunk* c, std::uint32_t slot, std::size_t requested);
  // A chunk for class cls, carved: a spare (one of that class first), else one from source
  // (*from_source set). nullptr if source has none.
  Chunk* new_chunk(std::uint32_t cls, ChunkSource& source, bool* from_source);
  // The spare new_chunk would carve for cls, or SIZE_MAX.
  std::size_t spare_for(std::uint32_t cls) const;
  void carve(Chunk* c, std::uint32_t cls);
  // Returns spare_[0, n) (the oldest) to source in one call and forgets them.
  void release_spares(std::size_t n, ChunkSource& source) noexcept;

  std::size_t limit_;
  std::size_t chunk_size_;
  std::vector<SizeClass> classes_;
  std::map<DevPtr, Chunk*> chunks_;      // every chunk, spares included
  std::vector<Chunk*> spare_;            // empty chunks (live == pending == 0), oldest first
  mutable Chunk* last_chunk_ = nullptr;  // chunk_of's last answer
  SlotQueue pending_;
  std::unordered_map<Stream, StreamCache> stream_caches_;
  Stream last_stream_ = kAnyStream;  // the stream whose cache is last_cache_
  StreamCache* last_cache_ = nullptr;
  std::size_t live_slots_ = 0;
};

}  // namespace gpustitch::detail
