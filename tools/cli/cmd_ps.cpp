// gpustitch ps: one line per process and device that runs the gpustitch pool.
#include <iostream>

#include "stats_client.h"

namespace gpustitch::cli {
namespace {

struct PsOptions {
  SourceOptions source;
};

Registrar reg{
    "ps", "List processes using gpustitch: memory held, fragmentation, stitches, OOMs",
    [](CLI::App& sub, GlobalOptions& global) -> std::function<int()> {
      auto opts = std::make_shared<PsOptions>();
      add_source_options(sub, opts->source);
      sub.footer(
          "Reads from gpustitchd when it runs (every user's processes for root and the admin "
          "group), otherwise the caller's own records in /dev/shm.\nExit status: 0 listed, 3 no "
          "process, 4 daemon required (--daemon/--socket) but unreachable.");
      return [opts, &global]() {
        if (!global.json) {
          std::vector<std::vector<std::string>> rows;
          std::size_t processes = 0;
          Fetched f = fetch_table(opts->source, &rows, &processes);
          if (f.status != kOk) {
            std::cerr << "gpustitch ps: " << f.error << "\n";
            return f.status;
          }
          if (processes == 0) {
            std::cout << "no process is using gpustitch (source: " << f.source << ")\n";
            return int(kNotFound);
          }
          std::cout << format_table(rows, kProcessRowAlign, terminal_width());
          return int(kOk);
        }
        Fetched f = fetch_list(opts->source);
        if (f.status != kOk) {
          std::cerr << "gpustitch ps: " << f.error << "\n";
          return f.status;
        }
        const auto& processes = f.answer["processes"];
        print_json({{"source", f.source}, {"processes", processes}});
        return processes.empty() ? int(kNotFound) : int(kOk);
      };
    }};

}  // namespace
}  // namespace gpustitch::cli
