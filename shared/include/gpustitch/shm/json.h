// The JSON form of a record, shared by gpustitchd (socket answers) and the gpustitch CLI (direct
// mode), so both show the same fields with the same names. Numbers stay numbers (bytes as
// integers, ratios as doubles). Part of gpustitch_shm_json, not of gpustitch_shm: the preload
// library never formats JSON.
//
// Process object:
//   {"pid","uid","user","start_time","exe","command","created_ns","publish_interval_ms",
//    "heartbeat_ns","publish_count","devices":[{"device","uuid", <every counter>,
//    "fragmentation","hist_allocs":[..],"hist_live":[..]}],
//    "events":[{"index","kind","device","time_ns","size",...}], "events_dropped",
//    "sites":[{"live_bytes","count","device","frames":[{"function","library","offset"}]}]}
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "gpustitch/shm/gpu_inventory.h"
#include "gpustitch/shm/record_reader.h"

namespace gpustitch::shm {

std::string uuid_string(const std::uint8_t (&uuid)[kUuidBytes]);  // "" when all zero
std::string user_name(uid_t uid);                                 // passwd name, or the number

// How much of a record goes into JSON. summary: what ps/top show (identity: pid, uid, user,
// command, exe; per device: device, uuid, allocated, reserved, cached, fragmentation, largest
// free block, stitches, OOMs, device free/total). counters: every counter. full: counters plus
// histograms, events and allocation sites.
enum class JsonDetail { summary, counters, full };

nlohmann::json device_to_json(const DeviceCounters& d, JsonDetail detail);
nlohmann::json event_to_json(const EventCopy& e);
nlohmann::json site_to_json(const SiteCopy& s);
nlohmann::json identity_to_json(const ProcessIdentity& id, JsonDetail detail);

// Adds, to every device of a process object ({"devices":[{"uuid",..}]}) whose GPU the driver
// lists, "gpu" (its index, nvidia-smi's), "gpu_name" and "pci_bus_id" (gpu_inventory.h). Devices
// of GPUs the driver does not list (simulated, MIG, no driver) keep only "device" and "uuid".
void add_gpu_fields(nlohmann::json& process, const GpuInventory& gpus);

// Everything a reader can get from a record now (snapshot, events, sites), or nullopt with *err.
std::optional<nlohmann::json> read_process_json(const RecordReader& reader, JsonDetail detail,
                                                ReadError* err);

// Scans the caller's own records (all records when the caller is root) directly, without the
// daemon, skipping records whose process is gone. Used by the CLI when gpustitchd is not running.
// A record of the caller's own uid whose heartbeat is fresh (within 3 publish intervals, at
// least 1 s) is taken as alive without reading /proc; any other record is checked against /proc
// (pid, start time, owner), so another user's record cannot pass for a process it is not.
nlohmann::json scan_processes_json(std::string_view prefix, JsonDetail detail);
// The same scan, handing each live record and its snapshot to visit instead of building JSON.
void scan_processes(std::string_view prefix,
                    const std::function<void(const RecordReader&, const SnapshotCopy&)>& visit);

// Talks to gpustitchd: sends one request line, returns the parsed answer, or nullopt with *why.
std::optional<nlohmann::json> query_daemon(const std::string& socket_path,
                                           const nlohmann::json& request, int timeout_ms,
                                           std::string* why);
// The same, returning the answer line unparsed (for callers that parse it their own way).
std::optional<std::string> query_daemon_text(const std::string& socket_path,
                                             const nlohmann::json& request, int timeout_ms,
                                             std::string* why);

inline constexpr const char* kDefaultSocket = "/run/gpustitch/gpustitchd.sock";

}  // namespace gpustitch::shm
