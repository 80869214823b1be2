#include "prometheus.h"

#include <fmt/format.h>
#include <unistd.h>

#include <map>
#include <set>

#include "gpustitch/shm/json.h"
#include "gpustitch/shm/metrics.h"

namespace gpustitch::daemon {

namespace {
// Length of the well-formed UTF-8 sequence at the start of s (RFC 3629: no overlong forms, no
// surrogates, nothing above U+10FFFF), or 0 when it is not one.
std::size_t utf8_sequence(std::string_view s) {
  auto b = [&](std::size_t i) { return static_cast<unsigned char>(s[i]); };
  unsigned char c = b(0);
  if (c < 0x80) return 1;
  std::size_t n;
  unsigned char lo = 0x80, hi = 0xBF;  // bounds of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;  // overlong
    if (c == 0xED) hi = 0x9F;  // surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;  // overlong
    if (c == 0xF4) hi = 0x8F;  // above U+10FFFF
  } else {
    return 0;
  }
  if (s.size() < n || b(1) < lo || b(1) > hi) return 0;
  for (std::size_t i = 2; i < n; ++i)
    if (b(i) < 0x80 || b(i) > 0xBF) return 0;
  return n;
}
}  // namespace

std::string escape_label(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  while (!value.empty()) {
    char c = value.front();
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else if (std::size_t n = utf8_sequence(value); n > 0) {
      out.append(value.data(), n);
      value.remove_prefix(n);
      continue;
    } else {
      // The exposition format is UTF-8 and Prometheus rejects a whole scrape over one bad label
      // (a command line in Latin-1 is enough): each byte that is not part of a well-formed
      // sequence becomes U+FFFD, as a UTF-8 decoder would show it.
      out += "\xEF\xBF\xBD";
    }
    value.remove_prefix(1);
  }
  return out;
}

namespace {

std::string node_name(const DaemonConfig& config) {
  if (!config.hostname.empty()) return config.hostname;
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return {};
  return buf;
}

// The GPU's labels: UUID always, the driver's figures where it lists the GPU, then Hostname.
std::string gpu_labels(const std::string& uuid, const shm::GpuInfo* gpu,
                       const std::string& hostname) {
  std::string out = fmt::format("UUID=\"{}\"", escape_label(uuid));
  if (gpu)
    out += fmt::format(",gpu=\"{}\",{}modelName=\"{}\",pci_bus_id=\"{}\"", gpu->index,
                       gpu->minor >= 0 ? fmt::format("device=\"nvidia{}\",", gpu->minor) : "",
                       escape_label(gpu->name), escape_label(gpu->bus_id));
  out += fmt::format(",Hostname=\"{}\"", escape_label(hostname));
  return out;
}

}  // namespace

std::string format_prometheus(const ProcessTable& table) {
  struct Series {
    std::string labels;
    const shm::DeviceCounters* counters;
  };
  // The per-GPU figures come from the process that published last on that GPU.
  struct Gpu {
    std::string labels;
    const shm::DeviceCounters* counters;
    std::uint64_t heartbeat_ns;
  };
  const std::string hostname = node_name(table.config());
  std::vector<Series> series;
  std::map<std::string, Gpu> gpus;  // by UUID text
  std::set<std::string> seen;       // label sets already exported
  std::size_t processes = 0;
  for (const auto& [pid, p] : table.processes()) {
    if (!p.have_snapshot) continue;
    ++processes;
    std::string command = p.reader.identity().cmdline;
    if (command.size() > 128) {
      // Cut at a character boundary, not inside a multi-byte sequence.
      std::size_t n = 128;
      while (n > 0 && (static_cast<unsigned char>(command[n]) & 0xC0) == 0x80) --n;
      command.resize(n);
    }
    std::string kube;
    if (p.kube) {
      kube = fmt::format(",pod_uid=\"{}\"", escape_label(p.kube->pod_uid));
      if (!p.kube->container_id.empty())
        kube += fmt::format(",container_id=\"{}\"", escape_label(p.kube->container_id));
    }
    const std::string process = fmt::format("pid=\"{}\",user=\"{}\",command=\"{}\"", pid,
                                            escape_label(p.user), escape_label(command));
    for (const auto& d : p.snapshot.devices) {
      const std::string uuid = shm::uuid_string(d.uuid);
      const shm::GpuInfo* gpu = table.gpus().find(d.uuid);
      const std::string on_gpu = gpu_labels(uuid, gpu, hostname);
      std::string labels =
          fmt::format("{},cuda_device=\"{}\",{}{}", process, d.ordinal, on_gpu, kube);
      // A record is its process's word: one that lists a device twice must not make two series
      // with one label set, for which Prometheus would reject the node's whole scrape.
      if (!seen.insert(labels).second) continue;
      series.push_back({std::move(labels), &d});
      if (uuid.empty()) continue;  // not attributable to a GPU
      auto [it, inserted] = gpus.try_emplace(uuid, Gpu{on_gpu, &d, p.snapshot.heartbeat_ns});
      if (!inserted && p.snapshot.heartbeat_ns > it->second.heartbeat_ns)
        it->second = Gpu{on_gpu, &d, p.snapshot.heartbeat_ns};
    }
  }
  std::string out;
  out.reserve(256 + series.size() * 24 * 220);
  for (const auto& m : shm::kMetrics) {
    const char* type = m.kind == shm::MetricKind::gauge ? "gauge" : "counter";
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", m.name, m.help, m.name, type);
    switch (m.scope) {
      case shm::MetricScope::node:
        out += fmt::format("{} {}\n", m.name, processes);
        break;
      case shm::MetricScope::gpu:
        for (const auto& [uuid, g] : gpus)
          out += fmt::format("{}{{{}}} {}\n", m.name, g.labels, g.counters->*(m.field));
        break;
      case shm::MetricScope::process:
        for (const auto& s : series) {
          if (m.field && m.seconds_from_ns)
            out += fmt::format("{}{{{}}} {:.9f}\n", m.name, s.labels,
                               static_cast<double>(s.counters->*(m.field)) / 1e9);
          else if (m.field)
            out += fmt::format("{}{{{}}} {}\n", m.name, s.labels, s.counters->*(m.field));
          else
            out += fmt::format("{}{{{}}} {:.6f}\n", m.name, s.labels, s.counters->fragmentation());
        }
        break;
    }
  }
  return out;
}

}  // namespace gpustitch::daemon
