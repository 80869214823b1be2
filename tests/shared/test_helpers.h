// Helpers for the statistics tests: a per-test record prefix (so parallel runs and a real
// gpustitchd on the machine never see each other's records) and cleanup.
#pragma once

#include <dirent.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>

#include "gpustitch/shm/names.h"

namespace gpustitch::test {

// "gstest<pid>x<n>": unique per test process and call.
inline std::string unique_prefix() {
  static int n = 0;
  return "gstest" + std::to_string(::getpid()) + "x" + std::to_string(n++);
}

// Removes every /dev/shm entry with prefix (whatever the uid or file type: tests plant FIFOs
// and symlinks too).
inline void remove_records(const std::string& prefix) {
  DIR* dir = ::opendir(shm::kShmDir);
  if (!dir) return;
  while (dirent* e = ::readdir(dir)) {
    std::string n = e->d_name;
    if (n.rfind(prefix + ".", 0) == 0) ::unlink((std::string(shm::kShmDir) + "/" + n).c_str());
  }
  ::closedir(dir);
}

// Polls f every `poll` until it holds or `limit` has passed; returns f's last answer.
template <typename F>
bool eventually(F f, std::chrono::milliseconds limit = std::chrono::milliseconds(10000),
                std::chrono::milliseconds poll = std::chrono::milliseconds(50)) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (f()) return true;
    std::this_thread::sleep_for(poll);
  }
  return f();
}

struct PrefixGuard {
  std::string prefix = unique_prefix();
  ~PrefixGuard() { remove_records(prefix); }
};

}  // namespace gpustitch::test
