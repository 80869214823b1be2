// TraceThreads: runs each call on a thread that stands for the trace thread that made it, one
// call at a time and in the trace's order.
//
// Why: the pool keeps state per thread (a thread's arena: its small pool and its chunks, chosen
// at the thread's first small allocation). PyTorch's training traces come from two threads (the
// Python thread and the autograd engine's device thread), so on the GPU the pool serves them from
// two arenas; replayed from one thread, it used one, and the replay missed what the second
// arena's chunks hold. The calls stay serial (the caller waits for each), so a replay is as
// deterministic as before. Which arena each thread gets is the policy's to say
// (pool_policy.cpp binds them by the trace threads' order), not the process's other threads'.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

namespace gpustitch::replay {

class TraceThreads {
 public:
  TraceThreads() = default;
  TraceThreads(const TraceThreads&) = delete;
  TraceThreads& operator=(const TraceThreads&) = delete;
  ~TraceThreads();

  // Runs f on trace_thread's thread and returns when f has: the caller's own for the first trace
  // thread seen, a worker (started at its first call) for each other. A template so that the
  // caller's own calls (all of them in a one-thread trace) run f directly; only a handoff wraps it.
  template <class F>
  void run(std::uint64_t trace_thread, F&& f) {
    if (on_caller(trace_thread)) {
      f();
      return;
    }
    const std::function<void()> job = std::ref(f);  // a reference: no copy, no allocation
    handoff(trace_thread, job);
  }

 private:
  struct Worker {
    std::thread thread;
    const std::function<void()>* job = nullptr;  // set by handoff(), cleared by the worker when run
    bool stop = false;
  };
  // The first trace thread seen is the caller's own: a trace of one thread makes no handoffs.
  bool on_caller(std::uint64_t trace_thread) {
    if (!first_) first_ = trace_thread;
    return *first_ == trace_thread;
  }
  void handoff(std::uint64_t trace_thread, const std::function<void()>& f);
  void loop(Worker& w);

  std::optional<std::uint64_t> first_;  // the trace thread the caller stands for
  std::mutex mu_;
  std::condition_variable cv_;  // one waiter at a time on each side: the caller or a worker
  std::map<std::uint64_t, std::unique_ptr<Worker>> workers_;
};

}  // namespace gpustitch::replay
