// Helpers for the statistics tests: a per-test record prefix (so parallel runs and a real
// gpustitchd on the machine never see each other's records) and cleanup.
#pragma once

#include <dirent.h>
#include <unistd.h>

#include <string>

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

struct PrefixGuard {
  std::string prefix = unique_prefix();
  ~PrefixGuard() { remove_records(prefix); }
};

}  // namespace gpustitch::test
