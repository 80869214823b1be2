// Deferred reuse: how freed memory is kept from new allocations while the device may still use it.
//
// Native cudaFree waits for the whole device (50 ms behind a 50 ms kernel on an H200), which is
// how it guarantees that no kernel still touches the memory when cudaMalloc hands it out again.
// The pool must give the same guarantee without making every free wait. It uses fence epochs:
//
//   - every free stamps the memory with the device's current epoch and queues it (FIFO);
//   - a fence pass closes the epoch (epoch++), waits for the device (Backend::synchronize, i.e.
//     cuCtxSynchronize, which returns once all work queued before the call has finished), then
//     makes reusable everything stamped with an epoch at or before the closed one;
//   - memory freed on a stream (cudaFreeAsync) is also reusable at once by that same stream,
//     because stream order already guarantees that its earlier work ran first.
//
// Fence passes run on this background thread, so allocation and free never wait for the device.
// An allocation that finds no fenced memory first takes fresh physical memory; only when the
// device has none left does it run a fence pass itself (the slow path a native cudaMalloc would
// not have needed, taken where native cudaFree would already have waited).
//
// The thread starts lazily on the first free (never in a library constructor), paces its passes
// (at most one per 0.5 ms, each covering every free queued before it), lingers briefly after the
// queue empties so that a steady stream of frees does not wake it one by one, then sleeps until
// kicked. An allocation that needs pending memory does not wait for the pace: it fences itself.
#include "reclaimer.h"

#include <chrono>

namespace gpustitch::detail {
namespace {
constexpr auto kLinger = std::chrono::milliseconds(1);
// Between passes while frees keep coming: one fence covers all frees of the interval, and the
// arenas' locks are not taken in a tight loop against the threads that use them.
constexpr auto kPace = std::chrono::microseconds(500);
constexpr int kLingerRounds = 100;  // about 100 ms of polling before sleeping
}  // namespace

Reclaimer::Reclaimer(std::function<bool()> pass) : pass_(std::move(pass)) {}

Reclaimer::~Reclaimer() {
  stop();
}

void Reclaimer::stop() noexcept {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
    started_.store(true);  // a later kick must not start a thread
  }
  cv_.notify_all();
  if (thread_ && thread_->joinable()) thread_->join();
}

void Reclaimer::kick() noexcept {
  if (!started_.load(std::memory_order_acquire)) {
    std::lock_guard lock(mu_);
    if (!started_.load(std::memory_order_relaxed)) {
      try {
        thread_ = std::make_unique<std::thread>([this] { run(); });
        started_.store(true, std::memory_order_release);
      } catch (...) {
        // No thread: pending frees are then fenced by allocations that need them.
      }
      return;
    }
  }
  if (sleeping_.load(std::memory_order_seq_cst)) {
    {
      std::lock_guard lock(mu_);
      kicked_ = true;
    }
    cv_.notify_one();
  }
}

void Reclaimer::forget_after_fork() noexcept {
  // The std::thread object refers to a thread of the parent; destroying it would terminate.
  (void)thread_.release();
  started_.store(false);
  sleeping_.store(false);
  new (&mu_) std::mutex();
  new (&cv_) std::condition_variable();
  kicked_ = false;
}

void Reclaimer::run() {
  int idle_rounds = 0;
  for (;;) {
    bool more = pass_();
    std::unique_lock lock(mu_);
    if (stop_) return;
    if (more) {
      idle_rounds = 0;
      cv_.wait_for(lock, kPace, [&] { return stop_; });
      if (stop_) return;
      continue;
    }
    if (++idle_rounds < kLingerRounds) {
      cv_.wait_for(lock, kLinger, [&] { return stop_ || kicked_; });
    } else {
      // Announce sleep, then look once more: a free that queued before it saw sleeping_ is
      // caught by this pass, one after it will kick.
      sleeping_.store(true, std::memory_order_seq_cst);
      lock.unlock();
      more = pass_();
      lock.lock();
      if (!more) cv_.wait(lock, [&] { return stop_ || kicked_; });
      sleeping_.store(false, std::memory_order_seq_cst);
      idle_rounds = 0;
    }
    kicked_ = false;
    if (stop_) return;
  }
}

}  // namespace gpustitch::detail
