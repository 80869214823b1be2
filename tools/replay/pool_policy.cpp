// The gpustitch pool as a replay policy: a real gpustitch::Pool over a SimBackend of the given
// capacity (or, with PolicyEnv::gpu, over the CUDA backend with cap = capacity), with stitching
// on ("gpustitch") or off ("gpustitch-no-stitch"). Reserved is the pool's bytes_reserved
// (physical memory held from the backend).
//
// With PolicyEnv::explain_peak it also keeps the pool's memory map (Pool::memory_map) as it was
// right after the allocation that took reserved to its peak, and reports it as counters: where
// the bytes above the live ones were (free blocks by size, memory waiting for its fence, small
// chunks, spare handles). That is the measuring instrument for "why is reserved above demand".
#include <gpustitch/backend_factory.h>
#include <gpustitch/config.h>
#include <gpustitch/pool.h>
#include <gpustitch/sim_backend.h>

#include <algorithm>
#include <map>
#include <vector>

#include "driver_cost.h"
#include "policy.h"
#include "trace_threads.h"

namespace gpustitch::replay {

namespace {

class PoolPolicy final : public ReplayPolicy {
 public:
  PoolPolicy(std::string name, std::unique_ptr<Backend> backend, const Config& config,
             bool explain_peak)
      : name_(std::move(name)),
        stitching_(config.stitching),
        explain_peak_(explain_peak),
        backend_(std::make_unique<CostedBackend>(std::move(backend))),
        pool_(*backend_, config) {}

  static std::unique_ptr<ReplayPolicy> make(std::string name, const PolicyEnv& env, bool stitching,
                                            std::string* why) {
    Config c = make_config(stitching);
    if (!env.pool_conf.empty()) {
      ConfigResult r = parse_config(env.pool_conf, c);
      if (!r.errors.empty()) {
        if (why) *why = r.errors.front();
        return nullptr;
      }
      c = r.config;
      c.stitching = stitching;  // the policy's name says which
    }
    std::unique_ptr<Backend> backend;
    if (env.gpu) {
      c.backend = BackendKind::cuda;
      c.cap = env.capacity;
      backend = make_backend(c, why);
      if (!backend) return nullptr;
    } else {
      backend = std::make_unique<SimBackend>(sim_options(env));
    }
    if (backend->device_count() < env.devices) {
      if (why) *why = "the trace uses more devices than the backend has";
      return nullptr;
    }
    return std::make_unique<PoolPolicy>(std::move(name), std::move(backend), c, env.explain_peak);
  }

  std::string name() const override { return name_; }

  // A trace thread's own thread (TraceThreads) is bound, before its first call, to the arena of
  // the trace thread's order of appearance (the first to arena 0, the next to 1), so that the same
  // trace gets the same arenas whatever else the process runs: left to the pool, a thread takes
  // the arena the fewest threads of the process use, and settings replayed side by side (tune
  // --jobs) shared arenas and gave other figures.
  void set_thread(std::uint64_t thread) override {
    thread_ = thread;
    const auto [it, first] = arena_of_.try_emplace(thread, static_cast<unsigned>(arena_of_.size()));
    if (first) threads_.run(thread, [arena = it->second] { Pool::bind_thread_to_arena(arena); });
  }
  bool allocate(int device, std::size_t size, Stream stream, std::uint64_t* handle) override {
    DevPtr p = 0;
    Status s = Status::ok;
    threads_.run(thread_, [&] { s = pool_.allocate(device, size, stream, &p); });
    if (s != Status::ok) return false;
    *handle = p;
    if (explain_peak_) note_peak(device, size);
    return true;
  }
  void deallocate(int, std::uint64_t handle, std::size_t, Stream stream) override {
    threads_.run(thread_, [&] { pool_.deallocate(static_cast<DevPtr>(handle), stream); });
  }
  std::uint64_t reserved(int device) const override { return pool_.stats(device).bytes_reserved; }
  std::uint64_t peak_reserved(int device) const override {
    return pool_.stats(device).peak_reserved;
  }
  // With stitching, cached pieces combine into one block: the largest allocation that can
  // succeed, bounded by the cache (it may count fresh device memory too); without, the largest
  // cached block.
  std::uint64_t largest_free_block(int device) const override {
    const DeviceStats s = pool_.stats(device);
    const std::uint64_t usable = s.bytes_cached - std::min(s.bytes_cached, s.bytes_pending);
    if (stitching_) return std::min(s.largest_possible, usable);
    return std::min(s.largest_free_block, usable);
  }
  std::vector<std::pair<std::string, std::uint64_t>> counters(int devices) const override {
    std::uint64_t hits = 0, fresh = 0, stitches = 0, trims = 0, fences = 0, waits = 0;
    for (int d = 0; d < devices; ++d) {
      const DeviceStats s = pool_.stats(d);
      hits += s.cache_hits, fresh += s.fresh, stitches += s.stitches, trims += s.trims;
      fences += s.fence_syncs, waits += s.fence_waits;
    }
    // fences: device fences the pool made (each a wait for the whole device on the GPU, where
    // the host runs ahead of it; free on replay's idle simulated device, so only their number
    // tells their cost).
    std::vector<std::pair<std::string, std::uint64_t>> out = {
        {"cache_hits", hits}, {"fresh", fresh},   {"stitches", stitches},
        {"trims", trims},     {"fences", fences}, {"fence_waits", waits}};
    for (auto& c : backend_->cost().counters()) out.push_back(std::move(c));
    if (explain_peak_) explain(devices, &out);
    return out;
  }

 private:
  struct PeakView {
    std::uint64_t reserved = 0;  // bytes_reserved right after the allocation
    std::uint64_t request = 0;   // its size
    std::vector<MappedSegment> map;
  };
  void note_peak(int device, std::size_t size) {
    if (peaks_.size() <= static_cast<std::size_t>(device)) peaks_.resize(device + 1);
    PeakView& v = peaks_[static_cast<std::size_t>(device)];
    const std::uint64_t reserved = pool_.stats(device).bytes_reserved;
    if (reserved <= v.reserved) return;
    v.reserved = reserved;
    v.request = size;
    v.map.clear();
    pool_.memory_map(device, &v.map);
  }
  // Where reserved memory was at its peak, summed over devices. Free blocks under 2 MiB can hold
  // no whole handle (the driver's granularity), so only best fit can reuse them where they lie.
  // Free bytes in a granule that a live or pending block also touches ("pinned") could not move
  // with handles of any size, since the driver maps at least a granule; the rest of the free
  // bytes lie in granules wholly free, which handles of one granule could have moved. So pinned
  // free memory is the layout's (where blocks were placed), the rest the handles' size.
  void explain(int devices, std::vector<std::pair<std::string, std::uint64_t>>* out) const {
    std::uint64_t reserved = 0, request = 0, live = 0, free = 0, pending = 0, small = 0;
    std::uint64_t free_blocks = 0, free_small_pieces = 0, largest_free = 0, mapped = 0;
    std::uint64_t pinned = 0;
    for (int d = 0; d < devices && static_cast<std::size_t>(d) < peaks_.size(); ++d) {
      const PeakView& v = peaks_[static_cast<std::size_t>(d)];
      reserved += v.reserved;
      request = std::max(request, v.request);
      pinned += pinned_free(v.map, backend_->granularity(d));
      for (const MappedSegment& seg : v.map) {
        mapped += seg.size;
        if (seg.small) {
          small += seg.size;
          continue;
        }
        for (const MappedBlock& b : seg.blocks) {
          if (b.state == MappedBlock::State::live) {
            live += b.size;
          } else if (b.state == MappedBlock::State::pending) {
            pending += b.size;
          } else {
            free += b.size;
            ++free_blocks;
            if (b.size < 2 * MiB) free_small_pieces += b.size;
            largest_free = std::max<std::uint64_t>(largest_free, b.size);
          }
        }
      }
    }
    out->insert(out->end(), {{"peak_reserved_explained", reserved},
                             {"peak_request_bytes", request},
                             {"peak_live_bytes", live},
                             {"peak_free_bytes", free},
                             {"peak_free_blocks", free_blocks},
                             {"peak_free_under_2mib_bytes", free_small_pieces},
                             {"peak_free_pinned_bytes", pinned},
                             {"peak_largest_free_bytes", largest_free},
                             {"peak_pending_bytes", pending},
                             {"peak_small_chunk_bytes", small},
                             {"peak_spare_bytes", reserved > mapped ? reserved - mapped : 0}});
  }

  // Free bytes lying in a granule that a live or pending block, or a small-object chunk, also
  // touches.
  static std::uint64_t pinned_free(const std::vector<MappedSegment>& map, std::size_t g) {
    if (g == 0) return 0;
    struct Piece {
      DevPtr lo, hi;  // [lo, hi)
      bool free;
    };
    std::vector<Piece> pieces;
    for (const MappedSegment& seg : map) {
      if (seg.small) {
        pieces.push_back({seg.base, seg.base + seg.size, false});  // a chunk, allocated whole
        continue;
      }
      for (const MappedBlock& b : seg.blocks) {
        if (b.size != 0) {
          pieces.push_back({b.ptr, b.ptr + b.size, b.state == MappedBlock::State::free});
        }
      }
    }
    std::sort(pieces.begin(), pieces.end(),
              [](const Piece& a, const Piece& b) { return a.lo < b.lo; });
    // Pieces do not overlap: the ones sharing a granule with piece i are its neighbours in
    // address order, and the ones beyond them lying in that same granule.
    auto touched = [&](std::size_t i, DevPtr granule) {
      for (std::size_t j = i; j-- > 0 && (pieces[j].hi - 1) / g >= granule;) {
        if (!pieces[j].free) return true;
      }
      for (std::size_t j = i + 1; j < pieces.size() && pieces[j].lo / g <= granule; ++j) {
        if (!pieces[j].free) return true;
      }
      return false;
    };
    std::uint64_t pinned = 0;
    for (std::size_t i = 0; i < pieces.size(); ++i) {
      const Piece& p = pieces[i];
      if (!p.free) continue;
      const DevPtr first = p.lo / g, last = (p.hi - 1) / g;
      for (DevPtr granule : {first, last}) {
        if (touched(i, granule)) {
          pinned += std::min<DevPtr>(p.hi, (granule + 1) * g) - std::max<DevPtr>(p.lo, granule * g);
        }
        if (first == last) break;  // one granule, counted once
      }
    }
    return pinned;
  }

  // The simulated fence takes kSimFenceNs (policy.h: why), at least: the simulator busy-waits.
  static SimOptions sim_options(const PolicyEnv& env) {
    SimOptions o{env.devices, env.capacity, env.granularity, env.map_offset};
    o.call_ns[static_cast<std::size_t>(SimOp::synchronize)] = kSimFenceNs;
    return o;
  }
  static Config make_config(bool stitching) {
    Config c;
    c.stitching = stitching;
    c.backend = BackendKind::sim;
    c.background_reclaim = false;  // deterministic: the same trace gives the same figures
    // As many arenas on every host (the pool's default follows its cores): the GPU machine's,
    // where the traces were recorded.
    c.arenas = kMaxArenas;
    return c;
  }
  std::string name_;
  bool stitching_;
  bool explain_peak_;
  std::vector<PeakView> peaks_;             // per device
  std::unique_ptr<CostedBackend> backend_;  // every driver call, counted and costed
  Pool pool_;
  std::uint64_t thread_ = 0;                    // the trace thread of the next call
  std::map<std::uint64_t, unsigned> arena_of_;  // trace thread -> its arena, by first appearance
  // Declared last, destroyed first: no thread outlives the pool it calls.
  TraceThreads threads_;
};

PolicyRegistrar reg_on{"gpustitch", "gpustitch pool, stitching on (simulated device)", true,
                       [](const PolicyEnv& env, std::string* why) {
                         return PoolPolicy::make("gpustitch", env, true, why);
                       }};
PolicyRegistrar reg_off{"gpustitch-no-stitch", "gpustitch pool, stitching off (simulated device)",
                        true, [](const PolicyEnv& env, std::string* why) {
                          return PoolPolicy::make("gpustitch-no-stitch", env, false, why);
                        }};

}  // namespace

}  // namespace gpustitch::replay
