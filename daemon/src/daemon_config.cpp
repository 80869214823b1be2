#include "daemon_config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstring>

namespace gpustitch::daemon {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r'))
    s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r'))
    s.remove_suffix(1);
  return s;
}

bool parse_unsigned(std::string_view v, unsigned* out, int base = 10) {
  if (v.empty()) return false;
  unsigned x = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), x, base);
  if (ec != std::errc{} || p != v.data() + v.size()) return false;
  *out = x;
  return true;
}

bool parse_bool(std::string_view v, bool* out) {
  if (v == "on" || v == "true" || v == "yes" || v == "1") return *out = true, true;
  if (v == "off" || v == "false" || v == "no" || v == "0") return *out = false, true;
  return false;
}

}  // namespace

std::vector<std::string_view> daemon_config_keys() {
  return {"socket",
          "socket_mode",
          "sample_interval_ms",
          "history_seconds",
          "admin_group",
          "prometheus_port",
          "prometheus_address",
          "log_level",
          "record_prefix",
          "reap",
          "max_records",
          "max_records_per_uid",
          "max_devices",
          "coop_floor_mb",
          "hostname",
          "nvidia_gpus_dir"};
}

DaemonConfigResult parse_daemon_config(std::string_view text, const DaemonConfig& base) {
  DaemonConfigResult r{base, {}, {}, false};
  DaemonConfig& c = r.config;
  int lineno = 0;
  while (!text.empty()) {
    std::size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view{} : text.substr(nl + 1);
    ++lineno;
    if (std::size_t hash = line.find('#'); hash != std::string_view::npos)
      line = line.substr(0, hash);
    line = trim(line);
    if (line.empty()) continue;
    std::size_t eq = line.find('=');
    std::string_view key =
        eq == std::string_view::npos ? std::string_view{} : trim(line.substr(0, eq));
    auto bad = [&](const std::string& why) {
      r.errors.push_back("line " + std::to_string(lineno) + ": " + why);
      r.bad_keys.emplace_back(key);
    };
    if (eq == std::string_view::npos) {
      bad("expected key = value");
      continue;
    }
    std::string_view value = trim(line.substr(eq + 1));
    std::string k(key);
    unsigned u = 0;
    if (key == "socket") {
      if (value.empty() || value.front() != '/')
        bad("socket: needs an absolute path");
      else if (value.size() >= 108)  // sizeof(sockaddr_un::sun_path), NUL included
        bad("socket: path longer than 107 bytes");
      else
        c.socket_path = std::string(value);
    } else if (key == "socket_mode") {
      if (!parse_unsigned(value, &u, 8) || u > 0777)
        bad("socket_mode: expected octal like 0660");
      else
        c.socket_mode = u;
    } else if (key == "sample_interval_ms") {
      if (!parse_unsigned(value, &u) || u < 10 || u > 3600000)
        bad("sample_interval_ms: 10..3600000");
      else
        c.sample_interval_ms = u;
    } else if (key == "history_seconds") {
      if (!parse_unsigned(value, &u) || u > 7 * 86400)
        bad("history_seconds: 0..604800");
      else
        c.history_seconds = u;
    } else if (key == "admin_group") {
      c.admin_group = std::string(value);
    } else if (key == "prometheus_port") {
      if (!parse_unsigned(value, &u) || u > 65535)
        bad("prometheus_port: 0..65535");
      else
        c.prometheus_port = u;
    } else if (key == "prometheus_address") {
      if (value.empty())
        bad("prometheus_address: empty");
      else
        c.prometheus_address = std::string(value);
    } else if (key == "log_level") {
      static const char* levels[] = {"trace", "debug", "info", "warn", "error", "critical", "off"};
      bool ok = false;
      for (auto* l : levels) ok |= value == l;
      if (!ok)
        bad("log_level: trace|debug|info|warn|error|critical|off");
      else
        c.log_level = std::string(value);
    } else if (key == "record_prefix") {
      bool ok = !value.empty() && value.size() < 64;
      for (char ch : value)
        ok &= (std::isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '-');
      if (!ok)
        bad("record_prefix: letters, digits, '_' and '-' only");
      else
        c.record_prefix = std::string(value);
    } else if (key == "reap") {
      bool b;
      if (!parse_bool(value, &b))
        bad("reap: on|off");
      else
        c.reap = b;
    } else if (key == "max_records") {
      if (!parse_unsigned(value, &u) || u == 0)
        bad("max_records: a positive number");
      else
        c.max_records = u;
    } else if (key == "max_records_per_uid") {
      if (!parse_unsigned(value, &u) || u == 0)
        bad("max_records_per_uid: a positive number");
      else
        c.max_records_per_uid = u;
    } else if (key == "max_devices") {
      if (!parse_unsigned(value, &u) || u > 16)
        bad("max_devices: 0 (the driver's GPU count) .. 16");
      else
        c.max_devices = u;
    } else if (key == "coop_floor_mb") {
      if (!parse_unsigned(value, &u) || u > (1u << 30))
        bad("coop_floor_mb: MiB, 0 = off");
      else
        c.coop_floor_mb = u;
    } else if (key == "hostname") {
      bool ok = value.size() <= 253;
      for (char ch : value) ok &= ch > 0x20 && ch < 0x7f && ch != '"' && ch != '\\';
      if (!ok)
        bad("hostname: at most 253 printable characters, no quotes or spaces");
      else
        c.hostname = std::string(value);
    } else if (key == "nvidia_gpus_dir") {
      if (value.empty() || value.front() != '/')
        bad("nvidia_gpus_dir: needs an absolute path");
      else
        c.nvidia_gpus_dir = std::string(value);
    } else {
      bad("unknown key '" + k + "'");
    }
  }
  return r;
}

bool read_bounded_file(const std::string& path, std::size_t limit, std::string* out,
                       std::string* why) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    *why = std::strerror(errno);
    return false;
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    *why = S_ISDIR(st.st_mode) ? "is a directory" : "not a regular file";
    ::close(fd);
    return false;
  }
  out->clear();
  char buf[65536];
  while (true) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      *why = std::strerror(errno);
      ::close(fd);
      return false;
    }
    if (n == 0) break;
    if (out->size() + static_cast<std::size_t>(n) > limit) {
      *why = "larger than " + std::to_string(limit) + " bytes";
      ::close(fd);
      return false;
    }
    out->append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return true;
}

DaemonConfigResult load_daemon_config(const std::string& path, const DaemonConfig& base) {
  std::string text, why;
  if (!read_bounded_file(path, kMaxConfigBytes, &text, &why)) {
    DaemonConfigResult r{base, {}, {}, false};
    r.errors.push_back(path + ": " + why);
    r.unreadable = true;
    return r;
  }
  return parse_daemon_config(text, base);
}

}  // namespace gpustitch::daemon
