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
//     out-of-memory;
//   - roundup_power2_divisions:N rounds a request above N x 512 B up to the next of N equal steps
//     between the powers of two around it (a power of two stays as is), so that slightly
//     different sizes share blocks (round_size, roundup_power2_next_division);
//   - garbage_collection_threshold:T, before a new segment is allocated and while reserved is
//     above T x the memory the process may use (here: the capacity; PyTorch applies the
//     threshold only when torch.cuda.set_per_process_memory_fraction set that limit), releases
//     whole free large segments that have waited for reuse at least as long as their average,
//     oldest wait first by rounds, until reserved is under the threshold
//     (garbage_collect_cached_blocks). A block's wait is counted in large-pool lookups since it
//     was last handed out (gc_count).
// The device has `capacity` bytes; a segment allocation fails when reserved + size > capacity.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <unordered_map>
#include <vector>

#include "driver_cost.h"
#include "policy.h"

namespace gpustitch::replay {

// PYTORCH_CUDA_ALLOC_CONF settings the model follows (the defaults are PyTorch's).
struct CachingOptions {
  std::size_t max_split_size = SIZE_MAX;     // max_split_size_mb
  std::size_t roundup_power2_divisions = 0;  // 0 or 1: off
  double garbage_collection_threshold = 0;   // 0: off
};

class CachingAllocatorModel {
 public:
  CachingAllocatorModel(std::size_t capacity, std::size_t max_split_size = SIZE_MAX);
  CachingAllocatorModel(std::size_t capacity, const CachingOptions& options);
  ~CachingAllocatorModel();

  // Returns the block address, or 0 for out-of-memory.
  std::uint64_t allocate(std::size_t size, Stream stream);
  void free(std::uint64_t addr);

  std::uint64_t reserved() const noexcept { return reserved_; }
  std::uint64_t peak_reserved() const noexcept { return peak_reserved_; }
  std::uint64_t allocated() const noexcept { return allocated_; }  // rounded sizes of live blocks
  std::uint64_t segments() const noexcept { return segments_; }
  // What its segments' cudaMalloc and cudaFree calls would cost on the GPU (driver_cost.h).
  const DriverCost& cost() const noexcept { return cost_; }
  // The largest cached block one request could be served from (any stream, either pool).
  std::uint64_t largest_free_block() const noexcept;
  std::uint64_t gc_releases() const noexcept { return gc_releases_; }

  // PyTorch's round_size without and with roundup_power2_divisions.
  static std::size_t round_size(std::size_t size) noexcept;
  static std::size_t round_size(std::size_t size, std::size_t divisions) noexcept;
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
    std::uint64_t gc_base = 0;  // large_lookups_ when last handed out or created
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
  void garbage_collect();
  bool should_split(const Block* b, std::size_t size) const noexcept;

  std::size_t capacity_;
  std::size_t max_split_;
  std::size_t divisions_;
  double gc_threshold_;
  std::uint64_t large_lookups_ = 0, gc_releases_ = 0;
  FreeSet small_free_, large_free_;
  std::unordered_map<std::uint64_t, Block*> live_;
  std::uint64_t next_addr_ = 1ull << 40;
  std::uint64_t reserved_ = 0, peak_reserved_ = 0, allocated_ = 0, segments_ = 0;
  DriverCost cost_;
};

class CachingPolicy final : public ReplayPolicy {
 public:
  CachingPolicy(std::string name, const PolicyEnv& env, std::size_t max_split_size);
  CachingPolicy(std::string name, const PolicyEnv& env, const CachingOptions& options);
  std::string name() const override { return name_; }
  bool allocate(int device, std::size_t size, Stream stream, std::uint64_t* handle) override;
  void deallocate(int device, std::uint64_t handle, std::size_t size, Stream stream) override;
  std::uint64_t reserved(int device) const override;
  std::uint64_t peak_reserved(int device) const override;
  std::uint64_t largest_free_block(int device) const override;
  // The driver counters of its segments' calls (driver_cost.h), summed over devices.
  std::vector<std::pair<std::string, std::uint64_t>> counters(int devices) const override;

 private:
  std::string name_;
  std::vector<std::unique_ptr<CachingAllocatorModel>> devices_;
};

}  // namespace gpustitch::replay
