#include "stats_client.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>

#include "gpustitch/shm/json.h"
#include "gpustitch/shm/names.h"
#include "gpustitch/shm/record_reader.h"

namespace gpustitch::cli {
using nlohmann::json;

void add_source_options(CLI::App& sub, SourceOptions& opts) {
  sub.add_option(
      "--socket", opts.socket,
      "gpustitchd socket (default $GPUSTITCH_SOCKET or " + std::string(shm::kDefaultSocket) + ")");
  auto* d = sub.add_flag("--direct", opts.direct,
                         "Read the records in /dev/shm directly instead of asking gpustitchd");
  sub.add_flag("--daemon", opts.daemon, "Ask gpustitchd only; fail when it is not reachable")
      ->excludes(d);
  sub.add_option("--prefix", opts.prefix, "Record name prefix (tests)")->group("");
}

std::string socket_path(const SourceOptions& opts) {
  if (!opts.socket.empty()) return opts.socket;
  if (const char* env = std::getenv("GPUSTITCH_SOCKET"); env && *env) return env;
  return shm::kDefaultSocket;
}

std::string record_prefix(const SourceOptions& opts) {
  if (!opts.prefix.empty()) return opts.prefix;
  if (const char* env = std::getenv("GPUSTITCH_SHM_PREFIX"); env && *env) return env;
  return std::string(shm::kDefaultPrefix);
}

namespace {
constexpr int kDaemonTimeoutMs = 2000;

// Asks the daemon unless told not to. Returns true when the answer (or a definitive failure)
// came from the daemon; false means "fall back to reading records directly".
bool ask_daemon(const SourceOptions& opts, const json& request, Fetched* out) {
  if (opts.direct) return false;
  std::string why;
  auto answer = shm::query_daemon(socket_path(opts), request, kDaemonTimeoutMs, &why);
  if (!answer) {
    if (opts.daemon || !opts.socket.empty()) {
      out->status = kUnreachable;
      out->error = "gpustitchd not reachable: " + why;
      return true;
    }
    return false;
  }
  out->source = "daemon";
  if (!answer->value("ok", false)) {
    out->error = answer->value("error", std::string("error"));
    out->status = out->error == "not found" ? kNotFound : kProblem;
    return true;
  }
  out->answer = std::move(*answer);
  return true;
}
}  // namespace

Fetched fetch_list(const SourceOptions& opts, bool summary) {
  Fetched f;
  if (ask_daemon(opts, json{{"cmd", "list"}, {"summary", summary}}, &f)) return f;
  f.source = "direct";
  f.answer = json{{"ok", true},
                  {"processes", shm::scan_processes_json(record_prefix(opts),
                                                         summary ? shm::JsonDetail::summary
                                                                 : shm::JsonDetail::counters)}};
  return f;
}

Fetched fetch_show(const SourceOptions& opts, long pid, unsigned history_seconds) {
  Fetched f;
  if (ask_daemon(opts, json{{"cmd", "show"}, {"pid", pid}, {"history_seconds", history_seconds}},
                 &f))
    return f;
  f.source = "direct";
  uid_t me = ::geteuid();
  std::optional<uid_t> only;
  if (me != 0) only = me;
  for (const auto& name : shm::discover_records(record_prefix(opts), only)) {
    if (name.pid != pid || !shm::record_process_alive(name)) continue;
    shm::ReadError err;
    auto reader = shm::RecordReader::open(name, only, &err);
    if (!reader) {
      f.status = kUnreachable;
      f.error = name.path() + ": " + shm::to_string(err);
      return f;
    }
    auto j = shm::read_process_json(*reader, shm::JsonDetail::full, &err);
    if (!j) {
      f.status = kUnreachable;
      f.error = name.path() + ": " + shm::to_string(err);
      return f;
    }
    f.answer = json{{"ok", true}, {"process", std::move(*j)}, {"history", json::array()}};
    return f;
  }
  f.status = kNotFound;
  f.error = "not found";
  return f;
}

std::string human_bytes(std::uint64_t bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 6) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, v < 10 ? "%.2f %s" : v < 100 ? "%.1f %s" : "%.0f %s", v, units[u]);
  return buf;
}

std::string percent(double ratio) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f%%", ratio * 100.0);
  return buf;
}

std::uint64_t u64(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number_unsigned() ? it->get<std::uint64_t>()
         : it != j.end() && it->is_number_integer()
             ? static_cast<std::uint64_t>(std::max<std::int64_t>(0, it->get<std::int64_t>()))
             : 0;
}

double f64(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : 0.0;
}

std::string str(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

int terminal_width() {
  if (const char* c = std::getenv("COLUMNS"); c && std::atoi(c) > 0) return std::atoi(c);
  winsize ws{};
  if (::isatty(STDOUT_FILENO) && ::ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col)
    return ws.ws_col;
  return 0;
}

std::string format_table(const std::vector<std::vector<std::string>>& rows,
                         const std::vector<bool>& right, int width) {
  std::vector<std::size_t> w;
  for (const auto& r : rows)
    for (std::size_t i = 0; i + 1 < r.size(); ++i) {
      if (w.size() <= i) w.resize(i + 1, 0);
      w[i] = std::max(w[i], r[i].size());
    }
  std::string out;
  for (const auto& r : rows) {
    std::string line;
    for (std::size_t i = 0; i < r.size(); ++i) {
      if (i) line += "  ";
      if (i + 1 == r.size()) {
        line += r[i];
        break;
      }
      std::string pad(w[i] - r[i].size(), ' ');
      line += (i < right.size() && right[i]) ? pad + r[i] : r[i] + pad;
    }
    if (width > 0 && line.size() > static_cast<std::size_t>(width)) line.resize(width);
    out += line + "\n";
  }
  return out;
}

void print_json(const json& j) {
  std::cout << j.dump(2, ' ', false, json::error_handler_t::replace) << "\n";
}

const std::vector<bool> kProcessRowAlign = {true, false, true, true, true,
                                            true, true,  true, true, false};

std::vector<std::vector<std::string>> process_rows(const json& processes, bool header) {
  std::vector<std::vector<std::string>> rows;
  if (header)
    rows.push_back({"PID", "USER", "DEV", "ALLOCATED", "RESERVED", "FRAG", "LARGEST FREE",
                    "STITCHES", "OOMS", "COMMAND"});
  for (const auto& p : processes) {
    const auto& devices = p.value("devices", json::array());
    std::string pid = std::to_string(u64(p, "pid"));
    std::string cmd = str(p, "command");
    if (cmd.empty()) cmd = str(p, "exe");
    if (devices.empty()) {
      rows.push_back({pid, str(p, "user"), "-", "-", "-", "-", "-", "-", "-", cmd});
      continue;
    }
    for (const auto& d : devices) {
      rows.push_back({pid, str(p, "user"), std::to_string(u64(d, "device")),
                      human_bytes(u64(d, "bytes_allocated")), human_bytes(u64(d, "bytes_reserved")),
                      percent(f64(d, "fragmentation")), human_bytes(u64(d, "largest_free_block")),
                      std::to_string(u64(d, "stitches")), std::to_string(u64(d, "ooms")), cmd});
    }
  }
  return rows;
}

}  // namespace gpustitch::cli
