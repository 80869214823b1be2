// GPUSTITCH_CONF parsing. See config.h for the policy on bad input.
#include "gpustitch/config.h"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace gpustitch {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\n')) {
    s.remove_prefix(1);
  }
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n')) {
    s.remove_suffix(1);
  }
  return s;
}

bool parse_u64(std::string_view v, std::uint64_t* out) {
  if (v.empty()) return false;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), *out);
  return ec == std::errc() && p == v.data() + v.size();
}

bool parse_double(std::string_view v, double* out) {
  if (v.empty()) return false;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), *out);
  return ec == std::errc() && p == v.data() + v.size();
}

// A count setting: 0 to 65536.
bool parse_count(std::string_view v, unsigned* out) {
  std::uint64_t n;
  if (!parse_u64(v, &n) || n > 65536) return false;
  *out = static_cast<unsigned>(n);
  return true;
}

bool parse_bool(std::string_view v, bool* out) {
  if (v == "on" || v == "true" || v == "1" || v == "yes") return *out = true, true;
  if (v == "off" || v == "false" || v == "0" || v == "no") return *out = false, true;
  return false;
}

// A size in `unit` bytes, with overflow check.
bool parse_scaled(std::string_view v, std::size_t unit, std::size_t* out) {
  std::uint64_t n = 0;
  if (!parse_u64(v, &n) || n > SIZE_MAX / unit) return false;
  *out = static_cast<std::size_t>(n) * unit;
  return true;
}

// A size in MiB, 0 (no limit, or never) or between 2 and 1048576 (max_handle_mb and the like).
bool parse_mb_or_zero(std::string_view v, std::size_t* out) {
  std::size_t s;
  if (!parse_scaled(v, MiB, &s) || (s != 0 && (s < 2 * MiB || s > 1024 * GiB))) return false;
  *out = s;
  return true;
}

struct KeySpec {
  std::string_view key;
  std::string_view expects;  // for the error message
  std::function<bool(std::string_view, Config&)> apply;
};

const std::vector<KeySpec>& key_specs() {
  static const std::vector<KeySpec> specs = {
      {"backend", "cuda, sim or auto",
       [](std::string_view v, Config& c) {
         if (v == "cuda") return c.backend = BackendKind::cuda, true;
         if (v == "sim") return c.backend = BackendKind::sim, true;
         if (v == "auto") return c.backend = BackendKind::automatic, true;
         return false;
       }},
      {"max_split_size_mb", "a size in MiB (>= 1)",
       [](std::string_view v, Config& c) {
         std::size_t s;
         if (!parse_scaled(v, MiB, &s) || s == 0) return false;
         return c.max_split_size = s, true;
       }},
      {"release_threshold_mb", "a size in MiB",
       [](std::string_view v, Config& c) { return parse_scaled(v, MiB, &c.release_threshold); }},
      {"arenas", "a count between 0 and 8 (0 = one per core)",
       [](std::string_view v, Config& c) {
         std::uint64_t n;
         if (!parse_u64(v, &n) || n > kMaxArenas) return false;
         return c.arenas = static_cast<unsigned>(n), true;
       }},
      {"small_limit_kb", "a size in KiB between 1 and 16384",
       [](std::string_view v, Config& c) {
         std::size_t s;
         if (!parse_scaled(v, KiB, &s) || s < KiB || s > 16 * MiB) return false;
         return c.small_limit = s, true;
       }},
      {"cap_mb", "a size in MiB",
       [](std::string_view v, Config& c) { return parse_scaled(v, MiB, &c.cap); }},
      {"cap_fraction", "a fraction between 0 and 1",
       [](std::string_view v, Config& c) {
         double f;
         if (!parse_double(v, &f) || !(f >= 0.0 && f <= 1.0)) return false;
         return c.cap_fraction = f, true;
       }},
      {"segment_mb", "a size in MiB between 2 and 1048576",
       [](std::string_view v, Config& c) {
         std::size_t s;
         if (!parse_scaled(v, MiB, &s) || s < 2 * MiB || s > 1024 * GiB) return false;
         return c.segment_size = s, true;
       }},
      {"fresh_handles", "a count between 0 and 65536 (0 = no limit)",
       [](std::string_view v, Config& c) { return parse_count(v, &c.fresh_handles); }},
      {"max_handle_mb", "a size in MiB, 0 (no limit) or between 2 and 1048576",
       [](std::string_view v, Config& c) { return parse_mb_or_zero(v, &c.max_handle); }},
      {"fresh_coarse_mb", "a size in MiB, 0 (never) or between 2 and 1048576",
       [](std::string_view v, Config& c) { return parse_mb_or_zero(v, &c.fresh_coarse); }},
      {"stream_fresh_coarse_mb", "a size in MiB, 0 (as fresh_coarse_mb) or between 2 and 1048576",
       [](std::string_view v, Config& c) { return parse_mb_or_zero(v, &c.stream_fresh_coarse); }},
      {"handle_share", "a count between 0 and 65536 (0 = no limit)",
       [](std::string_view v, Config& c) { return parse_count(v, &c.handle_share); }},
      {"gap_handles", "a count between 0 and 65536 (0 = no limit)",
       [](std::string_view v, Config& c) { return parse_count(v, &c.gap_handles); }},
      {"size_ranges", "on or off",
       [](std::string_view v, Config& c) { return parse_bool(v, &c.size_ranges); }},
      {"memory_first_mb", "a size in MiB, 0 (never) or between 2 and 1048576",
       [](std::string_view v, Config& c) { return parse_mb_or_zero(v, &c.memory_first); }},
      {"stitching", "on or off",
       [](std::string_view v, Config& c) { return parse_bool(v, &c.stitching); }},
      {"reclaim", "thread, inline or ordered",
       [](std::string_view v, Config& c) {
         if (v != "thread" && v != "inline" && v != "ordered") return false;
         c.background_reclaim = v != "inline";
         c.ordered_fences = v == "ordered";
         return true;
       }},
      {"grow_slack_pct", "a percentage between 0 and 100",
       [](std::string_view v, Config& c) {
         std::uint64_t n;
         if (!parse_u64(v, &n) || n > 100) return false;
         return c.grow_slack_pct = static_cast<unsigned>(n), true;
       }},
      {"unmap", "background, inline or lazy",
       [](std::string_view v, Config& c) {
         if (v == "background") return c.unmap = Config::Unmap::background, true;
         if (v == "inline") return c.unmap = Config::Unmap::inline_, true;
         if (v == "lazy") return c.unmap = Config::Unmap::lazy, true;
         return false;
       }},
      {"driver_pool_release", "on or off",
       [](std::string_view v, Config& c) { return parse_bool(v, &c.driver_pool_release); }},
      {"stream_miss_fence", "on or off",
       [](std::string_view v, Config& c) { return parse_bool(v, &c.stream_miss_fence); }},
      {"stream_cut_fence", "on or off",
       [](std::string_view v, Config& c) { return parse_bool(v, &c.stream_cut_fence); }},
      {"stream_cut_wait", "on or off",
       [](std::string_view v, Config& c) { return parse_bool(v, &c.stream_cut_wait); }},
      {"large_cache_mb", "a size in MiB (0 = off)",
       [](std::string_view v, Config& c) { return parse_scaled(v, MiB, &c.large_cache); }},
      {"sim_capacity_mb", "a size in MiB (>= 1)",
       [](std::string_view v, Config& c) {
         std::size_t s;
         if (!parse_scaled(v, MiB, &s) || s == 0) return false;
         return c.sim_capacity = s, true;
       }},
      {"sim_granularity_kb", "a power of two in KiB, at least 4",
       [](std::string_view v, Config& c) {
         std::size_t s;
         if (!parse_scaled(v, KiB, &s) || s < 4 * KiB || (s & (s - 1)) != 0) return false;
         return c.sim_granularity = s, true;
       }},
      {"sim_devices", "a device count between 1 and 16",
       [](std::string_view v, Config& c) {
         std::uint64_t n;
         if (!parse_u64(v, &n) || n < 1 || n > 16) return false;
         return c.sim_devices = static_cast<int>(n), true;
       }},
      {"sim_map_offset", "on or off",
       [](std::string_view v, Config& c) { return parse_bool(v, &c.sim_map_offset); }},
      {"sim_shared", "a name of letters, digits, '_', '-' or '.' (at most 64)",
       [](std::string_view v, Config& c) {
         if (v.empty() || v.size() > 64) return false;
         for (char ch : v) {
           const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                           (ch >= '0' && ch <= '9') || ch == '_' || ch == '-' || ch == '.';
           if (!ok) return false;
         }
         return c.sim_shared = std::string(v), true;
       }},
      {"enable", "on or off",
       [](std::string_view v, Config& c) { return parse_bool(v, &c.enabled); }},
      {"ipc", "native or pool",
       [](std::string_view v, Config& c) {
         if (v == "native") return c.ipc_native = true, true;
         if (v == "pool") return c.ipc_native = false, true;
         return false;
       }},
      {"trace", "a file path",
       [](std::string_view v, Config& c) {
         if (v.empty()) return false;
         return c.trace_path = std::string(v), true;
       }},
      {"trace_events", "a count of events between 0 (off) and 10000000",
       [](std::string_view v, Config& c) {
         std::uint64_t n;
         if (!parse_u64(v, &n) || n > 10000000) return false;
         return c.trace_events = static_cast<std::size_t>(n), true;
       }},
      {"log_level", "trace, debug, info, warn, error or off",
       [](std::string_view v, Config& c) {
         for (std::string_view l : {"trace", "debug", "info", "warn", "error", "off"}) {
           if (v == l) return c.log_level = std::string(v), true;
         }
         return false;
       }},
      {"summary", "on or off",
       [](std::string_view v, Config& c) { return parse_bool(v, &c.summary); }},
      {"publish", "on or off",
       [](std::string_view v, Config& c) { return parse_bool(v, &c.publish); }},
      {"publish_interval_ms", "milliseconds between 10 and 60000",
       [](std::string_view v, Config& c) {
         std::uint64_t n;
         if (!parse_u64(v, &n) || n < 10 || n > 60000) return false;
         return c.publish_interval_ms = static_cast<unsigned>(n), true;
       }},
      {"sites_min_mb", "a size in MiB (0 = off)",
       [](std::string_view v, Config& c) { return parse_scaled(v, MiB, &c.sites_min_size); }},
      {"sites_sample", "a sampling period K (1 in K; 0 = off)",
       [](std::string_view v, Config& c) {
         std::uint64_t n;
         if (!parse_u64(v, &n) || n > UINT32_MAX) return false;
         return c.sites_sample = static_cast<unsigned>(n), true;
       }},
      {"coop", "on or off", [](std::string_view v, Config& c) { return parse_bool(v, &c.coop); }},
      {"program_vmm", "serve or count",
       [](std::string_view v, Config& c) {
         if (v == "serve") return c.serve_program_vmm = true, true;
         if (v == "count") return c.serve_program_vmm = false, true;
         return false;
       }},
      {"coop_wait_ms", "milliseconds between 0 and 5000",
       [](std::string_view v, Config& c) {
         std::uint64_t n;
         if (!parse_u64(v, &n) || n > 5000) return false;
         return c.coop_wait_ms = static_cast<unsigned>(n), true;
       }},
      {"coop_rate", "releases per second between 1 and 1000",
       [](std::string_view v, Config& c) {
         std::uint64_t n;
         if (!parse_u64(v, &n) || n < 1 || n > 1000) return false;
         return c.coop_rate = static_cast<unsigned>(n), true;
       }},
  };
  return specs;
}

// Edit distance (insertions, deletions, substitutions, adjacent transpositions) between two
// short keys; keys are at most a few dozen characters, so the quadratic table is tiny.
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i)
    for (std::size_t j = 1; j <= b.size(); ++j) {
      std::size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

// The known key an unknown one most likely meant: the closest by edit distance, when it is
// within a third of the key's length (at least 2), or the one the unknown key is a prefix or a
// unit-less form of ("max_split_size" for max_split_size_mb). Empty when nothing is close.
std::string nearest_key(std::string_view key) {
  if (key.empty() || key.size() > 64) return {};
  std::string_view best;
  std::size_t best_distance = std::max<std::size_t>(2, key.size() / 3) + 1;
  for (const auto& s : key_specs()) {
    std::string_view k = s.key;
    std::size_t dist = edit_distance(key, k);
    if (key.size() >= 4 && k.substr(0, key.size()) == key) dist = std::min<std::size_t>(dist, 1);
    if (dist < best_distance) {
      best_distance = dist;
      best = k;
    }
  }
  return std::string(best);
}

}  // namespace

ConfigResult parse_config(std::string_view text, const Config& base) {
  ConfigResult result{base, {}};
  std::size_t pos = 0;
  while (pos <= text.size()) {
    std::size_t comma = text.find(',', pos);
    if (comma == std::string_view::npos) comma = text.size();
    std::string_view entry = trim(text.substr(pos, comma - pos));
    pos = comma + 1;
    if (entry.empty()) continue;
    std::size_t colon = entry.find(':');
    if (colon == std::string_view::npos) {
      result.errors.push_back("GPUSTITCH_CONF: entry '" + std::string(entry) +
                              "' is not key:value; ignored");
      continue;
    }
    std::string_view key = trim(entry.substr(0, colon));
    std::string_view value = trim(entry.substr(colon + 1));
    const KeySpec* spec = nullptr;
    for (const auto& s : key_specs()) {
      if (s.key == key) spec = &s;
    }
    if (spec == nullptr) {
      std::string suggestion = nearest_key(key);
      result.errors.push_back("GPUSTITCH_CONF: unknown key '" + std::string(key) + "'" +
                              (suggestion.empty() ? "" : " (did you mean " + suggestion + "?)") +
                              "; ignored");
      continue;
    }
    Config trial = result.config;
    if (!spec->apply(value, trial)) {
      result.errors.push_back("GPUSTITCH_CONF: " + std::string(key) + ": '" + std::string(value) +
                              "' is not " + std::string(spec->expects) + "; ignored");
      continue;
    }
    result.config = std::move(trial);
  }
  return result;
}

ConfigResult config_from_env() {
  const char* text = std::getenv("GPUSTITCH_CONF");
  return parse_config(text == nullptr ? std::string_view{} : std::string_view{text});
}

std::vector<std::string_view> config_keys() {
  std::vector<std::string_view> keys;
  for (const auto& s : key_specs()) keys.push_back(s.key);
  return keys;
}

}  // namespace gpustitch
