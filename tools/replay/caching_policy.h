// A model of PyTorch's CUDACachingAllocator (c10/cuda/CUDACachingAllocator.cpp), pure
// accounting: no memory is touched, addresses are synthetic. It reproduces the decisions that
// make reserved memory grow past what is allocated:
//   - requests are rounded to 512 B; <= 1 MiB go to the small pool, the rest to the large pool;
//   - a new segment ("cudaMalloc") is 2 MiB for small requests, 20 MiB for large requests under
//     10 MiB, and the request rounded up to 2 MiB above that;
//   - a cached block is found best-fit (smallest free block >= request, same stream) and split
//     when the remainder is >= 512 B (small) or > 1 MiB (large, and only below max_split_size);
//   - with max_split_size, blocks >= max_split_size serve only requests >= max_split_size and
//     not when they exceed the request by 20 MiB or more;
//   - freed blocks merge with free neighbours of the same segment; a segment goes back to the
//     device only when it is entirely free, and only when an allocation would otherwise fail:
//     first oversize segments (with max_split_size), then every free segment, then retry, then
//     out-of-memory.
// The device has `capacity` bytes; a segment allocation fails when reserved + size > capacity.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <unordered_map>
#include <vector>

#include "policy.h"

namespace gpustitch::replay {

class CachingAllocatorModel {
 public:
  CachingAllocatorModel(std::size_t capacity, std::size_t max_split_size = SIZE_MAX);
  ~CachingAllocatorModel();

  // Returns the block address, or 0 for out-of-memory.
  std::uint64_t allocate(std::size_t size, Stream stream);
  void free(std::uint64_t addr);

  std::uint64_t reserved() const noexcept { return reserved_; }
  std::uint64_t peak_reserved() const noexcept { return peak_reserved_; }
  std::uint64_t allocated() const noexcept { return allocated_; }  // rounded sizes of live blocks
  std::uint64_t segments() const noexcept { return segments_; }

  static std::size_t round_size(std::size_t size) noexcept;
  static std::size_t segment_size(std::size_t rounded) noexcept;

  static constexpr std::size_t kMinBlockSize = 512;
  static constexpr std::size_t kSmallSize = 1 * MiB;
  static constexpr std::size_t kSmallBuffer = 2 * MiB;
  static constexpr std::size_t kLargeBuffer = 20 * MiB;
  static constexpr std::size_t kMinLargeAlloc = 10 * MiB;
  static constexpr std::size_t kRoundLarge = 2 * MiB;

 private:
  struct Block {
    std::uint64_t addr;
    std::size_t size;
    Stream stream;
    bool small;
    bool allocated = false;
    Block* prev = nullptr;
    Block* next = nullptr;
  };
  struct Order {
    bool operator()(const Block* a, const Block* b) const noexcept {
      if (a->stream != b->stream) return a->stream < b->stream;
      if (a->size != b->size) return a->size < b->size;
      return a->addr < b->addr;
    }
  };
  using FreeSet = std::set<Block*, Order>;

  Block* find_free(FreeSet& pool, std::size_t size, Stream stream);
  Block* new_segment(std::size_t size, Stream stream, bool small);
  void release_segment(FreeSet& pool, Block* b);
  void release_oversize(std::size_t needed);
  void release_all_cached();
  bool should_split(const Block* b, std::size_t size) const noexcept;

  std::size_t capacity_;
  std::size_t max_split_;
  FreeSet small_free_, large_free_;
  std::unordered_map<std::uint64_t, Block*> live_;
  std::uint64_t next_addr_ = 1ull << 40;
  std::uint64_t reserved_ = 0, peak_reserved_ = 0, allocated_ = 0, segments_ = 0;
};

class CachingPolicy final : public ReplayPolicy {
 public:
  CachingPolicy(std::string name, const PolicyEnv& env, std::size_t max_split_size);
  std::string name() const override { return name_; }
  bool allocate(int device, std::size_t size, Stream stream, std::uint64_t* handle) override;
  void deallocate(int device, std::uint64_t handle, std::size_t size, Stream stream) override;
  std::uint64_t reserved(int device) const override;
  std::uint64_t peak_reserved(int device) const override;

 private:
  std::string name_;
  std::vector<std::unique_ptr<CachingAllocatorModel>> devices_;
};

}  // namespace gpustitch::replay
