// CachingAllocatorModel: PyTorch's caching allocator decisions, as accounting. See the header for
// the rules modelled and caching_policy registrations below for the replay policies built on it.
#include "caching_policy.h"

#include <algorithm>

namespace gpustitch::replay {

CachingAllocatorModel::CachingAllocatorModel(std::size_t capacity, std::size_t max_split_size)
    : capacity_(capacity), max_split_(max_split_size) {}

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
  Block key{0, size, stream, false};
  auto it = pool.lower_bound(&key);
  if (it == pool.end() || (*it)->stream != stream) return nullptr;
  Block* b = *it;
  // Oversize blocks serve only oversize requests, and not much larger ones.
  if (size < max_split_ && b->size >= max_split_) return nullptr;
  if (size >= max_split_ && b->size >= size + kLargeBuffer) return nullptr;
  pool.erase(it);
  return b;
}

CachingAllocatorModel::Block* CachingAllocatorModel::new_segment(std::size_t size, Stream stream,
                                                                 bool small) {
  if (reserved_ + size > capacity_) return nullptr;
  auto* b = new Block{next_addr_, size, stream, small};
  next_addr_ += align_up(size, kRoundLarge) + kRoundLarge;  // keep segments apart
  reserved_ += size;
  peak_reserved_ = std::max(peak_reserved_, reserved_);
  ++segments_;
  return b;
}

void CachingAllocatorModel::release_segment(FreeSet& pool, Block* b) {
  pool.erase(b);
  reserved_ -= b->size;
  --segments_;
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

std::uint64_t CachingAllocatorModel::allocate(std::size_t request, Stream stream) {
  std::size_t size = round_size(request);
  bool small = size <= kSmallSize;
  FreeSet& pool = small ? small_free_ : large_free_;
  Block* b = find_free(pool, size, stream);
  if (b == nullptr) {
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
    : name_(std::move(name)) {
  for (int d = 0; d < env.devices; ++d)
    devices_.push_back(std::make_unique<CachingAllocatorModel>(env.capacity, max_split_size));
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
