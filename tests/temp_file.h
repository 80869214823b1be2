// Temporary files of a test program: a path in GoogleTest's temporary directory, unique to the
// process, removed when the program exits. The CLI and trace tests write traces, plots and
// snapshots there, several MB per run, which ctest's one process per test would otherwise leave
// behind.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

namespace gpustitch::test {

// TempDir()/gpustitch_<kind>_<pid>_<name>, removed at exit (a directory with what it holds; and
// its ".tmp" sibling, which the snapshot writer renames from).
inline std::string temp_file(const std::string& kind, const std::string& name) {
  struct Created {
    std::mutex mu;
    std::vector<std::string> paths;
    pid_t owner = getpid();
    ~Created() {
      if (getpid() != owner) return;  // a forked child exiting: the files are its parent's
      std::error_code ignored;
      for (const std::string& p : paths) {
        std::filesystem::remove_all(p, ignored);  // some tests make a directory there
        std::filesystem::remove(p + ".tmp", ignored);
      }
    }
  };
  static Created created;
  std::string path =
      testing::TempDir() + "gpustitch_" + kind + "_" + std::to_string(getpid()) + "_" + name;
  std::lock_guard lock(created.mu);
  created.paths.push_back(path);
  return path;
}

}  // namespace gpustitch::test
