// TraceThreads: each trace thread's calls run on one thread of their own, the first trace
// thread's on the caller, one call at a time and in order. (That replays of the two-thread
// training traces stay deterministic: Replay.TheSameTraceGivesTheSameFiguresEveryTime.)
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <thread>
#include <vector>

#include "trace_threads.h"

using namespace gpustitch::replay;

TEST(TraceThreads, EachTraceThreadsCallsRunOnOneThreadOfItsOwnInOrder) {
  std::vector<std::pair<std::uint64_t, std::thread::id>> calls;  // no lock: calls are serial
  {
    TraceThreads threads;
    const std::uint64_t order[] = {7, 9, 7, 11, 9, 9, 7, 11};
    for (std::uint64_t t : order) {
      threads.run(t, [&] { calls.emplace_back(t, std::this_thread::get_id()); });
    }
  }  // the destructor joins the workers
  ASSERT_EQ(calls.size(), 8u);
  const std::uint64_t order[] = {7, 9, 7, 11, 9, 9, 7, 11};
  std::map<std::uint64_t, std::set<std::thread::id>> by_trace_thread;
  for (std::size_t i = 0; i < calls.size(); ++i) {
    EXPECT_EQ(calls[i].first, order[i]) << "call " << i << " ran out of order";
    by_trace_thread[calls[i].first].insert(calls[i].second);
  }
  EXPECT_EQ(*by_trace_thread[7].begin(), std::this_thread::get_id()) << "the first: the caller";
  std::set<std::thread::id> distinct;
  for (const auto& [t, ids] : by_trace_thread) {
    EXPECT_EQ(ids.size(), 1u) << "trace thread " << t << " ran on several threads";
    distinct.insert(*ids.begin());
  }
  EXPECT_EQ(distinct.size(), 3u) << "two trace threads shared a thread";
}
