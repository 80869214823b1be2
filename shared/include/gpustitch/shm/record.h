// The per-process statistics record: one POSIX shared-memory object per process that runs the
// pool, written only by that process and read by gpustitchd and the gpustitch CLI.
//
// Layout rules (the record is an ABI between binaries of different versions and an untrusted
// input for readers):
//   * fixed layout, only fixed-width integers, doubles and char arrays; every offset is pinned by
//     a static_assert below. Any change to it bumps kLayoutVersion. New per-device counters are
//     appended at the end of DeviceCounters, so an older layout differs only in the device stride
//     and the offsets after the snapshot: readers also accept the layouts in kReadableLayouts
//     (their missing counters read as zero and SnapshotCopy says which layout it came from), and
//     reject every other version instead of guessing.
//   * the header names the version and the record size; a reader accepts a record only when
//     magic, version and size match one readable layout and the object's size equals
//     record_size.
//   * identity is written once, before the magic is stored (with release ordering), and never
//     changes afterwards.
//   * the snapshot (per-device counters + heartbeat) is guarded by a single-writer seqlock
//     (see seqlock.h): only the publisher thread writes it, the writer never waits.
//   * the event ring is written by any thread of the process: a writer claims an index with one
//     fetch_add and takes the slot with a compare-exchange on the slot's own sequence word, so it
//     never waits either (an event that finds its slot still being written is counted as dropped).
//   * the allocation-site table has its own seqlock; its writer serializes itself in-process.
//   * strings are NUL-padded but readers never rely on it (they bound every string read).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace gpustitch::shm {

inline constexpr std::uint64_t kRecordMagic = 0x3148435449545347ull;  // "GSTITCH1", little endian
// 2: cooperative-release counters; 3: memory the program maps itself (program_*); 4: of that,
// what the pool served (program_served_*); 5: the pool's own driver calls (driver_*); 6: their
// split by thread and kind, and what reserved held when it last rose to its peak; 7: the time the
// program's threads waited for the device inside the pool (fence_*).
inline constexpr std::uint32_t kLayoutVersion = 7;

inline constexpr int kMaxDevices = 16;
inline constexpr int kHistogramBuckets = 32;  // = gpustitch::kHistogramBuckets (checked in .cpp)
inline constexpr int kEventSlots = 64;        // power of two
inline constexpr int kMaxSites = 16;
inline constexpr int kMaxFrames = 8;
inline constexpr std::size_t kExeBytes = 256;
inline constexpr std::size_t kCmdlineBytes = 1024;
inline constexpr std::size_t kUuidBytes = 16;

// The per-device counters. The list is an X-macro so that the core's DeviceStats conversion, the
// JSON form and the Prometheus exporter all walk the same fields in the same order.
#define GPUSTITCH_SHM_DEVICE_COUNTERS(X) \
  X(bytes_requested)                     \
  X(bytes_allocated)                     \
  X(live_blocks)                         \
  X(bytes_reserved)                      \
  X(bytes_cached)                        \
  X(bytes_pending)                       \
  X(bytes_mapped)                        \
  X(handles)                             \
  X(views)                               \
  X(largest_free_block)                  \
  X(largest_possible)                    \
  X(peak_allocated)                      \
  X(peak_reserved)                       \
  X(device_free)                         \
  X(device_total)                        \
  X(allocs)                              \
  X(frees)                               \
  X(cache_hits)                          \
  X(fresh)                               \
  X(stitches)                            \
  X(stitched_bytes)                      \
  X(trims)                               \
  X(trimmed_bytes)                       \
  X(ooms)

// Cooperative release (docs/coop.md), kept by the preload library's coop layer, not the core.
#define GPUSTITCH_SHM_COOP_COUNTERS(X)                                                     \
  X(coop_given_bytes)    /* idle cache released because a neighbour asked */               \
  X(coop_gives)          /* requests served that released something */                     \
  X(coop_received_bytes) /* bytes neighbours released for this process's requests */       \
  X(coop_receives)       /* neighbours' replies that released something */                 \
  X(coop_asks)           /* allocations that would have failed and asked the neighbours */ \
  X(coop_requests)       /* requests received (valid or not) */                            \
  X(coop_dropped)        /* requests dropped: rate limit, malformed, sender not permitted */

// Device memory the program maps itself with the VMM API (cuMemCreate/cuMemMap), kept by the
// preload library (preload/src/program_memory.h). Layout 3; program_served_* layout 4.
#define GPUSTITCH_SHM_PROGRAM_COUNTERS(X)                                                          \
  X(program_held_bytes)     /* physical bytes it holds: created and not both released+unmapped */  \
  X(program_created_bytes)  /* bytes of handles created and not released */                        \
  X(program_handles)        /* handles created and not released */                                 \
  X(program_mapped_bytes)   /* bytes of address range mapped and not unmapped */                   \
  X(program_served_bytes)   /* of program_held_bytes: handles the pool lent (program_lending.h) */ \
  X(program_served_handles) /* those handles */

// The pool's own calls into the driver's memory API (create, map, set-access, unmap, release),
// counted and timed by the core (DeviceStats::driver_calls/driver_ns): the CPU time the pool adds
// to its process for physical memory, which cache hits never pay. Layout 5.
#define GPUSTITCH_SHM_DRIVER_COUNTERS(X)               \
  X(driver_calls) /* memory-API calls the pool made */ \
  X(driver_ns)    /* wall time in them, nanoseconds (the calls themselves, not locks) */

// Where the pool's driver time goes and why its peak was reached (DeviceStats, same names).
// Layout 6. The per-kind counters are the allocating threads' (DriverOp order); the reclaimer
// thread's calls are all unmaps of moved handles' old places (unmap:background).
#define GPUSTITCH_SHM_DRIVER_DETAIL_COUNTERS(X)                                              \
  X(driver_background_calls) /* of driver_calls, the reclaimer thread's */                   \
  X(driver_background_ns)                                                                    \
  X(driver_create_calls)                                                                     \
  X(driver_create_ns)                                                                        \
  X(driver_map_calls)                                                                        \
  X(driver_map_ns)                                                                           \
  X(driver_set_access_calls)                                                                 \
  X(driver_set_access_ns)                                                                    \
  X(driver_unmap_calls)                                                                      \
  X(driver_unmap_ns)                                                                         \
  X(driver_release_calls)                                                                    \
  X(driver_release_ns)                                                                       \
  X(peak_reserved_allocated) /* when reserved last rose to its peak: bytes then allocated */ \
  X(peak_reserved_pending)   /* and bytes then freed but waiting for the device (its fence) */

// The time the program's threads waited for the device inside the pool (DeviceStats, same names
// and meaning): fences run on the calling thread (a miss or a trim fencing the frees it needs, an
// out-of-memory retry), and allocations that waited for the reclaimer thread's fence
// (stream_miss_fence), those that ran out (kMaxFenceWait) apart. Not the reclaimer's own fences.
// Layout 7.
#define GPUSTITCH_SHM_WAIT_COUNTERS(X)                                                    \
  X(fence_syncs)           /* device synchronizations run on the program's threads */     \
  X(fence_sync_ns)         /* wall time in them, nanoseconds */                           \
  X(fence_waits)           /* allocations that waited for the reclaimer thread's fence */ \
  X(fence_wait_ns)         /* wall time in those waits, nanoseconds */                    \
  X(fence_waits_timed_out) /* of fence_waits, those that ran out (took fresh memory) */

struct DeviceCounters {
#define GPUSTITCH_SHM_FIELD(name) std::uint64_t name;
  GPUSTITCH_SHM_DEVICE_COUNTERS(GPUSTITCH_SHM_FIELD)
#undef GPUSTITCH_SHM_FIELD
  std::uint64_t hist_allocs[kHistogramBuckets];
  std::uint64_t hist_live[kHistogramBuckets];
  std::uint8_t uuid[kUuidBytes];  // all zero when unknown
  std::int32_t ordinal;           // device ordinal in the process
  std::uint32_t reserved0;
  std::uint64_t reserved1;
#define GPUSTITCH_SHM_FIELD(name) std::uint64_t name;
  GPUSTITCH_SHM_COOP_COUNTERS(GPUSTITCH_SHM_FIELD)
  GPUSTITCH_SHM_PROGRAM_COUNTERS(GPUSTITCH_SHM_FIELD)
  GPUSTITCH_SHM_DRIVER_COUNTERS(GPUSTITCH_SHM_FIELD)
  GPUSTITCH_SHM_DRIVER_DETAIL_COUNTERS(GPUSTITCH_SHM_FIELD)
  GPUSTITCH_SHM_WAIT_COUNTERS(GPUSTITCH_SHM_FIELD)
#undef GPUSTITCH_SHM_FIELD

  // What cooperative release may ask this process's pool for: its idle cache. Memory the program
  // maps itself (program_*) is the program's, not the pool's, so however large it is the pool
  // cannot give any of it back.
  std::uint64_t releasable_bytes() const noexcept {
    return bytes_cached;
  }

  // 1 - allocated/reserved, as DeviceStats::fragmentation().
  double fragmentation() const noexcept {
    return bytes_reserved == 0
               ? 0.0
               : 1.0 - static_cast<double>(bytes_allocated) / static_cast<double>(bytes_reserved);
  }
};

struct RecordHeader {
  std::uint64_t magic;        // kRecordMagic once the record is complete
  std::uint32_t version;      // kLayoutVersion
  std::uint32_t record_size;  // sizeof(Record)
  std::uint64_t created_ns;   // CLOCK_REALTIME
  std::uint32_t max_devices;  // kMaxDevices
  std::uint32_t event_slots;  // kEventSlots
  std::uint32_t max_sites;    // kMaxSites
  std::uint32_t reserved0;
  std::uint64_t reserved1[3];
};

struct Identity {
  std::int32_t pid;
  std::uint32_t uid;
  std::uint64_t start_time;  // field 22 of /proc/<pid>/stat: clock ticks after boot
  std::uint32_t publish_interval_ms;
  std::uint32_t reserved0;
  std::uint64_t reserved1[3];
  char exe[kExeBytes];          // readlink(/proc/self/exe), truncated
  char cmdline[kCmdlineBytes];  // /proc/self/cmdline with NULs turned into spaces, truncated
};

// Guarded by seq (odd while the publisher writes).
struct Snapshot {
  std::uint64_t seq;
  std::uint64_t heartbeat_ns;   // CLOCK_REALTIME of this publish
  std::uint64_t publish_count;  // publishes so far
  std::uint32_t device_count;   // valid entries of devices[]
  std::uint32_t reserved0;
  std::uint64_t events_head;  // EventRing::head at this publish (readers poll it cheaply)
  std::uint64_t reserved1[3];
  DeviceCounters devices[kMaxDevices];
};

// Event kinds in the record. 1-4 mirror gpustitch::EventKind; the cooperative-release kinds are
// reserved for the layer that implements it.
enum class RecordEventKind : std::uint32_t {
  oom = 1,
  stitch = 2,
  trim = 3,
  release = 4,
  coop_give = 5,
  coop_receive = 6,
};
const char* to_string(RecordEventKind kind) noexcept;  // "unknown" for values outside the enum

struct EventSlot {
  // 2*index+1 while event number `index` is written, 2*index+2 once complete, 0 never written.
  std::uint64_t seq;
  std::uint32_t kind;  // RecordEventKind
  std::int32_t device;
  std::uint64_t time_ns;           // CLOCK_REALTIME
  std::uint64_t size;              // oom: requested; stitch: stitched; trim/release: released
  std::uint64_t device_free;       // driver free memory at the time
  std::uint64_t cached;            // pool cached bytes at the time
  std::uint64_t largest_possible;  // oom: the largest allocation that could have succeeded
  std::uint64_t pieces;            // stitch: pieces; trim: handles released
  double fragmentation;
  std::uint64_t peer_pid;  // coop_*: the other process
  std::uint64_t reserved[2];
};

struct EventRing {
  std::uint64_t head;     // events claimed so far; event i lives in slots[i % kEventSlots]
  std::uint64_t dropped;  // events dropped because their slot was still being written
  std::uint64_t reserved[6];
  EventSlot slots[kEventSlots];
};

struct SiteFrame {
  char function[96];  // demangled or raw symbol, truncated
  char library[64];   // basename of the object file
  std::uint64_t offset;
};

struct Site {
  std::uint64_t live_bytes;
  std::uint64_t count;  // live allocations from this site
  std::uint32_t frame_count;
  std::int32_t device;  // -1 when mixed
  SiteFrame frames[kMaxFrames];
};

// Guarded by seq; filled by the allocation-site sampler (a separate layer) when it is enabled.
struct SiteTable {
  std::uint64_t seq;
  std::uint64_t updated_ns;
  std::uint32_t count;
  std::uint32_t reserved0;
  std::uint64_t reserved1[5];
  Site sites[kMaxSites];
};

struct Record {
  RecordHeader header;
  Identity identity;
  Snapshot snapshot;
  EventRing events;
  SiteTable sites;
};

// ---- layout pins: a change here is a layout change, bump kLayoutVersion --------------------
static_assert(std::is_trivially_copyable_v<Record> && std::is_standard_layout_v<Record>);
static_assert(sizeof(DeviceCounters) ==
              24 * 8 + 2 * kHistogramBuckets * 8 + 32 + 7 * 8 + 6 * 8 + 2 * 8 + 14 * 8 + 5 * 8);
static_assert(sizeof(DeviceCounters) == 1008);
static_assert(offsetof(DeviceCounters, program_held_bytes) == 792);
static_assert(offsetof(DeviceCounters, program_served_bytes) == 824);
static_assert(offsetof(DeviceCounters, driver_calls) == 840);
static_assert(offsetof(DeviceCounters, driver_background_calls) == 856);
static_assert(offsetof(DeviceCounters, fence_syncs) == 968);
static_assert(sizeof(RecordHeader) == 64);
static_assert(sizeof(Identity) == 48 + kExeBytes + kCmdlineBytes);
static_assert(sizeof(Snapshot) == 64 + kMaxDevices * sizeof(DeviceCounters));
static_assert(sizeof(Snapshot) == 16192);
static_assert(sizeof(EventSlot) == 96);
static_assert(sizeof(EventRing) == 64 + kEventSlots * sizeof(EventSlot));
static_assert(sizeof(SiteFrame) == 168);
static_assert(sizeof(Site) == 24 + kMaxFrames * sizeof(SiteFrame));
static_assert(sizeof(SiteTable) == 64 + kMaxSites * sizeof(Site));
static_assert(offsetof(Record, header) == 0);
static_assert(offsetof(Record, identity) == 64);
static_assert(offsetof(Record, snapshot) == 64 + 1328);
static_assert(offsetof(Record, events) == 1392 + 16192);
static_assert(offsetof(Record, sites) == 17584 + 6208);
static_assert(sizeof(Record) == 23792 + 21952);
static_assert(offsetof(Snapshot, devices) == 64);
static_assert(offsetof(EventRing, slots) == 64);
static_assert(offsetof(SiteTable, sites) == 64);
static_assert((kEventSlots & (kEventSlots - 1)) == 0);

// ---- layouts a reader accepts -------------------------------------------------------------
// An older layout is this one with fewer counters at the end of DeviceCounters: the header,
// identity and snapshot head are where they are now, devices[] has a shorter stride, and the
// event ring and site table (unchanged themselves) follow the shorter snapshot.
struct LayoutInfo {
  std::uint32_t version;
  std::uint32_t record_size;
  std::uint32_t device_stride;  // bytes per DeviceCounters entry
  std::uint32_t events_offset;  // offsetof(Record, events)
  std::uint32_t sites_offset;   // offsetof(Record, sites)
};
constexpr LayoutInfo layout_with_stride(std::uint32_t version, std::size_t stride) {
  const std::size_t events = offsetof(Record, snapshot) + offsetof(Snapshot, devices) +
                             static_cast<std::size_t>(kMaxDevices) * stride;
  return {version, static_cast<std::uint32_t>(events + sizeof(EventRing) + sizeof(SiteTable)),
          static_cast<std::uint32_t>(stride), static_cast<std::uint32_t>(events),
          static_cast<std::uint32_t>(events + sizeof(EventRing))};
}
inline constexpr LayoutInfo kReadableLayouts[] = {
    layout_with_stride(kLayoutVersion, sizeof(DeviceCounters)),
    // 6: without the fence_* counters.
    layout_with_stride(6, offsetof(DeviceCounters, fence_syncs)),
    // 5: without the driver detail counters.
    layout_with_stride(5, offsetof(DeviceCounters, driver_background_calls)),
    // 4: without the driver_* counters.
    layout_with_stride(4, offsetof(DeviceCounters, driver_calls)),
    // 3: without the program_served_* counters.
    layout_with_stride(3, offsetof(DeviceCounters, program_served_bytes)),
    // 2: without the program_* counters.
    layout_with_stride(2, offsetof(DeviceCounters, program_held_bytes)),
};
static_assert(kReadableLayouts[0].record_size == sizeof(Record));
static_assert(kReadableLayouts[0].events_offset == offsetof(Record, events));
static_assert(kReadableLayouts[0].sites_offset == offsetof(Record, sites));
// Layouts 6, 5, 4, 3 and 2 as they were pinned when they were current.
static_assert(kReadableLayouts[1].record_size == 23152 + 21952);
static_assert(kReadableLayouts[1].events_offset == 1392 + 15552);
static_assert(kReadableLayouts[1].sites_offset == 16944 + 6208);
static_assert(kReadableLayouts[2].record_size == 21360 + 21952);
static_assert(kReadableLayouts[2].events_offset == 1392 + 13760);
static_assert(kReadableLayouts[2].sites_offset == 15152 + 6208);
static_assert(kReadableLayouts[3].record_size == 21104 + 21952);
static_assert(kReadableLayouts[3].events_offset == 1392 + 13504);
static_assert(kReadableLayouts[3].sites_offset == 14896 + 6208);
static_assert(kReadableLayouts[4].record_size == 20848 + 21952);
static_assert(kReadableLayouts[4].events_offset == 1392 + 13248);
static_assert(kReadableLayouts[4].sites_offset == 14640 + 6208);
static_assert(kReadableLayouts[5].record_size == 20336 + 21952);
static_assert(kReadableLayouts[5].events_offset == 1392 + 12736);
static_assert(kReadableLayouts[5].sites_offset == 14128 + 6208);

// The readable layout with this version, or null.
constexpr const LayoutInfo* find_layout(std::uint32_t version) {
  for (const LayoutInfo& l : kReadableLayouts) {
    if (l.version == version) return &l;
  }
  return nullptr;
}

}  // namespace gpustitch::shm
