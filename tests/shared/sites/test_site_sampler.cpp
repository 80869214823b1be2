// SiteSampler: a captured stack names the function that allocated; live bytes and counts follow
// allocations and frees per site; the sampling triggers (size threshold, 1 in K) hold; the
// sampler is not created when sites are off.
#include <gtest/gtest.h>

#include <string>

#include "gpustitch/sites/site_sampler.h"

using namespace gpustitch;
using namespace gpustitch::sites;

// Stand-ins for two places in a program that allocate device memory. noinline and exported
// (the test links with -rdynamic) so the stack has a frame for each and dladdr can name it.
extern "C++" __attribute__((noinline)) void allocate_weights_here(SiteSampler& s, DevPtr p,
                                                                  std::size_t size) {
  s.on_allocate(0, p, size, kAnyStream, ServedBy::fresh);
  asm volatile("" ::: "memory");  // keep the call from becoming a tail call
}

__attribute__((noinline)) void allocate_activations_here(SiteSampler& s, DevPtr p,
                                                         std::size_t size) {
  s.on_allocate(0, p, size, kAnyStream, ServedBy::cache);
  asm volatile("" ::: "memory");
}

namespace {
// Calls f(0..n-1) from one call site: n is read from a volatile, so the compiler can neither
// peel the loop into n copies (different return addresses) nor turn the call into a tail call.
volatile int g_times = 0;
template <class F>
__attribute__((noinline)) void repeat_from_one_site(int n, F f) {
  g_times = n;
  const int times = g_times;
  for (int i = 0; i < times; ++i) {
    f(i);
    asm volatile("" ::: "memory");
  }
}

bool names(const SiteReport& r, const std::string& fn) {
  return !r.frames.empty() && r.frames.front().function.find(fn) != std::string::npos;
}
}  // namespace

TEST(SiteSampler, StackNamesTheAllocatingFunction) {
  SiteSampler s({.min_size = 1, .sample_every = 0});
  allocate_weights_here(s, 0x1000, 64 * MiB);
  auto top = s.top(4);
  ASSERT_EQ(top.size(), 1u);
  ASSERT_FALSE(top[0].frames.empty());
  // The innermost frame after gpustitch's own is the function that called into the pool.
  EXPECT_NE(top[0].frames[0].function.find("allocate_weights_here"), std::string::npos)
      << top[0].frames[0].function << " in " << top[0].frames[0].library << " (unwinder "
      << SiteSampler::unwinder() << ")";
  EXPECT_NE(top[0].frames[0].library.find("test_sites"), std::string::npos)
      << top[0].frames[0].library;
  EXPECT_GT(top[0].frames[0].offset, 0u);
  // The caller of that function (this test body) is further down the stack.
  bool found_test = false;
  for (const auto& f : top[0].frames)
    if (f.function.find("StackNamesTheAllocatingFunction") != std::string::npos) found_test = true;
  EXPECT_TRUE(found_test);
}

TEST(SiteSampler, AggregatesLiveBytesAndCountPerSite) {
  SiteSampler s({.min_size = 1, .sample_every = 0});
  repeat_from_one_site(3, [&](int i) { allocate_weights_here(s, 0x100000 * (i + 1), 10 * MiB); });
  allocate_activations_here(s, 0x900000, 50 * MiB);
  auto top = s.top(8);
  ASSERT_EQ(top.size(), 2u);
  EXPECT_TRUE(names(top[0], "allocate_activations_here"));
  EXPECT_EQ(top[0].live_bytes, 50 * MiB);
  EXPECT_TRUE(names(top[1], "allocate_weights_here"));
  EXPECT_EQ(top[1].live_bytes, 30 * MiB);
  EXPECT_EQ(top[1].live_count, 3u);

  s.on_free(0, 0x900000, 50 * MiB, kAnyStream);
  s.on_free(0, 0x100000, 10 * MiB, kAnyStream);
  s.on_free(0, 0xdead000, 1, kAnyStream);  // never sampled: ignored
  top = s.top(8);
  ASSERT_EQ(top.size(), 2u);
  EXPECT_TRUE(names(top[0], "allocate_weights_here"));
  EXPECT_EQ(top[0].live_bytes, 20 * MiB);
  EXPECT_EQ(top[0].live_count, 2u);
  EXPECT_EQ(top[0].total_count, 3u);
  EXPECT_EQ(top[1].live_bytes, 0u);
  EXPECT_EQ(top[1].total_bytes, 50 * MiB);

  auto frames = s.frames_of(0x200000);
  ASSERT_FALSE(frames.empty());
  EXPECT_NE(frames[0].function.find("allocate_weights_here"), std::string::npos);
  EXPECT_TRUE(s.frames_of(0x100000).empty());  // freed
  EXPECT_EQ(s.top(1).size(), 1u);
}

TEST(SiteSampler, SamplesOnlyWhatTheTriggersSelect) {
  SiteSampler big({.min_size = 4 * MiB, .sample_every = 0});
  allocate_weights_here(big, 0x1000, 4 * MiB - 1);
  allocate_weights_here(big, 0x2000, 4 * MiB);
  EXPECT_EQ(big.sampled(), 1u);

  SiteSampler one_in_4({.min_size = 0, .sample_every = 4});
  repeat_from_one_site(400,
                       [&](int i) { allocate_activations_here(one_in_4, 0x1000 * (i + 1), 512); });
  EXPECT_EQ(one_in_4.sampled(), 100u);
  auto top = one_in_4.top(1);
  ASSERT_EQ(top.size(), 1u);
  EXPECT_EQ(top[0].live_count, 100u);
}

TEST(SiteSampler, NotCreatedWhenSitesAreOff) {
  Config c;
  EXPECT_EQ(make_site_sampler(c), nullptr);
  c.sites_sample = 100;
  auto s = make_site_sampler(c);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->options().sample_every, 100u);
  c.sites_sample = 0;
  c.sites_min_size = 64 * MiB;
  s = make_site_sampler(c);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->options().min_size, 64 * MiB);
}
