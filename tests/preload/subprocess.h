// Runs a program with an exact environment and collects its exit status, stdout and stderr.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace subprocess {

struct Result {
  int status = -1;  // exit status, or 128 + signal
  std::string out, err;
};

inline std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// argv as started: through the emulator in a cross build whose tests run under one (qemu-user,
// CMAKE_CROSSCOMPILING_EMULATOR, compiled in as GPUSTITCH_TEST_EMULATOR by tests/CMakeLists.txt).
// qemu-user emulates one program: an execve of another foreign binary goes to the kernel, which
// cannot run it without binfmt_misc (absent in CI containers). The emulator passes the environment
// (LD_PRELOAD included) to the emulated program's loader, and the child keeps its pid.
inline std::vector<std::string> emulated(std::vector<std::string> argv) {
#ifdef GPUSTITCH_TEST_EMULATOR
  std::vector<std::string> cmd;
  std::istringstream words(GPUSTITCH_TEST_EMULATOR);
  for (std::string w; words >> w;) cmd.push_back(w);
  cmd.insert(cmd.end(), argv.begin(), argv.end());
  return cmd;
#else
  return argv;
#endif
}

// timeout_s > 0: a child still running then is killed (SIGKILL, status 137), so a test of a
// hang fails instead of hanging.
inline Result run(std::vector<std::string> argv, std::vector<std::string> env,
                  unsigned timeout_s = 0) {
  argv = emulated(std::move(argv));
  static int n = 0;
  std::string base = std::string(::testing::TempDir()) + "gpustitch_sub_" +
                     std::to_string(getpid()) + "_" + std::to_string(n++);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, (base + ".out").c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_addopen(&fa, 2, (base + ".err").c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  env.push_back("PATH=/usr/bin:/bin");
  if (const char* asan = std::getenv("ASAN_OPTIONS"))
    env.push_back(std::string("ASAN_OPTIONS=") + asan);
  std::vector<char*> envp, args;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  pid_t pid = 0;
  Result r;
  if (posix_spawn(&pid, args[0], &fa, nullptr, args.data(), envp.data()) == 0) {
    int status = 0;
    if (timeout_s == 0) {
      waitpid(pid, &status, 0);
    } else {
      for (unsigned waited_ms = 0; waitpid(pid, &status, WNOHANG) == 0; waited_ms += 10) {
        if (waited_ms >= timeout_s * 1000u) {
          kill(pid, SIGKILL);
          waitpid(pid, &status, 0);
          break;
        }
        usleep(10000);
      }
    }
    r.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  posix_spawn_file_actions_destroy(&fa);
  r.out = slurp(base + ".out");
  r.err = slurp(base + ".err");
  std::remove((base + ".out").c_str());
  std::remove((base + ".err").c_str());
  return r;
}

inline int count_lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

}  // namespace subprocess
