// gpustitch show PID: everything one process publishes: counters per device, the size
// histogram, recent events, allocation sites, and (from gpustitchd) a chart of its history.
#include <algorithm>
#include <cmath>
#include <ctime>
#include <iostream>

#include "number_checks.h"
#include "stats_client.h"

namespace gpustitch::cli {
namespace {
using nlohmann::json;

struct ShowOptions {
  SourceOptions source;
  long pid = 0;
  unsigned history_seconds = 600;
  int chart_width = 60;
};

std::string clock_time(std::uint64_t ns) {
  std::time_t t = static_cast<std::time_t>(ns / 1000000000ull);
  char buf[32];
  std::strftime(buf, sizeof buf, "%H:%M:%S", std::localtime(&t));
  char ms[8];
  std::snprintf(ms, sizeof ms, ".%03u", static_cast<unsigned>(ns / 1000000ull % 1000));
  return std::string(buf) + ms;
}

std::string bucket_label(int i) {
  // Bucket i holds [2^(i+9), 2^(i+10)); bucket 0 also holds everything below 1 KiB.
  if (i == 0) return "< 1 KiB";
  return ">= " + human_bytes(std::uint64_t(1) << (i + 9));
}

// A chart of reserved (light) and allocated (dark) bytes over time, `rows` lines tall.
std::string history_chart(const json& h, int width, int rows = 6) {
  const auto& t = member(h, "time_ns");
  const auto& alloc = member(h, "allocated");
  const auto& res = member(h, "reserved");
  if (!t.is_array() || !alloc.is_array() || !res.is_array()) return "";
  std::size_t n = std::min({t.size(), alloc.size(), res.size()});
  if (n < 2) return "";
  width = std::max(8, width);
  std::vector<std::uint64_t> a(width, 0), r(width, 0);
  std::vector<bool> have(width, false);
  // Each column shows the largest value of the samples that fall in it; with fewer samples
  // than columns, a sample spans several columns.
  for (int col = 0; col < width; ++col) {
    std::size_t lo = static_cast<std::size_t>(col) * n / static_cast<std::size_t>(width);
    std::size_t hi =
        std::max(lo + 1, static_cast<std::size_t>(col + 1) * n / static_cast<std::size_t>(width));
    for (std::size_t i = lo; i < hi && i < n; ++i) {
      a[col] = std::max(a[col], as_u64(alloc[i]));
      r[col] = std::max(r[col], as_u64(res[i]));
      have[col] = true;
    }
  }
  std::uint64_t top = 1;
  for (int c = 0; c < width; ++c) top = std::max({top, a[c], r[c]});
  std::string out;
  for (int row = rows - 1; row >= 0; --row) {
    std::string line = row == rows - 1 ? human_bytes(top) : row == 0 ? "0" : "";
    line.resize(10, ' ');
    line += "|";
    for (int c = 0; c < width; ++c) {
      double level = double(row) + 0.5;
      double av = have[c] ? double(a[c]) * rows / double(top) : 0;
      double rv = have[c] ? double(r[c]) * rows / double(top) : 0;
      line += av >= level ? "\u2588" : rv >= level ? "\u2591" : " ";
    }
    out += line + "\n";
  }
  std::uint64_t t0 = as_u64(t[0]), t1 = as_u64(t[n - 1]);
  double span = double(t1 - std::min(t0, t1)) / 1e9;
  char foot[160];
  std::snprintf(foot, sizeof foot,
                "%10s+%s\n%10s %s ... %s (%.0f s; \u2588 allocated, \u2591 reserved)\n", "",
                std::string(width, '-').c_str(), "", clock_time(t0).c_str(), clock_time(t1).c_str(),
                span);
  return out + foot;
}

void print_process(const json& answer, const std::string& source, int chart_width) {
  const json& p = member(answer, "process");
  std::cout << "pid " << u64(p, "pid") << "  user " << str(p, "user") << "  exe " << str(p, "exe")
            << "\ncommand " << str(p, "command") << "\n";
  std::uint64_t hb = u64(p, "heartbeat_ns");
  std::cout << "last published " << (hb ? clock_time(hb) : std::string("never")) << " (every "
            << u64(p, "publish_interval_ms") << " ms), source " << source << "\n";
  for (const auto& d : items(p, "devices")) {
    std::string uuid = str(d, "uuid");
    std::cout << "\ndevice " << u64(d, "device") << (uuid.empty() ? "" : " (" + uuid + ")") << "\n";
    auto line = [](std::vector<std::pair<std::string, std::string>> kv) {
      std::string s = " ";
      for (auto& [k, v] : kv) s += " " + k + " " + v + " ";
      std::cout << s << "\n";
    };
    line({{"allocated", human_bytes(u64(d, "bytes_allocated"))},
          {"requested", human_bytes(u64(d, "bytes_requested"))},
          {"live blocks", std::to_string(u64(d, "live_blocks"))}});
    line({{"reserved", human_bytes(u64(d, "bytes_reserved"))},
          {"cached", human_bytes(u64(d, "bytes_cached"))},
          {"pending", human_bytes(u64(d, "bytes_pending"))},
          {"mapped", human_bytes(u64(d, "bytes_mapped"))}});
    line({{"fragmentation", percent(f64(d, "fragmentation"))},
          {"largest free block", human_bytes(u64(d, "largest_free_block"))},
          {"largest possible", human_bytes(u64(d, "largest_possible"))}});
    line({{"peak allocated", human_bytes(u64(d, "peak_allocated"))},
          {"peak reserved", human_bytes(u64(d, "peak_reserved"))},
          {"device free",
           human_bytes(u64(d, "device_free")) + " / " + human_bytes(u64(d, "device_total"))}});
    line({{"allocations", std::to_string(u64(d, "allocs"))},
          {"cache hits", std::to_string(u64(d, "cache_hits"))},
          {"fresh", std::to_string(u64(d, "fresh"))},
          {"frees", std::to_string(u64(d, "frees"))},
          {"handles", std::to_string(u64(d, "handles"))},
          {"views", std::to_string(u64(d, "views"))}});
    line({{"stitches",
           std::to_string(u64(d, "stitches")) + " (" + human_bytes(u64(d, "stitched_bytes")) + ")"},
          {"trims",
           std::to_string(u64(d, "trims")) + " (" + human_bytes(u64(d, "trimmed_bytes")) + ")"},
          {"OOMs", std::to_string(u64(d, "ooms"))}});
    // The pool's own time in the driver's memory API: what physical memory cost the process's CPU
    // (cache hits pay none). Record layouts before 5 did not carry it.
    if (u64(p, "layout_version") == 0 || u64(p, "layout_version") >= 5) {
      char ms[32];
      std::snprintf(ms, sizeof ms, "%.1f ms", static_cast<double>(u64(d, "driver_ns")) / 1e6);
      line({{"driver calls", std::to_string(u64(d, "driver_calls")) + " (" + ms + ")"}});
    }
    // Layout 6: where that time went (the allocating threads' calls by kind, the reclaimer
    // thread's apart), and what reserved held when it last rose to its peak: memory waiting for
    // the device there means the pool grew while the GPU still ran work queued before frees.
    if (u64(p, "layout_version") == 0 || u64(p, "layout_version") >= 6) {
      auto calls = [&](const char* label, const std::string& kind) {
        char ms[32];
        std::snprintf(ms, sizeof ms, "%.1f ms",
                      static_cast<double>(u64(d, ("driver_" + kind + "_ns").c_str())) / 1e6);
        return std::pair<std::string, std::string>{
            label, std::to_string(u64(d, ("driver_" + kind + "_calls").c_str())) + " (" + ms + ")"};
      };
      line({calls("create", "create"), calls("map", "map"), calls("set access", "set_access"),
            calls("unmap", "unmap"), calls("release", "release"),
            calls("reclaimer thread", "background")});
      line({{"when reserved peaked",
             human_bytes(u64(d, "peak_reserved_allocated")) + " allocated, " +
                 human_bytes(u64(d, "peak_reserved_pending")) + " waiting for the device"}});
    }
    // Layout 7: how long the program's threads waited for the GPU inside the pool, fencing frees
    // themselves and waiting for the reclaimer's fence (those that ran out took fresh memory):
    // where a program slower under gpustitch than under PyTorch's allocator spent that time.
    if (u64(p, "layout_version") == 0 || u64(p, "layout_version") >= 7) {
      auto ms = [&](const char* field) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.1f ms", static_cast<double>(u64(d, field)) / 1e6);
        return std::string(buf);
      };
      line({{"waits for the device",
             std::to_string(u64(d, "fence_syncs")) + " fences on the program's threads (" +
                 ms("fence_sync_ns") + "), " + std::to_string(u64(d, "fence_waits")) +
                 " waits for the reclaimer's fence (" + ms("fence_wait_ns") + ", " +
                 std::to_string(u64(d, "fence_waits_timed_out")) + " ran out)"}});
    }
    // Memory the program maps itself with cuMemCreate/cuMemMap (XLA, expandable segments, NCCL):
    // on the GPU and charged to the process, but not served by the pool and not releasable by it.
    if (u64(p, "layout_version") != 0 && u64(p, "layout_version") < 3) {
      line({{"mapped by the program itself",
             "not reported (record layout " + std::to_string(u64(p, "layout_version")) + ")"}});
    } else {
      line({{"mapped by the program itself", human_bytes(u64(d, "program_held_bytes"))},
            {"handles", std::to_string(u64(d, "program_handles")) + " (" +
                            human_bytes(u64(d, "program_created_bytes")) + ")"},
            {"address mapped", human_bytes(u64(d, "program_mapped_bytes"))}});
    }
    if (u64(d, "coop_requests") + u64(d, "coop_asks") != 0) {
      line({{"coop gave", human_bytes(u64(d, "coop_given_bytes")) + " (" +
                              std::to_string(u64(d, "coop_gives")) + ")"},
            {"received", human_bytes(u64(d, "coop_received_bytes")) + " (" +
                             std::to_string(u64(d, "coop_receives")) + ")"},
            {"asked", std::to_string(u64(d, "coop_asks"))},
            {"requests", std::to_string(u64(d, "coop_requests"))},
            {"dropped", std::to_string(u64(d, "coop_dropped"))}});
    }
    const auto& ha = items(d, "hist_allocs");
    const auto& hl = items(d, "hist_live");
    std::uint64_t most = 0;
    for (const auto& v : ha)
      most = std::max(most, v.is_number_unsigned() ? v.get<std::uint64_t>() : 0);
    if (most) {
      std::cout << "  allocation sizes (since start | live now):\n";
      for (std::size_t i = 0; i < ha.size() && i < hl.size(); ++i) {
        std::uint64_t n = as_u64(ha[i]);
        if (!n) continue;
        int bar = static_cast<int>(std::ceil(30.0 * double(n) / double(most)));
        char buf[64];
        std::snprintf(buf, sizeof buf, "    %-12s %10llu | %-8llu ", bucket_label(int(i)).c_str(),
                      static_cast<unsigned long long>(n),
                      static_cast<unsigned long long>(as_u64(hl[i])));
        std::string b;
        for (int k = 0; k < bar; ++k) b += "\u2587";
        std::cout << buf << b << "\n";
      }
    }
  }
  const auto& events = items(p, "events");
  std::cout << "\nrecent events";
  if (u64(p, "events_dropped")) std::cout << " (" << u64(p, "events_dropped") << " dropped)";
  std::cout << (events.empty() ? ": none\n" : ":\n");
  std::size_t from = events.size() > 20 ? events.size() - 20 : 0;
  for (std::size_t i = from; i < events.size(); ++i) {
    const auto& e = events[i];
    std::string kind = str(e, "kind");
    std::cout << "  " << clock_time(u64(e, "time_ns")) << "  " << kind << "  dev "
              << (member(e, "device").is_number_integer() ? member(e, "device").get<long long>()
                                                          : -1);
    if (kind == "oom")
      std::cout << "  requested " << human_bytes(u64(e, "size")) << ", largest possible "
                << human_bytes(u64(e, "largest_possible")) << ", device free "
                << human_bytes(u64(e, "device_free")) << ", cached "
                << human_bytes(u64(e, "cached")) << ", fragmentation "
                << percent(f64(e, "fragmentation"));
    else if (kind == "stitch")
      std::cout << "  " << human_bytes(u64(e, "size")) << " from " << u64(e, "pieces") << " pieces";
    else if (kind == "trim" || kind == "release")
      std::cout << "  released " << human_bytes(u64(e, "size")) << " (" << u64(e, "pieces")
                << (u64(e, "pieces") == 1 ? " handle)" : " handles)");
    else if (kind == "coop_give")
      std::cout << "  gave " << human_bytes(u64(e, "size")) << " of idle cache to pid "
                << u64(e, "peer_pid");
    else if (kind == "coop_receive")
      std::cout << "  received " << human_bytes(u64(e, "size")) << " released by pid "
                << u64(e, "peer_pid");
    else
      std::cout << "  " << human_bytes(u64(e, "size")) << " peer " << u64(e, "peer_pid");
    std::cout << "\n";
  }
  const auto& sites = items(p, "sites");
  if (!sites.empty()) {
    std::cout << "\ntop allocation sites:\n";
    for (const auto& s : sites) {
      std::cout << "  " << human_bytes(u64(s, "live_bytes")) << " in " << u64(s, "count")
                << " allocations\n";
      for (const auto& f : items(s, "frames"))
        std::cout << "      " << str(f, "function") << " (" << str(f, "library") << "+0x"
                  << std::hex << u64(f, "offset") << std::dec << ")\n";
    }
  }
  const auto& history = items(answer, "history");
  bool any = false;
  for (const auto& h : history) {
    std::string chart = history_chart(h, chart_width);
    if (chart.empty()) continue;
    any = true;
    std::cout << "\nhistory, device " << u64(h, "device") << ":\n" << chart;
  }
  if (!any && source == "direct")
    std::cout << "\n(history needs gpustitchd: it keeps a window per process)\n";
}

Registrar reg{"show", "Details of one process: counters, size histogram, events, history",
              [](CLI::App& sub, GlobalOptions& global) -> std::function<int()> {
                auto opts = std::make_shared<ShowOptions>();
                sub.add_option("pid", opts->pid, "Process id")->required()->check(pid_check());
                add_source_options(sub, opts->source);
                sub.add_option("--history", opts->history_seconds,
                               "Seconds of history to chart (daemon)")
                    ->check(CLI::Range(0u, kMaxHistorySeconds));
                sub.add_option("--width", opts->chart_width, "Chart width in columns")
                    ->check(CLI::Range(8, 1000));
                sub.footer(
                    "Exit status: 0 shown, 3 no such process (or not yours), 4 record or daemon "
                    "unreadable.");
                return [opts, &global]() {
                  Fetched f = fetch_show(opts->source, opts->pid, opts->history_seconds);
                  if (f.status != kOk) {
                    if (global.json)
                      print_json({{"error", f.error}, {"pid", opts->pid}});
                    else
                      std::cerr << "gpustitch show: pid " << opts->pid << ": " << f.error << "\n";
                    return f.status;
                  }
                  if (global.json) {
                    print_json({{"source", f.source},
                                {"process", f.answer["process"]},
                                {"history", items(f.answer, "history")}});
                  } else {
                    print_process(f.answer, f.source, opts->chart_width);
                  }
                  return int(kOk);
                };
              }};

}  // namespace
}  // namespace gpustitch::cli
