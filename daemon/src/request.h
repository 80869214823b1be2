// gpustitchd's query protocol: one JSON object per line in, one JSON object per line out.
//
//   {"cmd":"ping"}                               -> {"ok":true,"version":..,"pid":..}
//   {"cmd":"list"}                               -> {"ok":true,"processes":[<process>...]}
//   {"cmd":"show","pid":N,"history_seconds":S}   -> {"ok":true,"process":<process with detail>,
//                                                    "history":[{"device","time_ns":[..],
//                                                    "allocated":[..],"reserved":[..],
//                                                    "largest_free":[..]}]}
//   {"cmd":"status"}                             -> {"ok":true,"tracked":..,"passes":..,
//                                                    "last_pass":{..}} (last_pass, node-wide
//                                                    figures, only for root and admin_group)
// Errors: {"ok":false,"error":"..."} (a process the caller may not see is "not found", exactly
// as one that does not exist, so the answer reveals nothing about other users).
//
// Who sees what is decided from the peer's credentials (SO_PEERCRED): root and members of the
// configured admin group see every process, anyone else only processes of their own uid.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpustitch/shm/json.h"
#include "process_table.h"

namespace gpustitch::daemon {

inline constexpr std::size_t kMaxRequestBytes = 4096;

enum class Command { ping, list, show, status };

struct Request {
  Command cmd = Command::ping;
  pid_t pid = 0;
  std::uint32_t history_seconds = 600;
  bool summary = false;  // list: only the fields ps/top show
};

// Parses one request line. Never throws; on failure returns nullopt and sets *why.
std::optional<Request> parse_request(std::string_view line, std::string* why);

struct Peer {
  uid_t uid = 0;
  gid_t gid = 0;
  pid_t pid = 0;
  std::vector<gid_t> groups;  // supplementary groups of the peer process
};

// Whether peer may see every process (root or a member of admin_group).
bool peer_sees_all(const Peer& peer, const std::string& admin_group);
// Supplementary groups of a process from /proc/<pid>/status ("Groups:").
std::vector<gid_t> process_groups(pid_t pid);

// gpus: the node's GPUs, to name each device's GPU (shm::add_gpu_fields); null: only the UUID.
nlohmann::json process_summary_json(const TrackedProcess& p, shm::JsonDetail detail,
                                    const shm::GpuInventory* gpus = nullptr);
// The process's full figures, events and sites; its history is answered beside it (show).
nlohmann::json process_detail_json(const TrackedProcess& p,
                                   const shm::GpuInventory* gpus = nullptr);

// Answers one request line for peer. Never throws.
std::string handle_request(std::string_view line, const Peer& peer, const ProcessTable& table,
                           const DaemonConfig& config);

}  // namespace gpustitch::daemon
