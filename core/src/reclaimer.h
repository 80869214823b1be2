// Background fencing of freed memory. See reclaimer.cpp.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace gpustitch::detail {

class Reclaimer {
 public:
  // pass() fences once and promotes what the fence covered; returns whether frees still wait.
  explicit Reclaimer(std::function<bool()> pass);
  ~Reclaimer();
  Reclaimer(const Reclaimer&) = delete;
  Reclaimer& operator=(const Reclaimer&) = delete;

  // Called after a free was queued (with the pool lock held). Cheap unless the thread sleeps.
  void kick() noexcept;
  // In a fork child: the thread does not exist there; forget it (a later kick starts a new one).
  void forget_after_fork() noexcept;
  // Stops and joins the thread; kicks after this do nothing.
  void stop() noexcept;

 private:
  void run();
  std::function<bool()> pass_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool kicked_ = false;
  bool stop_ = false;
  std::atomic<bool> sleeping_{false};
  std::atomic<bool> started_{false};
  std::unique_ptr<std::thread> thread_;
};

}  // namespace gpustitch::detail
