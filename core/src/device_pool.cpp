// The pool of one device.
//
// Where an allocation comes from, in order:
//   1. small requests (< small_limit) go to the small-object pool (small_pool.h), which takes
//      whole chunks from here;
//   2. a cached block: best fit among fenced free blocks (or among blocks the same stream freed,
//      which stream order makes safe at once), split if larger; max_split_size keeps oversize
//      blocks for large requests, as PYTORCH_CUDA_ALLOC_CONF's max_split_size_mb does;
//   3. fresh physical memory: ONE handle of the whole rounded size, in a "home" view of its own.
//      Mapping cost is per handle (about 27 us for cuMemSetAccess on an H200, whatever the size),
//      so a fresh block is never built from granule-sized pieces;
//   4. stitching, when the device (or the configured cap) cannot give fresh memory: the physical
//      memory behind free blocks, wherever they lie, is mapped side by side into a new address
//      range (a "stitched" view), topped up with a fresh handle if the free blocks are not
//      enough. The source blocks stay in their views, marked "lent", so their bytes are never
//      handed out twice; the stitched view is cached and reused like any other;
//   5. trim (release wholly free views back to the driver, dissolve idle stitched views) and try
//      3 and 4 again; only then out-of-memory.
// An allocation therefore fails only when the request exceeds device free + pool free memory.
//
// Handle size trade-off: a free piece of a partly used handle can be stitched only where the
// driver maps at a non-zero offset into a handle (Backend::supports_map_offset). Where it cannot,
// only whole free handles are lent, and the stitched view may come out larger than asked (the
// surplus stays free in the stitched view).
//
// Frees never wait for the device: memory is queued with a fence epoch (reclaimer.cpp).
//
// Thread safety: one mutex per device guards everything here; backend calls on the slow paths
// (create, map, stitch) run under it, as cudaMalloc does in PyTorch's allocator. Observer
// callbacks run after the mutex is released.
#include "device_pool.h"

#include <algorithm>
#include <ctime>

namespace gpustitch::detail {
namespace {

constexpr std::size_t kLargeBuffer = 20 * MiB;  // PyTorch's slack for oversize blocks

std::uint64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000ull +
         static_cast<std::uint64_t>(ts.tv_nsec);
}

}  // namespace

DevicePool::DevicePool(Backend& backend, const Config& config, int device, PoolObserver* observer)
    : backend_(backend),
      config_(config),
      device_(device),
      observer_(observer),
      small_(config.small_limit, std::max<std::size_t>(backend.granularity(device), 1)),
      reclaimer_([this] { return fence_pass(); }) {
  granularity_ = backend_.granularity(device_);
  map_offset_ = backend_.supports_map_offset(device_);
  std::size_t free = 0, total = 0;
  usable_ = granularity_ != 0 && backend_.mem_info(device_, &free, &total) == Status::ok;
  total_ = total;
  last_device_free_ = free;
  access_.push_back(device_);
  stats_.device_total = total;
  stats_.device_free = free;
}

DevicePool::~DevicePool() {
  // Everything is given back, live blocks included: the pool dies with its process (or test).
  std::lock_guard lock(mu_);
  for (auto& [base, v] : views_) {
    for (const Piece& p : v->pieces) backend_.unmap(v->base + p.offset, p.size);
    backend_.unreserve(v->base, v->size);
  }
  for (auto& [base, v] : views_) {
    for (Handle* h : v->owned) {
      backend_.release(h->id);
      delete h;
    }
    for (Block* b = v->first; b != nullptr;) {
      Block* next = b->next;
      delete b;
      b = next;
    }
    delete v;
  }
  views_.clear();
}

std::size_t DevicePool::cap_bytes() const noexcept {
  std::size_t cap = SIZE_MAX;
  if (config_.cap != 0) cap = config_.cap;
  if (config_.cap_fraction > 0.0 && total_ != 0) {
    cap =
        std::min(cap, static_cast<std::size_t>(config_.cap_fraction * static_cast<double>(total_)));
  }
  return cap;
}

bool DevicePool::cap_allows(std::size_t bytes) const noexcept {
  std::size_t cap = cap_bytes();
  return stats_.bytes_reserved <= cap && bytes <= cap - stats_.bytes_reserved;
}

// ---------------------------------------------------------------------------------------------
// Allocation

Status DevicePool::allocate(std::size_t size, Stream stream, DevPtr* out,
                            Outcome* outcome) noexcept {
  Status status = Status::ok;
  {
    std::lock_guard lock(mu_);
    if (!usable_) return Status::not_initialized;
    current_outcome_ = outcome;
    const int bucket = histogram_bucket(size);
    if (size < config_.small_limit) {
      SmallAlloc a = small_.allocate(size, stream, *this);
      if (a.ptr == 0) {
        // take_chunk already fenced, stitched and trimmed: the device is really full.
        status = Status::out_of_memory;
      } else {
        live_.emplace(a.ptr, LiveEntry{nullptr, a.chunk, a.slot});
        stats_.bytes_allocated += a.chunk->slot_size;
        outcome->how = ServedBy::small;
        outcome->size = a.chunk->slot_size;
        if (!a.from_new_chunk) ++stats_.cache_hits;
        *out = a.ptr;
      }
    } else {
      const std::size_t rounded = align_up(size, granularity_);
      Block* b = nullptr;
      status = rounded < size ? Status::out_of_memory
                              : allocate_large(size, rounded, stream, &b, outcome);
      if (status == Status::ok) {
        b->requested = size;
        b->stream = stream;
        live_.emplace(b->ptr, LiveEntry{b, nullptr, 0});
        stats_.bytes_allocated += b->size;
        outcome->size = b->size;
        *out = b->ptr;
      }
    }
    if (status == Status::ok) {
      ++stats_.allocs;
      ++stats_.live_blocks;
      stats_.bytes_requested += size;
      ++stats_.hist_allocs[bucket];
      ++stats_.hist_live[bucket];
      stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.bytes_allocated);
    } else if (status == Status::out_of_memory) {
      ++stats_.ooms;
      backend_.mem_info(device_, &last_device_free_, nullptr);
      outcome->add(make_event(EventKind::oom, size, 0));
    }
    current_outcome_ = nullptr;
  }
  emit(*outcome);
  return status;
}

Status DevicePool::allocate_large(std::size_t size, std::size_t rounded, Stream stream, Block** out,
                                  Outcome* outcome) noexcept {
  (void)size;
  if (Block* b = take_cached(rounded, stream)) {
    ++stats_.cache_hits;
    outcome->how = ServedBy::cache;
    *out = b;
    return Status::ok;
  }
  if (!config_.background_reclaim && has_pending()) {
    fence_locked();
    if (Block* b = take_cached(rounded, stream)) {
      ++stats_.cache_hits;
      outcome->how = ServedBy::cache;
      *out = b;
      return Status::ok;
    }
  }
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (create_fresh(rounded, out) == Status::ok) {
      ++stats_.fresh;
      outcome->how = ServedBy::fresh;
      return Status::ok;
    }
    // No fresh memory: memory still waiting for its fence is the cheapest to get back.
    if (has_pending()) {
      fence_locked();
      if (Block* b = take_cached(rounded, stream)) {
        ++stats_.cache_hits;
        outcome->how = ServedBy::cache;
        *out = b;
        return Status::ok;
      }
    }
    if (config_.stitching) {
      std::size_t pieces = 0;
      if (stitch(rounded, out, &pieces) == Status::ok) {
        ++stats_.stitches;
        stats_.stitched_bytes += rounded;
        outcome->how = ServedBy::stitched;
        outcome->add(make_event(EventKind::stitch, rounded, pieces));
        return Status::ok;
      }
    }
    // Give idle memory back to the driver (whole free views, idle stitched views) and retry:
    // PyTorch's free-cache-and-retry, which also heals fragmentation when stitching is off.
    small_.drop_stream_caches();
    if (attempt == 0 && trim_locked(0, outcome) == 0) break;
    if (Block* b = take_cached(rounded, stream)) {
      ++stats_.cache_hits;
      outcome->how = ServedBy::cache;
      *out = b;
      return Status::ok;
    }
  }
  return Status::out_of_memory;
}

Block* DevicePool::take_cached(std::size_t rounded, Stream stream) noexcept {
  if (stream != kAnyStream && !stream_free_.empty()) {
    auto it = stream_free_.find(stream);
    if (it != stream_free_.end()) {
      Block* b = take_from(it->second, rounded, true);
      if (it->second.empty()) stream_free_.erase(it);
      if (b != nullptr) return b;
    }
  }
  return take_from(free_, rounded, false);
}

Block* DevicePool::take_from(FreeSet& set, std::size_t rounded, bool pending) noexcept {
  Block probe;
  probe.size = rounded;
  probe.ptr = 0;
  auto it = set.lower_bound(&probe);
  if (it == set.end()) return nullptr;
  Block* b = *it;
  const std::size_t max_split = config_.max_split_size;
  if (rounded < max_split && b->size >= max_split) return nullptr;
  if (rounded >= max_split && b->size >= rounded + kLargeBuffer) return nullptr;
  set.erase(it);
  if (b->size > rounded && b->size < max_split) {
    Block* rest = split(b, rounded);
    if (pending) {
      // The remainder stays queued for its fence, right where b was, and reusable by the stream.
      fq_insert_after(b, rest);
      set.insert(rest);
      stats_.bytes_pending -= b->size;
    } else {
      free_.insert(rest);
    }
  } else if (pending) {
    stats_.bytes_pending -= b->size;
  }
  if (pending) fq_remove(b);
  b->state = BlockState::allocated;
  return b;
}

Status DevicePool::map_access(DevPtr ptr, std::size_t size) noexcept {
  return backend_.set_access(ptr, size, std::span<const int>(access_.data(), access_.size()));
}

Status DevicePool::create_fresh(std::size_t rounded, Block** out) noexcept {
  if (!cap_allows(rounded)) return Status::out_of_memory;
  PhysHandle h = 0;
  if (Status s = backend_.create(device_, rounded, &h); s != Status::ok) return s;
  DevPtr va = 0;
  if (backend_.reserve(device_, rounded, &va) != Status::ok) {
    backend_.release(h);
    return Status::out_of_memory;
  }
  if (backend_.map(va, rounded, h, 0) != Status::ok) {
    backend_.unreserve(va, rounded);
    backend_.release(h);
    return Status::out_of_memory;
  }
  if (map_access(va, rounded) != Status::ok) {
    backend_.unmap(va, rounded);
    backend_.unreserve(va, rounded);
    backend_.release(h);
    return Status::out_of_memory;
  }
  auto* handle = new Handle{h, rounded, 1};
  auto* view = new View;
  view->base = va;
  view->size = rounded;
  view->pieces.push_back(Piece{0, rounded, handle, 0});
  view->owned.push_back(handle);
  auto* b = new Block;
  b->ptr = va;
  b->size = rounded;
  b->view = view;
  b->state = BlockState::allocated;
  view->first = b;
  views_.emplace(va, view);
  stats_.bytes_reserved += rounded;
  stats_.bytes_mapped += rounded;
  ++stats_.handles;
  ++stats_.views;
  stats_.peak_reserved = std::max(stats_.peak_reserved, stats_.bytes_reserved);
  *out = b;
  return Status::ok;
}

// ---------------------------------------------------------------------------------------------
// Stitching

void DevicePool::lendable(Block* b, std::vector<Segment>* out) const noexcept {
  if (map_offset_) {
    out->push_back({b->ptr, b->size});
    return;
  }
  // Without offset mapping only whole handles, mapped whole, can be lent.
  const View* v = b->view;
  for (const Piece& p : v->pieces) {
    DevPtr start = v->base + p.offset;
    if (start < b->ptr || start + p.size > b->end()) continue;
    if (p.handle_offset != 0 || p.size != p.handle->size) continue;
    if (!out->empty() && out->back().ptr + out->back().size == start) {
      out->back().size += p.size;
    } else {
      out->push_back({start, p.size});
    }
  }
}

void DevicePool::slices_of(DevPtr ptr, std::size_t size, std::vector<Slice>* out) const noexcept {
  const View* v = view_of(ptr);
  const std::size_t lo = ptr - v->base, hi = lo + size;
  for (const Piece& p : v->pieces) {
    const std::size_t s = std::max(lo, p.offset), e = std::min(hi, p.offset + p.size);
    if (s >= e) continue;
    Slice slice{p.handle, p.handle_offset + (s - p.offset), e - s};
    if (!out->empty() && out->back().handle == slice.handle &&
        out->back().handle_offset + out->back().size == slice.handle_offset) {
      out->back().size += slice.size;  // contiguous in the same handle: one map call
    } else {
      out->push_back(slice);
    }
  }
}

Block* DevicePool::block_at(DevPtr ptr) const noexcept {
  const View* v = view_of(ptr);
  if (v == nullptr) return nullptr;
  for (Block* b = v->first; b != nullptr; b = b->next) {
    if (ptr >= b->ptr && ptr < b->end()) return b;
  }
  return nullptr;
}

Status DevicePool::stitch(std::size_t rounded, Block** out, std::size_t* pieces) noexcept {
  // Candidate memory: lendable ranges of fenced free blocks, largest first (fewest map calls).
  std::vector<Segment> segments;
  for (auto it = free_.rbegin(); it != free_.rend(); ++it) lendable(*it, &segments);
  std::stable_sort(segments.begin(), segments.end(),
                   [](const Segment& a, const Segment& b) { return a.size > b.size; });
  std::vector<Segment> chosen;
  std::size_t taken = 0;
  for (const Segment& s : segments) {
    if (taken >= rounded) break;
    std::size_t want = rounded - taken;
    if (s.size <= want || !map_offset_) {
      chosen.push_back(s);  // whole (without offset mapping a handle cannot be cut)
      taken += s.size;
    } else {
      chosen.push_back({s.ptr, want});
      taken += want;
    }
  }
  if (chosen.empty()) return Status::out_of_memory;  // nothing cached: stitching cannot help
  const std::size_t extra = taken < rounded ? rounded - taken : 0;
  if (extra != 0 && !cap_allows(extra)) return Status::out_of_memory;
  const std::size_t total = taken + extra;

  std::vector<Slice> slices;
  for (const Segment& s : chosen) slices_of(s.ptr, s.size, &slices);

  // Acquire everything first; any failure rolls back to exactly the state before.
  Handle* extra_handle = nullptr;
  if (extra != 0) {
    PhysHandle h = 0;
    if (backend_.create(device_, extra, &h) != Status::ok) return Status::out_of_memory;
    extra_handle = new Handle{h, extra, 0};
    slices.push_back(Slice{extra_handle, 0, extra});
  }
  DevPtr va = 0;
  auto undo = [&](std::size_t mapped_count) {
    std::size_t off = 0;
    for (std::size_t i = 0; i < mapped_count; ++i) {
      backend_.unmap(va + off, slices[i].size);
      off += slices[i].size;
    }
    if (va != 0) backend_.unreserve(va, total);
    if (extra_handle != nullptr) {
      backend_.release(extra_handle->id);
      delete extra_handle;
    }
    return Status::out_of_memory;
  };
  if (backend_.reserve(device_, total, &va) != Status::ok) {
    va = 0;
    return undo(0);
  }
  std::size_t off = 0;
  for (std::size_t i = 0; i < slices.size(); ++i) {
    if (backend_.map(va + off, slices[i].size, slices[i].handle->id, slices[i].handle_offset) !=
        Status::ok) {
      return undo(i);
    }
    off += slices[i].size;
  }
  if (map_access(va, total) != Status::ok) return undo(slices.size());

  // Commit: build the stitched view, then mark the source ranges lent.
  auto* view = new View;
  view->base = va;
  view->size = total;
  view->stitched = true;
  off = 0;
  for (const Slice& s : slices) {
    view->pieces.push_back(Piece{off, s.size, s.handle, s.handle_offset});
    ++s.handle->maps;
    off += s.size;
  }
  if (extra_handle != nullptr) view->owned.push_back(extra_handle);
  for (const Segment& s : chosen) {
    Block* b = block_at(s.ptr);  // a free block containing the whole segment
    free_.erase(b);
    if (b->ptr < s.ptr) {
      Block* lent = split(b, s.ptr - b->ptr);
      free_.insert(b);
      b = lent;
    }
    if (b->size > s.size) free_.insert(split(b, s.size));
    b->state = BlockState::lent;
    b->lent_to = view;
    view->borrowed.push_back(b);
  }
  auto* alloc = new Block;
  alloc->ptr = va;
  alloc->size = rounded;
  alloc->view = view;
  alloc->state = BlockState::allocated;
  view->first = alloc;
  if (total > rounded) free_.insert(split(alloc, rounded));
  views_.emplace(va, view);
  stats_.bytes_mapped += total;
  ++stats_.views;
  if (extra_handle != nullptr) {
    stats_.bytes_reserved += extra;
    ++stats_.handles;
    stats_.peak_reserved = std::max(stats_.peak_reserved, stats_.bytes_reserved);
  }
  *pieces = slices.size();
  *out = alloc;
  return Status::ok;
}

// ---------------------------------------------------------------------------------------------
// Block bookkeeping

Block* DevicePool::split(Block* b, std::size_t size) noexcept {
  auto* rest = new Block;
  rest->ptr = b->ptr + size;
  rest->size = b->size - size;
  rest->view = b->view;
  rest->prev = b;
  rest->next = b->next;
  rest->state = b->state;
  rest->stream = b->stream;
  rest->epoch = b->epoch;
  if (b->next != nullptr) b->next->prev = rest;
  b->next = rest;
  b->size = size;
  return rest;
}

void DevicePool::make_free(Block* b) noexcept {
  b->state = BlockState::free;
  b->lent_to = nullptr;
  b->stream = kAnyStream;
  if (Block* p = b->prev; p != nullptr && p->state == BlockState::free) {
    free_.erase(p);
    p->size += b->size;
    p->next = b->next;
    if (b->next != nullptr) b->next->prev = p;
    delete b;
    b = p;
  }
  if (Block* n = b->next; n != nullptr && n->state == BlockState::free) {
    free_.erase(n);
    b->size += n->size;
    b->next = n->next;
    if (n->next != nullptr) n->next->prev = b;
    delete n;
  }
  free_.insert(b);
}

void DevicePool::fq_push(Block* b) noexcept {
  b->fq_prev = fq_tail_;
  b->fq_next = nullptr;
  if (fq_tail_ != nullptr) fq_tail_->fq_next = b;
  fq_tail_ = b;
  if (fq_head_ == nullptr) fq_head_ = b;
}

void DevicePool::fq_insert_after(Block* pos, Block* b) noexcept {
  b->fq_prev = pos;
  b->fq_next = pos->fq_next;
  if (pos->fq_next != nullptr) pos->fq_next->fq_prev = b;
  pos->fq_next = b;
  if (fq_tail_ == pos) fq_tail_ = b;
}

void DevicePool::fq_remove(Block* b) noexcept {
  if (b->fq_prev != nullptr) b->fq_prev->fq_next = b->fq_next;
  if (b->fq_next != nullptr) b->fq_next->fq_prev = b->fq_prev;
  if (fq_head_ == b) fq_head_ = b->fq_next;
  if (fq_tail_ == b) fq_tail_ = b->fq_prev;
  b->fq_prev = b->fq_next = nullptr;
}

View* DevicePool::view_of(DevPtr ptr) const noexcept {
  auto it = views_.upper_bound(ptr);
  if (it == views_.begin()) return nullptr;
  --it;
  return ptr < it->second->end() ? it->second : nullptr;
}

void DevicePool::destroy_view(View* v) noexcept {
  free_.erase(v->first);
  for (const Piece& p : v->pieces) {
    backend_.unmap(v->base + p.offset, p.size);
    --p.handle->maps;
  }
  backend_.unreserve(v->base, v->size);
  for (Handle* h : v->owned) {
    backend_.release(h->id);
    stats_.bytes_reserved -= h->size;
    --stats_.handles;
    delete h;
  }
  stats_.bytes_mapped -= v->size;
  --stats_.views;
  delete v->first;
  views_.erase(v->base);
  delete v;
}

void DevicePool::dissolve(View* v) noexcept {
  std::vector<Block*> borrowed = std::move(v->borrowed);
  destroy_view(v);
  for (Block* b : borrowed) make_free(b);
}

// ---------------------------------------------------------------------------------------------
// Free

Status DevicePool::deallocate(DevPtr ptr, Stream stream, Outcome* outcome) noexcept {
  {
    std::lock_guard lock(mu_);
    auto it = live_.find(ptr);
    if (it == live_.end()) return Status::invalid_value;
    LiveEntry e = it->second;
    live_.erase(it);
    std::size_t requested = 0;
    if (e.chunk != nullptr) {
      requested = e.chunk->requested[e.slot];
      stats_.bytes_allocated -= e.chunk->slot_size;
      small_.free(e.chunk, e.slot, stream, epoch_);
    } else {
      Block* b = e.block;
      requested = b->requested;
      stats_.bytes_allocated -= b->size;
      b->state = BlockState::pending;
      b->epoch = epoch_;
      b->stream = stream;
      fq_push(b);
      stats_.bytes_pending += b->size;
      if (stream != kAnyStream) stream_free_[stream].insert(b);
    }
    stats_.bytes_requested -= requested;
    --stats_.live_blocks;
    --stats_.hist_live[histogram_bucket(requested)];
    ++stats_.frees;
    outcome->size = requested;
    if (config_.background_reclaim) reclaimer_.kick();
  }
  return Status::ok;
}

// ---------------------------------------------------------------------------------------------
// Fencing

void DevicePool::promote(std::uint64_t epoch) noexcept {
  while (fq_head_ != nullptr && fq_head_->epoch <= epoch) {
    Block* b = fq_head_;
    fq_remove(b);
    stats_.bytes_pending -= b->size;
    if (b->stream != kAnyStream) {
      auto it = stream_free_.find(b->stream);
      if (it != stream_free_.end()) {
        it->second.erase(b);
        if (it->second.empty()) stream_free_.erase(it);
      }
    }
    make_free(b);
  }
  small_.promote(epoch, *this);
}

void DevicePool::fence_locked() noexcept {
  const std::uint64_t target = epoch_++;
  if (backend_.synchronize(device_) == Status::ok) promote(target);
}

bool DevicePool::fence_pass() noexcept {
  std::uint64_t target;
  {
    std::lock_guard lock(mu_);
    if (!has_pending()) return false;
    target = epoch_++;
  }
  // The device is waited for without the lock: allocations and frees go on meanwhile.
  if (backend_.synchronize(device_) != Status::ok) return false;
  Outcome outcome;
  bool more;
  {
    std::lock_guard lock(mu_);
    promote(target);
    maybe_release_locked(&outcome);
    more = has_pending();
  }
  emit(outcome);
  return more;
}

void DevicePool::drain_pending() noexcept {
  std::lock_guard lock(mu_);
  small_.drop_stream_caches();
  // Under the lock nothing new is freed, so one fence covers every pending free.
  if (has_pending()) fence_locked();
}

void DevicePool::maybe_release_locked(Outcome* outcome) noexcept {
  if (config_.release_threshold == SIZE_MAX) return;
  if (stats_.bytes_reserved - stats_.bytes_allocated > config_.release_threshold) {
    trim_locked(config_.release_threshold, outcome);
  }
}

std::size_t DevicePool::trim_locked(std::size_t keep, Outcome* outcome) noexcept {
  const std::size_t reserved_before = stats_.bytes_reserved;
  std::size_t handles_before = stats_.handles;
  auto cached = [&] { return stats_.bytes_reserved - stats_.bytes_allocated; };
  if (cached() <= keep) return 0;
  small_.release_empty(*this);
  // Idle stitched views first: dissolving one gives its borrowed blocks back to their views,
  // which may then be wholly free. Repeat for stitched views built from stitched views.
  for (bool changed = true; changed;) {
    changed = false;
    std::vector<View*> idle;
    for (auto& [base, v] : views_) {
      if (v->stitched && v->wholly_free()) idle.push_back(v);
    }
    for (View* v : idle) {
      dissolve(v);
      changed = true;
    }
  }
  std::vector<View*> idle;
  for (auto& [base, v] : views_) {
    if (!v->stitched && v->wholly_free()) idle.push_back(v);
  }
  std::sort(idle.begin(), idle.end(), [](View* a, View* b) { return a->size > b->size; });
  for (View* v : idle) {
    if (cached() <= keep) break;
    destroy_view(v);
  }
  const std::size_t released = reserved_before - stats_.bytes_reserved;
  if (released != 0) {
    ++stats_.trims;
    stats_.trimmed_bytes += released;
    outcome->add(make_event(EventKind::trim, released, handles_before - stats_.handles));
  }
  return released;
}

std::size_t DevicePool::trim(Outcome* outcome) noexcept {
  std::lock_guard lock(mu_);
  small_.drop_stream_caches();
  if (has_pending()) fence_locked();
  std::size_t released = trim_locked(0, outcome);
  emit(*outcome);
  return released;
}

// ---------------------------------------------------------------------------------------------
// Chunks for the small pool

Block* DevicePool::take_chunk(std::size_t size) noexcept {
  Block* b = nullptr;
  Outcome scratch;
  Outcome* outcome = current_outcome_ != nullptr ? current_outcome_ : &scratch;
  if (allocate_large(size, size, kAnyStream, &b, outcome) != Status::ok) return nullptr;
  b->small_chunk = true;
  b->requested = size;
  b->stream = kAnyStream;
  return b;
}

void DevicePool::return_chunk(Block* b) noexcept {
  b->small_chunk = false;
  make_free(b);  // every slot was fenced before the chunk came back
}

// ---------------------------------------------------------------------------------------------
// Queries

bool DevicePool::owns_live(DevPtr ptr) const noexcept {
  std::lock_guard lock(mu_);
  return live_.count(ptr) != 0;
}

bool DevicePool::find(DevPtr ptr, BlockInfo* out) const noexcept {
  std::lock_guard lock(mu_);
  Block* b = block_at(ptr);
  if (b == nullptr || b->state != BlockState::allocated) return false;
  if (!b->small_chunk) {
    if (out != nullptr) *out = BlockInfo{b->ptr, b->requested, b->size, device_, b->stream};
    return true;
  }
  Chunk* c = small_.chunk_of(ptr);
  if (c == nullptr) return false;
  const std::size_t slot = (ptr - c->base) / c->slot_size;
  if (slot >= c->nslots || !c->allocated[slot]) return false;
  if (out != nullptr) {
    *out = BlockInfo{c->base + slot * c->slot_size, c->requested[slot], c->slot_size, device_,
                     kAnyStream};
  }
  return true;
}

Status DevicePool::grant_peer_access(int peer) noexcept {
  std::lock_guard lock(mu_);
  if (std::find(access_.begin(), access_.end(), peer) != access_.end()) return Status::ok;
  access_.push_back(peer);
  for (auto& [base, v] : views_) {
    if (Status s = map_access(v->base, v->size); s != Status::ok) {
      access_.pop_back();
      for (auto& [b2, v2] : views_) {
        if (v2 == v) break;
        map_access(v2->base, v2->size);  // back to the previous set of devices
      }
      return s;
    }
  }
  return Status::ok;
}

Status DevicePool::mem_info(std::size_t* free, std::size_t* total) noexcept {
  std::size_t device_free = 0, device_total = 0;
  Status s = backend_.mem_info(device_, &device_free, &device_total);
  if (s != Status::ok) return s;
  std::lock_guard lock(mu_);
  last_device_free_ = device_free;
  const std::size_t cap = cap_bytes();
  std::size_t headroom = stats_.bytes_reserved >= cap ? 0 : cap - stats_.bytes_reserved;
  if (free != nullptr) {
    *free = std::min(device_free, headroom) + (stats_.bytes_reserved - stats_.bytes_allocated);
  }
  if (total != nullptr) *total = std::min(device_total, cap);
  return Status::ok;
}

std::size_t DevicePool::largest_possible_locked(std::size_t device_free) const noexcept {
  const std::size_t cap = cap_bytes();
  std::size_t headroom = stats_.bytes_reserved >= cap ? 0 : cap - stats_.bytes_reserved;
  headroom = std::min(headroom, device_free) / granularity_ * granularity_;
  std::size_t largest_free = free_.empty() ? 0 : (*free_.rbegin())->size;
  std::size_t wholly_free = 0;
  for (auto& [base, v] : views_) {
    if (v->wholly_free()) wholly_free += v->size;
  }
  if (!config_.stitching) return std::max(largest_free, headroom + wholly_free);
  std::size_t lendable_bytes = 0;
  std::vector<Segment> segments;
  for (Block* b : free_) lendable(b, &segments);
  for (const Segment& s : segments) lendable_bytes += s.size;
  return std::max(largest_free, headroom + lendable_bytes + stats_.bytes_pending);
}

DeviceStats DevicePool::stats() const noexcept {
  std::size_t device_free = 0, device_total = 0;
  const bool have_info = backend_.mem_info(device_, &device_free, &device_total) == Status::ok;
  std::lock_guard lock(mu_);
  DeviceStats s = stats_;
  if (!have_info) device_free = last_device_free_;
  s.device_free = device_free;
  s.device_total = have_info ? device_total : total_;
  s.bytes_cached = s.bytes_reserved - s.bytes_allocated;
  s.largest_free_block = free_.empty() ? 0 : (*free_.rbegin())->size;
  s.largest_possible = usable_ ? largest_possible_locked(device_free) : 0;
  return s;
}

PoolEvent DevicePool::make_event(EventKind kind, std::uint64_t size,
                                 std::uint64_t pieces) noexcept {
  PoolEvent e{};
  e.kind = kind;
  e.device = device_;
  e.time_ns = now_ns();
  e.size = size;
  e.device_free = last_device_free_;
  e.cached = stats_.bytes_reserved - stats_.bytes_allocated;
  e.largest_possible = usable_ ? largest_possible_locked(last_device_free_) : 0;
  e.pieces = pieces;
  e.fragmentation = stats_.fragmentation();
  return e;
}

void DevicePool::emit(const Outcome& outcome) noexcept {
  if (observer_ == nullptr) return;
  if (outcome.has_event) observer_->on_event(outcome.event);
  if (outcome.has_event2) observer_->on_event(outcome.event2);
}

void DevicePool::after_fork_child() noexcept {
  reclaimer_.forget_after_fork();
}

}  // namespace gpustitch::detail
