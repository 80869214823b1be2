// A model of PyTorch's CUDACachingAllocator with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
// (c10/cuda/CUDACachingAllocator.cpp: ExpandableSegment and the allocator paths that use it),
// pure accounting like caching_policy.h: no memory is touched, addresses are synthetic. It
// reproduces the decisions that make reserved memory what it is:
//   - requests are rounded to 512 B; <= 1 MiB go to the small pool, the rest to the large pool;
//   - each (stream, pool) reserves one virtual address range of 1 1/8 x the device's capacity
//     (another only when that range has no room left), and maps physical pages into it: 2 MiB
//     pages in the small pool, 20 MiB in the large pool, each page one physical handle mapped
//     whole, so reserved is the mapped pages. Free space is never shared between streams;
//   - a request is served best fit from the free mapped blocks of its stream and pool, except
//     that a free block followed by unmapped space ranks by the size it could grow to, so the
//     next larger block is taken instead when it is smaller than that (get_free_block);
//   - on a miss, the lowest unmapped place of the stream's range where the unmapped space, with
//     the free block just before it and the free or unmapped blocks after it, holds the request
//     (find_expandable_block), and only the pages missing there are mapped;
//   - a block is cut whenever 512 B or more remain (should_split with expandable segments), so
//     allocated blocks are not rounded to pages; freed blocks merge with free neighbours anywhere
//     in the range, mapped with mapped and unmapped with unmapped;
//   - pages are unmapped only when an allocation would otherwise fail (release_cached_blocks):
//     every whole page inside a free block, in both pools and on every stream; then the mapping
//     is retried once, then out-of-memory.
// The device has `capacity` bytes; mapping fails when reserved + the pages to map > capacity.
// max_split_size_mb is not modelled (PyTorch's default, unlimited).
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <unordered_map>
#include <vector>

#include "driver_cost.h"
#include "policy.h"

namespace gpustitch::replay {

class ExpandableSegmentsModel {
 public:
  explicit ExpandableSegmentsModel(std::size_t capacity);
  ~ExpandableSegmentsModel();
  ExpandableSegmentsModel(const ExpandableSegmentsModel&) = delete;
  ExpandableSegmentsModel& operator=(const ExpandableSegmentsModel&) = delete;

  // Returns the block address, or 0 for out-of-memory.
  std::uint64_t allocate(std::size_t size, Stream stream);
  void free(std::uint64_t addr);

  std::uint64_t reserved() const noexcept { return reserved_; }
  std::uint64_t peak_reserved() const noexcept { return peak_reserved_; }
  std::uint64_t allocated() const noexcept { return allocated_; }  // rounded sizes of live blocks
  std::uint64_t maps() const noexcept { return maps_; }            // map calls (num_device_alloc)
  std::uint64_t unmaps() const noexcept { return unmaps_; }        // unmap calls (num_device_free)
  std::uint64_t segments() const noexcept { return segments_; }    // address ranges reserved
  // Its driver calls: a handle created, mapped and granted access per page mapped, unmapped and
  // released per page unmapped.
  const DriverCost& driver_cost() const noexcept { return cost_; }
  // The largest mapped free block (any stream, either pool).
  std::uint64_t largest_free_block() const noexcept;

  static std::size_t round_size(std::size_t size) noexcept;

  static constexpr std::size_t kMinBlockSize = 512;
  static constexpr std::size_t kSmallSize = 1 * MiB;
  static constexpr std::size_t kSmallPage = 2 * MiB;
  static constexpr std::size_t kLargePage = 20 * MiB;

 private:
  struct Block {
    std::uint64_t addr;
    std::size_t size;
    Stream stream;
    bool small;  // which pool
    bool mapped;
    bool allocated = false;
    Block* prev = nullptr;  // neighbours in the same address range
    Block* next = nullptr;
  };
  struct BySize {  // PyTorch's BlockComparatorSize
    bool operator()(const Block* a, const Block* b) const noexcept {
      if (a->stream != b->stream) return a->stream < b->stream;
      if (a->size != b->size) return a->size < b->size;
      return a->addr < b->addr;
    }
  };
  struct ByAddress {  // PyTorch's BlockComparatorAddress
    bool operator()(const Block* a, const Block* b) const noexcept {
      if (a->stream != b->stream) return a->stream < b->stream;
      return a->addr < b->addr;
    }
  };
  struct BlockPool {
    std::size_t page;
    std::set<Block*, BySize> free;         // mapped, not allocated
    std::set<Block*, ByAddress> unmapped;  // address space without pages
  };

  BlockPool& pool_for(std::size_t rounded) noexcept {
    return rounded <= kSmallSize ? small_ : large_;
  }
  BlockPool& pool_of(const Block* b) noexcept { return b->small ? small_ : large_; }
  Block* get_free_block(BlockPool& pool, std::size_t size, Stream stream);
  Block* find_expandable_block(BlockPool& pool, std::size_t size, Stream stream);
  Block* try_allocate_expandable_block(BlockPool& pool, std::size_t size, Stream stream);
  bool map_block(BlockPool& pool, Block* b, std::size_t size);
  void unmap_block(BlockPool& pool, Block* b);
  void release_cached_blocks();
  static void try_merge(BlockPool& pool, Block* dst, Block* src);

  std::size_t capacity_;
  BlockPool small_{kSmallPage, {}, {}}, large_{kLargePage, {}, {}};
  std::unordered_map<std::uint64_t, Block*> live_;
  std::uint64_t next_addr_ = 1ull << 44;
  std::uint64_t reserved_ = 0, peak_reserved_ = 0, allocated_ = 0;
  std::uint64_t maps_ = 0, unmaps_ = 0, segments_ = 0;
  DriverCost cost_;
};

class ExpandablePolicy final : public ReplayPolicy {
 public:
  explicit ExpandablePolicy(const PolicyEnv& env);
  std::string name() const override { return "expandable-segments"; }
  bool allocate(int device, std::size_t size, Stream stream, std::uint64_t* handle) override;
  void deallocate(int device, std::uint64_t handle, std::size_t size, Stream stream) override;
  std::uint64_t reserved(int device) const override;
  std::uint64_t peak_reserved(int device) const override;
  std::uint64_t largest_free_block(int device) const override;
  std::vector<std::pair<std::string, std::uint64_t>> counters(int devices) const override;

 private:
  std::vector<std::unique_ptr<ExpandableSegmentsModel>> devices_;
};

}  // namespace gpustitch::replay
