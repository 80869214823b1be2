#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "gpustitch/config.h"

using namespace gpustitch;

TEST(Config, ParsesEveryDocumentedKind) {
  auto r = parse_config(
      "max_split_size_mb:512, release_threshold_mb:4096,small_limit_kb:512,cap_mb:1024,"
      "stitching:off,backend:sim,sim_capacity_mb:81920,trace:/tmp/t.csv,log_level:info");
  EXPECT_TRUE(r.errors.empty());
  EXPECT_EQ(r.config.max_split_size, 512 * MiB);
  EXPECT_EQ(r.config.release_threshold, 4096 * MiB);
  EXPECT_EQ(r.config.small_limit, 512 * KiB);
  EXPECT_EQ(r.config.cap, 1024 * MiB);
  EXPECT_FALSE(r.config.stitching);
  EXPECT_EQ(r.config.backend, BackendKind::sim);
  EXPECT_EQ(r.config.sim_capacity, 80 * GiB);
  EXPECT_EQ(r.config.trace_path, "/tmp/t.csv");
  EXPECT_EQ(r.config.log_level, "info");
}

TEST(Config, ArenasTakesACountUpToTheMaximumAndZeroMeansOnePerCore) {
  EXPECT_EQ(parse_config("").config.arenas, 0u);
  auto r = parse_config("arenas:3");
  EXPECT_TRUE(r.errors.empty());
  EXPECT_EQ(r.config.arenas, 3u);
  r = parse_config("arenas:8,arenas:0");
  EXPECT_TRUE(r.errors.empty());
  EXPECT_EQ(r.config.arenas, 0u);
  r = parse_config("arenas:9,stitching:off");
  ASSERT_EQ(r.errors.size(), 1u);
  EXPECT_NE(r.errors[0].find("arenas"), std::string::npos) << r.errors[0];
  EXPECT_EQ(r.config.arenas, 0u) << "a rejected value leaves the default";
  EXPECT_FALSE(r.config.stitching);
}

TEST(Config, EmptyGivesDefaults) {
  auto r = parse_config("");
  EXPECT_TRUE(r.errors.empty());
  EXPECT_EQ(r.config.max_split_size, SIZE_MAX);
  EXPECT_TRUE(r.config.stitching);
  EXPECT_EQ(r.config.small_limit, 256 * KiB);
}

TEST(Config, UnknownKeyIsNamedAndTheRestStillApplies) {
  auto r = parse_config("max_split_size_mb:64,bogus_key:1,cap_fraction:0.5");
  ASSERT_EQ(r.errors.size(), 1u);
  EXPECT_NE(r.errors[0].find("bogus_key"), std::string::npos);
  EXPECT_EQ(r.config.max_split_size, 64 * MiB);
  EXPECT_DOUBLE_EQ(r.config.cap_fraction, 0.5);
}

TEST(Config, UnknownKeySuggestsTheNearestKnownOne) {
  auto r = parse_config("max_split_size:64,stiching:off,bogus_key:1,release_treshold_mb:8");
  ASSERT_EQ(r.errors.size(), 4u);
  EXPECT_NE(r.errors[0].find("unknown key 'max_split_size' (did you mean max_split_size_mb?)"),
            std::string::npos)
      << r.errors[0];
  EXPECT_NE(r.errors[1].find("(did you mean stitching?)"), std::string::npos) << r.errors[1];
  EXPECT_EQ(r.errors[2].find("did you mean"), std::string::npos) << r.errors[2];
  EXPECT_NE(r.errors[3].find("(did you mean release_threshold_mb?)"), std::string::npos)
      << r.errors[3];
}

TEST(Config, MalformedValuesAreRejectedOneMessageEach) {
  auto r = parse_config(
      "max_split_size_mb:abc,cap_fraction:2,stitching:maybe,noval,"
      "release_threshold_mb:99999999999999999999999,small_limit_kb:-4");
  EXPECT_EQ(r.errors.size(), 6u);
  for (const char* key : {"max_split_size_mb", "cap_fraction", "stitching", "noval",
                          "release_threshold_mb", "small_limit_kb"}) {
    bool named = false;
    for (auto& e : r.errors) named |= e.find(key) != std::string::npos;
    EXPECT_TRUE(named) << key;
  }
  Config defaults;
  EXPECT_EQ(r.config.max_split_size, defaults.max_split_size);
  EXPECT_EQ(r.config.cap_fraction, defaults.cap_fraction);
  EXPECT_TRUE(r.config.stitching);
}

TEST(Config, OverflowingSizesAreRejected) {
  auto r = parse_config("cap_mb:18446744073709551615");
  EXPECT_EQ(r.errors.size(), 1u);
  EXPECT_EQ(r.config.cap, 0u);
}

TEST(Config, KeysListIncludesCoreKeys) {
  auto keys = config_keys();
  for (const char* k : {"max_split_size_mb", "release_threshold_mb", "small_limit_kb", "cap_mb",
                        "cap_fraction", "stitching", "backend"}) {
    EXPECT_NE(std::find(keys.begin(), keys.end(), k), keys.end()) << k;
  }
}

TEST(Config, LargeCacheBudgetInMiBAndZeroTurnsItOff) {
  EXPECT_EQ(parse_config("").config.large_cache, 0u);
  EXPECT_EQ(parse_config("large_cache_mb:64").config.large_cache, 64 * MiB);
  EXPECT_EQ(parse_config("large_cache_mb:0").config.large_cache, 0u);
  auto r = parse_config("large_cache_mb:lots");
  ASSERT_EQ(r.errors.size(), 1u);
  EXPECT_NE(r.errors[0].find("large_cache_mb"), std::string::npos);
  EXPECT_EQ(r.config.large_cache, 0u);
}

TEST(Config, HandleSizeKeys) {
  auto r = parse_config("segment_mb:4,fresh_handles:0,max_handle_mb:64");
  EXPECT_TRUE(r.errors.empty());
  EXPECT_EQ(r.config.segment_size, 4 * MiB);
  EXPECT_EQ(r.config.fresh_handles, 0u);
  EXPECT_EQ(r.config.max_handle, 64 * MiB);
  EXPECT_EQ(parse_config("max_handle_mb:0").config.max_handle, 0u) << "0: no limit";
  EXPECT_EQ(Config{}.max_handle, 10 * MiB);
  auto bad = parse_config("max_handle_mb:1,fresh_handles:70000");
  EXPECT_EQ(bad.errors.size(), 2u);
  EXPECT_EQ(bad.config.max_handle, 10 * MiB) << "a rejected value leaves the default";
}

TEST(Config, MemoryFirstLayoutKeys) {
  EXPECT_FALSE(Config{}.size_ranges) << "off by default";
  EXPECT_EQ(Config{}.memory_first, 8 * GiB);
  EXPECT_EQ(parse_config("memory_first_mb:0").config.memory_first, 0u) << "0: never";
  EXPECT_EQ(parse_config("memory_first_mb:512").config.memory_first, 512 * MiB);
  EXPECT_FALSE(parse_config("memory_first_mb:1").errors.empty()) << "below one granule";
  EXPECT_EQ(Config{}.gap_handles, 16u);
  auto r = parse_config("size_ranges:on,handle_share:1024,gap_handles:0");
  EXPECT_TRUE(r.errors.empty());
  EXPECT_TRUE(r.config.size_ranges);
  EXPECT_EQ(r.config.handle_share, 1024u);
  EXPECT_EQ(r.config.gap_handles, 0u) << "0: no bound";
  auto bad = parse_config("size_ranges:sometimes,gap_handles:70000");
  ASSERT_EQ(bad.errors.size(), 2u);
  EXPECT_NE(bad.errors[0].find("size_ranges"), std::string::npos) << bad.errors[0];
  EXPECT_NE(bad.errors[1].find("gap_handles"), std::string::npos) << bad.errors[1];
  EXPECT_FALSE(bad.config.size_ranges) << "a rejected value leaves the default";
  EXPECT_EQ(bad.config.gap_handles, 16u);
}

TEST(Config, FreshCoarseKey) {
  EXPECT_EQ(Config{}.fresh_coarse, 256 * MiB) << "the default";
  EXPECT_EQ(parse_config("fresh_coarse_mb:0").config.fresh_coarse, 0u) << "never";
  EXPECT_EQ(parse_config("fresh_coarse_mb:1024").config.fresh_coarse, 1 * GiB);
  auto bad = parse_config("fresh_coarse_mb:1");
  EXPECT_EQ(bad.errors.size(), 1u);
  EXPECT_EQ(bad.config.fresh_coarse, 256 * MiB) << "a rejected value leaves the default";
  EXPECT_EQ(Config{}.stream_fresh_coarse, 2 * GiB) << "the default for a stream's fresh range";
  EXPECT_EQ(parse_config("stream_fresh_coarse_mb:0").config.stream_fresh_coarse, 0u)
      << "as fresh_coarse_mb";
  EXPECT_EQ(parse_config("stream_fresh_coarse_mb:512").config.stream_fresh_coarse, 512 * MiB);
  auto bad_stream = parse_config("stream_fresh_coarse_mb:x");
  ASSERT_EQ(bad_stream.errors.size(), 1u);
  EXPECT_NE(bad_stream.errors[0].find("stream_fresh_coarse_mb"), std::string::npos);
  EXPECT_EQ(bad_stream.config.stream_fresh_coarse, 2 * GiB);
}

// Switches that are on unless turned off; a bad value keeps them on and names the key.
TEST(Config, OnByDefaultSwitches) {
  const std::pair<const char*, bool Config::*> switches[] = {
      {"driver_pool_release", &Config::driver_pool_release},
      {"stream_cut_fence", &Config::stream_cut_fence},
      {"stream_cut_wait", &Config::stream_cut_wait},
  };
  for (const auto& [key, member] : switches) {
    SCOPED_TRACE(key);
    EXPECT_TRUE(parse_config("").config.*member);
    EXPECT_FALSE(parse_config(std::string(key) + ":off").config.*member);
    auto bad = parse_config(std::string(key) + ":sometimes");
    ASSERT_EQ(bad.errors.size(), 1u);
    EXPECT_NE(bad.errors[0].find(key), std::string::npos);
    EXPECT_TRUE(bad.config.*member) << "a bad value keeps the default";
  }
}

TEST(Config, ReclaimTakesThreadInlineOrOrdered) {
  const Config d = parse_config("").config;
  EXPECT_TRUE(d.background_reclaim);
  EXPECT_FALSE(d.ordered_fences);
  const Config inl = parse_config("reclaim:inline").config;
  EXPECT_FALSE(inl.background_reclaim);
  EXPECT_FALSE(inl.ordered_fences);
  const Config ord = parse_config("reclaim:ordered").config;
  EXPECT_TRUE(ord.background_reclaim) << "ordered fences run on the reclaimer thread";
  EXPECT_TRUE(ord.ordered_fences);
  const Config back = parse_config("reclaim:ordered,reclaim:thread").config;
  EXPECT_FALSE(back.ordered_fences) << "the last value wins";
  auto bad = parse_config("reclaim:sometimes");
  ASSERT_EQ(bad.errors.size(), 1u);
  EXPECT_NE(bad.errors[0].find("thread, inline or ordered"), std::string::npos) << bad.errors[0];
  EXPECT_FALSE(bad.config.ordered_fences);
}

TEST(Config, ProgramVmmServesByDefaultAndCanOnlyCount) {
  EXPECT_TRUE(parse_config("").config.serve_program_vmm);
  auto r = parse_config("program_vmm:count");
  EXPECT_TRUE(r.errors.empty());
  EXPECT_FALSE(r.config.serve_program_vmm);
  EXPECT_TRUE(parse_config("program_vmm:serve").config.serve_program_vmm);
  r = parse_config("program_vmm:off");
  ASSERT_EQ(r.errors.size(), 1u);
  EXPECT_NE(r.errors[0].find("serve or count"), std::string::npos) << r.errors[0];
}

TEST(Config, GrowSlackIsAPercentageAndUnmapAMode) {
  auto r = parse_config("grow_slack_pct:4,unmap:lazy");
  EXPECT_TRUE(r.errors.empty());
  EXPECT_EQ(r.config.grow_slack_pct, 4u);
  EXPECT_EQ(r.config.unmap, Config::Unmap::lazy);
  auto bad = parse_config("grow_slack_pct:101,unmap:later");
  EXPECT_EQ(bad.errors.size(), 2u);
  Config defaults;
  EXPECT_EQ(bad.config.grow_slack_pct, defaults.grow_slack_pct);
  EXPECT_EQ(bad.config.unmap, defaults.unmap);
}
