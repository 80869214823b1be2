// ExpandableSegmentsModel: PyTorch's caching allocator with expandable segments, as accounting.
// See the header for the rules modelled and the registration below for the replay policy. Every
// block is in exactly one place between calls: the live map (allocated), its pool's free set
// (mapped) or its pool's unmapped set; a block's address or size (the sets' keys) is changed
// only while it is out of its set.
#include "expandable_policy.h"

#include <algorithm>

namespace gpustitch::replay {

ExpandableSegmentsModel::ExpandableSegmentsModel(std::size_t capacity) : capacity_(capacity) {}

ExpandableSegmentsModel::~ExpandableSegmentsModel() {
  std::vector<Block*> all;
  for (BlockPool* p : {&small_, &large_}) {
    all.insert(all.end(), p->free.begin(), p->free.end());
    all.insert(all.end(), p->unmapped.begin(), p->unmapped.end());
  }
  for (auto& [addr, b] : live_) all.push_back(b);
  for (Block* b : all) delete b;
}

std::size_t ExpandableSegmentsModel::round_size(std::size_t size) noexcept {
  if (size < kMinBlockSize) return kMinBlockSize;
  return align_up(size, kMinBlockSize);
}

void ExpandableSegmentsModel::try_merge(BlockPool& pool, Block* dst, Block* src) {
  // PyTorch's try_merge_blocks: only blocks in the same state merge, so a free block never
  // swallows address space without pages (or the reverse).
  if (src == nullptr || src->allocated || src->mapped != dst->mapped) return;
  if (src->mapped) {
    pool.free.erase(src);
  } else {
    pool.unmapped.erase(src);
  }
  if (dst->prev == src) {
    dst->addr = src->addr;
    dst->prev = src->prev;
    if (dst->prev) dst->prev->next = dst;
  } else {
    dst->next = src->next;
    if (dst->next) dst->next->prev = dst;
  }
  dst->size += src->size;
  delete src;
}

ExpandableSegmentsModel::Block* ExpandableSegmentsModel::get_free_block(BlockPool& pool,
                                                                        std::size_t size,
                                                                        Stream stream) {
  Block key{0, size, stream, false, true};
  auto it = pool.free.lower_bound(&key);
  if (it == pool.free.end() || (*it)->stream != stream) return nullptr;
  // A free block followed by unmapped space could grow to the end of the range; PyTorch ranks
  // it by that size, so best fit walks on to the next larger block while that one could grow
  // to less. Taking the growable tail only when nothing else fits keeps the tail whole.
  auto expandable_size = [](const Block* b) {
    return b->size + (b->next && !b->next->mapped ? b->next->size : 0);
  };
  for (auto next = std::next(it); next != pool.free.end() && (*next)->stream == stream &&
                                  expandable_size(*next) < expandable_size(*it);
       ++next)
    it = next;
  Block* b = *it;
  pool.free.erase(it);
  return b;
}

ExpandableSegmentsModel::Block* ExpandableSegmentsModel::find_expandable_block(BlockPool& pool,
                                                                               std::size_t size,
                                                                               Stream stream) {
  // The lowest unmapped place of the stream's ranges where free and unmapped space together
  // hold the request, starting at the free block just before it if there is one. Lowest first
  // so that the range fills from its start and gaps left by unmapping are filled again.
  auto has_room = [size](const Block* b) {
    std::size_t bytes = 0;
    for (; bytes < size && b != nullptr && !b->allocated; b = b->next) bytes += b->size;
    return bytes >= size;
  };
  Block key{0, 0, stream, false, false};
  for (auto it = pool.unmapped.lower_bound(&key);
       it != pool.unmapped.end() && (*it)->stream == stream; ++it) {
    Block* c = *it;
    if (c->prev != nullptr && !c->prev->allocated) c = c->prev;
    if (has_room(c)) return c;
  }
  // No room in this stream's ranges (usually: no range yet): reserve a new one, 1 1/8 of the
  // device, so that pages unmapped early in the range can be mapped again at its end.
  std::size_t pages =
      std::max<std::size_t>(1, align_up(capacity_ + capacity_ / 8, pool.page) / pool.page);
  next_addr_ = align_up(next_addr_, kLargePage);  // page-aligned in both pools
  auto* b = new Block{next_addr_, pages * pool.page, stream, &pool == &small_, false};
  next_addr_ += b->size + kLargePage;  // keep ranges apart
  ++segments_;
  pool.unmapped.insert(b);
  return b;
}

bool ExpandableSegmentsModel::map_block(BlockPool& pool, Block* b, std::size_t size) {
  // Whole pages from the start of the unmapped block: each page is one physical handle.
  std::size_t bytes = align_up(size, pool.page);
  if (reserved_ + bytes > capacity_) return false;
  reserved_ += bytes;
  peak_reserved_ = std::max(peak_reserved_, reserved_);
  ++maps_;
  for (std::size_t p = 0; p < bytes / pool.page; ++p) {
    cost_.create(pool.page);
    cost_.map();
    cost_.set_access_handle(pool.page);
  }
  pool.unmapped.erase(b);
  b->mapped = true;
  if (bytes < b->size) {
    auto* rest = new Block{b->addr + bytes, b->size - bytes, b->stream, b->small, false};
    rest->prev = b;
    rest->next = b->next;
    if (b->next) b->next->prev = rest;
    b->next = rest;
    b->size = bytes;
    pool.unmapped.insert(rest);
  }
  try_merge(pool, b, b->prev);
  try_merge(pool, b, b->next);
  pool.free.insert(b);
  return true;
}

ExpandableSegmentsModel::Block* ExpandableSegmentsModel::try_allocate_expandable_block(
    BlockPool& pool, std::size_t size, Stream stream) {
  // The candidate is unmapped, or free and followed by unmapped space. Map what is missing,
  // one unmapped block at a time; each mapping merges with the free block before it. A mapping
  // that fails leaves the pages mapped so far in place (as PyTorch does).
  Block* c = find_expandable_block(pool, size, stream);
  if (!c->mapped && !map_block(pool, c, std::min(c->size, size))) return nullptr;
  while (c->size < size) {
    Block* n = c->next;
    if (n == nullptr || n->mapped || n->allocated) return nullptr;  // not reached: has_room
    if (!map_block(pool, n, std::min(size - c->size, n->size))) return nullptr;
    c = n;  // the old c was merged into n
  }
  pool.free.erase(c);
  return c;
}

void ExpandableSegmentsModel::unmap_block(BlockPool& pool, Block* b) {
  // Only the whole pages inside the free block go: a page is one handle and cannot be split.
  std::uint64_t begin = align_up(b->addr, pool.page);
  std::uint64_t end = (b->addr + b->size) / pool.page * pool.page;
  if (begin >= end) return;
  pool.free.erase(b);
  reserved_ -= end - begin;
  ++unmaps_;
  for (std::uint64_t p = 0; p < (end - begin) / pool.page; ++p) {
    cost_.unmap();
    cost_.release(pool.page);
  }
  if (begin > b->addr) {
    auto* before = new Block{b->addr, begin - b->addr, b->stream, b->small, true};
    before->prev = b->prev;
    before->next = b;
    if (b->prev) b->prev->next = before;
    b->prev = before;
    pool.free.insert(before);
  }
  if (end < b->addr + b->size) {
    auto* after = new Block{end, b->addr + b->size - end, b->stream, b->small, true};
    after->prev = b;
    after->next = b->next;
    if (b->next) b->next->prev = after;
    b->next = after;
    pool.free.insert(after);
  }
  b->addr = begin;
  b->size = end - begin;
  b->mapped = false;
  try_merge(pool, b, b->prev);
  try_merge(pool, b, b->next);
  pool.unmapped.insert(b);
}

void ExpandableSegmentsModel::release_cached_blocks() {
  // PyTorch's release_blocks, large pool first: unmap the free pages of every free block, and
  // give back a range that has become wholly unmapped (a later range is then the stream's
  // lowest).
  for (BlockPool* pool : {&large_, &small_}) {
    std::vector<Block*> to_unmap(pool->free.begin(), pool->free.end());
    for (Block* b : to_unmap) {
      unmap_block(*pool, b);
      if (!b->mapped && b->prev == nullptr && b->next == nullptr) {
        pool->unmapped.erase(b);
        --segments_;
        delete b;
      }
    }
  }
}

std::uint64_t ExpandableSegmentsModel::allocate(std::size_t request, Stream stream) {
  std::size_t size = round_size(request);
  BlockPool& pool = pool_for(size);
  Block* b = get_free_block(pool, size, stream);
  if (b == nullptr) b = try_allocate_expandable_block(pool, size, stream);
  if (b == nullptr) {
    release_cached_blocks();
    b = try_allocate_expandable_block(pool, size, stream);
  }
  if (b == nullptr) return 0;
  // should_split with expandable segments: any remainder of 512 B or more stays free, in both
  // pools, so blocks are not rounded to pages. The block keeps the front, the rest the tail.
  if (b->size - size >= kMinBlockSize) {
    auto* rest = new Block{b->addr + size, b->size - size, stream, b->small, true};
    rest->prev = b;
    rest->next = b->next;
    if (b->next) b->next->prev = rest;
    b->next = rest;
    b->size = size;
    pool.free.insert(rest);
  }
  b->allocated = true;
  allocated_ += b->size;
  live_[b->addr] = b;
  return b->addr;
}

void ExpandableSegmentsModel::free(std::uint64_t addr) {
  auto it = live_.find(addr);
  if (it == live_.end()) return;
  Block* b = it->second;
  live_.erase(it);
  allocated_ -= b->size;
  b->allocated = false;
  BlockPool& pool = pool_of(b);
  try_merge(pool, b, b->prev);
  try_merge(pool, b, b->next);
  pool.free.insert(b);
}

ExpandablePolicy::ExpandablePolicy(const PolicyEnv& env) {
  for (int d = 0; d < env.devices; ++d)
    devices_.push_back(std::make_unique<ExpandableSegmentsModel>(env.capacity));
}

bool ExpandablePolicy::allocate(int device, std::size_t size, Stream stream,
                                std::uint64_t* handle) {
  if (device < 0 || device >= static_cast<int>(devices_.size())) return false;
  std::uint64_t addr = devices_[static_cast<std::size_t>(device)]->allocate(size, stream);
  *handle = addr;
  return addr != 0;
}

void ExpandablePolicy::deallocate(int device, std::uint64_t handle, std::size_t, Stream) {
  if (device < 0 || device >= static_cast<int>(devices_.size())) return;
  devices_[static_cast<std::size_t>(device)]->free(handle);
}

std::uint64_t ExpandablePolicy::reserved(int device) const {
  return devices_[static_cast<std::size_t>(device)]->reserved();
}

std::uint64_t ExpandableSegmentsModel::largest_free_block() const noexcept {
  // Ordered by stream, then size: one lookup per stream (runs at every new peak of a replay).
  std::uint64_t best = 0;
  for (const BlockPool* pool : {&large_, &small_}) {
    auto it = pool->free.end();
    while (it != pool->free.begin()) {
      --it;
      best = std::max<std::uint64_t>(best, (*it)->size);
      Block first{0, 0, (*it)->stream, false, true};
      it = pool->free.lower_bound(&first);
    }
  }
  return best;
}

std::uint64_t ExpandablePolicy::largest_free_block(int device) const {
  return devices_[static_cast<std::size_t>(device)]->largest_free_block();
}

std::uint64_t ExpandablePolicy::peak_reserved(int device) const {
  return devices_[static_cast<std::size_t>(device)]->peak_reserved();
}

std::vector<std::pair<std::string, std::uint64_t>> ExpandablePolicy::counters(int devices) const {
  std::uint64_t maps = 0, unmaps = 0;
  DriverCost cost;
  for (int d = 0; d < devices && d < static_cast<int>(devices_.size()); ++d) {
    const ExpandableSegmentsModel& m = *devices_[static_cast<std::size_t>(d)];
    maps += m.maps();
    unmaps += m.unmaps();
    cost += m.driver_cost();
  }
  std::vector<std::pair<std::string, std::uint64_t>> out = {{"maps", maps}, {"unmaps", unmaps}};
  for (auto& c : cost.counters()) out.push_back(std::move(c));
  return out;
}

namespace {
PolicyRegistrar reg_expandable{
    "expandable-segments",
    "model of PyTorch's CUDA caching allocator with expandable_segments:True", true,
    [](const PolicyEnv& env, std::string*) -> std::unique_ptr<ReplayPolicy> {
      return std::make_unique<ExpandablePolicy>(env);
    }};
}  // namespace

}  // namespace gpustitch::replay
