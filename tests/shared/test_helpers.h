// Helpers for the statistics tests: a per-test record prefix (so parallel runs and a real
// gpustitchd on the machine never see each other's records) and cleanup.
#pragma once

#include <unistd.h>

#include <string>

#include "gpustitch/shm/names.h"

namespace gpustitch::test {

// "gstest<pid>x<n>": unique per test process and call.
inline std::string unique_prefix() {
  static int n = 0;
  return "gstest" + std::to_string(::getpid()) + "x" + std::to_string(n++);
}

// Removes every record with prefix (whatever the uid).
inline void remove_records(const std::string& prefix) {
  for (const auto& name : shm::discover_records(prefix)) ::unlink(name.path().c_str());
}

struct PrefixGuard {
  std::string prefix = unique_prefix();
  ~PrefixGuard() { remove_records(prefix); }
};

}  // namespace gpustitch::test
