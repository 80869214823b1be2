// gpustitchd: collects the statistics records of every process that runs the gpustitch pool and
// serves them on a Unix socket (JSON) and, optionally, as Prometheus text. See docs/stats.md.
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>

#include <CLI/CLI.hpp>

#include "daemon_config.h"
#include "server.h"

int main(int argc, char** argv) {
  CLI::App app{"gpustitchd: gpustitch statistics daemon"};
  std::string config_path = "/etc/gpustitch/gpustitchd.conf";
  std::vector<std::string> sets;
  std::string socket_path;
  unsigned port = 0;
  bool port_set = false;
  std::string log_level;
  auto* config_opt =
      app.add_option("-c,--config", config_path, "Configuration file (key = value lines)");
  app.add_option("--socket", socket_path, "Query socket path (overrides the file's `socket`)");
  app.add_option("--prometheus-port", port, "Serve Prometheus metrics on this port (0 = off)")
      ->each([&](const std::string&) { port_set = true; });
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error|off");
  app.add_option("-s,--set", sets, "Override a config key: --set key=value (repeatable)");
  app.set_version_flag("--version", std::string(GPUSTITCH_VERSION));
  CLI11_PARSE(app, argc, argv);

  // stderr, no colors, no timestamps when the journal adds its own.
  auto logger = spdlog::stderr_logger_mt("gpustitchd");
  spdlog::set_default_logger(logger);
  spdlog::set_pattern(std::getenv("JOURNAL_STREAM") ? "%l: %v" : "%Y-%m-%d %H:%M:%S.%e %l: %v");

  // Two descriptors per tracked process (its record and its pidfd): lift the soft limit.
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &lim);
  }

  // The options become key = value lines: a value with a line break would smuggle in other keys.
  for (const auto* v : {&socket_path, &log_level, &config_path})
    if (v->find_first_of("\r\n") != std::string::npos) {
      spdlog::error("command line: a value contains a line break");
      return 2;
    }
  for (const auto& s : sets)
    if (s.find_first_of("\r\n") != std::string::npos) {
      spdlog::error("command line: --set {}: contains a line break", s.substr(0, s.find('\n')));
      return 2;
    }

  gpustitch::daemon::ServerOptions options;
  options.config_path = config_path;
  options.config_required = config_opt->count() > 0 && !config_path.empty();
  for (const auto& s : sets) options.override_text += s + "\n";
  if (!socket_path.empty()) options.override_text += "socket = " + socket_path + "\n";
  if (port_set) options.override_text += "prometheus_port = " + std::to_string(port) + "\n";
  if (!log_level.empty()) options.override_text += "log_level = " + log_level + "\n";
  return gpustitch::daemon::run_server(options);
}
