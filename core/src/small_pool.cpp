// Small-object pool. The design is described in small_pool.h.
#include "small_pool.h"

#include <algorithm>
#include <bit>
#include <new>

namespace gpustitch::detail {
namespace {
// Per stream and class: an eighth of a chunk's slots, between 2 and 64. A stream's cached slots are
// reusable by it alone until they leave the cache, so this bounds what a stream keeps to itself
// (about 256 KiB per class with 2 MiB chunks, 2 slots for the largest classes).
// A stream's cache of one class holds 1/32 of a chunk's slots, 2 to 16. An eighth, 2 to 64, kept
// 11.5 MiB of chunks at hf_llama_generate's peak in stream order against 6.1 MiB freed with
// cudaFree (replay; the memory-first layout then held it at 1.031x of demand, 1.028x after), and
// pool_bench's stream-ordered pairs and mixed sizes ran within their run-to-run spread either way.
constexpr std::size_t kStreamCacheMin = 2, kStreamCacheMax = 16, kStreamCacheShare = 32;

// The class of size (>= 1) in the series 512, 1024, 1536, 2048, then p*5/4, p*3/2, p*7/4, 2p for
// each power of two p >= 2048, computed directly.
std::uint32_t series_index(std::size_t size) {
  if (size <= 2048) return static_cast<std::uint32_t>((size - 1) >> 9);
  const int k = static_cast<int>(std::bit_width(size - 1)) - 1;  // 2^k < size <= 2^(k+1)
  const std::size_t p = std::size_t{1} << k;
  return static_cast<std::uint32_t>(4 + 4 * (k - 11) + ((size - 1 - p) >> (k - 2)));
}
}  // namespace

SmallPool::SmallPool(std::size_t limit, std::size_t granularity) : limit_(limit) {
  chunk_size_ = align_up(std::max<std::size_t>(2 * MiB, 2 * limit), granularity);
  // 512, 1024, 1536, 2048, then p*5/4, p*3/2, p*7/4, 2p for each power of two p >= 2048.
  std::vector<std::uint32_t> sizes = {512, 1024, 1536, 2048};
  for (std::size_t p = 2048; sizes.back() < limit; p *= 2) {
    for (std::size_t num : {5, 6, 7, 8}) sizes.push_back(static_cast<std::uint32_t>(p * num / 4));
  }
  while (sizes.size() > 1 && sizes[sizes.size() - 2] >= limit) sizes.pop_back();
  for (auto s : sizes) classes_.push_back(SizeClass{s, 0, {}});
  spare_.reserve(kMaxSpareChunks + 1);
}

SmallPool::~SmallPool() {
  for (auto& [base, c] : chunks_) delete c;
}

std::size_t SmallPool::next_chunk_size(std::uint32_t cls) const {
  const SizeClass& sc = classes_[cls];
  const std::size_t first =
      std::min(chunk_size_, std::max(kMinChunk, std::bit_ceil(kMinSlots * sc.size)));
  const unsigned doublings = std::min<std::uint32_t>(sc.chunks, 16);
  return std::min(chunk_size_, first << doublings);
}

std::uint32_t SmallPool::class_index(std::size_t size) const {
  // The classes are the series above, cut after the first one >= limit.
  return std::min(series_index(size), static_cast<std::uint32_t>(classes_.size() - 1));
}

SmallPool::StreamCache& SmallPool::cache_of(Stream stream) {
  if (stream == last_stream_) return *last_cache_;
  auto it = stream_caches_.find(stream);
  if (it == stream_caches_.end()) {
    // Built whole before it is inserted: a stream's cache exists with every class or not at
    // all, also when host memory runs out half-way (a throw here leaves nothing behind).
    StreamCache fresh(classes_.size());
    for (std::size_t i = 0; i < classes_.size(); ++i) {
      const std::size_t per_chunk = chunk_size_ / classes_[i].size;
      fresh[i].set_capacity(static_cast<std::uint32_t>(std::clamp<std::size_t>(
          per_chunk / kStreamCacheShare, kStreamCacheMin, kStreamCacheMax)));
    }
    it = stream_caches_.emplace(stream, std::move(fresh)).first;  // node-based: address stable
  }
  StreamCache& caches = it->second;
  last_stream_ = stream;
  last_cache_ = &caches;
  return caches;
}

void SmallPool::drop_stream_caches() noexcept {
  for (auto& [stream, caches] : stream_caches_) {
    for (auto& cache : caches) {
      while (!cache.empty()) queue(cache.pop_oldest());
    }
  }
  stream_caches_.clear();
  last_stream_ = kAnyStream;
  last_cache_ = nullptr;
}

std::size_t SmallPool::class_size(std::size_t size) const {
  return classes_[class_index(std::max<std::size_t>(size, 1))].size;
}

void SmallPool::add_partial(Chunk* c) noexcept {
  if (c->partial_index != SIZE_MAX) return;
  auto& list = classes_[c->cls].partial;
  try {
    list.push_back(c);
  } catch (...) {
    return;  // no host memory: c's free slots wait until it empties (then it is a spare)
  }
  c->partial_index = list.size() - 1;
}

void SmallPool::queue(const SlotRef& ref) noexcept {
  try {
    pending_.push_back(ref);
  } catch (...) {
    // No host memory for the queue: the slot is not reused until its chunk is carved afresh,
    // and `pending` keeps counting only the entries that name the chunk.
    --ref.chunk->pending;
  }
}

void SmallPool::remove_partial(Chunk* c) {
  if (c->partial_index == SIZE_MAX) return;
  auto& list = classes_[c->cls].partial;
  Chunk* last = list.back();
  list[c->partial_index] = last;
  last->partial_index = c->partial_index;
  list.pop_back();
  c->partial_index = SIZE_MAX;
}

void SmallPool::take_slot(Chunk* c, std::uint32_t slot, std::size_t requested) {
  ++c->gen[slot];
  c->allocated[slot] = 1;
  c->requested[slot] = static_cast<std::uint32_t>(requested);
  ++c->live;
  ++live_slots_;
}

SmallAlloc SmallPool::allocate(std::size_t size, Stream stream, ChunkSource& source) noexcept {
  try {
    return allocate_slot(size, stream, source);
  } catch (...) {
    return {};  // host memory ran out (a stream's cache table, a chunk's tables): no slot
  }
}

SmallAlloc SmallPool::allocate_slot(std::size_t size, Stream stream, ChunkSource& source) {
  const std::uint32_t cls = class_index(std::max<std::size_t>(size, 1));
  SizeClass& sc = classes_[cls];
  // 1. A slot this stream freed itself: stream order makes reuse safe without a fence.
  if (stream != kAnyStream && !stream_caches_.empty()) {
    auto it = stream == last_stream_ ? stream_caches_.end() : stream_caches_.find(stream);
    StreamCache* caches = stream == last_stream_       ? last_cache_
                          : it != stream_caches_.end() ? &it->second
                                                       : nullptr;
    if (caches != nullptr) {
      last_stream_ = stream, last_cache_ = caches;
      auto& cache = (*caches)[cls];
      if (!cache.empty()) {
        // Entries are never stale: a slot leaves the cache before anything else can take it.
        SlotRef ref = cache.pop_newest();
        take_slot(ref.chunk, ref.slot, size);
        --ref.chunk->pending;
        return {ref.chunk->base + std::size_t{ref.slot} * ref.chunk->slot_size, ref.chunk,
                ref.slot};
      }
    }
  }
  // 2. A fenced free slot, from a partial chunk of the class or else a spare or new chunk. Before
  // a chunk is taken, the queued slots are fenced here if the source says so (see small_pool.h).
  bool from_new = false, fenced = false;
  // Before a chunk comes from the source, the slots the streams keep for themselves join the
  // fence queue: they may be all that is left in chunks of other classes, which then empty at the
  // fence and serve this class. (In replay of hf_llama_generate in stream order, 24 chunks held
  // no live slot, only cached ones, while new classes took fresh chunks.)
  if (sc.partial.empty() && !stream_caches_.empty() && spare_for(cls) == SIZE_MAX) {
    drop_stream_caches();
  }
  if (sc.partial.empty() && !pending_.empty() && source.fence_for_chunk(next_chunk_size(cls))) {
    promote(UINT64_MAX, source);
    fenced = true;
  }
  Chunk* c = nullptr;
  if (sc.partial.empty()) {
    c = new_chunk(cls, source, &from_new);
    if (c == nullptr) return {};
    add_partial(c);  // without host memory it is not listed; its other slots wait (add_partial)
  } else {
    c = sc.partial.back();
  }
  std::uint32_t slot = c->free_slots.back();
  c->free_slots.pop_back();
  if (c->free_slots.empty()) remove_partial(c);
  take_slot(c, slot, size);
  return {c->base + std::size_t{slot} * c->slot_size, c, slot, from_new, fenced};
}

void SmallPool::free(Chunk* c, std::uint32_t slot, Stream stream, std::uint64_t epoch) noexcept {
  ++c->gen[slot];
  c->allocated[slot] = 0;
  --c->live;
  ++c->pending;
  --live_slots_;
  const SlotRef ref{c, slot, c->gen[slot], epoch};
  if (stream == kAnyStream) {
    queue(ref);
    return;
  }
  try {
    auto& cache = cache_of(stream)[c->cls];
    if (cache.full()) queue(cache.pop_oldest());  // its fence makes it anyone's
    cache.push(ref);
  } catch (...) {
    queue(ref);  // no host memory for the stream's cache: the fence queue instead
  }
}

void SmallPool::carve(Chunk* c, std::uint32_t cls) {
  // No queue or cache entry names c (live == pending == 0, or new), so its tables start afresh;
  // generations only grow, so that a slot index never repeats one it had under an earlier class.
  const std::uint32_t n = static_cast<std::uint32_t>(c->size / classes_[cls].size);
  c->cls = cls;
  c->slot_size = classes_[cls].size;
  c->nslots = n;
  c->free_slots.resize(n);
  for (std::uint32_t i = 0; i < n; ++i) c->free_slots[i] = n - 1 - i;
  c->requested.assign(n, 0);
  c->allocated.assign(n, 0);
  if (c->gen.size() < n) c->gen.resize(n, 0);
}

std::size_t SmallPool::spare_for(std::uint32_t cls) const {
  // A spare of this class keeps its free list as it is; otherwise the smallest spare at least as
  // large as the class's next chunk is carved (the newest of equals). The memory is held already,
  // so a spare is used before the source is asked.
  const std::size_t want = next_chunk_size(cls);
  std::size_t pick = SIZE_MAX;
  for (std::size_t i = spare_.size(); i-- > 0;) {
    if (spare_[i]->cls == cls) return i;
    if (spare_[i]->size >= want && (pick == SIZE_MAX || spare_[i]->size < spare_[pick]->size)) {
      pick = i;
    }
  }
  return pick;
}

Chunk* SmallPool::new_chunk(std::uint32_t cls, ChunkSource& source, bool* from_source) {
  const std::size_t pick = spare_for(cls);
  if (pick != SIZE_MAX) {
    Chunk* c = spare_[pick];
    if (c->cls != cls) carve(c, cls);  // may throw: c is still a spare then
    spare_.erase(spare_.begin() + static_cast<std::ptrdiff_t>(pick));
    ++classes_[cls].chunks;
    return c;
  }
  Block* block = source.take_chunk(next_chunk_size(cls));
  if (block == nullptr) return nullptr;
  // Without host memory for the chunk's tables the block goes straight back: no slot names it.
  std::unique_ptr<Chunk> c(new (std::nothrow) Chunk);
  try {
    if (c == nullptr) throw std::bad_alloc();
    c->block = block;
    c->base = block->ptr;
    c->size = block->size;
    carve(c.get(), cls);
    chunks_.emplace(c->base, c.get());
  } catch (...) {
    source.return_chunks(&block, 1);
    throw;
  }
  *from_source = true;
  ++classes_[cls].chunks;
  return c.release();
}

void SmallPool::release_spares(std::size_t n, ChunkSource& source) noexcept {
  Block* blocks[kMaxSpareChunks + 1];
  for (std::size_t i = 0; i < n; ++i) {
    Chunk* c = spare_[i];
    blocks[i] = c->block;
    chunks_.erase(c->base);
    if (last_chunk_ == c) last_chunk_ = nullptr;
    delete c;
  }
  spare_.erase(spare_.begin(), spare_.begin() + static_cast<std::ptrdiff_t>(n));
  if (n > 0) source.return_chunks(blocks, n);
}

void SmallPool::promote(std::uint64_t epoch, ChunkSource& source) noexcept {
  while (!pending_.empty() && pending_.front().epoch <= epoch) {
    SlotRef ref = pending_.front();
    pending_.pop_front();
    Chunk* c = ref.chunk;
    if (c->gen[ref.slot] != ref.gen) continue;  // reused by its stream meanwhile
    ++c->gen[ref.slot];
    --c->pending;
    c->free_slots.push_back(ref.slot);
    if (c->live == 0 && c->pending == 0) {
      remove_partial(c);
      --classes_[c->cls].chunks;
      spare_.push_back(c);
      if (spare_.size() > kMaxSpareChunks) {
        release_spares(spare_.size() - kMaxSpareChunks / 2, source);
      }
    } else {
      add_partial(c);
    }
  }
}

std::size_t SmallPool::release_empty(ChunkSource& source) noexcept {
  const std::size_t n = spare_.size();
  release_spares(n, source);
  return n;
}

Chunk* SmallPool::chunk_of(DevPtr ptr) const {
  // A thread mostly frees what it just allocated: the last chunk found is checked first.
  if (Chunk* last = last_chunk_; last != nullptr && ptr - last->base < last->size) return last;
  auto it = chunks_.upper_bound(ptr);
  if (it == chunks_.begin()) return nullptr;
  --it;
  Chunk* c = it->second;
  if (ptr >= c->base + c->size) return nullptr;
  last_chunk_ = c;
  return c;
}

}  // namespace gpustitch::detail
