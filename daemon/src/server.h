// gpustitchd's event loop (Boost.Asio, one thread): the sampling timer, the Unix query socket,
// the optional Prometheus HTTP endpoint (Boost.Beast), and signals (SIGHUP reloads the config
// file, SIGTERM/SIGINT stop cleanly). Everything runs on one thread, so the process table needs
// no locks; a sampling pass over 1,000 records takes a few ms, well inside one interval.
#pragma once

#include <memory>
#include <string>

#include "daemon_config.h"

namespace gpustitch::daemon {

struct ServerOptions {
  std::string config_path;       // re-read on SIGHUP; "" = none
  bool config_required = false;  // named on the command line: missing or unreadable is fatal
  std::string override_text;     // key=value lines from the command line, applied after the file
};

// Runs until SIGTERM/SIGINT. Returns the process exit status.
int run_server(const ServerOptions& options);

// Applies log_level to spdlog.
void apply_log_level(const std::string& level);

}  // namespace gpustitch::daemon
