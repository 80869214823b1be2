// Subcommand registry of the gpustitch CLI. Each subcommand lives in its own cmd_*.cpp and
// registers itself with a static Registrar, so commands are added without touching main.cpp.
//
//   static gpustitch::cli::Registrar reg{"ps", [](CLI::App& app) { ...; return run_fn; }};
//
// Exit codes (documented in README): 0 success, 1 the command ran and found a problem (doctor
// failures, OOMs in demo when asked to fail on them), 2 usage error, 3 nothing to show / process
// not found, 4 the daemon or a record could not be reached/read.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace gpustitch::cli {

enum ExitCode : int { kOk = 0, kProblem = 1, kUsage = 2, kNotFound = 3, kUnreachable = 4 };

// Options common to every subcommand.
struct GlobalOptions {
  bool json = false;
};

// A setup function adds options to the subcommand and returns the function that runs it.
using Setup = std::function<std::function<int()>(CLI::App& sub, GlobalOptions& global)>;

struct CommandSpec {
  std::string name;
  std::string description;
  Setup setup;
};

std::vector<CommandSpec>& registry();

struct Registrar {
  Registrar(std::string name, std::string description, Setup setup) {
    registry().push_back({std::move(name), std::move(description), std::move(setup)});
  }
};

}  // namespace gpustitch::cli
