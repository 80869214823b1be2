// DevicePool::memory_map: the device's mapped ranges and their blocks, read from the pool's own
// bookkeeping when a snapshot is asked for (`gpustitch snapshot PID`), never kept on the side.
//
// What a segment is: a run of blocks of the device's address space that physical memory backs,
// between two unbacked blocks (address space with nothing mapped), so every physical byte appears
// once. A chunk of the small-object pool is a segment of its own ("small"), cut into its slots.
//
// Consistency: the address space and large blocks are copied under the device lock in one go; each
// chunk's slots, and each large block an arena holds (large_cache.h: live there, or parked, i.e.
// freed and shown as pending), are read afterwards under its arena's lock (arena locks come before
// the device lock, never after it). A chunk given back to the large pool in between is shown as one
// free block: the picture is exact per lock, not across them, which is all a snapshot of a running
// program is.
#include <new>

#include "device_pool.h"

namespace gpustitch::detail {

Status DevicePool::memory_map(std::vector<MappedSegment>* out) const noexcept {
  struct ChunkRef {
    std::size_t segment;  // index in *out
    DevPtr base;
    std::size_t size;
    std::uint16_t arena;
  };
  std::vector<ChunkRef> chunks;
  struct ArenaBlockRef {  // a large block held by an arena: its fields are the arena's
    std::size_t segment;
    std::size_t block;  // index in the segment's blocks
    DevPtr ptr;
    std::uint16_t arena;
  };
  std::vector<ArenaBlockRef> arena_blocks;
  try {
    {
      std::lock_guard lock(mu_);
      for (const LargeHeap* heap : {&heap_, &chunks_})
        for (std::size_t span = 0; span < heap->space().span_count(); ++span) {
          const AddressSpace& space = heap->space();
          MappedSegment* seg = nullptr;
          for (const Block* b = space.first_block(span); b != nullptr; b = b->next) {
            if (b->state == BlockState::unbacked) {
              seg = nullptr;
              continue;
            }
            if (b->state == BlockState::allocated && b->small_chunk) {
              seg = nullptr;
              MappedSegment chunk;
              chunk.device = device_;
              chunk.base = b->ptr;
              chunk.size = b->size;
              chunk.stitched = false;
              chunk.small = true;
              out->push_back(std::move(chunk));
              chunks.push_back({out->size() - 1, b->ptr, b->size, b->arena});
              continue;
            }
            if (seg == nullptr) {
              out->emplace_back();
              seg = &out->back();
              seg->device = device_;
              seg->base = b->ptr;
              seg->stitched = false;
            }
            MappedBlock mb;
            mb.ptr = b->ptr;
            mb.size = b->size;
            if (b->state == BlockState::allocated && b->arena_owned) {
              mb.state = MappedBlock::State::pending;  // until its arena says otherwise
              arena_blocks.push_back({static_cast<std::size_t>(seg - out->data()),
                                      seg->blocks.size(), b->ptr, b->arena});
              seg->size = b->end() - seg->base;
              seg->blocks.push_back(mb);
              continue;
            }
            switch (b->state) {
              case BlockState::allocated:
                mb.state = MappedBlock::State::live;
                mb.requested = b->requested;
                mb.stream = b->stream;
                if (seg->stream == kAnyStream) seg->stream = b->stream;
                break;
              case BlockState::pending:
                mb.state = MappedBlock::State::pending;
                mb.stream = b->stream;
                break;
              default:
                mb.state = MappedBlock::State::free;
                break;
            }
            seg->size = b->end() - seg->base;
            seg->blocks.push_back(mb);
          }
        }
    }
    for (const ArenaBlockRef& ref : arena_blocks) {
      if (ref.arena >= arenas_.size()) continue;
      Arena& a = *arenas_[ref.arena];
      MappedSegment& seg = (*out)[ref.segment];
      MappedBlock& mb = seg.blocks[ref.block];
      std::lock_guard lock(a.mu);
      if (const Block* b = a.large.live(ref.ptr)) {
        mb.state = MappedBlock::State::live;
        mb.requested = b->requested;
        mb.stream = b->stream;
        if (seg.stream == kAnyStream) seg.stream = b->stream;
      } else if (const Block* p = a.large.parked(ref.ptr)) {
        // Freed on that stream (kAnyStream: with cudaFree semantics); pending until a fence.
        mb.stream = p->stream;
      }
      // Neither: it went back to the large pool since the views were read, as pending.
    }
    for (const ChunkRef& ref : chunks) {
      MappedSegment& seg = (*out)[ref.segment];
      const Chunk* c = nullptr;
      if (ref.arena < arenas_.size()) {
        Arena& a = *arenas_[ref.arena];
        std::lock_guard lock(a.mu);
        c = a.small.chunk_of(ref.base);
        if (c != nullptr && c->base == ref.base) {
          // Not allocated: pending until its fence (or its stream's reuse), free once it is back
          // in the chunk's free list.
          std::vector<std::uint8_t> fenced(c->nslots, 0);
          for (std::uint32_t s : c->free_slots) fenced[s] = 1;
          for (std::uint32_t s = 0; s < c->nslots; ++s) {
            MappedBlock mb;
            mb.ptr = c->base + std::size_t{s} * c->slot_size;
            mb.size = c->slot_size;
            if (c->allocated[s]) {
              mb.state = MappedBlock::State::live;
              mb.requested = c->requested[s];
            } else {
              mb.state = fenced[s] ? MappedBlock::State::free : MappedBlock::State::pending;
            }
            seg.blocks.push_back(mb);
          }
          const std::size_t used = std::size_t{c->nslots} * c->slot_size;
          if (used < ref.size) {
            seg.blocks.push_back({c->base + used, ref.size - used, 0, MappedBlock::State::free});
          }
        } else {
          c = nullptr;
        }
      }
      if (c == nullptr) {  // given back to the large pool since the views were read
        seg.small = false;
        seg.blocks.push_back({ref.base, ref.size, 0, MappedBlock::State::free});
      }
    }
  } catch (const std::bad_alloc&) {
    return Status::out_of_memory;
  }
  return Status::ok;
}

}  // namespace gpustitch::detail
