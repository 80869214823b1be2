#include "trace_threads.h"

#include <system_error>

namespace gpustitch::replay {

TraceThreads::~TraceThreads() {
  {
    std::lock_guard lock(mu_);
    for (auto& [id, w] : workers_) w->stop = true;
  }
  cv_.notify_all();
  for (auto& [id, w] : workers_) w->thread.join();
}

void TraceThreads::handoff(std::uint64_t trace_thread, const std::function<void()>& f) {
  std::unique_lock lock(mu_);
  auto it = workers_.find(trace_thread);
  if (it == workers_.end()) {
    auto w = std::make_unique<Worker>();
    Worker* raw = w.get();
    it = workers_.emplace(trace_thread, std::move(w)).first;
    try {
      raw->thread = std::thread([this, raw] { loop(*raw); });
    } catch (const std::system_error&) {  // no thread to be had: the caller's own stands in
      workers_.erase(it);
      lock.unlock();
      f();
      return;
    }
  }
  Worker& w = *it->second;
  w.job = &f;
  cv_.notify_all();
  cv_.wait(lock, [&] { return w.job == nullptr; });
}

void TraceThreads::loop(Worker& w) {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return w.job != nullptr || w.stop; });
    if (w.job == nullptr) return;  // stop, nothing left to run
    const std::function<void()>* job = w.job;
    lock.unlock();
    (*job)();
    lock.lock();
    w.job = nullptr;
    cv_.notify_all();
  }
}

}  // namespace gpustitch::replay
