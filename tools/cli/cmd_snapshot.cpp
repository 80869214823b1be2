// gpustitch snapshot PID -o FILE.pickle: asks a process running under gpustitch for a PyTorch
// memory snapshot (the pickle pytorch.org/memory_viz reads) of its device memory: live, cached and
// waiting for reuse, segment by segment as the pool maps it.
// gpustitch snapshot --trace TRACE [--at N] -o FILE.pickle: the same from a recorded trace, with
// the allocation timeline (device_traces) for memory_viz's timeline views.
// The request channel is described in shared/trace/include/gpustitch/trace/snapshot.h.
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "bounded_file.h"
#include "command.h"
#include "gpustitch/trace/snapshot.h"
#include "gpustitch/trace/trace_reader.h"
#include "number_checks.h"
#include "terminal_text.h"

namespace gpustitch::cli {
namespace {

struct SnapshotArgs {
  int pid = 0;
  std::string output;
  std::string trace;
  std::size_t at = 0;
  unsigned timeout_ms = 5000;
};

int run_snapshot(const SnapshotArgs& a, const GlobalOptions& g) {
  std::error_code ec;
  std::string out = std::filesystem::absolute(a.output, ec).string();
  if (ec) out = a.output;
  nlohmann::json j;
  j["output"] = out;
  auto report = [&](bool ok, const std::string& why, int code) {
    j["ok"] = ok;
    if (!ok) j["error"] = why;
    if (g.json) {
      std::cout << terminal_json(j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace))
                << "\n";
    } else if (ok) {
      std::cout << "wrote " << out << " (open it at https://pytorch.org/memory_viz)\n";
    } else {
      std::cerr << "gpustitch snapshot: " << terminal_text(why) << "\n";  // may be the process's
    }
    return code;
  };
  if (!a.trace.empty()) {
    j["trace"] = a.trace;
    trace::Trace tr;
    std::string why, bytes;
    switch (replay::read_bounded_file(a.trace, replay::kMaxTraceFileBytes, &bytes, &why)) {
      case replay::BoundedRead::ok:
        break;
      case replay::BoundedRead::cannot_open:
        return report(false, why, kNotFound);
      case replay::BoundedRead::refused:
        return report(false, why, kUsage);
    }
    {
      std::istringstream text(std::move(bytes));
      tr = trace::read_trace(text);
    }
    if (tr.bad_lines) std::cerr << a.trace << ": " << tr.bad_lines << " bad lines skipped\n";
    auto data = trace::snapshot_from_trace(tr, a.at);
    j["segments"] = data.segments.size();
    if (!trace::write_pytorch_snapshot(data, out, &why)) return report(false, why, kProblem);
    return report(true, "", kOk);
  }
  if (a.pid <= 0) return report(false, "give a PID (or --trace TRACE)", kUsage);
  j["pid"] = a.pid;
  std::string why;
  if (trace::SnapshotRequests::request(a.pid, out, a.timeout_ms, &why))
    return report(true, "", kOk);
  bool missing = why.rfind("no process", 0) == 0;
  return report(false, why, missing ? kNotFound : kUnreachable);
}

Registrar reg{
    "snapshot",
    "Write a PyTorch memory snapshot (for pytorch.org/memory_viz) of a process or trace",
    [](CLI::App& app, GlobalOptions& global) {
      auto a = std::make_shared<SnapshotArgs>();
      app.add_option("pid", a->pid, "Process running under gpustitch")->check(pid_check());
      app.add_option("-o,--output", a->output, "Output file (.pickle)")->required();
      app.add_option("--trace", a->trace, "Build the snapshot from a trace instead");
      app.add_option("--at", a->at, "With --trace: state after the first N events");
      app.add_option("--timeout-ms", a->timeout_ms,
                     "How long to wait for the process (default 5000)")
          ->check(CLI::Range(1u, 3600000u));
      return [a, &global]() { return run_snapshot(*a, global); };
    }};

}  // namespace
}  // namespace gpustitch::cli
