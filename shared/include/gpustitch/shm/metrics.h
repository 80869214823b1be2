// The Prometheus metrics gpustitchd exports: one list, used by the exporter, its tests and the
// packaged Grafana dashboard. Labels follow dcgm-exporter's, so that the two join on a GPU:
//   per process and GPU (MetricScope::process): pid, user, command, cuda_device (the process's
//     own device ordinal), UUID, and where the driver lists the GPU gpu (its index, nvidia-smi's),
//     device ("nvidia<minor>"), modelName, pci_bus_id; Hostname; pod_uid and container_id when
//     the process runs in a Kubernetes pod (daemon/src/kube_cgroup.h).
//   per GPU (MetricScope::gpu), once per UUID whatever the number of processes on it: UUID, gpu,
//     device, modelName, pci_bus_id, Hostname.
//   per node (MetricScope::node): gpustitch_processes, no labels.
#pragma once

#include <cstdint>

#include "gpustitch/shm/record.h"

namespace gpustitch::shm {

enum class MetricKind { gauge, counter };
enum class MetricScope { process, gpu, node };

struct MetricSpec {
  const char* name;
  MetricKind kind;
  const char* help;
  // The counter it reads; null for the derived ones (fragmentation ratio, process count).
  std::uint64_t DeviceCounters::*field;
  MetricScope scope = MetricScope::process;
  // The field counts nanoseconds and the metric is in seconds (Prometheus's base unit).
  bool seconds_from_ns = false;
};

inline constexpr const char* kProcessesMetric = "gpustitch_processes";
inline constexpr const char* kFragmentationMetric = "gpustitch_fragmentation_ratio";

inline constexpr MetricSpec kMetrics[] = {
    {"gpustitch_allocated_bytes", MetricKind::gauge, "Bytes in live allocations (after rounding).",
     &DeviceCounters::bytes_allocated},
    {"gpustitch_reserved_bytes", MetricKind::gauge,
     "Physical memory the allocator holds from the driver.", &DeviceCounters::bytes_reserved},
    {"gpustitch_cached_bytes", MetricKind::gauge,
     "Reserved bytes not allocated (free for reuse, including pending).",
     &DeviceCounters::bytes_cached},
    {"gpustitch_pending_bytes", MetricKind::gauge,
     "Freed bytes waiting for device work to finish before reuse.", &DeviceCounters::bytes_pending},
    {"gpustitch_peak_allocated_bytes", MetricKind::gauge, "Highest allocated bytes so far.",
     &DeviceCounters::peak_allocated},
    {"gpustitch_peak_reserved_bytes", MetricKind::gauge, "Highest reserved bytes so far.",
     &DeviceCounters::peak_reserved},
    {"gpustitch_largest_free_block_bytes", MetricKind::gauge,
     "Largest cached block usable without stitching.", &DeviceCounters::largest_free_block},
    {"gpustitch_largest_possible_bytes", MetricKind::gauge,
     "Largest allocation that can succeed now (with stitching).",
     &DeviceCounters::largest_possible},
    {kFragmentationMetric, MetricKind::gauge, "1 - allocated/reserved.", nullptr},
    {"gpustitch_device_free_bytes", MetricKind::gauge,
     "Driver-reported free memory of the GPU (from the process that published last).",
     &DeviceCounters::device_free, MetricScope::gpu},
    {"gpustitch_device_total_bytes", MetricKind::gauge, "Driver-reported total memory of the GPU.",
     &DeviceCounters::device_total, MetricScope::gpu},
    {"gpustitch_program_mapped_bytes", MetricKind::gauge,
     "Device memory the program maps itself (cuMemCreate/cuMemMap): physical bytes it holds.",
     &DeviceCounters::program_held_bytes},
    {"gpustitch_program_served_bytes", MetricKind::gauge,
     "Of the memory the program maps itself, the bytes of handles the pool lent it.",
     &DeviceCounters::program_served_bytes},
    {"gpustitch_program_handles", MetricKind::gauge,
     "Physical memory handles the program created itself and has not released.",
     &DeviceCounters::program_handles},
    {kProcessesMetric, MetricKind::gauge, "Processes publishing gpustitch statistics.", nullptr,
     MetricScope::node},
    {"gpustitch_allocations_total", MetricKind::counter, "Allocations served.",
     &DeviceCounters::allocs},
    {"gpustitch_frees_total", MetricKind::counter, "Frees.", &DeviceCounters::frees},
    {"gpustitch_cache_hits_total", MetricKind::counter, "Allocations served from cached memory.",
     &DeviceCounters::cache_hits},
    {"gpustitch_fresh_allocations_total", MetricKind::counter,
     "Allocations served by creating new physical memory.", &DeviceCounters::fresh},
    {"gpustitch_stitches_total", MetricKind::counter,
     "Allocations served by stitching cached pieces.", &DeviceCounters::stitches},
    {"gpustitch_stitched_bytes_total", MetricKind::counter, "Bytes served by stitching.",
     &DeviceCounters::stitched_bytes},
    {"gpustitch_trims_total", MetricKind::counter, "Trim passes that released memory.",
     &DeviceCounters::trims},
    {"gpustitch_trimmed_bytes_total", MetricKind::counter, "Bytes released by trimming.",
     &DeviceCounters::trimmed_bytes},
    {"gpustitch_oom_total", MetricKind::counter, "Out-of-memory errors returned.",
     &DeviceCounters::ooms},
    {"gpustitch_driver_calls_total", MetricKind::counter,
     "Calls the pool made into the driver's memory API (create, map, set access, unmap, release).",
     &DeviceCounters::driver_calls},
    {"gpustitch_driver_seconds_total", MetricKind::counter,
     "Wall time the pool spent in those driver calls.", &DeviceCounters::driver_ns,
     MetricScope::process, true},
    {"gpustitch_driver_background_seconds_total", MetricKind::counter,
     "Of that time, the reclaimer thread's (unmaps off the program's threads).",
     &DeviceCounters::driver_background_ns, MetricScope::process, true},
    {"gpustitch_peak_reserved_pending_bytes", MetricKind::gauge,
     "When reserved last rose to its peak: freed bytes then waiting for the device's work.",
     &DeviceCounters::peak_reserved_pending},
    {"gpustitch_peak_reserved_allocated_bytes", MetricKind::gauge,
     "When reserved last rose to its peak: bytes then allocated.",
     &DeviceCounters::peak_reserved_allocated},
    {"gpustitch_fence_syncs_total", MetricKind::counter,
     "Device synchronizations the pool ran on the program's threads (a miss or trim fencing the "
     "frees it needs, an out-of-memory retry).",
     &DeviceCounters::fence_syncs},
    {"gpustitch_fence_sync_seconds_total", MetricKind::counter,
     "Wall time the program's threads spent in those synchronizations.",
     &DeviceCounters::fence_sync_ns, MetricScope::process, true},
    {"gpustitch_fence_waits_total", MetricKind::counter,
     "Allocations that waited for the reclaimer thread's fence (stream_miss_fence).",
     &DeviceCounters::fence_waits},
    {"gpustitch_fence_wait_seconds_total", MetricKind::counter,
     "Wall time the program's threads spent in those waits.", &DeviceCounters::fence_wait_ns,
     MetricScope::process, true},
    {"gpustitch_fence_waits_timed_out_total", MetricKind::counter,
     "Of those waits, the ones that ran out (200 ms bound) and took fresh memory instead.",
     &DeviceCounters::fence_waits_timed_out},
    {"gpustitch_coop_given_bytes_total", MetricKind::counter,
     "Idle cached bytes released because a process on the same GPU asked.",
     &DeviceCounters::coop_given_bytes},
    {"gpustitch_coop_gives_total", MetricKind::counter,
     "Release requests served that released memory.", &DeviceCounters::coop_gives},
    {"gpustitch_coop_received_bytes_total", MetricKind::counter,
     "Bytes other processes released for this process's allocations.",
     &DeviceCounters::coop_received_bytes},
    {"gpustitch_coop_receives_total", MetricKind::counter,
     "Replies from other processes that released memory.", &DeviceCounters::coop_receives},
    {"gpustitch_coop_asks_total", MetricKind::counter,
     "Allocations that would have failed and asked other processes to release memory.",
     &DeviceCounters::coop_asks},
    {"gpustitch_coop_requests_total", MetricKind::counter,
     "Release requests received from other processes.", &DeviceCounters::coop_requests},
    {"gpustitch_coop_dropped_total", MetricKind::counter,
     "Release requests dropped (rate limit, malformed, sender not permitted).",
     &DeviceCounters::coop_dropped},
};

// Labels of per-process series (the GPU's labels are dropped where the driver does not list it,
// the Kubernetes ones outside pods), and of per-GPU series.
inline constexpr const char* kProcessLabels[] = {
    "pid",    "user",      "command",    "cuda_device", "UUID",    "gpu",
    "device", "modelName", "pci_bus_id", "Hostname",    "pod_uid", "container_id"};
inline constexpr const char* kGpuLabels[] = {"UUID",      "gpu",        "device",
                                             "modelName", "pci_bus_id", "Hostname"};

}  // namespace gpustitch::shm
