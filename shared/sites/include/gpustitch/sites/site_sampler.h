// Allocation sites: which code holds the device memory.
//
// SiteSampler is a PoolObserver that captures the native stack of sampled allocations (every
// allocation of at least min_size bytes, and/or one in sample_every), aggregates them per call
// site (a hash of the return addresses) by live bytes and count, and answers top-K queries with
// symbolized frames (function demangled, library, offset into the library).
//
// Cost model. Off means not registered: make_site_sampler() returns null when neither trigger is
// configured, and the pool then pays nothing. When on, an allocation that is not sampled costs a
// size compare and a thread-local countdown; a free costs one hash lookup under a sharded lock
// (only while sampled blocks are live); a sampled allocation costs one stack walk (bench/sites).
//
// Unwinding uses libunwind's unw_backtrace when libunwind.so.8 can be loaded (dlopen, once, when
// the sampler is created), else libgcc's _Unwind_Backtrace. Debian's libunwind.a is not
// position-independent and defines the _Unwind_* symbols itself, so it cannot be linked into the
// preload library; loading it at run time keeps libgpustitch.so free of a libunwind dependency.
//
// Frames inside gpustitch (the sampler, the pool, the preload hooks) are stripped from the top of
// each stack when it is symbolized: leading frames in the sampler's own shared object (when it is
// not the main program) and leading frames whose function is in namespace gpustitch::. Functions
// of the main program are named only when it exports them (-rdynamic); shared libraries always.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "gpustitch/config.h"
#include "gpustitch/stats.h"

namespace gpustitch::sites {

struct SiteFrame {
  std::string function;      // demangled; "0x<pc>" when the symbol is unknown
  std::string library;       // file name of the object (no directory)
  std::uint64_t offset = 0;  // pc - load address of the object
};

struct SiteReport {
  std::uint64_t id = 0;          // stable for the process's life
  std::uint64_t live_bytes = 0;  // sampled allocations still live
  std::uint64_t live_count = 0;
  std::uint64_t total_bytes = 0;  // sampled allocations since start
  std::uint64_t total_count = 0;
  std::vector<SiteFrame> frames;  // innermost (the allocating call) first
};

struct SiteSamplerOptions {
  std::size_t min_size = 0;   // sample every allocation >= min_size (0: off)
  unsigned sample_every = 0;  // sample one allocation in sample_every (0: off)
  int max_depth = 32;         // frames captured per stack
};

// Returns a sampler when config enables sites (sites_min_mb / sites_sample), else null.
std::unique_ptr<class SiteSampler> make_site_sampler(const Config& config);

class SiteSampler final : public PoolObserver {
 public:
  explicit SiteSampler(SiteSamplerOptions options);
  ~SiteSampler() override;

  void on_allocate(int device, DevPtr ptr, std::size_t size, Stream stream,
                   ServedBy how) noexcept override;
  void on_free(int device, DevPtr ptr, std::size_t size, Stream stream) noexcept override;

  // Sites ordered by live bytes (then total bytes), at most k, frames symbolized and stripped of
  // gpustitch's own frames. Sites whose stripped frames are equal are merged.
  std::vector<SiteReport> top(std::size_t k) const;
  // The symbolized stack of a live sampled allocation (empty if ptr was not sampled).
  std::vector<SiteFrame> frames_of(DevPtr ptr) const;
  // The symbolized stack of a site (SiteReport::id, last_sampled_site); empty if unknown. Sites
  // are kept for the process's life, so an id stays valid after its allocations are freed.
  std::vector<SiteFrame> frames_of_site(std::uint64_t site) const;
  // For an observer placed after the sampler in the same fan-out: the site of the allocation of
  // ptr that this thread is reporting right now, if the sampler sampled it, else 0. A
  // thread-local read (trace::SiteOfAllocation).
  static std::uint64_t last_sampled_site(DevPtr ptr) noexcept;

  std::uint64_t sampled() const noexcept { return sampled_.load(std::memory_order_relaxed); }
  const SiteSamplerOptions& options() const noexcept { return options_; }
  // "libunwind" or "libgcc": the unwinder in use.
  static const char* unwinder() noexcept;

 private:
  struct Site {
    std::vector<void*> pcs;
    std::uint64_t live_bytes = 0, live_count = 0, total_bytes = 0, total_count = 0;
    mutable std::vector<SiteFrame> symbols;  // filled on first query
    mutable bool symbolized = false;
  };
  struct LiveEntry {
    std::uint64_t site;
    std::size_t size;
  };
  static constexpr int kShards = 16;
  struct Shard {
    mutable std::mutex mu;
    std::unordered_map<DevPtr, LiveEntry> live;
  };
  bool should_sample(std::size_t size) noexcept;
  const std::vector<SiteFrame>& symbols_locked(const Site& site) const;

  SiteSamplerOptions options_;
  mutable std::mutex sites_mu_;
  std::unordered_map<std::uint64_t, Site> sites_;
  mutable Shard shards_[kShards];
  std::atomic<std::uint64_t> live_sampled_{0};
  std::atomic<std::uint64_t> sampled_{0};
};

// Captures up to max return addresses of the calling thread, innermost first.
int capture_stack(void** pcs, int max) noexcept;
// Symbolizes one return address (dladdr + demangling).
SiteFrame symbolize(void* pc);

}  // namespace gpustitch::sites
