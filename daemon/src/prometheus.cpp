#include "prometheus.h"

#include <fmt/format.h>

#include "gpustitch/shm/json.h"
#include "gpustitch/shm/metrics.h"

namespace gpustitch::daemon {

std::string escape_label(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '"')
      out += "\\\"";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

std::string format_prometheus(const ProcessTable& table) {
  struct Series {
    std::string labels;
    const shm::DeviceCounters* counters;
  };
  std::vector<Series> series;
  std::size_t processes = 0;
  for (const auto& [pid, p] : table.processes()) {
    if (!p.have_snapshot) continue;
    ++processes;
    std::string command = p.reader.identity().cmdline.substr(0, 128);
    for (const auto& d : p.snapshot.devices) {
      series.push_back(
          {fmt::format("pid=\"{}\",device=\"{}\",uuid=\"{}\",user=\"{}\",command=\"{}\"", pid,
                       d.ordinal, escape_label(shm::uuid_string(d.uuid)), escape_label(p.user),
                       escape_label(command)),
           &d});
    }
  }
  std::string out;
  out.reserve(256 + series.size() * 24 * 160);
  for (const auto& m : shm::kMetrics) {
    const char* type = m.kind == shm::MetricKind::gauge ? "gauge" : "counter";
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", m.name, m.help, m.name, type);
    if (std::string_view(m.name) == shm::kProcessesMetric) {
      out += fmt::format("{} {}\n", m.name, processes);
      continue;
    }
    for (const auto& s : series) {
      if (m.field)
        out += fmt::format("{}{{{}}} {}\n", m.name, s.labels, s.counters->*(m.field));
      else
        out += fmt::format("{}{{{}}} {:.6f}\n", m.name, s.labels, s.counters->fragmentation());
    }
  }
  return out;
}

}  // namespace gpustitch::daemon
