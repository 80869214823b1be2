// Helpers for the daemon's process-level tests (test_stats_e2e.cpp, test_daemon_soak.cpp): start
// programs with their stdout on a pipe, read their lines, wait for conditions, and run producer
// programs under LD_PRELOAD=libgpustitch.so on the simulated backend.
//
// The build passes the paths: GPUSTITCHD, GPUSTITCH_CLI, PRELOAD_PRODUCER (preload_producer.cpp),
// PRELOAD (the LD_PRELOAD value: the shim, after the sanitizer runtime in sanitizer builds) and
// CUDA_LIB_PATH (the directories of the CUDA runtime and driver test doubles).
#pragma once

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "test_helpers.h"  // eventually()

extern char** environ;

namespace gpustitch::test {

using namespace std::chrono_literals;

struct Child {
  pid_t pid = -1;
  int out = -1;  // read end of its stdout
};

// Starts argv with stdout on a pipe, with the calling process's environment plus env
// ("NAME=value", later entries win). uid/gid >= 0: drop to them first (the tests run as root).
// stderr_path: where its stderr goes (appended), else the caller's. The child is SIGKILLed when
// the test dies (a ctest timeout must not leave producers or a daemon behind).
inline Child spawn(const std::vector<std::string>& argv, const std::vector<std::string>& env = {},
                   int uid = -1, int gid = -1, const std::string& stderr_path = {}) {
  std::vector<std::string> envs;
  for (char** e = environ; *e; ++e) envs.emplace_back(*e);
  for (const auto& e : env) {
    std::string key = e.substr(0, e.find('=') + 1);
    std::erase_if(envs, [&](const std::string& s) { return s.rfind(key, 0) == 0; });
    envs.push_back(e);
  }
  std::vector<char*> args, envp;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  for (const auto& e : envs) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) return {};
  int err = stderr_path.empty()
                ? -1
                : ::open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(p[1], 1);
    if (err >= 0) ::dup2(err, 2);
    if (gid >= 0 && (::setgroups(0, nullptr) != 0 || ::setgid(gid) != 0)) ::_exit(126);
    if (uid >= 0 && ::setuid(uid) != 0) ::_exit(126);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // after setuid, which clears it
    if (::getppid() != parent) ::_exit(126);
    ::execve(args[0], args.data(), envp.data());
    ::_exit(127);
  }
  ::close(p[1]);
  if (err >= 0) ::close(err);
  return {pid, p[0]};
}

// Reads one line from fd within the timeout.
inline std::string read_line(int fd, std::chrono::milliseconds timeout) {
  std::string line;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return line;
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, static_cast<int>(left.count())) <= 0) return line;
    char c;
    if (::read(fd, &c, 1) != 1) return line;
    if (c == '\n') return line;
    line += c;
  }
}

// Runs a command to completion; returns {exit status, stdout}.
inline std::pair<int, std::string> run(const std::vector<std::string>& argv, int uid = -1,
                                       int gid = -1) {
  Child c = spawn(argv, {}, uid, gid);
  std::string out;
  char buf[65536];
  ssize_t n;
  while ((n = ::read(c.out, buf, sizeof buf)) > 0) out.append(buf, static_cast<std::size_t>(n));
  ::close(c.out);
  int status = 0;
  ::waitpid(c.pid, &status, 0);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), out};
}

#ifdef PRELOAD  // tests that run no producers are built without the preload paths
// The environment that runs preload_producer under libgpustitch.so on two simulated devices of
// 1 GiB, publishing every publish_ms into records named prefix.*.
// conf: more GPUSTITCH_CONF keys, after (and so over) these.
inline std::vector<std::string> producer_env(const std::string& prefix, unsigned publish_ms = 20,
                                             const std::string& conf = "") {
  return {std::string("LD_PRELOAD=") + PRELOAD, std::string("LD_LIBRARY_PATH=") + CUDA_LIB_PATH,
          "GPUSTITCH_CONF=backend:sim,sim_devices:2,sim_capacity_mb:1024,publish_interval_ms:" +
              std::to_string(publish_ms) + (conf.empty() ? "" : "," + conf),
          "GPUSTITCH_SHM_PREFIX=" + prefix};
}

// Starts preload_producer with args; its pid once it printed "READY <pid>", else -1 (the child
// is then killed and reaped).
inline Child start_producer(const std::string& prefix, const std::vector<std::string>& args,
                            int uid = -1, int gid = -1, const std::string& conf = "") {
  std::vector<std::string> argv{PRELOAD_PRODUCER};
  argv.insert(argv.end(), args.begin(), args.end());
  Child c = spawn(argv, producer_env(prefix, 20, conf), uid, gid);
  if (c.pid <= 0) return c;
  if (read_line(c.out, 10000ms) != "READY " + std::to_string(c.pid)) {
    ::kill(c.pid, SIGKILL);
    ::waitpid(c.pid, nullptr, 0);
    ::close(c.out);
    return {};
  }
  return c;
}

#endif

// SIGKILLs, reaps and forgets a child.
inline void kill_child(Child& c) {
  if (c.pid > 0) {
    ::kill(c.pid, SIGKILL);
    ::waitpid(c.pid, nullptr, 0);
  }
  if (c.out >= 0) ::close(c.out);
  c = {};
}

}  // namespace gpustitch::test
