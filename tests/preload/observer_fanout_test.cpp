// ObserverFanout: every added observer sees every callback, also observers added while another
// thread is raising events (the pool's reclaimer can run before the last observer is added).
#include "observer_fanout.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <thread>

namespace {

using gpustitch::PoolEvent;
using gpustitch::ServedBy;
using gpustitch::preload::ObserverFanout;

struct Counting : gpustitch::PoolObserver {
  std::atomic<int>* allocs;
  std::atomic<int>* frees;
  std::atomic<int>* events;
  Counting(std::atomic<int>* a, std::atomic<int>* f, std::atomic<int>* e)
      : allocs(a), frees(f), events(e) {}
  void on_allocate(int, gpustitch::DevPtr, std::size_t, gpustitch::Stream,
                   ServedBy) noexcept override {
    ++*allocs;
  }
  void on_free(int, gpustitch::DevPtr, std::size_t, gpustitch::Stream) noexcept override {
    ++*frees;
  }
  void on_event(const PoolEvent&) noexcept override { ++*events; }
};

TEST(ObserverFanout, ForwardsEveryCallbackToEveryObserver) {
  ObserverFanout fan;
  std::atomic<int> a1{0}, f1{0}, e1{0}, a2{0}, f2{0}, e2{0};
  fan.on_allocate(0, 1, 1, 0, ServedBy::fresh);  // no observer yet: nothing to do
  ASSERT_TRUE(fan.add(std::make_unique<Counting>(&a1, &f1, &e1)));
  ASSERT_TRUE(fan.add(std::make_unique<Counting>(&a2, &f2, &e2)));
  EXPECT_FALSE(fan.add(nullptr));
  fan.on_allocate(0, 0x1000, 64, 0, ServedBy::cache);
  fan.on_free(0, 0x1000, 64, 0);
  fan.on_event(PoolEvent{});
  EXPECT_EQ(fan.size(), 2);
  EXPECT_EQ(a1 + a2, 2);
  EXPECT_EQ(f1 + f2, 2);
  EXPECT_EQ(e1 + e2, 2);
}

TEST(ObserverFanout, CapacityIsBoundedAndAddingRacesWithEvents) {
  ObserverFanout fan;
  std::atomic<int> a{0}, f{0}, e{0};
  std::atomic<bool> stop{false};
  std::thread events([&] {
    while (!stop) fan.on_event(PoolEvent{});
  });
  for (int i = 0; i < ObserverFanout::kMaxObservers; ++i) {
    EXPECT_TRUE(fan.add(std::make_unique<Counting>(&a, &f, &e)));
  }
  EXPECT_FALSE(fan.add(std::make_unique<Counting>(&a, &f, &e)));
  stop = true;
  events.join();
  int before = e.load();
  fan.on_event(PoolEvent{});
  EXPECT_EQ(e.load(), before + ObserverFanout::kMaxObservers);
}

}  // namespace
