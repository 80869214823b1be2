// AddressSpace: spans, the block index and block nodes. See address_space.h for the design.
#include "address_space.h"

#include <new>

namespace gpustitch::detail {

namespace {
constexpr std::size_t kKeepFreeNodes = 256;  // nodes kept for reuse beyond a reserve_nodes
}

AddressSpace::AddressSpace(Backend& backend, int device, std::size_t granularity) noexcept
    : backend_(backend), device_(device), granularity_(granularity == 0 ? 1 : granularity) {}

AddressSpace::~AddressSpace() {
  for (std::size_t s = 0; s < span_count(); ++s) {
    for (Block* b = first_[s]; b != nullptr;) {
      Block* next = b->next;
      if (b->unbacked_hook.is_linked()) unbacked_.erase(unbacked_.iterator_to(*b));
      index_.erase(index_.iterator_to(*b));
      delete b;
      b = next;
    }
    backend_.unreserve(spans_[s].base, spans_[s].size);
  }
  while (free_nodes_ != nullptr) {
    Block* next = free_nodes_->next;
    delete free_nodes_;
    free_nodes_ = next;
  }
}

Status AddressSpace::add_span(std::size_t size, std::uint8_t range) noexcept {
  const std::size_t n = span_count();
  if (n == kMaxSpans) return Status::out_of_memory;
  size = (size + granularity_ - 1) / granularity_ * granularity_;
  Block* b = new_node();
  if (b == nullptr) return Status::out_of_memory;
  DevPtr base = 0;
  if (Status s = backend_.reserve(device_, size, &base); s != Status::ok) {
    delete_node(b);
    return s;
  }
  spans_[n] = Span{base, size};
  b->ptr = base;
  b->size = size;
  b->span = static_cast<std::uint16_t>(n);
  b->size_range = range;
  b->state = BlockState::unbacked;
  index_.insert(*b);
  unbacked_.insert(*b);
  first_[n] = b;
  span_lo_[n].store(base, std::memory_order_relaxed);
  span_hi_[n].store(base + size, std::memory_order_relaxed);
  nspans_.store(n + 1, std::memory_order_release);
  return Status::ok;
}

bool AddressSpace::contains(DevPtr ptr) const noexcept {
  const std::size_t n = nspans_.load(std::memory_order_acquire);
  for (std::size_t i = 0; i < n; ++i) {
    if (ptr >= span_lo_[i].load(std::memory_order_relaxed) &&
        ptr < span_hi_[i].load(std::memory_order_relaxed)) {
      return true;
    }
  }
  return false;
}

std::size_t AddressSpace::reserved_bytes() const noexcept {
  std::size_t total = 0;
  for (std::size_t i = 0; i < span_count(); ++i) total += spans_[i].size;
  return total;
}

Block* AddressSpace::block_at(DevPtr ptr) const noexcept {
  if (!contains(ptr)) return nullptr;
  Block probe;
  probe.ptr = ptr;
  auto it = index_.upper_bound(probe);
  if (it == index_.begin()) return nullptr;
  --it;
  Block& b = const_cast<Block&>(*it);
  return ptr < b.end() ? &b : nullptr;
}

Block* AddressSpace::first_block(std::size_t span) const noexcept {
  return span < span_count() ? first_[span] : nullptr;
}

Block* AddressSpace::split(Block* b, std::size_t size) noexcept {
  Block* rest = new_node();
  if (rest == nullptr) return nullptr;
  rest->ptr = b->ptr + size;
  rest->size = b->size - size;
  rest->span = b->span;
  rest->size_range = b->size_range;
  rest->prev = b;
  rest->next = b->next;
  rest->state = b->state;
  rest->stream = b->stream;
  rest->epoch = b->epoch;
  rest->free_event = b->free_event;
  if (b->next != nullptr) b->next->prev = rest;
  b->next = rest;
  b->size = size;
  index_.insert(index_.iterator_to(*b), *rest);
  if (b->unbacked_hook.is_linked()) unbacked_.insert(*rest);
  return rest;
}

void AddressSpace::absorb_next(Block* b) noexcept {
  Block* n = b->next;
  b->size += n->size;
  b->next = n->next;
  if (n->next != nullptr) n->next->prev = b;
  if (n->unbacked_hook.is_linked()) unbacked_.erase(unbacked_.iterator_to(*n));
  index_.erase(index_.iterator_to(*n));
  delete_node(n);
}

void AddressSpace::set_unbacked(Block* b) noexcept {
  b->state = BlockState::unbacked;
  b->stream = kAnyStream;
  if (!b->unbacked_hook.is_linked()) unbacked_.insert(*b);
}

void AddressSpace::clear_unbacked(Block* b) noexcept {
  if (b->unbacked_hook.is_linked()) unbacked_.erase(unbacked_.iterator_to(*b));
}

Block* AddressSpace::merge_unbacked(Block* b) noexcept {
  if (b->prev != nullptr && b->prev->state == BlockState::unbacked) {
    b = b->prev;
    absorb_next(b);
  }
  if (b->next != nullptr && b->next->state == BlockState::unbacked) absorb_next(b);
  return b;
}

bool AddressSpace::reserve_nodes(std::size_t n) noexcept {
  while (free_node_count_ < n) {
    Block* b = new (std::nothrow) Block;
    if (b == nullptr) return false;
    b->next = free_nodes_;
    free_nodes_ = b;
    ++free_node_count_;
  }
  return true;
}

Block* AddressSpace::new_node() noexcept {
  if (free_nodes_ == nullptr) return new (std::nothrow) Block;
  Block* b = free_nodes_;
  free_nodes_ = b->next;
  --free_node_count_;
  b->next = nullptr;
  return b;
}

void AddressSpace::delete_node(Block* b) noexcept {
  if (free_node_count_ >= kKeepFreeNodes) {
    delete b;
    return;
  }
  // Reset to a fresh node (the atomic member rules out plain assignment).
  b->~Block();
  new (b) Block;
  b->next = free_nodes_;
  free_nodes_ = b;
  ++free_node_count_;
}

}  // namespace gpustitch::detail
