// The CLI end to end: `gpustitch replay --generate ... --json --plot` and
// `gpustitch snapshot --trace`, as a user runs them.
#include <gtest/gtest.h>
#include <unistd.h>
#include "temp_file.h"

#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

namespace {

std::string run(const std::string& cmd, int* rc) {
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  std::size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  int status = pclose(p);
  *rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string tmp(const std::string& name) {
  return gpustitch::test::temp_file("cli", name);
}

int count_of(const std::string& text, const std::string& needle) {
  int n = 0;
  for (auto at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

}  // namespace

TEST(ReplayCli, GeneratesReplaysAndPlots) {
  std::string trace = tmp("gen.csv"), svg = tmp("plot.svg");
  int rc = 0;
  std::string out = run(std::string(GPUSTITCH_CLI) + " replay --generate " + trace +
                            " --steps 30 --capacity-gb 80 --json --plot " + svg,
                        &rc);
  ASSERT_EQ(rc, 0) << out;
  auto j = nlohmann::json::parse(out);
  EXPECT_GT(j["events"].get<int>(), 1000);
  std::map<std::string, nlohmann::json> by_name;
  for (auto& p : j["policies"]) by_name[p["policy"]] = p;
  ASSERT_TRUE(by_name.count("gpustitch"));
  ASSERT_TRUE(by_name.count("gpustitch-no-stitch"));
  ASSERT_TRUE(by_name.count("pytorch"));
  ASSERT_TRUE(by_name.count("expandable-segments"));
  for (auto& [name, p] : by_name) {
    EXPECT_EQ(p["ooms"], 0) << name;
    EXPECT_GT(p["peak_reserved_bytes"].get<double>(), 0) << name;
    EXPECT_EQ(p["peak_allocated_bytes"], by_name["gpustitch"]["peak_allocated_bytes"]) << name;
  }
  // How gpustitch served the trace: without stitching nothing is stitched; every allocation
  // served from a chunk or block cache, fresh memory or a stitch is at most one of each.
  for (const char* name : {"gpustitch", "gpustitch-no-stitch"}) {
    const auto& p = by_name[name];
    ASSERT_TRUE(p.contains("stitches") && p.contains("fresh") && p.contains("cache_hits")) << p;
    EXPECT_GT(p["fresh"].get<long>(), 0) << name;
  }
  EXPECT_EQ(by_name["gpustitch-no-stitch"]["stitches"], 0);
  EXPECT_FALSE(by_name["pytorch"].contains("stitches"));
  EXPECT_GT(by_name["expandable-segments"]["maps"].get<long>(), 0);
  std::string plot = slurp(svg);
  EXPECT_EQ(plot.rfind("<svg", 0), 0u);
  EXPECT_EQ(count_of(plot, "<polyline"), 4);  // reserved per policy
  EXPECT_EQ(count_of(plot, "<polygon"), 1);   // the demand, once
  EXPECT_NE(plot.find("pytorch reserved"), std::string::npos);

  // The written trace reads back with no bad lines and replays the same way.
  out = run(std::string(GPUSTITCH_CLI) + " replay " + trace + " --policy pytorch --json", &rc);
  ASSERT_EQ(rc, 0) << out;
  auto again = nlohmann::json::parse(out);
  EXPECT_EQ(again["bad_lines"], 0);
  EXPECT_EQ(again["policies"][0]["peak_reserved_bytes"], by_name["pytorch"]["peak_reserved_bytes"]);
}

// What-if replays: a driver without offset mapping (--whole-handles) and the user's pool settings
// (--conf) reach the gpustitch policies; settings the pool would reject are a usage error.
TEST(ReplayCli, WholeHandlesAndPoolSettings) {
  std::string trace = tmp("whatif.csv");
  int rc = 0;
  std::string out = run(std::string(GPUSTITCH_CLI) + " replay --generate " + trace +
                            " --steps 20 --capacity-gb 80 --policy gpustitch"
                            " --conf fresh_handles:0 --json",
                        &rc);
  ASSERT_EQ(rc, 0) << out;
  auto offset = nlohmann::json::parse(out)["policies"][0];
  out = run(std::string(GPUSTITCH_CLI) + " replay " + trace +
                " --policy gpustitch --whole-handles --conf segment_mb:64 --json",
            &rc);
  ASSERT_EQ(rc, 0) << out;
  auto whole = nlohmann::json::parse(out)["policies"][0];
  EXPECT_EQ(whole["ooms"], 0);
  // Handles of at least 64 MiB move only whole: free memory left inside a handle a live block
  // still touches cannot move, so the pool holds more than with 2 MiB handles (deterministic:
  // inline fencing).
  EXPECT_GT(whole["peak_reserved_bytes"].get<double>(),
            offset["peak_reserved_bytes"].get<double>());
  out =
      run(std::string(GPUSTITCH_CLI) + " replay " + trace + " --conf segment_mb:banana 2>&1", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("segment_mb"), std::string::npos) << out;
}

// The text report says what each policy's driver calls would cost on a GPU, by kind (PyTorch's
// model: cudaMalloc per segment; the VMM policies: creates and maps), how much of it falls in the
// trace's second half, and gpustitch's device fences.
TEST(ReplayCli, TextReportHasEachPolicysDriverCalls) {
  const std::string trace = std::string(GPUSTITCH_TRACES) + "/transformer_dynseq.csv";
  int rc = 0;
  const std::string out = run(std::string(GPUSTITCH_CLI) + " replay " + trace +
                                  " --whole-handles --policy pytorch,expandable-segments,gpustitch",
                              &rc);
  ASSERT_EQ(rc, 0) << out;
  auto line_of = [&](const std::string& policy) {
    const auto at = out.find("\n" + policy + ": driver calls ");
    return at == std::string::npos ? std::string()
                                   : out.substr(at + 1, out.find('\n', at + 1) - at - 1);
  };
  const std::string torch = line_of("pytorch"), expandable = line_of("expandable-segments"),
                    ours = line_of("gpustitch");
  EXPECT_NE(torch.find(" cudaMalloc)"), std::string::npos) << out;
  EXPECT_EQ(torch.find("creates"), std::string::npos) << torch;
  EXPECT_NE(expandable.find(" creates, "), std::string::npos) << out;
  EXPECT_NE(ours.find(" unmaps"), std::string::npos) << out;
  EXPECT_NE(ours.find("of it in the second half"), std::string::npos) << ours;
  EXPECT_NE(ours.find(" device fences"), std::string::npos) << ours;
}

// --explain-peak accounts for every byte the pool held at its peak (live, free, waiting for a
// fence, small chunks, spare handles), in JSON and in the text report; other policies get none.
TEST(ReplayCli, ExplainPeakAccountsForEveryReservedByte) {
  std::string trace = tmp("explain.csv");
  int rc = 0;
  std::string out = run(std::string(GPUSTITCH_CLI) + " replay --generate " + trace +
                            " --steps 20 --capacity-gb 80 --whole-handles --explain-peak"
                            " --policy pytorch,gpustitch,gpustitch-no-stitch --json",
                        &rc);
  ASSERT_EQ(rc, 0) << out;
  const auto report = nlohmann::json::parse(out);
  for (const auto& p : report["policies"]) {
    if (p["policy"] == "pytorch") {
      EXPECT_FALSE(p.contains("peak_live_bytes")) << p;
      continue;
    }
    ASSERT_TRUE(p.contains("peak_live_bytes")) << p;
    const auto at = [&](const char* k) { return p[k].get<std::uint64_t>(); };
    EXPECT_EQ(at("peak_reserved_explained"), at("peak_reserved_bytes")) << p;
    EXPECT_EQ(at("peak_live_bytes") + at("peak_free_bytes") + at("peak_pending_bytes") +
                  at("peak_small_chunk_bytes") + at("peak_spare_bytes"),
              at("peak_reserved_bytes"))
        << p;
    EXPECT_GT(at("peak_live_bytes"), 0u) << p;
    EXPECT_GT(at("peak_request_bytes"), 0u) << p;
    EXPECT_LE(at("peak_free_under_2mib_bytes"), at("peak_free_bytes")) << p;
    EXPECT_LE(at("peak_free_pinned_bytes"), at("peak_free_bytes")) << p;
    EXPECT_LE(at("peak_largest_free_bytes"), at("peak_free_bytes")) << p;
    EXPECT_EQ(at("peak_free_blocks") == 0, at("peak_free_bytes") == 0) << p;
  }
  out = run(std::string(GPUSTITCH_CLI) + " replay " + trace +
                " --policy pytorch,gpustitch --explain-peak",
            &rc);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_EQ(count_of(out, " at its peak ("), 1) << out;
  EXPECT_NE(out.find("gpustitch at its peak ("), std::string::npos) << out;
}

// Free memory in a granule that a live block also touches can move with no handle size (the
// driver maps at least a granule); the rest of the free memory could.
TEST(ReplayCli, ExplainPeakTellsPinnedFreeMemoryFromMovable) {
  auto peak_of = [](const std::string& name, std::size_t a, std::size_t c) {
    const std::string trace = tmp(name);
    std::ofstream(trace) << "Thread,Time,Action,Pointer,Size,Stream\n"
                         << "1,00:00:00.1,allocate,0x1000," << a << ",0x0\n"
                         << "1,00:00:00.2,allocate,0x2000," << a << ",0x0\n"
                         << "1,00:00:00.3,free,0x1000," << a << ",0x0\n"
                         << "1,00:00:00.4,allocate,0x3000," << c << ",0x0\n";
    int rc = 0;
    const std::string out = run(std::string(GPUSTITCH_CLI) + " replay " + trace +
                                    " --whole-handles --explain-peak --json"
                                    " --policy gpustitch,gpustitch-no-stitch",
                                &rc);
    EXPECT_EQ(rc, 0) << out;
    std::map<std::string, nlohmann::json> by_policy;
    const auto report = nlohmann::json::parse(out);
    for (const auto& p : report["policies"]) {
      by_policy[p["policy"].get<std::string>()] = p;
    }
    return by_policy;
  };
  constexpr std::uint64_t kMiB = 1 << 20;
  // 3 MiB blocks A and B side by side, A freed, 5 MiB asked for: the last MiB of A's place shares
  // B's first granule, and C's last MiB leaves the rest of its granule free. With stitching the
  // first granule of A's place moves to back C, so what stays free is exactly those two MiB.
  auto unaligned = peak_of("pinned.csv", 3 * kMiB, 5 * kMiB);
  EXPECT_EQ(unaligned["gpustitch"]["peak_free_bytes"], 2 * kMiB) << unaligned["gpustitch"];
  EXPECT_EQ(unaligned["gpustitch"]["peak_free_pinned_bytes"], 2 * kMiB) << unaligned["gpustitch"];
  // Without stitching A's first granule stays where it is, free and movable.
  const auto& no_stitch = unaligned["gpustitch-no-stitch"];
  EXPECT_EQ(no_stitch["peak_free_bytes"].get<std::uint64_t>() -
                no_stitch["peak_free_pinned_bytes"].get<std::uint64_t>(),
            2 * kMiB)
      << no_stitch;
  // Blocks of whole granules share none: nothing free is pinned.
  auto aligned = peak_of("aligned.csv", 4 * kMiB, 6 * kMiB);
  for (const auto& [name, p] : aligned) {
    EXPECT_EQ(p["peak_free_pinned_bytes"], 0u) << p;
  }
  EXPECT_EQ(aligned["gpustitch-no-stitch"]["peak_free_bytes"], 4 * kMiB);
}

TEST(ReplayCli, UnknownPolicyAndMissingTraceAreReported) {
  int rc = 0;
  run(std::string(GPUSTITCH_CLI) + " replay /nonexistent.csv 2>/dev/null", &rc);
  EXPECT_EQ(rc, 3);
  std::string trace = tmp("one.csv");
  std::ofstream(trace)
      << "Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00.1,allocate,0x1,8,0x0\n";
  run(std::string(GPUSTITCH_CLI) + " replay " + trace + " --policy nosuch 2>/dev/null", &rc);
  EXPECT_EQ(rc, 2);
}

TEST(SnapshotCli, WritesASnapshotOfATrace) {
  if (std::string(GPUSTITCH_PYTHON3).empty()) GTEST_SKIP() << "no python3";
  std::string trace = tmp("snap.csv"), pickle = tmp("snap.pickle");
  int rc = 0;
  run(std::string(GPUSTITCH_CLI) + " replay --generate " + trace +
          " --steps 3 --policy pytorch >/dev/null",
      &rc);
  ASSERT_EQ(rc, 0);
  std::string out = run(std::string(GPUSTITCH_CLI) + " snapshot --trace " + trace +
                            " --at 2000 -o " + pickle + " --json",
                        &rc);
  ASSERT_EQ(rc, 0) << out;
  out = run(std::string(GPUSTITCH_PYTHON3) + " " + GPUSTITCH_SNAPSHOT_CHECK + " snapshot " + pickle,
            &rc);
  ASSERT_EQ(rc, 0) << out;
  auto j = nlohmann::json::parse(out);
  EXPECT_GT(j["blocks"].get<int>(), 0);
  EXPECT_GT(j["entries"].get<int>(), 0);
}
