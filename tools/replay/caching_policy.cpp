// CachingAllocatorModel: PyTorch's caching allocator decisions, as accounting. See the header for
// the rules modelled and caching_policy registrations below for the replay policies built on it.
#include "caching_policy.h"

#include <algorithm>

namespace gpustitch::replay {

CachingAllocatorModel::CachingAllocatorModel(std::size_t capacity, std::size_t max_split_size)
    : CachingAllocatorModel(capacity, CachingOptions{max_split_size, 0, 0}) {}

CachingAllocatorModel::CachingAllocatorModel(std::size_t capacity, const CachingOptions& options)
    : capacity_(capacity),
      max_split_(options.max_split_size),
      divisions_(options.roundup_power2_divisions),
      gc_threshold_(options.garbage_collection_threshold) {}

CachingAllocatorModel::~CachingAllocatorModel() {
  std::vector<Block*> all;
  for (auto* b : small_free_) all.push_back(b);
  for (auto* b : large_free_) all.push_back(b);
  for (auto& [addr, b] : live_) all.push_back(b);
  for (auto* b : all) delete b;
}

std::size_t CachingAllocatorModel::round_size(std::size_t size) noexcept {
  if (size < kMinBlockSize) return kMinBlockSize;
  return align_up(size, kMinBlockSize);
}

std::size_t CachingAllocatorModel::round_size(std::size_t size, std::size_t divisions) noexcept {
  if (size < kMinBlockSize) return kMinBlockSize;
  if (divisions <= 1 || size <= kMinBlockSize * divisions) return align_up(size, kMinBlockSize);
  // roundup_power2_next_division: divisions equal steps between power2_floor and twice it.
  if ((size & (size - 1)) == 0) return size;
  std::size_t floor = std::size_t{1} << (63 - __builtin_clzll(size));
  std::size_t step = floor >> (63 - __builtin_clzll(divisions));
  if (step == 0) return floor << 1;
  std::size_t rounded_floor = size & ~(step - 1);
  return rounded_floor == size ? size : rounded_floor + step;
}

std::uint64_t CachingAllocatorModel::largest_free_block() const noexcept {
  // The pools are ordered by stream, then size: the largest of a stream is its last block, so
  // only one lookup per stream (this runs at every new peak of a replay).
  std::uint64_t best = 0;
  for (const FreeSet* pool : {&large_free_, &small_free_}) {
    auto it = pool->end();
    while (it != pool->begin()) {
      --it;
      best = std::max<std::uint64_t>(best, (*it)->size);
      Block first{0, 0, (*it)->stream, false};
      it = pool->lower_bound(&first);
    }
    if (best > 0) break;  // a small block is never larger than a large one
  }
  return best;
}

std::size_t CachingAllocatorModel::segment_size(std::size_t rounded) noexcept {
  if (rounded <= kSmallSize) return kSmallBuffer;
  if (rounded < kMinLargeAlloc) return kLargeBuffer;
  return align_up(rounded, kRoundLarge);
}

bool CachingAllocatorModel::should_split(const Block* b, std::size_t size) const noexcept {
  std::size_t remaining = b->size - size;
  if (b->small) return remaining >= kMinBlockSize;
  return size < max_split_ && remaining > kSmallSize;
}

CachingAllocatorModel::Block* CachingAllocatorModel::find_free(FreeSet& pool, std::size_t size,
                                                               Stream stream) {
  if (&pool == &large_free_) ++large_lookups_;
  Block key{0, size, stream, false};
  auto it = pool.lower_bound(&key);
  if (it == pool.end() || (*it)->stream != stream) return nullptr;
  Block* b = *it;
  // Oversize blocks serve only oversize requests, and not much larger ones.
  if (size < max_split_ && b->size >= max_split_) return nullptr;
  if (size >= max_split_ && b->size >= size + kLargeBuffer) return nullptr;
  pool.erase(it);
  b->gc_base = large_lookups_;  // denote the block has been used
  return b;
}

CachingAllocatorModel::Block* CachingAllocatorModel::new_segment(std::size_t size, Stream stream,
                                                                 bool small) {
  if (size > capacity_ - reserved_) return nullptr;  // reserved_ <= capacity_: no wrap-around
  auto* b = new Block{next_addr_, size, stream, small};
  b->gc_base = large_lookups_;
  next_addr_ += align_up(size, kRoundLarge) + kRoundLarge;  // keep segments apart
  reserved_ += size;
  peak_reserved_ = std::max(peak_reserved_, reserved_);
  ++segments_;
  cost_.cuda_malloc(size);
  return b;
}

void CachingAllocatorModel::release_segment(FreeSet& pool, Block* b) {
  pool.erase(b);
  reserved_ -= b->size;
  --segments_;
  cost_.cuda_free(b->size);
  delete b;
}

void CachingAllocatorModel::release_oversize(std::size_t needed) {
  // PyTorch's release_available_cached_blocks: free whole oversize segments, largest first,
  // until the request could fit.
  std::vector<Block*> candidates;
  for (Block* b : large_free_)
    if (b->prev == nullptr && b->next == nullptr && b->size >= max_split_) candidates.push_back(b);
  std::sort(candidates.begin(), candidates.end(),
            [](const Block* a, const Block* b) { return a->size > b->size; });
  std::size_t freed = 0;
  for (Block* b : candidates) {
    if (freed >= needed) break;
    freed += b->size;
    release_segment(large_free_, b);
  }
}

void CachingAllocatorModel::release_all_cached() {
  for (FreeSet* pool : {&small_free_, &large_free_}) {
    std::vector<Block*> whole;
    for (Block* b : *pool)
      if (b->prev == nullptr && b->next == nullptr) whole.push_back(b);
    for (Block* b : whole) release_segment(*pool, b);
  }
}

void CachingAllocatorModel::garbage_collect() {
  // PyTorch's garbage_collect_cached_blocks: rounds over the whole free large segments, each
  // releasing those that waited at least the current average, until reserved is under the
  // threshold or a round releases nothing.
  const auto threshold = static_cast<std::uint64_t>(gc_threshold_ * static_cast<double>(capacity_));
  if (reserved_ <= threshold) return;
  const std::uint64_t target = reserved_ - threshold;
  double total_age = 0;
  std::size_t freeable = 0;
  for (const Block* b : large_free_)
    if (b->prev == nullptr && b->next == nullptr) {
      total_age += static_cast<double>(large_lookups_ - b->gc_base);
      ++freeable;
    }
  std::uint64_t reclaimed = 0;
  bool freed = true;
  while (reclaimed < target && freed && freeable > 0) {
    const double age_threshold = total_age / static_cast<double>(freeable);
    freed = false;
    for (auto it = large_free_.begin(); it != large_free_.end() && reclaimed < target;) {
      Block* b = *it++;
      const auto age = static_cast<double>(large_lookups_ - b->gc_base);
      if (b->prev != nullptr || b->next != nullptr || age < age_threshold) continue;
      freed = true;
      reclaimed += b->size;
      total_age -= age;
      --freeable;
      ++gc_releases_;
      release_segment(large_free_, b);
    }
  }
}

std::uint64_t CachingAllocatorModel::allocate(std::size_t request, Stream stream) {
  // A request larger than the device is out of memory, as PyTorch reports it; rounding it (up to
  // 2^64 - 1 bytes from a hostile trace) would wrap around to a small size and "serve" it.
  if (request > capacity_) return 0;
  std::size_t size = round_size(request, divisions_);
  bool small = size <= kSmallSize;
  FreeSet& pool = small ? small_free_ : large_free_;
  Block* b = find_free(pool, size, stream);
  if (b == nullptr) {
    if (gc_threshold_ > 0) garbage_collect();
    std::size_t seg = segment_size(size);
    b = new_segment(seg, stream, small);
    if (b == nullptr && max_split_ != SIZE_MAX) {
      release_oversize(seg);
      b = new_segment(seg, stream, small);
    }
    if (b == nullptr) {
      release_all_cached();
      b = new_segment(seg, stream, small);
    }
    if (b == nullptr) return 0;
  }
  if (should_split(b, size)) {
    auto* rest = new Block{b->addr + size, b->size - size, stream, b->small};
    rest->prev = b;
    rest->next = b->next;
    if (b->next) b->next->prev = rest;
    b->next = rest;
    b->size = size;
    pool.insert(rest);
  }
  b->allocated = true;
  allocated_ += b->size;
  live_[b->addr] = b;
  return b->addr;
}

void CachingAllocatorModel::free(std::uint64_t addr) {
  auto it = live_.find(addr);
  if (it == live_.end()) return;
  Block* b = it->second;
  live_.erase(it);
  allocated_ -= b->size;
  b->allocated = false;
  FreeSet& pool = b->small ? small_free_ : large_free_;
  if (Block* p = b->prev; p != nullptr && !p->allocated) {
    pool.erase(p);
    p->size += b->size;
    p->next = b->next;
    if (b->next) b->next->prev = p;
    delete b;
    b = p;
  }
  if (Block* n = b->next; n != nullptr && !n->allocated) {
    pool.erase(n);
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    delete n;
  }
  pool.insert(b);
}

CachingPolicy::CachingPolicy(std::string name, const PolicyEnv& env, std::size_t max_split_size)
    : CachingPolicy(std::move(name), env, CachingOptions{max_split_size, 0, 0}) {}

CachingPolicy::CachingPolicy(std::string name, const PolicyEnv& env, const CachingOptions& options)
    : name_(std::move(name)) {
  for (int d = 0; d < env.devices; ++d)
    devices_.push_back(std::make_unique<CachingAllocatorModel>(env.capacity, options));
}

std::uint64_t CachingPolicy::largest_free_block(int device) const {
  return devices_[static_cast<std::size_t>(device)]->largest_free_block();
}

bool CachingPolicy::allocate(int device, std::size_t size, Stream stream, std::uint64_t* handle) {
  if (device < 0 || device >= static_cast<int>(devices_.size())) return false;
  // cudaMalloc-style calls (kAnyStream) all share PyTorch's current stream.
  std::uint64_t addr = devices_[static_cast<std::size_t>(device)]->allocate(size, stream);
  *handle = addr;
  return addr != 0;
}

void CachingPolicy::deallocate(int device, std::uint64_t handle, std::size_t, Stream) {
  if (device < 0 || device >= static_cast<int>(devices_.size())) return;
  devices_[static_cast<std::size_t>(device)]->free(handle);
}

std::vector<std::pair<std::string, std::uint64_t>> CachingPolicy::counters(int devices) const {
  DriverCost cost;
  for (int d = 0; d < devices && d < static_cast<int>(devices_.size()); ++d)
    cost += devices_[static_cast<std::size_t>(d)]->cost();
  return cost.counters();
}

std::uint64_t CachingPolicy::reserved(int device) const {
  return devices_[static_cast<std::size_t>(device)]->reserved();
}

std::uint64_t CachingPolicy::peak_reserved(int device) const {
  return devices_[static_cast<std::size_t>(device)]->peak_reserved();
}

namespace {
PolicyRegistrar reg_pytorch{
    "pytorch", "model of PyTorch's CUDA caching allocator (default settings)", true,
    [](const PolicyEnv& env, std::string*) -> std::unique_ptr<ReplayPolicy> {
      return std::make_unique<CachingPolicy>("pytorch", env, SIZE_MAX);
    }};
PolicyRegistrar reg_pytorch_split{
    "pytorch-max-split", "the PyTorch model with max_split_size_mb (--max-split-mb, default 128)",
    false, [](const PolicyEnv& env, std::string*) -> std::unique_ptr<ReplayPolicy> {
      std::size_t split = env.max_split_size == SIZE_MAX ? 128 * MiB : env.max_split_size;
      return std::make_unique<CachingPolicy>(
          "pytorch-max-split-" + std::to_string(split / MiB) + "mb", env, split);
    }};
}  // namespace

}  // namespace gpustitch::replay
