// Configuration, parsed from GPUSTITCH_CONF in PYTORCH_CUDA_ALLOC_CONF's style:
//   GPUSTITCH_CONF="max_split_size_mb:512,release_threshold_mb:4096,stitching:on"
//
// Policy on bad input: every problem (unknown key, malformed value) produces one message naming
// the key; the offending entry is ignored, every other entry still applies, and the program
// continues. Nothing in here throws or aborts.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "gpustitch/types.h"

namespace gpustitch {

enum class BackendKind { automatic, cuda, sim };

// Most arenas (per-thread small pools and parked large blocks) one device pool has.
inline constexpr unsigned kMaxArenas = 8;

struct Config {
  // --- allocator core -----------------------------------------------------------------------
  BackendKind backend = BackendKind::automatic;  // backend:cuda|sim|auto
  // Cached blocks at least this large are never split, and are used only for requests at least
  // this large (PyTorch's max_split_size_mb). SIZE_MAX = no limit.
  std::size_t max_split_size = SIZE_MAX;  // max_split_size_mb
  // Idle cached physical memory above this is handed back to the driver. SIZE_MAX = keep all
  // (cached memory is still released before an out-of-memory is reported).
  std::size_t release_threshold = SIZE_MAX;  // release_threshold_mb
  std::size_t small_limit = 256 * KiB;       // small_limit_kb: below, size-class chunks
  // Arenas per device pool, 1..kMaxArenas; 0: one per core, at most kMaxArenas. Threads share
  // them (the least used one at a thread's first small allocation), so fewer arenas hold fewer
  // partly used chunks for more lock sharing. Replay sets it, so that its figures do not depend
  // on the host's cores.
  unsigned arenas = 0;        // arenas
  std::size_t cap = 0;        // cap_mb: most physical memory per device
  double cap_fraction = 0.0;  // cap_fraction: of the device's total
  bool stitching = true;      // stitching:on|off
  // Physical memory moves between places of the address space in whole handles (the driver maps
  // handles whole), so small handles let freed memory move piece by piece; each handle costs a
  // create, a map and a share of cuMemSetAccess (large_heap.cpp). Fresh memory comes in handles
  // of segment_mb, or of 1/fresh_handles of the range it backs when that is larger (0: no limit),
  // but none larger than max_handle_mb (0: no limit), as expandable segments' 20 MiB pages: a
  // live block pins the free rest of every handle it touches.
  // The default, 1: fresh memory comes in handles of max_handle_mb (10 MiB), the last one
  // smaller. On the H200 (tools/gpu/memory_compare.sh, three rounds) 20 MiB handles (expandable
  // segments' page) ran GPT and HF Llama training 9% and 15% faster than expandable segments,
  // where 4 handles per range ran 2% slower and 64 (the old default) 2-20% slower, for 0.2-1%
  // less memory than 1. 10 MiB handles then held GPT at 19.60-19.65 GB against 19.88-20.10 with
  // 20 MiB (expandable segments 19.92), HF Llama at 13.45-13.49 against 13.51-13.54, at tokens/s
  // within the runs' spread (large_heap.cpp). In replay, 64 handles spent 5-8x expandable
  // segments' time in driver calls, 10 MiB handles 2.8x on the training traces.
  std::size_t segment_size = 2 * MiB;  // segment_mb
  unsigned fresh_handles = 1;          // fresh_handles
  std::size_t max_handle = 10 * MiB;   // max_handle_mb
  // Nor larger than 1/handle_share of the physical memory the large heap will hold (0: no such
  // bound), with at most 16 per fresh range: a small program's handles are small, so what its
  // live blocks pin stays a small share of what it holds, while a large one's reach max_handle_mb
  // (at 1.25 GiB held). In replay (--whole-handles, 140 GiB) 128 took the small traces from
  // 1.044-1.116x of demand to 1.013-1.052x, for 15-25% more driver time on the training traces
  // (large_heap.cpp).
  unsigned handle_share = 128;  // handle_share
  // And at most gap_handles of them per fresh range (0: no bound), which bounds what one fresh
  // block costs: a fresh 256 MiB block in an empty heap is 16 handles of 16 MiB, not 128 of 2 MiB.
  // In replay 16 held the recorded traces at 1.011-1.052x of demand, 32 and 64 at 1.011-1.052x
  // with bucketed sizes at 1.043x against 1.024x, and 16 created the fewest handles
  // (gpt_seqlen_b5: 1,296 against 1,371). 0 with handle_share:1024 and size_ranges:on is the
  // memory-first layout (README, "Configuration").
  unsigned gap_handles = 16;  // gap_handles
  // Requests below 1 MiB, below 4 MiB and larger are placed in address ranges of their own, so
  // that small blocks pack among themselves instead of leaving pieces of granules between large
  // ones; physical memory still moves between the ranges (large_heap.cpp). Off by default: with
  // the default handle sizes it gains little and moves handles more often, and the memory-first
  // layout (with handle_share:1024,gap_handles:0), which held HF Llama training at 1.02x of live
  // bytes on an H100 against 1.03x, ran it at 0.87-0.90x of PyTorch's tokens/s against 0.98x.
  bool size_ranges = false;  // size_ranges
  // Until the large heap first holds this much (outside very large live blocks), it uses the
  // memory-first layout whatever the three settings above say (0: never; large_heap.cpp: why).
  std::size_t memory_first = 8 * GiB;  // memory_first_mb
  // A fresh range of at least fresh_coarse_mb (0: never) is backed by handles of the size above at
  // both ends and at most 4 larger ones between them (large_heap.cpp): a fresh 256 MiB-2 GiB
  // block then costs a few driver calls, as cudaMalloc does, instead of one per 10 MiB (0.7-2.0x
  // cudaMalloc on the H200 against 6-64x). A large handle is split in three when a later block
  // is cut inside it, and given back when it is too large to move where memory is needed, so a
  // block freed and taken again at its size costs no driver call at all.
  std::size_t fresh_coarse = 256 * MiB;  // fresh_coarse_mb
  // The same bound for a fresh range that a stream-ordered request (cudaMallocAsync) takes, where
  // it is larger (0: as fresh_coarse_mb). Such a block's large handles are what a later cut out of
  // the stream's own freed memory pins, or waits for the device to split (stream_cut_fence): on
  // an H100 those waits and splits cost the defaults 1-11% of tokens/s against the rule off in
  // four pairs of runs (README, "On the GPU"). With cudaFree semantics a freed block becomes
  // free only at a fence, so its cuts always split at once. Below the bound a stream-ordered
  // fresh range comes in ordinary handles, at a fresh block's earlier cost (6-64x cudaMalloc for
  // 256 MiB-2 GiB on the H200); larger ones would cost more handles than the waits do.
  std::size_t stream_fresh_coarse = 2 * GiB;  // stream_fresh_coarse_mb
  // Frees wait for device work on a background thread (thread), or only when an allocation
  // needs their memory (inline: deterministic, for tests and replay). ordered: the thread runs
  // the device waits, but freed large blocks become free only on the allocating thread, at the
  // points where inline fences, after a bounded wait for the thread's fence (as
  // stream_miss_fence waits): inline's decisions, and so replay's figures, without a device wait
  // under the lock (docs/address-space.md, "Ordered fences").
  bool background_reclaim = true;  // reclaim:thread|inline|ordered
  bool ordered_fences = false;     // reclaim:ordered (with background_reclaim)
  // A moved handle's old place is unmapped by that thread (background) instead of the allocating
  // one (inline), which then makes a map and a share of one cuMemSetAccess per moved handle, not
  // also an unmap (retired_mappings.h); inline where there is no such thread. lazy: only when
  // its address space or handle is needed again (deterministic, for tests). inline is the
  // default: on the H200 background halved the allocating thread's driver time on HF Llama
  // training but not on the GPT workload, and neither tokens/s nor peak reserved differed
  // outside the runs' spread, so the simpler path, with no second thread in the driver's
  // memory API, stays the default (docs/address-space.md, "The allocating thread's driver time").
  enum class Unmap : std::uint8_t { inline_, background, lazy };
  Unmap unmap = Unmap::inline_;  // unmap:inline|background|lazy
  // While the pool holds less than this percentage above the program's peak allocated bytes, a
  // miss takes fresh memory instead of moving idle handles: memory for fewer driver calls once the
  // pool has grown. 0: moves whenever idle memory can serve.
  unsigned grow_slack_pct = 0;  // grow_slack_pct
  // A stream-ordered allocation (cudaMallocAsync) that would take fresh memory while much freed
  // memory still waits for its fence waits for the reclaimer's fence first (without the locks,
  // 200 ms at most, and not again until a fence that ran out completes), as a cudaMalloc does.
  // On the H200 under PyTorch's cudaMallocAsync backend it holds HF Llama training at
  // 13.51-13.56 GB (1.02x of live bytes) against 15.0-16.0 GB off (a 1-20 ms bound: 13.45-14.64).
  bool stream_miss_fence = true;  // stream_miss_fence:on|off
  // A stream-ordered allocation whose best fit is a cut out of the stream's own memory still
  // waiting for its fence, with the cut inside a large handle (fresh_coarse_mb), first makes sure
  // the device is done with that memory, so that the cut may split the handle instead of the
  // live block pinning its free rest for as long as it lives: it asks the event recorded at the
  // block's free (free_events.h; no wait), else fences where fences are cheap (reclaim:inline,
  // an idle device), else waits as stream_cut_wait says. On an H100 it held HF Llama training at
  // 1.017x of PyTorch's peak allocated against 1.028x (README, "On the GPU").
  bool stream_cut_fence = true;  // stream_cut_fence:on|off
  // Where the free's event says the device still runs it: wait (outside the locks, until that
  // event completes or the reclaimer's fence covers it, 200 ms at most, and only where
  // stream_miss_fence may wait), or cut at once and let the live block pin the handle's free rest
  // (off: no stream-ordered cut ever waits for the device). On an H100 off gave 2-9% more
  // tokens/s for 1.019-1.024x of PyTorch's peak allocated instead of 1.015-1.019x: on, since
  // memory is what the pool is for; off for programs whose limit is speed.
  bool stream_cut_wait = true;  // stream_cut_wait:on|off
  // Large blocks freed on a stream (cudaFreeAsync) are kept, up to this many bytes (and 32
  // blocks) per thread arena, for the same stream to reuse without the device lock. 0 = off, the
  // default: parked blocks merge with nothing, and in replay of the training traces the cache
  // raised peak reserved memory by 2-14% (stream order) for lock traffic that a single-threaded
  // framework does not have. Programs that allocate large blocks from many threads turn it on.
  std::size_t large_cache = 0;  // large_cache_mb
  // --- simulated backend --------------------------------------------------------------------
  std::size_t sim_capacity = 80 * GiB;    // sim_capacity_mb
  std::size_t sim_granularity = 2 * MiB;  // sim_granularity_kb
  int sim_devices = 1;                    // sim_devices
  bool sim_map_offset = true;             // sim_map_offset:on|off
  // Non-empty: processes naming the same device share its capacity, as on one GPU.
  std::string sim_shared;  // sim_shared:NAME
  // --- layers above the core (preload shim, statistics, tracing) ----------------------------
  bool enabled = true;      // enable:on|off (shim passes everything through)
  bool ipc_native = false;  // ipc:native|pool
  // on: the device's default memory pool (the driver's, behind cudaMallocAsync) keeps its release
  // threshold at 0 while the pool serves the device, whatever the program sets (the program reads
  // back its own value), so memory that reaches it without passing the hooks goes back to the
  // driver at each synchronisation instead of staying reserved (preload/src/hooks_mempool.cpp).
  // PyTorch's cudaMallocAsync backend sets the threshold to the maximum; on the H200 its HF Llama
  // training under the shim then held 1,760 MiB there at its peak (NVML peak 15.9 GB; with the
  // threshold at 0, 14.2 GB), for allocations of at most 77-451 MiB live. On by default: in five
  // interleaved pairs of runs it was faster in three and slower in two (49.0k against 46.0k
  // tokens/s on the means), so its cost is within the runs' noise, and the device holds 1.8 GB
  // less.
  bool driver_pool_release = true;     // driver_pool_release:on|off
  std::string trace_path;              // trace:PATH
  std::string log_level = "warn";      // log_level:trace|debug|info|warn|error|off
  bool summary = false;                // summary:on|off (exit summary below info; run sets it)
  bool publish = true;                 // publish:on|off (shared-memory statistics)
  unsigned publish_interval_ms = 100;  // publish_interval_ms
  std::size_t sites_min_size = 0;      // sites_min_mb: capture stacks at/above (0=off)
  unsigned sites_sample = 0;           // sites_sample: capture 1 in K (0=off)
  // Recent allocation events kept in memory for the timeline of snapshots (memory_viz's
  // device_traces), 64 bytes each, preallocated. 0 = off.
  std::size_t trace_events = 10000;  // trace_events:N
  // Cooperative release between processes sharing a GPU (docs/coop.md): give idle cached memory
  // to a neighbour about to run out, and ask neighbours before reporting out-of-memory.
  bool coop = true;            // coop:on|off (off: neither gives nor asks)
  unsigned coop_wait_ms = 50;  // coop_wait_ms: how long an allocation waits for neighbours
  unsigned coop_rate = 4;      // coop_rate: releases per second this process grants (burst too)
  // Memory the program maps itself with the VMM API (preload/src/program_lending.h): serve (a
  // cuMemCreate may be answered with an idle handle of the pool of that size and matching
  // properties, a released handle with those properties goes to the pool's cache) or count
  // (every call goes to the driver; the memory is only counted).
  bool serve_program_vmm = true;  // program_vmm:serve|count
};

struct ConfigResult {
  Config config;
  std::vector<std::string> errors;  // one human-readable line per rejected entry
};

// Parses text on top of base. Never throws.
ConfigResult parse_config(std::string_view text, const Config& base = Config{});

// parse_config(getenv("GPUSTITCH_CONF")).
ConfigResult config_from_env();

// The keys parse_config knows, for --help output and documentation.
std::vector<std::string_view> config_keys();

}  // namespace gpustitch
