// gpustitch: the companion CLI. Subcommands register themselves (see command.h).
#include <algorithm>
#include <iostream>
#include <map>

#include "command.h"
#include "terminal_text.h"

namespace gpustitch::cli {
std::vector<CommandSpec>& registry() {
  static std::vector<CommandSpec> commands;
  return commands;
}
namespace {
// Prints "gpustitch SUB: WHAT" for an option value the parser refused; returns kUsage.
int usage_error(const CLI::App& app, const CLI::ParseError& e) {
  std::string name;
  for (const CLI::App* sub : app.get_subcommands())  // the subcommands given on the line
    name = sub->get_name();
  std::cerr << "gpustitch" << (name.empty() ? "" : " " + name) << ": " << terminal_text(e.what())
            << "\n";
  return kUsage;
}
}  // namespace
}  // namespace gpustitch::cli

int main(int argc, char** argv) {
  using namespace gpustitch::cli;
  CLI::App app{"gpustitch: a GPU allocator that stitches scattered free memory, and its tools"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string(GPUSTITCH_VERSION));
  GlobalOptions global;
  auto& commands = registry();
  std::sort(commands.begin(), commands.end(),
            [](const CommandSpec& a, const CommandSpec& b) { return a.name < b.name; });
  std::map<CLI::App*, std::function<int()>> runners;
  for (auto& spec : commands) {
    CLI::App* sub = app.add_subcommand(spec.name, spec.description);
    sub->add_flag("--json", global.json, "Print machine-readable JSON");
    runners[sub] = spec.setup(*sub, global);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ValidationError& e) {
    // A value the command cannot use (number_checks.h): one line naming the command and the
    // option, as the errors a command finds itself, and nothing else (a script reads one line).
    return usage_error(app, e);
  } catch (const CLI::ConversionError& e) {
    return usage_error(app, e);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? kOk : kUsage;
  }
  // Whatever a command meets (a daemon's answer of the wrong shape, input that is not UTF-8, no
  // memory), the CLI ends with one line and a status, never with a signal.
  for (auto& [sub, run] : runners) {
    if (!sub->parsed()) continue;
    try {
      return run();
    } catch (const std::exception& e) {
      std::cerr << "gpustitch " << sub->get_name() << ": " << terminal_text(e.what()) << "\n";
      return kProblem;
    } catch (...) {
      std::cerr << "gpustitch " << sub->get_name() << ": unexpected error\n";
      return kProblem;
    }
  }
  return kUsage;
}
