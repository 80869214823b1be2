// SiteSampler: per-call-site attribution of live device memory. See site_sampler.h.
#include "gpustitch/sites/site_sampler.h"

#include <cxxabi.h>
#include <dlfcn.h>
#include <unwind.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace gpustitch::sites {

namespace {

using UnwBacktrace = int (*)(void**, int);
std::once_flag g_unwinder_once;
UnwBacktrace g_unw_backtrace = nullptr;

void load_unwinder() {
  std::call_once(g_unwinder_once, [] {
    void* h = dlopen("libunwind.so.8", RTLD_LAZY | RTLD_LOCAL);
    if (h != nullptr) g_unw_backtrace = reinterpret_cast<UnwBacktrace>(dlsym(h, "unw_backtrace"));
  });
}

struct GccState {
  void** pcs;
  int max;
  int n;
};

_Unwind_Reason_Code gcc_step(struct _Unwind_Context* ctx, void* arg) {
  auto* st = static_cast<GccState*>(arg);
  if (st->n >= st->max) return _URC_END_OF_STACK;
  _Unwind_Ptr ip = _Unwind_GetIP(ctx);
  if (ip == 0) return _URC_END_OF_STACK;
  st->pcs[st->n++] = reinterpret_cast<void*>(ip);
  return _URC_NO_REASON;
}

std::uint64_t hash_pcs(void* const* pcs, int n) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a over the addresses
  for (int i = 0; i < n; ++i) {
    auto v = reinterpret_cast<std::uintptr_t>(pcs[i]);
    for (int b = 0; b < 8; ++b) {
      h ^= (v >> (8 * b)) & 0xff;
      h *= 1099511628211ull;
    }
  }
  return h ? h : 1;
}

std::string demangle(const char* name) {
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  if (status == 0 && d != nullptr) {
    std::string out(d);
    std::free(d);
    return out;
  }
  return name;
}

// The shared object the sampler lives in (null when it is the main program).
const void* own_object_base() {
  static const void* base = [] {
    Dl_info info;
    if (dladdr(reinterpret_cast<void*>(&hash_pcs), &info) == 0)
      return static_cast<const void*>(nullptr);
    Dl_info main_info;
    void* main_sym = dlsym(RTLD_DEFAULT, "main");
    if (main_sym != nullptr && dladdr(main_sym, &main_info) != 0 &&
        main_info.dli_fbase == info.dli_fbase)
      return static_cast<const void*>(nullptr);
    return static_cast<const void*>(info.dli_fbase);
  }();
  return base;
}

bool internal_frame(void* pc, const SiteFrame& f) {
  if (const void* own = own_object_base()) {
    Dl_info info;
    if (dladdr(static_cast<char*>(pc) - 1, &info) != 0 && info.dli_fbase == own) return true;
  }
  return f.function.rfind("gpustitch::", 0) == 0;
}

thread_local unsigned t_countdown = 0;
// The allocation this thread sampled last while on_allocate reports it (see last_sampled_site):
// cleared on every allocation, so a stale entry never names a later, unsampled one.
thread_local DevPtr t_last_ptr = 0;
thread_local std::uint64_t t_last_site = 0;

}  // namespace

int capture_stack(void** pcs, int max) noexcept {
  if (max <= 0) return 0;
  if (g_unw_backtrace != nullptr) {
    int n = g_unw_backtrace(pcs, max);
    return n < 0 ? 0 : n;
  }
  GccState st{pcs, max, 0};
  _Unwind_Backtrace(gcc_step, &st);
  return st.n;
}

const char* SiteSampler::unwinder() noexcept {
  load_unwinder();
  return g_unw_backtrace != nullptr ? "libunwind" : "libgcc";
}

SiteFrame symbolize(void* pc) {
  SiteFrame f;
  Dl_info info;
  // pc is a return address: look up pc-1 so a call at the end of a function names that function.
  void* lookup = static_cast<char*>(pc) - 1;
  if (dladdr(lookup, &info) != 0) {
    if (info.dli_fname != nullptr) {
      const char* slash = std::strrchr(info.dli_fname, '/');
      f.library = slash ? slash + 1 : info.dli_fname;
    }
    f.offset =
        reinterpret_cast<std::uintptr_t>(pc) - reinterpret_cast<std::uintptr_t>(info.dli_fbase);
    if (info.dli_sname != nullptr) f.function = demangle(info.dli_sname);
  }
  if (f.function.empty()) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "0x%llx",
                  static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(pc)));
    f.function = buf;
  }
  return f;
}

std::unique_ptr<SiteSampler> make_site_sampler(const Config& config) {
  if (config.sites_min_size == 0 && config.sites_sample == 0) return nullptr;
  SiteSamplerOptions o;
  o.min_size = config.sites_min_size;
  o.sample_every = config.sites_sample;
  return std::make_unique<SiteSampler>(o);
}

SiteSampler::SiteSampler(SiteSamplerOptions options) : options_(options) {
  options_.max_depth = std::clamp(options_.max_depth, 1, 128);
  load_unwinder();
  (void)own_object_base();
}

SiteSampler::~SiteSampler() = default;

bool SiteSampler::should_sample(std::size_t size) noexcept {
  if (options_.min_size != 0 && size >= options_.min_size) return true;
  if (options_.sample_every != 0) {
    if (t_countdown == 0) t_countdown = options_.sample_every;
    if (--t_countdown == 0) return true;
  }
  return false;
}

void SiteSampler::on_allocate(int, DevPtr ptr, std::size_t size, Stream, ServedBy) noexcept {
  t_last_ptr = 0;
  if (!should_sample(size)) return;
  // Start the stack at our caller: the frames of capture_stack and of this function are dropped
  // by finding our own return address among the first few captured ones.
  void* const caller = __builtin_return_address(0);
  void* raw[130];
  int n = capture_stack(raw, options_.max_depth + 2);
  int first = 0;
  for (int i = 0; i < n && i < 4; ++i) {
    if (raw[i] == caller) {
      first = i;
      break;
    }
  }
  void** pcs = raw + first;
  n = std::min(n - first, options_.max_depth);
  std::uint64_t h = hash_pcs(pcs, n);
  try {
    {
      std::lock_guard lock(sites_mu_);
      Site& s = sites_[h];
      if (s.pcs.empty()) s.pcs.assign(pcs, pcs + n);
      s.live_bytes += size;
      s.live_count += 1;
      s.total_bytes += size;
      s.total_count += 1;
    }
    Shard& sh = shards_[(ptr >> 9) % kShards];
    std::lock_guard lock(sh.mu);
    auto [it, inserted] = sh.live.insert_or_assign(ptr, LiveEntry{h, size});
    (void)it;
    if (inserted) live_sampled_.fetch_add(1, std::memory_order_relaxed);
  } catch (...) {
    // Out of host memory: this allocation goes unattributed; the program is unaffected.
  }
  sampled_.fetch_add(1, std::memory_order_relaxed);
  t_last_ptr = ptr;
  t_last_site = h;
}

std::uint64_t SiteSampler::last_sampled_site(DevPtr ptr) noexcept {
  return t_last_ptr == ptr && ptr != 0 ? t_last_site : 0;
}

void SiteSampler::on_free(int, DevPtr ptr, std::size_t, Stream) noexcept {
  if (live_sampled_.load(std::memory_order_relaxed) == 0) return;
  LiveEntry e;
  {
    Shard& sh = shards_[(ptr >> 9) % kShards];
    std::lock_guard lock(sh.mu);
    auto it = sh.live.find(ptr);
    if (it == sh.live.end()) return;
    e = it->second;
    sh.live.erase(it);
  }
  live_sampled_.fetch_sub(1, std::memory_order_relaxed);
  std::lock_guard lock(sites_mu_);
  auto it = sites_.find(e.site);
  if (it != sites_.end()) {
    it->second.live_bytes -= std::min<std::uint64_t>(it->second.live_bytes, e.size);
    it->second.live_count -= std::min<std::uint64_t>(it->second.live_count, 1);
  }
}

const std::vector<SiteFrame>& SiteSampler::symbols_locked(const Site& site) const {
  if (!site.symbolized) {
    std::size_t i = 0;
    std::vector<SiteFrame> all;
    all.reserve(site.pcs.size());
    for (void* pc : site.pcs) all.push_back(symbolize(pc));
    while (i < all.size() && internal_frame(site.pcs[i], all[i])) ++i;
    if (i == all.size()) i = 0;  // nothing but gpustitch frames: keep them all
    site.symbols.assign(all.begin() + static_cast<std::ptrdiff_t>(i), all.end());
    site.symbolized = true;
  }
  return site.symbols;
}

std::vector<SiteReport> SiteSampler::top(std::size_t k) const {
  std::vector<SiteReport> merged;
  {
    std::lock_guard lock(sites_mu_);
    std::map<std::string, std::size_t> by_frames;
    for (const auto& [id, site] : sites_) {
      const auto& frames = symbols_locked(site);
      std::string key;
      for (const auto& f : frames) key += f.library + "+" + std::to_string(f.offset) + ";";
      auto [it, inserted] = by_frames.emplace(key, merged.size());
      if (inserted) {
        SiteReport r;
        r.id = id;
        r.frames = frames;
        merged.push_back(std::move(r));
      }
      SiteReport& r = merged[it->second];
      r.id = std::min(r.id, id);
      r.live_bytes += site.live_bytes;
      r.live_count += site.live_count;
      r.total_bytes += site.total_bytes;
      r.total_count += site.total_count;
    }
  }
  std::sort(merged.begin(), merged.end(), [](const SiteReport& a, const SiteReport& b) {
    if (a.live_bytes != b.live_bytes) return a.live_bytes > b.live_bytes;
    if (a.total_bytes != b.total_bytes) return a.total_bytes > b.total_bytes;
    return a.id < b.id;
  });
  if (merged.size() > k) merged.resize(k);
  return merged;
}

std::vector<SiteFrame> SiteSampler::frames_of(DevPtr ptr) const {
  std::uint64_t site;
  {
    Shard& sh = shards_[(ptr >> 9) % kShards];
    std::lock_guard lock(sh.mu);
    auto it = sh.live.find(ptr);
    if (it == sh.live.end()) return {};
    site = it->second.site;
  }
  std::lock_guard lock(sites_mu_);
  auto it = sites_.find(site);
  if (it == sites_.end()) return {};
  return symbols_locked(it->second);
}

std::vector<SiteFrame> SiteSampler::frames_of_site(std::uint64_t site) const {
  std::lock_guard lock(sites_mu_);
  auto it = sites_.find(site);
  if (it == sites_.end()) return {};
  return symbols_locked(it->second);
}

}  // namespace gpustitch::sites
