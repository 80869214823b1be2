// run_tune: the sweep, the bisections and the answer. See tune.h for what is measured and how
// the answer is chosen.
#include "tune.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <thread>
#include <tuple>

#include "caching_policy.h"

namespace gpustitch::replay {

namespace {

std::string gib(std::uint64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(b) / static_cast<double>(GiB));
  return buf;
}

std::string caching_conf(const CachingOptions& o) {
  std::string conf;
  auto add = [&](const std::string& item) { conf += (conf.empty() ? "" : ",") + item; };
  if (o.max_split_size != SIZE_MAX)
    add("max_split_size_mb:" + std::to_string(o.max_split_size / MiB));
  if (o.roundup_power2_divisions > 1)
    add("roundup_power2_divisions:" + std::to_string(o.roundup_power2_divisions));
  if (o.garbage_collection_threshold > 0) {
    char buf[48];
    std::snprintf(buf, sizeof buf, "garbage_collection_threshold:%g",
                  o.garbage_collection_threshold);
    add(buf);
  }
  return conf;
}

TuneSetting caching_setting(const CachingOptions& o) {
  TuneSetting s;
  s.conf = caching_conf(o);
  s.label = s.conf.empty() ? "default" : s.conf;
  s.family = TuneFamily::pytorch;
  std::string label = s.label;
  s.make = [o, label](const PolicyEnv& env, std::string*) -> std::unique_ptr<ReplayPolicy> {
    return std::make_unique<CachingPolicy>(label, env, o);
  };
  return s;
}

TuneSetting registered_setting(const std::string& label, TuneFamily family, const std::string& conf,
                               const std::string& policy, const std::string& pool_conf) {
  TuneSetting s{label, family, conf, nullptr};
  s.make = [policy, pool_conf](const PolicyEnv& env,
                               std::string* why) -> std::unique_ptr<ReplayPolicy> {
    const PolicySpec* spec = find_policy(policy);
    if (spec == nullptr) {
      if (why) *why = "policy " + policy + " is not built in";
      return nullptr;
    }
    PolicyEnv e = env;
    e.pool_conf = pool_conf;
    return spec->make(e, why);
  };
  return s;
}

// The options a caching-model setting was made from, recovered from its conf (for combining).
CachingOptions parse_caching_conf(const std::string& conf) {
  CachingOptions o;
  std::size_t at = 0;
  while (at < conf.size()) {
    std::size_t end = conf.find(',', at);
    std::string item = conf.substr(at, end == std::string::npos ? std::string::npos : end - at);
    std::size_t colon = item.find(':');
    if (colon != std::string::npos) {
      std::string key = item.substr(0, colon), value = item.substr(colon + 1);
      if (key == "max_split_size_mb") o.max_split_size = std::stoull(value) * MiB;
      if (key == "roundup_power2_divisions") o.roundup_power2_divisions = std::stoull(value);
      if (key == "garbage_collection_threshold") o.garbage_collection_threshold = std::stod(value);
    }
    if (end == std::string::npos) break;
    at = end + 1;
  }
  return o;
}

struct Measurer {
  const trace::Trace& trace;
  PolicyEnv env;
  std::uint64_t resolution;
  std::size_t max_points;

  // Replays through the setting at capacity; null result policy name when it cannot be made.
  bool replay(const TuneSetting& s, std::uint64_t capacity, bool stop_at_oom, ReplayResult* out,
              std::string* why) const {
    PolicyEnv e = env;
    e.capacity = capacity;
    auto policy = s.make(e, why);
    if (!policy) return false;
    *out = replay_trace(trace, *policy, ReplayOptions{stop_at_oom ? 16 : max_points, stop_at_oom});
    return true;
  }
  bool fits(const TuneSetting& s, std::uint64_t capacity) const {
    ReplayResult r;
    std::string why;
    return replay(s, capacity, true, &r, &why) && r.ooms == 0;
  }

  TuneRow measure(const TuneSetting& s, std::uint64_t capacity) const {
    TuneRow row;
    row.setting = s;
    std::string why;
    if (!replay(s, capacity, false, &row.at_capacity, &why)) {
      row.at_capacity.policy = s.label + " (unavailable: " + why + ")";
      return row;
    }
    row.at_capacity.policy = s.label;
    const std::uint64_t live = row.at_capacity.peak_allocated;
    std::uint64_t lo = live > 0 ? live - 1 : 0;  // below the live bytes nothing fits
    std::uint64_t hi = 0;
    if (row.at_capacity.ooms == 0) {
      hi = capacity;
      const std::uint64_t peak = row.at_capacity.peak_reserved;
      if (peak >= live && peak < hi && fits(s, peak)) hi = peak;
    } else {
      // Beyond the capacity: as much as the trace could want, so that the reserved peak there is
      // what the setting needs without pressure.
      const std::uint64_t big = std::max<std::uint64_t>(4 * capacity, 8 * std::max(live, GiB));
      ReplayResult free_run;
      row.largest_tried = big;
      if (!replay(s, big, false, &free_run, &why) || free_run.ooms > 0) return row;
      hi = big;
      if (free_run.peak_reserved >= live && fits(s, free_run.peak_reserved))
        hi = free_run.peak_reserved;
    }
    while (hi > lo && hi - lo > resolution) {
      const std::uint64_t mid = lo + (hi - lo) / 2;
      if (fits(s, mid)) {
        hi = mid;
      } else {
        lo = mid;
      }
    }
    row.min_capacity = hi;
    row.largest_tried = std::max(row.largest_tried, capacity);
    return row;
  }
};

void measure_all(const Measurer& m, const std::vector<TuneSetting>& settings,
                 std::uint64_t capacity, unsigned jobs, std::size_t done_before, std::size_t total,
                 const TuneOptions& options, std::vector<TuneRow>* rows) {
  const std::size_t first = rows->size();
  rows->resize(first + settings.size());
  std::atomic<std::size_t> next{0};
  std::mutex mu;
  std::size_t done = done_before;
  auto worker = [&]() {
    for (std::size_t i = next++; i < settings.size(); i = next++) {
      TuneRow row = m.measure(settings[i], capacity);
      std::lock_guard<std::mutex> lock(mu);
      (*rows)[first + i] = std::move(row);
      ++done;
      if (options.progress) options.progress(done, total, settings[i].label);
    }
  };
  std::vector<std::thread> threads;
  const unsigned n = std::max(1u, std::min<unsigned>(jobs, static_cast<unsigned>(settings.size())));
  for (unsigned t = 1; t < n; ++t) threads.emplace_back(worker);
  worker();
  for (auto& t : threads) t.join();
}

// Lexicographic rank: no OOM at the capacity, smallest device (none found: last), peak
// reserved, then the sweep's order (simpler settings and smaller values first). The measured
// cost is not ranked on: it is host timing, and equal settings differ in it by tens of percent
// from run to run.
auto rank_key(const std::vector<TuneRow>& rows, std::size_t i) {
  const TuneRow& r = rows[i];
  return std::make_tuple(r.at_capacity.ooms > 0, r.min_capacity == 0 ? UINT64_MAX : r.min_capacity,
                         r.at_capacity.peak_reserved, i);
}

}  // namespace

std::vector<std::uint64_t> max_split_scan_mb(std::uint64_t peak_reserved) {
  std::vector<std::uint64_t> mb;
  const double peak_mb = static_cast<double>(peak_reserved) / static_cast<double>(MiB);
  for (int k = 0; k <= 4; ++k) {
    const auto v = static_cast<std::uint64_t>(std::llround(peak_mb / 4 * std::pow(2.0, k / 2.0)));
    if (v > 20) mb.push_back(v);
  }
  for (std::uint64_t v = 32; v <= 4096; v *= 2) mb.push_back(v);
  std::sort(mb.begin(), mb.end());
  mb.erase(std::unique(mb.begin(), mb.end()), mb.end());
  return mb;
}

std::vector<TuneSetting> default_sweep(std::uint64_t peak_reserved) {
  std::vector<TuneSetting> s;
  s.push_back(caching_setting({}));
  for (std::uint64_t mb : max_split_scan_mb(peak_reserved))
    s.push_back(caching_setting({mb * MiB, 0, 0}));
  for (double t : {0.6, 0.8}) s.push_back(caching_setting({SIZE_MAX, 0, t}));
  for (std::size_t d : {2, 4, 8, 16}) s.push_back(caching_setting({SIZE_MAX, d, 0}));
  s.push_back(registered_setting("expandable_segments:True", TuneFamily::pytorch,
                                 "expandable_segments:True", "expandable-segments", ""));
  s.push_back(registered_setting("gpustitch", TuneFamily::gpustitch, "", "gpustitch", ""));
  s.push_back(registered_setting("gpustitch stitching:off", TuneFamily::gpustitch, "stitching:off",
                                 "gpustitch-no-stitch", ""));
  for (const char* conf : {"fresh_handles:16", "fresh_handles:256", "small_limit_kb:64",
                           "small_limit_kb:1024", "size_ranges:on,handle_share:1024,gap_handles:0"})
    s.push_back(registered_setting(std::string("gpustitch ") + conf, TuneFamily::gpustitch, conf,
                                   "gpustitch", conf));
  return s;
}

TuneAnswer decide(const std::vector<TuneRow>& rows, std::uint64_t capacity,
                  std::uint64_t resolution, std::uint64_t peak_allocated) {
  TuneAnswer a;
  std::vector<std::size_t> pytorch, stitch;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    (rows[i].setting.family == TuneFamily::pytorch ? pytorch : stitch).push_back(i);
    if (rows[i].setting.label == "default") a.default_row = i;
  }
  auto best_of = [&](const std::vector<std::size_t>& idx) {
    std::size_t best = idx.front();
    for (std::size_t i : idx)
      if (rank_key(rows, i) < rank_key(rows, best)) best = i;
    return best;
  };
  const TuneRow& def = rows[a.default_row];
  std::size_t best = pytorch.empty() ? a.default_row : best_of(pytorch);
  if (!stitch.empty()) a.best_gpustitch = best_of(stitch);
  const TuneRow& b = rows[best];
  auto needs = [&](const TuneRow& r) {
    return r.min_capacity ? gib(r.min_capacity) : "more than " + gib(r.largest_tried);
  };
  auto saves = [&](std::uint64_t from, std::uint64_t to) {
    return from > to && from - to > resolution;
  };
  const bool avoids = def.at_capacity.ooms > 0 && b.at_capacity.ooms == 0;
  const bool smaller = (def.min_capacity == 0 && b.min_capacity != 0) ||
                       (b.min_capacity != 0 && saves(def.min_capacity, b.min_capacity)) ||
                       (b.at_capacity.ooms == 0 &&
                        saves(def.at_capacity.peak_reserved, b.at_capacity.peak_reserved));
  a.recommended = (best != a.default_row && (avoids || smaller)) ? best : a.default_row;
  const TuneRow& rec = rows[a.recommended];
  a.alloc_conf = rec.setting.conf;
  const std::string line = "PYTORCH_CUDA_ALLOC_CONF=" + rec.setting.conf;

  bool any_fits = false, pytorch_fits = false;
  for (std::size_t i = 0; i < rows.size(); ++i)
    if (rows[i].at_capacity.ooms == 0) {
      any_fits = true;
      if (rows[i].setting.family == TuneFamily::pytorch) pytorch_fits = true;
    }
  std::string s;
  if (!any_fits) {
    a.verdict = TuneVerdict::short_of_memory;
    std::uint64_t smallest = 0;
    std::string who;
    for (const auto& r : rows)
      if (r.min_capacity && (smallest == 0 || r.min_capacity < smallest)) {
        smallest = r.min_capacity;
        who = r.setting.label;
      }
    s = "Nothing helps: no setting runs this trace on a " + gib(capacity) +
        " device without out-of-memory. The job holds up to " + gib(peak_allocated) +
        " live at once" + (peak_allocated > capacity ? ", more than the device has" : "") + ". ";
    if (smallest)
      s += "The smallest device any setting runs it on is " + gib(smallest) + " (" + who +
           "), short by " + gib(smallest - capacity) + ". ";
    s += "Reduce what it holds (batch size, sequence length, activation checkpointing) or use a "
         "larger device.";
  } else if (!pytorch_fits) {
    a.verdict = TuneVerdict::only_gpustitch_fits;
    const TuneRow& g = rows[a.best_gpustitch];
    s = "No PYTORCH_CUDA_ALLOC_CONF setting runs this trace on a " + gib(capacity) +
        " device (the best, " + b.setting.label + ", needs " + needs(b) + "); gpustitch (" +
        g.setting.label + ") does: it needs " + needs(g) + ".";
  } else if (a.recommended == a.default_row) {
    a.verdict = TuneVerdict::default_is_best;
    s = "Keep PyTorch's default: no setting saves more than the bisection's precision (" +
        gib(resolution) + "); it needs a " + needs(def) + " device and reserves at most " +
        gib(def.at_capacity.peak_reserved) + ".";
  } else {
    a.verdict = avoids ? TuneVerdict::setting_avoids_oom : TuneVerdict::setting_saves;
    if (avoids) {
      const auto n = def.at_capacity.ooms;
      s = line + " avoids the " + std::to_string(n) +
          (n == 1 ? " out-of-memory error" : " out-of-memory errors") + " the default hits on a " +
          gib(capacity) + " device: it needs " + needs(rec) + " (the default " + needs(def) + ").";
    } else {
      s = line + " needs a " + needs(rec) + " device instead of the default's " + needs(def);
      if (def.min_capacity && rec.min_capacity) {
        char pct[32];
        std::snprintf(pct, sizeof pct, "%.1f%%",
                      100.0 * static_cast<double>(def.min_capacity - rec.min_capacity) /
                          static_cast<double>(def.min_capacity));
        s += " (saves " + gib(def.min_capacity - rec.min_capacity) + ", " + pct + ")";
      }
      s += "; peak reserved " + gib(rec.at_capacity.peak_reserved) + " instead of " +
           gib(def.at_capacity.peak_reserved) + ".";
    }
    if (rec.setting.conf.find("garbage_collection_threshold") != std::string::npos)
      s += " PyTorch applies garbage_collection_threshold only under "
           "torch.cuda.set_per_process_memory_fraction; the model takes the capacity as that "
           "limit.";
  }
  if (a.best_gpustitch != SIZE_MAX && a.verdict != TuneVerdict::only_gpustitch_fits) {
    const TuneRow& g = rows[a.best_gpustitch];
    s += " gpustitch (" + g.setting.label + "): needs " + needs(g) + ", peak reserved " +
         gib(g.at_capacity.peak_reserved) + ", " + std::to_string(g.at_capacity.ooms) +
         " OOMs at " + gib(capacity) + ".";
  }
  a.summary = s;
  return a;
}

TuneReport run_tune(const trace::Trace& trace, const TuneOptions& options) {
  TuneReport rep;
  rep.capacity = options.capacity;
  Measurer m{trace, PolicyEnv{}, 0, options.max_points};
  m.env.devices = trace.device_count();
  // The default's unconstrained peak sizes the max_split_size_mb scan and the resolution.
  const TuneSetting def = caching_setting({});
  ReplayResult free_run;
  std::string why;
  const std::uint64_t big = std::max<std::uint64_t>(4 * options.capacity, 1024 * GiB);
  m.replay(def, big, false, &free_run, &why);
  rep.peak_allocated = free_run.peak_allocated;
  rep.resolution = options.resolution
                       ? options.resolution
                       : std::max<std::uint64_t>(2 * MiB, align_up(rep.peak_allocated / 200, MiB));
  m.resolution = rep.resolution;

  std::vector<TuneSetting> settings = default_sweep(free_run.peak_reserved);
  measure_all(m, settings, options.capacity, options.jobs, 0, settings.size(), options, &rep.rows);

  // Combine the best value of each caching-model knob that beat the default on its own.
  auto improves = [&](const TuneRow& r, const TuneRow& d) {
    return std::make_tuple(r.at_capacity.ooms > 0, r.min_capacity ? r.min_capacity : UINT64_MAX,
                           r.at_capacity.peak_reserved) <
           std::make_tuple(d.at_capacity.ooms > 0, d.min_capacity ? d.min_capacity : UINT64_MAX,
                           d.at_capacity.peak_reserved);
  };
  const TuneRow& d = rep.rows.front();
  const TuneRow* best_knob[3] = {nullptr, nullptr, nullptr};
  for (std::size_t i = 0; i < rep.rows.size(); ++i) {
    const TuneRow& r = rep.rows[i];
    if (r.setting.family != TuneFamily::pytorch || r.setting.conf.find(',') != std::string::npos)
      continue;
    int knob = r.setting.conf.rfind("max_split", 0) == 0 ? 0
               : r.setting.conf.rfind("roundup", 0) == 0 ? 1
               : r.setting.conf.rfind("garbage", 0) == 0 ? 2
                                                         : -1;
    if (knob < 0 || !improves(r, d)) continue;
    if (best_knob[knob] == nullptr ||
        rank_key(rep.rows, i) <
            rank_key(rep.rows, static_cast<std::size_t>(best_knob[knob] - rep.rows.data())))
      best_knob[knob] = &r;
  }
  std::vector<CachingOptions> parts;
  for (const TuneRow* r : best_knob)
    if (r) parts.push_back(parse_caching_conf(r->setting.conf));
  std::vector<TuneSetting> combos;
  auto merge = [](std::initializer_list<const CachingOptions*> list) {
    CachingOptions o;
    for (const CachingOptions* p : list) {
      if (p->max_split_size != SIZE_MAX) o.max_split_size = p->max_split_size;
      if (p->roundup_power2_divisions > 1) o.roundup_power2_divisions = p->roundup_power2_divisions;
      if (p->garbage_collection_threshold > 0)
        o.garbage_collection_threshold = p->garbage_collection_threshold;
    }
    return o;
  };
  for (std::size_t i = 0; i < parts.size(); ++i)
    for (std::size_t j = i + 1; j < parts.size(); ++j)
      combos.push_back(caching_setting(merge({&parts[i], &parts[j]})));
  if (parts.size() == 3)
    combos.push_back(caching_setting(merge({&parts[0], &parts[1], &parts[2]})));
  const std::size_t total_now = settings.size() + combos.size();
  if (!combos.empty())
    measure_all(m, combos, options.capacity, options.jobs, settings.size(), total_now, options,
                &rep.rows);
  const double base = rep.rows.front().at_capacity.ns_per_op;
  for (auto& r : rep.rows) r.relative_cost = base > 0 ? r.at_capacity.ns_per_op / base : 1;
  rep.answer = decide(rep.rows, rep.capacity, rep.resolution, rep.peak_allocated);
  return rep;
}

}  // namespace gpustitch::replay
