// Installation checks for `gpustitch doctor` (see doctor_install.h for the list).
//
// The preload library is proven loadable by running a trivial program (/bin/true) with it in
// LD_PRELOAD, in a child process with a time limit, never by loading it into the CLI: its
// constructor sets up interposition of the CUDA entry points, which has no business in the CLI,
// and a broken build must not crash the tool that is meant to diagnose it. The child gets
// GPUSTITCH_CONF=enable:off,publish:off so that it touches neither the GPU nor /dev/shm. The
// dynamic loader reports a library it cannot preload on stderr and runs the program anyway, so
// success is "exit status 0 and no loader error".
#include "doctor_install.h"

#include <fcntl.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <string_view>

#include "bounded_file.h"
#include "gpustitch/config.h"
#if GPUSTITCH_HAVE_DAEMON_CONFIG
#include "daemon_config.h"  // the daemon's own parser: same keys, same errors
#endif

extern char** environ;

namespace gpustitch::cli::install {
namespace {

std::string trim(std::string_view s) {
  const char* ws = " \t\r\n";
  std::size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  std::size_t e = s.find_last_not_of(ws);
  return std::string(s.substr(b, e - b + 1));
}

// Configuration and unit files are a few KiB; 1 MiB is generous. Anything that is not a regular
// file (a FIFO would block the doctor, /dev/zero would fill its memory) is refused.
constexpr std::uint64_t kMaxConfigFileBytes = 1 << 20;

std::optional<std::string> read_file(const std::string& path, std::string* why = nullptr) {
  std::string bytes, reason;
  if (replay::read_bounded_file(path, kMaxConfigFileBytes, &bytes, &reason) !=
      replay::BoundedRead::ok) {
    if (why) *why = reason;
    return std::nullopt;
  }
  return bytes;
}

std::string errno_text(int err) {
  return std::strerror(err);
}

bool is_executable_file(const std::string& path, std::string* why) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    *why = path + ": " + errno_text(errno);
    return false;
  }
  if (!S_ISREG(st.st_mode)) {
    *why = path + ": not a regular file";
    return false;
  }
  if ((st.st_mode & 0111) == 0) {
    *why = path + ": not executable";
    return false;
  }
  return true;
}

// --- preload library ---------------------------------------------------------------------------

struct ProbeResult {
  bool ran = false;
  int status = -1;
  std::string output;  // stderr of the probe
  std::string error;   // why the probe could not run
};

// Runs program with LD_PRELOAD=library; returns what the loader and the program said.
ProbeResult probe_preload(const std::string& program, const std::string& library, int timeout_ms) {
  ProbeResult r;
  std::vector<std::string> env_store;
  for (char** e = environ; e && *e; ++e) {
    std::string_view kv(*e);
    if (kv.starts_with("LD_PRELOAD=") || kv.starts_with("GPUSTITCH_CONF=")) continue;
    env_store.emplace_back(kv);
  }
  env_store.push_back("LD_PRELOAD=" + library);
  env_store.push_back("GPUSTITCH_CONF=enable:off,publish:off");
  std::vector<char*> envp;
  for (auto& s : env_store) envp.push_back(s.data());
  envp.push_back(nullptr);

  int pipefd[2];
  if (::pipe2(pipefd, O_CLOEXEC) != 0) {
    r.error = "pipe: " + errno_text(errno);
    return r;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, pipefd[1], STDERR_FILENO);
  std::string prog = program;
  char* argv[] = {prog.data(), nullptr};
  pid_t pid = -1;
  int rc = ::posix_spawn(&pid, prog.c_str(), &actions, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&actions);
  ::close(pipefd[1]);
  if (rc != 0) {
    ::close(pipefd[0]);
    r.error = "cannot run " + program + ": " + errno_text(rc);
    return r;
  }
  // Read stderr until EOF or the deadline.
  timespec start;
  ::clock_gettime(CLOCK_MONOTONIC, &start);
  bool timed_out = false;
  char buf[1024];
  for (;;) {
    timespec now;
    ::clock_gettime(CLOCK_MONOTONIC, &now);
    long elapsed = (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
    if (elapsed >= timeout_ms) {
      timed_out = true;
      break;
    }
    pollfd p{pipefd[0], POLLIN, 0};
    int n = ::poll(&p, 1, static_cast<int>(timeout_ms - elapsed));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      timed_out = n == 0;
      break;
    }
    ssize_t got = ::read(pipefd[0], buf, sizeof buf);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    if (r.output.size() < 16384) r.output.append(buf, static_cast<std::size_t>(got));
  }
  ::close(pipefd[0]);
  if (timed_out) ::kill(pid, SIGKILL);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (timed_out) {
    r.error = program + " did not finish within " + std::to_string(timeout_ms) + " ms";
    return r;
  }
  r.ran = true;
  r.status = status;
  return r;
}

DoctorCheck check_preload_library(const InstallLayout& l) {
  DoctorCheck c{"preload library", false, ""};
  std::string path = l.at(l.preload_library);
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    c.detail = path + ": missing (reinstall the gpustitch package)";
    return c;
  }
  if (::access(path.c_str(), R_OK) != 0) {
    c.detail = path + ": not readable: " + errno_text(errno);
    return c;
  }
  ProbeResult p = probe_preload(l.probe_program, path, 10000);
  if (!p.ran) {
    c.detail = path + ": could not test loading it: " + p.error;
    return c;
  }
  std::string said = trim(p.output);
  if (said.find("cannot be preloaded") != std::string::npos ||
      said.find("ld.so") != std::string::npos) {
    c.detail = path + ": the dynamic loader rejects it: " + said;
    return c;
  }
  if (!WIFEXITED(p.status) || WEXITSTATUS(p.status) != 0) {
    c.detail = path + ": " + l.probe_program + " with it preloaded " +
               (WIFSIGNALED(p.status) ? "died of signal " + std::to_string(WTERMSIG(p.status))
                                      : "exited " + std::to_string(WEXITSTATUS(p.status))) +
               (said.empty() ? "" : ": " + said);
    return c;
  }
  c.ok = true;
  c.detail = path + ": loads";
  return c;
}

// --- configuration -----------------------------------------------------------------------------

#if !GPUSTITCH_HAVE_DAEMON_CONFIG
struct KeyValues {
  std::vector<std::pair<std::string, std::string>> entries;
  std::vector<std::string> errors;
};

// gpustitchd.conf: "key = value" lines, '#' comments, blank lines. Used only when the daemon's own
// parser is not built into the CLI (a checkout without daemon/).
KeyValues parse_key_values(const std::string& text) {
  KeyValues kv;
  std::istringstream in(text);
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    std::string t = trim(line.substr(0, line.find('#')));
    if (t.empty()) continue;
    std::size_t eq = t.find('=');
    std::string key = eq == std::string::npos ? "" : trim(t.substr(0, eq));
    bool key_ok = !key.empty();
    for (char ch : key)
      if (!(ch == '_' || ch == '-' || ch == '.' || (ch >= 'a' && ch <= 'z') ||
            (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9')))
        key_ok = false;
    if (!key_ok) {
      kv.errors.push_back("line " + std::to_string(lineno) + ": expected key = value");
      continue;
    }
    kv.entries.emplace_back(key, trim(t.substr(eq + 1)));
  }
  return kv;
}
#endif

DoctorCheck check_daemon_config(const InstallLayout& l, std::string* socket) {
  DoctorCheck c{"daemon config", false, ""};
  std::string path = l.at(l.daemon_config);
  std::string why;
  auto text = read_file(path, &why);
  if (!text) {
    c.detail = why;
    return c;
  }
#if GPUSTITCH_HAVE_DAEMON_CONFIG
  auto parsed = gpustitch::daemon::parse_daemon_config(*text);
  const std::vector<std::string>& errors = parsed.errors;
  *socket = parsed.config.socket_path;
#else
  KeyValues kv = parse_key_values(*text);
  const std::vector<std::string>& errors = kv.errors;
  for (auto& [k, v] : kv.entries)
    if (k == "socket" && !v.empty()) *socket = v;
#endif
  if (!errors.empty()) {
    c.detail = path + ": " + errors.front() +
               (errors.size() > 1 ? " (and " + std::to_string(errors.size() - 1) + " more)" : "");
    return c;
  }
  c.ok = true;
  c.detail = path + ": accepted";
  return c;
}

DoctorCheck check_preload_config(const InstallLayout& l) {
  DoctorCheck c{"preload config", false, ""};
  std::string path = l.at(l.preload_config);
  std::string why;
  auto text = read_file(path, &why);
  if (!text) {
    c.detail = why;
    return c;
  }
  // One key:value per line; together they form a GPUSTITCH_CONF value.
  std::string joined;
  std::size_t count = 0;
  std::istringstream in(*text);
  std::string line;
  while (std::getline(in, line)) {
    std::string t = trim(line);
    if (t.empty() || t[0] == '#') continue;
    if (!joined.empty()) joined += ',';
    joined += t;
    ++count;
  }
  ConfigResult r = parse_config(joined);
  if (!r.errors.empty()) {
    c.detail = path + ": " + r.errors.front();
    return c;
  }
  c.ok = true;
  c.detail = path + ": " + std::to_string(count) + " setting(s), all accepted";
  return c;
}

DoctorCheck check_environment_config() {
  DoctorCheck c{"GPUSTITCH_CONF", true, ""};
  const char* v = std::getenv("GPUSTITCH_CONF");
  if (!v || !*v) {
    c.detail = "not set (library defaults)";
    return c;
  }
  ConfigResult r = parse_config(v);
  if (!r.errors.empty()) {
    c.ok = false;
    c.detail = r.errors.front();
    return c;
  }
  c.detail = std::string("\"") + v + "\" accepted";
  return c;
}

// --- systemd integration -----------------------------------------------------------------------

DoctorCheck check_unit(const InstallLayout& l) {
  DoctorCheck c{"systemd unit", false, ""};
  std::string path = l.at(l.unit);
  auto text = read_file(path);
  if (!text) {
    c.detail = path + ": missing";
    return c;
  }
  std::string exec;
  std::istringstream in(*text);
  std::string line;
  while (std::getline(in, line)) {
    std::string t = trim(line);
    if (t.starts_with("ExecStart=")) {
      std::string cmd = trim(t.substr(10));
      // Strip systemd's prefixes (-, @, :, +, !) and take the program.
      std::size_t b = cmd.find_first_not_of("-@:+!");
      cmd = b == std::string::npos ? "" : cmd.substr(b);
      exec = cmd.substr(0, cmd.find_first_of(" \t"));
      break;
    }
  }
  if (exec != l.daemon) {
    c.detail = path + ": ExecStart= runs \"" + exec + "\", expected " + l.daemon;
    return c;
  }
  c.ok = true;
  c.detail = path;
  struct stat st;
  std::string override_unit = l.at("/etc/systemd/system/gpustitchd.service");
  std::string dropins = l.at("/etc/systemd/system/gpustitchd.service.d");
  if (::stat(override_unit.c_str(), &st) == 0)
    c.detail += " (overridden by " + override_unit + ")";
  else if (::stat(dropins.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
    c.detail += " (drop-ins in " + dropins + ")";
  return c;
}

DoctorCheck check_present(const std::string& name, const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return {name, false, path + ": " + errno_text(errno)};
  return {name, true, path};
}

DoctorCheck check_service_user(const InstallLayout& l) {
  DoctorCheck c{"service user", true, ""};
  if (!l.root.empty()) {
    c.detail = "not checked below another root";
    return c;
  }
  if (::getpwnam(l.service_user.c_str()) == nullptr) {
    c.ok = false;
    c.detail = l.service_user + ": no such user (systemd-sysusers " + l.sysusers + " creates it)";
    return c;
  }
  c.detail = l.service_user;
  return c;
}

DoctorCheck check_runtime_dir(const InstallLayout& l) {
  DoctorCheck c{"runtime directory", false, ""};
  std::string path = l.at(l.runtime_dir);
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    c.detail = path + ": missing (systemd-tmpfiles --create " + l.tmpfiles + ")";
    return c;
  }
  c.ok = true;
  c.detail = path;
  return c;
}

DoctorCheck check_socket(const std::string& path) {
  DoctorCheck c{"daemon socket", false, ""};
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) {
    c.detail = path + ": path too long for a Unix socket";
    return c;
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    c.detail = "socket: " + errno_text(errno);
    return c;
  }
  int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  int err = rc == 0 ? 0 : errno;
  ::close(fd);
  if (rc == 0 || err == EAGAIN) {  // EAGAIN: listening, backlog full
    c.ok = true;
    c.detail = path + ": accepting connections";
  } else {
    c.detail =
        path + ": " + errno_text(err) + " (is gpustitchd running? systemctl status gpustitchd)";
  }
  return c;
}

DoctorCheck check_ld_so_preload(const InstallLayout& l) {
  DoctorCheck c{"ld.so.preload", true, ""};
  std::string path = l.at("/etc/ld.so.preload");
  auto text = read_file(path);
  if (!text) {
    c.detail = "not used (node-wide preloading off)";
    return c;
  }
  std::vector<std::string> ours;
  std::string entry;
  for (char ch : *text + " ") {
    if (ch == ' ' || ch == '\t' || ch == '\n' || ch == ':') {
      if (entry.find("libgpustitch") != std::string::npos) ours.push_back(entry);
      entry.clear();
    } else {
      entry += ch;
    }
  }
  if (ours.empty()) {
    c.detail = path + " does not name libgpustitch.so";
    return c;
  }
  for (auto& e : ours) {
    struct stat st;
    if (::stat(l.at(e).c_str(), &st) != 0) {
      c.ok = false;
      c.detail = path + " names " + e +
                 ", which does not exist: every program prints a loader "
                 "error (remove the line or reinstall)";
      return c;
    }
  }
  c.detail = path + " preloads " + ours.front() + " node-wide";
  if (ours.front() != l.preload_library) c.detail += " (installed copy: " + l.preload_library + ")";
  return c;
}

DoctorCheck check_dev_shm() {
  DoctorCheck c{"/dev/shm", false, ""};
  struct stat st;
  if (::stat("/dev/shm", &st) != 0 || !S_ISDIR(st.st_mode)) {
    c.detail = "missing: processes cannot publish statistics";
    return c;
  }
  if ((st.st_mode & 01777) != 01777) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", st.st_mode & 07777);
    c.detail = std::string("mode ") + mode + ", expected 1777: other users cannot publish records";
    return c;
  }
  c.ok = true;
  c.detail = "shared-memory directory present";
  return c;
}

}  // namespace

InstallLayout InstallLayout::installed() {
  InstallLayout l;
  l.preload_library = GPUSTITCH_PRELOAD_PATH;
  l.daemon = GPUSTITCH_DAEMON_PATH;
  l.daemon_config = GPUSTITCH_DAEMON_CONF;
  l.preload_config = GPUSTITCH_PRELOAD_CONF;
  l.unit = GPUSTITCH_UNIT_PATH;
  l.sysusers = GPUSTITCH_SYSUSERS_PATH;
  l.tmpfiles = GPUSTITCH_TMPFILES_PATH;
  l.runtime_dir = GPUSTITCH_RUNTIME_DIR;
  l.socket = GPUSTITCH_SOCKET_PATH;
  l.service_user = GPUSTITCH_SERVICE_USER;
  return l;
}

InstallLayout InstallLayout::under(std::string root) {
  InstallLayout l = installed();
  while (!root.empty() && root.back() == '/') root.pop_back();
  l.root = std::move(root);
  return l;
}

std::vector<DoctorCheck> check_installation(const InstallLayout& l) {
  std::vector<DoctorCheck> out;
  out.push_back(check_preload_library(l));
  {
    DoctorCheck c{"daemon binary", false, ""};
    std::string path = l.at(l.daemon), why;
    c.ok = is_executable_file(path, &why);
    c.detail = c.ok ? path : why;
    out.push_back(c);
  }
  std::string socket = l.socket;
  out.push_back(check_daemon_config(l, &socket));
  out.push_back(check_preload_config(l));
  out.push_back(check_environment_config());
  out.push_back(check_unit(l));
  out.push_back(check_present("sysusers.d entry", l.at(l.sysusers)));
  out.push_back(check_present("tmpfiles.d entry", l.at(l.tmpfiles)));
  out.push_back(check_service_user(l));
  out.push_back(check_runtime_dir(l));
  out.push_back(check_socket(l.at(socket)));
  out.push_back(check_ld_so_preload(l));
  out.push_back(check_dev_shm());
  return out;
}

std::vector<DoctorCheck> check_installation() {
  return check_installation(InstallLayout::installed());
}

}  // namespace gpustitch::cli::install
