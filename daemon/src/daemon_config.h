// gpustitchd's configuration file: /etc/gpustitch/gpustitchd.conf (or --config PATH), one
// `key = value` per line, `#` starts a comment. Unknown keys and bad values are reported one line
// each and ignored; everything else applies (the same policy as the allocator's GPUSTITCH_CONF).
// Re-read on SIGHUP.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace gpustitch::daemon {

struct DaemonConfig {
  std::string socket_path = "/run/gpustitch/gpustitchd.sock";  // socket
  unsigned socket_mode = 0666;                   // socket_mode (octal): who may connect at all
  unsigned sample_interval_ms = 1000;            // sample_interval_ms
  unsigned history_seconds = 3600;               // history_seconds: window kept per process
  std::string admin_group;                       // admin_group: members see every process
  unsigned prometheus_port = 0;                  // prometheus_port: 0 = off
  std::string prometheus_address = "127.0.0.1";  // prometheus_address
  std::string log_level = "info";                // log_level: trace|debug|info|warn|error|off
  std::string record_prefix = "gpustitch";       // record_prefix (tests only)
  bool reap = true;                              // reap: remove records of exited processes
  unsigned max_records = 4096;                   // max_records: processes tracked at most
  // max_records_per_uid: processes of one user tracked at most (root: only max_records), so that
  // one user's records, real or made up, cannot stop the tracking of everyone else.
  unsigned max_records_per_uid = 128;
  // max_devices: devices per process with a history. 0 = the GPUs the driver lists
  // (/proc/driver/nvidia/gpus), or 16 where it lists none. A record may claim 16 devices; the
  // history (history_capacity() points each) follows what the node really has.
  unsigned max_devices = 0;
  // Cooperative release: when a GPU's free memory (from the records) falls below this, ask the
  // processes on it with idle cache to release some (docs/coop.md). 0 = off.
  unsigned coop_floor_mb = 0;  // coop_floor_mb
  // hostname: the Prometheus label Hostname (dcgm-exporter's). "" = gethostname(). In a
  // Kubernetes DaemonSet, the node's name (--set hostname=$(NODE_NAME)).
  std::string hostname;
  // nvidia_gpus_dir: where the driver lists the node's GPUs (tests point it at a fixture).
  std::string nvidia_gpus_dir = "/proc/driver/nvidia/gpus";

  // Samples kept per process and device.
  std::size_t history_capacity() const {
    return std::max<std::size_t>(
        1, std::size_t(history_seconds) * 1000 / std::max(1u, sample_interval_ms));
  }
};

struct DaemonConfigResult {
  DaemonConfig config;
  std::vector<std::string> errors;
  // Keys whose line was rejected (the value of `base` was kept). The server treats a bad `socket`
  // line as fatal at start and as "keep the current socket" on reload: falling back to the default
  // path would take over whatever listens there.
  std::vector<std::string> bad_keys;
  bool unreadable = false;  // the file could not be read (errors.front() says why)
  bool bad(std::string_view key) const {
    for (const auto& k : bad_keys)
      if (k == key) return true;
    return false;
  }
};

DaemonConfigResult parse_daemon_config(std::string_view text, const DaemonConfig& base = {});
// Reads and parses a file. A file that cannot be read (missing, not a regular file, larger than
// kMaxConfigBytes) gives base, unreadable and one error line.
DaemonConfigResult load_daemon_config(const std::string& path, const DaemonConfig& base = {});

inline constexpr std::size_t kMaxConfigBytes = 1 << 20;

// Reads at most limit bytes of a regular file. Never blocks on a FIFO or a device, never grows
// without bound (`-c /dev/zero`). On failure returns false and says why.
bool read_bounded_file(const std::string& path, std::size_t limit, std::string* out,
                       std::string* why);

std::vector<std::string_view> daemon_config_keys();

}  // namespace gpustitch::daemon
