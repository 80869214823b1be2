// HybridLock: the pool's mutex. An uncontended lock+unlock costs one atomic exchange and one plain
// store, where std::mutex (glibc) costs two atomic read-modify-writes: on the cache-hit path, which
// takes two locks per allocate+free pair, that is a third of the pair's cost (measured: ~15 ns of
// ~57 ns on a virtualised 2 GHz core).
//
// Why unlock can be a plain store: a waiter first spins briefly (critical sections on the hot path
// are tens of nanoseconds), then sleeps in futex_wait with a short timeout. The unlocker wakes
// sleepers it sees in waiters_, but without a fence between its store and that load it may miss a
// waiter that was just going to sleep; such a waiter wakes by itself when its timeout expires
// (kSleep) and retries. So a missed wake-up costs at most kSleep of latency in a rare race, never a
// hang, and the common path pays no fence. Holders of the lock for long (a fence waiting for the
// device, a driver call creating memory) leave waiters asleep, not spinning.
//
// Satisfies Lockable (std::lock_guard, std::unique_lock). Not recursive. Not fair.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

namespace gpustitch::detail {

class HybridLock {
 public:
  void lock() noexcept {
    if (state_.exchange(1, std::memory_order_acquire) == 0) return;
    lock_slow();
  }
  bool try_lock() noexcept {
    return state_.load(std::memory_order_relaxed) == 0 &&
           state_.exchange(1, std::memory_order_acquire) == 0;
  }
  void unlock() noexcept {
    state_.store(0, std::memory_order_release);
    if (waiters_.load(std::memory_order_relaxed) != 0) wake();
  }

 private:
  static constexpr long kSleepNs = 50'000;  // bound on the latency of a missed wake-up
  static constexpr int kSpins = 32;

  void lock_slow() noexcept {
    for (int i = 0; i < kSpins; ++i) {
      pause();
      if (state_.load(std::memory_order_relaxed) == 0 &&
          state_.exchange(1, std::memory_order_acquire) == 0) {
        return;
      }
    }
    waiters_.fetch_add(1, std::memory_order_seq_cst);
    while (state_.exchange(1, std::memory_order_acquire) != 0) {
      timespec timeout{0, kSleepNs};
      syscall(SYS_futex, &state_, FUTEX_WAIT_PRIVATE, 1, &timeout, nullptr, 0);
    }
    waiters_.fetch_sub(1, std::memory_order_relaxed);
  }
  void wake() noexcept { syscall(SYS_futex, &state_, FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0); }
  static void pause() noexcept {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield" ::: "memory");
#endif
  }

  std::atomic<std::uint32_t> state_{0};  // 0 free, 1 held
  std::atomic<std::uint32_t> waiters_{0};
};

}  // namespace gpustitch::detail
