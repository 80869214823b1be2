// The device's address space: the reservations every large block and small-pool chunk of one
// device lives in, tiled by blocks in address order.
//
// Why one address space per device, not one address range per allocation: blocks freed next to
// each other merge into one free block whatever allocation they came from, so a request larger
// than any single freed block is served from their union without mapping anything. This is what
// keeps PyTorch's expandable segments close to its live bytes; a preloaded cudaMalloc carries no
// stream, so the pool keeps one space per device, not one per stream (expandable segments strand
// free memory in the streams that freed it).
//
// A span is one reservation (cuMemAddressReserve), twice the device's memory by default (costs
// about 3 us on an H200 for 256 GiB, and no physical memory): a span starts as one unbacked
// block, and more spans are reserved only when no unbacked block can hold a request. Blocks never
// merge across spans (a mapping cannot cross a reservation).
//
// Not thread-safe, except contains(): the device lock guards it. Blocks come from a free list of
// nodes, refilled with new(std::nothrow): a split that cannot get a node reports it (host memory
// exhausted) instead of throwing, and in the steady state nothing is allocated.
#pragma once

#include <array>
#include <atomic>
#include <boost/intrusive/set.hpp>

#include "gpustitch/backend.h"
#include "pool_types.h"

namespace gpustitch::detail {

class AddressSpace {
 public:
  static constexpr std::size_t kMaxSpans = 16;

  struct ByAddress {
    bool operator()(const Block& a, const Block& b) const { return a.ptr < b.ptr; }
  };
  using BlockIndex =
      boost::intrusive::set<Block,
                            boost::intrusive::member_hook<Block, AddressHook, &Block::addr_hook>,
                            boost::intrusive::compare<ByAddress>>;
  using UnbackedIndex = boost::intrusive::set<
      Block, boost::intrusive::member_hook<Block, AddressHook, &Block::unbacked_hook>,
      boost::intrusive::compare<ByAddress>>;
  struct Span {
    DevPtr base = 0;
    std::size_t size = 0;
  };

  AddressSpace(Backend& backend, int device, std::size_t granularity) noexcept;
  ~AddressSpace();  // unreserves every span; the caller has unmapped everything
  AddressSpace(const AddressSpace&) = delete;
  AddressSpace& operator=(const AddressSpace&) = delete;

  // Reserves a span of `size` bytes (rounded to the granularity) as one unbacked block, whose
  // blocks serve the requests of size range `range` (LargeHeap).
  Status add_span(std::size_t size, std::uint8_t range = 0) noexcept;
  // Whether ptr lies in a span. Lock-free (a span is published before any pointer into it is
  // handed out, and spans are only removed at destruction).
  bool contains(DevPtr ptr) const noexcept;
  std::size_t span_count() const noexcept { return nspans_.load(std::memory_order_relaxed); }
  std::size_t reserved_bytes() const noexcept;
  const Span& span(std::size_t i) const noexcept { return spans_[i]; }

  // The block containing ptr; nullptr outside every span.
  Block* block_at(DevPtr ptr) const noexcept;
  Block* first_block(std::size_t span) const noexcept;

  // b keeps [0, size) and the rest becomes a new block of b's state right after it (returned),
  // nullptr when no node can be had (nothing changed). An unbacked b stays in the unbacked index
  // and so does the rest.
  Block* split(Block* b, std::size_t size) noexcept;
  // b absorbs its next neighbour (which must exist and be in no index but the address one).
  void absorb_next(Block* b) noexcept;
  // Marks b unbacked (indexed) or takes it out of the unbacked index, for another state.
  void set_unbacked(Block* b) noexcept;
  void clear_unbacked(Block* b) noexcept;
  // Merges an unbacked block with unbacked neighbours; returns the merged block.
  Block* merge_unbacked(Block* b) noexcept;
  const UnbackedIndex& unbacked() const noexcept { return unbacked_; }
  std::size_t blocks() const noexcept { return index_.size(); }

  // Keeps at least n nodes ready, so that a multi-step change cannot fail half-way.
  bool reserve_nodes(std::size_t n) noexcept;

 private:
  Block* new_node() noexcept;
  void delete_node(Block* b) noexcept;

  Backend& backend_;
  const int device_;
  const std::size_t granularity_;
  std::array<Span, kMaxSpans> spans_{};
  std::array<Block*, kMaxSpans> first_{};
  // Published spans, for contains(): base and end, written before nspans_ is raised.
  std::array<std::atomic<DevPtr>, kMaxSpans> span_lo_{};
  std::array<std::atomic<DevPtr>, kMaxSpans> span_hi_{};
  std::atomic<std::size_t> nspans_{0};
  BlockIndex index_;
  UnbackedIndex unbacked_;
  Block* free_nodes_ = nullptr;  // linked through Block::next
  std::size_t free_node_count_ = 0;
};

}  // namespace gpustitch::detail
